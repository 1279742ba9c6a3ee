"""Stage 2 distillation losses over cached teacher distributions.

Standalone functions, called by the trainer on one micro-batch in the format of the "Stage 2
batch" table of docs/architecture.md. Every loss returns a `LossSum`: the SUM of its per-chunk
(or per-token) terms plus how many terms were summed. The trainer all-reduces the counts once per
optimizer step and divides, so chunks weigh the same whatever micro-batch, accumulation step or
data-parallel rank they came from.

Memory: the student logits `[N, V]` (bf16 or fp32) are never copied to fp32 as a whole. The
log-partition, the gathered support columns and the projected probabilities are computed in
blocks of `row_chunk` positions, and backward recomputes each block's softmax instead of keeping
it (one custom autograd function for support log-probs and projections, `_StudentTerms`, which
writes a single logits-sized gradient buffer; `fuse_cross_entropy` folds the trainer's CE into it).
KD math runs in fp32 (fp64 when the logits are fp64, which the gradient tests use).

    from stage2_student import losses
    kd = losses.topk_forward_kl(logits, rows, batch["teacher_ids"], batch["teacher_logprobs"],
                                batch["teacher_residual"], temperature=2.0)
    loss = kd.total / global_chunk_count
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import Tensor

from xtcache.errors import ProjectionError, XtcacheError

ROW_CHUNK = 1024
PROB_FLOOR = 1e-12  # probabilities are floored here before a log (a teacher rest of exactly 0 stays 0)
_LN2 = math.log(2.0)


class NoValidChunksError(XtcacheError):
    """A micro-batch reached the loss without a single valid chunk."""


class EmptyMappedSupportError(ProjectionError):
    """No student token maps (through W) onto any teacher id stored for the batch."""


class LossSum(NamedTuple):
    """A loss as a sum over `count` terms; divide by the global count to normalize."""

    total: Tensor  # scalar, fp32 (fp64 for fp64 logits)
    count: Tensor  # scalar float: number of terms in `total`


# --------------------------------------------------------------------------------------------
# numerics


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends; x is clamped to <= -1e-20 (result finite)."""
    x = x.clamp(max=-1e-20)
    near_zero = x > -_LN2
    a = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, -_LN2))))
    b = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -_LN2), x)))
    return torch.where(near_zero, a, b)


def _safe_log(p: Tensor) -> Tensor:
    return torch.log(p.clamp(min=PROB_FLOOR))


def _kl_terms(p: Tensor, log_p: Tensor, log_q: Tensor) -> Tensor:
    """p * (log p - log q) with 0 where p == 0 (no NaN in forward or backward)."""
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))


# --------------------------------------------------------------------------------------------
# student side: exact log-probs of a few columns, full-vocab log-partition, in row blocks


def _projection_entries(support: Tensor, projection: "ProjectionOperator", dtype: torch.dtype):
    """The W entries feeding each stored (row, slot) of `support` [b, K], flat over the block.

    Returns (slot [E] flat index i * K + j, row [E] = i, student id [E], weight [E]): only student ids
    with nonzero weight into a row's support appear, so nothing of size [b, V] or [b, U] is built.
    """
    flat = support.reshape(-1)
    slot = torch.nonzero(flat >= 0).squeeze(1)  # [S]
    starts = projection.crow[flat[slot]]
    lengths = projection.crow[flat[slot] + 1] - starts  # [S]
    entry_slot = torch.repeat_interleave(slot, lengths)  # [E]
    offset = torch.arange(entry_slot.numel(), device=slot.device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths)
    src = torch.repeat_interleave(starts, lengths) + offset
    return entry_slot, entry_slot // support.shape[1], projection.col[src], projection.val[src].to(dtype)


