"""Round trips and error paths of the Zarr teacher-cache store (xtcache.store), local and memory://.

    .venv/bin/python -m pytest -q tests/test_store.py
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.models import FORMAT_VERSION, AlignGroupMeta, Manifest
from xtcache.errors import CorruptionError, FormatVersionError, StoreError, XtcacheError
from xtcache.store import (
    AlignmentRecord,
    CacheReader,
    CacheWriter,
    DocRecord,
    cache_path_for,
    find_cache,
    list_caches,
    shard_id,
)
from xtcache.store.codecs import FloatLogProbs, QuantizedLogProbs, SortedDeltaIds, SqrtProbs


@dataclass(frozen=True)
class _Align:  # the fields of xtcache.align.chunks.Alignment that the store reads
    student_end: np.ndarray
    teacher_end: np.ndarray
    exact: np.ndarray


def make_doc(rng, row: int, T: int, k: int, V: int, mode: str = "topk") -> DocRecord:
    """A document with random but valid teacher data; T may be 0."""
    has_pred = np.ones(T, dtype=bool)
    if T:
        has_pred[0] = False
    if mode == "full":
        ids = np.stack([rng.permutation(V) for _ in range(T)]).astype(np.int32) if T else np.zeros((0, V), np.int32)
    else:
        ids = (np.stack([rng.choice(V, k, replace=False) for _ in range(T)]).astype(np.int32)
               if T else np.zeros((0, k), np.int32))
    width = ids.shape[1]
    probs = rng.dirichlet(np.full(width + 1, 0.3), size=T) if T else np.zeros((0, width + 1))
    if mode == "full":
        probs[:, :width] += probs[:, width:] / width
        probs[:, width] = 0
    logprobs = np.log(np.maximum(probs[:, :width], 1e-30)).astype(np.float32)
    counts = None
    if mode == "sampled":
        counts = rng.integers(0, 5, size=(T, k)).astype(np.uint16)
        logprobs = None
    text = "".join(chr(0x41 + int(c)) for c in rng.integers(0, 40, size=T)) + "é"
    return DocRecord(
        source="corpus.jsonl", row=row, text=text, teacher_ids=rng.integers(0, V, T).astype(np.int32),
        char_offsets=np.stack([np.arange(T), np.arange(T) + 1], axis=1).astype(np.int32) if T else np.zeros((0, 2), np.int32),
        has_pred=has_pred, topk_ids=ids, topk_logprobs=logprobs, topk_counts=counts,
        residual=probs[:, width].astype(np.float32),
        realized_logprob=np.where(has_pred, -1.5, np.nan).astype(np.float32))


def make_alignment(rng, T: int) -> AlignmentRecord:
    """Random chunking of T teacher tokens against a random number of student tokens."""
    if T == 0:
        return AlignmentRecord(np.zeros(0, np.int32), _Align(np.zeros(0, np.int32), np.zeros(0, np.int32),
                                                              np.zeros(0, bool)))
    t_end = np.unique(np.concatenate([rng.integers(1, T + 1, size=max(1, T // 2)), [T]])).astype(np.int32)
    s_len = rng.integers(1, 3, size=len(t_end))
    s_end = np.cumsum(s_len).astype(np.int32)
    return AlignmentRecord(rng.integers(0, 500, s_end[-1]).astype(np.int32),
                           _Align(s_end, t_end, rng.random(len(t_end)) < 0.9))


def manifest(mode="topk", k=8, V=70_000, **kw) -> Manifest:
    return Manifest(cache_key=kw.pop("cache_key", "key-a"), mode=mode, k=k, teacher_vocab_size=V, **kw)


def check_same(doc: DocRecord, got: DocRecord, mode: str, tol: float, floor: float = -24.0, sqrt: bool = False) -> None:
    """`got` equals `doc`, with stored log-probs within `tol` of the originals clamped at `floor` (`sqrt`: their
    sqrt(p) within `tol`, the sqrt-prob code of format version 3) and float16 side arrays within 2^-11."""
    assert got.text == doc.text and got.doc_id == doc.doc_id
    np.testing.assert_array_equal(got.teacher_ids, doc.teacher_ids)
    np.testing.assert_array_equal(got.char_offsets, doc.char_offsets)
    np.testing.assert_array_equal(got.has_pred, doc.has_pred)
    np.testing.assert_allclose(got.residual, doc.residual, rtol=2.0**-11, atol=2.0**-25)
    np.testing.assert_allclose(got.realized_logprob, doc.realized_logprob, rtol=2.0**-11)
    hp = doc.has_pred
    if mode == "sampled":
        for t in np.flatnonzero(hp):
            want = {int(i): int(c) for i, c in zip(doc.topk_ids[t], doc.topk_counts[t]) if c > 0}
            have = {int(i): int(c) for i, c in zip(got.topk_ids[t], got.topk_counts[t]) if c > 0}
            assert have == want
        return
    order = np.argsort(doc.topk_ids, axis=1, kind="stable")
    by_id = np.argsort(got.topk_ids, axis=1, kind="stable")  # stored rows by id (dictionary codes: another order)
    np.testing.assert_array_equal(np.take_along_axis(got.topk_ids, by_id, 1)[hp],
                                  np.take_along_axis(doc.topk_ids, order, 1)[hp])
    want_lp = np.take_along_axis(doc.topk_logprobs, order, 1)[hp]
    have_lp = np.take_along_axis(got.topk_logprobs, by_id, 1)[hp]
    if sqrt:
        assert np.abs(np.exp(have_lp / 2.0) - np.exp(want_lp / 2.0)).max(initial=0) <= tol
        return
    if tol > 0:
        want_lp = np.maximum(want_lp, floor)
    assert np.abs(have_lp - want_lp).max(initial=0) <= tol


@pytest.mark.parametrize("mode,k,V", [("topk", 8, 70_000), ("full", 300, 300), ("sampled", 6, 262_144), ("sampled", 5, 65_536),
                                      ("topk", 4, 1000)])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_round_trip_every_mode(tmp_path, mode, k, V, where):
    rng = np.random.default_rng(1)
    url = str(tmp_path / "cache") if where == "local" else f"memory://rt-{mode}-{k}-{V}"
    docs = [make_doc(rng, i, T, k, V, mode) for i, T in enumerate([0, 1, 7, 33])]
    with CacheWriter(url, manifest(mode, k, V)) as w:
        meta = w.write_part(0, docs[:2])
        w.write_part(1, docs[2:])
    reader = CacheReader(url)
    assert [s.shard_id for s in reader.shards] == [shard_id(0, 0), shard_id(0, 1)]
    assert meta.num_docs == 2 and meta.num_positions == 1 and meta.num_predicted == 0
    got = [reader.read_shard(s.shard_id, verify=True) for s in reader.shards]
    records = [g.doc(i) for g in got for i in range(g.num_docs)]
    for doc, rec in zip(docs, records, strict=True):
        sqrt = mode == "topk"  # full mode keeps 8-bit log-probs (xtcache.store.codecs.default_codecs)
        check_same(doc, rec, mode, tol=SqrtProbs(127).max_sqrt_error + 1e-6 if sqrt else 24.0 / 255 / 2 + 1e-6, sqrt=sqrt)
    assert not reader.is_complete()


def test_alignment_groups_written_with_parts_and_added_later(tmp_path):
    rng = np.random.default_rng(2)
    url = str(tmp_path / "cache")
    g1 = AlignGroupMeta(fingerprint="f" * 64, tokenizer_name="student-a", vocab_size=500)
    docs = [make_doc(rng, i, T, 8, 5000) for i, T in enumerate([3, 0, 12])]
    al1 = [make_alignment(rng, len(d.teacher_ids)) for d in docs]
    w = CacheWriter(url, manifest(V=5000, alignment_groups=[g1]))
    w.write_part(0, docs, {g1.fingerprint: al1})
    w.finish({"docs": 3})
    teacher_files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache" / "shards").rglob("*"))

    g2 = AlignGroupMeta(fingerprint="e" * 64, tokenizer_name="student-b", vocab_size=700)
    al2 = [make_alignment(rng, len(d.teacher_ids)) for d in docs]
    with CacheWriter(url, manifest(V=5000)) as w2:
        w2.add_alignment_group(g2, shard_id(0, 0), al2)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "cache" / "shards").rglob("*")) == teacher_files

    reader = CacheReader(url)
    groups = reader.alignment_groups()
    assert set(groups) == {g1.fingerprint, g2.fingerprint}
    assert groups[g2.fingerprint].tokenizer_name == "student-b"
    for fp, al in ((g1.fingerprint, al1), (g2.fingerprint, al2)):
        data = reader.read_alignment(fp, shard_id(0, 0), verify=True)
        assert groups[fp].stats["chunks"] == len(data.exact) == sum(len(a.alignment.exact) for a in al)
        for i, a in enumerate(al):
            s0, s1 = data.doc_student_offsets[i], data.doc_student_offsets[i + 1]
            c0, c1 = data.doc_chunk_offsets[i], data.doc_chunk_offsets[i + 1]
            np.testing.assert_array_equal(data.student_ids[s0:s1], a.student_ids)
            np.testing.assert_array_equal(data.student_end[c0:c1], a.alignment.student_end)
            np.testing.assert_array_equal(data.teacher_end[c0:c1], a.alignment.teacher_end)
            np.testing.assert_array_equal(data.exact[c0:c1], a.alignment.exact)
    assert reader.is_complete()


def test_alignment_must_cover_the_teacher_tokens(tmp_path):
    rng = np.random.default_rng(3)
    g = AlignGroupMeta(fingerprint="a" * 64, vocab_size=500)
    docs = [make_doc(rng, 0, 5, 8, 5000)]
    bad = make_alignment(rng, 4)
    with CacheWriter(str(tmp_path / "c"), manifest(V=5000, alignment_groups=[g])) as w:
        with pytest.raises(XtcacheError, match="ends at teacher token 4, the document has 5"):
            w.write_part(0, docs, {g.fingerprint: [bad]})


def test_claims_resume_and_cache_key(tmp_path):
    url = str(tmp_path / "cache")
    w = CacheWriter(url, manifest(num_writers=2), writer_index=1)
    with pytest.raises(StoreError, match="writer 1 .* is claimed by pid"):
        CacheWriter(url, manifest(num_writers=2), writer_index=1)
    CacheWriter(url, manifest(num_writers=2), writer_index=1, resume=True).close()
    w.close()
    CacheWriter(url, manifest(num_writers=2), writer_index=0).close()
    with pytest.raises(StoreError, match="writer index 2 is outside"):
        CacheWriter(url, manifest(num_writers=2), writer_index=2)
    with pytest.raises(StoreError, match="written for another teacher/corpus/settings: cache key key-a != key-b"):
        CacheWriter(url, manifest(cache_key="key-b"))


def test_resume_refuses_to_take_over_a_live_writer(tmp_path):
    import json
    import socket
    import subprocess

    url = str(tmp_path / "cache")
    CacheWriter(url, manifest()).close()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        claim = tmp_path / "cache" / "claims" / "w00000.json"  # as a running job leaves it
        claim.parent.mkdir(exist_ok=True)
        claim.write_text(json.dumps({"format_version": 1, "writer_index": 0, "pid": alive.pid,
                                     "host": socket.gethostname(), "time": "2026-01-01T00:00:00Z"}))
        with pytest.raises(StoreError, match="still running"):
            CacheWriter(url, manifest(), resume=True)
    finally:
        alive.kill()
        alive.wait()
    CacheWriter(url, manifest(), resume=True).close()  # the holder died: --resume takes over


def test_rewrite_of_a_part_is_deterministic(tmp_path):
    rng = np.random.default_rng(4)
    url = str(tmp_path / "cache")
    docs = [make_doc(rng, i, 9, 8, 5000) for i in range(3)]
    with CacheWriter(url, manifest(V=5000)) as w:
        first = w.write_part(0, docs)
    with CacheWriter(url, manifest(V=5000)) as w:
        assert [m.shard_id for m in w.committed_parts()] == [first.shard_id]
        second = w.write_part(0, docs)
    assert {n: a.sha256 for n, a in first.arrays.items()} == {n: a.sha256 for n, a in second.arrays.items()}
    assert len(CacheReader(url).shards) == 1


def _two_one_doc_parts(tmp_path, seed: int, *, finish: bool = False) -> str:
    """A store with parts 0 and 1 of writer 0, one document each (and its done marker if `finish`)."""
    rng = np.random.default_rng(seed)
    url = str(tmp_path / "cache")
    with CacheWriter(url, manifest(V=5000)) as w:
        w.write_part(0, [make_doc(rng, 0, 4, 8, 5000)])
        w.write_part(1, [make_doc(rng, 1, 4, 8, 5000)])
        if finish:
            w.finish({})
    return url


def test_uncommitted_part_is_invisible(tmp_path):
    url = _two_one_doc_parts(tmp_path, 5)
    os.remove(tmp_path / "cache" / "index" / f"{shard_id(0, 1)}.json")  # as if killed before the commit
    reader = CacheReader(url)
    assert [s.shard_id for s in reader.shards] == [shard_id(0, 0)]


def test_bad_inputs_raise_xtcache_errors(tmp_path):
    rng = np.random.default_rng(6)
    with pytest.raises(ValueError, match="--top-k 9 is larger than the teacher vocabulary"):
        manifest(k=9, V=8)
    for mode, k in (("full", 8), ("sampled", 11)):
        with pytest.raises(ValueError, match=f"mode {mode}: k={k} does not fit the teacher vocabulary 10"):
            manifest(mode=mode, k=k, V=10)
    doc = make_doc(rng, 0, 5, 8, 5000)
    doc.topk_ids[2, 3] = 5000
    with CacheWriter(str(tmp_path / "c"), manifest(V=5000)) as w:
        with pytest.raises(XtcacheError, match="id 5000 is outside the teacher vocabulary"):
            w.write_part(0, [doc])
        doc.topk_ids[2, 3] = -1
        with pytest.raises(XtcacheError, match="id -1 is outside"):
            w.write_part(0, [doc])
        wide = make_doc(rng, 1, 5, 9, 5000)
        with pytest.raises(XtcacheError, match="top-k width 9 != k=8"):
            w.write_part(0, [wide])


def test_not_a_store_and_newer_version(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreError, match="is not an xtcache store"):
        CacheReader(str(tmp_path / "plain"))
    url = str(tmp_path / "cache")
    rng = np.random.default_rng(7)
    with CacheWriter(url, manifest(V=5000)) as w:
        w.write_part(0, [make_doc(rng, 0, 4, 8, 5000)])
    index = tmp_path / "cache" / "index" / f"{shard_id(0, 0)}.json"
    meta = json.loads(index.read_text())
    meta["format_version"] = FORMAT_VERSION + 1
    index.write_text(json.dumps(meta))
    with pytest.raises(FormatVersionError, match=f"teacher part w00000-p000000 .* reads format version {FORMAT_VERSION}"):
        CacheReader(url)
    man = tmp_path / "cache" / "manifest.json"
    raw = json.loads(man.read_text())
    raw["format_version"] = FORMAT_VERSION + 1
    man.write_text(json.dumps(raw))
    with pytest.raises(FormatVersionError, match=f"format version {FORMAT_VERSION + 1}"):
        CacheReader(url)


def test_corrupted_chunk_names_shard_and_array(tmp_path):
    rng = np.random.default_rng(8)
    url = str(tmp_path / "cache")
    with CacheWriter(url, manifest(V=70_000)) as w:
        w.write_part(0, [make_doc(rng, 0, 200, 8, 70_000)])
    chunk = next(p for p in (tmp_path / "cache" / "shards" / shard_id(0, 0) / "topk_logprobs" / "c").rglob("*")
                 if p.is_file())
    data = bytearray(chunk.read_bytes())
    for i in range(40, 60):
        data[i] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match=r"teacher part w00000-p000000: array .topk_logprobs."):
        CacheReader(url).read_shard(shard_id(0, 0), verify=True)


def test_finished_store_missing_a_counted_part_is_incomplete_and_fails_verify(tmp_path):
    from xtcache.app.store_commands import verify_store

    url = _two_one_doc_parts(tmp_path, 6, finish=True)
    assert CacheReader(url).is_complete() and verify_store(url) == []
    os.remove(tmp_path / "cache" / "index" / f"{shard_id(0, 1)}.json")  # an index lost after the job finished
    assert not CacheReader(url).is_complete()
    (problem,) = verify_store(url)
    assert "writer 0" in problem and "finished with 2 parts but only 1" in problem


def test_cache_dir_helpers(tmp_path):
    rng = np.random.default_rng(9)
    cache_dir = str(tmp_path / "caches")
    key = "0123456789abcdef" * 4
    url = cache_path_for(cache_dir, key)
    assert find_cache(cache_dir, key) is None
    w = CacheWriter(url, manifest(V=5000, cache_key=key))
    w.write_part(0, [make_doc(rng, 0, 6, 8, 5000)])
    assert find_cache(cache_dir, key) is None  # not finished yet
    w.finish({"documents": 1})
    assert find_cache(cache_dir, key) == url
    (infos,) = list_caches(cache_dir)
    assert (infos.key, infos.documents, infos.positions, infos.complete) == (key, 1, 6, True)
    assert infos.size > 0 and infos.url == url


def test_inspect_verify_and_cache_ls_commands(tmp_path):
    from tests.commands import xtcache

    rng = np.random.default_rng(10)
    cache_dir = tmp_path / "caches"
    url = cache_path_for(str(cache_dir), "k" * 64)
    g = AlignGroupMeta(fingerprint="b" * 64, tokenizer_name="student", vocab_size=500)
    docs = [make_doc(rng, i, T, 8, 70_000) for i, T in enumerate([0, 1, 40, 60])]
    w = CacheWriter(url, manifest(cache_key="k" * 64, alignment_groups=[g], fingerprints={"corpus": "c" * 64}))
    w.write_part(0, docs[:2], {g.fingerprint: [make_alignment(rng, len(d.teacher_ids)) for d in docs[:2]]})
    w.write_part(1, docs[2:], {g.fingerprint: [make_alignment(rng, len(d.teacher_ids)) for d in docs[2:]]})
    # a store still being written: its committed parts check out, yet it is no store to train on
    running = xtcache("verify", url)
    assert running.returncode == 1 and "1 of 1 writer(s) have not finished" in running.stderr, running.stderr
    assert "--allow-incomplete" in running.stderr
    partial = xtcache("verify", url, "--allow-incomplete")
    assert partial.returncode == 0 and "OK (2 shards, 101 positions, incomplete)" in partial.stdout, partial.stdout
    w.finish()
    out = xtcache("inspect", url)
    assert out.returncode == 0, out.stdout + out.stderr
    for needle in ("teacher positions 101", "documents       4", "topk_ids", "B/position", "x smaller",
                   "mean top-k mass", "student", "1:1", f"format version  {FORMAT_VERSION}", "corpus", "shards 2"):
        assert needle in out.stdout, (needle, out.stdout)
    # bytes/position (inspect's and the demo's): every byte of the store over its teacher positions
    from xtcache.app.store_commands import store_summary

    on_disk = sum(f.stat().st_size for f in Path(url).rglob("*") if f.is_file())
    assert store_summary(url).bytes_per_position == on_disk / 101
    assert f"{on_disk / 101:.1f} B/position (every file of the store" in out.stdout, out.stdout

    ok = xtcache("verify", url)
    assert ok.returncode == 0 and "OK (2 shards, 101 positions, complete)" in ok.stdout, ok.stdout + ok.stderr

    ls = xtcache("cache", "ls", "--cache-dir", cache_dir)
    assert ls.returncode == 0 and "k" * 16 in ls.stdout and "yes" in ls.stdout, ls.stdout + ls.stderr

    # damage one array of each part: --all names both, the default stops at the first
    for sid, name in ((shard_id(0, 0), "residual"), (shard_id(0, 1), "topk_ids")):
        chunk = next(p for p in (Path(url) / "shards" / sid / name / "c").rglob("*") if p.is_file())
        data = bytearray(chunk.read_bytes())
        data[len(data) // 3] ^= 0x55
        chunk.write_bytes(bytes(data))
    bad = xtcache("verify", url)
    assert bad.returncode == 1
    assert "teacher part w00000-p000000: array 'residual'" in bad.stderr
    assert "topk_ids" not in bad.stdout + bad.stderr
    every = xtcache("verify", url, "--all")
    assert every.returncode == 1
    assert "teacher part w00000-p000000: array 'residual'" in every.stderr
    assert "teacher part w00000-p000001: array 'topk_ids'" in every.stderr


def test_verify_reports_newer_shard_version(tmp_path):
    from xtcache.app.store_commands import verify_store

    rng = np.random.default_rng(11)
    url = str(tmp_path / "cache")
    with CacheWriter(url, manifest(V=5000)) as w:
        w.write_part(0, [make_doc(rng, 0, 3, 8, 5000)])
    index = tmp_path / "cache" / "index" / f"{shard_id(0, 0)}.json"
    raw = json.loads(index.read_text())
    raw["format_version"] = 7
    index.write_text(json.dumps(raw))
    (problem,) = verify_store(url)
    assert "teacher part w00000-p000000 has format version 7" in problem
    (problem,) = verify_store(str(tmp_path))
    assert problem.startswith(f"{tmp_path} is not an xtcache store (no manifest.json)")


def test_json_schema_files_match_the_models():
    from schemas import export

    for name, text in export.render().items():
        path = Path(export.HERE) / name
        assert path.read_text(encoding="utf-8") == text, f"{name} is stale: run `python -m schemas.export`"


def test_s3_round_trip_through_moto(monkeypatch):
    """s3:// through s3fs against a local moto S3 server; storage_options pass through unchanged."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_mod.ThreadedMotoServer(port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.setenv(var, "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        import s3fs

        options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
        s3fs.S3FileSystem(**options).mkdir("xtcache-test")
        rng = np.random.default_rng(12)
        docs = [make_doc(rng, i, T, 8, 70_000) for i, T in enumerate([0, 5, 30])]
        url = "s3://xtcache-test/cache"
        w = CacheWriter(url, manifest(), storage_options=options)
        w.write_part(0, docs)
        with pytest.raises(StoreError, match="is claimed by pid"):
            CacheWriter(url, manifest(), storage_options=options)
        w.finish()
        reader = CacheReader(url, storage_options=options)
        assert reader.is_complete()
        got = reader.read_shard(shard_id(0, 0), verify=True)
        for i, doc in enumerate(docs):
            check_same(doc, got.doc(i), "topk", tol=SqrtProbs(127).max_sqrt_error + 1e-6, sqrt=True)
        from xtcache.app.store_commands import verify_store

        assert verify_store(url, options) == []
    finally:
        server.stop()


