"""Stage 2 streaming loader on real small stores (CacheWriter + real toy-tokenizer alignments).

    .venv/bin/python -m pytest -x -q tests/test_loader.py
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.models import AlignGroupMeta, Manifest
from stage2_student import loader as L
from stage2_student.order import epoch_window_order, global_micro_batch, is_held_out
from tests.loader_settings import loader_settings
from xtcache.align.chunks import align_text
from xtcache.align.tokenizer import encode_with_offsets
from xtcache.errors import ConfigError
from xtcache.fingerprint import tokenizer_fingerprint
from xtcache.packing import pack_documents
from xtcache.store import AlignmentRecord, CacheReader, CacheWriter, DocRecord

K = 4
SEQ = 48


# ------------------------------------------------------------------------------ pure packing


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=30), min_size=1, max_size=6),
       st.integers(4, 24))
def test_pack_documents_cuts_at_chunks_and_covers_each_chunk_once(docs, seq_len):
    lens = [np.asarray(d, dtype=np.int64) for d in docs]
    plan = pack_documents(list(range(len(docs))), lens, seq_len)
    seen = {d: np.zeros(len(x), dtype=int) for d, x in enumerate(lens)}
    for w in range(plan.num_windows):
        segs = range(plan.window_offsets[w], plan.window_offsets[w + 1])
        total = sum(int(lens[plan.seg_doc[i]][plan.seg_lo[i]:plan.seg_hi[i]].sum()) for i in segs)
        assert 0 < len(segs) and total <= seq_len
        for i in segs:
            d, lo, hi = plan.seg_doc[i], plan.seg_lo[i], plan.seg_hi[i]
            if plan.seg_ctx[i]:
                assert i == plan.window_offsets[w] and lens[d][lo] > 0  # context opens a window
                lo += 1
            seen[d][lo:hi] += 1
    skipped = 0
    for d, x in enumerate(lens):
        too_long = x > seq_len
        assert (seen[d][~too_long] == 1).all() and (seen[d][too_long] == 0).all()
        skipped += int(too_long.sum())
    assert plan.skipped_chunks == skipped


def test_epoch_order_and_rank_partition_are_pure():
    a = epoch_window_order([3, 5, 2], seed=1, epoch=0)
    assert np.array_equal(a, epoch_window_order([3, 5, 2], seed=1, epoch=0))
    assert not np.array_equal(a, epoch_window_order([3, 5, 2], seed=1, epoch=1))
    assert sorted(map(tuple, a.tolist())) == [(s, w) for s, n in enumerate([3, 5, 2]) for w in range(n)]
    # world 2 x accum 2: every global micro-batch exactly once, in whole steps
    got = sorted(global_micro_batch(j, rank=r, world_size=2, grad_accum=2) for r in range(2) for j in range(6))
    assert got == list(range(12))
    assert [global_micro_batch(j, rank=1, world_size=2, grad_accum=2) for j in range(4)] == [2, 3, 6, 7]


def test_holdout_is_deterministic_and_near_fraction():
    ids = [f"c.jsonl:{i}:{i:016x}" for i in range(4000)]
    share = np.mean([is_held_out(d, 0.1) for d in ids])
    assert 0.08 < share < 0.12
    assert [is_held_out(d, 0.1) for d in ids[:50]] == [is_held_out(d, 0.1) for d in ids[:50]]
    assert not any(is_held_out(d, 0.0) for d in ids)


# ------------------------------------------------------------------------------ a real store


def _texts(toy_setup, n):
    with open(toy_setup.train_jsonl, encoding="utf-8") as f:
        return [json.loads(line)["text"][: 150 + 37 * i] for i, line in zip(range(n), f)]


def _doc(text, row, teacher_tok, rng, mode):
    ids, offsets = encode_with_offsets(teacher_tok, text)
    t = len(ids)
    has_pred = np.ones(t, dtype=bool)
    has_pred[0] = False
    if row % 5 == 3 and t > 6:
        has_pred[5] = False  # a row without prediction inside a document
    topk = np.stack([rng.choice(2048, K, replace=False) for _ in range(t)]).astype(np.int32)
    probs = rng.dirichlet(np.ones(K + 1), size=t)
    realized = -(row * 1000 + np.arange(t)) / 1000.0  # unique per (document, row): identifies rows
    counts = rng.integers(0, 4, size=(t, K)).astype(np.uint16) if mode == "sampled" else None
    return DocRecord(source="train.jsonl", row=row, text=text, teacher_ids=ids.astype(np.int32),
                     char_offsets=offsets.astype(np.int32), has_pred=has_pred, topk_ids=topk,
                     topk_logprobs=None if mode == "sampled" else np.log(probs[:, :K]).astype(np.float32),
                     topk_counts=counts, residual=probs[:, K].astype(np.float32),
                     realized_logprob=realized.astype(np.float32))


def _write_store(path, toy_setup, teacher_tok, student_tok, *, mode="topk", n_docs=14, parts=3, key=None):
    rng = np.random.default_rng(0)
    fp = tokenizer_fingerprint(student_tok)
    group = AlignGroupMeta(fingerprint=fp, tokenizer_name="toy-student", vocab_size=len(student_tok))
    # format version 2: float32 realized log-probs, which identify rows here (version 3 stores them as float16)
    manifest = Manifest(cache_key=key or f"loader-{mode}", mode=mode, k=K, teacher_vocab_size=2048, format_version=2,
                        num_samples=12 if mode == "sampled" else None, alignment_groups=[group],
                        fingerprints={"teacher_tokenizer": tokenizer_fingerprint(teacher_tok)})
    texts = _texts(toy_setup, n_docs)
    with CacheWriter(str(path), manifest) as w:
        for p, part in enumerate(np.array_split(np.arange(n_docs), parts)):
            docs, aligns = [], []
            for i in part:
                docs.append(_doc(texts[i], int(i), teacher_tok, rng, mode))
                s_ids, t_ids, al = align_text(texts[i], student_tok, teacher_tok)
                assert np.array_equal(t_ids, docs[-1].teacher_ids)
                aligns.append(AlignmentRecord(student_ids=s_ids.astype(np.int32), alignment=al))
            w.write_part(p, docs, {fp: aligns})
        w.finish()
    return str(path), fp


@pytest.fixture(scope="module")
def store(tmp_path_factory, toy_setup, teacher_tokenizer, student_tokenizer):
    return _write_store(tmp_path_factory.mktemp("loader") / "cache", toy_setup, teacher_tokenizer, student_tokenizer)


def _reference(url, fp):
    """(doc row, teacher position) -> stored row values; per document its student ids and chunk ends."""
    r = CacheReader(url)
    rows, docs = {}, {}
    for meta in r.shards:
        sd, al = r.read_shard(meta.shard_id), r.read_alignment(fp, meta.shard_id)
        for d, doc in enumerate(meta.docs):
            p0, p1 = sd.doc_pos_offsets[d], sd.doc_pos_offsets[d + 1]
            for t in range(p1 - p0):
                rows[(doc.row, t)] = (sd.topk_ids[p0 + t], sd.topk_logprobs[p0 + t], sd.residual[p0 + t],
                                      sd.has_pred[p0 + t])
            c0, c1 = al.doc_chunk_offsets[d], al.doc_chunk_offsets[d + 1]
            s0, s1 = al.doc_student_offsets[d], al.doc_student_offsets[d + 1]
            docs[doc.row] = (al.student_ids[s0:s1], al.student_end[c0:c1], al.teacher_end[c0:c1])
    return rows, docs


def _valid_chunks(batch):
    """[(doc row, first teacher position, n rows, student tokens)] of every valid chunk."""
    out = []
    for c in range(batch["num_chunks"]):
        real = batch["teacher_realized"][batch["teacher_chunk"] == c].numpy().astype(np.float64)
        key = np.round(-real * 1000).astype(np.int64)
        b, i = np.nonzero(batch["student_chunk"].numpy() == c)
        assert len(set(b.tolist())) == 1 and np.array_equal(i, np.arange(i[0], i[0] + len(i)))
        toks = batch["input_ids"][b[0], i + 1].numpy()  # the logit at i predicts token i + 1
        assert np.array_equal(batch["labels"][b[0], i].numpy(), toks)
        out.append((int(key[0] // 1000), int(key[0] % 1000), len(key), tuple(toks.tolist())))
        assert np.array_equal(key, key[0] + np.arange(len(key)))  # consecutive rows of one document
    return out


def _dataset(url, fp, **kw):
    args = dict(seq_len=SEQ, micro_batch_size=2, pad_id=2, seed=3)
    args.update(kw)
    return L.CacheDataset(url, fp, *loader_settings(args), **args)


def _all_batches(loader):
    return [b for b in loader]


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], int):
            assert a[k] == b[k]
        else:
            assert np.array_equal(a[k].numpy(), b[k].numpy()), k


def test_batches_hold_exact_chunks_and_stored_rows(store):
    url, fp = store
    rows, docs = _reference(url, fp)
    ds = _dataset(url, fp, epochs=1)
    batches = _all_batches(L.CacheLoader(ds))
    assert len(batches) == ds.batches_per_epoch > 0
    seen = set()
    for batch in batches:
        assert batch["input_ids"].shape == (2, SEQ) and batch["chunk_exact"].shape == (batch["num_chunks"],)
        assert batch["teacher_ids"].shape == (batch["teacher_chunk"].shape[0], K)
        for row, t0, n, toks in _valid_chunks(batch):
            s_ids, s_end, t_end = docs[row]
            c = int(np.searchsorted(t_end, t0, side="right"))  # the chunk whose teacher rows start at t0
            assert (t_end[c - 1] if c else 0) == t0 and t_end[c] == t0 + n  # a whole chunk, cut at its ends
            s0 = s_end[c - 1] if c else 0
            assert toks == tuple(s_ids[s0:s_end[c]].tolist())
            assert all(rows[(row, t)][3] for t in range(t0, t0 + n))
            seen.add((row, c))
        sel = batch["teacher_chunk"].numpy()
        for j in range(len(sel)):
            key = int(round(-float(batch["teacher_realized"][j]) * 1000))
            ids, lp, res, _ = rows[(key // 1000, key % 1000)]
            assert np.array_equal(batch["teacher_ids"][j].numpy(), ids)
            assert np.array_equal(batch["teacher_logprobs"][j].numpy(), lp)
            assert batch["teacher_residual"][j].item() == res
    assert len(seen) == sum(b["num_chunks"] for b in batches)  # no chunk twice in an epoch
    assert len(seen) > 0.5 * sum(len(d[1]) for d in docs.values())


def test_identical_batches_for_0_1_2_workers(store):
    url, fp = store
    runs = [_all_batches(L.CacheLoader(_dataset(url, fp, epochs=2), num_workers=n)) for n in (0, 1, 2)]
    assert len(runs[0]) == len(runs[1]) == len(runs[2]) > 2
    for a, b, c in zip(*runs):
        _same(a, b)
        _same(a, c)
    first, second = runs[0][: len(runs[0]) // 2], runs[0][len(runs[0]) // 2:]
    assert any(not np.array_equal(x["input_ids"].numpy(), y["input_ids"].numpy()) for x, y in zip(first, second))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_yields_exactly_the_remaining_batches(store, workers):
    url, fp = store
    full = _all_batches(L.CacheLoader(_dataset(url, fp, epochs=2)))
    cut = len(full) // 2 + 1  # inside the second half, across an epoch boundary
    ld = L.CacheLoader(_dataset(url, fp, epochs=2), num_workers=workers)
    it = iter(ld)
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(ld.state_dict()))
    del it
    resumed = L.CacheLoader(_dataset(url, fp, epochs=2), num_workers=workers)
    resumed.load_state_dict(state)
    rest = _all_batches(resumed)
    assert len(head) + len(rest) == len(full)
    for a, b in zip(head + rest, full):
        _same(a, b)
    with pytest.raises(ConfigError, match="cannot resume"):
        L.CacheLoader(_dataset(url, fp, epochs=2, seed=4)).load_state_dict(state)
    with pytest.raises(ConfigError, match="caches \\['another-cache'\\] -> \\['loader-topk'\\]"):
        L.CacheLoader(_dataset(url, fp, epochs=2)).load_state_dict({**state, "caches": ["another-cache"]})
    older = {k: v for k, v in state.items() if k != "caches"}  # a checkpoint from before the caches were recorded
    L.CacheLoader(_dataset(url, fp, epochs=2)).load_state_dict(older)


@pytest.mark.parametrize("workers", [0, 1])
def test_iterating_the_loader_leaves_torch_global_rng_alone(store, workers):
    """A resumed run starts one more iterator than the uninterrupted one, after its checkpoint restored
    torch's RNG: an iterator that drew from that RNG would put the resumed run's dropout out of line."""
    import torch

    url, fp = store
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for _ in range(2):
        next(iter(L.CacheLoader(_dataset(url, fp, epochs=1), num_workers=workers)))
    assert torch.equal(torch.get_rng_state(), before)


def test_ranks_are_disjoint_and_equal_grad_accum(store):
    url, fp = store
    one = _all_batches(L.CacheLoader(_dataset(url, fp, epochs=1, grad_accum=2)))
    ranks = [_all_batches(L.CacheLoader(_dataset(url, fp, epochs=1, rank=r, world_size=2))) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(one) // 2
    # world 1 x accum 2 and world 2 x accum 1 see the same global micro-batches, step by step
    for s in range(len(ranks[0])):
        _same(one[2 * s], ranks[0][s])
        _same(one[2 * s + 1], ranks[1][s])
    ds = [_dataset(url, fp, epochs=1, rank=r, world_size=2) for r in range(2)]
    windows = [set(map(tuple, np.concatenate([d.micro_batch_windows(0, j) for j in range(d.batches_per_epoch)])
                       .tolist())) for d in ds]
    assert not windows[0] & windows[1]
    step = 2 * 2
    assert len(windows[0] | windows[1]) == (ds[0].num_windows // step) * step  # all but the dropped remainder


def test_holdout_split_is_disjoint_from_train(store):
    url, fp = store
    rows = lambda batches: {k[0] for b in batches for k in _valid_chunks(b)}  # noqa: E731
    train = _all_batches(L.CacheLoader(_dataset(url, fp, epochs=1, holdout_fraction=0.3)))
    held = _all_batches(L.CacheLoader(_dataset(url, fp, split="eval", holdout_fraction=0.3)))
    assert rows(train) and rows(held) and not rows(train) & rows(held)
    ids = [f"{d.source}:{d.row}:{d.content_hash}" for m in CacheReader(url).shards for d in m.docs]
    assert rows(held) <= {int(i.split(":")[1]) for i in ids if is_held_out(i, 0.3)}


def test_student_fingerprint_mismatch_points_to_align(store):
    url, _ = store
    with pytest.raises(ConfigError, match=r"xtcache align .* --student-tokenizer"):
        _dataset(url, "0" * 64)


def test_same_tokenizer_store_gives_one_to_one_chunks(tmp_path, toy_setup, teacher_tokenizer):
    url, fp = _write_store(tmp_path / "same", toy_setup, teacher_tokenizer, teacher_tokenizer, n_docs=6, parts=2)
    ds = _dataset(url, fp, epochs=1)
    assert not ds.identity  # the alignment group exists (identity chunks written by align_text)
    for batch in L.CacheLoader(ds):
        assert batch["teacher_chunk"].tolist() == list(range(batch["num_chunks"]))
        assert int((batch["student_chunk"] >= 0).sum()) == batch["num_chunks"]
        assert batch["chunk_exact"].all()


def test_sampled_store_gives_counts(tmp_path, toy_setup, teacher_tokenizer, student_tokenizer):
    url, fp = _write_store(tmp_path / "sampled", toy_setup, teacher_tokenizer, student_tokenizer, mode="sampled",
                           n_docs=6, parts=1)
    batch = next(iter(L.CacheLoader(_dataset(url, fp, epochs=1))))
    assert "teacher_logprobs" not in batch and batch["teacher_counts"].dtype.is_floating_point
    assert ((batch["teacher_counts"] > 0) == (batch["teacher_ids"] >= 0)).all()


def test_measure_rate_counts_positions(store):
    """The benchmarks' loader rate counts the attention-mask tokens and chunks of the batches it read."""
    from xtcache.testing.rates import measure_rate

    url, fp = store
    out = measure_rate(L.CacheLoader(_dataset(url, fp)), 3)
    first = []
    for batch in L.CacheLoader(_dataset(url, fp)):  # the same seed: the same first batches
        first.append(batch)
        if len(first) == 3:
            break
    assert out["micro_batches"] == 3
    assert out["positions"] == sum(int(b["attention_mask"].sum()) for b in first) > 0
    assert out["chunks"] == sum(int(b["num_chunks"]) for b in first) > 0
    assert out["positions_per_s"] == pytest.approx(out["positions"] / out["seconds"])


