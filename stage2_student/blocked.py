"""The blocked KD + CE terms of one micro-batch: one autograd function over blocks of student logit rows.

`Objective.prepare` plans the blocks on the host (`Block`, `Prepared`); `blocked_terms` computes each
block's KD and CE terms in forward and recomputes the block in backward, so that no [rows, V]
tensor of the whole micro-batch exists besides the one logits-sized gradient buffer
(stage2_student/objective.py's module docstring states the memory bound).

    kd_per_chunk, ce_sum = blocked_terms(logits, [(objective.spec, prepared)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from stage2_student import losses
from stage2_student.losses import ProjectionOperator


@dataclass(frozen=True)
class _Spec:
    kind: str | None  # None: CE only
    temperature: float
    beta: float
    tau: float
    tail: str
    projection: ProjectionOperator | None = None


class Block:
    """One block of student rows: host-planned index tensors (moved to the device with `to`)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def to(self, device) -> "Block":
        for name, value in self.__dict__.items():
            if isinstance(value, Tensor):
                setattr(self, name, value.to(device, non_blocking=True))
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


def _take(t: Tensor, sel) -> Tensor:
    return t[sel[0]:sel[1]] if isinstance(sel, tuple) else t.index_select(0, sel)


def blocked_terms(logits: Tensor, passes: list[tuple[_Spec, Prepared]]) -> tuple[list[Tensor], Tensor]:
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


class _BlockedTerms(torch.autograd.Function):
    """(KD of every chunk [C_i] of each pass..., CE sum) over the blocks of a micro-batch; backward
    recomputes block by block.

    Backward allocates the gradient of the logits (the only [N, V] tensor) and, per block of each
    pass, re-runs `_block_terms` with autograd on a copy of the block's rows, adding its gradient in.
    """

    @staticmethod
    def forward(ctx, logits, passes):
        cdt = losses.compute_dtype(logits.dtype)
        outs = []
        ce_out = torch.zeros((), dtype=cdt, device=logits.device)
        for spec, prep in passes:
            kd_out = torch.zeros(prep.chunks, dtype=cdt, device=logits.device)
            for blk in prep.blocks:
                kd, ce = _block_terms(spec, logits.index_select(0, blk.pos), blk, prep.teacher)
                kd_out.index_add_(0, blk.kd_chunk, kd)
                ce_out += ce
            outs.append(kd_out)
        ctx.save_for_backward(logits)
        ctx.passes = passes
        return (*outs, ce_out)

    @staticmethod
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        grad_ce = grads[-1]
        grad = torch.zeros_like(logits)
        for (spec, prep), grad_kd in zip(ctx.passes, grads[:-1]):
            for blk in prep.blocks:
                with torch.enable_grad():
                    z = logits.index_select(0, blk.pos).detach().requires_grad_(True)
                    kd, ce = _block_terms(spec, z, blk, prep.teacher)
                    (gz,) = torch.autograd.grad((kd * grad_kd[blk.kd_chunk]).sum() + ce * grad_ce, z)
                grad.index_add_(0, blk.pos, gz)
                del z, gz, kd, ce  # the block's graph goes now, not when the next block replaces it
        return grad, None


