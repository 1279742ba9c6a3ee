"""Corpus bytes read by N `teacher-dump` jobs under the shard plan, at cluster scale, without a cluster.

A synthetic listing of 10,000 Parquet files of skewed (log-normal) sizes, cut into row groups of
at most 128 MiB of text column, stands for a ~1 TB corpus; only what the planner sees (sizes and
row-group footers) exists, no data. 1,000 jobs are planned over it and the bench prints, per job,
the bytes it reads: its row groups' text column chunks plus pyarrow's footer read (64 KiB, or the
footer if larger; footer sizes are measured on real Parquet footers with the same row-group
counts) of each file it touches, and the `shard_plan.json` every job other than 0 reads. Writer 0
also lists the corpus once (every footer) and takes the corpus fingerprint (2 MiB per file):
shown separately and added to the total. The row "every job reads every row (before)" is the
modulo scheme this plan replaced. Targets: total within 1.05x of the corpus, max/mean job bytes
at most 1.2.

`--engine-start` also runs a real two-job store with vLLM on the tests' toy teacher (one
`xtcache teacher-dump` process per job, one after the other, each with fresh engines) and prints
each job's engine start as its summary reports it: job 0 runs the first-batch check (reference
engine, then hidden-state engine: what every job did before), job 1 trusts job 0's record (the
hidden-state engine only). Two stores one after the other: the first vLLM start on a machine
also fills compile and page caches, so store b is the fair comparison. Run it under the
machine's vLLM lock.

    .venv/bin/python bench/shard_plan.py [--files 10000] [--jobs 1000] [--seed 0] [--engine-start]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FOOTER_READ = 64 * 1024  # pyarrow reads the last 64 KiB of a file to find its footer
FINGERPRINT_SAMPLE = 2 << 20  # xtcache.fingerprint.corpus_fingerprint: first and last MiB of every file
RG_BYTES = 128 << 20


def footer_sizes(max_groups: int) -> dict[int, int]:
    """Serialized Parquet footer bytes for 1..max_groups row groups (two columns), measured."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = {}
    for g in range(1, max_groups + 1):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": ["x"] * g, "id": list(range(g))}), sink, row_group_size=1)
        out[g] = pq.ParquetFile(pa.BufferReader(sink.getvalue())).metadata.serialized_size
    return out


