"""Stage 2 losses against brute-force references on tiny vocabularies.

    .venv/bin/python -m pytest -x -q tests/test_losses.py
"""

from __future__ import annotations

import math

import pytest
import torch

from stage2_student import losses
from xtcache.errors import XtcacheError

V = 11


def _teacher_topk(n_rows: int, vocab: int, k: int, gen: torch.Generator, dtype=torch.float64):
    """Random full teacher distributions, their top-k (ids, T=1 log-probs) and residual."""
    full = torch.log_softmax(torch.randn(n_rows, vocab, generator=gen, dtype=dtype) * 2, dim=-1)
    logp, ids = full.topk(k, dim=-1)
    residual = (1 - logp.exp().sum(-1)).clamp(min=0)
    if k == vocab:
        residual = torch.zeros_like(residual)
    return full, ids, logp, residual


def _ref_pair(logits, ids, logp, residual, temperature):
    """Dense reference: support + rest distributions (ghost tail) built with plain autograd ops."""
    log_q_full = torch.log_softmax(logits / temperature, dim=-1)
    q_k = log_q_full.gather(1, ids).exp()
    q = torch.cat([q_k, (1 - q_k.sum(-1, keepdim=True)).clamp(min=0)], dim=-1)
    tempered = torch.cat([logp / temperature, torch.log(residual.clamp(min=1e-300))[:, None] / temperature], -1)
    if (residual == 0).all():
        tempered = tempered[:, :-1]
    p = torch.softmax(tempered, dim=-1)
    if p.shape[1] == q.shape[1] - 1:
        p = torch.cat([p, torch.zeros_like(p[:, :1])], dim=-1)
    return p, q


def _kl(p, q):
    return torch.where(p > 0, p * (p.clamp(min=1e-300).log() - q.clamp(min=1e-300).log()), 0).sum()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_support_topk_kl_is_exact_kl(temperature):
    gen = torch.Generator().manual_seed(0)
    full, ids, logp, residual = _teacher_topk(6, V, V, gen)
    logits = torch.randn(6, V, generator=gen, dtype=torch.float64)
    rows = torch.arange(6)
    got = losses.topk_forward_kl(logits, rows, ids, logp, residual, temperature=temperature)
    p = torch.softmax(full / temperature, -1)
    q = torch.softmax(logits / temperature, -1)
    want = (p * (p.log() - q.log())).sum() * temperature**2
    assert got.count.item() == 6
    torch.testing.assert_close(got.total, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["forward", "reverse", "jsd"])
def test_topk_losses_match_dense_reference_and_gradients(name):
    gen = torch.Generator().manual_seed(1)
    _, ids, logp, residual = _teacher_topk(5, V, 4, gen)
    logits = torch.randn(7, V, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([0, 2, 3, 5, 6])
    t = 1.5
    fn = {"forward": losses.topk_forward_kl, "reverse": losses.topk_reverse_kl,
          "jsd": lambda *a, **kw: losses.topk_generalized_jsd(*a, beta=0.3, **kw)}[name]
    got = fn(logits, rows, ids, logp, residual, temperature=t, row_chunk=2).total
    p, q = _ref_pair(logits[rows], ids, logp, residual, t)
    if name == "forward":
        want = _kl(p, q)
    elif name == "reverse":
        want = _kl(q, p)
    else:
        m = 0.3 * p + 0.7 * q
        want = 0.3 * _kl(p, m) + 0.7 * _kl(q, m)
    want = want * t**2
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    (g_got,) = torch.autograd.grad(got, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want, rtol=1e-7, atol=1e-10)


def test_support_logprobs_gradcheck():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, V, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([4, 0, 2, 0])  # a repeated row accumulates its gradient
    ids = torch.randint(0, V, (4, 3), generator=gen)
    assert torch.autograd.gradcheck(
        lambda z: losses.student_support_logprobs(z, rows, ids, temperature=1.7, row_chunk=3), (logits,))


def test_jsd_limits_and_symmetry():
    gen = torch.Generator().manual_seed(3)
    _, ids, logp, residual = _teacher_topk(4, V, 5, gen)
    logits = torch.randn(4, V, generator=gen, dtype=torch.float64)
    rows = torch.arange(4)
    args = (logits, rows, ids, logp, residual)
    fwd = losses.topk_forward_kl(*args).total
    rev = losses.topk_reverse_kl(*args).total
    assert torch.equal(losses.topk_generalized_jsd(*args, beta=0.0).total, fwd)
    assert torch.equal(losses.topk_generalized_jsd(*args, beta=1.0).total, rev)
    eps = 1e-5
    torch.testing.assert_close(losses.topk_generalized_jsd(*args, beta=eps).total / eps, fwd, rtol=1e-3, atol=0)
    torch.testing.assert_close(losses.topk_generalized_jsd(*args, beta=1 - eps).total / eps, rev, rtol=1e-3, atol=0)
    assert fwd > 0 and rev > 0 and not torch.isclose(fwd, rev)
    # beta = 0.5 is symmetric: swap the roles of teacher and student on a full-vocab support
    full_t, ids_f, logp_f, res_f = _teacher_topk(3, V, V, gen)
    z = torch.randn(3, V, generator=gen, dtype=torch.float64)
    a = losses.topk_generalized_jsd(z, torch.arange(3), ids_f, logp_f, res_f, beta=0.5).total
    swapped_logp = torch.log_softmax(z, -1).gather(1, ids_f)
    b = losses.topk_generalized_jsd(full_t, torch.arange(3), ids_f, swapped_logp, res_f, beta=0.5).total
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError):
        losses.topk_generalized_jsd(*args, beta=1.5)


