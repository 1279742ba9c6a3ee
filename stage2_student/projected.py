"""Projected KL (P-KL) of one block with its gradient in closed form, never a [chunks, V_t] graph.

`stage2_student.blocked` calls these for `--loss pkl` blocks, in place of recomputing
`losses.projected_kl` under autograd; the values are that function's (docs/losses.md). Per chunk c,
with pbar_c the mean of the chunk's student softmaxes at T, W the projection augmented by one column
that holds every unmapped student token (weight 1), q_c = W^T pbar_c, K_c the union of the chunk's
stored teacher ids and p_c the mean of its teacher rows on K_c (rest p_r):

    KL_c = sum_{t in K_c} s p_c(t) log(s p_c(t) / max(q_c(t), floor)) + p_r log(p_r / q_r),
    q_r = sum_{t not in K_c} q_c(t)       (a sum of non-negative terms: exact at any outside mass)

(s renormalises K_c when the student has nothing outside it, as `losses.drop_unreachable_rest`).
With H_c(t) = dKL_c/dq_c(t), that is -sum_{entries e of (c, t)} w_e / q_c(t) on K_c (w_e = s p_e /
rows of the row's chunk; 0 where q_c(t) < floor) and -p_r / q_r outside, and G_c = W H_c:

    dKL_c / du_i = (1 / rows of c) softmax(u_i) * (G_c - <softmax(u_i), G_c>)   (u_i = z_i / T, row i of chunk c)

so forward is one fused softmax pass and one CSR matmul W^T pbar, backward one softmax pass and one W H
(plus forward's matmul again for wide teacher rows, whose dKL/dq per stored entry forward does not keep:
`SAVE_ENTRIES_BELOW`); the rest is O(stored entries) gathers and scatters into [V_t + 2, C] buffers
(teacher ids by chunk, chunks contiguous). On one CPU thread at 4k vocabularies this is about 7x less
loss time than the autograd recompute. tests/test_closed_form.py checks values and gradients against
`losses.projected_kl` under autograd.

    kd, ce, saved = forward(spec, z_rows, blk, teacher)                        # [C], CE sum, O(rows)
    g = gradient(spec, z_rows, blk, teacher, saved, grad_kd_chunks, grad_ce)   # [b, V]
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor

from stage2_student import closed_form, losses

SAVE_ENTRIES_BELOW = 1 / 16  # forward keeps dKL/dq of the stored entries for backward when k <= this x V_t
_CSR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # projection -> {(dtype, device): matrices}


def _matrices(projection, dtype, device) -> tuple[Tensor, Tensor, Tensor, int, bool]:
    """(W^T [V_t + 2, V_s], W [V_s, V_t + 2]) as CSR in `dtype` on `device`, which columns have entries (bool
    [V_t + 2]), how many, and whether a student token is unmapped (`ProjectionOperator.augmented`: column V_t
    holds the unmapped student tokens, column V_t + 1 is empty and takes stored-id padding). Moved once per
    (dtype, device); nothing is computed or read back here."""
    per = _CSR.setdefault(projection, {})
    key = (dtype, torch.device(device))
    if key not in per:
        w_t, w, has = projection.augmented
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            per[key] = (w_t.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype),
                        torch.from_numpy(has).to(device), int(has.sum()), bool(has[-2]))
    return per[key]


def _softmax(spec, z: Tensor, m: int) -> Tensor:
    """The softmax of the KD rows at T [m, V] (one fused pass)."""
    return torch.softmax(z[:m] if spec.temperature == 1.0 else z[:m] / spec.temperature, dim=-1)


def _ce_partition(spec, z: Tensor, m: int, soft: Tensor) -> Tensor:
    """CE's log-partition of every row [b]; at T = 1 the KD rows' from their softmax (`closed_form.log_partition`)."""
    if spec.temperature != 1.0:
        return torch.logsumexp(z, dim=-1)
    return torch.cat([closed_form.log_partition(z[:m], soft), torch.logsumexp(z[m:], dim=-1)])


def _chunk_means(soft: Tensor, blk) -> Tensor:
    """pbar [C, V_s]: the mean of each chunk's student softmaxes."""
    if soft.shape[0] == blk.num_chunks:  # one row per chunk: the mean is the row
        return soft.new_empty(soft.shape).index_copy_(0, blk.student_chunk, soft)
    p_bar = soft.new_zeros((blk.num_chunks, soft.shape[1])).index_add_(0, blk.student_chunk, soft)
    return p_bar.mul_(blk.inv_student_rows.to(soft.dtype)[:, None])


