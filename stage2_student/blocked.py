"""The blocked KD + CE terms of one micro-batch: one autograd function over blocks of student logit rows.

`Objective.prepare` plans the blocks on the host (`Block`, `Prepared`); `blocked_terms` computes each
block's KD and CE terms in forward and recomputes the block in backward, so that no [rows, V]
tensor of the whole micro-batch exists besides the one logits-sized gradient buffer
(stage2_student/objective.py's module docstring states the memory bound).

    kd_per_chunk, ce_sum = blocked_terms(logits, [(objective.spec, prepared)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from stage2_student import closed_form, losses, onpolicy, projected
from stage2_student.losses import ProjectionOperator


@dataclass(frozen=True)
class TermSpec:
    """What one teacher's pass computes: the KD kind and its settings (`Objective.spec`)."""

    kind: str | None  # None: CE only
    temperature: float
    beta: float
    tau: float
    tail: str
    projection: ProjectionOperator | None = None
    is_cap: float = 0.0  # rkl-pg: cap of the truncated importance ratio (0: no ratio)
    divergence: str = "forward"  # pkl: forward, reverse, jsd or forward-reverse (projected._kl_terms)
    reverse_weight: float = 0.5  # pkl forward-reverse: (1 - w) forward + w reverse


@dataclass
class Block:
    """One block of student logit rows, planned on the host (`Objective.prepare`); `to` moves its
    index tensors to the device.

    Its rows are `logit_rows`: first `num_kd_rows` rows that carry KD, then rows that carry only CE.
    Same tokenizer: KD row i is the student row of teacher row `teacher_rows[i]` and gives one KD
    term, of chunk `kd_chunk[i]`. Cross tokenizer (pkl, alm): the KD rows are the student rows of
    `num_chunks` whole chunks (`student_chunk`: block-local chunk of each), `teacher_rows` their
    chunks' teacher rows (`teacher_chunk`: block-local chunk of each), one KD term per chunk, of
    chunk `kd_chunk[c]`. Chunks are the micro-batch's unless said block-local.
    """

    logit_rows: Tensor  # int64 [b] rows of the micro-batch's logits flattened to [B*L, V]
    num_kd_rows: int  # the first num_kd_rows of logit_rows carry KD (0: a CE-only block)
    kd_chunk: Tensor  # int64 [terms] the chunk of each KD term the block returns
    ce_rows: Tensor  # int64 [e] index into logit_rows of each row with a CE label
    ce_labels: Tensor  # int64 [e] that row's label (the next student token)
    teacher_rows: tuple[int, int] | Tensor | None = None  # the block's teacher rows: (start, end), or int64 [M]
    # cross tokenizer only
    num_chunks: int = 0  # chunks of the block
    student_chunk: Tensor | None = None  # int64 [P] block-local chunk of each KD row
    teacher_chunk: Tensor | None = None  # int64 [M] block-local chunk of each teacher row
    inv_student_rows: Tensor | None = None  # float64 [num_chunks] 1 / KD rows of each chunk
    teacher_row_weight: Tensor | None = None  # float64 [M] 1 / teacher rows of the row's chunk
    kd_labels: Tensor | None = None  # int64 [P] label of each KD row, -100 as 0 (alm, rkl-pg)
    behaviour_logprobs: Tensor | None = None  # float32 [P] rkl-pg: the sampling policy's log-prob of each label

    def to(self, device) -> "Block":
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                setattr(self, f.name, value.to(device, non_blocking=True))
        return self


class Prepared:
    """A micro-batch planned for the objective: blocks, teacher tensors and host-side counts."""

    def __init__(self, blocks: list[Block], teacher: dict, agree: dict | None, *, chunks: int, tokens: int,
                 valid_pos: int):
        self.blocks, self.teacher, self.agree = blocks, teacher, agree
        self.chunks, self.tokens, self.valid_pos = chunks, tokens, valid_pos

    def to(self, device) -> "Prepared":
        for b in self.blocks:
            b.to(device)
        self.teacher = {k: v.to(device, non_blocking=True) for k, v in self.teacher.items()}
        if self.agree is not None:
            self.agree = {k: v.to(device, non_blocking=True) for k, v in self.agree.items()}
        return self


_take = closed_form.take_rows