def test_xtcache_verify_exit_status(tmp_path):
    """Through the real `xtcache` entry point: 0 for a good store, non-zero naming the problem otherwise."""
    from tests.commands import xtcache

    rng = np.random.default_rng(13)
    url = str(tmp_path / "cache")
    with CacheWriter(url, manifest(V=5000)) as w:
        w.write_part(0, [make_doc(rng, 0, 30, 8, 5000)])
        w.finish()

    good = xtcache("verify", url)
    assert good.returncode == 0, good.stderr
    chunk = next(p for p in (tmp_path / "cache" / "shards" / shard_id(0, 0) / "char_offsets" / "c").rglob("*")
                 if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:-7] + b"garbage")
    bad = xtcache("verify", url)
    assert bad.returncode != 0
    assert "teacher part w00000-p000000: array 'char_offsets'" in bad.stderr


@st.composite
def store_cases(draw):
    """Mode, k, vocab (up to 262,144), log-prob codec and document lengths (0 and 1 included)."""
    mode = draw(st.sampled_from(["topk", "full", "sampled"]))
    if mode == "full":
        vocab = draw(st.integers(1, 40))
        k = vocab
    else:
        vocab = draw(st.sampled_from([2, 50, 65_536, 65_537, 151_936, 262_144]))
        k = draw(st.integers(1, min(vocab, 16)))
    lp_codec = draw(st.sampled_from([QuantizedLogProbs(8, -24.0), QuantizedLogProbs(16, -30.0),
                                     FloatLogProbs("float16"), FloatLogProbs("float32")]))
    lengths = draw(st.lists(st.sampled_from([0, 1, 2, 5, 17]), min_size=0, max_size=5))
    return mode, k, vocab, lp_codec, lengths, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=25, deadline=None)
