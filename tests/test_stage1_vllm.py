"""`xtcache teacher-dump` with real vLLM on the CPU: top-k, full and sampled stores, same and cross tokenizer.

Engine starts cost 20-40 s each, so the in-process dumps share one pair of engines (the prompt
log-prob reference and the hidden-state fast path) through `capture.EngineCache`; one more test
runs the real command line in subprocesses: killed with SIGKILL while its engine runs (the engine
processes exit with it), then resumed to a complete store (its engine shut down at the end).

    .venv/bin/python -m pytest -q tests/test_stage1_vllm.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stage1_teacher.config import build_config
from stage1_teacher.dump import run_teacher_dump
from xtcache.testing.suite import VLLM_PROCESSES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUANT_TOL = 0.5 / 127 + 1e-3  # in sqrt(p): half a step of the default sqrt-prob codec (format 3)


def assert_stored_close(stored, want):
    """Stored log-probs within QUANT_TOL of `want` in sqrt(p), the metric the sqrt-prob codec bounds."""
    np.testing.assert_allclose(np.exp(stored / 2.0), np.exp(np.asarray(want, np.float64) / 2.0), atol=QUANT_TOL)


@pytest.fixture(scope="module")
def corpus(toy_setup, tmp_path_factory):
    path = tmp_path_factory.mktemp("vcorpus") / "docs.jsonl"
    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:16]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def engine_processes():
    """Engines started in this test process run in their own processes, as in production: vLLM's
    in-process start scans every imported module, and another test file in the same pytest worker may
    have imported one that refuses it (the S3 tests' server framework)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in VLLM_PROCESSES.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def engines(engine_processes):
    from stage1_teacher.capture import EngineCache

    cache = EngineCache()
    yield cache
    cache.close()


@pytest.fixture(scope="module")
def stores(teacher, corpus, toy_setup, engines, tmp_path_factory):
    """One store per mode, each with a cross-tokenizer and a same-tokenizer alignment group."""
    root = tmp_path_factory.mktemp("vstores")
    out = {}
    for mode in ("topk", "full", "sampled", "headtail"):
        cfg = build_config({
            "teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer), teacher],
            "data": [corpus], "out": str(root / mode), "engine": "vllm", "dtype": "float32", "mode": mode,
            "top_k": 8, "num_samples": 16, "max_seq_len": 256, "window_overlap": 32, "docs_per_part": 6})
        out[mode] = (str(root / mode), run_teacher_dump(cfg, engines=engines, progress=False))
    return out


def hf_logprobs(teacher, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    with torch.no_grad():
        z = model(input_ids=torch.as_tensor(ids, dtype=torch.long)[None]).logits[0]
    return torch.log_softmax(z, -1).numpy()


def _first_window_rows(d, n=256):
    return min(n, len(d.teacher_ids))


@pytest.mark.parametrize("mode", ["topk", "full", "sampled", "headtail"])
def test_vllm_store_verifies_and_matches_transformers(stores, mode, teacher):
    from xtcache.commands_store import verify_store
    from xtcache.store import CacheReader

    url, summary = stores[mode]
    assert "hidden states" in summary.capture_path and summary.check_gap < 1e-3
    assert summary.documents == 16 and summary.windows > 16
    assert verify_store(url) == []
    r = CacheReader(url)
    assert r.is_complete() and sorted(g.identity for g in r.alignment_groups().values()) == [False, True]
    V = r.manifest.teacher_vocab_size
    shard = r.read_shard(r.shards[0].shard_id, verify=True)
    for i in (0, shard.num_docs - 1):
        d = shard.doc(i)
        n = _first_window_rows(d)
        ref = hf_logprobs(teacher, d.teacher_ids[:n])[:-1]  # rows 1..n-1 of the first window
        rows = slice(1, n)
        np.testing.assert_allclose(d.realized_logprob[rows], ref[np.arange(n - 1), d.teacher_ids[1:n]], rtol=2**-11, atol=1e-3)
        assert d.has_pred[1:].all()
        ids = d.topk_ids[rows].astype(np.int64)
        if mode == "headtail":  # the exact top-8 (in id order), then 16 draws from the rest of the distribution
            head, tail, counts = ids[:, :8], ids[:, 8:], d.topk_counts[rows]
            kth = -np.sort(-ref[:, :V], 1)[:, 7]
            assert (np.take_along_axis(ref, head, 1) >= kth[:, None] - 1e-3).all()
            assert_stored_close(d.topk_logprobs[rows], np.take_along_axis(ref, head, 1))
            drew = d.residual[rows] > 0
            assert drew.any() and (counts[drew].sum(1) == 16).all() and (counts[~drew] == 0).all()
            live = counts > 0
            assert (tail[live] < V).all() and not (tail[:, :, None] == head[:, None, :])[live].any()
        elif mode == "sampled":
            assert (d.topk_counts[rows].sum(1) == 16).all()
            live = d.topk_counts[rows] > 0
            assert (ids[live] < V).all()
            # sampled ids are likely ones: their mean teacher probability is far above uniform
            assert np.exp(np.take_along_axis(ref, ids, 1))[live].mean() > 20.0 / V
        else:
            got = np.take_along_axis(ref, ids, 1)
            if mode == "full":  # full mode keeps 8-bit log-probs: half a step, plus kernel differences
                np.testing.assert_allclose(d.topk_logprobs[rows], got, atol=24.0 / 255 / 2 + 1e-3)
            else:
                assert_stored_close(d.topk_logprobs[rows], got)
            if mode == "topk":
                kth = -np.sort(-ref[:, :V], 1)[:, 7]
                assert (got >= kth[:, None] - 1e-3).all()
            else:
                assert (ids == np.arange(V)).all()


def test_fallback_for_unsupported_heads_is_loud(teacher, corpus, toy_setup, engines, tmp_path, monkeypatch, caplog):
    import stage1_teacher.head as head
    from xtcache.store import CacheReader

    monkeypatch.setattr(head, "HEAD_ARCHITECTURES", set())
    cfg = build_config({"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)],
                        "data": [corpus], "out": str(tmp_path / "fb"), "engine": "vllm", "dtype": "float32",
                        "top_k": 4, "max_seq_len": 256, "docs_per_part": 8})
    with caplog.at_level("WARNING"):
        s = run_teacher_dump(cfg, engines=engines, progress=False)
    assert "prompt log-probs" in s.capture_path and any("FALLBACK" in n for n in s.notes)
    assert any("FALLBACK" in rec.message for rec in caplog.records)
    r = CacheReader(str(tmp_path / "fb"))
    d = r.read_shard(r.shards[0].shard_id).doc(0)
    n = _first_window_rows(d)
    ref = hf_logprobs(teacher, d.teacher_ids[:n])[:-1]
    assert (d.topk_ids < r.manifest.teacher_vocab_size).all()
    assert_stored_close(d.topk_logprobs[1:n], np.take_along_axis(ref, d.topk_ids[1:n].astype(np.int64), 1))


def _engine_processes(pid: int) -> list:
    """The vLLM engine processes (`VLLM::EngineCore`, `VLLM::Worker`) among a process's descendants."""
    import psutil

    out = []
    for q in psutil.Process(pid).children(recursive=True):
        try:
            cmd = q.cmdline()
            if "VLLM" in q.name() or (cmd and "VLLM" in cmd[0]):
                out.append(q)
        except psutil.Error:
            pass
    return out


def test_cli_killed_while_its_engine_runs_leaves_no_engine_then_resumes(teacher, corpus, toy_setup, tmp_path):
    """The real command line, twice: killed with SIGKILL once its vLLM engine processes are up, they
    exit with it (xtcache.reaper); the same command with --resume then starts its own engine and
    writes the store, which verifies.

    --no-fast-path keeps each run to one engine start (the fast path is covered in process above;
    a resume after committed parts is tests/test_stage1_dump.py's, with the same part logic).
    """
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the engine in its own processes (engine_processes)
    out = tmp_path / "cli"
    args = [sys.executable, "-m", "xtcache.cli", "teacher-dump", "--teacher", teacher, "--student-tokenizer",
            str(toy_setup.student_tokenizer), "--data", corpus, "--out", str(out), "--mode", "topk",
            "--top-k", "8", "--dtype", "float32", "--max-seq-len", "256", "--no-fast-path", "--resume"]
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    engine_procs: list = []
    while time.time() < deadline and p.poll() is None and not engine_procs:
        time.sleep(0.2)
        engine_procs = _engine_processes(p.pid)
    assert p.poll() is None and engine_procs, "the dump ended before its vLLM engine process appeared"
    everything = psutil.Process(p.pid).children(recursive=True)  # the engine and the reaper's watcher
    p.send_signal(signal.SIGKILL)
    p.wait()
    gone, alive = psutil.wait_procs(everything, timeout=60)
    assert not alive, f"processes outlived the killed dump: {[q.name() for q in alive]}"

    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "vLLM prompt log-probs" in done.stdout and "positions/s" in done.stdout
    from xtcache.commands_store import verify_store

    assert verify_store(str(out)) == []


def test_first_batch_check_runs_once_per_store(teacher, corpus, toy_setup, engines, tmp_path):
    """Writer 0 runs the fast path's first-batch check (reference engine + hidden engine) and records
    it; writer 1 starts only the hidden-state engine and trusts the record; a failed record stops
    a writer before any engine starts. Another store of the same teacher trusts that record with
    --trust-check-from; a store without one is refused before any engine starts."""
    from schemas.models import CaptureCheck

    lines = Path(corpus).read_text().splitlines(keepends=True)
    data = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    data[0].write_text("".join(lines[:8]))
    data[1].write_text("".join(lines[8:]))
    requested = []
    real_get = engines.get

    def get(key, factory):
        requested.append(key[0])
        return real_get(key, factory)

    engines.get = get
    try:
        def job(out, i, **extra):
            cfg = build_config({"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)],
                                "data": [str(p) for p in data], "out": str(out), "engine": "vllm", "dtype": "float32",
                                "top_k": 8, "max_seq_len": 256, "docs_per_part": 4, "num_shards": 2,
                                "shard_index": i, **extra})
            requested.clear()
            return run_teacher_dump(cfg, engines=engines, progress=False), list(requested)

        s0, kinds0 = job(tmp_path / "store", 0)
        assert kinds0 == ["vllm-plp", "vllm-hidden"] and s0.check_source == "ran here"
        (rec_path,) = (tmp_path / "store" / "capture_checks").glob("*.json")
        rec = CaptureCheck.model_validate_json(rec_path.read_text())
        assert rec.passed and rec.writer_index == 0 and rec.max_gap == s0.check_gap and rec.dtype == "float32"
        s1, kinds1 = job(tmp_path / "store", 1)
        assert kinds1 == ["vllm-hidden"] and s1.check_source == "checked by writer 0" and s1.check_gap == rec.max_gap
        from xtcache.store import CacheReader

        assert CacheReader(str(tmp_path / "store")).is_complete()
        # a failed check recorded in a store stops its writers before they start an engine
        bad = tmp_path / "bad"
        (bad / "capture_checks").mkdir(parents=True)
        (bad / "capture_checks" / rec_path.name).write_text(rec.model_copy(update={"passed": False}).model_dump_json())
        from xtcache.errors import CaptureError

        with pytest.raises(CaptureError, match="check of the fast path failed"):
            job(bad, 0)
        assert requested == []
        # another store of the same teacher trusts this store's record: only the hidden-state engine
        other = tmp_path / "other"
        s2, kinds2 = job(other, 0, trust_check_from=str(tmp_path / "store"))
        assert kinds2 == ["vllm-hidden"] and s2.check_source == f"trusted from {tmp_path / 'store'}"
        assert s2.check_gap == rec.max_gap
        (copied,) = (other / "capture_checks").glob("*.json")  # for this store's other writers and resumes
        got = CaptureCheck.model_validate_json(copied.read_text())
        assert got.passed and got.max_gap == rec.max_gap and str(tmp_path / "store") in got.reference
        s3, kinds3 = job(other, 1)  # writer 1 of that store, without the option, trusts the copy
        assert kinds3 == ["vllm-hidden"] and s3.check_source == "checked by writer 0"
        assert CacheReader(str(other)).is_complete()
        # a store without a record for this teacher is refused before any engine starts
        with pytest.raises(CaptureError, match="--trust-check-from .* holds no first-batch check"):
            job(tmp_path / "third", 0, trust_check_from=str(tmp_path / "no-such-store"))
        assert requested == []
    finally:
        engines.get = real_get