def blocked_terms(logits: Tensor, passes: list[tuple[TermSpec, Prepared]]) -> tuple[list[Tensor], Tensor]:
    """([KD of every chunk [C_i] of each pass], CE sum over the passes) of one micro-batch's logits.

    A pass is one teacher's (spec, prepared plan); all of them run in one autograd function, so
    that backward writes one logits-sized gradient buffer whatever the number of teachers.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    if not any(p.blocks for _, p in passes):
        zero = flat.sum().to(losses.compute_dtype(flat.dtype)) * 0.0  # keeps the graph for backward
        return [zero.expand(p.chunks) for _, p in passes], zero
    *kd, ce = _BlockedTerms.apply(flat, passes)
    return kd, ce


class Scratch:
    """[rows, V]-sized buffers that the blocks of one forward or backward pass reuse in turn.

    On CPU every fresh buffer of that size pays its page faults again (about a pass over it), block after
    block; `take` hands out the same memory for a name each time (contents undefined), sized for the pass's
    largest block. The closed forms take their [rows, V] work from here and may overwrite the block's rows.
    """

    def __init__(self, device, numel: int):
        self.device, self.numel, self._bufs = device, numel, {}

    def take(self, name: str, shape: tuple, dtype) -> Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self._bufs[name] = torch.empty(max(n, self.numel), dtype=dtype, device=self.device)
        return buf[:n].view(shape)

    def rows(self, logits: Tensor, index: Tensor) -> Tensor:
        """`logits.index_select(0, index)`, into the buffer "rows"."""
        out = self.take("rows", (index.shape[0], logits.shape[1]), logits.dtype)
        return torch.index_select(logits, 0, index, out=out)

    @classmethod
    def of(cls, logits: Tensor, passes) -> "Scratch":
        rows = max((b.logit_rows.shape[0] for _, p in passes for b in p.blocks), default=0)
        return cls(logits.device, rows * logits.shape[1])


class _BlockedTerms(torch.autograd.Function):
    """(KD of every chunk [C_i] of each pass..., CE sum) over the blocks of a micro-batch; backward
    recomputes block by block.

    Backward allocates the gradient of the logits (the only [N, V] tensor) and, per block of each
    pass, adds in the block's gradient: written in closed form (`closed_form`: CE, KL, sampled;
    `projected`: P-KL) or by re-running `_block_terms` with autograd on a copy of the block's rows.
    Both directions copy a block's rows into one `Scratch` buffer, which the closed forms may overwrite.
    """

    @staticmethod
    def forward(ctx, logits, passes):
        cdt = losses.compute_dtype(logits.dtype)
        outs = []
        ce_out = torch.zeros((), dtype=cdt, device=logits.device)
        ctx.saved = []  # per pass and block: (closed-form module, its O(rows) log-partitions), None: autograd recompute
        scratch = Scratch.of(logits, passes)
        for spec, prep in passes:
            kd_out = torch.zeros(prep.chunks, dtype=cdt, device=logits.device)
            saved = []
            for blk in prep.blocks:
                z = scratch.rows(logits, blk.logit_rows)
                form = _closed_form(spec, blk)
                if form is not None:
                    kd, ce, keep = form.forward(spec, z, blk, prep.teacher, scratch)
                    keep = (form, keep)
                else:
                    (kd, ce), keep = _block_terms(spec, z, blk, prep.teacher), None
                saved.append(keep)
                kd_out.index_add_(0, blk.kd_chunk, kd)
                ce_out += ce
            outs.append(kd_out)
            ctx.saved.append(saved)
        ctx.save_for_backward(logits)
        ctx.passes = passes
        return (*outs, ce_out)

    @staticmethod
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        grad_ce = grads[-1]
        grad = torch.zeros_like(logits)
        scratch = Scratch.of(logits, ctx.passes)
        for (spec, prep), grad_kd, saved in zip(ctx.passes, grads[:-1], ctx.saved):
            for blk, keep in zip(prep.blocks, saved):
                if keep is not None:
                    z = scratch.rows(logits, blk.logit_rows)
                    form, keep = keep
                    gz = form.gradient(spec, z, blk, prep.teacher, keep, grad_kd[blk.kd_chunk], grad_ce, scratch)
                    grad.index_add_(0, blk.logit_rows, gz.to(grad.dtype))
                    del z, gz
                    continue
                with torch.enable_grad():
                    z = logits.index_select(0, blk.logit_rows).detach().requires_grad_(True)
                    kd, ce = _block_terms(spec, z, blk, prep.teacher)
                    (gz,) = torch.autograd.grad((kd * grad_kd[blk.kd_chunk]).sum() + ce * grad_ce, z)
                grad.index_add_(0, blk.logit_rows, gz)
                del z, gz, kd, ce  # the block's graph goes now, not when the next block replaces it
        return grad, None


def _closed_form(spec: TermSpec, blk: Block):
    """The module that computes this block's terms and gradient in closed form (None: autograd recompute)."""
    if spec.kind in closed_form.KINDS or blk.num_kd_rows == 0:
        return closed_form  # CE-only blocks of any pass included
    return projected if spec.kind == "pkl" else None


