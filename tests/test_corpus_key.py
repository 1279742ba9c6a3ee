"""The corpus part of the cache key sees every byte: no edited corpus reuses a stale cache silently.

Bad-input matrix: a same-size edit in the middle of a >2 MiB JSONL, Parquet and Arrow file, a
reordered file list, an appended row, a renamed, added or removed file, the same on an object
store (S3 test server); then end to end with `--engine hf` (no vLLM): a `--cache-dir` run after a
mid-file edit computes a new cache, and a multi-job `--out` store rerun after an edit is refused
by name. Digests cost one read per version of a file (validators, hash cache, recorded digests).

    .venv/bin/python -m pytest -q tests/test_corpus_key.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stage1_teacher.config import build_config
from stage1_teacher.dump import run_teacher_dump
from xtcache import file_digest
from xtcache.errors import StoreError
from xtcache.file_digest import FileHasher
from xtcache.fingerprint import corpus_fingerprint

BIG = 3 << 20  # over the 2 MiB the old key sampled (first and last MiB)


@pytest.fixture(autouse=True)
def private_hash_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XTCACHE_HASH_CACHE", str(tmp_path / "hashes.sqlite"))


def _words(n_bytes: int, seed: int = 0) -> str:
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta"]
    out, size = [], 0
    while size < n_bytes:
        out.append(rng.choice(words))
        size += len(out[-1]) + 1
    return " ".join(out)


def edit_middle(path: Path, start: int | None = None) -> int:
    """Change the first letter of the first word (after a space) at or after the middle of the file
    (or `start`) to the next letter: a one-byte, same-size edit of a document's text."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if start is None else start
    while not (97 <= data[i] < ord("z") and data[i - 1] == ord(" ")):
        i += 1
    data[i] += 1
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size
    return i


