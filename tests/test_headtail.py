"""The exact head + sampled tail capture mode (`--mode headtail`): targets, store, estimator, training.

Unit level: `distill_targets` against a dense fp64 reference, the unbiasedness of the stage-2
estimate p_hat (head exact, tail R c / n) and of its cross-entropy, the store's round trip and
`xtcache verify` on a damaged part, the objective's kinds and refusals. Then a few stage-2 steps on a
real headtail store of the toy teacher (same tokenizer and cross tokenizer) and one
`teacher-dump --engine hf --mode headtail` end to end.

    pytest -q tests/test_headtail.py
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stage2_student import losses
from stage2_student.batches import drawn_targets
from stage2_student.objective import Capabilities, Objective, resolve_kind
from tests.commands import xtcache
from xtcache.errors import ConfigError

K, N = 4, 24  # head width, tail draws


def _reference(z: np.ndarray, V: int) -> np.ndarray:
    """fp64 log-softmax over every column (padded columns included, as the teacher's normaliser)."""
    z = z.astype(np.float64)
    m = z.max(1, keepdims=True)
    return z - (np.log(np.exp(z - m).sum(1, keepdims=True)) + m)


def _targets(z, V, seed, **kw):
    from stage1_teacher.capture.head import distill_targets

    return distill_targets(torch.from_numpy(z), np.zeros(len(z), dtype=np.int64), mode="headtail", k=K, vocab_size=V,
                           num_samples=N, generator=torch.Generator().manual_seed(seed), **kw)


def _teacher_tensors(t):
    """(ids with padding -1, log-probs, counts, residual) of `distill_targets` output, as the stage-2 batch holds them
    (`stage2_student.batches.drawn_targets`), in float64."""
    b = drawn_targets(t.ids.astype(np.int64), t.logprobs, t.counts.astype(np.float32))
    return (torch.from_numpy(b["teacher_ids"]), torch.from_numpy(b["teacher_logprobs"]).double(),
            torch.from_numpy(b["teacher_counts"]).double(), torch.from_numpy(t.residual).double())


def test_headtail_targets_match_a_dense_reference():
    rng = np.random.default_rng(0)
    n, V, pad = 41, 60, 5
    z = (rng.normal(size=(n, V + pad)) * 3).astype(np.float32)
    z[:, V:] += 1.0  # padded lm_head columns with mass: never emitted
    z[0, :K] += 200.0  # all mass in the head: no draws
    lp = _reference(z, V)
    t = _targets(z, V, seed=1, rows_per_block=7)
    assert t.ids.shape == (n, K + N) and t.logprobs.shape == (n, K) and t.counts.shape == (n, N)
    head = np.argsort(-lp[:, :V], 1, kind="stable")[:, :K]
    assert np.array_equal(t.ids[:, :K], head)  # the exact top-K, most likely first
    np.testing.assert_allclose(t.logprobs, np.take_along_axis(lp, head, 1), atol=1e-5)
    assert np.all(np.diff(t.logprobs, axis=1) <= 0)
    in_vocab = np.exp(lp[:, :V])
    tail_mass = in_vocab.sum(1) - np.take_along_axis(in_vocab, head, 1).sum(1)
    np.testing.assert_allclose(t.residual, tail_mass, rtol=1e-5, atol=1e-7)
    assert t.residual[0] == 0 and not t.counts[0].any() and not t.ids[0, K:].any()
    for r in range(1, n):
        live = t.counts[r] > 0  # [N]: the tail's slots, ids [K:]
        assert t.counts[r].sum() == N
        tail_ids = t.ids[r, K:][live]
        assert (tail_ids < V).all() and not set(tail_ids.tolist()) & set(head[r].tolist())
        assert len(set(tail_ids.tolist())) == live.sum()
        key = list(zip(-t.counts[r][live].astype(int), tail_ids))
        assert key == sorted(key) and np.all(live[:live.sum()])  # by count desc, id asc; padding last
        assert not t.ids[r, K:][~live].any()  # padding id 0
    again = _targets(z, V, seed=1, rows_per_block=13)  # other blocks, same seed: the same draws
    assert np.array_equal(again.ids, t.ids) and np.array_equal(again.counts, t.counts)
    other = _targets(z, V, seed=2)
    assert not np.array_equal(other.counts, t.counts)


def test_the_estimate_and_its_cross_entropy_are_unbiased():
    """Mean of p_hat over many independent draws -> p; mean CE estimate -> the exact CE, within 5 standard errors."""
    rng = np.random.default_rng(3)
    V, trials = 30, 4000
    z_row = (rng.normal(size=V) * 1.5).astype(np.float32)
    t = _targets(np.repeat(z_row[None], trials, 0), V, seed=7)
    ids, lp, counts, resid = _teacher_tensors(t)
    log_p_hat, rest = losses.teacher_logprobs(ids, lp, counts, resid, torch.float64)
    assert not rest.any()
    p_hat = torch.zeros(trials, V, dtype=torch.float64).scatter_add_(
        1, ids.clamp(min=0), torch.where(ids >= 0, log_p_hat.exp(), 0.0))  # [trials, V]
    p = np.exp(_reference(z_row[None], V)[0])
    np.testing.assert_allclose(p_hat.sum(1).numpy(), 1.0, atol=1e-5)  # head + R = 1 (no padded columns)
    se = p_hat.std(0).numpy() / math.sqrt(trials)
    assert np.all(np.abs(p_hat.mean(0).numpy() - p) <= 5 * se + 1e-6), np.abs(p_hat.mean(0).numpy() - p) / (se + 1e-12)
    log_q = np.log(np.exp(_reference(rng.normal(size=(1, V)), V)[0]))
    ce = -(p_hat.numpy() * log_q).sum(1)  # [trials]
    exact = -(p * log_q).sum()
    assert abs(ce.mean() - exact) <= 5 * ce.std() / math.sqrt(trials), (ce.mean(), exact)
    # its variance: R^2 Var_{j ~ p_tail}(log q_j) / n (docs/losses.md)
    head = t.ids[0, :K]
    tail = np.setdiff1d(np.arange(V), head)
    R = p[tail].sum()
    p_tail = p[tail] / R
    var = R**2 * (p_tail * (log_q[tail] - (p_tail * log_q[tail]).sum()) ** 2).sum() / N
    assert abs(ce.var() / var - 1) < 0.15, (ce.var(), var)


def _store(path, rows_of_docs, damage=None):
    """A headtail store of synthetic documents (rows of `distill_targets` output); `damage(docs)` edits them first."""
    from schemas.models import Manifest
    from xtcache.store import CacheWriter, DocRecord

    V = 60
    manifest = Manifest(cache_key="headtail-test", mode="headtail", k=K + N, top_k=K, num_samples=N,
                        teacher_vocab_size=V)
    docs = []
    for i, t in enumerate(rows_of_docs):
        T = len(t.ids) + 1  # position 0 predicts nothing
        pad = lambda a, fill=0: np.concatenate([np.full((1, *a.shape[1:]), fill, a.dtype), a])  # noqa: E731
        docs.append(DocRecord(source="mem", row=i, text="x" * T, teacher_ids=np.arange(T, dtype=np.int32),
                              char_offsets=np.stack([np.arange(T), np.arange(1, T + 1)], 1).astype(np.int32),
                              has_pred=np.arange(T) > 0, topk_ids=pad(t.ids), topk_logprobs=pad(t.logprobs),
                              topk_counts=pad(t.counts), residual=pad(t.residual), realized_logprob=pad(t.realized)))
    if damage is not None:
        damage(docs)
    with CacheWriter(str(path), manifest) as w:
        w.write_part(0, docs)
        w.finish()
    return str(path)


def test_a_store_reads_back_verifies_and_a_tail_id_in_the_head_fails_verify(tmp_path):
    from xtcache.app.store_commands import verify_store
    from xtcache.store import CacheReader

    rng = np.random.default_rng(5)
    z = (rng.normal(size=(30, 60)) * 3).astype(np.float32)
    z[3, :K] += 200.0
    t = _targets(z, 60, seed=0)
    url = _store(tmp_path / "ok", [t])
    assert verify_store(url) == []
    data = CacheReader(url).read_shard(CacheReader(url).shards[0].shard_id)
    assert data.topk_ids.shape == (31, K + N) and data.topk_logprobs.shape == (31, K)
    assert data.topk_counts.shape == (31, N)
    for r in range(30):
        head_ids, tail_ids, counts = data.topk_ids[1 + r, :K], data.topk_ids[1 + r, K:], data.topk_counts[1 + r]
        assert np.all(np.diff(head_ids) > 0)  # the head by position, ascending by id
        got_head = dict(zip(head_ids.tolist(), data.topk_logprobs[1 + r].tolist()))
        assert sorted(got_head) == sorted(t.ids[r, :K].tolist())
        for j, want in zip(t.ids[r, :K], t.logprobs[r]):  # sqrt-prob code: |sqrt p' - sqrt p| <= 1/254
            assert abs(math.exp(got_head[int(j)] / 2) - math.exp(want / 2)) <= 0.5 / 127 + 1e-6
        live = counts > 0
        assert np.all(live[:live.sum()]) and np.all(np.diff(tail_ids[live]) > 0)  # drawn ids ascending, padding last
        want = t.counts[r] > 0
        assert dict(zip(tail_ids[live].tolist(), counts[live].tolist())) == dict(
            zip(t.ids[r, K:][want].tolist(), t.counts[r][want].tolist()))
    np.testing.assert_allclose(data.residual[1:], t.residual, rtol=2**-10, atol=1e-7)

    def tail_id_in_head(docs):
        docs[0].topk_ids[5, K] = docs[0].topk_ids[5, 0]  # position 5's first draw is its most likely head id

    problems = verify_store(_store(tmp_path / "bad", [t], damage=tail_id_in_head))
    assert len(problems) == 1 and "\n" not in problems[0]
    assert "topk_counts" in problems[0] and "position 5" in problems[0], problems


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_the_id_transform_codes_head_and_tail_apart(dtype):
    """Each run sorted and delta coded on its own, decoded back in place or not; one run keeps its config."""
    from xtcache.store import codecs

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5000, size=(40, K + N))
    codec = codecs.SortedDeltaIds(dtype, head=K)
    deltas, order = codec.encode(ids)
    assert np.array_equal(np.sort(order[:, :K], 1), np.tile(np.arange(K), (40, 1)))  # values stay in their run
    want = np.concatenate([np.sort(ids[:, :K], 1), np.sort(ids[:, K:], 1)], 1)
    assert np.array_equal(codec.decode(deltas.copy()), want)
    assert np.array_equal(codec.decode(deltas.copy(), overwrite=True), want)
    assert np.array_equal(np.take_along_axis(ids, order, 1), want)
    assert codecs.codec_from_config(codec.to_config()) == codec
    assert "head" not in codecs.SortedDeltaIds(dtype).to_config()["configuration"]  # topk, full, sampled: as before
    assert codecs.default_codecs("headtail", 60, k=K + N, top_k=K)["topk_ids"]["configuration"]["head"] == K