class _StudentTerms(torch.autograd.Function):
    """Student quantities of selected rows of z in one pass over the vocabulary, block by block.

    Row i (logit row rows[i], temperature 1 / inv_t[i]) yields the log-probs
    log softmax(z_i / T_i)[ids[i]] and, where a projection is given, the projected probabilities
    (W^T softmax(z_i / T_i))[support[i]] (0 at support < 0). Forward keeps only the per-row
    log-partition; backward recomputes each block's softmax s and writes every term's gradient
    into ONE logits-sized buffer:
      d/dz_i = inv_t_i [ scatter(ids_i, g_i) - s sum(g_i) + s (W g^q_i - <s, W g^q_i>) ],
    where W g^q_i is nonzero only at the student ids that map into row i's support, so the
    projection side costs O(those W entries), never a [rows, V] or [rows, |support|] product.
    The trainer folds its cross-entropy in here (see `fuse_cross_entropy`), so a KD step holds a
    single gradient buffer for the logits like a CE-only step.
    """

    @staticmethod
    def forward(ctx, logits, rows, inv_t, ids, support, projection, row_chunk):
        cdt = _compute_dtype(logits.dtype)
        m = rows.shape[0]
        out = torch.empty(ids.shape, dtype=cdt, device=logits.device)  # [M, k]
        lse = torch.empty(m, dtype=cdt, device=logits.device)  # [M]
        q = None if support is None else torch.empty(support.shape, dtype=cdt, device=logits.device)
        for s in range(0, m, row_chunk):
            e = min(s + row_chunk, m)
            z = logits[rows[s:e]].to(cdt).mul_(inv_t[s:e, None])  # [b, V]
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(1, ids[s:e]) - lse[s:e, None]
            if q is not None:  # q[i, j] = sum_s softmax(z_i)[s] W[s, support[i, j]]
                slot, row, sid, w = _projection_entries(support[s:e], projection, cdt)
                p_e = (z[row, sid] - lse[s:e][row]).exp_()  # softmax at the entries only
                q[s:e] = torch.zeros(e - s, support.shape[1], dtype=cdt, device=z.device).view(-1).index_add_(
                    0, slot, p_e * w).view(e - s, -1)
        ctx.save_for_backward(logits, rows, inv_t, ids, lse, support)
        ctx.projection, ctx.row_chunk = projection, row_chunk
        return out, q

    @staticmethod
    def backward(ctx, grad_out, grad_q):  # [M, k], [M, K] or None
        logits, rows, inv_t, ids, lse, support = ctx.saved_tensors
        cdt = lse.dtype
        grad = torch.zeros_like(logits)  # [N, V] in the logits' dtype: the only full-size buffer
        grad_out = torch.zeros(ids.shape, dtype=cdt, device=lse.device) if grad_out is None else grad_out.to(cdt)
        for s in range(0, rows.shape[0], ctx.row_chunk):
            e = min(s + ctx.row_chunk, rows.shape[0])
            p = logits[rows[s:e]].to(cdt).mul_(inv_t[s:e, None]).sub_(lse[s:e, None]).exp_()  # softmax [b, V]
            coef = -grad_out[s:e].sum(dim=-1, keepdim=True)  # [b, 1]
            g = None
            if grad_q is not None and support is not None:  # + sum_j g^q_ij (W[v, K_ij] p_v - p_v q_ij)
                slot, row, sid, w = _projection_entries(support[s:e], ctx.projection, cdt)
                if slot.numel():
                    pg = p[row, sid] * w * grad_q[s:e].to(cdt).reshape(-1)[slot]  # [E]
                    coef = coef - torch.zeros(e - s, dtype=cdt, device=p.device).index_add_(0, row, pg)[:, None]
                    g = p.mul_(coef).index_put_((row, sid), pg, accumulate=True)
            if g is None:
                g = p.mul_(coef)
            g.scatter_add_(1, ids[s:e], grad_out[s:e])
            grad.index_add_(0, rows[s:e], g.mul_(inv_t[s:e, None]).to(grad.dtype))
        return grad, None, None, None, None, None, None


def _inv_temperature(rows: Tensor, temperature: float, like: Tensor) -> Tensor:
    return torch.full(rows.shape, 1.0 / float(temperature), dtype=_compute_dtype(like.dtype), device=rows.device)


def student_support_logprobs(logits: Tensor, rows: Tensor, ids: Tensor, *, temperature: float = 1.0,
                             row_chunk: int = ROW_CHUNK) -> Tensor:
    """Exact student log-probs log softmax(z_r / T)[ids] over the full vocabulary.

    logits: [N, V] (any float dtype); rows: int64 [M] rows of `logits`; ids: int64 [M, k], negative
    ids (padding) are read as id 0 and must be masked by the caller. Returns [M, k] fp32.
    Inside `fuse_cross_entropy` for these logits, the pending cross-entropy is computed in the same pass.
    """
    ids = ids.clamp(min=0)
    fused = _pending_ce(logits)
    if fused is not None:
        return fused.run(logits, rows, ids, None, None, temperature, row_chunk)[0]
    out, _ = _StudentTerms.apply(logits, rows, _inv_temperature(rows, temperature, logits), ids, None, None,
                                 int(row_chunk))
    return out


def student_rest_logprob(log_q: Tensor) -> Tensor:
    """log(1 - sum_j exp(log_q[..., j])): the student's mass outside the support, [M]."""
    return log1mexp(torch.logsumexp(log_q, dim=-1))


# --------------------------------------------------------------------------------------------
# teacher side


