"""`xtcache teacher-dump` and `xtcache align` end to end with the transformers engine (no vLLM).

Stores are real Zarr stores on disk; stored values are checked against an independent
transformers forward of the teacher. The vLLM engines are covered in test_stage1_vllm.py.

    .venv/bin/python -m pytest -q tests/test_stage1_dump.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from stage1_teacher.config import build_config
from stage1_teacher.dump import run_teacher_dump
from stage1_teacher.summary import Summary
from tests.commands import WarmProcs, xtcache
from xtcache.errors import CaptureError, ConfigError, StoreError

REPO = Path(__file__).resolve().parents[1]
QUANT_TOL = 0.5 / 127 + 1e-4  # in sqrt(p): half a step of the default sqrt-prob codec (format 3)


def assert_stored_close(stored, want):
    """Stored log-probs within QUANT_TOL of `want` in sqrt(p), the metric the sqrt-prob codec bounds."""
    np.testing.assert_allclose(np.exp(stored / 2.0), np.exp(np.asarray(want, np.float64) / 2.0), atol=QUANT_TOL)


@pytest.fixture(scope="module")
def corpus(toy_setup, tmp_path_factory):
    """24 held-out documents plus rows that must be skipped."""
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:24]
    with open(path, "wb") as f:
        for i, t in enumerate(texts):
            f.write((json.dumps({"text": t}) + "\n").encode())
            if i == 3:
                f.write(b'{"text": ""}\n{"nope": 1}\n{"text": "bad \xff"}\n{"text": "x"}\n')
    return str(path)


def dump(teacher, corpus, out, students, **kw):
    values = {"teacher": teacher, "student_tokenizer": [str(s) for s in students],
              "data": corpus if isinstance(corpus, list) else [corpus],
              "out": str(out), "engine": "hf", "max_seq_len": 160, "window_overlap": 32, "docs_per_part": 8,
              "top_k": 16, **kw}
    return run_teacher_dump(build_config(values), progress=False)


def hf_logprobs(teacher, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        z = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0]
    return torch.log_softmax(z, -1).numpy()  # [T, V_model]; row t predicts token t+1


def read_all(url):
    from xtcache.store import CacheReader

    r = CacheReader(str(url))
    return r, [r.read_shard(m.shard_id, verify=True) for m in r.shards]


def test_topk_cross_and_same_tokenizer_match_transformers(teacher, corpus, toy_setup, tmp_path, student_tokenizer,
                                                          teacher_tokenizer):
    from xtcache.align.chunks import align_text
    from xtcache.app.store_commands import verify_store

    s = dump(teacher, corpus, tmp_path / "s", [toy_setup.student_tokenizer, toy_setup.teacher_tokenizer],
             max_seq_len=1024, window_overlap=0)
    assert isinstance(s, Summary) and s.documents == 24
    assert s.skipped == {"empty document": 1, "missing text field": 1, "invalid UTF-8": 1,
                         "fewer than 2 teacher tokens": 1}
    assert verify_store(str(tmp_path / "s")) == []
    r, shards = read_all(tmp_path / "s")
    groups = r.alignment_groups()
    assert len(groups) == 2 and sorted(g.identity for g in groups.values()) == [False, True]
    V = r.manifest.teacher_vocab_size
    for shard in shards[:2]:
        for i in range(0, shard.num_docs, 3):
            d = shard.doc(i)
            lp = hf_logprobs(teacher, d.teacher_ids)  # independent reference, whole document
            assert not d.has_pred[0] and d.has_pred[1:].all()
            ref = lp[:-1]  # rows predicting tokens 1..T-1
            np.testing.assert_allclose(d.realized_logprob[1:], ref[np.arange(len(ref)), d.teacher_ids[1:]], rtol=2**-11, atol=1e-4)
            got = np.take_along_axis(ref, d.topk_ids[1:].astype(np.int64), 1)
            assert_stored_close(d.topk_logprobs[1:], got)
            kth = -np.sort(-ref[:, :V], 1)[:, 15]
            assert (got >= kth[:, None] - 1e-4).all()  # stored ids are the top-16 of the real vocab
            np.testing.assert_allclose(d.residual[1:], 1 - np.exp(got).sum(1), rtol=2**-11, atol=1e-4)
    for fp, g in groups.items():
        a = r.read_alignment(fp, r.shards[0].shard_id)
        if g.identity:
            assert np.array_equal(a.student_ids, shards[0].teacher_ids)
            assert np.array_equal(a.student_end, a.teacher_end)
        else:  # each document's chunks: the aligner's on its text, partitioning both token sequences
            for i in range(shards[0].num_docs):
                d, rec = shards[0].doc(i), a.record(i)
                s_ids, t_ids, want = align_text(d.text, student_tokenizer, teacher_tokenizer)
                assert np.array_equal(t_ids, d.teacher_ids) and np.array_equal(rec.student_ids, s_ids)
                for name in ("student_end", "teacher_end", "exact"):
                    assert np.array_equal(getattr(rec.alignment, name), getattr(want, name)), (i, name)
                ends = rec.alignment
                assert ends.student_end[-1] == len(s_ids) and ends.teacher_end[-1] == len(d.teacher_ids)
                assert (np.diff(ends.student_end) > 0).all() and (np.diff(ends.teacher_end) > 0).all()


def test_full_mode_windows_store_each_row_once(teacher, corpus, toy_setup, tmp_path):
    s = dump(teacher, corpus, tmp_path / "f", [toy_setup.teacher_tokenizer], mode="full")
    r, shards = read_all(tmp_path / "f")
    V = r.manifest.teacher_vocab_size
    assert r.manifest.k == V and s.windows > s.documents  # documents longer than 160 tokens were windowed
    d = shards[0].doc(0)
    assert d.topk_ids.shape == (len(d.teacher_ids), V)
    assert d.has_pred[1:].all()  # overlap gives every later window's rows left context
    # rows inside the first window equal the whole-document forward (causal attention)
    lp = hf_logprobs(teacher, d.teacher_ids[:160])
    # full mode keeps 8-bit log-probs (xtcache.store.codecs.default_codecs): half a step in log-prob
    np.testing.assert_allclose(d.topk_logprobs[1:160], lp[:-1, :V], atol=24.0 / 255 / 2 + 1e-4)
    # residual = mass of the padded lm_head columns (tiny, but the model's own)
    np.testing.assert_allclose(d.residual[1:160], np.exp(lp[:-1, V:]).sum(1), atol=1e-5)


def test_full_mode_parts_end_at_a_position_limit_that_fits_memory(teacher, corpus, toy_setup, tmp_path, monkeypatch,
                                                                  caplog):
    """Where --docs-per-part windows of full-vocabulary targets could pass the part byte budget (1 GiB: 2,730
    positions at 49,152 ids), parts also end at a number of positions, never inside a document, and the store holds
    the same documents with the same targets as one cut by documents alone; the limit is in the store's settings."""
    import logging

    from stage1_teacher import plan

    dump(teacher, corpus, tmp_path / "docs", [toy_setup.teacher_tokenizer], mode="full")
    r1, by_docs = read_all(tmp_path / "docs")
    V = r1.manifest.teacher_vocab_size
    assert plan.part_position_limit(256, 2047, 49_152) == 2730
    for k in (64, 128, 256):  # top-64, headtail's default 64 + 64, top-256: parts as before the limit
        assert plan.part_position_limit(256, 2047, k) is None
    assert "part_positions" not in r1.manifest.settings  # docs_per_part 8 x 160 x V x 8 B: under the budget
    monkeypatch.setattr(plan, "LIMIT_FROM", 0)  # the limit applies ...
    monkeypatch.setattr(plan, "PART_BYTES", 300 * V * plan.TARGET_BYTES)  # ... to parts of at most 300 positions
    caplog.set_level(logging.INFO)
    dump(teacher, corpus, tmp_path / "pos", [toy_setup.teacher_tokenizer], mode="full")
    r2, by_pos = read_all(tmp_path / "pos")
    assert r2.manifest.settings["part_positions"] == 300 and "or 300 positions" in caplog.text
    assert len(by_pos) > len(by_docs)
    assert [s.shard_id for s in by_pos] == [f"w00000-p{i:06d}" for i in range(len(by_pos))]
    lengths = [[len(s.doc(i).teacher_ids) for i in range(s.num_docs)] for s in by_pos]
    assert all(sum(n) <= 300 or len(n) == 1 for n in lengths)  # over the limit only as a document of its own
    for n, after in zip(lengths, lengths[1:]):  # no part ends early: it has 8 documents or the next would not fit
        assert len(n) == 8 or sum(n) + after[0] > 300, (n, after)
    assert any(len(n) == 1 and n[0] > 300 for n in lengths) == ("written as a part of its own" in caplog.text)
    docs1 = [s.doc(i) for s in by_docs for i in range(s.num_docs)]
    docs2 = [s.doc(i) for s in by_pos for i in range(s.num_docs)]
    assert [d.teacher_ids.tolist() for d in docs1] == [d.teacher_ids.tolist() for d in docs2]
    for a, b in zip(docs1, docs2):
        np.testing.assert_array_equal(a.topk_logprobs, b.topk_logprobs)


