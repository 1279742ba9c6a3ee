"""The README's decoupled-hardware walkthrough, run for real against an S3-compatible server on loopback.

1. two `teacher-dump` jobs (`--shard-index i --num-shards 2`) read their share of a corpus from the
   bucket and fill one store in the bucket; job 1 is killed with SIGKILL after it committed a part
   and resumed with `--resume`;
2. `xtcache verify` on the s3:// URL passes, the store holds every document of the corpus once, its
   corpus fingerprint equals that of the same files on a local disk, and `xtcache inspect` reads it;
3. `train-student` under `torchrun` with two ranks trains from the bucket and exports the student.

Every command is its own process and reaches the bucket only through `--storage-options`, as a
separate machine would. The `teacher-dump` jobs, `verify` and `inspect` are forked from one process
that imported torch, transformers and s3fs once and never opened the bucket itself (`tests.commands`:
each command still a process of its own, SIGKILL kills it); `torchrun` and its ranks are plain
subprocesses. The S3 server (moto) runs in this process on 127.0.0.1.

    pytest -q tests/test_s3_walkthrough.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.commands import WarmProcs
from tests.test_train_kd import run_stage2

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
BUCKET = "xtcache-walkthrough"


DUMP_MODULES = ("torch", "transformers", "s3fs", "xtcache.app.cli", "xtcache.store", "xtcache.app.store_commands",
                "stage1_teacher.cli", "stage1_teacher.dump", "stage1_teacher.capture.hf_engine")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    from xtcache.testing.s3 import s3_server

    with s3_server(BUCKET) as server:
        yield server


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _done(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"


def test_two_jobs_one_killed_and_resumed_then_verify_then_torchrun_from_the_bucket(toy_setup, s3, tmp_path):
    options, fs = s3
    jobs = WarmProcs(env=_env(), modules=DUMP_MODULES)  # its imports overlap the uploads below
    opts = json.dumps(options)
    lines = toy_setup.heldout_jsonl.read_text().splitlines()
    half = len(lines) // 2
    local = []
    for i, part in enumerate((lines[:half], lines[half:])):  # two corpus files: one per job under the plan
        fs.pipe(f"{BUCKET}/corpus/part-{i}.jsonl", ("\n".join(part) + "\n").encode())
        local.append(tmp_path / f"part-{i}.jsonl")
        local[-1].write_text("\n".join(part) + "\n")
    url = f"s3://{BUCKET}/caches/toy"
    dump = ["teacher-dump", "--teacher", str(toy_setup.teacher_model), "--student-tokenizer",
            str(toy_setup.student_tokenizer), "--data", f"s3://{BUCKET}/corpus/*.jsonl", "--out", url,
            "--engine", "hf", "--top-k", "8", "--max-seq-len", "128", "--docs-per-part", "4",
            "--storage-options", opts, "--num-shards", "2"]

    with jobs:
        job0 = jobs.start(*dump, "--shard-index", "0")
        job1 = jobs.start(*dump, "--shard-index", "1")
        deadline = time.time() + 300
        while time.time() < deadline and jobs.poll(job1) is None:  # kill job 1 once it committed a part
            fs.invalidate_cache()
            if fs.glob(f"{BUCKET}/caches/toy/index/w00001-*.json"):
                break
            time.sleep(0.2)
        assert jobs.poll(job1) is None, "job 1 finished before it could be killed: give it more parts"
        os.kill(job1, signal.SIGKILL)
        assert jobs.wait(job1).returncode == -signal.SIGKILL
        _done(jobs.wait(job0), "job 0")
        fs.invalidate_cache()
        assert not fs.exists(f"{BUCKET}/caches/toy/done/w00001.json"), "the killed job must not look done"
        refused = jobs.cli("verify", url, "--storage-options", opts)
        assert refused.returncode == 1 and "is incomplete" in refused.stdout + refused.stderr, refused.stderr[-2000:]
        _done(jobs.wait(jobs.start(*dump, "--shard-index", "1", "--resume")), "job 1 resumed")
        verify = jobs.cli("verify", url, "--storage-options", opts)
        _done(verify, "verify")
        inspect = jobs.cli("inspect", url, "--storage-options", opts)
        _done(inspect, "inspect")

    log = verify.stdout
    from stage1_teacher.cache_inputs import read_records
    from xtcache.fingerprint import content_fingerprint, corpus_fingerprint
    from xtcache.store import CacheReader

    reader = CacheReader(url, options)
    assert reader.is_complete()
    positions = sum(m.num_positions for m in reader.shards)  # every committed part checked out, the store finished
    assert log.strip().splitlines()[-1] == f"{url}: OK ({len(reader.shards)} shards, {positions:,} positions, complete)"
    # the corpus streamed from the bucket: the same fingerprint as the same files on a local disk
    recorded = read_records(url, [0, 1], options)  # each job's digests of the files it read
    assert content_fingerprint(recorded[i][0][1] for i in sorted(recorded)) == corpus_fingerprint(local)
    assert "documents" in inspect.stdout.lower()
    assert {m.writer_index for m in reader.shards} == {0, 1}
    docs = [d for m in reader.shards for d in reader.read_shard(m.shard_id).doc_ids()]
    usable = sum(1 for line in lines if json.loads(line).get("text"))
    assert len(docs) == len(set(docs)) == usable

    out = tmp_path / "run"
    run = run_stage2(out, "--cache", url, "--storage-options", opts, "--student", str(toy_setup.student_model),
                     "--seq-len", "64", "--micro-batch-size", "2", "--max-steps", "3", "--eval-fraction", "0.2",
                     "--zero-stage", "2", "--lr", "1e-3", nproc=2)
    assert run["summary"]["world_size"] == 2 and run["summary"]["steps"] == 3
    assert [r["step"] for r in run["train"]] == [1, 2, 3]
    assert run["summary"]["final_eval_kl"] > 0
    assert (out / "hf" / "config.json").exists()