def test_sampled_kl_is_unbiased():
    gen = torch.Generator().manual_seed(4)
    n_rows, n_draws, trials = 3, 16, 3000
    p = torch.softmax(torch.randn(n_rows, V, generator=gen, dtype=torch.float64) * 2, -1)
    logits = torch.randn(n_rows, V, generator=gen, dtype=torch.float64)
    draws = torch.multinomial(p.repeat(trials, 1), n_draws, replacement=True, generator=gen)
    counts = torch.zeros(trials * n_rows, V, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64))
    # the store keeps unique ids + counts, padded: present ids first, padding count 0 with id -1
    order = counts.argsort(dim=-1, descending=True)
    k = int((counts > 0).sum(-1).max())
    ids = order[:, :k]
    cnt = counts.gather(1, ids)
    ids = torch.where(cnt > 0, ids, -1)
    big_logits = logits.repeat(trials, 1)
    got = losses.sampled_kl(big_logits, torch.arange(trials * n_rows), ids, cnt).total / trials
    full_ce = -(p * torch.log_softmax(logits, -1)).sum()
    torch.testing.assert_close(got, full_ce, rtol=0.01, atol=0)
    # the gradient of the sampled loss is that of the full KL, up to sampling noise
    z = logits.clone().requires_grad_(True)
    g_sample = torch.autograd.grad(losses.sampled_kl(z.repeat(trials, 1), torch.arange(trials * n_rows),
                                                     ids, cnt).total / trials, z)[0]
    g_full = torch.softmax(logits, -1) - p
    torch.testing.assert_close(g_sample, g_full, atol=0.02, rtol=0)


def _projection(v_s: int, v_t: int, gen) -> torch.Tensor:
    """Random sparse W [V_s, V_t], up to 3 entries per row, rows summing to 1; last teacher id unmapped."""
    dense = torch.zeros(v_s, v_t, dtype=torch.float64)
    for s in range(v_s):
        cols = torch.randperm(v_t - 1, generator=gen)[: 1 + s % 3]
        dense[s, cols] = torch.rand(len(cols), generator=gen, dtype=torch.float64) + 0.1
    dense /= dense.sum(-1, keepdim=True)
    return dense


def _pkl_batch(gen):
    """4 chunks: 1:1, 2:1 (two student logits), 1:2 (two teacher rows), 1:1; plus an invalid logit."""
    student_chunk = torch.tensor([[-1, 0, 1, 1, 2], [3, -1, -1, -1, -1]])
    teacher_chunk = torch.tensor([0, 1, 2, 2, 3])
    return student_chunk, teacher_chunk