def temper_teacher(logprobs: Tensor, residual: Tensor, temperature: float = 1.0, *,
                   tail: str = "ghost", vocab_size: int | None = None,
                   valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Teacher distribution at temperature T over the stored support plus one rest bucket.

    The cache stores T=1 log-probs of k ids and the residual mass r. Exact re-tempering needs the
    unstored tail, so the tail is modelled:
      tail="ghost":   the rest is ONE token with probability r: rest_T ∝ r^(1/T). For T > 1 this
                      is a lower bound of the true tempered tail mass (x^(1/T) is concave).
      tail="uniform": the rest is spread evenly over the V - k unstored ids:
                      rest_T ∝ (V - k) (r / (V - k))^(1/T), an upper bound for T > 1.
    The true value lies between the two; at T = 1 both are exact. Support and rest are then
    normalized together (this also absorbs quantization error of the stored log-probs).

    logprobs: [R, k]; residual: [R]; valid: bool [R, k], False for padding (excluded; its log-prob
    comes back as -inf). Returns (log p [R, k], p_rest [R]) in fp32; p_rest is exactly 0 where
    the residual is <= 0 (full-vocab caches). fp32 (fp64 for fp64 inputs).
    """
    cdt = _compute_dtype(logprobs.dtype)
    lp = logprobs.to(cdt) / temperature  # [R, k]
    if valid is not None:
        lp = lp.masked_fill(~valid, -math.inf)
    r = residual.to(cdt)
    has_rest = r > 0
    log_r = torch.log(r.clamp(min=PROB_FLOOR))
    if tail == "uniform":
        if vocab_size is None:
            raise ValueError("temper_teacher(tail='uniform') needs vocab_size")
        n_tail = torch.tensor(float(max(vocab_size - logprobs.shape[-1], 1)), device=lp.device)
        rest = (log_r - n_tail.log()) / temperature + n_tail.log()
    elif tail == "ghost":
        rest = log_r / temperature
    else:
        raise ValueError(f"teacher tail model {tail!r}: use 'ghost' or 'uniform'")
    rest = torch.where(has_rest, rest, torch.full_like(rest, -math.inf))  # [R]
    lse = torch.logsumexp(torch.cat([lp, rest[:, None]], dim=-1), dim=-1)  # [R]
    return lp - lse[:, None], torch.exp(rest - lse)


# --------------------------------------------------------------------------------------------
# same tokenizer: one logit row per chunk


def same_tokenizer_rows(student_chunk: Tensor, num_chunks: int) -> Tensor:
    """Flat logit position of each chunk, [C]: in same-tokenizer batches chunk c has one logit.

    student_chunk: int64 [B, L] from the batch. Raises if the batch is not 1:1.
    """
    flat = student_chunk.reshape(-1)
    pos = torch.nonzero(flat >= 0).squeeze(1)  # [C]
    if num_chunks == 0:
        raise NoValidChunksError("micro-batch has no valid chunk: windows too short (--seq-len) "
                                 "or every teacher row lacks a prediction")
    if pos.numel() != num_chunks:
        raise XtcacheError(f"batch has {pos.numel()} chunk logits for {num_chunks} chunks: not a "
                           "same-tokenizer batch; use the projected KL loss for cross-tokenizer caches")
    rows = torch.empty_like(pos)
    rows[flat[pos]] = pos
    return rows


def _topk_pair(logits, rows, teacher_ids, teacher_logprobs, teacher_residual, temperature, tail,
               row_chunk):
    """Teacher and student over support + rest: (p, log p, q, log q), each [M, k+1].

    Padded support entries (id < 0) get probability exactly 0 and a finite log (masked later),
    so no inf * 0 appears in forward or backward.
    """
    if rows.numel() == 0:
        raise NoValidChunksError("micro-batch has no valid chunk")
    logits = logits.reshape(-1, logits.shape[-1])  # [N, V]
    pad = teacher_ids < 0  # [M, k]
    log_q = student_support_logprobs(logits, rows, teacher_ids, temperature=temperature,
                                     row_chunk=row_chunk)  # [M, k]
    log_p, p_rest = temper_teacher(teacher_logprobs, teacher_residual, temperature, tail=tail,
                                   vocab_size=logits.shape[-1], valid=~pad)  # [M, k], [M]
    log_p, p_rest = log_p.to(log_q.dtype), p_rest.to(log_q.dtype)
    q_rest_log = student_rest_logprob(log_q.masked_fill(pad, -math.inf))  # [M]
    zero = torch.zeros((), dtype=log_q.dtype, device=log_q.device)
    log_p = torch.where(pad, zero, log_p)
    log_q = torch.where(pad, zero, log_q)
    p = torch.cat([torch.where(pad, zero, log_p.exp()), p_rest[:, None]], dim=-1)  # [M, k+1]
    q = torch.cat([torch.where(pad, zero, log_q.exp()), q_rest_log.exp()[:, None]], dim=-1)
    log_p_all = torch.cat([log_p, _safe_log(p_rest)[:, None]], dim=-1)  # [M, k+1]
    log_q_all = torch.cat([log_q, q_rest_log[:, None]], dim=-1)  # [M, k+1]
    return p, log_p_all, q, log_q_all


def _count(n, ref: Tensor) -> Tensor:
    return torch.as_tensor(n, dtype=ref.dtype, device=ref.device)


def topk_forward_kl(logits: Tensor, rows: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor,
                    teacher_residual: Tensor, *, temperature: float = 1.0, teacher_tail: str = "ghost",
                    row_chunk: int = ROW_CHUNK) -> LossSum:
    """Forward KL(p || q) over the stored support K plus a rest bucket, times T^2, summed over rows.

    sum_r T^2 [ sum_{v in K_r} p(v) log(p(v)/q(v)) + p_rest log(p_rest/q_rest) ], with
    q = softmax(z/T) over the FULL student vocabulary (so gathering K is exact) and
    q_rest = 1 - sum_K q; p = teacher tempered by `temper_teacher`. The rest bucket keeps the
    truncated target unbiased in mass (RS-KD; Megatron's "ghost" token). With K = whole vocab this
    is the exact KL. logits [N, V] or [B, L, V] (rows index the flattened positions, see
    `same_tokenizer_rows`); rows [M] logit row of each teacher row; teacher_* [M, k], [M].
    """
    p, log_p, _, log_q = _topk_pair(logits, rows, teacher_ids, teacher_logprobs, teacher_residual,
                                    temperature, teacher_tail, row_chunk)
    total = _kl_terms(p, log_p, log_q).sum() * temperature**2
    return LossSum(total, _count(rows.numel(), total))


def topk_reverse_kl(logits: Tensor, rows: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor,
                    teacher_residual: Tensor, *, temperature: float = 1.0, teacher_tail: str = "ghost",
                    row_chunk: int = ROW_CHUNK) -> LossSum:
    """Reverse KL(q || p) over support + rest, times T^2, summed over rows (mode seeking).

    sum_r T^2 sum_{v in K_r + rest} q(v) log(q(v)/p(v)); teacher probabilities of 0 (the rest of
    a full-vocab cache) are floored at PROB_FLOOR.
    """
    _, log_p, q, log_q = _topk_pair(logits, rows, teacher_ids, teacher_logprobs, teacher_residual,
                                    temperature, teacher_tail, row_chunk)
    total = _kl_terms(q, log_q, log_p).sum() * temperature**2
    return LossSum(total, _count(rows.numel(), total))


def topk_generalized_jsd(logits: Tensor, rows: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor,
                         teacher_residual: Tensor, *, beta: float = 0.5, temperature: float = 1.0,
                         teacher_tail: str = "ghost", row_chunk: int = ROW_CHUNK) -> LossSum:
    """Generalized Jensen-Shannon divergence over support + rest, times T^2, summed over rows.

    m = beta p + (1 - beta) q;  JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m)
    (Agarwal et al. 2024, "On-policy distillation", the form TRL's generalized_jsd_loss uses).
    beta = 0 and beta = 1 return forward KL(p || q) and reverse KL(q || p) respectively; for
    small beta JSD_beta / beta -> KL(p || q), and JSD_beta / (1 - beta) -> KL(q || p) as beta -> 1.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"--jsd-beta {beta}: must be in [0, 1]")
    if beta == 0.0:
        return topk_forward_kl(logits, rows, teacher_ids, teacher_logprobs, teacher_residual,
                               temperature=temperature, teacher_tail=teacher_tail, row_chunk=row_chunk)
    if beta == 1.0:
        return topk_reverse_kl(logits, rows, teacher_ids, teacher_logprobs, teacher_residual,
                               temperature=temperature, teacher_tail=teacher_tail, row_chunk=row_chunk)
    p, log_p, q, log_q = _topk_pair(logits, rows, teacher_ids, teacher_logprobs, teacher_residual,
                                    temperature, teacher_tail, row_chunk)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))  # [M, k+1]
    jsd = beta * _kl_terms(p, log_p, log_m) + (1.0 - beta) * _kl_terms(q, log_q, log_m)
    total = jsd.sum() * temperature**2
    return LossSum(total, _count(rows.numel(), total))