def test_loader_batch_feeds_projected_kl_and_alm(store, student_tokenizer, teacher_tokenizer):
    """End to end: a real micro-batch, a real projection map, the P-KL and ALM losses and their gradients."""
    import torch

    from stage2_student import losses
    from stage2_student.objective import Objective
    from xtcache.projection import build_projection

    url, fp = store
    batch = next(iter(L.CacheLoader(_dataset(url, fp, epochs=1))))
    op = losses.ProjectionOperator(build_projection(student_tokenizer, teacher_tokenizer).to_torch_sparse(2048))
    logits = torch.randn(*batch["input_ids"].shape, len(student_tokenizer), requires_grad=True)
    vocab = logits.shape[-1]
    pkl = Objective("pkl", temperature=2.0, projection=op, row_chunk=16)
    alm = Objective("alm")
    pkl_sum, _ = pkl.sums(logits, pkl.prepare(batch, vocab=vocab))
    alm_sum, _ = alm.sums(logits, alm.prepare(batch, vocab=vocab))
    assert batch["num_chunks"] > 0 and torch.isfinite(pkl_sum + alm_sum)
    (pkl_sum + alm_sum).backward()
    touched = logits.grad.abs().sum(-1) > 0
    assert torch.equal(touched, batch["student_chunk"] >= 0)  # gradient exactly at the valid chunks' logits
    agree, n = pkl.agreement(logits, pkl.prepare(batch, vocab=vocab))
    assert 0 <= agree.item() <= n.item() == batch["num_chunks"]