@given(store_cases())
def test_store_round_trip_property(case):
    mode, k, vocab, lp_codec, lengths, seed = case
    rng = np.random.default_rng(seed)
    docs = [make_doc(rng, i, T, k, vocab, mode) for i, T in enumerate(lengths)]
    codecs_cfg = {} if mode == "sampled" else {
        "topk_ids": SortedDeltaIds("uint16" if vocab <= 65_536 else "uint32").to_config(),
        "topk_logprobs": lp_codec.to_config()}
    url = f"memory://prop-{seed}-{mode}-{k}-{vocab}"
    with CacheWriter(url, manifest(mode, k, vocab, codecs=codecs_cfg)) as w:
        w.write_part(3, docs)
    reader = CacheReader(url)
    got = reader.read_shard(shard_id(0, 3), verify=True)
    assert got.num_docs == len(docs) and got.doc_ids() == [d.doc_id for d in docs]
    if isinstance(lp_codec, QuantizedLogProbs):
        tol = lp_codec.max_abs_error * (1 + 1e-5) + 1e-6
        floor = lp_codec.min_logprob
    else:
        tol, floor = (0.0, -np.inf) if lp_codec.dtype == "float32" else (None, -np.inf)
    for i, doc in enumerate(docs):
        if mode == "sampled":
            check_same(doc, got.doc(i), mode, tol=0)
            continue
        if tol is None:  # float16: relative error bound
            rec = got.doc(i)
            hp = doc.has_pred
            order = np.argsort(doc.topk_ids, axis=1, kind="stable")
            want = np.take_along_axis(doc.topk_logprobs, order, 1)[hp]
            np.testing.assert_allclose(rec.topk_logprobs[hp], want, rtol=2 ** -11, atol=1e-7)
            continue
        doc_clamped = DocRecord(**{**doc.__dict__, "topk_logprobs": np.maximum(doc.topk_logprobs, floor)})
        check_same(doc_clamped, got.doc(i), mode, tol=tol, floor=floor)


