"""Shard plan of `xtcache teacher-dump`: which job reads which contiguous ranges of the corpus.

`N` jobs (`--num-shards`) split the corpus by bytes, not by rows: each job opens and reads only
its own ranges, so the cluster reads the corpus once in total instead of `N` times.

* The **listing** (`list_corpus`) holds, per file, its base name, size and format and, for
  Parquet, every row group's row count and the compressed bytes of the text column (what reading
  it costs), taken from the file's footer: no data page is read.
* The **plan** (`plan_shards`) is a pure function of (listing, N). Units are Parquet row groups
  and whole Arrow / JSONL / text files, in corpus order; job `j` gets the units whose byte
  midpoint falls in `[j, j + 1) * total / N`, a contiguous run. A job's bytes are within one
  unit of the mean, so the balance is as good as the largest unit is small against `total / N`.
* **Document ids do not change**: a Parquet row group knows its first row from the footers (the
  row counts of the groups before it), and line-based files (JSONL, text) and Arrow files are
  never split, so every row keeps the 0-based row number a single job gives it. Splitting a JSONL
  file at a byte offset would need the number of lines before that offset, which costs reading
  those bytes (or changing the ids to byte offsets, which changes every cache key of a JSONL
  corpus); a corpus of a few huge JSONL files should be cut into files or converted to Parquet.
* With `--out` and `N > 1` the plan is built once, by writer 0, and stored in the store as
  `shard_plan.json` (with the listing's fingerprint: names and sizes): the other writers wait for
  it and read it instead of reading every file's footer themselves. Its fingerprint is part of the
  capture settings (the cache key) and of the manifest, so a store is never filled under two
  plans; a run asking for another number of jobs is refused. The corpus content is checked job by
  job, each on the files it reads (`stage1_teacher.cache_inputs`): planning reads no data page.

    python -m stage1_teacher.shard_plan 8 corpus/*.parquet   # prints the plan's balance
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

from schemas.models import FORMAT_VERSION, ShardPlanFile, ShardPlanMeta
from stage1_teacher.corpus import Corpus
from stage1_teacher.polling import poll_until
from xtcache.errors import ConfigError, StoreError
from xtcache.fingerprint import canonical_sha256, listing_fingerprint
from xtcache.location import Location, read_model

log = logging.getLogger(__name__)

PLAN_FILE = "shard_plan.json"
PLAN_WAIT_S = 1800.0  # how long writers other than 0 wait for writer 0's plan
PLAN_POLL_S = 2.0


@dataclass(frozen=True)
class FileEntry:
    """One corpus file as the planner sees it."""

    name: str  # base name (the document ids' source)
    size: int
    format: str  # parquet | arrow | jsonl | text
    row_groups: tuple[tuple[int, int], ...] | None = None  # Parquet: (rows, text column bytes) per row group

    def as_json(self) -> dict:
        return {"name": self.name, "size": self.size, "format": self.format,
                "row_groups": None if self.row_groups is None else [list(g) for g in self.row_groups]}

    @staticmethod
    def from_json(d: dict) -> FileEntry:
        rg = d.get("row_groups")
        return FileEntry(name=d["name"], size=int(d["size"]), format=d["format"],
                         row_groups=None if rg is None else tuple((int(a), int(b)) for a, b in rg))


@dataclass(frozen=True)
class Range:
    """Row groups [start, stop) of file `file` (whole-file formats: start=0, stop=1)."""

    file: int
    start: int
    stop: int


@dataclass
class ShardPlan:
    num_jobs: int
    files: list[FileEntry]
    jobs: list[list[Range]]
    corpus_fingerprint: str = ""
    fingerprint: str = field(default="")

    def __post_init__(self):
        if not self.fingerprint:
            self.fingerprint = canonical_sha256({"num_jobs": self.num_jobs, "files": [f.as_json() for f in self.files],
                                                 "jobs": [[[r.file, r.start, r.stop] for r in j] for j in self.jobs]},
                                                ascii_only=True)

    def range_bytes(self, r: Range) -> int:
        f = self.files[r.file]
        return f.size if f.row_groups is None else sum(b for _, b in f.row_groups[r.start:r.stop])

    def range_rows(self, r: Range) -> int | None:
        f = self.files[r.file]
        return None if f.row_groups is None else sum(n for n, _ in f.row_groups[r.start:r.stop])

    def first_row(self, r: Range) -> int:
        """Row number (in its file) of the range's first row."""
        f = self.files[r.file]
        return 0 if f.row_groups is None else sum(n for n, _ in f.row_groups[:r.start])

    def job_bytes(self) -> list[int]:
        return [sum(self.range_bytes(r) for r in job) for job in self.jobs]

    def corpus_bytes(self) -> int:
        return sum(f.size if f.row_groups is None else sum(b for _, b in f.row_groups) for f in self.files)

    def as_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "num_jobs": self.num_jobs, "fingerprint": self.fingerprint,
                "corpus_fingerprint": self.corpus_fingerprint, "files": [f.as_json() for f in self.files],
                "jobs": [[[r.file, r.start, r.stop] for r in j] for j in self.jobs]}

    @staticmethod
    def from_json(d: dict, where: str = PLAN_FILE) -> ShardPlan:
        read_model(ShardPlanFile, d, where)
        plan = ShardPlan(num_jobs=int(d["num_jobs"]), files=[FileEntry.from_json(f) for f in d["files"]],
                         jobs=[[Range(*map(int, r)) for r in j] for j in d["jobs"]],
                         corpus_fingerprint=d.get("corpus_fingerprint", ""))
        if plan.fingerprint != d.get("fingerprint"):
            raise StoreError(f"{PLAN_FILE}: its fingerprint does not match its content (edited or damaged)")
        return plan

    def meta(self):
        """The manifest's summary of this plan (schemas.models.ShardPlanMeta)."""
        jb = self.job_bytes()
        return ShardPlanMeta(fingerprint=self.fingerprint, num_jobs=self.num_jobs, num_files=len(self.files),
                             corpus_bytes=self.corpus_bytes(), max_job_bytes=max(jb, default=0))