def test_finished_eval_stream_starts_over(store):
    url, fp = store
    ld = L.CacheLoader(_dataset(url, fp, split="eval", holdout_fraction=0.3))
    first, second = _all_batches(ld), _all_batches(ld)
    assert len(first) == len(second) == len(ld) > 0
    for a, b in zip(first, second):
        _same(a, b)


def test_packed_documents_do_not_see_each_other(store, toy_setup):
    """A window packing several documents gives each the logits it would get alone, and no label,
    chunk or prediction reaches across a document boundary."""
    import torch
    from transformers import AutoModelForCausalLM

    from stage2_student.student import model_inputs

    url, fp = store
    batches = _all_batches(L.CacheLoader(_dataset(url, fp, epochs=1)))
    model = AutoModelForCausalLM.from_pretrained(toy_setup.student_model, dtype=torch.float32).eval()
    checked = 0
    for batch in batches:
        pos, mask = batch["position_ids"].numpy(), batch["attention_mask"].numpy()
        with torch.no_grad():
            packed = model(**model_inputs(batch)).logits
        for b in range(pos.shape[0]):
            starts = [i for i in range(int(mask[b].sum())) if pos[b, i] == 0] + [int(mask[b].sum())]
            for lo, hi in zip(starts[:-1], starts[1:]):
                assert batch["labels"][b, hi - 1] == -100  # the last token predicts nothing across
                chunks = set(batch["student_chunk"][b, lo:hi].tolist()) - {-1}
                assert not chunks & set(batch["student_chunk"][b, :lo].tolist())
                if len(starts) > 2:
                    with torch.no_grad():
                        alone = model(input_ids=batch["input_ids"][b:b + 1, lo:hi]).logits[0]
                    torch.testing.assert_close(packed[b, lo:hi], alone, atol=1e-4, rtol=1e-4)
                    checked += 1
    assert checked >= 4, "no window packed several documents; shorten the documents or raise SEQ"


