"""Shard plans of `xtcache teacher-dump`: each of N jobs reads only its share of the corpus.

The plan is checked as a pure function (coverage, contiguity, balance, row numbers); four jobs
read a Parquet corpus through a filesystem that records every byte range fetched (no row group
read by two jobs, their documents together equal one job's); stores written by four jobs equal
one job's document for document (transformers engine, real Zarr stores).

    .venv/bin/python -m pytest -q tests/test_shard_plan.py
"""

from __future__ import annotations

import json
import os
import random
import string

import numpy as np
import pytest

from stage1_teacher.config import build_config
from stage1_teacher.corpus import Document, iter_corpus
from stage1_teacher.dump import run_teacher_dump
from stage1_teacher.shard_plan import FileEntry, ShardPlan, build_plan, launcher_index, obtain_plan, plan_shards
from xtcache.errors import ConfigError, StoreError

# ------------------------------------------------------------------------------ the plan itself


def _listing(seed: int, n_files: int) -> list[FileEntry]:
    rng = random.Random(seed)
    files = []
    for i in range(n_files):
        if rng.random() < 0.2:
            files.append(FileEntry(name=f"f{i}.jsonl", size=rng.randint(0, 5000), format="jsonl"))
        else:
            groups = tuple((rng.randint(0, 50), rng.randint(0, 3000)) for _ in range(rng.randint(0, 6)))
            files.append(FileEntry(name=f"f{i}.parquet", size=sum(b for _, b in groups) + 100, format="parquet",
                                   row_groups=groups))
    return files


@pytest.mark.parametrize("seed,n_files,n_jobs", [(0, 40, 1), (1, 40, 7), (2, 5, 16), (3, 200, 33)])
def test_plan_covers_every_unit_once_in_order_and_balances_bytes(seed, n_files, n_jobs):
    files = _listing(seed, n_files)
    plan = plan_shards(files, n_jobs)
    assert plan_shards(files, n_jobs).fingerprint == plan.fingerprint  # pure
    units = [(r.file, g) for job in plan.jobs for r in job for g in range(r.start, r.stop)]
    want = [(fi, g) for fi, f in enumerate(files) for g in range(1 if f.row_groups is None else len(f.row_groups))]
    assert units == want  # every row group / whole file exactly once, jobs contiguous and in corpus order
    sizes = [f.size if f.row_groups is None else b for f in files for b in ([None] if f.row_groups is None
                                                                             else [b for _, b in f.row_groups])]
    jb = plan.job_bytes()
    assert sum(jb) == plan.corpus_bytes() == sum(sizes)
    assert max(jb) <= sum(jb) / n_jobs + max(sizes)  # within one unit of the mean
    # row numbers: a range starts at the rows of the row groups before it in its file
    for job in plan.jobs:
        for r in job:
            f = files[r.file]
            assert plan.first_row(r) == (0 if f.row_groups is None else sum(n for n, _ in f.row_groups[:r.start]))
    assert ShardPlan.from_json(json.loads(json.dumps(plan.as_json()))).fingerprint == plan.fingerprint
    other = plan_shards(files, n_jobs + 1)
    assert other.fingerprint != plan.fingerprint


def test_plan_file_that_was_edited_is_refused():
    plan = plan_shards(_listing(5, 10), 3)
    raw = plan.as_json()
    raw["jobs"][0], raw["jobs"][1] = raw["jobs"][1], raw["jobs"][0]
    with pytest.raises(StoreError, match="fingerprint"):
        ShardPlan.from_json(raw)


