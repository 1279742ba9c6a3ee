"""What a teacher cache depends on beyond its flags: the corpus bytes and the capture engine.

**Corpus content.** Each `teacher-dump` job digests (sha256, `xtcache.file_digest`) its bytes of
the corpus files its shard-plan ranges touch, before any teacher work, and records the digests in
the store as `corpus_digests/wNNNNN.json` (one object per writer, written after its claim). A file
read by one job is its whole; a Parquet file split between jobs is cut at their first row groups'
byte offsets (`file_spans`), so the jobs' spans cover each of its bytes once.

* A single job touches every file: the whole-content digests are the corpus part of the cache
  key (`xtcache.fingerprint.content_fingerprint`), so any edit gives another key and
  `--cache-dir` computes a new cache instead of reusing the old one.
* With `--num-shards N > 1` the key holds the corpus listing (names and sizes, from writer 0's
  plan) and every job, when it runs again on a store (a rerun, `--resume`, a reuse of a complete
  store), compares its files' digests with those the store's writers recorded for the same files;
  a changed file is refused with its name. A job checks the other writers' spans of its files
  too, by a read only when the file's validator changed since their record, so a job that runs
  after an edit of a file shared with a finished job refuses as well. On a cold machine each job
  reads its own share once more, nothing else: no job samples every file to
  plan (`bench/shard_plan.py` shows the cost).
* A recorded digest whose validator (object-store ETag / generation / checksum, or local size,
  mtime, ctime and inode) equals the file's current one is trusted without a read; a machine's
  hash cache serves the rest; only what neither knows is read in full, and counted.

**Capture engine.** `capture_identity` names the path that computes the stored values (vLLM fast
path, vLLM prompt log-probs, transformers), its library version and vLLM's tensor-parallel size:
the first-batch check accepts gaps up to 0.5 nats outside fp32 between such paths, so a cache of
one is not reused for another. (A fast path that falls back to prompt log-probs does so for every
run of the same teacher, whose weights are already in the key.)

    python -m stage1_teacher.cache_inputs 4 corpus/*.jsonl   # digests job by job, with their cost
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from stage1_teacher.corpus import Corpus
from stage1_teacher.shard_plan import plan_from_args
from xtcache.errors import StoreError
from xtcache.file_digest import DigestStats, FileDigest, FileHasher
from xtcache.location import Location, now_iso

log = logging.getLogger(__name__)

RECORDS = "corpus_digests"


@dataclass
class ShareDigests:
    """The digests of the files one job touches (by file index in --data), and what they cost."""

    job: int
    files: dict[int, FileDigest]
    stats: DigestStats


def touched_files(shard_plan, job: int) -> list[int]:
    """Indices of the files job `job`'s ranges read (some of a split Parquet file's row groups count)."""
    return sorted({r.file for r in shard_plan.jobs[job]})


def writers_of(shard_plan, files: list[int]) -> list[int]:
    """Every job whose ranges touch one of `files` (the writers whose records cover them)."""
    want = set(files)
    return [j for j, ranges in enumerate(shard_plan.jobs) if any(r.file in want for r in ranges)]


def record_path(job: int) -> str:
    return f"{RECORDS}/w{job:05d}.json"


def read_records(out: str, writers: list[int], store_options: dict | None, plan_fingerprint: str | None = None
                 ) -> dict[int, list[tuple[int, FileDigest]]]:
    """file index -> [(writer, recorded digest)] from the store at `out` (empty when it has none).

    With `plan_fingerprint`, records made under another shard plan (another file list: the store is
    refused by its cache key or plan instead) are left out."""
    loc = Location(out, store_options)
    found: dict[int, list[tuple[int, FileDigest]]] = {}
    for w in writers:
        raw = loc.read_json(record_path(w))
        if raw is None or (plan_fingerprint is not None and raw.get("shard_plan") != plan_fingerprint):
            continue
        try:
            for fi, d in raw["files"].items():
                found.setdefault(int(fi), []).append((w, FileDigest.from_json(d)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"{out}/{record_path(w)}: not a corpus digest record ({type(e).__name__}: {e}); the "
                             "store is damaged: write a new --out") from None
    return found


def share_digests(corpus: Corpus | list[str], shard_plan, job: int, out: str | None, *,
                  storage_options: dict | None, store_options: dict | None, hasher: FileHasher | None = None
                  ) -> ShareDigests:
    """Digest job `job`'s bytes of every file it touches; with a store at `out`, refuse a file whose
    bytes differ from those a writer of that store recorded (each writer's span, checked by a read
    only when the file's validator changed since that writer's record). `corpus`: a resolved
    `Corpus`, or URLs resolved here with `storage_options`."""
    corpus = Corpus.of(corpus, storage_options=storage_options)
    urls = corpus.urls
    hasher = hasher or FileHasher(storage_options)
    files = touched_files(shard_plan, job)
    recorded = read_records(out, writers_of(shard_plan, files), store_options, shard_plan.fingerprint) if out else {}
    digests = {}
    for fi in files:
        spans = file_spans(corpus, shard_plan, fi)
        recs = recorded.get(fi, [])
        own = next((r for w, r in recs if w == job and r.span == spans[job]), None)
        mine = hasher.digest(urls[fi], recorded=own, span=spans[job])
        for w, r in recs:
            if r is own or (r.validator and r.validator == mine.validator):
                now = mine if r is own else r  # the file is the version writer w read
            else:
                now = hasher.digest(urls[fi], span=r.span)
            if (r.name, r.size, r.sha256) != (now.name, now.size, now.sha256):
                where = "" if r.span is None else f" (bytes {r.span[0]}..{r.span[1]})"
                raise StoreError(
                    f"--data {urls[fi]}: its content changed since writer {w} of --out {out} read it{where}: sha256 "
                    f"{r.sha256[:12]}.., {r.size} bytes recorded; now {now.sha256[:12]}.., {now.size} bytes. That "
                    "store holds teacher outputs of the old bytes: restore the file, or write a new store (another "
                    "--out, or delete this one)")
        digests[fi] = mine
    return ShareDigests(job=job, files=digests, stats=hasher.stats)


def file_spans(corpus: Corpus, shard_plan, fi: int) -> dict[int, tuple[int, int] | None]:
    """Job -> the bytes of file `fi` it vouches for: the whole file (None) when one job reads it; for a
    Parquet file split between jobs, from its first row group's start (0 for the first job) to the
    next job's (the file's end for the last), so the spans cover every byte once."""
    jobs = {j: r for j, ranges in enumerate(shard_plan.jobs) for r in ranges if r.file == fi}
    if len(jobs) == 1:
        return {j: None for j in jobs}
    starts, size = corpus.footer(fi).starts, corpus.files[fi].size
    entry = shard_plan.files[fi]
    if entry.row_groups is None or len(starts) != len(entry.row_groups):
        raise StoreError(f"--data {corpus.files[fi].url}: its row groups differ from the shard plan's; the corpus "
                         "changed since the plan, start a new --out")
    return {j: (0 if r.start == 0 else starts[r.start], size if r.stop == len(starts) else starts[r.stop])
            for j, r in jobs.items()}


def record_digests(out: str, share: ShareDigests, plan_fingerprint: str, store_options: dict | None) -> None:
    """Store this writer's digests (replacing its earlier record: same content, maybe new validators)."""
    Location(out, store_options).write_json_atomic(record_path(share.job), {
        "writer_index": share.job, "shard_plan": plan_fingerprint, "created": now_iso(),
        "files": {str(fi): d.as_json() for fi, d in share.files.items()}})


def capture_identity(teacher) -> dict:
    """The engine that computes the stored values, its version and (vLLM) tensor-parallel size."""
    if teacher.engine == "hf":
        import transformers

        return {"engine": "transformers", "transformers_version": transformers.__version__}
    import vllm

    return {"engine": "vllm", "path": "hidden states + lm_head" if teacher.fast_path else "prompt log-probs",
            "vllm_version": vllm.__version__, "tensor_parallel_size": teacher.tensor_parallel_size}


def main(argv: list[str]) -> None:
    corpus, plan = plan_from_args(argv, __doc__.splitlines()[0])
    for job in range(plan.num_jobs):
        share = share_digests(corpus, plan, job, None, storage_options=None, store_options=None,
                              hasher=FileHasher())
        print(f"job {job}: {len(share.files)} files; {share.stats.line()}")


if __name__ == "__main__":
    main(sys.argv[1:])