def _kl_parts(spec, p_bar: Tensor, blk, teacher: dict, mats) -> tuple[Tensor, tuple]:
    """(KL of each chunk [C] at the pass's temperature, unscaled by T^2; (entries, dKL/dq at the stored entries
    [M, k], dKL/dq outside K_c [C], <pbar_c, G_c> [C])): everything but the [V_t + 2, C] buffers is O(M k)."""
    cdt, n_c = p_bar.dtype, blk.num_chunks
    w_t, _, has, n_cols, unmapped = mats
    v_t = w_t.shape[0] - 2
    ids, log_p1, resid, _ = closed_form.stored(blk, teacher, cdt)
    log_p, p_rest = losses.temper_teacher(log_p1, resid, spec.temperature, tail=spec.tail, vocab_size=v_t,
                                          valid=None)  # [M, k], [M] (`stored` masked the padding)
    t_w = blk.teacher_row_weight.to(cdt)  # [M] 1 / teacher rows of the row's chunk
    at = (torch.where(ids >= 0, ids, v_t + 1), blk.teacher_chunk[:, None].expand_as(ids))  # buffer cells [M, k]
    w_e = log_p.exp().mul_(t_w[:, None])  # [M, k] p_e / rows of its chunk (0: padding)
    p_rest_c = torch.zeros(n_c, dtype=cdt, device=ids.device).index_add_(0, blk.teacher_chunk, p_rest * t_w)
    q = torch.sparse.mm(w_t, p_bar.t())  # [V_t + 2, C] q_c = W^T pbar_c, column by column
    q_at = q[at]  # [M, k] (padding: the empty column, 0)
    q[at] = 0.0
    q_rest = q.sum(dim=0)  # [C] the student's mass outside K_c, unmapped tokens included
    drop = _no_rest(ids, at, blk, has, n_cols, unmapped, q.shape) & (p_rest_c > 0)  # as losses.drop_unreachable_rest
    scale = torch.where(drop, 1.0 / (1.0 - p_rest_c.clamp(max=1.0 - 1e-7)), torch.ones_like(p_rest_c))  # [C]
    p_rest_c = torch.where(drop, torch.zeros_like(p_rest_c), p_rest_c)
    # the teacher's entropy on K_c: sum over distinct ids of p_c log p_c = sum_e w_e log p_c(t_e); q is 0 on K_c
    ent_e = torch.xlogy(w_e, q.index_put_(at, w_e, accumulate=True)[at])  # [M, k]
    del q
    log_q = q_at.clamp(min=losses.PROB_FLOOR).log()  # [M, k]
    zero = torch.zeros((), dtype=cdt, device=ids.device)
    d_e = torch.where(q_at >= losses.PROB_FLOOR, -w_e / q_at, zero)  # [M, k] dKL/dq, times scale below
    per_row = torch.stack([ent_e.sum(dim=-1), (w_e * log_q).sum(dim=-1), w_e.sum(dim=-1), (d_e * q_at).sum(dim=-1)],
                          dim=1)  # [M, 4]
    ent, cross, mass, dot = torch.zeros((n_c, 4), dtype=cdt, device=ids.device).index_add_(
        0, blk.teacher_chunk, per_row).unbind(1)  # [C] each
    kl = scale * (ent - cross) + torch.xlogy(scale, scale) * mass
    kl = kl + losses.divergence("kl", losses.safe_log(p_rest_c)[:, None], losses.safe_log(q_rest)[:, None])  # [C]
    d_rest = torch.where((p_rest_c > 0) & (q_rest > 0), -p_rest_c / q_rest, zero)  # [C]
    return kl, (at, d_e.mul_(scale[blk.teacher_chunk][:, None]), d_rest, scale * dot + d_rest * q_rest)


def _no_rest(ids: Tensor, at: tuple, blk, has: Tensor, n_cols: int, unmapped: bool, shape) -> Tensor:
    """Chunks whose K_c holds every column with entries [C] (never, with an unmapped student token: its column
    is never stored); an entry counts once per chunk, the one whose index stays in a [V_t + 2, C] buffer."""
    if unmapped:
        return torch.zeros(blk.num_chunks, dtype=torch.bool, device=ids.device)
    slot = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device).view(ids.shape)
    owner = torch.empty(shape, dtype=torch.int32, device=ids.device)
    owner[at] = slot
    counted = (owner[at] == slot) & has[at[0]]  # [M, k]
    seen = torch.zeros(blk.num_chunks, dtype=torch.int64, device=ids.device).index_add_(0, blk.teacher_chunk,
                                                                                          counted.sum(dim=-1))
    return seen == n_cols


