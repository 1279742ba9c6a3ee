"""Closed-form CE and forward KL (stage2_student/closed_form.py) against the same losses under autograd.

    .venv/bin/python -m pytest -x -q tests/test_closed_form.py
"""

from __future__ import annotations

import pytest
import torch

from stage2_student.objective import Objective
from tests.test_losses import _same_batch
from xtcache.errors import ConfigError


def _assert_equals_autograd(obj, prep, logits, weights, kd, ce, g) -> None:
    """The objective's (KD per chunk, CE, gradient of sum(weights * KD) + 0.7 CE) equal each block's
    terms recomputed under autograd (`blocked._block_terms`)."""
    from stage2_student import blocked

    zr = logits.clone().requires_grad_(True)
    flat = zr.reshape(-1, zr.shape[-1])
    want_kd, want_ce = torch.zeros(prep.chunks, dtype=torch.float64), 0.0
    for blk in prep.blocks:
        k_b, c_b = blocked._block_terms(obj.spec, flat.index_select(0, blk.logit_rows), blk, prep.teacher)
        want_kd = want_kd.index_add(0, blk.kd_chunk, k_b)
        want_ce = want_ce + c_b
    (g_want,) = torch.autograd.grad((want_kd * weights).sum() + 0.7 * want_ce, zr)
    torch.testing.assert_close(kd, want_kd, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ce, want_ce, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-9, atol=1e-12)


def _closed_form_case(case: str, gen):
    """(objective, batch, logits) of one block layout: padding, a row with no stored id, a repeated position,
    CE-only rows, full support, sampled counts, temperature."""
    n, v, k = 10, 23, {"full": 23, "full T=2": 23}.get(case, 5)
    temperature = 2.0 if case.endswith("T=2") else 1.0
    ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
    logp = torch.log_softmax(torch.randn(n, k, generator=gen, dtype=torch.float64) * 2, -1)
    residual = torch.zeros(n, dtype=torch.float64) if case.startswith("full") else torch.rand(n, generator=gen,
                                                                                             dtype=torch.float64) * 0.3
    logp = logp + torch.log1p(-residual)[:, None]
    if not case.startswith("full"):
        ids[1, 3:], logp[1, 3:] = -1, 0.0  # padded slots
        ids[4, :] = -1  # a row with no stored id: its teacher is all rest
    sc = torch.arange(n + 2)
    sc[3], sc[n + 1] = -1, -1  # two CE-only positions
    sc[sc > 3] -= 1
    sc[n] = n - 1
    labels = torch.randint(0, v, (1, n + 2), generator=gen)
    labels[0, 5] = -100
    batch = _same_batch(sc[None], ids, logp, residual, labels)
    if case == "sampled":
        counts = torch.randint(0, 4, (n, k), generator=gen).double()
        batch = _same_batch(sc[None], torch.where(counts > 0, ids, -1), None, torch.zeros(n), labels, counts=counts)
    kind = "sampled" if case == "sampled" else ("kl" if case != "ce" else None)
    obj = Objective(kind, temperature=temperature, row_chunk=4)
    logits = torch.randn(1, n + 2, v, generator=gen, dtype=torch.float64) * 3
    return obj, batch, logits


@pytest.mark.parametrize("case", ["ce", "topk", "topk T=2", "full", "full T=2", "sampled"])
def test_closed_form_equals_the_autograd_recompute(case, monkeypatch):
    """The closed-form path (values and the gradient it writes) equals the same losses recomputed under
    autograd (`blocked._block_terms`, the path the other losses take), on blocks with padding, rows without
    stored ids, CE-only rows, full support, counts and T = 2; and the closed form is the path taken."""
    from stage2_student import closed_form

    gen = torch.Generator().manual_seed(41)
    obj, batch, logits = _closed_form_case(case, gen)
    prep = obj.prepare(batch, vocab=logits.shape[-1])
    assert len(prep.blocks) > 1
    weights = torch.rand(prep.chunks, generator=gen, dtype=torch.float64)  # a different weight for each chunk
    z = logits.clone().requires_grad_(True)
    calls = []
    real = closed_form.gradient
    monkeypatch.setattr(closed_form, "gradient", lambda *a: calls.append(1) or real(*a))
    kd, ce = obj.terms(z, prep)
    (g,) = torch.autograd.grad((kd * weights).sum() + 0.7 * ce, z)
    assert len(calls) == len(prep.blocks)
    _assert_equals_autograd(obj, prep, logits, weights, kd, ce, g)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