def test_a_part_longer_than_its_alignment_is_refused_by_the_reader_check(store, monkeypatch):
    """The check that each document's chunks end at its teacher token count lives in the reader
    (`read_alignment(doc_pos_offsets=)`); the loader hands it the offsets of the part it decoded."""
    from xtcache.errors import CorruptionError

    url, fp = store
    real = CacheReader.read_shard

    def longer_first_document(self, sid, **kw):
        sd = real(self, sid, **kw)
        sd.doc_pos_offsets = sd.doc_pos_offsets + (np.arange(sd.doc_pos_offsets.shape[0]) > 0)
        return sd

    monkeypatch.setattr(CacheReader, "read_shard", longer_first_document)
    with pytest.raises(CorruptionError, match=r"alignment group .* part .*'teacher_end' are damaged: a document's "
                                              "last chunk does not end at its token count"):
        next(iter(L.CacheLoader(_dataset(url, fp))))
    reader = CacheReader(url)
    sid = reader.shards[0].shard_id
    with pytest.raises(CorruptionError, match="does not end at its token count"):
        reader.read_alignment(fp, sid, doc_pos_offsets=reader.read_shard(sid).doc_pos_offsets)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), max_size=12), max_size=3), st.integers(41, 60), st.integers(2, 12))
def test_common_boundaries_cut_teacher_windows_only_at_every_alignments_chunk_ends(ends, n_tokens, max_len):
    """xtcache.packing.common_boundaries serves stage 1's window cuts: a window that ends inside the
    document ends at the last chunk end of every alignment inside it, whenever there is one."""
    from stage1_teacher.windows import plan_windows
    from xtcache.packing import common_boundaries

    arrays = [np.sort(np.asarray(e, dtype=np.int32)) for e in ends]
    got = common_boundaries(arrays)
    assert got.dtype == np.int64 and np.all(np.diff(got) > 0) and np.all(got > 0)
    assert all(np.isin(got, a).all() for a in arrays)
    for w in plan_windows(n_tokens, max_len, 0, got):
        inside = got[(got > w.store_start) & (got <= w.end)]
        if w.end < n_tokens and len(inside):
            assert w.end == inside.max() and all(w.end in a for a in arrays)