def test_sampled_mode_is_seeded_and_counts_add_up(teacher, corpus, toy_setup, tmp_path):
    a = dump(teacher, corpus, tmp_path / "a", [toy_setup.student_tokenizer], mode="sampled", num_samples=12)
    dump(teacher, corpus, tmp_path / "b", [toy_setup.student_tokenizer], mode="sampled", num_samples=12,
         docs_per_part=5)
    _, sa = read_all(tmp_path / "a")
    _, sb = read_all(tmp_path / "b")
    ids_a = np.concatenate([s.topk_ids for s in sa])
    cnt_a = np.concatenate([s.topk_counts for s in sa])
    pred = np.concatenate([s.has_pred for s in sa])
    assert (cnt_a[pred].sum(1) == 12).all() and (cnt_a[~pred] == 0).all()
    assert a.positions == len(pred)
    # other part sizes, same draws: sampling streams are per document window, not per batch
    assert np.array_equal(cnt_a, np.concatenate([s.topk_counts for s in sb]))
    assert np.array_equal(ids_a, np.concatenate([s.topk_ids for s in sb]))


def test_same_request_twice_reuses_the_cache(teacher, corpus, toy_setup, tmp_path, monkeypatch):
    values = {"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)], "data": [corpus],
              "cache_dir": str(tmp_path / "caches"), "engine": "hf", "top_k": 8, "docs_per_part": 8}
    first = run_teacher_dump(build_config(values), progress=False)
    assert not first.reused and first.documents == 24

    import stage1_teacher.pipeline as pipeline

    def no_teacher(*a, **k):
        raise AssertionError("the teacher must not run for a cached request")

    monkeypatch.setattr(pipeline, "open_capture", no_teacher)
    again = run_teacher_dump(build_config(values), progress=False)
    assert again.reused and again.store == first.store
    assert any("no teacher work" in line for line in again.lines())
    # another student tokenizer: same teacher work, the new alignment group is added without the teacher
    both = [str(toy_setup.student_tokenizer), str(toy_setup.teacher_tokenizer)]
    more = run_teacher_dump(build_config({**values, "student_tokenizer": both}), progress=False)
    assert more.reused and more.alignment_groups_added == [str(toy_setup.teacher_tokenizer)]


