"""Where vLLM's engine runs on a CPU host, side by side: in the xtcache process, or in vLLM's own processes.

`xtcache teacher-dump` of the toy vLLM teacher (`xtcache.testing.toy_teacher`) over the first --docs documents
of the toy corpus, run as a user runs it (the command in a fresh process), once per capture path and process
model: `VLLM_ENABLE_V1_MULTIPROCESSING=1`, vLLM's default and CUDA's (an engine core process and a worker
process), and `=0`, the engine inside the xtcache process (xtcache's default on a CPU host with one worker,
`stage1_teacher.capture.vllm_engine.engine_in_process`). Per run: the command's wall time and CPU time (its own
and its processes'), and the engine start and capture rate that the dump reports; per path, whether the two
stores hold the same top-k ids, and the largest gap between their top-k log-probs. The first path runs vLLM's
processes first, the second the in-process engine first, so that neither meets only warm file caches.

    python bench/engine_process.py [--docs 256] [--workdir DIR] [--write-docs]

`--write-docs` writes the table into docs/troubleshooting.md's `engine-process` block (xtcache.app.docblock).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOC_BLOCKS = {"engine-process": "docs/troubleshooting.md"}  # --write-docs: block -> file
PATHS = (("fast path (hidden states + lm_head)", []), ("prompt log-probs (--no-fast-path)", ["--no-fast-path"]))
MODELS = (("vLLM's processes", "1"), ("in the xtcache process", "0"))
REPORTED = re.compile(r"wall time +([0-9.]+) s \(engine start ([0-9.]+) s\); ([0-9,]+) positions/s")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def dump(teacher: str, student_tokenizer: str, data: Path, out: Path, extra: list[str], multiprocessing: str) -> dict:
    """One `xtcache teacher-dump` process: its wall and CPU time, and what it reported."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    cmd = [sys.executable, "-m", "xtcache.app.cli", "teacher-dump", "--teacher", teacher, "--student-tokenizer",
           student_tokenizer, "--data", str(data), "--out", str(out), "--engine", "vllm", "--dtype", "float32",
           "--top-k", "64", *extra]
    cpu, t = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t, children_cpu() - cpu
    if proc.returncode != 0:
        raise SystemExit(f"teacher-dump failed (VLLM_ENABLE_V1_MULTIPROCESSING={multiprocessing}):\n"
                         + (proc.stdout + proc.stderr)[-3000:])
    m = REPORTED.search(proc.stdout)
    if m is None:
        raise SystemExit(f"teacher-dump printed no 'wall time ... positions/s' line:\n{proc.stdout[-2000:]}")
    return {"wall": wall, "cpu": cpu, "start": float(m.group(2)), "rate": float(m.group(3).replace(",", ""))}


def compare(a: Path, b: Path) -> tuple[bool, float]:
    """Whether two stores of the same documents hold the same top-k ids, and the largest top-k log-prob gap."""
    from xtcache.store import CacheReader

    ra, rb = CacheReader(str(a)), CacheReader(str(b))
    same, gap = len(ra.shards) == len(rb.shards), 0.0
    for sa, sb in zip(ra.shards, rb.shards):
        x, y = ra.read_shard(sa.shard_id, verify=True), rb.read_shard(sb.shard_id, verify=True)
        same &= bool(np.array_equal(x.topk_ids, y.topk_ids))
        gap = max(gap, float(np.abs(x.topk_logprobs.astype(np.float64) - y.topk_logprobs.astype(np.float64)).max()))
    return same, gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=256, help="documents of the toy corpus to capture")
    ap.add_argument("--workdir", default="/tmp/xtcache-bench-engine-process")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    from xtcache.testing import toy
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC
    from xtcache.testing.toy_teacher import build_vllm_teacher

    setup = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    teacher = str(build_vllm_teacher(setup.root))
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "docs.jsonl"
    lines = Path(setup.train_jsonl).read_text().splitlines(keepends=True)[:args.docs]
    data.write_text("".join(lines))
    t0 = time.perf_counter()
    rows = ["| capture path | vLLM's engine | command wall (s) | CPU (s) | engine start (s) | capture, positions/s |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    notes = []
    for i, (path, extra) in enumerate(PATHS):
        runs = {}
        for _, value in MODELS[::-1] if i % 2 else MODELS:  # each process model first once: no order favours one
            runs[value] = dump(teacher, str(setup.student_tokenizer), data, work / f"store-{len(extra)}-{value}",
                               extra, value)
        for model, value in MODELS:
            r = runs[value]
            rows.append(f"| {path} | {model} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['start']:.1f} | "
                        f"{r['rate']:,.0f} |")
        same, gap = compare(work / f"store-{len(extra)}-1", work / f"store-{len(extra)}-0")
        notes.append(f"{path}: the in-process run took {runs['0']['wall'] / runs['1']['wall']:.2f}x the wall time and "
                     f"{runs['0']['cpu'] / runs['1']['cpu']:.2f}x the CPU of vLLM's processes, captured "
                     f"{runs['0']['rate'] / runs['1']['rate']:.2f}x as fast; top-k ids "
                     f"{'equal' if same else 'NOT equal'}, largest top-k log-prob gap {gap:.2g}")
    body = "\n".join([f"{len(lines)} documents of the toy corpus, toy vLLM teacher, top-64, float32, "
                      f"{os.cpu_count()} cores.", "", *rows, "", *[f"- {n}" for n in notes]])
    print(body)
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.write_docs:
        from xtcache.app.docblock import write_block

        write_block(REPO / DOC_BLOCKS["engine-process"], "engine-process", body)


if __name__ == "__main__":
    main()