def _dense_pkl(logits, student_chunk, logp, ids, teacher_chunk, w, temperature):
    """Reference P-KL with a dense W and per-row dense teacher vectors restricted to the stored ids."""
    flat = logits.reshape(-1, logits.shape[-1])
    sc = student_chunk.reshape(-1)
    total = 0
    n_chunks = int(teacher_chunk.max()) + 1
    for c in range(n_chunks):
        q = (torch.softmax(flat[sc == c] / temperature, -1) @ w).mean(0)  # [V_t]
        rows = (teacher_chunk == c).nonzero()[:, 0]
        support = torch.unique(ids[rows])
        p = torch.zeros(w.shape[1], dtype=torch.float64)
        p_rest = 0
        for r in rows:
            lp = logp[r]
            res = 1 - lp.exp().sum()
            pr = torch.softmax(torch.cat([lp, res.log()[None]]) / temperature, 0)
            p[ids[r]] += pr[:-1] / len(rows)
            p_rest = p_rest + pr[-1] / len(rows)
        pv, qv = p[support], q[support].clamp(min=losses.PROB_FLOOR)
        q_rest = 1 - q[support].sum()
        total = total + (pv * (pv.log() - qv.log())).sum() + p_rest * (torch.log(p_rest) - torch.log(q_rest))
    return total * temperature**2


def test_projected_kl_matches_dense_reference_and_chunking():
    gen = torch.Generator().manual_seed(5)
    v_s, v_t, k = 9, 13, 4
    w = _projection(v_s, v_t, gen)
    op = losses.ProjectionOperator(w.to_sparse())
    student_chunk, teacher_chunk = _pkl_batch(gen)
    _, ids, logp, residual = _teacher_topk(5, v_t, k, gen)
    if (ids[0] == v_t - 1).sum() == 0:
        ids[0, 0] = v_t - 1  # a stored id that no student token maps to: floored, finite
    logits = torch.randn(2, 5, v_s, generator=gen, dtype=torch.float64, requires_grad=True)
    args = (student_chunk, ids, logp, residual, teacher_chunk, 4, op)
    got = losses.projected_kl(logits, *args, temperature=1.3, row_chunk=2)
    want = _dense_pkl(logits, student_chunk, logp, ids, teacher_chunk, w, 1.3)
    assert got.count.item() == 4
    torch.testing.assert_close(got.total, want, rtol=1e-7, atol=1e-9)
    g_got = torch.autograd.grad(got.total, logits)[0]
    g_want = torch.autograd.grad(want, logits)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-9)
    unchunked = losses.projected_kl(logits, *args, temperature=1.3, row_chunk=1024)
    torch.testing.assert_close(unchunked.total, got.total, rtol=1e-12, atol=1e-12)
    assert torch.equal(g_got[0, 0], torch.zeros(v_s))  # a logit in no valid chunk gets no gradient


def test_projected_kl_bf16_logits_compute_in_fp32():
    gen = torch.Generator().manual_seed(6)
    w = _projection(9, 13, gen)
    op = losses.ProjectionOperator(w.float().to_sparse())
    student_chunk, teacher_chunk = _pkl_batch(gen)
    _, ids, logp, residual = _teacher_topk(5, 13, 4, gen, dtype=torch.float32)
    logits = torch.randn(2, 5, 9, generator=gen).to(torch.bfloat16).requires_grad_(True)
    out = losses.projected_kl(logits, student_chunk, ids, logp, residual, teacher_chunk, 4, op)
    assert out.total.dtype == torch.float32 and torch.isfinite(out.total)
    out.total.backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_projected_kl_empty_mapped_support_and_no_chunk_raise():
    gen = torch.Generator().manual_seed(7)
    w = _projection(9, 13, gen)
    op = losses.ProjectionOperator(w.to_sparse())
    student_chunk, teacher_chunk = _pkl_batch(gen)
    _, ids, logp, residual = _teacher_topk(5, 13, 4, gen)
    logits = torch.randn(2, 5, 9, generator=gen, dtype=torch.float64)
    unmapped = torch.full_like(ids, 12)  # the last teacher id is never a target of W
    with pytest.raises(losses.EmptyMappedSupportError, match="projection"):
        losses.projected_kl(logits, student_chunk, unmapped, logp, residual, teacher_chunk, 4, op)
    with pytest.raises(losses.NoValidChunksError):
        losses.projected_kl(logits, torch.full_like(student_chunk, -1), ids[:0], logp[:0], residual[:0],
                            teacher_chunk[:0], 0, op)
    with pytest.raises(XtcacheError):
        losses.same_tokenizer_rows(torch.full((2, 3), -1), 0)
    with pytest.raises(XtcacheError):
        losses.topk_forward_kl(logits[0], torch.zeros(0, dtype=torch.int64), ids[:0], logp[:0], residual[:0])


