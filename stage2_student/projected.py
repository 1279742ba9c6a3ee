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

Two paths compute these.

- Support (CPU; a block whose union K of stored ids is at most `SUPPORT_BELOW` of the teacher ids, its
  entries few enough to keep): W restricted to K (about 2,000 of 49k teacher ids for 120 rows of a
  top-64 cache on the real pair). The forward exponentiates the block's rows in place (a scratch copy),
  takes q_i(t), t in K, of every row from one CSR product W_K^T e^T over a transposed copy of e at the
  student ids W_K has entries for (30-40% of the vocabulary there), and each row's mass outside K as
  e_i . w_out, w_out(s) = sum_{t not in K} W[s, t]; q_r = (mass outside K) + sum_{t in K - K_c} q_c(t)
  adds non-negative terms only. The backward writes softmax(u_i) * (alpha_i (W_K H_c + d_rest_c w_out)
  + beta_i): a rank-2 product, then one CSR product into the transposed view of the [rows, V] buffer;
  <softmax(u_i), G_c> comes per row from the forward. Its tables are [|K|, chunks]; its shapes depend on
  the data, which costs nothing on CPU.
- Dense (accelerators, where a data-dependent shape would read a device value back; wide caches; blocks
  whose ids cover much of the teacher vocabulary, as on the toy's 2k-id teacher, where it is about 1.8x
  faster): [V_t + 2, C] buffers (teacher ids by chunk) and the full W, products W^T pbar and W H.

Both run one exp pass over the rows per direction; docs/losses.md, "Step cost on the real pair", has
where the time goes. tests/test_closed_form.py checks values and gradients of both against
`losses.projected_kl` under autograd, and the two paths against each other at a wide teacher vocabulary.

    kd, ce, saved = forward(spec, z_rows, blk, teacher, scratch)                     # [C], CE sum, O(rows)
    g = gradient(spec, z_rows, blk, teacher, saved, grad_kd_chunks, grad_ce, scratch)   # [b, V]
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from stage2_student import closed_form, losses

SAVE_ENTRIES_BELOW = 1 / 16  # forward keeps dKL/dq of the stored entries for backward when k <= this x V_t
SUPPORT_DEVICES = ("cpu",)  # device types that take the support path
SUPPORT_BELOW = 1 / 4  # ... for a block whose union of stored ids is at most this share of the teacher ids
_CSR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # projection -> {(dtype, device): matrices}


class Saved(NamedTuple):
    """What forward keeps for `gradient`: O(rows), plus the stored entries' dKL/dq when they are few."""

    lse1: Tensor | None  # [b] CE's log-partition of every row (None: no CE rows)
    entries: tuple | None  # (dKL/dq at the stored entries [M, k], dKL/dq outside K_c [C], dense: <pbar_c, G_c> [C])
    lse: Tensor | None = None  # support path: [m] log-partition of the KD rows at T
    dot: Tensor | None = None  # support path: [m] <softmax(u_i), G_c> of each KD row


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


def _support_union(z: Tensor, blk, teacher: dict, mats) -> Tensor | None:
    """The block's union K of stored ids (ascending, padding as the empty column V_t + 1) where the support path
    takes the block: on `SUPPORT_DEVICES`, entries few enough to keep (`SAVE_ENTRIES_BELOW`) and K at most
    `SUPPORT_BELOW` of the teacher ids (else the dense buffers are about as small, and cheaper to index)."""
    n_cols = mats[0].shape[0]  # V_t + 2
    if z.device.type not in SUPPORT_DEVICES or teacher["teacher_ids"].shape[1] > SAVE_ENTRIES_BELOW * n_cols:
        return None
    union = _union(closed_form.take_rows(teacher["teacher_ids"], blk.teacher_rows), n_cols)
    return union if union.shape[0] <= SUPPORT_BELOW * (n_cols - 2) else None


def _union(ids: Tensor, n_cols: int) -> Tensor:
    """The distinct stored ids of `ids` [M, k], ascending, padding as the empty column n_cols - 1 (a CPU tensor:
    its data-dependent size costs no device read)."""
    marked = torch.zeros(n_cols, dtype=torch.bool, device=ids.device)
    marked[torch.where(ids >= 0, ids, n_cols - 1)] = True
    return marked.nonzero()[:, 0]