def sampled_kl(logits: Tensor, rows: Tensor, teacher_ids: Tensor, teacher_counts: Tensor, *,
               row_chunk: int = ROW_CHUNK) -> LossSum:
    """Sampled-target KL: cross-entropy against the empirical teacher distribution counts / N.

    sum_r - sum_j (c_rj / N_r) log q(v_rj), N_r = sum_j c_rj (N draws from the teacher at T=1,
    Sparse Logit Sampling / RS-KD). E[c / N] = p, so the expectation equals the full
    cross-entropy CE(p, q) = KL(p || q) + H(p); H(p) does not depend on the student, so the
    gradient is an unbiased estimate of the full-KL gradient. Draws are at T=1, so there is no
    temperature. teacher_counts [M, k] (0 = padding, whatever the padded id).
    """
    if rows.numel() == 0:
        raise NoValidChunksError("micro-batch has no valid chunk")
    counts = teacher_counts.float()  # [M, k]
    logits = logits.reshape(-1, logits.shape[-1])  # [N, V]
    log_q = student_support_logprobs(logits, rows, teacher_ids, row_chunk=row_chunk)  # [M, k]
    n = counts.sum(dim=-1, keepdim=True).clamp(min=1.0)  # [M, 1]
    total = -((counts / n).to(log_q.dtype) * log_q).sum()
    return LossSum(total, _count(rows.numel(), total))


# --------------------------------------------------------------------------------------------
# student cross-entropy


