"""CE and forward KL (top-k, full, sampled) of one block with their gradient in closed form.

`stage2_student.blocked` calls these for blocks whose pass is CE only (`--loss ce`) or forward KL
(`kl`, `sampled`), and for every CE-only block; P-KL has its own closed form (`stage2_student.projected`),
the other losses recompute their block under autograd. Forward keeps three
log-partitions per row (O(rows)); backward writes the block's gradient in one exp pass over the
vocabulary plus O(k) fixes at the stored ids, instead of re-running the block's graph (about ten
passes over [rows, V]). The values are the same formulas as `losses` (docs/losses.md):

    KL_row = T^2 [ sum_{i in S} p_i (log p_i - log q_i) + p_r (log p_r - log q_r) ]
    q = softmax(z / T), log q_r = logsumexp_{j not in S}(z_j / T) - lse   (exact at any outside mass)
    CE_row = logsumexp(z) - z_label

and, with P = sum_i p_i + p_r (1 up to rounding), the gradient of a * KL_row + c * CE_row is

    j not in S: T a exp(u_j - lse_out) (P q_r - p_r) + c softmax(z)_j      (u = z / T)
    j in S:     T a (P q_j - sum_{i: id_i = j} p_i) + c softmax(z)_j
    label y:    - c

`exp(u_j - lse_out)` is at most 1 outside S, so no term overflows however small q_r is; the
stored ids' entries are overwritten afterwards (there that factor may be inf). tests/test_closed_form.py
checks values and gradients against the same losses under autograd (`blocked._block_terms`),
tests/test_losses.py against dense fp64 references.

    kd, ce, saved = forward(spec, z_rows, blk, teacher, scratch)          # in _BlockedTerms.forward
    g = gradient(spec, z_rows, blk, teacher, saved, grad_kd_rows, grad_ce, scratch)   # [b, V], in backward
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stage2_student import losses

KINDS = (None, "kl", "sampled")  # the passes computed here; the others go through autograd


def take_rows(t: Tensor, sel) -> Tensor:
    """The rows `sel` of `t`: a (start, end) slice (a view) or an index tensor."""
    return t[sel[0]:sel[1]] if isinstance(sel, tuple) else t.index_select(0, sel)


def log_partition(u: Tensor, soft: Tensor | None = None) -> Tensor:
    """logsumexp(u) of each row [m], from its softmax (computed here unless given): max u - log max softmax(u),
    where the softmax is at least 1 / V, so its log keeps its digits. Two fast reductions and one fused pass,
    about half the time of `torch.logsumexp` on CPU (which writes and exps a shifted copy)."""
    if soft is None:
        soft = torch.softmax(u, dim=-1)
    return u.amax(dim=-1) - soft.amax(dim=-1).log()


def support_targets(ids: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """(column of each stored slot [m, k], row has a stored id [m]): a padding slot points at its row's first
    stored id (written twice with the same value), or at column 0 in a row with none (written with the value
    already there), so that the [m, V] buffers need no extra column (a strided view is 2-3x slower to fill)."""
    has, first = valid.max(dim=1)  # [m] any stored id, the first one's slot (0 if none)
    first = ids.gather(1, first[:, None]).clamp(min=0)  # [m, 1]
    return torch.where(valid, ids, first), has


def stored(blk, teacher: dict, cdt) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The block's teacher rows at T = 1: (ids [m, k], log p [m, k] (-inf: padding and any value that is not
    finite, as `temper_teacher(valid=...)` would mask it), residual [m], valid [m, k])."""
    ids = take_rows(teacher["teacher_ids"], blk.teacher_rows)  # [m, k]
    lp, cnt, res = (teacher.get(key) for key in ("teacher_logprobs", "teacher_counts", "teacher_residual"))
    log_p1, resid = losses.teacher_logprobs(ids, None if lp is None else take_rows(lp, blk.teacher_rows),
                                            None if cnt is None else take_rows(cnt, blk.teacher_rows),
                                            None if res is None else take_rows(res, blk.teacher_rows), cdt)
    log_p1 = torch.nan_to_num(log_p1, nan=-math.inf, posinf=-math.inf, neginf=-math.inf)  # 4x faster than masked_fill
    return ids, log_p1, resid, log_p1 > -math.inf


def _tempered(spec, log_p1: Tensor, resid: Tensor, valid: Tensor, vocab: int, lse_out: Tensor) -> tuple[Tensor, Tensor]:
    """(log p [m, k], p_rest [m]) at the pass's temperature, the rest dropped where the student has none."""
    log_p, p_rest = losses.temper_teacher(log_p1, resid, spec.temperature, tail=spec.tail, vocab_size=vocab,
                                          valid=None)  # `stored` masked the padding
    return losses.drop_unreachable_rest(log_p, p_rest, torch.isneginf(lse_out))