def test_ids_split_after_another_width_are_refused(tmp_path):
    """A writer refuses a manifest whose id transform splits elsewhere than top_k; a reader a part that does."""
    import json

    from schemas.models import CodecConfig, Manifest
    from xtcache.errors import CorruptionError, XtcacheError
    from xtcache.store import CacheReader, CacheWriter, codecs

    bad = Manifest(cache_key="headtail-test", mode="headtail", k=K + N, top_k=K, num_samples=N, teacher_vocab_size=60,
                   codecs={k: CodecConfig(**v) for k, v in codecs.default_codecs("headtail", 60, k=K + N, top_k=K - 1).items()})
    with pytest.raises(XtcacheError, match="splits rows after 3 ids"):
        CacheWriter(str(tmp_path / "bad"), bad)
    rng = np.random.default_rng(2)
    url = _store(tmp_path / "ok", [_targets((rng.normal(size=(8, 60)) * 3).astype(np.float32), 60, seed=0)])
    for name in ["manifest.json", *[f"index/{p.name}" for p in (tmp_path / "ok" / "index").iterdir()]]:
        path = tmp_path / "ok" / name
        doc = json.loads(path.read_text())
        ids = doc["codecs"]["topk_ids"] if name == "manifest.json" else doc["arrays"]["topk_ids"]["transform"]
        ids["configuration"]["head"] = K + 1
        path.write_text(json.dumps(doc))
    r = CacheReader(url)
    with pytest.raises(CorruptionError, match="splits rows after 5 ids, mode headtail needs 4"):
        r.read_shard(r.shards[0].shard_id)