def test_align_command_equals_dumping_with_both_tokenizers(teacher, corpus, toy_setup, tmp_path):
    from xtcache.fingerprint import tokenizer_fingerprint

    dump(teacher, corpus, tmp_path / "one", [toy_setup.student_tokenizer])
    res = xtcache("align", tmp_path / "one", "--student-tokenizer", toy_setup.teacher_tokenizer)
    assert res.returncode == 0, res.stdout + res.stderr
    dump(teacher, corpus, tmp_path / "both", [toy_setup.student_tokenizer, toy_setup.teacher_tokenizer])
    r1, _ = read_all(tmp_path / "one")
    r2, _ = read_all(tmp_path / "both")
    fp = tokenizer_fingerprint(toy_setup.teacher_tokenizer)
    assert r1.alignment_groups()[fp].identity
    for m in r1.shards:
        a1, a2 = r1.read_alignment(fp, m.shard_id), r2.read_alignment(fp, m.shard_id)
        for name in ("student_ids", "student_end", "teacher_end", "exact"):
            assert np.array_equal(getattr(a1, name), getattr(a2, name)), name
    # a cross-tokenizer group added later equals the one written by the dump
    dump(teacher, corpus, tmp_path / "ident", [toy_setup.teacher_tokenizer])
    res = xtcache("align", tmp_path / "ident", "--student-tokenizer", toy_setup.student_tokenizer)
    assert res.returncode == 0, res.stdout + res.stderr
    r3, _ = read_all(tmp_path / "ident")
    fp = tokenizer_fingerprint(toy_setup.student_tokenizer)
    assert not r3.alignment_groups()[fp].identity
    for m in r3.shards:
        a3, a2 = r3.read_alignment(fp, m.shard_id, verify=True), r2.read_alignment(fp, m.shard_id)
        assert len(a3.student_end) > 0
        for name in ("doc_student_offsets", "doc_chunk_offsets", "student_ids", "student_end", "teacher_end",
                     "exact"):
            assert np.array_equal(getattr(a3, name), getattr(a2, name)), name
    # a group the store already has is left as it is
    res = xtcache("align", tmp_path / "one", "--student-tokenizer", toy_setup.student_tokenizer)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(rf"\b0 parts aligned \(0 documents\), {len(r1.shards)} already present", res.stdout), res.stdout