def forward(spec, z_rows: Tensor, blk, teacher: dict) -> tuple[Tensor, Tensor, tuple]:
    """(P-KL of each of the block's chunks [C], CE sum, what `gradient` needs: O(rows), plus the stored
    entries' dKL/dq when they are few (`SAVE_ENTRIES_BELOW`), else recomputed in backward)."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)  # [b, V]
    m, t = blk.num_kd_rows, spec.temperature
    mats = _matrices(spec.projection, cdt, z.device)
    soft = _softmax(spec, z, m)
    lse1 = _ce_partition(spec, z, m, soft) if blk.ce_rows.shape[0] > 0 else None  # [b]
    p_bar = _chunk_means(soft, blk)
    del soft
    kl, parts = _kl_parts(spec, p_bar, blk, teacher, mats)
    keep = parts[1:] if teacher["teacher_ids"].shape[1] <= SAVE_ENTRIES_BELOW * mats[0].shape[0] else None
    return (kl if t == 1.0 else kl * t**2), closed_form.ce_sum(z, lse1, blk), (lse1, keep)


def gradient(spec, z_rows: Tensor, blk, teacher: dict, saved: tuple, grad_kd: Tensor, grad_ce: Tensor) -> Tensor:
    """d(sum_c grad_kd[c] * P-KL_c + grad_ce * CE) / d z_rows, [b, V] in the compute dtype (grad_kd: [C])."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)  # [b, V]
    lse1, keep = saved
    m, t, b = blk.num_kd_rows, spec.temperature, z.shape[0]
    mats = _matrices(spec.projection, cdt, z.device)
    c = torch.zeros(b, dtype=cdt, device=z.device)  # CE weight of each row
    if lse1 is not None:
        c = c.index_fill(0, blk.ce_rows, 1.0) * grad_ce.to(cdt)
    soft = _softmax(spec, z, m)
    if keep is None:
        _, (at, d_e, d_rest, dot) = _kl_parts(spec, _chunk_means(soft, blk), blk, teacher, mats)
    else:
        (d_e, d_rest, dot), at = keep, _cells(blk, teacher, mats)
    # H_c = dKL_c/dq_c: the rest's outside K_c (unmapped column included), the entries' sum on K_c; G = W H
    h = d_rest[None, :].expand(mats[0].shape[0], -1).clone()  # [V_t + 2, C]
    h[at] = 0.0
    h.index_put_(at, d_e, accumulate=True)
    g_rows = torch.sparse.mm(mats[1], h).t().index_select(0, blk.student_chunk)  # [m, V] G of each row's chunk
    del h
    alpha = (grad_kd.to(cdt) * blk.inv_student_rows.to(cdt)).index_select(0, blk.student_chunk) * t  # [m]
    if m == blk.num_chunks:  # <softmax_i, G_c> = <pbar_c, G_c>, from the entries
        dot = dot.index_select(0, blk.student_chunk)
    else:
        dot = torch.linalg.vecdot(soft, g_rows)  # [m]
    beta = -alpha * dot
    if t == 1.0:  # CE's softmax is the KD rows' softmax
        beta = beta + c[:m]
    g = torch.empty((b, z.shape[1]), dtype=cdt, device=z.device)
    torch.addcmul(beta[:, None], g_rows, alpha[:, None], out=g[:m]).mul_(soft)
    del g_rows, soft
    if t != 1.0 and lse1 is not None:
        g[:m] += torch.exp(z[:m] - lse1[:m, None]) * c[:m, None]
    if b > m:  # rows with CE only
        if lse1 is None:
            g[m:].zero_()
        else:
            torch.sub(z[m:], lse1[m:, None], out=g[m:]).exp_().mul_(c[m:, None])
    if lse1 is not None:
        g.index_put_((blk.ce_rows, blk.ce_labels), -c[blk.ce_rows], accumulate=True)
    return g


def _cells(blk, teacher: dict, mats) -> tuple[Tensor, Tensor]:
    """(column, chunk) of each stored entry of the block's teacher rows in the [V_t + 2, C] buffers."""
    ids = closed_form.take_rows(teacher["teacher_ids"], blk.teacher_rows)  # [M, k]
    v_t = mats[0].shape[0] - 2
    return torch.where(ids >= 0, ids, v_t + 1), blk.teacher_chunk[:, None].expand_as(ids)