# --------------------------------------------------------------------------------------------
# projected KL (stage2_student/projected.py)


def _pkl_case(case: str, gen, chunk_rows: str = "mean", pkl_divergence: str = "forward", **objective_kw):
    """(objective, batch, logits) of a cross-tokenizer micro-batch: chunks of 1, 2 and 3 student rows and of
    1 and 2 teacher rows over two sequences, CE-only and unlabelled positions, stored-id padding, a teacher row
    with no stored id, a stored id no student token maps to, an unmapped student token; "no rest": W maps every
    student token into 4 teacher ids that some chunks store all of (their rest is dropped); "full": every id.
    Otherwise a stored id's q is below the floor (`losses.PROB_FLOOR`) without being 0."""
    from stage2_student import losses
    from stage2_student.objective import Objective

    v_s, v_t = 20, 24
    w = torch.zeros(v_s, v_t, dtype=torch.float64)
    cols = 4 if case == "no rest" else v_t - 1  # the last teacher id: no W entry
    for s in range(0 if case == "no rest" else 1, v_s):  # student 0: unmapped
        w[s, torch.randperm(cols, generator=gen)[:1 + s % 3]] = torch.rand(1 + s % 3, generator=gen,
                                                                            dtype=torch.float64) + 0.1
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-300)
    # positions -> chunk (-1: no chunk); chunk sizes 1, 2, 3 student rows
    sc = torch.tensor([[0, 1, 1, -1, 2, 3, 3, 3, 4, -1, 5, 6], [7, 8, 8, 9, -1, 10, 11, 11, 12, 13, -1, -1]])
    tch = torch.tensor([0, 1, 2, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 10, 11, 12, 13])  # chunks 2, 6, 10: two rows
    n, k = tch.shape[0], {"full": v_t, "no rest": 5}.get(case, 6)
    ids = torch.stack([torch.randperm(v_t, generator=gen)[:k] for _ in range(n)])
    if case == "no rest":
        ids[[0, 4, 9], :4] = torch.arange(4)  # chunks 0, 3, 8 store every column W maps onto
    logp = torch.log_softmax(torch.randn(n, k, generator=gen, dtype=torch.float64) * 2, -1)
    residual = torch.zeros(n, dtype=torch.float64) if case == "full" else torch.rand(n, generator=gen,
                                                                                    dtype=torch.float64) * 0.3
    logp = logp + torch.log1p(-residual)[:, None]
    if case != "full":
        ids[1, 3:], logp[1, 3:] = -1, 0.0  # padded slots
        if case != "sampled":  # (a sampled row holds its draws)
            ids[7, :] = -1  # a teacher row with no stored id: all rest
        if case != "no rest":
            ids[5, 0] = v_t - 1  # a stored id no student token maps to: q = 0, floored
    labels = torch.randint(0, v_s, sc.shape, generator=gen)
    labels[0, 4], labels[1, 11] = -100, -100
    batch = {"student_chunk": sc, "labels": labels, "num_chunks": 14, "teacher_chunk": tch, "teacher_ids": ids,
             "teacher_residual": residual}
    if case == "sampled":
        counts = torch.randint(0, 4, (n, k), generator=gen).double()
        counts[:, 0] += 1
        batch.update(teacher_ids=torch.where(counts > 0, ids, -1), teacher_counts=counts,
                     teacher_residual=torch.zeros(n, dtype=torch.float64))
    else:
        batch["teacher_logprobs"] = logp
    temperature = 2.0 if "T=2" in case else 1.0
    obj = Objective("pkl", projection=losses.ProjectionOperator(w.to_sparse()), temperature=temperature,
                    teacher_tail="uniform" if "uniform" in case else "ghost", row_chunk=5,
                    chunk_rows=chunk_rows, pkl_divergence=pkl_divergence, **objective_kw)  # mean: every row of chunks of 1-3 student
    # and 1-2 teacher rows
    logits = torch.randn(2, 12, v_s, generator=gen, dtype=torch.float64) * 3
    if case != "no rest":  # teacher id 5, stored by row 2: every student token onto it at e^-30, q below the floor
        batch["teacher_ids"][2, 0] = 5
        logits[..., w[:, 5] > 0] = -30.0 * temperature
    return obj, batch, logits


# (SUPPORT_DEVICES, SAVE_ENTRIES_BELOW) of each P-KL path; SUPPORT_BELOW 1: the support path at tiny vocabularies
PKL_PATHS = {"support": (("cpu",), 1e9), "dense, entries saved": ((), 1e9), "dense, entries recomputed": ((), 0.0)}