def _block_terms(spec: _Spec, z_rows: Tensor, blk: Block, teacher: dict) -> tuple[Tensor, Tensor]:
    """(KD term of each of the block's chunks `blk.kd_chunk`, CE sum) of one block.
    z_rows: the block's logit rows [b, V] in the logits' dtype."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)
    zero = torch.zeros((), dtype=cdt, device=z.device)
    t = spec.temperature
    lse1 = torch.logsumexp(z, dim=-1)  # [b]
    ce = zero
    if blk.ce_loc.shape[0]:
        ce = -(z[blk.ce_loc, blk.ce_lab] - lse1[blk.ce_loc]).sum()
    if spec.kind is None or blk.n_kd == 0:
        return z.new_zeros(blk.kd_chunk.shape[0]), ce
    m = blk.n_kd
    if spec.kind == "alm":
        lq = z[:m].gather(1, blk.a_lab[:, None])[:, 0] - lse1[:m]  # [P] label log-probs at T=1
        log_ps = torch.zeros(blk.n_c, dtype=cdt, device=z.device).index_add(0, blk.cl, lq)
        realized = _take(teacher["teacher_realized"], blk.t_sel).to(cdt)
        log_pt = torch.zeros(blk.n_c, dtype=cdt, device=z.device).index_add(0, blk.trl, realized)
        kd = losses.chunk_likelihood(log_ps, log_pt, spec.tau)  # [n_c]
        return kd, ce
    zt = z[:m] if t == 1.0 else z[:m] / t  # [m, V]
    lse = lse1[:m] if t == 1.0 else torch.logsumexp(zt, dim=-1)
    ids = _take(teacher["teacher_ids"], blk.t_sel)  # [M, k]
    lp = teacher.get("teacher_logprobs")
    cnt = teacher.get("teacher_counts")
    res = teacher.get("teacher_residual")
    log_p1, resid = losses.teacher_logprobs(ids, None if lp is None else _take(lp, blk.t_sel),
                                            None if cnt is None else _take(cnt, blk.t_sel),
                                            None if res is None else _take(res, blk.t_sel), cdt)
    valid = torch.isfinite(log_p1)
    v_teacher = spec.projection.teacher_vocab if spec.kind == "pkl" else zt.shape[1]  # the uniform tail's V
    log_p, p_rest = losses.temper_teacher(log_p1, resid, t, tail=spec.tail, vocab_size=v_teacher,
                                          valid=valid)  # [M, k], [M]
    if spec.kind == "pkl":
        kd = _pkl_block(zt, lse, blk, ids, log_p, p_rest, spec.projection, cdt)
    else:
        vocab = zt.shape[1]
        log_q = (zt.gather(1, ids.clamp(min=0)) - lse[:, None]).masked_fill(~valid, -math.inf)  # [m, k]
        support = torch.zeros((m, vocab + 1), dtype=torch.bool, device=z.device)
        support.scatter_(1, torch.where(valid, ids, vocab), True)  # padding lands in the extra column
        log_q_rest = losses.rest_logprob(zt, lse, support[:, :vocab])  # [m]
        log_p, p_rest = _drop_unreachable_rest(log_p, p_rest, support[:, :vocab].all(dim=-1))
        log_p_all = torch.cat([log_p, _log(p_rest)[:, None]], dim=-1)  # [m, k+1]
        log_q_all = torch.cat([log_q, log_q_rest[:, None]], dim=-1)
        kind = "kl" if spec.kind == "sampled" else spec.kind
        kd = losses.divergence(kind, log_p_all, log_q_all, beta=spec.beta)  # [m]
    return (kd if t == 1.0 else kd * t**2), ce


def _log(p: Tensor) -> Tensor:
    """log p with -inf at 0 and no NaN in backward."""
    pos = p > 0
    return torch.where(pos, torch.log(torch.where(pos, p, torch.ones_like(p))), torch.full_like(p, -math.inf))


def _drop_unreachable_rest(log_p: Tensor, p_rest: Tensor, no_rest: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher over its support alone on rows whose student has no mass outside it (`no_rest`).

    There, the teacher's rest is mass on ids the student does not have (a full cache keeps the
    mass of the teacher lm_head's padding columns as its residual): it is dropped and the support
    renormalised, rather than a KL of +inf against a student rest of exactly 0.
    """
    drop = no_rest & (p_rest > 0)
    shift = torch.where(drop, torch.log1p(-p_rest.clamp(max=1.0 - 1e-7)), torch.zeros_like(p_rest))
    return log_p - shift[:, None], torch.where(drop, torch.zeros_like(p_rest), p_rest)