def _block_terms(spec: TermSpec, z_rows: Tensor, blk: Block, teacher: dict) -> tuple[Tensor, Tensor]:
    """(KD term of each of the block's chunks `blk.kd_chunk`, CE sum) of one block.
    z_rows: the block's logit rows [b, V] in the logits' dtype."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)
    zero = torch.zeros((), dtype=cdt, device=z.device)
    t = spec.temperature
    lse1 = torch.logsumexp(z, dim=-1)  # [b]
    ce = zero
    if blk.ce_rows.shape[0]:
        ce = -(z[blk.ce_rows, blk.ce_labels] - lse1[blk.ce_rows]).sum()
    if spec.kind is None or blk.num_kd_rows == 0:
        return z.new_zeros(blk.kd_chunk.shape[0]), ce
    m = blk.num_kd_rows
    if spec.kind in ("alm", "rkl-pg"):  # the chunk's log-prob of its text on each side
        lq = z[:m].gather(1, blk.kd_labels[:, None])[:, 0] - lse1[:m]  # [P] label log-probs at T=1
        log_ps = torch.zeros(blk.num_chunks, dtype=cdt, device=z.device).index_add(0, blk.student_chunk, lq)
        realized = _take(teacher["teacher_realized"], blk.teacher_rows).to(cdt)
        log_pt = torch.zeros(blk.num_chunks, dtype=cdt, device=z.device).index_add(0, blk.teacher_chunk, realized)
        if spec.kind == "alm":
            return losses.chunk_likelihood(log_ps, log_pt, spec.tau), ce  # [n_c]
        log_pb = None
        if blk.behaviour_logprobs is not None:
            log_pb = torch.zeros(blk.num_chunks, dtype=cdt, device=z.device).index_add(
                0, blk.student_chunk, blk.behaviour_logprobs.to(cdt))
            # a NaN row (a turn not stored on its sampled ids, onpolicy.behaviour_rows) makes its chunk's sum NaN:
            # no sampling log-prob there, so no ratio (w = 1)
            log_pb = torch.where(torch.isnan(log_pb), log_ps.detach(), log_pb)
        return onpolicy.reverse_kl_pg(log_ps, log_pt, log_pb, is_cap=spec.is_cap), ce  # [n_c]
    zt = z[:m] if t == 1.0 else z[:m] / t  # [m, V]
    lse = lse1[:m] if t == 1.0 else torch.logsumexp(zt, dim=-1)
    ids = _take(teacher["teacher_ids"], blk.teacher_rows)  # [M, k]
    lp = teacher.get("teacher_logprobs")
    cnt = teacher.get("teacher_counts")
    res = teacher.get("teacher_residual")
    log_p1, resid = losses.teacher_logprobs(ids, None if lp is None else _take(lp, blk.teacher_rows),
                                            None if cnt is None else _take(cnt, blk.teacher_rows),
                                            None if res is None else _take(res, blk.teacher_rows), cdt)
    valid = torch.isfinite(log_p1)
    v_teacher = spec.projection.teacher_vocab if spec.kind == "pkl" else zt.shape[1]  # the uniform tail's V
    log_p, p_rest = losses.temper_teacher(log_p1, resid, t, tail=spec.tail, vocab_size=v_teacher,
                                          valid=valid)  # [M, k], [M]
    if spec.kind == "pkl":
        kd = losses.projected_kl(zt, lse, ids, log_p, p_rest, spec.projection, num_chunks=blk.num_chunks,
                                 student_chunk=blk.student_chunk, teacher_chunk=blk.teacher_chunk,
                                 inv_student_rows=blk.inv_student_rows, teacher_row_weight=blk.teacher_row_weight,
                                 pkl_divergence=spec.divergence, beta=spec.beta,
                                 reverse_weight=spec.reverse_weight)
    else:
        vocab = zt.shape[1]
        log_q = (zt.gather(1, ids.clamp(min=0)) - lse[:, None]).masked_fill(~valid, -math.inf)  # [m, k]
        support = torch.zeros((m, vocab + 1), dtype=torch.bool, device=z.device)
        support.scatter_(1, torch.where(valid, ids, vocab), True)  # padding lands in the extra column
        log_q_rest = losses.rest_logprob(zt, lse, support[:, :vocab])  # [m]
        log_p, p_rest = losses.drop_unreachable_rest(log_p, p_rest, support[:, :vocab].all(dim=-1))
        log_p_all = torch.cat([log_p, losses.safe_log(p_rest)[:, None]], dim=-1)  # [m, k+1]
        log_q_all = torch.cat([log_q, log_q_rest[:, None]], dim=-1)
        kind = "kl" if spec.kind == "sampled" else spec.kind
        kd = losses.divergence(kind, log_p_all, log_q_all, beta=spec.beta)  # [m]
    return (kd if t == 1.0 else kd * t**2), ce