def test_launcher_indices_explicit_flag_wins():
    slurm = {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert launcher_index(None, None, slurm)[:2] == (2, 4)
    assert "Slurm" in launcher_index(None, None, slurm)[2]
    assert launcher_index(1, 4, slurm) == (1, 4, "--shard-index")
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_COUNT"):
        launcher_index(None, 8, slurm)
    with pytest.raises(ConfigError, match="--num-shards"):
        launcher_index(None, None, {"JOB_COMPLETION_INDEX": "3"})
    assert launcher_index(None, 5, {"JOB_COMPLETION_INDEX": "3"})[:2] == (3, 5)
    assert launcher_index(None, None, {"RANK": "1", "WORLD_SIZE": "2"})[:2] == (1, 2)
    assert launcher_index(None, None, {})[:2] == (0, 1)
    with pytest.raises(ConfigError, match="not an integer"):
        launcher_index(None, None, {"RANK": "x", "WORLD_SIZE": "2"})


def test_config_takes_the_index_from_the_launcher(monkeypatch, teacher, toy_setup, tmp_path):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "5")
    values = {"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)],
              "data": [str(toy_setup.heldout_jsonl)], "out": str(tmp_path / "s")}
    cfg = build_config(values)
    assert (cfg.store.shard_index, cfg.store.num_shards) == (2, 5) and "Slurm" in cfg.store.shard_source
    cfg = build_config({**values, "shard_index": 0, "num_shards": 2})
    assert (cfg.store.shard_index, cfg.store.num_shards, cfg.store.shard_source) == (0, 2, "--shard-index")


# ------------------------------------------------------------------- reads through a counting filesystem

def _counting_fs():
    """An fsspec filesystem ("countfs://" + local path) that records every byte range it fetches."""
    import fsspec
    from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

    class CountingFile(AbstractBufferedFile):
        def _fetch_range(self, start, end):
            self.fs.reads.append((self.path, start, end))
            with open(self.path, "rb") as f:
                f.seek(start)
                return f.read(end - start)

    class CountingFS(AbstractFileSystem):
        protocol = "countfs"
        reads: list = []

        def info(self, path, **kw):
            path = self._strip_protocol(path)
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            return {"name": path, "size": os.path.getsize(path),
                    "type": "directory" if os.path.isdir(path) else "file"}

        def ls(self, path, detail=True, **kw):
            path = self._strip_protocol(path)
            out = [self.info(os.path.join(path, n)) for n in sorted(os.listdir(path))]
            return out if detail else [o["name"] for o in out]

        def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kw):
            return CountingFile(self, path, mode, block_size=block_size or 1 << 16,
                                cache_type=kw.get("cache_type", "none"), cache_options=cache_options)

    fsspec.register_implementation("countfs", CountingFS, clobber=True)
    return CountingFS