def cross_entropy(logits: Tensor, labels: Tensor, *, row_chunk: int = ROW_CHUNK) -> LossSum:
    """Next-token cross-entropy on the student's own tokens, summed: -sum_i log q(labels_i).

    logits [B, L, V] or [N, V]; labels [B, L] or [N], already shifted, -100 = ignore.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat = labels.reshape(-1)
    rows = torch.nonzero(flat != -100).squeeze(1)  # [M]
    log_q = student_support_logprobs(flat_logits, rows, flat[rows, None], row_chunk=row_chunk)  # [M, 1]
    total = -log_q.sum()
    return LossSum(total, _count(rows.numel(), total))


class _PendingCE:
    """The trainer's cross-entropy, waiting to be computed in the next KD pass over the same logits."""

    def __init__(self, logits: Tensor, labels: Tensor):
        self.logits, self.labels = logits, labels.reshape(-1)
        self.result: LossSum | None = None  # set once a KD pass has computed it

    def matches(self, flat_logits: Tensor) -> bool:
        a, b = self.logits, flat_logits
        return (self.result is None and a.is_contiguous() and b.is_contiguous() and a.numel() == b.numel()
                and a.shape[-1] == b.shape[-1] and a.data_ptr() == b.data_ptr())

    def run(self, logits, rows, ids, support, projection, temperature, row_chunk):
        """The KD's `_StudentTerms` outputs for (rows, ids, support), with CE rows added to the pass.

        At T = 1 with distinct KD rows, a position both losses use is one row (one log-partition,
        one softmax in backward); otherwise CE rows are appended at T = 1.
        """
        ce_rows = torch.nonzero(self.labels != -100).squeeze(1)  # [Mc]
        m, k, mc = rows.numel(), ids.shape[1], ce_rows.numel()
        if float(temperature) == 1.0 and torch.unique(rows).numel() == m:
            all_rows, at = torch.unique(torch.cat([rows, ce_rows]), return_inverse=True)
            inv_t = torch.ones(all_rows.shape, dtype=_compute_dtype(logits.dtype), device=rows.device)
        else:
            all_rows, at = torch.cat([rows, ce_rows]), torch.arange(m + mc, device=rows.device)
            inv_t = torch.cat([_inv_temperature(rows, temperature, logits), _inv_temperature(ce_rows, 1.0, logits)])
        kd_at, ce_at = at[:m], at[m:]
        all_ids = torch.zeros((all_rows.numel(), k + 1), dtype=torch.int64, device=rows.device)
        all_ids[kd_at, :k] = ids
        all_ids[ce_at, k] = self.labels[ce_rows]
        all_support = None
        if support is not None:
            all_support = torch.full((all_rows.numel(), support.shape[1]), -1, dtype=support.dtype,
                                     device=support.device)
            all_support[kd_at] = support
        out, q = _StudentTerms.apply(logits, all_rows, inv_t, all_ids, all_support, projection, int(row_chunk))
        total = -out[ce_at, k].sum()
        self.result = LossSum(total, _count(mc, total))
        return out[kd_at, :k], None if q is None else q[kd_at]


_PENDING_CE: ContextVar[_PendingCE | None] = ContextVar("xtcache_pending_ce", default=None)


def _pending_ce(flat_logits: Tensor) -> _PendingCE | None:
    pending = _PENDING_CE.get()
    return pending if pending is not None and pending.matches(flat_logits) else None


@contextmanager
def fuse_cross_entropy(logits: Tensor, labels: Tensor):
    """Compute `cross_entropy(logits, labels)` inside the next KD loss called on these logits.

        with losses.fuse_cross_entropy(logits, labels) as fused:
            kd = kd_loss(logits, batch)
        ce = fused.result if fused.result is not None else losses.cross_entropy(logits, labels)

    The KD pass gathers each labelled position's label next to its KD columns, so CE and KD share
    the pass over the vocabulary and, above all, ONE logits-sized gradient buffer in backward
    (separate losses allocate one each). Values and gradients equal the separate computation.
    `fused.result` stays None when the KD loss made no pass over these logits.
    """
    token = _PENDING_CE.set(_PendingCE(logits, labels))
    try:
        yield _PENDING_CE.get()
    finally:
        _PENDING_CE.reset(token)


# --------------------------------------------------------------------------------------------
# cross tokenizer