def test_projection_operator_columns_and_student_top():
    gen = torch.Generator().manual_seed(8)
    w = _projection(9, 13, gen)
    op = losses.ProjectionOperator(w.float().to_sparse())
    cols = torch.tensor([0, 3, 12, 7])
    torch.testing.assert_close(op.columns(cols).to_dense(), w.float()[:, cols].t())
    assert torch.equal(op.student_top, w.argmax(dim=1))


def test_identity_projection_pkl_equals_topk_forward_kl():
    """With W = I and one logit and one row per chunk, P-KL is the same-tokenizer top-k KL."""
    gen = torch.Generator().manual_seed(9)
    op = losses.ProjectionOperator(torch.eye(V, dtype=torch.float64).to_sparse())
    _, ids, logp, residual = _teacher_topk(4, V, 5, gen)
    logits = torch.randn(1, 6, V, generator=gen, dtype=torch.float64)
    student_chunk = torch.tensor([[2, -1, 0, 3, 1, -1]])
    pkl = losses.projected_kl(logits, student_chunk, ids, logp, residual, torch.arange(4), 4, op,
                              temperature=2.0)
    rows = losses.same_tokenizer_rows(student_chunk, 4)
    assert rows.tolist() == [2, 4, 0, 3]
    kl = losses.topk_forward_kl(logits.reshape(-1, V), rows, ids, logp, residual, temperature=2.0)
    torch.testing.assert_close(pkl.total, kl.total, rtol=1e-6, atol=1e-9)


def test_chunk_likelihood_matches_direct_formula():
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 5, V, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (2, 5), generator=gen)
    student_chunk, teacher_chunk = _pkl_batch(gen)
    realized = -torch.rand(5, generator=gen, dtype=torch.float64) * 3
    tau = 2.0
    got = losses.chunk_likelihood_loss(logits, labels, student_chunk, realized, teacher_chunk, 4, tau=tau,
                                       row_chunk=2)
    logq = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0].reshape(-1)
    want = 0
    for c in range(4):
        log_ps = logq[student_chunk.reshape(-1) == c].sum()
        a = torch.exp(realized[teacher_chunk == c].sum() / tau)
        b = torch.exp(log_ps / tau)
        want = want - (a * torch.log(b) + (1 - a) * torch.log(1 - b))
    torch.testing.assert_close(got.total, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(got.total, logits)[0], torch.autograd.grad(want, logits)[0])


def test_cross_entropy_and_row_chunking_equal_unchunked():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 7, V, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (3, 7), generator=gen)
    labels[0, -1] = labels[2, 3] = -100
    ce = losses.cross_entropy(logits, labels, row_chunk=4)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(ce.total, want)
    assert ce.count.item() == 19
    big = losses.cross_entropy(logits, labels, row_chunk=10_000)
    torch.testing.assert_close(big.total, ce.total, rtol=1e-14, atol=0)


def test_combine_losses_fixed_and_dynamic():
    kd = torch.tensor(4.0, requires_grad=True)
    ce = torch.tensor(2.0, requires_grad=True)
    fixed = losses.combine_losses(kd, ce)
    assert math.isclose(fixed.item(), 4.0 + 0.2, rel_tol=1e-6)
    dyn = losses.combine_losses(kd, ce, dynamic=True)
    assert math.isclose(dyn.item(), 2.0 + 0.2, rel_tol=1e-6)
    (g_kd,) = torch.autograd.grad(dyn, kd)
    assert math.isclose(g_kd.item(), 0.5, rel_tol=1e-6)  # the scale is a constant: d/dKD = |CE| / |KD|


def test_top1_agreement_and_valid_share():
    logits = torch.full((1, 4, 5), -5.0)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 2, 2] = 5.0
    student_chunk = torch.tensor([[0, 1, 1, -1]])
    teacher_ids = torch.tensor([[7, 8], [9, 6]])
    teacher_logprobs = torch.tensor([[-0.1, -3.0], [-2.0, -0.5]])
    to_teacher = torch.tensor([0, 7, 1, 6, 2])
    agree, total = losses.top1_agreement(logits, student_chunk, teacher_ids, teacher_logprobs,
                                         torch.tensor([0, 1]), 2, student_to_teacher=to_teacher)
    assert (agree.item(), total.item()) == (2.0, 2.0)
    labels = torch.tensor([[3, 3, 3, -100]])
    assert losses.valid_chunk_share(student_chunk, labels) == 1.0
    assert losses.valid_chunk_share(torch.tensor([[0, -1, 1, -1]]), labels) == pytest.approx(2 / 3)


