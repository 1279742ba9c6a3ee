"""Stage 2 distillation losses: the math of one block of student rows, as pure functions.

`stage2_student.objective.Objective` cuts a micro-batch into blocks of student logit rows, calls
these functions on one block at a time (fp32, fp64 for fp64 logits) and recomputes them in
backward (docs/losses.md, "Memory"). Each function states its formula; tensor shapes are in the
comments. Nothing here reads a tensor back to the host.

The student's mass outside a support (the "rest bucket") is never `1 - sum(q)`: that subtraction
loses every digit when the student puts less than ~1e-6 outside the support. It is the
log-sum-exp of the logits outside the support (`rest_logprob`), exact at any outside mass.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from torch import Tensor

from xtcache.errors import ProjectionError, XtcacheError

PROB_FLOOR = 1e-12  # probabilities are floored here before a log (a teacher rest of exactly 0 stays 0)
LOG_FLOOR = math.log(PROB_FLOOR)
_LN2 = math.log(2.0)


class NoValidChunksError(XtcacheError):
    """A micro-batch reached the loss without a single valid chunk."""


class EmptyMappedSupportError(ProjectionError):
    """No student token maps (through W) onto any teacher id stored for the batch."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss math runs in: fp64 for fp64 logits (the gradient tests), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends; x is clamped to <= -1e-20 (result finite)."""
    x = x.clamp(max=-1e-20)
    near_zero = x > -_LN2
    a = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, -_LN2))))
    b = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -_LN2), x)))
    return torch.where(near_zero, a, b)


# --------------------------------------------------------------------------------------------
# teacher side