def _pkl_path_kept(saved) -> str:
    if saved.dot is not None:
        return "support"
    return "dense, entries saved" if saved.entries is not None else "dense, entries recomputed"


@pytest.mark.parametrize("path", list(PKL_PATHS))
@pytest.mark.parametrize("case", ["topk", "topk T=2", "topk T=2 uniform", "sampled", "no rest", "full"])
def test_projected_kl_closed_form_equals_the_autograd_recompute(case, path, monkeypatch):
    """The P-KL closed form (values and gradient, with CE) equals `losses.projected_kl` under autograd
    (`blocked._block_terms`) over several blocks on each path: W restricted to the block's union of stored ids
    (support), or the [V_t + 2, C] buffers with backward reusing the stored entries' dKL/dq from forward or
    recomputing them (dense); and it is the path taken."""
    from stage2_student import projected

    gen = torch.Generator().manual_seed(43)
    obj, batch, logits = _pkl_case(case, gen)
    devices, save_below = PKL_PATHS[path]
    monkeypatch.setattr(projected, "SUPPORT_DEVICES", devices)
    monkeypatch.setattr(projected, "SAVE_ENTRIES_BELOW", save_below)
    monkeypatch.setattr(projected, "SUPPORT_BELOW", 1.0)
    prep = obj.prepare(batch, vocab=logits.shape[-1])
    assert len(prep.blocks) > 2
    weights = torch.rand(prep.chunks, generator=gen, dtype=torch.float64)
    z = logits.clone().requires_grad_(True)
    calls = []
    real = projected.gradient
    monkeypatch.setattr(projected, "gradient", lambda *a: calls.append(_pkl_path_kept(a[4])) or real(*a))
    kd, ce = obj.terms(z, prep)
    (g,) = torch.autograd.grad((kd * weights).sum() + 0.7 * ce, z)
    assert calls == [path] * sum(b.num_kd_rows > 0 for b in prep.blocks)
    _assert_equals_autograd(obj, prep, logits, weights, kd, ce, g)
    assert torch.isfinite(g).all() and g.abs().sum() > 0 and (kd > 0).all()


@pytest.mark.parametrize("path", list(PKL_PATHS))
@pytest.mark.parametrize("divergence", ["forward", "reverse", "jsd", "forward-reverse"])
@pytest.mark.parametrize("case", ["topk", "topk T=2", "no rest", "full"])
def test_projected_reverse_kl_and_jsd_closed_form_equal_the_autograd_recompute(case, divergence, path, monkeypatch):
    """Every --pkl-divergence (forward, and the on-policy reverse, jsd, forward-reverse): values and gradient of
    the closed form equal `losses.projected_kl` under autograd on each path, first rows and chunk means alike
    (first rows give a block whose only teacher row stores no id: a support of one column, whose rest
    derivative the support path once overwrote); the others are other numbers than the forward KL's."""
    from stage2_student import projected

    devices, save_below = PKL_PATHS[path]
    monkeypatch.setattr(projected, "SUPPORT_DEVICES", devices)
    monkeypatch.setattr(projected, "SAVE_ENTRIES_BELOW", save_below)
    monkeypatch.setattr(projected, "SUPPORT_BELOW", 1.0)
    for chunk_rows in ("mean", "first"):
        gen = torch.Generator().manual_seed(47)
        obj, batch, logits = _pkl_case(case, gen, chunk_rows=chunk_rows, pkl_divergence=divergence)
        prep = obj.prepare(batch, vocab=logits.shape[-1])
        weights = torch.rand(prep.chunks, generator=gen, dtype=torch.float64)
        z = logits.clone().requires_grad_(True)
        kd, ce = obj.terms(z, prep)
        (g,) = torch.autograd.grad((kd * weights).sum() + 0.7 * ce, z)
        _assert_equals_autograd(obj, prep, logits, weights, kd, ce, g)
        assert torch.isfinite(g).all() and g.abs().sum() > 0 and (kd > -1e-12).all() and (kd > 0).any()
        if divergence != "forward":
            forward, _, _ = _pkl_case(case, torch.Generator().manual_seed(47), chunk_rows=chunk_rows)
            kd_forward, _ = forward.terms(logits.clone(), forward.prepare(batch, vocab=logits.shape[-1]))
            assert not torch.allclose(kd.detach(), kd_forward)