def forward(spec, z_rows: Tensor, blk, teacher: dict, scratch=None) -> tuple[Tensor, Tensor, Saved]:
    """(P-KL of each of the block's chunks [C], CE sum, what `gradient` needs). `z_rows` [b, V] is a copy of the
    block's logit rows that this may overwrite; `scratch` (`blocked.Scratch`) lends [rows, V]-sized buffers."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)  # [b, V]
    mats = _matrices(spec.projection, cdt, z.device)
    union = _support_union(z, blk, teacher, mats)
    if union is not None:
        return _support_forward(spec, z, blk, teacher, mats, union, scratch)
    m, t = blk.num_kd_rows, spec.temperature
    soft = _softmax(spec, z, m)
    lse1 = _ce_partition(spec, z, m, soft) if blk.ce_rows.shape[0] > 0 else None  # [b]
    p_bar = _chunk_means(soft, blk)
    del soft
    kl, parts = _dense_parts(spec, p_bar, blk, teacher, mats)
    keep = parts[1:] if teacher["teacher_ids"].shape[1] <= SAVE_ENTRIES_BELOW * mats[0].shape[0] else None
    return (kl if t == 1.0 else kl * t**2), closed_form.ce_sum(z, lse1, blk), Saved(lse1, keep)


def gradient(spec, z_rows: Tensor, blk, teacher: dict, saved: Saved, grad_kd: Tensor, grad_ce: Tensor,
             scratch=None) -> Tensor:
    """d(sum_c grad_kd[c] * P-KL_c + grad_ce * CE) / d z_rows, [b, V] in the compute dtype (grad_kd: [C]); may
    be written into `z_rows` (a copy of the block's rows) or a `scratch` buffer."""
    cdt = losses.compute_dtype(z_rows.dtype)
    z = z_rows.to(cdt)  # [b, V]
    mats = _matrices(spec.projection, cdt, z.device)
    c = torch.zeros(z.shape[0], dtype=cdt, device=z.device)  # CE weight of each row
    if saved.lse1 is not None:
        c = c.index_fill(0, blk.ce_rows, 1.0) * grad_ce.to(cdt)
    if saved.dot is not None:
        return _support_gradient(spec, z, blk, teacher, saved, grad_kd, c, mats, scratch)
    return _dense_gradient(spec, z, blk, teacher, saved, grad_kd, c, mats)


def _teacher(spec, blk, teacher: dict, v_t: int, cdt) -> tuple[Tensor, Tensor, Tensor]:
    """(stored ids [M, k], w_e = p_e / teacher rows of its chunk [M, k] (0: padding), the rest of each chunk
    p_r [C]) at the pass's temperature."""
    ids, log_p1, resid, _ = closed_form.stored(blk, teacher, cdt)
    log_p, p_rest = losses.temper_teacher(log_p1, resid, spec.temperature, tail=spec.tail, vocab_size=v_t,
                                          valid=None)  # [M, k], [M] (`stored` masked the padding)
    t_w = blk.teacher_row_weight.to(cdt)  # [M] 1 / teacher rows of the row's chunk
    p_rest_c = torch.zeros(blk.num_chunks, dtype=cdt, device=ids.device).index_add_(0, blk.teacher_chunk, p_rest * t_w)
    return ids, log_p.exp().mul_(t_w[:, None]), p_rest_c


def _kl_terms(blk, q_at: Tensor, q_rest: Tensor, p_at: Tensor, w_e: Tensor, p_rest_c: Tensor,
              no_rest: Tensor, divergence: str = "forward", beta: float = 0.5,
              reverse_weight: float = 0.5) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(divergence of each chunk [C] unscaled by T^2, its derivative by q at the stored entries [M, k] and
    outside K_c [C], <pbar_c, G_c> [C]) from q_c and p_c at each entry's (chunk, id) [M, k], q_r [C], w_e
    [M, k], p_r [C] and the chunks whose K_c holds every column with entries [C]. `divergence`: forward
    (KL(p || q), P-KL), reverse (KL(q || p)), jsd (generalized JSD(beta)) or forward-reverse ((1 - w) forward
    + w reverse, w = `reverse_weight`)."""
    if divergence == "forward-reverse":  # every output is linear in the divergence: the same mix of the two's
        both = (_kl_terms(blk, q_at, q_rest, p_at, w_e, p_rest_c, no_rest, kind) for kind in ("forward", "reverse"))
        return tuple((1.0 - reverse_weight) * f + reverse_weight * r for f, r in zip(*both))
    cdt, dev = q_at.dtype, q_at.device
    drop = no_rest & (p_rest_c > 0)  # as losses.drop_unreachable_rest
    scale = torch.where(drop, 1.0 / (1.0 - p_rest_c.clamp(max=1.0 - 1e-7)), torch.ones_like(p_rest_c))  # [C]
    p_rest_c = torch.where(drop, torch.zeros_like(p_rest_c), p_rest_c)
    if divergence != "forward":
        return _other_terms(blk, q_at, q_rest, p_at, w_e, p_rest_c, scale, divergence, beta)
    # the teacher's entropy on K_c: sum over distinct ids of p_c log p_c = sum_e w_e log p_c(t_e)
    ent_e = torch.xlogy(w_e, p_at)  # [M, k]
    log_q = q_at.clamp(min=losses.PROB_FLOOR).log()  # [M, k]
    zero = torch.zeros((), dtype=cdt, device=dev)
    d_e = torch.where(q_at >= losses.PROB_FLOOR, -w_e / q_at, zero)  # [M, k] dKL/dq, times scale below
    per_row = torch.stack([ent_e.sum(dim=-1), (w_e * log_q).sum(dim=-1), w_e.sum(dim=-1), (d_e * q_at).sum(dim=-1)],
                          dim=1)  # [M, 4]
    ent, cross, mass, dot = torch.zeros((blk.num_chunks, 4), dtype=cdt, device=dev).index_add_(
        0, blk.teacher_chunk, per_row).unbind(1)  # [C] each
    kl = scale * (ent - cross) + torch.xlogy(scale, scale) * mass
    kl = kl + losses.divergence("kl", losses.safe_log(p_rest_c)[:, None], losses.safe_log(q_rest)[:, None])  # [C]
    d_rest = torch.where((p_rest_c > 0) & (q_rest > 0), -p_rest_c / q_rest, zero)  # [C]
    return kl, d_e.mul_(scale[blk.teacher_chunk][:, None]), d_rest, scale * dot + d_rest * q_rest


def _other_terms(blk, q_at: Tensor, q_rest: Tensor, p_at: Tensor, w_e: Tensor, p_rest_c: Tensor, scale: Tensor,
                 divergence: str, beta: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_kl_terms` for the reverse and jsd divergences, over the same buckets (K_c and the
    rest). A bucket's value and derivative are functions of its (p, q); the entries of one (chunk, id)
    carry them in proportion to their share f_e = w_e / p_c of its teacher probability:

        reverse: q log(q / p),                                  d/dq = log(q / p) + 1
        jsd:     beta p log(p / m) + (1 - beta) q log(q / m),   d/dq = (1 - beta) log(q / m),  m = beta p + (1 - beta) q
    """
    cdt, dev = q_at.dtype, q_at.device
    zero = torch.zeros((), dtype=cdt, device=dev)
    pt = p_at * scale[blk.teacher_chunk][:, None]  # [M, k] the teacher's bucket, renormalised where its rest drops
    f_e = torch.where(p_at > 0, w_e / torch.where(p_at > 0, p_at, 1.0), zero)  # [M, k]; padding 0
    log_q, log_p = q_at.clamp(min=losses.PROB_FLOOR).log(), losses.safe_log(pt).clamp(min=losses.LOG_FLOOR)
    has_r = q_rest > 0
    log_qr = q_rest.clamp(min=losses.PROB_FLOOR).log()
    log_pr = losses.safe_log(p_rest_c).clamp(min=losses.LOG_FLOOR)

    def reverse():
        return (torch.xlogy(q_at, q_at) - q_at * log_p, log_q - log_p + 1.0,
                torch.xlogy(q_rest, q_rest) - q_rest * log_pr, torch.where(has_r, log_qr - log_pr + 1.0, zero))

    def jsd():
        log_m = torch.log(beta * pt + (1.0 - beta) * q_at).clamp(min=losses.LOG_FLOOR)
        m_r = beta * p_rest_c + (1.0 - beta) * q_rest
        log_mr = losses.safe_log(m_r).clamp(min=losses.LOG_FLOOR)
        val = beta * (torch.xlogy(pt, pt) - pt * log_m) + (1.0 - beta) * (torch.xlogy(q_at, q_at) - q_at * log_m)
        val_r = beta * (torch.xlogy(p_rest_c, p_rest_c) - p_rest_c * log_mr) + (1.0 - beta) * (
            torch.xlogy(q_rest, q_rest) - q_rest * log_mr)
        return val, (1.0 - beta) * (log_q - log_m), torch.where(m_r > 0, val_r, zero), \
            torch.where(has_r, (1.0 - beta) * (log_qr - log_mr), zero)

    if divergence == "reverse":
        val, g, val_r, g_r = reverse()
    elif divergence == "jsd":
        val, g, val_r, g_r = jsd()
    else:
        raise ValueError(f"divergence {divergence!r}: use forward, reverse, jsd or forward-reverse")
    d_e = torch.where(f_e > 0, f_e * g, zero)  # [M, k]
    per_row = torch.stack([torch.where(f_e > 0, f_e * val, zero).sum(dim=-1), (d_e * q_at).sum(dim=-1)], dim=1)
    value, dot = torch.zeros((blk.num_chunks, 2), dtype=cdt, device=dev).index_add_(
        0, blk.teacher_chunk, per_row).unbind(1)  # [C] each
    return value + val_r, d_e, g_r, dot + g_r * q_rest


# ---------------------------------------------------------------------------------------------------------
# support path: W restricted to the block's union of stored ids


@dataclass
class _Support:
    """The block's union K of stored teacher ids and W restricted to it."""

    cell: Tensor  # int64 [M, k] each stored entry's cell in [|K|, C] tables: position of its id in K x C + chunk
    w_kt: Tensor  # CSR [|K|, V_s] the rows of W^T for K
    w_out: Tensor  # [V_s] sum_{t not in K} W[s, t] (unmapped column included): a sum of non-negative terms
    has: Tensor  # bool [|K|] the columns of K with entries


def _support(ids: Tensor, cols: Tensor, blk, mats, cdt) -> _Support:
    """W on the union K `cols` of the block's stored ids `ids` [M, k]; O(M k + V_t + nnz(W))."""
    w_t, w, has, _, _ = mats
    n_cols = w_t.shape[0]  # V_t + 2
    ids = torch.where(ids >= 0, ids, n_cols - 1)  # [M, k]
    pos = torch.empty(n_cols, dtype=torch.int64, device=ids.device)
    pos[cols] = torch.arange(cols.shape[0], device=ids.device)
    crow = w_t.crow_indices()
    start, count = crow[cols], crow[cols + 1] - crow[cols]  # [|K|]
    ends = count.cumsum(0)
    picked = torch.arange(int(ends[-1]), device=ids.device) + torch.repeat_interleave(start - ends + count, count)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        w_kt = torch.sparse_csr_tensor(torch.cat([ends.new_zeros(1), ends]), w_t.col_indices()[picked],
                                       w_t.values()[picked], (cols.shape[0], w_t.shape[1]))
    outside = torch.ones((n_cols, 1), dtype=cdt, device=ids.device).index_fill_(0, cols, 0.0)
    w_out = torch.sparse.mm(w, outside)[:, 0]  # [V_s]
    return _Support(cell=pos[ids] * blk.num_chunks + blk.teacher_chunk[:, None], w_kt=w_kt, w_out=w_out,
                    has=has[cols])


def _touched(w_kt: Tensor) -> tuple[Tensor, Tensor]:
    """(the student ids with an entry in W_K^T [|S|], ascending; W_K^T on those columns, CSR [|K|, |S|])."""
    cols = w_kt.col_indices()
    marked = torch.zeros(w_kt.shape[1], dtype=torch.bool, device=cols.device)
    marked[cols] = True
    touched = marked.nonzero()[:, 0]
    pos = torch.empty(w_kt.shape[1], dtype=torch.int64, device=cols.device)
    pos[touched] = torch.arange(touched.shape[0], device=cols.device)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        return touched, torch.sparse_csr_tensor(w_kt.crow_indices(), pos[cols], w_kt.values(),
                                                (w_kt.shape[0], touched.shape[0]))


def _by_chunk(rows: Tensor, blk) -> Tensor:
    """The mean over each chunk's rows of `rows` [..., m] -> [..., C]."""
    sc = blk.student_chunk
    if rows.shape[-1] == blk.num_chunks:  # one row per chunk
        return torch.empty_like(rows).index_copy_(-1, sc, rows)
    out = rows.new_zeros((*rows.shape[:-1], blk.num_chunks))
    return out.index_add_(-1, sc, rows * blk.inv_student_rows.to(rows.dtype)[sc])


def _support_forward(spec, z: Tensor, blk, teacher: dict, mats, union: Tensor, scratch) -> tuple[Tensor, Tensor, Saved]:
    m, t = blk.num_kd_rows, spec.temperature
    has_ce = blk.ce_rows.shape[0] > 0
    label_logit = z[blk.ce_rows, blk.ce_labels] if has_ce else None  # [e], read before z is overwritten
    lse1 = torch.logsumexp(z, dim=-1) if has_ce and t != 1.0 else None  # [b] CE's, of the untempered rows
    u = z[:m] if t == 1.0 else z[:m].div_(t)  # [m, V]
    top = u.amax(dim=-1)  # [m]
    e = u.sub_(top[:, None]).exp_()  # [m, V] exp(u - max u), in place of z
    total = e.sum(dim=-1)  # [m]
    lse = top + total.log()  # [m]
    if has_ce and t == 1.0:
        lse1 = torch.cat([lse, torch.logsumexp(z[m:], dim=-1)])
    ids, w_e, p_rest_c = _teacher(spec, blk, teacher, mats[0].shape[0] - 2, z.dtype)
    sup = _support(ids, union, blk, mats, z.dtype)
    # the CSR product wants the rows as columns: a transposed copy of the student ids W_K has entries for only
    touched, w_kt = _touched(sup.w_kt)  # [|S|] (30-40% of the vocabulary on the real pair), CSR [|K|, |S|]
    e_t = torch.index_select(e.t(), 0, touched, out=_take(scratch, "pkl_t", (touched.shape[0], m), e))  # [|S|, m]
    q_rows = torch.sparse.mm(w_kt, e_t).div_(total)  # [|K|, m] q_i(t) = sum_s softmax(u_i)(s) W[s, t]
    del e_t
    n_k, n_c, sc = q_rows.shape[0], blk.num_chunks, blk.student_chunk
    flat = sup.cell.reshape(-1)  # [M k]
    in_k = torch.zeros(n_k * n_c, dtype=torch.bool, device=z.device).index_fill_(0, flat, True).view(n_k, n_c)
    q_rest_rows = (e @ sup.w_out).div_(total) + torch.where(in_k[:, sc], 0.0, q_rows).sum(dim=0)  # [m] q_r of each row
    q_at = _by_chunk(q_rows, blk).view(-1)[sup.cell]  # [M, k] q_c at each entry's id
    p_at = torch.zeros(n_k * n_c, dtype=z.dtype, device=z.device).index_add_(0, flat, w_e.view(-1))[sup.cell]
    no_rest = _support_no_rest(in_k, sup, mats)
    kl, d_e, d_rest, _ = _kl_terms(blk, q_at, _by_chunk(q_rest_rows, blk), p_at, w_e, p_rest_c, no_rest,
                                   spec.divergence, spec.beta, spec.reverse_weight)
    h = torch.zeros(n_k * n_c, dtype=z.dtype, device=z.device).index_add_(0, flat, d_e.view(-1)).view(n_k, n_c)
    dot = (h[:, sc] * q_rows).sum(dim=0) + d_rest[sc] * q_rest_rows  # [m] <softmax(u_i), G_c>
    ce = -(label_logit - lse1[blk.ce_rows]).sum() if has_ce else z.new_zeros(())
    return (kl if t == 1.0 else kl * t**2), ce, Saved(lse1, (d_e, d_rest), lse, dot)


def _support_no_rest(in_k: Tensor, sup: _Support, mats) -> Tensor:
    """Chunks whose K_c holds every column with entries [C] (never, with an unmapped student token)."""
    if mats[4]:
        return torch.zeros(in_k.shape[1], dtype=torch.bool, device=in_k.device)
    return (in_k & sup.has[:, None]).sum(dim=0) == mats[3]


def _support_gradient(spec, z: Tensor, blk, teacher: dict, saved: Saved, grad_kd: Tensor, c: Tensor, mats,
                      scratch) -> Tensor:
    cdt, (d_e, d_rest), dot = z.dtype, saved.entries, saved.dot
    m, t, v, n_c, sc = blk.num_kd_rows, spec.temperature, z.shape[1], blk.num_chunks, blk.student_chunk
    ids = closed_form.take_rows(teacher["teacher_ids"], blk.teacher_rows)
    sup = _support(ids, _union(ids, mats[0].shape[0]), blk, mats, cdt)
    n_k = sup.w_kt.shape[0]
    # H_c on K: the entries' sum on K_c, the rest's elsewhere; outside K it is the rest's, times w_out below
    flat = sup.cell.reshape(-1)
    h = d_rest.repeat(n_k, 1).view(-1).index_fill_(0, flat, 0.0)  # a copy: d_rest stays as saved
    h = h.index_add_(0, flat, d_e.reshape(-1)).view(n_k, n_c)
    alpha = (grad_kd.to(cdt) * blk.inv_student_rows.to(cdt)).index_select(0, sc) * t  # [m]
    beta = -alpha * dot + (c[:m] if t == 1.0 else 0.0)  # [m] (at T = 1 CE's softmax is the KD rows' softmax)
    # bracket_i = alpha_i (W_K H_c + d_rest_c w_out) + beta_i: a rank-2 product, then W_K H added through the
    # transposed view (the CSR product writes its [V, m] result straight into the [m, V] rows)
    bracket = _take(scratch, "pkl_b", (m, v), z)
    torch.mm(torch.stack([alpha * d_rest[sc], beta], dim=1), torch.stack([sup.w_out, torch.ones_like(sup.w_out)]),
             out=bracket)
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        w_k = sup.w_kt.t().to_sparse_csr()  # [V_s, |K|]
    bracket.t().addmm_(w_k, h.index_select(1, sc).mul_(alpha))
    ce_soft = None
    if t != 1.0 and saved.lse1 is not None:  # CE's softmax of the untempered rows, before z is overwritten
        ce_soft = torch.exp(z[:m] - saved.lse1[:m, None]).mul_(c[:m, None])
    u = z[:m] if t == 1.0 else z[:m].div_(t)
    g = z
    u.sub_(saved.lse[:, None]).exp_().mul_(bracket)  # g[:m]
    if ce_soft is not None:
        g[:m] += ce_soft
    if z.shape[0] > m:  # rows with CE only
        if saved.lse1 is None:
            g[m:].zero_()
        else:
            g[m:].sub_(saved.lse1[m:, None]).exp_().mul_(c[m:, None])
    if saved.lse1 is not None:
        g.index_put_((blk.ce_rows, blk.ce_labels), -c[blk.ce_rows], accumulate=True)
    return g


def _take(scratch, name: str, shape: tuple, like: Tensor) -> Tensor:
    """A buffer of `shape` from `scratch` (contents undefined), or a fresh one without."""
    if scratch is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return scratch.take(name, shape, like.dtype)


# ---------------------------------------------------------------------------------------------------------
# dense path: [V_t + 2, C] buffers and the full W


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


def _dense_parts(spec, p_bar: Tensor, blk, teacher: dict, mats) -> tuple[Tensor, tuple]:
    """(KL of each chunk [C] at the pass's temperature, unscaled by T^2; (entries, dKL/dq at the stored entries
    [M, k], dKL/dq outside K_c [C], <pbar_c, G_c> [C])): everything but the [V_t + 2, C] buffers is O(M k)."""
    w_t, _, has, n_cols, unmapped = mats
    v_t = w_t.shape[0] - 2
    ids, w_e, p_rest_c = _teacher(spec, blk, teacher, v_t, p_bar.dtype)
    at = (torch.where(ids >= 0, ids, v_t + 1), blk.teacher_chunk[:, None].expand_as(ids))  # buffer cells [M, k]
    q = torch.sparse.mm(w_t, p_bar.t())  # [V_t + 2, C] q_c = W^T pbar_c, column by column
    q_at = q[at]  # [M, k] (padding: the empty column, 0)
    q[at] = 0.0
    q_rest = q.sum(dim=0)  # [C] the student's mass outside K_c, unmapped tokens included
    no_rest = _no_rest(ids, at, blk, has, n_cols, unmapped, q.shape)
    p_at = q.index_put_(at, w_e, accumulate=True)[at]  # [M, k] p_c at each entry's id (q is 0 on K_c)
    del q
    kl, d_e, d_rest, dot = _kl_terms(blk, q_at, q_rest, p_at, w_e, p_rest_c, no_rest, spec.divergence, spec.beta,
                                     spec.reverse_weight)
    return kl, (at, d_e, d_rest, dot)


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


def _dense_gradient(spec, z: Tensor, blk, teacher: dict, saved: Saved, grad_kd: Tensor, c: Tensor, mats) -> Tensor:
    cdt, lse1, keep = z.dtype, saved.lse1, saved.entries
    m, t, b = blk.num_kd_rows, spec.temperature, z.shape[0]
    soft = _softmax(spec, z, m)
    if keep is None:
        _, (at, d_e, d_rest, dot) = _dense_parts(spec, _chunk_means(soft, blk), blk, teacher, mats)
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