def test_kinds_and_refusals():
    same, cross = Capabilities(same_tokenizer=True, mode="headtail"), Capabilities(same_tokenizer=False, mode="headtail")
    assert resolve_kind("auto", same) == "sampled" and resolve_kind("sampled", same) == "sampled"
    assert resolve_kind("auto", cross) == "pkl"
    for bad in ("kl", "rkl", "jsd"):
        with pytest.raises(ConfigError, match="headtail"):
            resolve_kind(bad, same)
    from stage2_student.config import LossConfig

    for caps in (same, cross):
        with pytest.raises(ConfigError, match="--temperature 2 on a headtail cache"):
            Objective.from_config(LossConfig(temperature=2.0), caps, projection=_identity_projection(4))
    Objective.from_config(LossConfig(), same)  # T = 1 is fine


def _identity_projection(v):
    return losses.ProjectionOperator(torch.eye(v).to_sparse())


def test_the_capture_settings_tell_the_modes_apart():
    from schemas.models import Manifest
    from stage1_teacher.config import build_config, settings_for_fingerprint
    from xtcache.fingerprint import settings_fingerprint

    def key(**kw):
        cfg = build_config({"teacher": "t", "student_tokenizer": ["s"], "data": ["d.txt"], "out": "o", **kw})
        return settings_fingerprint(settings_for_fingerprint(cfg, window_len=64, boundary_tokenizers=[]))

    keys = [key(mode="topk", top_k=4), key(mode="sampled", num_samples=24), key(mode="headtail", top_k=4, num_samples=24),
            key(mode="headtail", top_k=8, num_samples=24), key(mode="headtail", top_k=4, num_samples=16),
            key(mode="headtail", top_k=4, num_samples=24, seed=1)]
    assert len(set(keys)) == len(keys)
    with pytest.raises(ValueError, match="headtail"):
        Manifest(cache_key="x", mode="headtail", k=K + N + 1, top_k=K, num_samples=N, teacher_vocab_size=60)