def write_jsonl(path: Path, rows: int = 64) -> Path:
    path.write_text("".join(json.dumps({"text": _words(BIG // rows, seed=i)}) + "\n" for i in range(rows)))
    return path


def write_parquet(path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": [_words(BIG // 64, seed=i) for i in range(64)]})
    pq.write_table(table, path, compression="none", use_dictionary=False)  # the text bytes sit in the file as is
    return path


def write_arrow(path: Path) -> Path:
    import pyarrow as pa

    table = pa.table({"text": [_words(BIG // 64, seed=i) for i in range(64)]})
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return path


def read_texts(path: Path) -> list[str]:
    from stage1_teacher.corpus import iter_corpus

    return [d.text for d in iter_corpus([str(path)])]


@pytest.mark.parametrize("write", [write_jsonl, write_parquet, write_arrow], ids=["jsonl", "parquet", "arrow"])
def test_same_size_mid_file_edit_changes_the_key(tmp_path, write):
    suffix = {"write_jsonl": ".jsonl", "write_parquet": ".parquet", "write_arrow": ".arrow"}[write.__name__]
    path = write(tmp_path / f"corpus{suffix}")
    assert path.stat().st_size > BIG - (64 << 10)
    before, texts = corpus_fingerprint([path]), read_texts(path)
    edit_middle(path)
    after = read_texts(path)
    assert len(after) == len(texts) and sum(a != b for a, b in zip(after, texts)) == 1  # a real, readable edit
    assert corpus_fingerprint([path]) != before


def test_file_list_edits_change_the_key(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows=8)
    b = tmp_path / "b.jsonl"
    b.write_text('{"text": "one"}\n')
    base = corpus_fingerprint([a, b])
    assert corpus_fingerprint([b, a]) != base  # reordered
    assert corpus_fingerprint([a]) != base  # removed
    c = tmp_path / "c.jsonl"
    c.write_text('{"text": "three"}\n')
    assert corpus_fingerprint([a, b, c]) != base  # added
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_bytes(b.read_bytes())
    assert corpus_fingerprint([a, renamed]) != base  # same bytes, another name: other document ids
    with open(a, "a") as f:
        f.write('{"text": "appended"}\n')
    assert corpus_fingerprint([a, b]) != base  # appended row


def test_digests_read_each_version_once(tmp_path, monkeypatch):
    """Hash cache and recorded digests spare the read; a same-size edit under a restored mtime is
    still seen (ctime changes), and a file hashed within RACY_S of its last change is not cached."""
    monkeypatch.setattr(file_digest, "RACY_S", 0.2)
    path = write_jsonl(tmp_path / "a.jsonl", rows=8)
    size = path.stat().st_size
    hasher = FileHasher()
    racy = hasher.digest(str(path))
    assert hasher.stats.bytes_read == size and racy.validator == {}
    time.sleep(0.3)
    first = hasher.digest(str(path))
    assert hasher.stats.bytes_read == 2 * size and first.validator  # not racy now: cached
    assert hasher.digest(str(path)) == first and hasher.stats.bytes_read == 2 * size
    fresh = FileHasher()  # another process on this machine: the hash cache
    assert fresh.digest(str(path)) == first and fresh.stats.from_cache == 1 and fresh.stats.bytes_read == 0
    no_cache = FileHasher(cache_path=None)  # another machine: the digest recorded in the store
    assert no_cache.digest(str(path), recorded=first) == first and no_cache.stats.bytes_read == 0

    st = path.stat()
    edit_middle(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the edit hides its mtime (rsync -t, cp -p)
    time.sleep(0.3)
    edited = fresh.digest(str(path), recorded=first)
    assert edited.sha256 != first.sha256 and fresh.stats.read == 1


@pytest.fixture(scope="module")
def s3():
    from xtcache.testing.s3 import s3_server

    with s3_server("corpus-key") as server:
        yield server


def test_object_store_edit_changes_the_key_and_etag_spares_the_read(s3, tmp_path):
    options, fs = s3
    local = write_jsonl(tmp_path / "a.jsonl", rows=8)
    url = "s3://corpus-key/a.jsonl"
    fs.pipe(url, local.read_bytes())
    assert corpus_fingerprint([url], options) == corpus_fingerprint([local])  # the same bytes wherever they live

    hasher = FileHasher(options, cache_path=None)
    first = hasher.digest(url)
    assert "ETag" in first.validator and hasher.stats.bytes_read == local.stat().st_size
    again = FileHasher(options, cache_path=None)
    assert again.digest(url, recorded=first) == first and again.stats.bytes_read == 0

    edit_middle(local)
    fs.ls("corpus-key", detail=True)  # this client's cached listing holds the old ETag: not to be trusted
    other_client = type(fs)(**options, skip_instance_cache=True)
    other_client.pipe(url, local.read_bytes())
    edited = again.digest(url, recorded=first)
    assert edited.sha256 != first.sha256 and edited.validator["ETag"] != first.validator["ETag"]
    assert corpus_fingerprint([url], options) == corpus_fingerprint([local])


# ------------------------------------------------------------------------------ end to end (hf engine)


def padded_corpus(toy_setup, path: Path, n_docs: int = 6) -> tuple[Path, int]:
    """`n_docs` held-out documents between 1.2 MiB of skipped rows on each side (> 2 MiB in all);
    returns the path and the offset of the middle document's line."""
    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:n_docs]
    pad = json.dumps({"padding": "x" * (1200 << 10)}) + "\n"  # no text field: a skipped row
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    head = pad + "".join(lines[:n_docs // 2])
    path.write_text(head + "".join(lines[n_docs // 2:]) + pad)
    return path, len(head.encode()) + len('{"text": "')


def dump(teacher, toy_setup, data, **kw):
    values = {"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)],
              "data": [str(d) for d in data], "engine": "hf", "max_seq_len": 128, "window_overlap": 16,
              "docs_per_part": 4, "top_k": 8, **kw}
    return run_teacher_dump(build_config(values), progress=False)


def test_cache_dir_after_a_mid_file_edit_computes_a_new_cache(teacher, toy_setup, tmp_path):
    from stage1_teacher.corpus import Document, iter_corpus
    from xtcache.store import CacheReader

    path, middle = padded_corpus(toy_setup, tmp_path / "docs.jsonl")
    assert path.stat().st_size > 2 << 20
    first = dump(teacher, toy_setup, [path], cache_dir=str(tmp_path / "caches"))
    assert not first.reused and first.documents == 6
    edit_middle(path, middle)
    again = dump(teacher, toy_setup, [path], cache_dir=str(tmp_path / "caches"))
    assert not again.reused and again.store != first.store and again.documents == 6
    stored = sorted(d.content_hash for m in CacheReader(again.store).shards for d in m.docs)
    assert stored == sorted(d.content_hash for d in iter_corpus([str(path)]) if isinstance(d, Document))
    assert stored != sorted(d.content_hash for m in CacheReader(first.store).shards for d in m.docs)


def two_jsonl(toy_setup, root: Path) -> list[Path]:
    texts = [json.loads(line)["text"] for line in open(toy_setup.heldout_jsonl)][:8]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for name, part in (("a.jsonl", texts[:4]), ("b.jsonl", texts[4:])):
        files.append(root / name)
        files[-1].write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return files


def test_one_job_out_store_rerun_after_an_edit_is_refused(teacher, toy_setup, tmp_path):
    out = tmp_path / "store"
    data = two_jsonl(toy_setup, tmp_path / "data")
    assert not dump(teacher, toy_setup, data, out=str(out)).reused
    assert dump(teacher, toy_setup, data, out=str(out)).reused
    edit_middle(data[0])
    for kw in ({}, {"resume": True}):
        with pytest.raises(StoreError, match=r"a\.jsonl: its content changed since writer 0 of --out"):
            dump(teacher, toy_setup, data, out=str(out), **kw)


def test_multi_job_out_store_rerun_after_an_edit_is_refused(teacher, toy_setup, tmp_path):
    out = tmp_path / "store"
    data = two_jsonl(toy_setup, tmp_path / "data")
    for job in (0, 1):
        dump(teacher, toy_setup, data, out=str(out), num_shards=2, shard_index=job)
    again = dump(teacher, toy_setup, data, out=str(out), num_shards=2, shard_index=1)
    assert again.reused  # unchanged: the complete store is reused
    edit_middle(data[1])  # job 1's file, same size
    for kw in ({}, {"resume": True}):
        with pytest.raises(StoreError, match=r"b\.jsonl: its content changed since writer 1 of --out"):
            dump(teacher, toy_setup, data, out=str(out), num_shards=2, shard_index=1, **kw)
    assert dump(teacher, toy_setup, data, out=str(out), num_shards=2, shard_index=0).reused  # job 0's file is unchanged
    with open(data[1], "a") as f:  # an appended row: refused as well
        f.write(json.dumps({"text": "one more row"}) + "\n")
    with pytest.raises(StoreError, match=r"b\.jsonl"):
        dump(teacher, toy_setup, data, out=str(out), num_shards=2, shard_index=1)


def test_cache_key_names_the_capture_engine_its_version_and_tensor_parallel_size(teacher, toy_setup, tmp_path):
    """The first-batch check accepts gaps up to 0.5 nats outside fp32 between these paths: a cache of
    one is not another's."""
    import vllm

    from stage1_teacher.plan import make_plan

    data = two_jsonl(toy_setup, tmp_path / "data")
    base = {"teacher": teacher, "student_tokenizer": [str(toy_setup.student_tokenizer)], "data": [str(data[0])],
            "cache_dir": str(tmp_path / "caches"), "top_k": 8}
    plans = {name: make_plan(build_config({**base, **kw})) for name, kw in {
        "transformers": {"engine": "hf"}, "vllm fast path": {"engine": "vllm"},
        "vllm prompt log-probs": {"engine": "vllm", "fast_path": False},
        "vllm tp 2": {"engine": "vllm", "tensor_parallel_size": 2}}.items()}
    assert len({p.cache_key for p in plans.values()}) == 4
    assert plans["vllm fast path"].settings["capture_engine"] == {
        "engine": "vllm", "path": "hidden states + lm_head", "vllm_version": vllm.__version__, "tensor_parallel_size": 1}
    assert plans["transformers"].settings["capture_engine"]["engine"] == "transformers"


def test_a_parquet_file_split_between_jobs_is_checked_span_by_span(tmp_path, monkeypatch):
    """Two jobs share one Parquet file: their spans cover it once, each reads only its own on a cold
    machine and nothing on a rerun, and after an edit in job 1's span both jobs refuse the store."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stage1_teacher.cache_inputs import file_spans, record_digests, share_digests
    from stage1_teacher.corpus import Corpus
    from stage1_teacher.shard_plan import list_corpus, plan_shards

    monkeypatch.setattr(file_digest, "RACY_S", 0.2)
    path = tmp_path / "split.parquet"
    pq.write_table(pa.table({"text": [_words(4096, seed=i) for i in range(64)]}), path, row_group_size=8,
                   compression="none", use_dictionary=False)
    urls, out = [str(path)], str(tmp_path / "store")
    plan = plan_shards(list_corpus(urls, "text"), 2)
    spans = file_spans(Corpus.resolve(urls), plan, 0)
    size = path.stat().st_size
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == size and 0 < spans[1][0] < size
    time.sleep(0.3)

    def check(job):
        return share_digests(urls, plan, job, out, storage_options=None, store_options=None,
                             hasher=FileHasher(cache_path=None))

    for job in (0, 1):
        share = check(job)
        assert share.stats.bytes_read == spans[job][1] - spans[job][0]  # its own share, once
        record_digests(out, share, plan.fingerprint, None)
    assert check(0).stats.bytes_read == check(1).stats.bytes_read == 0  # validators unchanged: nothing read
    edit_middle(path, spans[1][0] + 100)
    for job in (1, 0):  # job 0's own bytes are unchanged, but job 1's recorded span is not
        with pytest.raises(StoreError, match=r"split\.parquet: its content changed since writer 1 of --out .* \(bytes"):
            check(job)