def test_dry_run_counts_without_teacher(teacher, corpus, toy_setup, tmp_path):
    res = xtcache("teacher-dump", "--teacher", teacher, "--student-tokenizer", toy_setup.student_tokenizer,
                  "--data", corpus, "--out", tmp_path / "dry", "--dry-run", "--max-seq-len", "160")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "documents           24" in res.stdout and "estimated size" in res.stdout
    assert "positions" in res.stdout and "fewer than 2 teacher tokens: 1" in res.stdout
    assert not (tmp_path / "dry").exists()



def test_the_default_window_of_a_teacher_of_2048_positions_does_not_warn(teacher, corpus, toy_setup, tmp_path, caplog):
    """The toy teacher's context is 2,048 positions, the default --max-seq-len 2048: windows of 2,047 tokens
    (--max-model-len must exceed the window), said once at info level; asking for more than the context warns."""
    import logging

    caplog.set_level(logging.INFO)
    args = ["teacher-dump", "--teacher", teacher, "--student-tokenizer", toy_setup.student_tokenizer, "--data", corpus,
            "--out", tmp_path / "dry", "--dry-run"]
    assert xtcache(*args).returncode == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "max-seq-len" in r.getMessage()]
    assert "windows of 2047 tokens: the teacher's context (2048 positions) less one" in caplog.text
    caplog.clear()
    assert xtcache(*args, "--max-seq-len", "4096").returncode == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "--max-seq-len 4096 exceeds the teacher's context (2048 positions): windows of 2047 tokens"]

def test_bad_requests_fail_clearly(teacher, corpus, toy_setup, tmp_path):
    from xtcache.testing.toy_teacher import build_vllm_teacher

    with pytest.raises(ConfigError, match="--top-k"):
        dump(teacher, corpus, tmp_path / "k", [toy_setup.student_tokenizer], top_k=100000)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(Path(teacher, "config.json").read_text())
    with pytest.raises(CaptureError, match="safetensors"):
        dump(str(empty), corpus, tmp_path / "w", [toy_setup.student_tokenizer])
    with pytest.raises(ConfigError, match="student tokenizer"):
        dump(teacher, corpus, tmp_path / "t", [tmp_path])
    with pytest.raises(ConfigError, match="is a usable document.*--text-field 'body'"):
        dump(teacher, corpus, tmp_path / "field", [toy_setup.student_tokenizer], text_field="body")
    assert not (tmp_path / "field").exists()  # refused before anything was created
    dump(teacher, corpus, tmp_path / "same", [toy_setup.student_tokenizer], top_k=4)
    other = str(build_vllm_teacher(toy_setup.root, tied=True, steps=0))
    with pytest.raises(StoreError, match=r"another key \(--teacher \(the model's weights or config\): "):
        dump(other, corpus, tmp_path / "same", [toy_setup.student_tokenizer], top_k=4)