def _pkl_block(zt: Tensor, lse: Tensor, blk: Block, ids: Tensor, log_p: Tensor, p_rest: Tensor, projection,
               cdt) -> Tensor:
    """Projected KL of a block's chunks (docs/losses.md), with sparse matmuls by W and an exact rest.

    p_c = mean of the chunk's teacher rows over K_c, the union of their stored ids (dense over the
    teacher vocabulary for the block's chunks only: [C, V_t], no per-entry index plan);
    q_c = W^T pbar_c over K_c, pbar_c = mean of the chunk's student softmaxes;
    q_c(rest) = sum_s pbar_c(s) w_out_c(s), w_out_c = W (1 - 1_{K_c}) + 1_unmapped: a sum of
    non-negative terms (the share of each student token's mass that falls outside K_c), never
    1 - sum(q_c), so it keeps its digits at any outside mass.
    """
    n_c = blk.n_c
    dev = zt.device
    w, wt, unmapped = projection.matrices(cdt)
    v_t = wt.shape[0]
    t_w = blk.t_w.to(cdt)  # [M] 1 / rows of the row's chunk
    p_rows = log_p.exp()  # [M, k] (0 at padding)
    # teacher: K_c and p_c scattered into [C, V_t + 1] (padding: column V_t)
    flat = (torch.where(ids >= 0, ids, v_t) + (blk.trl * (v_t + 1))[:, None]).reshape(-1)  # [M k]
    p_c = torch.zeros(n_c * (v_t + 1), dtype=cdt, device=dev).index_put_(
        (flat,), (p_rows * t_w[:, None]).reshape(-1), accumulate=True).view(n_c, v_t + 1)[:, :v_t]
    in_k = torch.zeros(n_c * (v_t + 1), dtype=torch.bool, device=dev).index_put_(
        (flat,), torch.ones((), dtype=torch.bool, device=dev)).view(n_c, v_t + 1)[:, :v_t]  # [C, V_t] K_c
    del flat
    p_rest_c = torch.zeros(n_c, dtype=cdt, device=dev).index_add(0, blk.trl, p_rest * t_w)
    # student: chunk-averaged softmax, projected through W
    p_bar = torch.zeros((n_c, zt.shape[1]), dtype=cdt, device=dev).index_add(
        0, blk.cl, (zt - lse[:, None]).exp()) * blk.inv_npos.to(cdt)[:, None]  # [C, V_s]
    q_c = torch.sparse.mm(wt, p_bar.t()).t()  # [C, V_t]
    w_out = torch.sparse.mm(w, (~in_k).to(cdt).t()) + unmapped[:, None]  # [V_s, C]
    q_rest_c = (p_bar * w_out.t()).sum(dim=-1)  # [C]
    no_rest = (w_out == 0).all(dim=0)  # [C] every student id's mass lands inside the chunk's support
    drop = no_rest & (p_rest_c > 0)  # as _drop_unreachable_rest: renormalise K_c, no rest
    scale = torch.where(drop, 1.0 / (1.0 - p_rest_c.clamp(max=1.0 - 1e-7)), torch.ones_like(p_rest_c))  # [C]
    p_rest_c = torch.where(drop, torch.zeros_like(p_rest_c), p_rest_c)
    # KL over K_c = sum p log p - sum p log q, per chunk. The teacher's part needs no graph: with
    # p = s p_c, sum p log p = s sum p_c log p_c + s log s sum p_c. The cross part, linear in p_c, is
    # summed over the rows' stored entries (p_c is their t_w-weighted sum): O(M k), not O(C V_t)
    entropy = scale * torch.xlogy(p_c, p_c).sum(dim=-1) + torch.xlogy(scale, scale) * p_c.sum(dim=-1)  # [C]
    q_at = q_c[blk.trl[:, None], ids.clamp(min=0)]  # [M, k]
    cross_rows = (p_rows * q_at.clamp(min=losses.PROB_FLOOR).log()).sum(dim=-1) * t_w * scale[blk.trl]  # [M]
    cross = torch.zeros(n_c, dtype=cross_rows.dtype, device=dev).index_add(0, blk.trl, cross_rows)  # [C]
    return entropy - cross + losses.divergence("kl", _log(p_rest_c)[:, None], _log(q_rest_c)[:, None])  # [C]