def test_backward_keeps_no_full_vocab_fp32_block():
    """Autograd saves no fp32 [rows, V] tensor: the softmax blocks are recomputed in backward."""
    gen = torch.Generator().manual_seed(12)
    v, n = 300, 64
    logits = torch.randn(n, v, generator=gen).to(torch.bfloat16).requires_grad_(True)
    _, ids, logp, residual = _teacher_topk(n, v, 8, gen, dtype=torch.float32)
    op = losses.ProjectionOperator(_projection(v, 40, gen).float().to_sparse())
    student_chunk = torch.arange(n).reshape(1, n) // 2  # 2 logits per chunk
    saved = []

    def pack(t):
        if t.dtype == torch.float32 and t.dim() == 2 and t.shape[-1] == v:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kl = losses.topk_forward_kl(logits, torch.arange(n), ids, logp, residual, row_chunk=16)
        pkl = losses.projected_kl(logits[None], student_chunk, ids[:32] % 40, logp[:32], residual[:32],
                                  torch.arange(32), 32, op, row_chunk=16)
    (kl.total + pkl.total).backward()
    assert saved == [] and torch.isfinite(logits.grad.float()).all()


def test_make_kd_loss_dispatches_on_batch_dicts():
    gen = torch.Generator().manual_seed(13)
    _, ids, logp, residual = _teacher_topk(3, V, 4, gen)
    logits = torch.randn(1, 4, V, generator=gen, dtype=torch.float64)
    batch = {"student_chunk": torch.tensor([[1, -1, 0, 2]]), "num_chunks": 3, "teacher_ids": ids,
             "teacher_logprobs": logp, "teacher_residual": residual, "teacher_chunk": torch.arange(3),
             "teacher_counts": torch.ones(3, 4), "labels": torch.tensor([[1, 2, 3, 4]]),
             "teacher_realized": -torch.rand(3, generator=gen, dtype=torch.float64)}
    rows = losses.same_tokenizer_rows(batch["student_chunk"], 3)
    want = losses.topk_forward_kl(logits.reshape(-1, V), rows, ids, logp, residual, temperature=2.0).total
    torch.testing.assert_close(losses.make_kd_loss("kl", temperature=2.0)(logits, batch), want)
    op = losses.ProjectionOperator(torch.eye(V, dtype=torch.float64).to_sparse())
    torch.testing.assert_close(losses.make_kd_loss("pkl", temperature=2.0, projection=op)(logits, batch), want)
    for name in ("rkl", "jsd", "sampled", "alm"):
        assert torch.isfinite(losses.make_kd_loss(name)(logits, batch))
    with pytest.raises(XtcacheError):
        losses.make_kd_loss("pkl")