class ProjectionOperator:
    """The projection W (student vocab -> teacher vocab) kept as W^T in CSR form.

    Built once per run from `ProjectionMap.to_torch_sparse(teacher_vocab)` (sparse [V_s, V_t],
    rows summing to 1). Only the columns of W for the teacher ids a batch stores are ever
    gathered; W is never made dense.
    """

    def __init__(self, w: Tensor):
        w = w.to_sparse_coo().coalesce() if w.layout != torch.sparse_coo else w.coalesce()
        self.student_vocab, self.teacher_vocab = int(w.shape[0]), int(w.shape[1])
        s, t = w.indices()
        val = w.values().float()
        order = torch.argsort(t * self.student_vocab + s)
        s, t, val = s[order], t[order], val[order]
        self.crow = torch.zeros(self.teacher_vocab + 1, dtype=torch.int64, device=w.device)
        self.crow[1:] = torch.cumsum(torch.bincount(t, minlength=self.teacher_vocab), 0)
        self.col, self.val = s, val  # [nnz] student ids, weights; grouped by teacher id
        # most-weighted teacher id of every student token (for top-1 agreement), -1 if unmapped
        by_w = torch.argsort(val, descending=True, stable=True)
        by_s = by_w[torch.argsort(s[by_w], stable=True)]
        first = torch.ones_like(by_s, dtype=torch.bool)
        first[1:] = s[by_s][1:] != s[by_s][:-1]
        self.student_top = torch.full((self.student_vocab,), -1, dtype=torch.int64, device=w.device)
        self.student_top[s[by_s][first]] = t[by_s][first]

    def to(self, device) -> "ProjectionOperator":
        for name in ("crow", "col", "val", "student_top"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def columns(self, teacher_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """W[:, teacher_ids]^T as a sparse COO [U, V_s] (teacher_ids: unique int64 [U])."""
        starts, ends = self.crow[teacher_ids], self.crow[teacher_ids + 1]
        lengths = ends - starts  # [U]
        row = torch.repeat_interleave(torch.arange(teacher_ids.numel(), device=lengths.device), lengths)
        offset = torch.arange(row.numel(), device=row.device) - (torch.cumsum(lengths, 0) - lengths)[row]
        src = starts[row] + offset  # [nnz_U]
        return torch.sparse_coo_tensor(torch.stack([row, self.col[src]]), self.val[src].to(dtype),
                                       (teacher_ids.numel(), self.student_vocab), is_coalesced=True,
                                       check_invariants=False)

    def mapped_count(self, teacher_ids: Tensor) -> Tensor:
        """How many W entries point at the given teacher ids (0 = nothing maps there)."""
        return (self.crow[teacher_ids + 1] - self.crow[teacher_ids]).sum()


def chunk_teacher_distribution(teacher_ids: Tensor, teacher_logprobs: Tensor, teacher_residual: Tensor,
                               teacher_chunk: Tensor, num_chunks: int, *, temperature: float = 1.0,
                               teacher_tail: str = "ghost", vocab_size: int | None = None):
    """Chunk-averaged teacher distribution over the union support of each chunk's rows.

    p_c(v) = mean_{t in T_c} p_t(v) (p_t(v) = 0 outside row t's stored support), p_c(rest) =
    mean_t p_t(rest) = 1 - sum_v p_c(v). Returns (support int64 [C, K] padded with -1,
    p [C, K], p_rest [C], fp32 or fp64 like `temper_teacher`).
    """
    valid = teacher_ids >= 0  # [R, k]
    log_p, p_rest = temper_teacher(teacher_logprobs, teacher_residual, temperature, tail=teacher_tail,
                                   vocab_size=vocab_size, valid=valid)  # [R, k], [R]
    rows_per_chunk = torch.bincount(teacher_chunk, minlength=num_chunks).clamp(min=1)  # [C]
    chunk_of = teacher_chunk[:, None].expand_as(teacher_ids)[valid]  # [nnz]
    width = int(teacher_ids.max().item()) + 1 if teacher_ids.numel() else 1
    keys, inverse = torch.unique(chunk_of * width + teacher_ids[valid], return_inverse=True)  # [U]
    key_chunk = keys // width
    per_chunk = torch.bincount(key_chunk, minlength=num_chunks)  # [C]
    slot = torch.arange(keys.numel(), device=keys.device) - (torch.cumsum(per_chunk, 0) - per_chunk)[key_chunk]
    k_max = int(per_chunk.max().item()) if keys.numel() else 1
    support = torch.full((num_chunks, k_max), -1, dtype=torch.int64, device=keys.device)
    support[key_chunk, slot] = keys % width
    p = torch.zeros((num_chunks, k_max), dtype=log_p.dtype, device=keys.device)
    weight = (log_p.exp()[valid] / rows_per_chunk[chunk_of])  # [nnz]
    p.index_put_((key_chunk[inverse], slot[inverse]), weight, accumulate=True)
    rest = torch.zeros(num_chunks, dtype=log_p.dtype, device=keys.device)
    rest.index_add_(0, teacher_chunk, p_rest / rows_per_chunk[teacher_chunk])
    return support, p, rest


def projected_kl(logits: Tensor, student_chunk: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor,
                 teacher_residual: Tensor, teacher_chunk: Tensor, num_chunks: int,
                 projection: ProjectionOperator, *, temperature: float = 1.0, teacher_tail: str = "ghost",
                 row_chunk: int = ROW_CHUNK) -> LossSum:
    """Projected KL (P-KL, NeMo-RL's cross-tokenizer loss) with a rest bucket, summed over chunks.

    For chunk c with student logit positions S_c and teacher rows T_c:
      q_i   = W^T softmax(z_i / T) restricted to K_c (the union of T_c's stored ids), i in S_c
      q_c   = mean_{i in S_c} q_i,            q_c(rest) = 1 - sum_{K_c} q_c
      p_c   = mean_{t in T_c} p_t over K_c,   p_c(rest) = mean_t p_t(rest)
      L     = T^2 sum_c sum_{v in K_c + rest} p_c(v) log(p_c(v) / q_c(v))
    NeMo-RL averages teacher log-probs over the full vocabulary; a cache knows only each row's
    top-k, so probabilities are averaged (missing entries count 0; their mass stays in the rest).
    Projected probabilities below PROB_FLOOR are floored (ids nothing maps to give a constant).
    logits [B, L, V_s] or [N, V_s]; student_chunk [B, L] or [N]; teacher_* [R, k], [R].
    """
    if num_chunks == 0:
        raise NoValidChunksError("micro-batch has no valid chunk: windows too short (--seq-len) "
                                 "or every teacher row lacks a prediction")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_chunk = student_chunk.reshape(-1)
    pos = torch.nonzero(flat_chunk >= 0).squeeze(1)  # [P]
    pos_chunk = flat_chunk[pos]  # [P]
    support, p_c, p_rest = chunk_teacher_distribution(
        teacher_ids, teacher_logprobs, teacher_residual, teacher_chunk, num_chunks,
        temperature=temperature, teacher_tail=teacher_tail, vocab_size=projection.teacher_vocab)
    stored = support[support >= 0]
    if int(projection.mapped_count(torch.unique(stored)).item()) == 0:
        raise EmptyMappedSupportError(
            "no student token maps onto any teacher id stored for this batch: the projection map "
            "was built for other tokenizers or is empty; check `xtcache projection inspect`")
    pos_support = support[pos_chunk]  # [P, K]
    no_ids = torch.zeros((pos.numel(), 0), dtype=torch.int64, device=pos.device)  # only projections here
    fused = _pending_ce(flat_logits)
    if fused is not None:
        _, q_pos = fused.run(flat_logits, pos, no_ids, pos_support, projection, temperature, row_chunk)
    else:
        _, q_pos = _StudentTerms.apply(flat_logits, pos, _inv_temperature(pos, temperature, flat_logits), no_ids,
                                       pos_support, projection, int(row_chunk))  # [P, K]
    n_pos = torch.bincount(pos_chunk, minlength=num_chunks).clamp(min=1).to(q_pos.dtype)  # [C]
    q_c = torch.zeros((num_chunks, support.shape[1]), dtype=q_pos.dtype, device=q_pos.device)
    q_c = q_c.index_add(0, pos_chunk, q_pos) / n_pos[:, None]  # [C, K]
    q_rest = 1.0 - q_c.sum(dim=-1)  # [C]
    p = torch.cat([p_c, p_rest[:, None]], dim=-1).to(q_c.dtype)  # [C, K+1]
    q = torch.cat([q_c, q_rest[:, None]], dim=-1)  # [C, K+1]
    total = _kl_terms(p, _safe_log(p), _safe_log(q)).sum() * temperature**2
    return LossSum(total, _count(num_chunks, total))


def chunk_likelihood_loss(logits: Tensor, labels: Tensor, student_chunk: Tensor, teacher_realized: Tensor,
                          teacher_chunk: Tensor, num_chunks: int, *, tau: float = 100.0,
                          row_chunk: int = ROW_CHUNK) -> LossSum:
    """ALM chunk-likelihood loss (tokenkit, Minixhofer et al. 2025), summed over chunks.

    log P_X(c) = sum of the realized tokens' log-probs of chunk c on side X (teacher: stored
    `teacher_realized`; student: log q(labels) at the chunk's logit positions);
    a = exp(log P_T(c) / tau), b = exp(log P_S(c) / tau),
    loss_c = -[a log b + (1 - a) log(1 - b)], with log(1 - b) = log1mexp(log P_S / tau).
    """
    if num_chunks == 0:
        raise NoValidChunksError("micro-batch has no valid chunk")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_chunk = student_chunk.reshape(-1)
    flat_labels = labels.reshape(-1)
    pos = torch.nonzero(flat_chunk >= 0).squeeze(1)  # [P]
    log_q = student_support_logprobs(flat_logits, pos, flat_labels[pos, None], row_chunk=row_chunk)[:, 0]
    log_ps = torch.zeros(num_chunks, dtype=log_q.dtype, device=log_q.device).index_add(
        0, flat_chunk[pos], log_q)  # [C]
    log_pt = torch.zeros(num_chunks, dtype=log_q.dtype, device=log_q.device).index_add(
        0, teacher_chunk, teacher_realized.to(log_q.dtype))  # [C]
    a = torch.exp(log_pt / tau)
    log_b = (log_ps / tau).clamp(max=-1e-20)
    total = -(a * log_b + (1.0 - a) * log1mexp(log_b)).sum()
    return LossSum(total, _count(num_chunks, total))


# --------------------------------------------------------------------------------------------
# combination and metrics


def combine_losses(kd: Tensor, ce: Tensor, *, w_kd: float = 1.0, w_ce: float = 0.1,
                   dynamic: bool = False) -> Tensor:
    """L = w_kd * s * KD + w_ce * CE on already-normalized losses.

    s = 1 (fixed weights, NeMo-RL defaults 1.0 / 0.1) or, with `dynamic`, the CE-matched scale
    s = stopgrad(|CE| / |KD|), so KD contributes CE's magnitude whatever its own scale.
    """
    if not dynamic:
        return w_kd * kd + w_ce * ce
    scale = (ce.detach().abs() / kd.detach().abs().clamp(min=1e-12))
    return w_kd * scale * kd + w_ce * ce


@torch.no_grad()
def top1_agreement(logits: Tensor, student_chunk: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor,
                   teacher_chunk: Tensor, num_chunks: int, *, student_to_teacher: Tensor | None = None
                   ) -> tuple[Tensor, Tensor]:
    """(agreeing chunks, chunks): student argmax at a chunk's first logit, mapped into the teacher
    vocabulary (`ProjectionOperator.student_top`, identity if None), vs the teacher's top-1 at the
    chunk's first row. Sampled caches: pass the counts as `teacher_logprobs` (argmax = mode).
    """
    flat_chunk = student_chunk.reshape(-1)
    pos = torch.nonzero(flat_chunk >= 0).squeeze(1)
    first_pos = torch.full((num_chunks,), -1, dtype=torch.int64, device=pos.device)
    first_pos.scatter_reduce_(0, flat_chunk[pos], pos, reduce="amin", include_self=False)
    arg = logits.reshape(-1, logits.shape[-1])[first_pos].argmax(dim=-1)  # [C]
    if student_to_teacher is not None:
        arg = student_to_teacher[arg]
    first_row = torch.full((num_chunks,), teacher_chunk.numel(), dtype=torch.int64, device=pos.device)
    rows = torch.arange(teacher_chunk.numel(), device=pos.device)
    first_row.scatter_reduce_(0, teacher_chunk, rows, reduce="amin", include_self=True)
    scores = teacher_logprobs[first_row].float().masked_fill(teacher_ids[first_row] < 0, -math.inf)
    top = teacher_ids[first_row].gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
    return (arg == top).sum().float(), torch.tensor(float(num_chunks), device=pos.device)


def valid_chunk_share(student_chunk: Tensor, labels: Tensor) -> float:
    """Share of the student's labelled (predicting) positions that lie in a valid chunk."""
    labelled = (labels != -100)
    return float(((student_chunk >= 0) & labelled).sum()) / max(int(labelled.sum()), 1)


def make_kd_loss(loss: str, *, temperature: float = 1.0, jsd_beta: float = 0.5, alm_tau: float = 100.0,
                 projection: ProjectionOperator | None = None, teacher_tail: str = "ghost",
                 row_chunk: int = ROW_CHUNK):
    """The trainer's KD term: a function (logits [B, L, V], batch) -> summed loss over valid chunks.

    loss: kl | rkl | jsd | sampled (same tokenizer, 1:1 chunks), pkl (needs `projection`) or alm.
    """
    if loss == "pkl" and projection is None:
        raise ProjectionError("--loss pkl needs a projection map (--projection, or built from both tokenizers)")
    if loss not in ("kl", "rkl", "jsd", "sampled", "pkl", "alm"):
        raise ValueError(f"--loss {loss!r}: use kl, rkl, jsd, sampled, pkl or alm")

    def kd(logits: Tensor, b: dict) -> Tensor:
        c = int(b["num_chunks"])
        if loss == "pkl":
            return projected_kl(logits, b["student_chunk"], b["teacher_ids"], b["teacher_logprobs"],
                                b["teacher_residual"], b["teacher_chunk"], c, projection, temperature=temperature,
                                teacher_tail=teacher_tail, row_chunk=row_chunk).total
        if loss == "alm":
            return chunk_likelihood_loss(logits, b["labels"], b["student_chunk"], b["teacher_realized"],
                                         b["teacher_chunk"], c, tau=alm_tau, row_chunk=row_chunk).total
        flat = logits.reshape(-1, logits.shape[-1])  # [B*L, V]
        rows = same_tokenizer_rows(b["student_chunk"], c)[b["teacher_chunk"]]  # logit row of each teacher row
        if loss == "sampled":
            return sampled_kl(flat, rows, b["teacher_ids"], b["teacher_counts"], row_chunk=row_chunk).total
        args = (flat, rows, b["teacher_ids"], b["teacher_logprobs"], b["teacher_residual"])
        kw = dict(temperature=temperature, teacher_tail=teacher_tail, row_chunk=row_chunk)
        if loss == "kl":
            return topk_forward_kl(*args, **kw).total
        if loss == "rkl":
            return topk_reverse_kl(*args, **kw).total
        return topk_generalized_jsd(*args, beta=jsd_beta, **kw).total

    return kd