def plan_shards(files: list[FileEntry], num_jobs: int, corpus_fingerprint: str = "") -> ShardPlan:
    """Contiguous, byte-balanced ranges for `num_jobs` jobs (pure: same listing and N, same plan)."""
    if num_jobs < 1:
        raise ValueError("num_jobs must be at least 1")
    units: list[tuple[int, int, int]] = []  # (file, row group or 0, bytes)
    for fi, f in enumerate(files):
        if f.row_groups is None:
            units.append((fi, 0, f.size))
        else:
            units.extend((fi, g, b) for g, (_, b) in enumerate(f.row_groups))
    total = sum(b for _, _, b in units)
    jobs: list[list[Range]] = [[] for _ in range(num_jobs)]
    done = 0
    for fi, g, b in units:
        # the unit's byte midpoint decides its job; empty units follow the previous unit
        j = min(num_jobs - 1, int((2 * done + b) * num_jobs // (2 * total))) if total else 0
        done += b
        stop = g + 1
        last = jobs[j][-1] if jobs[j] else None
        if last is not None and last.file == fi and last.stop == g:
            jobs[j][-1] = Range(fi, last.start, stop)
        else:
            jobs[j].append(Range(fi, g, stop))
    return ShardPlan(num_jobs=num_jobs, files=list(files), jobs=jobs, corpus_fingerprint=corpus_fingerprint)


def list_corpus(corpus: Corpus | list[str], text_field: str = "text",
                storage_options: dict | None = None) -> list[FileEntry]:
    """The planner's listing: sizes, and for Parquet the row groups from the footer (no data pages).

    `corpus`: a resolved `Corpus`, or URLs resolved here with `text_field` and `storage_options`."""
    corpus = Corpus.of(corpus, text_field, storage_options)
    footers = corpus.footers()
    entries = []
    for fi, f in enumerate(corpus.files):
        groups = None
        if fi in footers:
            if corpus.field not in footers[fi].columns:
                raise ConfigError(f"--data {f.url}: no column {corpus.field!r} (columns: {list(footers[fi].columns)}); "
                                  "set --text-field")
            groups = footers[fi].row_groups(corpus.field)
        entries.append(FileEntry(name=f.name, size=f.size, format=f.format, row_groups=groups))
    return entries


def build_plan(corpus: Corpus | list[str], text_field: str, num_jobs: int, storage_options: dict | None = None
               ) -> ShardPlan:
    """List the corpus and plan it (what writer 0, or a single job, does). The plan carries the
    listing's fingerprint (names and sizes): no content is read here; each job digests its own
    files (`stage1_teacher.cache_inputs`)."""
    listing = list_corpus(corpus, text_field, storage_options)
    return plan_shards(listing, num_jobs, listing_fingerprint((f.name, f.size) for f in listing))


def obtain_plan(corpus: Corpus | list[str], text_field: str, *, num_jobs: int, job: int, out: str | None,
                storage_options: dict | None, store_options: dict | None, dry_run: bool = False) -> ShardPlan:
    """This run's plan: the store's `shard_plan.json` when there is one (checked against the corpus
    listing and N), else built here (writer 0 stores it; a dry run keeps it to itself) or, for
    writers other than 0, waited for. `corpus`: a resolved `Corpus`, or URLs resolved here."""
    corpus = Corpus.of(corpus, text_field, storage_options)
    if num_jobs == 1 or not out:
        return build_plan(corpus, text_field, num_jobs)

    loc = Location(out, store_options)
    raw = loc.read_json(PLAN_FILE)
    if raw is None and dry_run:
        return build_plan(corpus, text_field, num_jobs)
    if raw is None and job == 0:
        plan = build_plan(corpus, text_field, num_jobs)
        if loc.create_exclusive(PLAN_FILE, plan.as_json()):
            log.info("shard plan for %d jobs written to %s/%s (fingerprint %s..)", num_jobs, out, PLAN_FILE,
                     plan.fingerprint[:12])
            return plan
        raw = loc.read_json(PLAN_FILE)
    if raw is None:
        log.info("waiting for writer 0 to store the shard plan at %s/%s", out, PLAN_FILE)
        raw = poll_until(lambda: loc.read_json(PLAN_FILE), timeout_s=PLAN_WAIT_S, poll_s=PLAN_POLL_S,
                         expired=lambda: StoreError(f"--out {out}: writer 0 stored no {PLAN_FILE} within "
                                                    f"{PLAN_WAIT_S:.0f} s; start --shard-index 0 first (it lists the "
                                                    "corpus once for all jobs)"))
    plan = ShardPlan.from_json(raw, f"{out}/{PLAN_FILE}")
    if plan.num_jobs != num_jobs:
        raise ConfigError(f"--num-shards {num_jobs}: --out {out} was planned for {plan.num_jobs} jobs; a store keeps "
                          f"one shard plan (use --num-shards {plan.num_jobs} or another --out)")
    names = [f.name for f in corpus.files]
    if names != [f.name for f in plan.files]:
        raise ConfigError(f"--data: the corpus files differ from those {out}/{PLAN_FILE} was planned for "
                          f"({len(names)} files given, {len(plan.files)} planned); use the same --data or another "
                          "--out")
    return plan


# --------------------------------------------------------------------------- launcher indices

def launcher_index(explicit_index: int | None, explicit_count: int | None, env: dict | None = None
                   ) -> tuple[int, int, str]:
    """(shard index, number of shards, where they came from).

    An explicit `--shard-index` wins. Otherwise, in order: a Slurm array (SLURM_ARRAY_TASK_ID minus
    SLURM_ARRAY_TASK_MIN, of SLURM_ARRAY_TASK_COUNT), a Kubernetes indexed Job (JOB_COMPLETION_INDEX;
    its count is not in the environment, so --num-shards must be given), torchrun-style RANK /
    WORLD_SIZE. No launcher and no flag: job 0 of --num-shards (default 1).
    """
    env = os.environ if env is None else env
    if explicit_index is not None:
        return explicit_index, explicit_count or 1, "--shard-index"
    if "SLURM_ARRAY_TASK_ID" in env:
        task, low = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_MIN", 0)
        count = _int(env, "SLURM_ARRAY_TASK_COUNT") if "SLURM_ARRAY_TASK_COUNT" in env else explicit_count
        if count is None:
            raise ConfigError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; pass --num-shards")
        if explicit_count is not None and explicit_count != count:
            raise ConfigError(f"--num-shards {explicit_count} disagrees with SLURM_ARRAY_TASK_COUNT={count}")
        return task - low, count, (f"Slurm array (SLURM_ARRAY_TASK_ID={task} - SLURM_ARRAY_TASK_MIN={low}, "
                                   f"SLURM_ARRAY_TASK_COUNT={count})")
    if "JOB_COMPLETION_INDEX" in env:
        if explicit_count is None:
            raise ConfigError("JOB_COMPLETION_INDEX is set (Kubernetes indexed Job) but the job count is not in the "
                              "environment: pass --num-shards (the Job's completions)")
        return _int(env, "JOB_COMPLETION_INDEX"), explicit_count, "Kubernetes indexed Job (JOB_COMPLETION_INDEX)"
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if explicit_count is not None and explicit_count != world:
            raise ConfigError(f"--num-shards {explicit_count} disagrees with WORLD_SIZE={world}")
        return rank, world, "RANK/WORLD_SIZE"
    return 0, explicit_count or 1, "default (no --shard-index, no launcher environment)"


def _int(env, name: str, default: int | None = None) -> int:
    if name not in env and default is not None:
        return default
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment {name}={env[name]!r}: not an integer") from None


def plan_from_args(argv: list[str], description: str) -> tuple[Corpus, ShardPlan]:
    """The corpus and plan of a command line `NUM_JOBS FILE... [--text-field F]` (the modules' mains)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("num_jobs", type=int)
    p.add_argument("files", nargs="+")
    p.add_argument("--text-field", default="text")
    args = p.parse_args(argv)
    corpus = Corpus.resolve(args.files, args.text_field)
    return corpus, plan_shards(list_corpus(corpus), args.num_jobs)


def main(argv: list[str]) -> None:
    _, plan = plan_from_args(argv, __doc__.splitlines()[0])
    jb = plan.job_bytes()
    mean = sum(jb) / len(jb)
    print(f"jobs {plan.num_jobs}  corpus bytes {plan.corpus_bytes()}  max/mean job bytes {max(jb) / max(mean, 1):.3f}  "
          f"fingerprint {plan.fingerprint[:16]}")


if __name__ == "__main__":
    main(sys.argv[1:])
