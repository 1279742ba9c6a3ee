"""Decoupled hardware, end to end: stage 1 reads its corpus from and writes its store to an S3-compatible
endpoint, stage 2 trains from it.

An S3 server (moto) runs on loopback in this process; every xtcache command runs as its own
subprocess and reaches the bucket only through `--storage-options`, as a separate machine would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    s3fs.S3FileSystem(**options).mkdir("xtcache-bucket")
    yield options
    server.stop()


def _xtcache(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "xtcache.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"xtcache {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_dump_to_s3_then_verify_inspect_and_train_from_s3(toy_setup, s3_endpoint, tmp_path):
    import s3fs

    from xtcache.fingerprint import corpus_fingerprint
    from xtcache.store import CacheReader

    opts = json.dumps(s3_endpoint)
    url = "s3://xtcache-bucket/caches/toy-topk"
    s3fs.S3FileSystem(**s3_endpoint).put(str(toy_setup.heldout_jsonl), "xtcache-bucket/corpus/heldout.jsonl")
    _xtcache("teacher-dump", "--teacher", str(toy_setup.teacher_model), "--student-tokenizer",
             str(toy_setup.student_tokenizer), "--data", "s3://xtcache-bucket/corpus/*.jsonl", "--out", url,
             "--engine", "hf", "--top-k", "8", "--max-seq-len", "256", "--storage-options", opts)
    reader = CacheReader(url, s3_endpoint)
    # the corpus streamed from the bucket: same documents and same fingerprint as the local file
    assert reader.manifest.fingerprints["corpus"] == corpus_fingerprint([toy_setup.heldout_jsonl])
    assert sum(m.num_docs for m in reader.shards) == len(toy_setup.heldout_jsonl.read_text().splitlines())

    verify = _xtcache("verify", url, "--storage-options", opts)
    positions = sum(m.num_positions for m in reader.shards)  # every committed part checked out, the store finished
    assert verify.stdout.strip() == f"{url}: OK ({len(reader.shards)} shards, {positions:,} positions, complete)"
    inspect = _xtcache("inspect", url, "--storage-options", opts)
    assert "documents" in inspect.stdout.lower()

    out = tmp_path / "run"
    _xtcache("train-student", "--cache", url, "--student", str(toy_setup.student_model), "--out", str(out),
             "--storage-options", opts, "--seq-len", "128", "--micro-batch-size", "2", "--max-steps", "3",
             "--eval-fraction", "0.2", "--zero-stage", "2", "--lr", "1e-3")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["final_eval_kl"] is not None and summary["final_eval_kl"] > 0
    assert (out / "hf" / "config.json").exists()
