"""`xtcache teacher-dump` with real vLLM on the CPU: top-k, full and sampled stores, same and cross tokenizer.

The in-process dumps (`run_teacher_dump`) run in one fresh interpreter (tests/vllm_dump_jobs.py),
one after another, with vLLM's engine in that process (xtcache's default on a CPU host): each of
the two engines (the prompt log-prob reference and the hidden-state fast path) starts once. The
tests then check the stores and what each dump reported. One more test runs the real command line
with vLLM's own process model, as on CUDA (`VLLM_ENABLE_V1_MULTIPROCESSING=1`): killed with SIGKILL
while its engine runs (the engine processes exit with it), then resumed to a complete store (its
engine shut down at the end).

    .venv/bin/python -m pytest -q tests/test_stage1_vllm.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stage1_teacher.config import build_config
from stage1_teacher.dump import run_teacher_dump
from stage1_teacher.summary import Summary
from tests.test_stage1_dump import hf_logprobs
from xtcache.testing.suite import VLLM_PROCESSES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUANT_TOL = 0.5 / 127 + 1e-3  # in sqrt(p): half a step of the default sqrt-prob codec (format 3)
MODES = ("topk", "full", "sampled", "headtail")


def assert_stored_close(stored, want):
    """Stored log-probs within QUANT_TOL of `want` in sqrt(p), the metric the sqrt-prob codec bounds."""
    np.testing.assert_allclose(np.exp(stored / 2.0), np.exp(np.asarray(want, np.float64) / 2.0), atol=QUANT_TOL)


@pytest.fixture(scope="module")
def corpus(toy_setup, tmp_path_factory):
    path = tmp_path_factory.mktemp("vcorpus") / "docs.jsonl"
    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:16]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def split_corpus(corpus: str, root: Path) -> list[str]:
    """The corpus in two files (8 documents each), for two writers."""
    lines = Path(corpus).read_text().splitlines(keepends=True)
    data = [root / "a.jsonl", root / "b.jsonl"]
    data[0].write_text("".join(lines[:8]))
    data[1].write_text("".join(lines[8:]))
    return [str(p) for p in data]


def two_writer_config(teacher, toy_setup, data, out, i, **extra) -> dict:
    """Writer `i` of 2 of a top-k store of `data` with the fast path (first-batch check)."""
    return {"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)], "data": data,
            "out": str(out), "engine": "vllm", "dtype": "float32", "top_k": 8, "max_seq_len": 256,
            "docs_per_part": 4, "num_shards": 2, "shard_index": i, **extra}


@pytest.fixture(scope="module")
def dumps(teacher, corpus, toy_setup, tmp_path_factory):
    """Every in-process dump of this module, run in order by tests/vllm_dump_jobs.py: one store per
    mode (each with a cross-tokenizer and a same-tokenizer alignment group), a store written through
    the fallback path, and the two writers of two stores that share one first-batch check."""
    root = tmp_path_factory.mktemp("vstores")
    jobs = [{"name": mode, "config": {
        "teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer), teacher], "data": [corpus],
        "out": str(root / mode), "engine": "vllm", "dtype": "float32", "mode": mode, "top_k": 8,
        "num_samples": 16, "max_seq_len": 256, "window_overlap": 32, "docs_per_part": 6}} for mode in MODES]
    jobs.append({"name": "fallback", "head_architectures": [], "config": {
        "teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)], "data": [corpus],
        "out": str(root / "fb"), "engine": "vllm", "dtype": "float32", "top_k": 4, "max_seq_len": 256,
        "docs_per_part": 8}})
    data = split_corpus(corpus, root)
    for name, store, i, extra in (("store-0", "store", 0, {}), ("store-1", "store", 1, {}),
                                  ("other-0", "other", 0, {"trust_check_from": str(root / "store")}),
                                  ("other-1", "other", 1, {})):
        jobs.append({"name": name, "config": two_writer_config(teacher, toy_setup, data, root / store, i, **extra)})
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tests.vllm_dump_jobs", str(root / "jobs.json"),
                           str(root / "results.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = json.loads((root / "results.json").read_text())
    for r in results.values():
        r["summary"] = Summary(**r["summary"]) if r["summary"] else None
    return root, data, results


def dumped(dumps, name: str) -> Summary:
    """The summary of one dump of `dumps`, which must have succeeded."""
    r = dumps[2][name]
    assert r["error"] is None, r["error"]
    return r["summary"]


def _first_window_rows(d, n=256):
    return min(n, len(d.teacher_ids))


@pytest.mark.parametrize("mode", MODES)
def test_vllm_store_verifies_and_matches_transformers(dumps, mode, teacher):
    from xtcache.app.store_commands import verify_store
    from xtcache.store import CacheReader

    url, summary = str(dumps[0] / mode), dumped(dumps, mode)
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


def test_fallback_for_unsupported_heads_is_loud(dumps, teacher):
    """A teacher whose head the fast path does not support (here: none is) is captured through vLLM's
    prompt log-probs, with a FALLBACK note in the summary and a warning in the log."""
    from xtcache.store import CacheReader

    s = dumped(dumps, "fallback")
    assert "prompt log-probs" in s.capture_path and any("FALLBACK" in n for n in s.notes)
    assert any("FALLBACK" in message for message in dumps[2]["fallback"]["warnings"])
    r = CacheReader(str(dumps[0] / "fb"))
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
    exit with it (xtcache.reaper); the same command with --resume then starts its own engine (in
    process: how it starts is not what the resume proves) and writes the store, which verifies.

    --no-fast-path keeps each run to one engine start (the fast path is covered in process above;
    a resume after committed parts is tests/test_stage1_dump.py's, with the same part logic).
    """
    import psutil

    env = {**os.environ, **VLLM_PROCESSES, "PYTHONPATH": str(REPO)}  # the engine in its own processes
    out = tmp_path / "cli"
    args = [sys.executable, "-m", "xtcache.app.cli", "teacher-dump", "--teacher", teacher, "--student-tokenizer",
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

    in_process = {**os.environ, "PYTHONPATH": str(REPO)}  # the resume's engine in process, the CPU default
    done = subprocess.run(args, cwd=REPO, env=in_process, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "vLLM prompt log-probs" in done.stdout and "positions/s" in done.stdout
    from xtcache.app.store_commands import verify_store

    assert verify_store(str(out)) == []


class NoEngines:
    """An engine cache that records what a dump asks it for and starts nothing."""

    def __init__(self):
        self.requested: list[str] = []

    def get(self, key, factory):
        self.requested.append(key[0])
        raise AssertionError(f"the dump asked for a {key[0]} engine")


def test_first_batch_check_runs_once_per_store(dumps, teacher, toy_setup):
    """Writer 0 runs the fast path's first-batch check (reference engine + hidden engine) and records
    it; writer 1 starts only the hidden-state engine and trusts the record; a failed record stops
    a writer before any engine starts. Another store of the same teacher trusts that record with
    --trust-check-from; a store without one is refused before any engine starts."""
    from schemas.models import CaptureCheck
    from xtcache.errors import CaptureError
    from xtcache.store import CacheReader

    root, data, results = dumps
    s0 = dumped(dumps, "store-0")
    assert results["store-0"]["engines"] == ["vllm-plp", "vllm-hidden"] and s0.check_source == "ran here"
    (rec_path,) = (root / "store" / "capture_checks").glob("*.json")
    rec = CaptureCheck.model_validate_json(rec_path.read_text())
    assert rec.passed and rec.writer_index == 0 and rec.max_gap == s0.check_gap and rec.dtype == "float32"
    s1 = dumped(dumps, "store-1")
    assert results["store-1"]["engines"] == ["vllm-hidden"] and s1.check_source == "checked by writer 0"
    assert s1.check_gap == rec.max_gap
    assert CacheReader(str(root / "store")).is_complete()
    # another store of the same teacher trusts this store's record: only the hidden-state engine
    s2 = dumped(dumps, "other-0")
    assert results["other-0"]["engines"] == ["vllm-hidden"] and s2.check_source == f"trusted from {root / 'store'}"
    assert s2.check_gap == rec.max_gap
    (copied,) = (root / "other" / "capture_checks").glob("*.json")  # for this store's other writers and resumes
    got = CaptureCheck.model_validate_json(copied.read_text())
    assert got.passed and got.max_gap == rec.max_gap and str(root / "store") in got.reference
    s3 = dumped(dumps, "other-1")  # writer 1 of that store, without the option, trusts the copy
    assert results["other-1"]["engines"] == ["vllm-hidden"] and s3.check_source == "checked by writer 0"
    assert CacheReader(str(root / "other")).is_complete()

    def refused(out, **extra):
        engines = NoEngines()
        cfg = build_config(two_writer_config(teacher, toy_setup, data, out, 0, **extra))
        with pytest.raises(CaptureError) as e:
            run_teacher_dump(cfg, engines=engines, progress=False)
        assert engines.requested == []
        return str(e.value)

    # a failed check recorded in a store stops its writers before they start an engine
    bad = root / "bad"
    (bad / "capture_checks").mkdir(parents=True)
    (bad / "capture_checks" / rec_path.name).write_text(rec.model_copy(update={"passed": False}).model_dump_json())
    assert "check of the fast path failed" in refused(bad)
    # a store without a record for this teacher is refused before any engine starts
    assert re.search("--trust-check-from .* holds no first-batch check",
                     refused(root / "third", trust_check_from=str(root / "no-such-store")))