def teacher_logprobs(ids: Tensor, logprobs: Tensor | None, counts: Tensor | None, residual: Tensor | None,
                     dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The teacher row distribution at T = 1 over its stored ids: (log p [R, k], residual [R]).

    top-k / full caches: the stored log-probs and residual. Sampled caches: the empirical
    distribution counts / N with residual 0 (E[counts / N] = p: an unbiased estimate of the
    teacher, as in RS-KD). Headtail caches (log-probs and counts both given, laid out by
    `batches.build_micro_batch`: the head's slots first with their log-probs and count 0, then the
    tail's with their counts and log-prob -inf): the head exact, each tail id R c_j / n (R = the
    stored tail mass, n = the row's tail draws), residual 0: E[R c_j / n] = R p_j / R = p_j, so this
    estimate is unbiased too (docs/losses.md states its variance). Padding (id < 0) gets log p = -inf.
    """
    if counts is None:
        lp = logprobs.to(dtype).masked_fill(ids < 0, -math.inf)
        return lp, residual.to(dtype)
    c = counts.to(dtype).masked_fill(ids < 0, 0.0)  # [R, k]
    n = c.sum(dim=-1, keepdim=True).clamp(min=1.0)
    zero = torch.zeros(c.shape[0], dtype=dtype, device=c.device)
    if logprobs is None:  # sampled
        lp = torch.where(c > 0, torch.log(c.clamp(min=1.0) / n), torch.full_like(c, -math.inf))
        return lp, zero
    # headtail: log(R c / n) on tail slots (-inf where R = 0), the stored log-prob on head slots
    log_r = torch.log(residual.to(dtype).clamp(min=0.0))[:, None]  # [R, 1]
    tail = log_r + torch.log(c.clamp(min=1.0) / n)  # [R, k]
    head = logprobs.to(dtype).masked_fill(ids < 0, -math.inf)
    return torch.where(c > 0, tail, head), zero


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
    comes back as -inf). Returns (log p [R, k], p_rest [R]); p_rest is exactly 0 where the
    residual is <= 0 (full-vocab caches). fp32 (fp64 for fp64 inputs).
    """
    cdt = compute_dtype(logprobs.dtype)
    lp = logprobs.to(cdt) if temperature == 1.0 else logprobs.to(cdt) / temperature  # [R, k]
    if valid is not None:
        lp = lp.masked_fill(~valid, -math.inf)
    r = residual.to(cdt)
    has_rest = r > 0
    log_r = torch.log(r.clamp(min=PROB_FLOOR))
    if tail == "uniform":
        if vocab_size is None:
            raise ValueError("temper_teacher(tail='uniform') needs vocab_size")
        n_tail = math.log(float(max(vocab_size - logprobs.shape[-1], 1)))
        rest = (log_r - n_tail) / temperature + n_tail
    elif tail == "ghost":
        rest = log_r / temperature
    else:
        raise ValueError(f"teacher tail model {tail!r}: use 'ghost' or 'uniform'")
    rest = torch.where(has_rest, rest, torch.full_like(rest, -math.inf))  # [R]
    lse = torch.logaddexp(torch.logsumexp(lp, dim=-1), rest)  # [R] over support and rest, no [R, k+1] copy
    return lp - lse[:, None], torch.exp(rest - lse)


# --------------------------------------------------------------------------------------------
# student side


def safe_log(p: Tensor) -> Tensor:
    """log p with -inf at 0 and no NaN in backward."""
    pos = p > 0
    return torch.where(pos, torch.log(torch.where(pos, p, torch.ones_like(p))), torch.full_like(p, -math.inf))


def drop_unreachable_rest(log_p: Tensor, p_rest: Tensor, no_rest: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher over its support alone on rows whose student has no mass outside it (`no_rest`).

    There, the teacher's rest is mass on ids the student does not have (a full cache keeps the
    mass of the teacher lm_head's padding columns as its residual): it is dropped and the support
    renormalised, rather than a KL of +inf against a student rest of exactly 0.
    """
    drop = no_rest & (p_rest > 0)
    shift = torch.where(drop, torch.log1p(-p_rest.clamp(max=1.0 - 1e-7)), torch.zeros_like(p_rest))
    return log_p - shift[:, None], torch.where(drop, torch.zeros_like(p_rest), p_rest)


def rest_logprob(z: Tensor, lse: Tensor, outside: Tensor) -> Tensor:
    """log of the student's mass outside a support, exact: logsumexp(z[outside]) - lse, [b].

    z [b, V] (already divided by T), lse [b] its log-partition, outside: either a bool mask
    [b, V] of the support (True = in the support) or a float [b, V] of log-weights added to z
    (log of the share of each student id that falls outside; -inf = none). Rows with nothing
    outside get -inf (their masked row is replaced by z first, so no NaN reaches backward).
    """
    if outside.dtype == torch.bool:
        full = outside.all(dim=-1)  # [b]
        masked = z.masked_fill(outside & ~full[:, None], -math.inf)
    else:
        full = torch.isneginf(outside).all(dim=-1)
        masked = z + outside.masked_fill(full[:, None], 0.0)
    rest = torch.logsumexp(masked, dim=-1) - lse
    return torch.where(full, torch.full_like(rest, -math.inf), rest)


def _kl_terms(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """a * (log a - log b) with 0 where a == 0 (no NaN in forward or backward)."""
    pos = a > 0
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(pos, a * (torch.where(pos, log_a, zero) - torch.where(pos, log_b, zero)), zero)


def divergence(kind: str, log_p: Tensor, log_q: Tensor, *, beta: float = 0.5) -> Tensor:
    """Per-row divergence between teacher p and student q over support + rest, [m].

    log_p, log_q: [m, n] log-probabilities over the same n buckets (-inf = probability 0).
      kl:  KL(p || q) = sum p (log p - log q)                     (forward, mass covering)
      rkl: KL(q || p) = sum q (log q - log p), log p floored at log PROB_FLOOR (mode seeking)
      jsd: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q
           (generalized JSD, Agarwal et al. 2024, the form of TRL's generalized_jsd_loss)
    """
    p = log_p.exp()
    if kind == "kl":
        return _kl_terms(p, log_p, log_q).sum(dim=-1)
    q = log_q.exp()
    if kind == "rkl":
        return _kl_terms(q, log_q, log_p.clamp(min=LOG_FLOOR)).sum(dim=-1)
    if kind == "jsd":  # -1e4: a finite stand-in for log 0 (exp underflows to 0 exactly), no NaN in backward
        lp, lq = log_p.clamp(min=-1e4), log_q.clamp(min=-1e4)
        log_m = torch.logaddexp(lp + math.log(beta), lq + math.log(1.0 - beta))  # [m, n]
        return (beta * _kl_terms(p, log_p, log_m) + (1.0 - beta) * _kl_terms(q, log_q, log_m)).sum(dim=-1)
    raise ValueError(f"divergence {kind!r}: use kl, rkl or jsd")


def chunk_likelihood(log_ps: Tensor, log_pt: Tensor, tau: float) -> Tensor:
    """ALM chunk-likelihood loss per chunk (tokenkit, Minixhofer et al. 2025), [C].

    a = exp(log P_T(c) / tau), b = exp(log P_S(c) / tau),
    loss_c = -[a log b + (1 - a) log(1 - b)], with log(1 - b) = log1mexp(log P_S / tau).
    """
    a = torch.exp(log_pt / tau)
    log_b = (log_ps / tau).clamp(max=-1e-20)
    return -(a * log_b + (1.0 - a) * log1mexp(log_b))


# --------------------------------------------------------------------------------------------
# cross tokenizer: the projection W


class ProjectionOperator:
    """The projection W (student vocab -> teacher vocab), sparse, rows summing to 1 (or empty).

    Built once per run from `ProjectionMap.to_torch_sparse(teacher_vocab)` (sparse [V_s, V_t]);
    never made dense. The loss multiplies blocks of student probabilities by W with sparse
    matmuls (`W^T p` for the projected probabilities, `W (1 - 1_K)` for the share of each student
    token's mass that falls outside a support K); `t_counts` (how many W entries point at each
    teacher id, on the host) lets the planner refuse a batch nothing maps onto; `student_top` is
    the most-weighted teacher id of every student token (-1 if unmapped), for top-1 agreement.
    """

    def __init__(self, w: Tensor):
        w = w.to_sparse_coo().coalesce() if w.layout != torch.sparse_coo else w.coalesce()
        self.student_vocab, self.teacher_vocab = int(w.shape[0]), int(w.shape[1])
        keep = w.values() > 0
        s, t = w.indices()[0][keep].cpu(), w.indices()[1][keep].cpu()
        val = w.values()[keep].detach().cpu().double()
        self.t_counts = np.bincount(t.numpy(), minlength=self.teacher_vocab)
        order = torch.argsort(s * self.teacher_vocab - val / (val.max() + 1.0), stable=True)  # heaviest first
        first = torch.ones(order.numel(), dtype=torch.bool)
        first[1:] = s[order][1:] != s[order][:-1]
        self.student_top = torch.full((self.student_vocab,), -1, dtype=torch.int64)
        self.student_top[s[order][first]] = t[order][first]
        self._indices, self._values = torch.stack([s, t]), val
        # W, W^T and `unmapped` (fp64) checked and coalesced here, on the host: on a GPU both read the
        # number of entries back, which the loss must not do (it only moves and casts them)
        idx = self._indices
        self._host = (
            torch.sparse_coo_tensor(idx, val, (self.student_vocab, self.teacher_vocab), check_invariants=True).coalesce(),
            torch.sparse_coo_tensor(idx.flip(0), val, (self.teacher_vocab, self.student_vocab),
                                    check_invariants=True).coalesce(),
            torch.ones(self.student_vocab, dtype=torch.float64).index_fill_(0, s, 0.0))
        self._device = torch.device("cpu")
        self._by_dtype: dict = {}
        self.augmented = _augmented_csr(s, t, val, self.student_vocab, self.teacher_vocab, self.t_counts)

    def to(self, device) -> "ProjectionOperator":
        """Move the operator to `device` (the trainer's; a no-op when it is there already)."""
        device = torch.device(device)
        if device != self._device:
            self._device, self._by_dtype = device, {}
            self.student_top = self.student_top.to(device)
        return self

    def matrices(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """(W [V_s, V_t], W^T [V_t, V_s]) sparse COO on the device, and `unmapped` [V_s] (1.0 for a
        student token with no entry), in `dtype`; moved once per dtype, never read back."""
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = tuple(m.to(device=self._device, dtype=dtype) for m in self._host)
        return self._by_dtype[dtype]

    def entries(self) -> tuple[Tensor, Tensor, Tensor]:
        """W's entries on the host: (student id [n], teacher id [n], weight fp64 [n]), weights > 0."""
        return self._indices[0], self._indices[1], self._values

    def dense(self) -> Tensor:
        """W as a dense fp64 [V_s, V_t] (tests and tiny vocabularies only)."""
        out = torch.zeros(self.student_vocab, self.teacher_vocab, dtype=torch.float64)
        out[self._indices[0], self._indices[1]] = self._values
        return out


def _augmented_csr(s: Tensor, t: Tensor, val: Tensor, v_s: int, v_t: int, t_counts: np.ndarray) -> tuple:
    """W augmented for P-KL's closed form (`stage2_student.projected`), built once on the host: (W^T [V_t + 2,
    V_s], W [V_s, V_t + 2]) as fp64 CSR, which columns have entries (bool numpy [V_t + 2]). Column V_t holds
    the unmapped student tokens (weight 1), column V_t + 1 is empty: stored-id padding points there."""
    unmapped = torch.ones(v_s, dtype=torch.bool).index_fill_(0, s, False).nonzero()[:, 0]
    s = torch.cat([s, unmapped])
    t = torch.cat([t, torch.full_like(unmapped, v_t)])
    val = torch.cat([val, torch.ones(unmapped.shape[0], dtype=val.dtype)])

    def csr(rows, cols, shape):
        coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), val, shape, check_invariants=True).coalesce()
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            return coo.to_sparse_csr()

    has = np.concatenate([t_counts > 0, [unmapped.numel() > 0, False]])
    return csr(t, s, (v_t + 2, v_s)), csr(s, t, (v_s, v_t + 2)), has


def projected_kl(zt: Tensor, lse: Tensor, ids: Tensor, log_p: Tensor, p_rest: Tensor, projection: ProjectionOperator,
                 *, num_chunks: int, student_chunk: Tensor, teacher_chunk: Tensor, inv_student_rows: Tensor,
                 teacher_row_weight: Tensor, pkl_divergence: str = "forward", beta: float = 0.5,
                 reverse_weight: float = 0.5) -> Tensor:
    """Projected KL of whole chunks [C] (docs/losses.md), with sparse matmuls by W and an exact rest.

    zt, lse: the chunks' student rows at temperature [P, V_s] and their log-sum-exp [P];
    ids, log_p, p_rest: their teacher rows' stored ids, tempered log-probs [M, k] and rest [M];
    student_chunk [P], teacher_chunk [M]: the chunk (0..C-1) of each row; inv_student_rows [C]:
    1 / student rows of each chunk; teacher_row_weight [M]: 1 / teacher rows of the row's chunk.

    p_c = mean of the chunk's teacher rows over K_c, the union of their stored ids (dense over the
    teacher vocabulary for the block's chunks only: [C, V_t], no per-entry index plan);
    q_c = W^T pbar_c over K_c, pbar_c = mean of the chunk's student softmaxes;
    q_c(rest) = sum_s pbar_c(s) w_out_c(s), w_out_c = W (1 - 1_{K_c}) + 1_unmapped: a sum of
    non-negative terms (the share of each student token's mass that falls outside K_c), never
    1 - sum(q_c), so it keeps its digits at any outside mass.

    `pkl_divergence`: forward (KL(p_c || q_c), the default), reverse (KL(q_c || p_c)), jsd (generalized
    JSD(beta)) or forward-reverse ((1 - w) forward + w reverse, w = `reverse_weight`), over the same buckets.
    """
    n_c = num_chunks
    dev = zt.device
    cdt = zt.dtype
    w, wt, unmapped = projection.matrices(cdt)
    v_t = wt.shape[0]
    t_w = teacher_row_weight.to(cdt)  # [M] 1 / rows of the row's chunk
    p_rows = log_p.exp()  # [M, k] (0 at padding)
    # teacher: K_c and p_c scattered into [C, V_t + 1] (padding: column V_t)
    flat = (torch.where(ids >= 0, ids, v_t) + (teacher_chunk * (v_t + 1))[:, None]).reshape(-1)  # [M k]
    p_c = torch.zeros(n_c * (v_t + 1), dtype=cdt, device=dev).index_put_(
        (flat,), (p_rows * t_w[:, None]).reshape(-1), accumulate=True).view(n_c, v_t + 1)[:, :v_t]
    in_k = torch.zeros(n_c * (v_t + 1), dtype=torch.bool, device=dev).index_put_(
        (flat,), torch.ones((), dtype=torch.bool, device=dev)).view(n_c, v_t + 1)[:, :v_t]  # [C, V_t] K_c
    del flat
    p_rest_c = torch.zeros(n_c, dtype=cdt, device=dev).index_add(0, teacher_chunk, p_rest * t_w)
    # student: chunk-averaged softmax, projected through W
    p_bar = torch.zeros((n_c, zt.shape[1]), dtype=cdt, device=dev).index_add(
        0, student_chunk, (zt - lse[:, None]).exp()) * inv_student_rows.to(cdt)[:, None]  # [C, V_s]
    q_c = torch.sparse.mm(wt, p_bar.t()).t()  # [C, V_t]
    w_out = torch.sparse.mm(w, (~in_k).to(cdt).t()) + unmapped[:, None]  # [V_s, C]
    q_rest_c = (p_bar * w_out.t()).sum(dim=-1)  # [C]
    no_rest = (w_out == 0).all(dim=0)  # [C] every student id's mass lands inside the chunk's support
    drop = no_rest & (p_rest_c > 0)  # as drop_unreachable_rest: renormalise K_c, no rest
    scale = torch.where(drop, 1.0 / (1.0 - p_rest_c.clamp(max=1.0 - 1e-7)), torch.ones_like(p_rest_c))  # [C]
    p_rest_c = torch.where(drop, torch.zeros_like(p_rest_c), p_rest_c)
    # KL over K_c = sum p log p - sum p log q, per chunk. The teacher's part needs no graph: with
    # p = s p_c, sum p log p = s sum p_c log p_c + s log s sum p_c. The cross part, linear in p_c, is
    # summed over the rows' stored entries (p_c is their t_w-weighted sum): O(M k), not O(C V_t)
    entropy = scale * torch.xlogy(p_c, p_c).sum(dim=-1) + torch.xlogy(scale, scale) * p_c.sum(dim=-1)  # [C]
    q_at = q_c[teacher_chunk[:, None], ids.clamp(min=0)]  # [M, k]
    cross_rows = (p_rows * q_at.clamp(min=PROB_FLOOR).log()).sum(dim=-1) * t_w * scale[teacher_chunk]  # [M]
    cross = torch.zeros(n_c, dtype=cross_rows.dtype, device=dev).index_add(0, teacher_chunk, cross_rows)  # [C]
    forward = entropy - cross + divergence("kl", safe_log(p_rest_c)[:, None], safe_log(q_rest_c)[:, None])  # [C]
    if pkl_divergence == "forward":
        return forward
    # the other divergences over the buckets K_c and the rest, dense over [C, V_t + 1]
    log_p_all = torch.cat([safe_log(p_c * scale[:, None]), safe_log(p_rest_c)[:, None]], dim=-1)
    log_q_all = torch.cat([safe_log(torch.where(in_k, q_c, 0.0)), safe_log(q_rest_c)[:, None]], dim=-1)
    if pkl_divergence == "reverse":
        return divergence("rkl", log_p_all, log_q_all)
    if pkl_divergence == "jsd":
        return divergence("jsd", log_p_all, log_q_all, beta=beta)
    if pkl_divergence == "forward-reverse":
        return (1.0 - reverse_weight) * forward + reverse_weight * divergence("rkl", log_p_all, log_q_all)
    raise ValueError(f"--pkl-divergence {pkl_divergence!r}: use forward, reverse, jsd or forward-reverse")