# ------------------------------------------------------------------------------ rollouts + corpus (GKD's lambda)


@pytest.mark.parametrize("fraction", [0.5, 0.3, 0.25, 0.75, 0.9, 0.1])
def test_every_run_of_micro_batches_holds_the_fraction_of_rollouts_rounded(fraction):
    """Any n consecutive micro-batches (a round of a few steps starts at 0) hold fraction x n rollout micro-batches
    rounded up or down, for every seed; the seed moves the phase, and the schedule is a pure function."""
    from stage2_student.rollout_mix import draws_rollout

    for seed in range(20):
        draws = np.array([draws_rollout(seed, g, fraction) for g in range(400)])
        assert draws.tolist() == [draws_rollout(seed, g, fraction) for g in range(400)]
        sums = np.concatenate([[0], np.cumsum(draws)])
        for n in (1, 2, 3, 4, 8, 16, 57):
            window = sums[n:] - sums[:-n]  # every run of n consecutive micro-batches
            assert window.min() >= np.floor(fraction * n) and window.max() <= np.ceil(fraction * n), (seed, n)
    phases = {tuple(draws_rollout(seed, g, 0.3) for g in range(10)) for seed in range(20)}
    assert len(phases) > 1  # the seed moves the phase
    assert all(draws_rollout(5, g, 1.0) for g in range(100))


