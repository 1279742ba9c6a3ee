"""Corpus bytes read by N `teacher-dump` jobs under the shard plan, at cluster scale, without a cluster.

A synthetic listing of 10,000 Parquet files of skewed (log-normal) sizes, cut into row groups of
at most 128 MiB of text column, stands for a ~1 TB corpus; only what the planner sees (sizes and
row-group footers) exists, no data. 1,000 jobs are planned over it and the bench prints, per job,
the bytes it reads: its row groups' text column chunks plus pyarrow's footer read (64 KiB, or the
footer if larger; footer sizes are measured on real Parquet footers with the same row-group
counts) of each file it touches, and the `shard_plan.json` every job other than 0 reads. Writer 0
also lists the corpus once (every footer): shown separately and added to the total.

The corpus check (the cache lookup's reads), before and after, side by side: before, writer 0
sampled 2 MiB of every file for the key (a same-size edit elsewhere went unseen); now each job
digests its bytes of the files it touches (whole files; its row groups' span of a Parquet file
split between jobs: `stage1_teacher.cache_inputs`), which reads its share once more on a cold
machine (no hash cache, no recorded digest) and reads nothing when their
validators (ETag / generation / stat) match a recorded digest. Seconds are the sha256 time at the
rate measured here (one core), and the validator check is timed on real local files. The row "every job reads every row (before)" is the
modulo scheme this plan replaced. Targets: total within 1.05x of the corpus, max/mean job bytes
at most 1.2.

`--engine-start` also runs a real two-job store with vLLM on the tests' toy teacher (one
`xtcache teacher-dump` process per job, one after the other, each with fresh engines) and prints
each job's engine start as its summary reports it: job 0 runs the first-batch check (reference
engine, then hidden-state engine: what every job did before), job 1 trusts job 0's record (the
hidden-state engine only). Two stores one after the other: the first vLLM start on a machine
also fills compile and page caches, so store b is the fair comparison. Run it under the
machine's vLLM lock.

    .venv/bin/python bench/shard_plan.py [--files 10000] [--jobs 1000] [--seed 0] [--engine-start] [--write-docs]

`--write-docs` also writes the printed tables into docs/scaling.md's `shard-plan` block (xtcache.app.docblock).
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

from xtcache.app.docblock import require_blocks, tee_stdout, write_block  # noqa: E402

DOC_BLOCKS = {"shard-plan": "docs/scaling.md"}  # --write-docs: block -> file

FOOTER_READ = 64 * 1024  # pyarrow reads the last 64 KiB of a file to find its footer
FINGERPRINT_SAMPLE = 2 << 20  # before: the corpus key sampled the first and last MiB of every file
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--jobs", type=int, default=1_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-start", action="store_true", help="also time vLLM engine starts of a two-job store")
    p.add_argument("--write-docs", action="store_true", help="also write the tables into docs/scaling.md (shard-plan)")
    args = p.parse_args(argv)
    if args.write_docs:
        require_blocks(REPO, DOC_BLOCKS)
    with tee_stdout() as printed:
        report(args)
    if args.write_docs:
        write_block(REPO / "docs" / "scaling.md", "shard-plan", printed.text())


def report(args) -> None:
    """Plan the synthetic corpus and print the tables (and, with --engine-start, the engine starts)."""
    from stage1_teacher.shard_plan import plan_shards

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
    planning = sum(footer_read(f) for f in files)  # writer 0, once
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
    row("writer 0 planning, once: every footer", f"{planning / 1e9:.2f} GB")
    row("writer 0 bytes / mean job bytes (with its planning)", f"{with_planning[0] / per_job.mean():.1f}")
    row("footer reads (files touched by jobs)", f"{footer.sum() / 1e9:.2f} GB ({touched:,} file opens)")
    row("shard_plan.json reads (jobs 1..N-1)", f"{plan_read.sum() / 1e9:.2f} GB")
    row("total bytes read / corpus bytes", f"{total / corpus:.4f} (target <= 1.05)")
    row("before (every job reads every row): total / corpus", f"{args.jobs:,}x ({args.jobs * corpus / 1e15:.2f} PB)")
    corpus_check_table(files, plan, per_job)
    if args.engine_start:
        engine_start_per_job()


def sha256_rate(n_bytes: int = 256 << 20) -> float:
    """Bytes per second of hashlib.sha256 on this machine (one core), measured."""
    import hashlib

    block = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8).tobytes()
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for _ in range(n_bytes // len(block)):
        h.update(block)
    return n_bytes / (time.perf_counter() - t0)


def validator_check_seconds(n_files: int = 200) -> float:
    """Seconds per file of a warm check (stat + recorded digest with an equal validator), measured."""
    import os
    import tempfile

    from xtcache.file_digest import RACY_S, FileHasher

    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(n_files):
            paths.append(os.path.join(tmp, f"f{i}.jsonl"))
            with open(paths[-1], "w") as f:
                f.write("{}\n")
        time.sleep(RACY_S + 0.1)  # older than file_digest.RACY_S: their validators are trusted
        recorded = [FileHasher(cache_path=None).digest(p) for p in paths]
        warm = FileHasher(cache_path=None)
        t0 = time.perf_counter()
        for p, r in zip(paths, recorded):
            warm.digest(p, recorded=r)
        if warm.stats.bytes_read:
            raise SystemExit("the warm check read file bytes: validators were not trusted")
        return (time.perf_counter() - t0) / n_files


def corpus_check_table(files, plan, per_job) -> None:
    """The cache lookup's corpus reads, before (2 MiB samples in writer 0) and after (per-job digests)."""
    rate = sha256_rate()
    per_file_s = validator_check_seconds()
    touched = [sorted({r.file for r in job}) for job in plan.jobs]
    readers = np.zeros(len(files), dtype=np.int64)
    for t in touched:
        readers[t] += 1
    before = np.zeros(len(plan.jobs), dtype=np.int64)
    before[0] = sum(min(f.size, FINGERPRINT_SAMPLE) for f in files)

    def span_bytes(r) -> int:  # a file read by one job: all of it; else its row groups' share of the file
        f = files[r.file]
        if readers[r.file] == 1:
            return f.size
        return f.size * plan.range_bytes(r) // sum(b for _, b in f.row_groups)

    cold = np.array([sum(span_bytes(r) for r in job) for job in plan.jobs], dtype=np.int64)
    n_touched = np.array([len(t) for t in touched])
    mean_read = per_job.mean()

    def gb(v) -> str:
        return f"{v / 1e9:.2f} GB"

    print(f"\ncorpus check of the cache lookup (sha256 at {rate / 1e9:.2f} GB/s, one core, measured here; warm "
          f"check {per_file_s * 1e6:.0f} us per local file, measured)\n")
    print("| measure | before: 2 MiB samples in writer 0 | after, cold: each job digests its bytes | after, warm: "
          "validators match |\n| --- | ---: | ---: | ---: |")
    print(f"| writer 0 bytes | {gb(before[0])} | {gb(cold[0])} | 0 |")
    print(f"| writer 0 bytes / mean job read | {before[0] / mean_read:.1f} | {cold[0] / mean_read:.2f} | 0 |")
    print(f"| mean job bytes / mean job read | {before.mean() / mean_read:.3f} | {cold.mean() / mean_read:.3f} | 0 |")
    print(f"| max job bytes / mean job read | {before.max() / mean_read:.1f} | {cold.max() / mean_read:.2f} | 0 |")
    print(f"| max job sha256 time | {before.max() / rate:.1f} s | {cold.max() / rate:.1f} s | "
          f"{n_touched.max() * per_file_s * 1e3:.1f} ms ({n_touched.max()} files) |")
    print(f"| all jobs bytes / corpus | {before.sum() / sum(f.size for f in files):.4f} | "
          f"{cold.sum() / sum(f.size for f in files):.4f} | 0 |")
    print("| an edit the lookup sees | in the first or last MiB, or a size change | any byte | any byte "
          "(it changes the validator) |")


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
            args = [sys.executable, "-m", "xtcache.app.cli", "teacher-dump", "--teacher", teacher, "--student-tokenizer",
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
