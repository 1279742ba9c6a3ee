"""Several teachers, one student: caches joined by document id, per-group combination of KD terms.

Fast tier: real stores written by `xtcache.testing.caches.build_hf_cache` from two different toy
teachers (the toy Qwen2 teacher, cross-tokenizer to the student, and a tiny Llama trained on the
student's own tokenizer), read by the real loader; the objective on random student logits.

    pytest -q tests/test_multi_teacher.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stage2_student import loader as L
from stage2_student.config import LoaderConfig
from stage2_student.join import num_teachers, teacher_view
from stage2_student.losses import ProjectionOperator
from stage2_student.mix import TeacherMix, mix_views
from stage2_student.objective import Objective
from tests.loader_settings import loader_settings
from xtcache.errors import ConfigError


@pytest.fixture(scope="session")
def second_teachers(toy_setup, tmp_path_factory):
    """(same-tokenizer teacher, second teacher of the toy teacher's tokenizer): tiny, randomly initialised
    (different from the trained toy teacher, which is all the loader and the combination need)."""
    from xtcache.testing.toy import build_tiny_model

    root = tmp_path_factory.mktemp("teachers")
    same = root / "llama_student_tok"
    build_tiny_model("llama", toy_setup.student_tokenizer, same, hidden=32, layers=1, intermediate=64, seed=3)
    other = root / "qwen_teacher_tok"
    build_tiny_model("qwen2", toy_setup.teacher_tokenizer, other, hidden=32, layers=1, intermediate=64, seed=4)
    return same, other


@pytest.fixture(scope="session")
def caches(toy_setup, second_teachers, tmp_path_factory):
    """Stores of the same 24 documents: A (toy teacher), B (same-tokenizer teacher), A2 (another teacher of
    A's tokenizer); B16 (B on the first 16 documents only); H (held-out documents: no overlap)."""
    from xtcache.testing.caches import build_hf_cache

    root = tmp_path_factory.mktemp("multi")
    student = [toy_setup.student_tokenizer]
    same, other = second_teachers
    out = {"A": build_hf_cache(root / "a", toy_setup.teacher_model, toy_setup.train_jsonl, student, k=8, max_docs=24,
                               docs_per_part=8),
           "B": build_hf_cache(root / "b", same, toy_setup.train_jsonl, student, k=8, max_docs=24, docs_per_part=12),
           "A2": build_hf_cache(root / "a2", other, toy_setup.train_jsonl, student, k=8, max_docs=24, docs_per_part=8),
           "B16": build_hf_cache(root / "b16", same, toy_setup.train_jsonl, student, k=8, max_docs=16,
                                 docs_per_part=8),
           "H": build_hf_cache(root / "h", same, toy_setup.heldout_jsonl, student, k=8, max_docs=8)}
    return out


def dataset(urls, toy_setup, **kw) -> L.CacheDataset:
    args = dict(seq_len=64, micro_batch_size=2, seed=1)
    args.update(kw)
    return L.CacheDataset(urls, str(toy_setup.student_tokenizer), *loader_settings(args), **args)


def batches(ds, n, num_workers=0) -> list[dict]:
    it = iter(L.CacheLoader(ds, num_workers=num_workers))
    return [next(it) for _ in range(n)]


def same_batch(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def projection(toy_setup) -> ProjectionOperator:
    from xtcache.projection import build_projection
    from xtcache.tokenizer import load_tokenizer

    teacher = load_tokenizer(toy_setup.teacher_tokenizer)
    pm = build_projection(load_tokenizer(toy_setup.student_tokenizer), teacher)
    return ProjectionOperator(pm.to_torch_sparse(len(teacher)))


def group_positions(view: dict) -> dict[int, set[int]]:
    """Chunk group -> the student logit positions of its chunks in one teacher's view."""
    sc = view["student_chunk"].reshape(-1).numpy()
    cg = view["chunk_group"].numpy()
    out: dict[int, set[int]] = {}
    for p in np.nonzero(sc >= 0)[0]:
        out.setdefault(int(cg[sc[p]]), set()).add(int(p))
    return out


# --------------------------------------------------------------------------------------------
# loader


def test_one_cache_is_the_n1_case_of_the_join(toy_setup, caches):
    a = batches(dataset(caches["A"], toy_setup), 3)
    b = batches(dataset([caches["A"]], toy_setup), 3)
    for x, y in zip(a, b):
        assert same_batch(x, y)
        assert num_teachers(x) == 1 and x["num_groups"] == x["num_chunks"]
        assert torch.equal(x["chunk_group"], torch.arange(x["num_chunks"]))


def test_joined_batches_share_the_student_side_and_resume_exactly(toy_setup, caches):
    ds = dataset([caches["A"], caches["B"]], toy_setup)
    assert ds.documents == 24
    first = batches(ds, 6)
    for batch in first:
        assert num_teachers(batch) == 2
        va, vb = teacher_view(batch, 0), teacher_view(batch, 1)
        assert torch.equal(va["input_ids"], vb["input_ids"])
        g = batch["num_groups"]
        assert 0 < g <= min(va["num_chunks"], vb["num_chunks"])
        # every group is the same student span for both teachers, and both are in every group
        pa, pb = group_positions(va), group_positions(vb)
        assert pa == pb and sorted(pa) == list(range(g))
        # teacher B shares the student's tokenizer: its chunks are single tokens
        assert (np.bincount(vb["student_chunk"].reshape(-1).numpy()[vb["student_chunk"].reshape(-1).numpy() >= 0])
                == 1).all()
    # prefetching workers and a resumed loader give the same stream
    assert all(same_batch(x, y) for x, y in zip(first, batches(ds, 6, num_workers=2)))
    loader = L.CacheLoader(ds)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    resumed = L.CacheLoader(dataset([caches["A"], caches["B"]], toy_setup))
    resumed.load_state_dict(state)
    assert all(same_batch(x, y) for x, y in zip(first[3:], [b for _, b in zip(range(3), resumed)]))


def test_missing_documents_drop_or_partial_and_no_overlap_is_refused(toy_setup, caches):
    drop = dataset([caches["A"], caches["B16"]], toy_setup)
    partial = dataset([caches["A"], caches["B16"]], toy_setup, teachers_missing="partial")
    assert (drop.documents, partial.documents) == (16, 24)
    only_a = 0
    for batch in batches(partial, partial.batches_per_epoch):
        present_b = set(group_positions(teacher_view(batch, 1)))
        present_a = set(group_positions(teacher_view(batch, 0)))
        assert present_b <= present_a == set(range(batch["num_groups"]))
        only_a += len(present_a - present_b)
    assert only_a > 0  # the 8 documents B lacks train with teacher A alone
    with pytest.raises(ConfigError, match="share no document"):
        dataset([caches["A"], caches["H"]], toy_setup)


def test_a_cache_without_the_students_alignment_is_named(toy_setup, caches, teacher_tokenizer):
    from xtcache.fingerprint import tokenizer_fingerprint

    fp = tokenizer_fingerprint(teacher_tokenizer)  # a "student" sharing A's tokenizer, that B was not aligned for
    with pytest.raises(ConfigError, match=f"cache {caches['B']} has no alignment.*xtcache align {caches['B']}"):
        L.CacheDataset([caches["A"], caches["B"]], fp, LoaderConfig(seq_len=64, micro_batch_size=2))


# --------------------------------------------------------------------------------------------
# combination


def joined_objective(toy_setup, caches, combine, weights=(0.7, 0.3), **kw) -> TeacherMix:
    objs = [Objective("pkl", projection=projection(toy_setup), ce_weight=0.1),
            Objective("kl", ce_weight=0.1, with_ce=False)]
    from xtcache.store import CacheReader

    vocab = [CacheReader(caches[name]).manifest.teacher_vocab_size for name in ("A", "B")]
    return TeacherMix(objs, combine=combine, weights=list(weights), vocab_sizes=vocab, **kw)


def run(obj, batch, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*batch["input_ids"].shape, vocab, generator=gen, dtype=torch.float64, requires_grad=True)
    prep = obj.prepare(batch, vocab=vocab)
    groups, tokens = obj.counts(batch)
    loss, m = obj(logits, prep, chunks_total=float(groups), tokens_total=float(tokens))
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    return logits, prep, loss, m


def test_sum_dynamic_and_select_weights(toy_setup, caches):
    batch = batches(dataset([caches["A"], caches["B"]], toy_setup), 1)[0]
    vocab = 1536
    single = [Objective("pkl", projection=projection(toy_setup), ce_weight=0.0),
              Objective("kl", ce_weight=0.0)]
    logits, _, loss, m = run(joined_objective(toy_setup, caches, "sum"), batch, vocab)
    per = [o.sums(logits.detach(), o.prepare(teacher_view(batch, i), vocab=vocab))[0]
           for i, o in enumerate(single)]
    assert m["kd_sum"].item() == pytest.approx(0.7 * per[0].item() + 0.3 * per[1].item(), rel=1e-9)
    assert m["teacher_kd"].numpy() == pytest.approx([p.item() for p in per], rel=1e-9)
    g = batch["num_groups"]
    assert m["teacher_weight"].numpy() == pytest.approx([0.7 * g, 0.3 * g])
    # dynamic at alpha 0 is the static sum; select takes, per group, the likelier teacher of the realized text
    _, _, _, m0 = run(joined_objective(toy_setup, caches, "dynamic", alpha=0.0), batch, vocab)
    assert m0["kd_sum"].item() == pytest.approx(m["kd_sum"].item(), rel=1e-6)
    _, prep, _, ms = run(joined_objective(toy_setup, caches, "select"), batch, vocab)
    like = []
    for i in range(2):
        v = teacher_view(batch, i)
        rows_group = v["chunk_group"].numpy()[v["teacher_chunk"].numpy()]
        like.append(np.bincount(rows_group, weights=v["teacher_realized"].numpy().astype(np.float64), minlength=g))
    chosen_b = like[1] > like[0]
    assert ms["teacher_weight"].numpy() == pytest.approx([g - chosen_b.sum(), chosen_b.sum()])
    assert 0 < chosen_b.sum() < g  # each teacher is the likelier one somewhere
    _, _, _, md = run(joined_objective(toy_setup, caches, "dynamic", alpha=50.0), batch, vocab)
    assert md["teacher_weight"].numpy() == pytest.approx(ms["teacher_weight"].numpy(), abs=0.05 * g)
    # teacher A is trained (peaked rows), teacher B randomly initialised (near-uniform rows): with equal
    # static weights, the confidence scores lean on A
    for score in ("entropy", "max-prob"):
        _, _, _, me = run(joined_objective(toy_setup, caches, "dynamic", weights=(0.5, 0.5), score=score, alpha=5.0),
                          batch, vocab)
        assert me["teacher_weight"].sum().item() == pytest.approx(g)
        assert me["teacher_weight"][0].item() > 0.5 * g, score  # more than its static half


def test_mean_probs_is_the_mixture_and_refuses_other_tokenizations(toy_setup, caches):
    batch = batches(dataset([caches["A"], caches["A2"]], toy_setup), 1)[0]
    va, vb = teacher_view(batch, 0), teacher_view(batch, 1)
    mixed = mix_views([va, vb], [0.25, 0.75])
    from xtcache.store import CacheReader

    v_t = CacheReader(caches["A"]).manifest.teacher_vocab_size
    dense = torch.zeros(mixed["teacher_ids"].shape[0], v_t, dtype=torch.float64)
    for lam, v in ((0.25, va), (0.75, vb)):
        dense.scatter_add_(1, v["teacher_ids"], lam * v["teacher_logprobs"].double().exp())
    got = torch.zeros_like(dense).scatter_add_(1, mixed["teacher_ids"].clamp(min=0), torch.where(
        mixed["teacher_ids"] >= 0, mixed["teacher_logprobs"].double().exp(), 0.0))
    assert torch.allclose(got, dense, atol=1e-6)
    want_rest = 0.25 * va["teacher_residual"].double() + 0.75 * vb["teacher_residual"].double()
    assert torch.allclose(mixed["teacher_residual"].double(), want_rest, atol=1e-6)
    obj = TeacherMix([Objective("pkl", projection=projection(toy_setup))], combine="mean-probs", weights=[0.25, 0.75])
    logits, _, _, m = run(obj, batch, 1536)
    direct = Objective("pkl", projection=projection(toy_setup))
    want = direct.sums(logits.detach(), direct.prepare(mixed, vocab=1536))[0]
    assert m["kd_sum"].item() == pytest.approx(want.item(), rel=1e-9)
    other = batches(dataset([caches["A"], caches["B"]], toy_setup), 1)[0]
    with pytest.raises(ConfigError, match="mean-probs"):
        obj.prepare(other, vocab=1536)