@pytest.mark.parametrize("world, accum", [(1, 4), (2, 1), (2, 2), (3, 1), (4, 1)])
def test_every_rank_and_every_optimizer_step_hold_the_fraction_of_rollouts(world, accum):
    """Each rank's micro-batches hold the fraction of rollouts, rounded, in every run of them (each rank reads its
    own share of both caches: none may read one stream only), and so do the ranks' micro-batches of every
    optimizer step together."""
    from stage2_student.rollout_mix import draws_rollout

    for fraction in (0.5, 0.25, 0.75, 1 / 3):
        for seed in range(5):
            draws = np.array([[draws_rollout(seed, j, fraction, rank=r, world_size=world) for j in range(200)]
                              for r in range(world)])
            for n in (1, 2, 4, 7):
                sums = np.concatenate([np.zeros((world, 1)), np.cumsum(draws, axis=1)], axis=1)
                window = sums[:, n:] - sums[:, :-n]  # every run of n micro-batches of every rank
                assert window.min() >= np.floor(fraction * n) and window.max() <= np.ceil(fraction * n)
            steps = draws.reshape(world, -1, accum).sum(axis=(0, 2))  # each step: every rank's accum micro-batches
            assert steps.min() >= np.floor(fraction * world * accum) - 1e-9, (fraction, seed)
            assert steps.max() <= np.ceil(fraction * world * accum) + 1e-9, (fraction, seed)