def synthetic_listing(n_files: int, seed: int):
    from stage1_teacher.shard_plan import FileEntry

    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(mean=np.log(50 << 20), sigma=1.2, size=n_files), 1 << 20, 4 << 30).astype(np.int64)
    files = []
    for i, size in enumerate(sizes):
        n_groups = max(1, int(-(-size // RG_BYTES)))
        text_bytes = int(size * 0.97)  # the rest: other columns, page headers, footer
        per = np.full(n_groups, text_bytes // n_groups, dtype=np.int64)
        per[-1] += text_bytes - per.sum()
        rows = (per // 2500).astype(int)  # ~2.5 KB documents
        files.append(FileEntry(name=f"part-{i:05d}.parquet", size=int(size), format="parquet",
                               row_groups=tuple((int(r), int(b)) for r, b in zip(rows, per))))
    return files


def main(argv: list[str]) -> None:
    from stage1_teacher.shard_plan import plan_shards

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--jobs", type=int, default=1_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-start", action="store_true", help="also time vLLM engine starts of a two-job store")
    args = p.parse_args(argv)

    files = synthetic_listing(args.files, args.seed)
    footers = footer_sizes(max(len(f.row_groups) for f in files))
    t0 = time.perf_counter()
    plan = plan_shards(files, args.jobs, corpus_fingerprint="0" * 64)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan_json = json.dumps(plan.as_json()).encode()
    serialize_s = time.perf_counter() - t0
    corpus = sum(f.size for f in files)

    def footer_read(f) -> int:
        return min(f.size, max(FOOTER_READ, footers[len(f.row_groups)] + 8))

    data = np.array(plan.job_bytes(), dtype=np.int64)
    footer = np.array([sum(footer_read(files[fi]) for fi in {r.file for r in job}) for job in plan.jobs])
    plan_read = np.array([0] + [len(plan_json)] * (args.jobs - 1))
    per_job = data + footer + plan_read
    planning = sum(footer_read(f) + min(f.size, FINGERPRINT_SAMPLE) for f in files)  # writer 0, once
    with_planning = per_job.copy()
    with_planning[0] += planning
    total = int(with_planning.sum())
    touched = sum(len({r.file for r in job}) for job in plan.jobs)

    def row(name, v):
        print(f"| {name} | {v} |")

    print(f"\n{args.files:,} Parquet files, {corpus / 1e12:.3f} TB, {sum(len(f.row_groups) for f in files):,} row "
          f"groups (<= 128 MiB), {args.jobs:,} jobs\n")
    print("| measure | value |\n| --- | --- |")
    row("planning time (plan_shards, pure)", f"{plan_s * 1e3:.1f} ms")
    row("shard_plan.json size / serialization", f"{len(plan_json) / 1e6:.2f} MB / {serialize_s * 1e3:.1f} ms")
    row("bytes read per job: mean", f"{per_job.mean() / 1e9:.3f} GB")
    row("bytes read per job: max / mean (without writer 0's planning)",
        f"{per_job.max() / per_job.mean():.3f} (target <= 1.2)")
    row("bytes read per job: min / mean", f"{per_job.min() / per_job.mean():.3f}")
    row("writer 0 planning, once: every footer + fingerprint samples", f"{planning / 1e9:.2f} GB")
    row("writer 0 bytes / mean job bytes (with its planning)", f"{with_planning[0] / per_job.mean():.1f}")
    row("footer reads (files touched by jobs)", f"{footer.sum() / 1e9:.2f} GB ({touched:,} file opens)")
    row("shard_plan.json reads (jobs 1..N-1)", f"{plan_read.sum() / 1e9:.2f} GB")
    row("total bytes read / corpus bytes", f"{total / corpus:.4f} (target <= 1.05)")
    row("before (every job reads every row): total / corpus", f"{args.jobs:,}x ({args.jobs * corpus / 1e15:.2f} PB)")
    if args.engine_start:
        engine_start_per_job()


def engine_start_per_job() -> None:
    """Engine start of job 0 (checks: two engines) and job 1 (trusts the record: one engine)."""
    import os
    import re
    import subprocess
    import tempfile

    from xtcache.testing import toy
    from xtcache.testing.suite import TEST_CACHE, TEST_SPEC  # the tests' toy setup, built once
    from xtcache.testing.toy_teacher import build_vllm_teacher

    setup = toy.build_toy_setup(TEST_CACHE, TEST_SPEC)
    teacher = str(build_vllm_teacher(setup.root))
    texts = [json.loads(line)["text"] for line in open(setup.heldout_jsonl)][:16]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = []
        for i in range(2):
            path = Path(tmp) / f"part{i}.jsonl"
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i * 8:(i + 1) * 8]))
            data += ["--data", str(path)]
        for store, job in (("a", 0), ("a", 1), ("b", 0), ("b", 1)):  # store b: with warm compile/page caches
            args = [sys.executable, "-m", "xtcache.cli", "teacher-dump", "--teacher", teacher, "--student-tokenizer",
                    str(setup.student_tokenizer), *data, "--out", f"{tmp}/store_{store}", "--dtype", "float32",
                    "--top-k", "8", "--max-seq-len", "256", "--num-shards", "2", "--shard-index", str(job)]
            t0 = time.perf_counter()
            p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                raise SystemExit(f"job {job} failed:\n{(p.stdout + p.stderr)[-3000:]}")
            start = float(re.search(r"engine start ([0-9.]+) s", p.stdout).group(1))
            check = re.search(r"first-batch check gap [^:]+: ([^)]+)\)", p.stdout).group(1)
            rows.append((store, job, start, wall, check))
    print("\n| store | job | engine start (s) | process wall (s) | first-batch check |\n"
          "| --- | --- | ---: | ---: | --- |")
    for store, job, start, wall, check in rows:
        print(f"| {store} | {job} | {start:.1f} | {wall:.1f} | {check} |")
    print(f"| b | job 1 / job 0 engine start | {rows[3][2] / rows[2][2]:.2f} | | |")


if __name__ == "__main__":
    main(sys.argv[1:])