# ---------------------------------------------------------------------------------------------- stage 2


@pytest.fixture(scope="module")
def headtail_store(toy_setup, tmp_path_factory):
    from xtcache.testing.caches import build_hf_cache

    return build_hf_cache(tmp_path_factory.mktemp("headtail") / "store", toy_setup.teacher_model, toy_setup.train_jsonl,
                          [toy_setup.teacher_tokenizer, toy_setup.student_tokenizer], mode="headtail", k=K,
                          num_samples=N, max_docs=12, docs_per_part=6)


@pytest.mark.parametrize("same", [True, False], ids=["same-tokenizer", "cross-tokenizer"])
def test_stage2_trains_on_a_headtail_store(toy_setup, headtail_store, same):
    """A few steps on one micro-batch of the real loader: the KD term falls, through the estimator."""
    from transformers import AutoModelForCausalLM

    from stage2_student import loader as L
    from stage2_student.config import LoaderConfig, LossConfig
    from stage2_student.student import model_inputs
    from xtcache.app.store_commands import verify_store

    assert verify_store(headtail_store) == []
    tok = toy_setup.teacher_tokenizer if same else toy_setup.student_tokenizer
    ds = L.CacheDataset(headtail_store, str(tok), LoaderConfig(seq_len=48, micro_batch_size=2), seed=0)
    batch = next(iter(L.CacheLoader(ds, num_workers=0)))
    assert "teacher_counts" in batch and "teacher_logprobs" in batch and (batch["teacher_ids"] >= 0).any()
    projection = None
    if not same:
        from xtcache.projection import build_projection
        from xtcache.tokenizer import load_tokenizer

        teacher = load_tokenizer(toy_setup.teacher_tokenizer)
        pm = build_projection(load_tokenizer(toy_setup.student_tokenizer), teacher)
        projection = losses.ProjectionOperator(pm.to_torch_sparse(len(teacher)))
    obj = Objective.from_config(LossConfig(), Capabilities(same_tokenizer=same, mode="headtail"), projection)
    assert obj.kind == ("sampled" if same else "pkl")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(toy_setup.teacher_model if same else toy_setup.student_model),
                                                 dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    chunks, tokens = obj.counts(batch)
    kds = []
    for _ in range(6):
        logits = model(**model_inputs(batch)).logits
        loss, m = obj(logits, obj.prepare(batch, vocab=logits.shape[-1]), chunks_total=chunks, tokens_total=tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        kds.append(float(m["kd_sum"]) / chunks)
    assert all(math.isfinite(v) for v in kds) and kds[-1] < 0.9 * kds[0], kds


def test_teacher_dump_headtail_end_to_end(tmp_path, toy_setup):
    """`xtcache teacher-dump --engine hf --mode headtail`, then `xtcache verify` and `inspect`."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(toy_setup.train_jsonl.read_text().splitlines(keepends=True)[:6]))
    out = tmp_path / "store"
    proc = xtcache("teacher-dump", "--teacher", toy_setup.teacher_model, "--student-tokenizer", toy_setup.student_tokenizer,
                   "--data", data, "--out", out, "--mode", "headtail", "--top-k", K, "--num-samples", N, "--engine", "hf")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from xtcache.app.store_commands import store_summary, verify_store

    assert verify_store(str(out)) == []
    m = store_summary(str(out)).manifest
    assert (m.mode, m.top_k, m.num_samples, m.settings["seed"]) == ("headtail", K, N, 0)