def test_rollout_mixture_reads_each_stream_in_order_and_resumes_exactly(store, tmp_path, toy_setup, teacher_tokenizer,
                                                                          student_tokenizer, caplog):
    from stage2_student.rollout_mix import MixedLoader

    corpus, fp = store
    rollouts, _ = _write_store(tmp_path / "rollouts", toy_setup, teacher_tokenizer, student_tokenizer, n_docs=6,
                               parts=2)

    def mixed(seed=3):
        return MixedLoader(L.CacheLoader(_dataset(rollouts, fp)), L.CacheLoader(_dataset(corpus, fp)), fraction=0.4,
                           seed=seed)

    n, cut = 16, 7
    loader = mixed()
    it = iter(loader)
    full = [next(it) for _ in range(n)]
    drawn = [loader.source(j) for j in range(n)]
    assert 0 < drawn.count("rollouts") < n
    alone = {"rollouts": iter(L.CacheLoader(_dataset(rollouts, fp))), "corpus": iter(L.CacheLoader(_dataset(corpus, fp)))}
    for batch, name in zip(full, drawn):  # each stream's own batches, in its own order
        _same(batch, next(alone[name]))
    first = mixed()
    it = iter(first)
    head = [next(it) for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    resumed = mixed()
    resumed.load_state_dict(state)
    it = iter(resumed)
    for a, b in zip(head + [next(it) for _ in range(n - cut)], full):
        _same(a, b)
    with pytest.raises(ConfigError, match="cannot resume"):
        mixed(seed=4).load_state_dict(state)
    older = {**state, "mixture": {k: v for k, v in state["mixture"].items() if k not in ("schedule", "corpus_loss")}}
    with pytest.raises(ConfigError, match="drawn from the rollouts and the corpus independently"):
        mixed().load_state_dict(older)  # the independent draws of before: another stream
    assert state["mixture"]["corpus_loss"] == "kd"
    other = MixedLoader(L.CacheLoader(_dataset(rollouts, fp)), L.CacheLoader(_dataset(corpus, fp)), fraction=0.4,
                        seed=3, corpus_loss="ce")
    with caplog.at_level(logging.WARNING, logger="stage2_student.rollout_mix"):
        other.load_state_dict(state)  # the same stream, another loss on its corpus micro-batches: allowed, logged
    assert "resuming with --corpus-loss ce on a checkpoint trained with --corpus-loss kd" in caplog.text
    with pytest.raises(ConfigError, match="own ranks"):
        L.reshard_state(state, rank=0, world_size=2, grad_accum=1)


def test_init_from_continues_the_corpus_stream_of_the_same_cache_and_starts_any_other_at_its_beginning(
        store, tmp_path, toy_setup, teacher_tokenizer, student_tokenizer, caplog):
    """The next round (--init-from the last one's checkpoint, new rollouts) reads the corpus micro-batches that
    follow the ones the last round read, not the corpus's first ones again; a checkpoint of another cache, seed or
    rank layout leaves the corpus stream at its beginning, logged."""
    from stage2_student.rollout_mix import MixedLoader

    corpus, fp = store
    rollouts = [_write_store(tmp_path / f"rollouts{r}", toy_setup, teacher_tokenizer, student_tokenizer, n_docs=6,
                             parts=2, key=f"rollouts-{r}")[0] for r in range(2)]

    def mixed(r, seed=3):
        return MixedLoader(L.CacheLoader(_dataset(rollouts[r], fp, seed=seed)),
                           L.CacheLoader(_dataset(corpus, fp, seed=seed)), fraction=0.5, seed=seed)

    first = mixed(0)
    it = iter(first)
    for _ in range(8):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    alone = iter(L.CacheLoader(_dataset(corpus, fp)))
    read = [next(alone) for _ in range(state["corpus"]["consumed"])]  # round 0's corpus micro-batches
    assert len(read) == 4
    nxt = mixed(1)
    with caplog.at_level(logging.INFO, logger="stage2_student.rollout_mix"):
        assert nxt.continue_corpus(state, "ckpt/step2")
    assert "continues where --init-from ckpt/step2 left it (epoch 0, micro-batch 4)" in caplog.text
    it = iter(nxt)
    own = iter(L.CacheLoader(_dataset(rollouts[1], fp)))
    for j in range(8):  # its own rollouts from their start, the corpus from where round 0 left it
        _same(next(it), next(alone) if nxt.source(j) == "corpus" else next(own))
    unmixed = L.CacheLoader(_dataset(corpus, fp))  # a run that trained on the corpus as its --cache
    it = iter(unmixed)
    for _ in range(3):
        next(it)
    again = mixed(1)
    assert again.continue_corpus(json.loads(json.dumps(unmixed.state_dict())), "ckpt") and again.corpus.consumed == 3
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stage2_student.rollout_mix"):
        assert not mixed(1).continue_corpus({"mixture": {}, "corpus": {**state["corpus"], "caches": ["other"]}}, "c")
        assert not mixed(1, seed=4).continue_corpus(state, "c")
        assert not mixed(1).continue_corpus(None, "c")
        assert not mixed(1).continue_corpus({k: v for k, v in state["corpus"].items() if k != "caches"}, "c")
    assert caplog.text.count("starts at its beginning") == 4
    assert "did not read that cache" in caplog.text and "seed 3 -> 4" in caplog.text
    assert "another number of ranks" in caplog.text
    fresh = mixed(1)
    fresh.continue_corpus(None, "c")
    assert fresh.corpus.consumed == 0 and fresh.corpus.epoch == 0


def _mixed_beside_alone(corpus_loss: str, store, tmp_path, toy_setup, teacher_tokenizer, student_tokenizer):
    """(micro-batch j of a rollouts + corpus MixedLoader under `corpus_loss`, its stream's name, that stream's own
    next micro-batch read alone) for j = 0..11."""
    from stage2_student.rollout_mix import MixedLoader

    corpus, fp = store
    rollouts, _ = _write_store(tmp_path / "rollouts", toy_setup, teacher_tokenizer, student_tokenizer, n_docs=6,
                               parts=2)
    loader = MixedLoader(L.CacheLoader(_dataset(rollouts, fp)), L.CacheLoader(_dataset(corpus, fp)), fraction=0.4,
                         seed=3, corpus_loss=corpus_loss)
    it = iter(loader)
    alone = {"rollouts": iter(L.CacheLoader(_dataset(rollouts, fp))), "corpus": iter(L.CacheLoader(_dataset(corpus, fp)))}
    for j in range(12):
        name = loader.source(j)
        yield next(it), name, next(alone[name])


def test_corpus_loss_auto_marks_the_corpus_micro_batches_for_their_own_objective_and_leaves_them_whole(
        store, tmp_path, toy_setup, teacher_tokenizer, student_tokenizer):
    from stage2_student.rollout_mix import CORPUS_OBJECTIVE_KEY

    names = []
    for batch, name, want in _mixed_beside_alone("auto", store, tmp_path, toy_setup, teacher_tokenizer,
                                                 student_tokenizer):
        names.append(name)
        assert bool(batch.pop(CORPUS_OBJECTIVE_KEY, False)) == (name == "corpus")
        _same(batch, want)  # teacher values and all
    assert set(names) == {"rollouts", "corpus"}


def test_corpus_loss_ce_gives_the_corpus_micro_batches_without_their_teacher_and_the_rollouts_as_they_are(
        store, tmp_path, toy_setup, teacher_tokenizer, student_tokenizer):
    from stage2_student.join import TEACHER_KEYS
    from stage2_student.rollout_mix import CORPUS_OBJECTIVE_KEY

    for batch, name, want in _mixed_beside_alone("ce", store, tmp_path, toy_setup, teacher_tokenizer,
                                                 student_tokenizer):
        if name == "rollouts":
            _same(batch, want)
            continue
        assert batch[CORPUS_OBJECTIVE_KEY] and want["num_chunks"] > 0
        assert not set(TEACHER_KEYS) & set(batch)  # no teacher key is left to read, no chunk to count
        teacher = {*TEACHER_KEYS, "num_groups", "num_teachers", CORPUS_OBJECTIVE_KEY}
        _same({k: v for k, v in batch.items() if k not in teacher},
              {k: v for k, v in want.items() if k not in teacher})  # the same text, labels and masks