def two_files(corpus, root: Path) -> list[str]:
    """The corpus cut into two JSONL files (a plan never splits a JSONL file between jobs)."""
    lines = Path(corpus).read_bytes().splitlines(keepends=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.jsonl").write_bytes(b"".join(lines[:14]))
    (root / "b.jsonl").write_bytes(b"".join(lines[14:]))
    return [str(root / "a.jsonl"), str(root / "b.jsonl")]


def test_parallel_shards_are_disjoint_and_claims_exclusive(teacher, corpus, toy_setup, tmp_path):
    from xtcache.store import CacheWriter

    out = tmp_path / "par"
    data = two_files(corpus, tmp_path / "data")
    dump(teacher, data, out, [toy_setup.student_tokenizer], num_shards=2, shard_index=0)
    r, _ = read_all(out)
    assert not r.is_complete()
    # while another process holds writer 1, a second job for the same shard is refused
    holder = CacheWriter(str(out), r.manifest, writer_index=1)
    try:
        with pytest.raises(StoreError, match="claimed"):
            dump(teacher, data, out, [toy_setup.student_tokenizer], num_shards=2, shard_index=1)
    finally:
        holder.close()
    dump(teacher, data, out, [toy_setup.student_tokenizer], num_shards=2, shard_index=1)
    r, shards = read_all(out)
    assert r.is_complete()
    assert {m.writer_index for m in r.shards} == {0, 1}
    ids = [d for s in shards for d in s.doc_ids()]
    assert len(ids) == len(set(ids)) == 24


# ------------------------------------------------------------------------------ kill and resume


def _index_hashes(url: Path) -> dict:
    """Every committed array's sha256 (teacher and alignment parts), by part and name."""
    out = {}
    for p in sorted(url.rglob("index/*.json")):
        meta = json.loads(p.read_text())
        for name, spec in meta["arrays"].items():
            out[f"{p.relative_to(url)}:{name}"] = spec["sha256"]
    return out


DUMP_MODULES = ("torch", "transformers", "xtcache.app.cli", "xtcache.store", "stage1_teacher.cli", "stage1_teacher.dump",
                "stage1_teacher.capture.hf_engine")


@pytest.fixture(scope="module")
def procs():
    """`xtcache teacher-dump` processes, each forked from one warm process that imported torch and
    transformers once: each its own process (own pid; SIGKILL kills it alone), in the environment of
    this process with the repository on PYTHONPATH."""
    with WarmProcs(env={**os.environ, "PYTHONPATH": str(REPO)}, modules=DUMP_MODULES) as server:
        yield server


def test_kill_and_resume_equals_uninterrupted_run(teacher, corpus, toy_setup, procs, tmp_path):
    """SIGKILL a real dump process (`xtcache teacher-dump`, forked from the warm server) at several
    moments, resume each time; the store must equal a clean run of the same settings (in this
    process: the command line's settings are the config's, tests/test_cliconfig.py).

    Uses --engine hf: three vLLM engine starts per run would cost minutes on a CPU.
    """
    args = ["--teacher", teacher, "--student-tokenizer", str(toy_setup.student_tokenizer), "--data", corpus,
            "--engine", "hf", "--mode", "sampled", "--num-samples", "8", "--docs-per-part", "3",
            "--max-seq-len", "160", "--window-overlap", "16", "--batch-tokens", "400"]
    clean = tmp_path / "clean"
    dump(teacher, corpus, clean, [toy_setup.student_tokenizer], mode="sampled", num_samples=8, docs_per_part=3,
         max_seq_len=160, window_overlap=16, batch_tokens=400, top_k=64)
    want = _index_hashes(clean)
    assert len([k for k in want if k.startswith("index/")]) > 0

    out = tmp_path / "killed"
    kills = 0
    for target_parts in (0, 2, 5):  # before any commit, and mid-run twice
        pid = procs.start("teacher-dump", *args, "--out", str(out), "--resume")
        deadline = time.time() + 120
        while time.time() < deadline and procs.poll(pid) is None:
            if len(list((out / "index").glob("*.json"))) >= target_parts and (out / "manifest.json").exists():
                break
            time.sleep(0.05)
        if procs.poll(pid) is None:
            os.kill(pid, signal.SIGKILL)
            kills += 1
        procs.wait(pid)
    assert kills >= 2
    p = procs.cli("teacher-dump", *args, "--out", str(out))  # without --resume: a clear refusal, nothing overwritten
    log = p.stdout + p.stderr
    assert p.returncode == 2 and "--resume" in log, log[-2000:]
    p = procs.cli("teacher-dump", *args, "--out", str(out), "--resume")
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    assert _index_hashes(out) == want
    from xtcache.store import CacheReader

    assert CacheReader(str(out)).is_complete()


def test_teacher_with_bos_gets_a_bos_in_front_of_every_window(corpus, toy_setup, tmp_path):
    """A Llama-style teacher (BOS first): later windows start with BOS, so every row has a prediction."""
    from stage1_teacher.windows import plan_windows
    from xtcache.testing import toy

    teacher = tmp_path / "bos_teacher"
    toy.build_tiny_model("llama", toy_setup.student_tokenizer, teacher, hidden=64, heads=2, kv_heads=1,
                         intermediate=128)
    s = dump(str(teacher), corpus, tmp_path / "bos", [teacher], max_seq_len=64, window_overlap=0, top_k=8)
    assert s.windows > 3 * s.documents
    r, shards = read_all(tmp_path / "bos")
    d = shards[0].doc(0)
    bos = int(d.teacher_ids[0])
    assert d.has_pred[1:].all() and not d.has_pred[0]
    w = plan_windows(len(d.teacher_ids), 64, 0, None, bos_prefix=True)[1]
    lp = hf_logprobs(str(teacher), np.concatenate(([bos], d.teacher_ids[w.ctx_start:w.end])))[:-1]
    rows = np.arange(w.store_start, w.end)
    ref = lp[1 + rows - w.ctx_start - 1]  # window row j (after BOS) is predicted by logits row j - 1
    np.testing.assert_allclose(d.realized_logprob[rows], ref[np.arange(len(rows)), d.teacher_ids[rows]], rtol=2**-11, atol=1e-4)
    assert_stored_close(d.topk_logprobs[rows], np.take_along_axis(ref, d.topk_ids[rows].astype(np.int64), 1))


def test_two_jobs_fill_disjoint_shards_concurrently(teacher, corpus, toy_setup, procs, tmp_path):
    """Two `xtcache teacher-dump` processes at once (forked from the warm server), one per shard."""
    from xtcache.app.store_commands import verify_store

    out = tmp_path / "conc"
    a, b = two_files(corpus, tmp_path / "data")
    base = ["--teacher", teacher, "--student-tokenizer", str(toy_setup.student_tokenizer), "--data", a, "--data", b,
            "--engine", "hf", "--top-k", "8", "--docs-per-part", "4", "--max-seq-len", "256", "--out", str(out),
            "--num-shards", "2"]
    pids = [procs.start("teacher-dump", *base, "--shard-index", str(i)) for i in (1, 0)]  # 1 waits for 0's plan
    jobs = [procs.wait(pid) for pid in pids]
    logs = [j.stdout + j.stderr for j in jobs]
    assert [j.returncode for j in jobs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    r, shards = read_all(out)
    assert r.is_complete() and verify_store(str(out)) == []
    writers = {m.writer_index for m in r.shards}
    assert writers == {0, 1}
    ids = [d for s in shards for d in s.doc_ids()]
    assert len(ids) == len(set(ids)) == 24