def _fused_cases(gen):
    """(name, kd(logits) -> LossSum) on one [2, 5, V] logits batch: every KD family, both fusion paths."""
    _, ids, logp, residual = _teacher_topk(4, V, 4, gen)
    rows = torch.tensor([1, 2, 5, 9])
    repeated = torch.tensor([1, 2, 2, 9])  # a logit row used twice: CE rows are appended, not merged
    w = _projection(V, 13, gen)
    op = losses.ProjectionOperator(w.to_sparse())
    student_chunk, teacher_chunk = _pkl_batch(gen)
    _, t_ids, t_logp, t_res = _teacher_topk(5, 13, 4, gen)
    realized = -torch.rand(5, generator=gen, dtype=torch.float64) * 3
    counts = torch.randint(0, 4, ids.shape, generator=gen).double()
    flat = lambda z: z.reshape(-1, V)  # noqa: E731
    return [
        ("kl T=1", lambda z: losses.topk_forward_kl(flat(z), rows, ids, logp, residual, row_chunk=3)),
        ("kl repeated rows", lambda z: losses.topk_forward_kl(flat(z), repeated, ids, logp, residual)),
        ("jsd T=2", lambda z: losses.topk_generalized_jsd(flat(z), rows, ids, logp, residual, beta=0.3,
                                                          temperature=2.0, row_chunk=4)),
        ("rkl", lambda z: losses.topk_reverse_kl(flat(z), rows, ids, logp, residual)),
        ("sampled", lambda z: losses.sampled_kl(flat(z), rows, ids, counts)),
        ("pkl T=1", lambda z: losses.projected_kl(z, student_chunk, t_ids, t_logp, t_res, teacher_chunk, 4, op,
                                                  row_chunk=2)),
        ("pkl T=1.3", lambda z: losses.projected_kl(z, student_chunk, t_ids, t_logp, t_res, teacher_chunk, 4, op,
                                                    temperature=1.3)),
        ("alm", lambda z: losses.chunk_likelihood_loss(z, torch.randint(0, V, (2, 5), generator=gen),
                                                       student_chunk, realized, teacher_chunk, 4, tau=2.0)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_fused_cross_entropy_equals_separate_ce_and_kd(case):
    """CE computed inside the KD pass gives the same CE, KD and gradients as the two losses apart."""
    gen = torch.Generator().manual_seed(14)
    name, kd = _fused_cases(gen)[case]
    logits = torch.randn(2, 5, V, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (2, 5), generator=gen)
    labels[0, 0] = labels[1, 3] = -100
    gen_state = gen.get_state()
    separate_kd = kd(logits).total
    separate_ce = losses.cross_entropy(logits, labels)
    gen.set_state(gen_state)  # alm draws its labels: the same ones again
    with losses.fuse_cross_entropy(logits, labels) as fused:
        fused_kd = kd(logits).total
    assert fused.result is not None, name
    assert fused.result.count.item() == separate_ce.count.item() == 8
    torch.testing.assert_close(fused_kd, separate_kd, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.result.total, separate_ce.total, rtol=1e-12, atol=1e-12)
    g_sep = torch.autograd.grad(separate_kd + 0.1 * separate_ce.total, logits)[0]
    g_fused = torch.autograd.grad(fused_kd + 0.1 * fused.result.total, logits)[0]
    torch.testing.assert_close(g_fused, g_sep, rtol=1e-10, atol=1e-12)


def test_fused_cross_entropy_only_rides_on_the_same_logits():
    gen = torch.Generator().manual_seed(15)
    _, ids, logp, residual = _teacher_topk(3, V, 4, gen)
    logits = torch.randn(1, 4, V, generator=gen, dtype=torch.float64)
    other = logits.clone()
    labels = torch.randint(0, V, (1, 4), generator=gen)
    with losses.fuse_cross_entropy(logits, labels) as fused:
        losses.topk_forward_kl(other.reshape(-1, V), torch.arange(3), ids, logp, residual)
    assert fused.result is None  # another tensor: the trainer falls back to a separate CE
    with losses.fuse_cross_entropy(logits, labels) as fused:
        losses.topk_forward_kl(logits.reshape(-1, V), torch.arange(3), ids, logp, residual)
        first = fused.result
        losses.topk_forward_kl(logits.reshape(-1, V), torch.arange(3), ids, logp, residual)
    assert fused.result is first  # computed once, by the first pass
    assert losses._pending_ce(logits.reshape(-1, V)) is None  # nothing pending after the block


def test_fused_backward_allocates_one_logits_sized_gradient():
    """Separate CE + KD allocate two [N, V] gradient buffers in backward; fused, one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    gen = torch.Generator().manual_seed(16)
    n = 12
    _, ids, logp, residual = _teacher_topk(n, V, 4, gen)
    logits = torch.randn(n, V, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (n,), generator=gen)

    class CountFullSize(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.zeros_like, torch.ops.aten.zeros, torch.ops.aten.new_zeros) \
                    and isinstance(out, torch.Tensor) and tuple(out.shape) == (n, V):
                self.count += 1
            return out

    def grad_buffers(fuse: bool) -> int:
        if fuse:
            with losses.fuse_cross_entropy(logits, labels) as fused:
                kd = losses.topk_forward_kl(logits, torch.arange(n), ids, logp, residual).total
            loss = kd + fused.result.total
        else:
            loss = (losses.topk_forward_kl(logits, torch.arange(n), ids, logp, residual).total
                    + losses.cross_entropy(logits, labels).total)
        with CountFullSize() as mode:
            torch.autograd.grad(loss, logits)
        return mode.count

    assert grad_buffers(fuse=False) == 2
    assert grad_buffers(fuse=True) == 1