def _random_text(rng: random.Random, n: int) -> str:
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(n // 6)]
    return " ".join(words)[:n]


@pytest.fixture(scope="module")
def parquet_corpus(tmp_path_factory):
    """Four uncompressed Parquet files of 1-4 row groups of ~180 KB each (over pyarrow's 64 KiB footer read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    root = tmp_path_factory.mktemp("pq")
    files = []
    for i, groups in enumerate((3, 1, 4, 2)):
        texts = [_random_text(rng, rng.randint(2500, 3500)) for _ in range(60 * groups)]
        path = root / f"part{i}.parquet"
        pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path, row_group_size=60,
                       compression="none")
        files.append(str(path))
    return files


def test_four_jobs_read_each_row_group_once_and_together_equal_one_job(parquet_corpus, tmp_path):
    import pyarrow.parquet as pq

    fs_cls = _counting_fs()
    urls = [f"countfs://{p}" for p in parquet_corpus]
    out = str(tmp_path / "store")
    # writer 0's part: list the corpus once (footers only: no content sample) and store the plan
    fs_cls.reads.clear()
    plan = obtain_plan(urls, "text", num_jobs=4, job=0, out=out, storage_options={}, store_options={})
    planning = sum(e - s for _, s, e in fs_cls.reads)
    assert planning <= len(urls) * 64 * 1024
    single = [d for d in iter_corpus(parquet_corpus, "text") if isinstance(d, Document)]
    per_job_docs, per_job_reads = [], []
    for job in range(4):
        fs_cls.reads.clear()
        got = obtain_plan(urls, "text", num_jobs=4, job=job, out=out, storage_options={}, store_options={})
        assert got.fingerprint == plan.fingerprint
        assert not fs_cls.reads  # the other jobs read the stored plan, not the corpus footers
        per_job_docs.append([d for d in iter_corpus(urls, "text", plan=got, job=job, storage_options={})
                             if isinstance(d, Document)])
        per_job_reads.append(list(fs_cls.reads))
    # documents: disjoint, and together exactly the single job's (same ids, same order)
    union = [d.doc_id for docs in per_job_docs for d in docs]
    assert union == [d.doc_id for d in single]
    assert all(per_job_docs)  # every job had work
    # bytes: every row group's column chunk is fetched by exactly one job; the others touch at most
    # pyarrow's 64 KiB footer read of it
    corpus_bytes = sum(os.path.getsize(p) for p in parquet_corpus)
    for path in parquet_corpus:
        md = pq.ParquetFile(path).metadata
        for g in range(md.num_row_groups):
            col = md.row_group(g).column(0)
            lo = col.dictionary_page_offset or col.data_page_offset
            hi = lo + col.total_compressed_size
            fetched = [sum(max(0, min(e, hi) - max(s, lo)) for p, s, e in reads if p == path)
                       for reads in per_job_reads]
            full = [j for j, n in enumerate(fetched) if n >= (hi - lo)]
            assert len(full) == 1, (path, g, fetched)
            assert all(n <= 64 * 1024 for j, n in enumerate(fetched) if j != full[0]), (path, g, fetched)
    total_read = sum(e - s for reads in per_job_reads for _, s, e in reads)
    touched = sum(len({r.file for r in job}) for job in plan.jobs)
    assert total_read <= corpus_bytes + touched * 64 * 1024  # read once, plus one footer read per file and job
    # the corpus check: each job digests its own bytes, together every byte once
    from stage1_teacher.cache_inputs import share_digests
    from xtcache.file_digest import FileHasher

    digested = [share_digests(urls, plan, job, None, storage_options={}, store_options=None,
                              hasher=FileHasher({}, cache_path=None)).stats.bytes_read for job in range(4)]
    assert sum(digested) == corpus_bytes and all(digested)
    print(f"corpus {corpus_bytes} B, 4 jobs read {total_read} B ({total_read / corpus_bytes:.2f}x), "
          f"planning (writer 0 only) {planning} B")


def test_other_job_count_or_corpus_is_refused(parquet_corpus, tmp_path):
    out = str(tmp_path / "store")
    obtain_plan(parquet_corpus, "text", num_jobs=4, job=0, out=out, storage_options={}, store_options={})
    with pytest.raises(ConfigError, match="planned for 4 jobs"):
        obtain_plan(parquet_corpus, "text", num_jobs=3, job=0, out=out, storage_options={}, store_options={})
    with pytest.raises(ConfigError, match="differ"):
        obtain_plan(parquet_corpus[:2], "text", num_jobs=4, job=1, out=out, storage_options={}, store_options={})


# ------------------------------------------------------------------------- N-job store == 1-job store


def test_a_run_fetches_each_parquet_footer_once(teacher, toy_setup, parquet_corpus, tmp_path):
    """--data is resolved once: the first-rows check, the messages-field detection, the shard plan,
    the digest spans of a file split between jobs and the reader share each Parquet footer. A footer
    fetch is a read that ends at the file's end without starting at 0 (a digest reads from 0)."""
    from collections import Counter

    fs_cls = _counting_fs()
    urls = [f"countfs://{p}" for p in parquet_corpus]
    fs_cls.reads.clear()
    counts = _dump(teacher, urls, tmp_path / "store", [toy_setup.student_tokenizer], num_shards=2, shard_index=0,
                   dry_run=True)
    assert counts.documents > 0
    size = {p: os.path.getsize(p) for p in parquet_corpus}
    footers = Counter(p for p, start, end in fs_cls.reads if end == size[p] and start > 0)
    assert footers == Counter(parquet_corpus)  # every file once (each file's first rows are checked)
    plan = build_plan(parquet_corpus, "text", 2)
    assert len({r.file for r in plan.jobs[0]} & {r.file for r in plan.jobs[1]}) == 1  # a split file's spans too


@pytest.fixture(scope="module")
def mixed_corpus(toy_setup, tmp_path_factory):
    """Parquet files of several row groups plus a JSONL and a text file, with rows to skip."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:30]
    root = tmp_path_factory.mktemp("mixed")
    a = root / "a.parquet"
    pq.write_table(pa.table({"text": texts[:10] + [None, ""]}), a, row_group_size=3)
    b = root / "b.parquet"
    pq.write_table(pa.table({"text": texts[10:16]}), b, row_group_size=2)
    c = root / "c.jsonl"
    c.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[16:24]) + '{"nope": 1}\n')
    d = root / "d.txt"
    d.write_text("\n".join(t.replace("\n", " ") for t in texts[24:30]) + "\n")
    return [str(a), str(b), str(c), str(d)]


def _dump(teacher, data, out, students, **kw):
    values = {"teacher": teacher, "student_tokenizer": [str(s) for s in students], "data": data, "out": str(out),
              "engine": "hf", "max_seq_len": 96, "window_overlap": 16, "docs_per_part": 3, "top_k": 8, **kw}
    return run_teacher_dump(build_config(values), progress=False)


def _store_docs(url) -> dict:
    """doc id -> every stored per-document array (teacher side and alignment), from a verified read."""
    from xtcache.store import CacheReader

    r = CacheReader(str(url))
    assert r.is_complete()
    out = {}
    (fp,) = r.alignment_groups()
    for m in r.shards:
        data = r.read_shard(m.shard_id, verify=True)
        al = r.read_alignment(fp, m.shard_id, verify=True)
        for i in range(data.num_docs):
            d, a = data.doc(i), al.record(i)
            # a row's top-k is a set: its order follows its part's id dictionary (format 4), so compare by id
            order = np.argsort(d.topk_ids, axis=1, kind="stable")
            out[d.doc_id] = {"text": d.text, "teacher_ids": d.teacher_ids, "char_offsets": d.char_offsets,
                             "has_pred": d.has_pred, "topk_ids": np.take_along_axis(d.topk_ids, order, 1),
                             "topk_logprobs": np.take_along_axis(d.topk_logprobs, order, 1),
                             "residual": d.residual, "realized": d.realized_logprob, "student_ids": a.student_ids,
                             "student_end": a.alignment.student_end, "teacher_end": a.alignment.teacher_end}
    return out


def _assert_same_docs(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        for name, v in a[k].items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(v, b[k][name], err_msg=f"{k} {name}")
            else:
                assert v == b[k][name], (k, name)


@pytest.fixture(scope="module")
def one_job(teacher, toy_setup, mixed_corpus, tmp_path_factory):
    """(store, summary) of the mixed corpus written by one job: what several jobs must equal."""
    one = tmp_path_factory.mktemp("one_job") / "one"
    return one, _dump(teacher, mixed_corpus, one, [toy_setup.student_tokenizer])


def test_four_jobs_write_the_same_documents_as_one(teacher, toy_setup, mixed_corpus, one_job, tmp_path):
    students = [toy_setup.student_tokenizer]
    one, single = one_job
    many = tmp_path / "many"
    summaries = [_dump(teacher, mixed_corpus, many, students, num_shards=4, shard_index=i) for i in (0, 2, 3, 1)]
    assert sum(s.documents for s in summaries) == single.documents and all(s.documents for s in summaries)
    _assert_same_docs(_store_docs(one), _store_docs(many))
    from xtcache.store import CacheReader

    r = CacheReader(str(many))
    plan = build_plan(mixed_corpus, "text", 4, {})
    assert r.manifest.shard_plan.fingerprint == plan.fingerprint and r.manifest.shard_plan.num_jobs == 4
    assert r.manifest.settings["shard_plan"] == plan.fingerprint
    single_manifest = CacheReader(str(one)).manifest
    assert "shard_plan" not in single_manifest.settings and single_manifest.shard_plan is None
    with pytest.raises(ConfigError, match="planned for 4 jobs"):
        _dump(teacher, mixed_corpus, many, students, num_shards=2, shard_index=0)
    # verify checks each writer's documents against its plan ranges: sound as written, and a plan
    # whose jobs were swapped around puts documents outside their writer's ranges
    from xtcache.app.store_commands import verify_store

    assert verify_store(str(many), stop_first=False) == []
    plan_file = many / "shard_plan.json"
    swapped = json.loads(plan_file.read_text())
    swapped["jobs"] = swapped["jobs"][::-1]
    plan_file.write_text(json.dumps(swapped))
    problems = verify_store(str(many), stop_first=False)
    assert problems and all("outside writer" in p and "shard-plan ranges" in p for p in problems), problems


def test_kill_and_resume_of_one_job_gives_the_same_store(teacher, toy_setup, mixed_corpus, one_job, procs, tmp_path):
    """SIGKILL job 1 of 2 (a real command-line process, forked from the worker's warm process) after its first
    commits, resume it: the store equals one job's run. Job 0 writes its share in this process first, with the
    same settings."""
    import signal
    import time

    data = [a for p in mixed_corpus for a in ("--data", p)]
    out = tmp_path / "two"
    base = ["teacher-dump", "--teacher", teacher, "--student-tokenizer", str(toy_setup.student_tokenizer), *data,
            "--engine", "hf", "--max-seq-len", "96", "--window-overlap", "16", "--docs-per-part", "1", "--top-k", "8",
            "--out", str(out), "--num-shards", "2"]
    _dump(teacher, mixed_corpus, out, [toy_setup.student_tokenizer], docs_per_part=1, num_shards=2, shard_index=0)
    pid = procs.start(*base, "--shard-index", "1")
    deadline = time.time() + 300
    while time.time() < deadline and procs.poll(pid) is None and len(list((out / "index").glob("w00001-*.json"))) < 2:
        time.sleep(0.05)
    assert procs.poll(pid) is None, "job 1 finished before it could be killed"
    os.kill(pid, signal.SIGKILL)
    assert procs.wait(pid).returncode == -signal.SIGKILL
    p = procs.cli(*base, "--shard-index", "1", "--resume")
    log = p.stdout + p.stderr
    assert p.returncode == 0 and "parts kept" in log, log[-3000:]
    _assert_same_docs(_store_docs(one_job[0]), _store_docs(out))


def test_each_job_checks_the_first_rows_of_its_own_files_only(teacher, toy_setup, tmp_path):
    """With several jobs, a job opens only the files of its share: a file no row of which is a document
    stops the job that reads it, before its teacher is hashed, and not the others."""
    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:8]
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    bad.write_text("".join(json.dumps({"nope": t}) + "\n" for t in texts))
    plan = build_plan([str(good), str(bad)], "text", 2)
    assert [{r.file for r in job} for job in plan.jobs] == [{0}, {1}]
    counts = _dump(teacher, [str(good), str(bad)], tmp_path / "s", [toy_setup.student_tokenizer], num_shards=2,
                   shard_index=0, dry_run=True)
    assert counts.documents == 8
    with pytest.raises(ConfigError, match=r"--data .*b\.jsonl: none of its first 8 rows is a usable document"):
        _dump(teacher, [str(good), str(bad)], tmp_path / "s", [toy_setup.student_tokenizer], num_shards=2,
              shard_index=1, dry_run=True)