def forward(spec, z_rows: Tensor, blk, teacher: dict, scratch=None) -> tuple[Tensor, Tensor, tuple]:
    """(KD of each KD row [m], CE sum, what `gradient` needs: O(rows)) of one block (`scratch`: unused here)."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)  # [b, V]
    t, m, vocab = spec.temperature, blk.num_kd_rows, z.shape[1]
    has_ce = blk.ce_rows.shape[0] > 0
    if spec.kind is None or m == 0:
        lse1 = torch.logsumexp(z, dim=-1) if has_ce else None  # [b]
        return z.new_zeros(blk.kd_chunk.shape[0]), ce_sum(z, lse1, blk), (None, None, lse1)
    u = z[:m] if t == 1.0 else z[:m] / t  # [m, V]
    ids, log_p1, resid, valid = stored(blk, teacher, cdt)
    target, has = support_targets(ids, valid)
    # the support set 1e4 below the row's minimum, where exp underflows to exactly 0 as -inf would; a row
    # whose every id is stored then stays finite (exp of inf / NaN takes a 17x slower path on CPU)
    u_min = u.amin(dim=-1)  # [m]
    masked = u.clone()  # [m, V]
    masked.scatter_(1, target, torch.where(has, u_min - 1e4, u[:, 0])[:, None].expand_as(target))
    lse_out = log_partition(masked)  # [m]
    del masked
    lse_out = torch.where(lse_out < u_min, -math.inf, lse_out)  # -inf: nothing outside the support
    lse = log_partition(u)  # [m]
    lse1 = None  # CE's log-partition: of the untempered rows; at T = 1 the KD rows' lse
    if has_ce:
        lse1 = torch.cat([lse, torch.logsumexp(z[m:], dim=-1)]) if t == 1.0 else torch.logsumexp(z, dim=-1)
    log_p, p_rest = _tempered(spec, log_p1, resid, valid, vocab, lse_out)
    p = log_p.exp().nan_to_num_(nan=0.0)  # [m, k] (NaN of a row with no stored id and no rest: 0)
    # sum_i p_i (log p_i - log q_i), log q_i = u_i - lse, 0 where p_i = 0 (padding: log p_i = -inf taken as 0)
    terms = torch.nan_to_num(log_p, nan=0.0, neginf=0.0).sub_(u.gather(1, target)).add_(lse[:, None]).mul_(p)
    kd = terms.sum(dim=-1)  # [m]
    kd = kd + losses.divergence("kl", losses.safe_log(p_rest)[:, None], (lse_out - lse)[:, None])  # [m]
    return (kd if t == 1.0 else kd * t**2), ce_sum(z, lse1, blk), (lse, lse_out, lse1)


def ce_sum(z: Tensor, lse1: Tensor | None, blk) -> Tensor:
    """CE summed over the block's labelled rows, from their log-partitions `lse1` [b] (None: no CE rows)."""
    if lse1 is None:
        return torch.zeros((), dtype=z.dtype, device=z.device)
    return -(z[blk.ce_rows, blk.ce_labels] - lse1[blk.ce_rows]).sum()


def gradient(spec, z_rows: Tensor, blk, teacher: dict, saved: tuple, grad_kd_rows: Tensor | None,
             grad_ce: Tensor, scratch=None) -> Tensor:
    """d(sum_rows grad_kd_rows * KD_row + grad_ce * CE) / d z_rows, [b, V] in the compute dtype, written into a
    `scratch` buffer (`blocked.Scratch`) when one is given."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)  # [b, V]
    lse, lse_out, lse1 = saved
    t, b, vocab = spec.temperature, z.shape[0], z.shape[1]
    m = 0 if lse is None else blk.num_kd_rows
    c = torch.zeros(b, dtype=cdt, device=z.device)  # CE weight of each row
    if lse1 is not None:
        c = c.index_fill(0, blk.ce_rows, 1.0) * grad_ce.to(cdt)
    if scratch is None:
        g = torch.empty((b, vocab), dtype=cdt, device=z.device)
    else:
        g = scratch.take("grad", (b, vocab), cdt)
    if m:
        u = z[:m] if t == 1.0 else z[:m] / t  # [m, V]
        ids, log_p1, resid, valid = stored(blk, teacher, cdt)
        log_p, p_rest = _tempered(spec, log_p1, resid, valid, vocab, lse_out)
        p = log_p.exp().nan_to_num_(nan=0.0)  # [m, k] (0 at padding; NaN of an empty row: 0, as in the KL)
        zero = torch.zeros((), dtype=cdt, device=z.device)
        p_rest = torch.where(p_rest > 0, p_rest, zero)
        big_p = p.sum(dim=-1) + p_rest  # [m]
        a = grad_kd_rows.to(cdt) * t  # [m]
        q_r = torch.exp(lse_out - lse)  # [m]
        outside = a * (big_p * q_r - p_rest)  # [m]
        # a row with nothing outside its support is overwritten below: its pass runs on finite values (lse)
        ref = torch.where(torch.isneginf(lse_out), lse, lse_out)[:, None]
        if t == 1.0:  # c softmax(z)_j = c q_r exp(u_j - lse_out): one exp pass for both terms
            torch.sub(u, ref, out=g[:m]).exp_().mul_((outside + c[:m] * q_r)[:, None])
        else:
            torch.sub(u, ref, out=g[:m]).exp_().mul_(outside[:, None])
            if lse1 is not None:
                g[:m] += torch.exp(z[:m] - lse1[:m, None]) * c[:m, None]
        target, has = support_targets(ids, valid)
        u_at = u.gather(1, target)  # [m, k]
        if t == 1.0:  # softmax(z) = q: one gather
            at_ids = torch.exp(u_at - lse[:, None]).mul_((a * big_p + c[:m])[:, None])
        else:
            at_ids = torch.exp(u_at - lse[:, None]).mul_((a * big_p)[:, None])
            if lse1 is not None:
                at_ids += c[:m, None] * torch.exp(z[:m].gather(1, target) - lse1[:m, None])
        at_ids = torch.where(has[:, None], at_ids, g[:m, :1])  # a row with no stored id keeps column 0
        g[:m].scatter_(1, target, at_ids)  # the support's entries (a repeated id gets the same value twice)
        g[:m].scatter_add_(1, target, -a[:, None] * p)
    if b > m:  # rows with CE only
        rest = g[m:]
        if lse1 is None:
            rest.zero_()
        else:
            torch.sub(z[m:], lse1[m:, None], out=rest).exp_().mul_(c[m:, None])
    if lse1 is not None:
        g.index_put_((blk.ce_rows, blk.ce_labels), -c[blk.ce_rows], accumulate=True)
    return g