def test_later_writer_declares_a_new_group(tmp_path):
    rng = np.random.default_rng(14)
    url = str(tmp_path / "cache")
    g1 = AlignGroupMeta(fingerprint="1" * 64, vocab_size=500)
    g2 = AlignGroupMeta(fingerprint="2" * 64, vocab_size=600)
    docs = [make_doc(rng, 0, 6, 8, 5000)]
    with CacheWriter(url, manifest(V=5000, num_writers=2, alignment_groups=[g1]), writer_index=0) as w:
        w.write_part(0, docs, {g1.fingerprint: [make_alignment(rng, 6)]})
    with CacheWriter(url, manifest(V=5000, num_writers=2, alignment_groups=[g1, g2]), writer_index=1) as w:
        w.write_part(0, docs, {g.fingerprint: [make_alignment(rng, 6)] for g in (g1, g2)})
        with pytest.raises(XtcacheError, match="alignment group 333333333333.. is not declared"):
            w.write_part(1, docs, {"3" * 64: [make_alignment(rng, 6)]})
    reader = CacheReader(url)
    assert set(reader.alignment_groups()) == {g1.fingerprint, g2.fingerprint}
    assert set(reader.alignment_parts(g2.fingerprint)) == {shard_id(1, 0)}
    assert set(reader.alignment_parts(g1.fingerprint)) == {shard_id(0, 0), shard_id(1, 0)}


def test_an_all_zero_array_has_its_object_so_losing_it_is_reported_missing(tmp_path):
    rng = np.random.default_rng(21)
    url = str(tmp_path / "cache")
    doc = make_doc(rng, 0, 50, 4, 100)
    doc.residual = np.zeros(50, np.float32)  # every value the fill value
    with CacheWriter(url, manifest(V=100, k=4)) as w:
        w.write_part(0, [doc])
    obj = tmp_path / "cache" / "shards" / shard_id(0, 0) / "residual" / "c" / "0"
    assert obj.is_file()
    assert np.array_equal(CacheReader(url).read_shard(shard_id(0, 0)).residual, doc.residual)
    obj.unlink()
    with pytest.raises(CorruptionError, match=r"teacher part w00000-p000000: array 'residual' is missing \(no object"):
        CacheReader(url).read_shard(shard_id(0, 0))