def test_pkl_reverse_weight_mixes_the_forward_and_reverse_kl_by_its_weight(monkeypatch):
    """--pkl-reverse-weight w: the forward-reverse P-KL's values and gradient are (1 - w) times the forward P-KL's
    plus w times the reverse P-KL's (each its own objective), on the closed form and under autograd alike."""
    from stage2_student import projected

    monkeypatch.setattr(projected, "SUPPORT_BELOW", 1.0)

    def terms(divergence, **kw):
        obj, batch, logits = _pkl_case("topk", torch.Generator().manual_seed(53), pkl_divergence=divergence, **kw)
        prep = obj.prepare(batch, vocab=logits.shape[-1])
        z = logits.clone().requires_grad_(True)
        kd, ce = obj.terms(z, prep)
        (g,) = torch.autograd.grad(kd.sum(), z)
        return obj, prep, logits, kd.detach(), ce, g

    _, _, _, kd_f, _, g_f = terms("forward")
    _, _, _, kd_r, _, g_r = terms("reverse")
    for w in (0.5, 0.8):
        obj, prep, logits, kd, ce, g = terms("forward-reverse", pkl_reverse_weight=w)
        torch.testing.assert_close(kd, (1 - w) * kd_f + w * kd_r)
        torch.testing.assert_close(g, (1 - w) * g_f + w * g_r)
        weights = torch.ones(prep.chunks, dtype=torch.float64)
        z = logits.clone().requires_grad_(True)
        kd2, ce2 = obj.terms(z, prep)
        (g2,) = torch.autograd.grad(kd2.sum() + 0.7 * ce2, z)
        _assert_equals_autograd(obj, prep, logits, weights, kd2, ce2, g2)
    with pytest.raises(ConfigError, match=r"^--pkl-reverse-weight 0.8: weighs the reverse KL of --pkl-divergence "
                                          r"forward-reverse, not of reverse$"):
        Objective("pkl", projection=obj.projection, pkl_divergence="reverse", pkl_reverse_weight=0.8)


def _wide_pkl_case(gen, dtype, chunk_rows: str):
    """(objective, batch, logits) at a teacher vocabulary far wider than a block's stored ids, as on the real
    pair: 6,000 teacher ids, top-12 rows whose union is a few percent of them; every student token maps onto
    1-4 teacher ids, the first of them one of five heavy ids (each the target of ~100 student tokens), two
    student tokens map nowhere; chunks of 1-3 student and 1-2 teacher rows, CE-only positions."""
    from stage2_student import losses
    from stage2_student.objective import Objective

    v_s, v_t, k = 500, 6000, 12
    w = torch.zeros(v_s, v_t, dtype=torch.float64)
    for s in range(2, v_s):
        n = 1 + s % 4
        cols = torch.cat([torch.tensor([s % 5]), 5 + torch.randperm(v_t - 5, generator=gen)[:n - 1]])
        w[s, cols] = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-300)
    sc, tch, n_chunks = [], [], 0
    for _ in range(3):  # 3 sequences of 40 positions
        row = []
        while len(row) < 40:
            rows = min(int(torch.randint(1, 4, (1,), generator=gen)), 40 - len(row))
            if len(row) % 7 == 3:  # a span without a teacher side: CE only
                row += [-1] * rows
                continue
            row += [n_chunks] * rows
            tch += [n_chunks] * int(torch.randint(1, 3, (1,), generator=gen))
            n_chunks += 1
        sc.append(row)
    sc, tch = torch.tensor(sc), torch.tensor(tch)
    n = tch.shape[0]
    # stored ids: a few heavy ones and a shared pool, so that a block's union stays small
    pool = torch.randperm(v_t, generator=gen)[:150]
    ids = torch.stack([torch.cat([torch.randperm(5, generator=gen)[:3],
                                  pool[torch.randperm(150, generator=gen)[:k - 3]]]) for _ in range(n)])
    ids[3, 8:] = -1  # padding
    logp = torch.log_softmax(torch.randn(n, k, generator=gen, dtype=torch.float64) * 2, -1)
    residual = torch.rand(n, generator=gen, dtype=torch.float64) * 0.3
    logp = (logp + torch.log1p(-residual)[:, None]).masked_fill(ids < 0, 0.0)
    labels = torch.randint(0, v_s, sc.shape, generator=gen)
    labels[0, 5] = -100
    batch = {"student_chunk": sc, "labels": labels, "num_chunks": n_chunks, "teacher_chunk": tch,
             "teacher_ids": ids, "teacher_logprobs": logp.to(dtype), "teacher_residual": residual.to(dtype)}
    obj = Objective("pkl", projection=losses.ProjectionOperator(w.to(dtype).to_sparse()), row_chunk=400,
                    chunk_rows=chunk_rows)
    return obj, batch, (torch.randn(3, 40, v_s, generator=gen, dtype=torch.float64) * 4).to(dtype)


@pytest.mark.parametrize("chunk_rows", ["mean", "first"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_projected_kl_support_path_equals_the_dense_path_at_a_wide_teacher_vocabulary(dtype, chunk_rows,
                                                                                       monkeypatch):
    """At a teacher vocabulary far wider than the stored support, the support path (W restricted to each
    block's union of stored ids, the rest as the mass outside the union plus q_c on the union outside K_c)
    gives the dense path's values and gradient ([V_t + 2, C] buffers and the full W), with chunks of several
    rows (`--chunk-rows mean`) and of their first rows."""
    from stage2_student import projected

    obj, batch, logits = _wide_pkl_case(torch.Generator().manual_seed(45), dtype, chunk_rows)
    prep = obj.prepare(batch, vocab=logits.shape[-1])
    assert len(prep.blocks) > 2
    weights = torch.rand(prep.chunks, generator=torch.Generator().manual_seed(46), dtype=torch.float64).to(dtype)
    out, kept = {}, []
    real = projected.gradient
    monkeypatch.setattr(projected, "gradient", lambda *a: kept.append(_pkl_path_kept(a[4])) or real(*a))
    for devices in (("cpu",), ()):
        monkeypatch.setattr(projected, "SUPPORT_DEVICES", devices)
        z = logits.clone().requires_grad_(True)
        kd, ce = obj.terms(z, prep)
        (g,) = torch.autograd.grad((kd * weights).sum() + 0.7 * ce, z)
        out[devices] = kd, ce, g
    n_kd = sum(b.num_kd_rows > 0 for b in prep.blocks)
    assert kept == ["support"] * n_kd + ["dense, entries saved"] * n_kd
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    for got, want in zip(out[("cpu",)], out[()]):
        torch.testing.assert_close(got, want, **tol)
    assert (out[()][0] > 0).all() and out[()][2].abs().sum() > 0


@pytest.mark.parametrize("kind", ["kl", "pkl"])
def test_agreement_plan_takes_the_largest_stored_score_never_a_padding_slot(kind):
    """The teacher's top-1 of each chunk (the first row's largest stored log-prob or count) is read in place;
    padding slots, even with a larger stored value than every real one, and all-padding rows are handled as
    the masked float64 argmax over the chunk's first row."""
    gen = torch.Generator().manual_seed(44)
    obj, batch, logits = (_pkl_case if kind == "pkl" else _closed_form_case)("topk", gen)
    batch["teacher_logprobs"][1, 3:] = 5.0  # padding slots above every stored value
    ids, score, tch = batch["teacher_ids"], batch["teacher_logprobs"], batch["teacher_chunk"]
    first = torch.stack([torch.nonzero(tch == c)[0, 0] for c in range(batch["num_chunks"])])
    want = ids[first].gather(1, torch.where(ids[first] >= 0, score[first], -torch.inf).argmax(1, keepdim=True))[:, 0]
    assert torch.equal(obj.prepare(batch, vocab=logits.shape[-1]).agree["teacher_top"], want)


@pytest.mark.parametrize("case", ["topk", "topk T=2", "sampled", "no rest", "full"])
def test_projected_kl_of_first_rows_equals_the_autograd_recompute(case):
    """`--chunk-rows first` (each chunk's first student position and first teacher row, the later positions
    CE only): the closed form equals `losses.projected_kl` under autograd, values and gradient with CE."""
    gen = torch.Generator().manual_seed(43)
    obj, batch, logits = _pkl_case(case, gen, chunk_rows="first")
    prep = obj.prepare(batch, vocab=logits.shape[-1])
    assert sum(b.num_kd_rows for b in prep.blocks) == prep.chunks  # one student row per chunk
    weights = torch.rand(prep.chunks, generator=gen, dtype=torch.float64)
    z = logits.clone().requires_grad_(True)
    kd, ce = obj.terms(z, prep)
    (g,) = torch.autograd.grad((kd * weights).sum() + 0.7 * ce, z)
    _assert_equals_autograd(obj, prep, logits, weights, kd, ce, g)
    assert torch.isfinite(g).all() and g.abs().sum() > 0 and (kd > -1e-12).all()  # a KL: 0 where both sides agree


def test_defaults_are_forward_reverse_p_kl_with_half_ce_on_exact_caches_and_forward_on_drawn_ones():
    from stage2_student.config import LossConfig
    from stage2_student.losses import ProjectionOperator
    from stage2_student.objective import Capabilities, Objective

    proj = ProjectionOperator(torch.eye(4, dtype=torch.float64).to_sparse())
    for mode in ("topk", "full"):  # exact teacher log-probs: the real pair's measured default (docs/losses.md)
        obj = Objective.from_config(LossConfig(), Capabilities(same_tokenizer=False, mode=mode), proj)
        assert (obj.kind, obj.spec.divergence, obj.spec.reverse_weight, obj.ce_weight) == ("pkl", "forward-reverse",
                                                                                          0.5, 0.5)
    for mode in ("sampled", "headtail"):  # an estimated teacher: the forward KL is linear in it, the reverse is not
        obj = Objective.from_config(LossConfig(), Capabilities(same_tokenizer=False, mode=mode), proj)
        assert (obj.kind, obj.spec.divergence) == ("pkl", "forward")
    same = Objective.from_config(LossConfig(), Capabilities(same_tokenizer=True, mode="topk"))
    assert (same.kind, same.spec.divergence, same.ce_weight) == ("kl", "forward", 0.1)
    given = Objective.from_config(LossConfig(pkl_divergence="forward", ce_weight=1.0),
                                  Capabilities(same_tokenizer=False, mode="topk"), proj)
    assert (given.spec.divergence, given.ce_weight) == ("forward", 1.0)
    # what summary.json records and `xtcache rounds` compares: the resolved settings of the loss and no others
    cross = Objective.from_config(LossConfig(), Capabilities(same_tokenizer=False, mode="topk"), proj)
    assert cross.describe() == {"kind": "pkl", "ce_weight": 0.5, "kd_weight": 1.0, "dynamic_scaling": False,
                                "temperature": 1.0, "teacher_tail": "ghost", "pkl_divergence": "forward-reverse",
                                "chunk_rows": "first", "pkl_reverse_weight": 0.5}
    assert same.describe() == {"kind": "kl", "ce_weight": 0.1, "kd_weight": 1.0, "dynamic_scaling": False,
                               "temperature": 1.0, "teacher_tail": "ghost"}
    assert "pkl_reverse_weight" not in given.describe()  # forward alone has no reverse weight
    ce = Objective.from_config(LossConfig(loss="ce"), Capabilities(same_tokenizer=True, mode="topk"))
    assert ce.describe() == {"kind": None, "ce_weight": 1.0}


def test_pkl_divergence_applies_to_projected_kl_only():
    from stage2_student.config import LossConfig
    from stage2_student.objective import Capabilities, Objective
    from xtcache.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--pkl-divergence reverse: applies to --loss pkl .*--loss rkl or --loss jsd$"):
        Objective("kl", pkl_divergence="reverse")
    same = Capabilities(mode="topk", same_tokenizer=True)
    with pytest.raises(ConfigError, match="--pkl-divergence jsd"):
        Objective.from_config(LossConfig(pkl_divergence="jsd"), same)


def test_the_held_out_kl_is_reused_from_the_training_objective_only_when_it_is_the_measure():
    """A run trained with another divergence, other chunk rows, another temperature or tail has its held-out KL
    computed by the measure (the forward first-token KL), never read off its own KD term."""
    from stage2_student.evaluation import same_measure
    from stage2_student.losses import ProjectionOperator
    from stage2_student.objective import Objective

    proj = ProjectionOperator(torch.eye(4, dtype=torch.float64).to_sparse())
    measure = Objective("pkl", ce_weight=0.0, projection=proj, with_ce=False)
    assert same_measure(Objective("pkl", projection=proj), measure)
    for other in (dict(pkl_divergence="reverse"), dict(pkl_divergence="jsd"), dict(chunk_rows="mean"),
                  dict(temperature=2.0), dict(teacher_tail="uniform")):
        assert not same_measure(Objective("pkl", projection=proj, **other), measure), other
    same_tok = Objective("kl", ce_weight=0.0, with_ce=False)
    assert same_measure(Objective("kl"), same_tok) and not same_measure(Objective("rkl"), same_tok)
