"""Stores of format versions 1 (before conversations), 2 (before codec v2) and 3 (before dictionary coded
ids) still read and verify, keep their version when extended, and this writer writes every version it reads.

`tests/fixtures/store_v1` was written by the xtcache of format version 1 (commit 39ac103) with
`tests/fixtures/make_store_v1.py`:

    git archive 39ac103 | tar -x -C /tmp/old && cd /tmp/old && \
        PYTHONPATH=. python $REPO/tests/fixtures/make_store_v1.py $REPO/tests/fixtures/store_v1

`tests/fixtures/store_v2` (8-bit log-prob codes, float32 side arrays, ids above 16 bits) was written
by the xtcache of format version 2 (commit 87f80aa) with `tests/fixtures/make_store_v2.py`, which also
saved the values it wrote as `tests/fixtures/store_v2_source.npz`:

    git archive 87f80aa | tar -x -C /tmp/old && cd /tmp/old && \
        PYTHONPATH=. python $REPO/tests/fixtures/make_store_v2.py $REPO/tests/fixtures/store_v2

`tests/fixtures/store_v3` (sqrt-prob codes, float16 side arrays, ids sorted by id, above 16 bits) was
written by the xtcache of format version 3 (commit 370e2f4) with `tests/fixtures/make_store_v3.py`, which
saved the values it wrote as `tests/fixtures/store_v3_source.npz`:

    git archive 370e2f4 | tar -x -C /tmp/old && cd /tmp/old && \
        PYTHONPATH=. python $REPO/tests/fixtures/make_store_v3.py $REPO/tests/fixtures/store_v3
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from schemas.models import FORMAT_VERSION, AlignGroupMeta
from xtcache.align.chunks import identity_alignment
from xtcache.errors import FormatVersionError
from xtcache.store import AlignmentRecord, CacheReader, CacheWriter

V1 = Path(__file__).resolve().parent / "fixtures" / "store_v1"
V2 = Path(__file__).resolve().parent / "fixtures" / "store_v2"
V3 = Path(__file__).resolve().parent / "fixtures" / "store_v3"


def test_a_version_1_store_reads_and_verifies():
    from xtcache.app.store_commands import store_summary, verify_store

    assert FORMAT_VERSION == 4
    r = CacheReader(str(V1))
    assert r.manifest.format_version == 1 and not r.manifest.conversation and r.is_complete()
    shard = r.read_shard(r.shards[0].shard_id, verify=True)
    assert shard.texts == ["hello world", "a second document"] and shard.conversations is None
    al = r.read_alignment("a" * 64, r.shards[0].shard_id, verify=True)
    assert al.student_role is None and al.student_ids.shape[0] == 5
    assert verify_store(str(V1)) == []
    assert store_summary(str(V1)).conversation == {}


def test_a_group_added_to_a_version_1_store_keeps_version_1(tmp_path):
    store = tmp_path / "v1"
    shutil.copytree(V1, store)
    r = CacheReader(str(store))
    sid = r.shards[0].shard_id
    group = AlignGroupMeta(fingerprint="c" * 64, tokenizer_name="added", vocab_size=50, identity=True)
    with CacheWriter(str(store), r.manifest) as w:
        lengths = np.diff(r.doc_pos_offsets(sid))
        w.add_alignment_group(group, sid, [AlignmentRecord(student_ids=np.zeros(int(n), np.int32),
                                                           alignment=identity_alignment(int(n))) for n in lengths])
    r = CacheReader(str(store))
    assert r.alignment_groups()["c" * 64].format_version == 1
    assert r.alignment_parts("c" * 64)[sid].format_version == 1
    assert r.read_alignment("c" * 64, sid, verify=True).student_ids.shape[0] == 5
    assert r.manifest.format_version == 1


def test_conversations_need_version_2(tmp_path):
    m = CacheReader(str(V1)).manifest.model_copy(update={"conversation": True})
    with pytest.raises(FormatVersionError, match="cannot write format version 1 with conversations"):
        CacheWriter(str(tmp_path / "x"), m)


def _sorted_source(store: Path, shard) -> tuple:
    """(source arrays, top-k ids and log-probs sorted by id) of a fixture store's two documents, and checks that
    the part holds those ids, sorted, at every predicted position (ids above 16 bits among them)."""
    src = np.load(store.parent / f"{store.name}_source.npz")
    ids = np.concatenate([src["topk_ids0"], src["topk_ids1"]])
    lp = np.concatenate([src["topk_logprobs0"], src["topk_logprobs1"]])
    assert ids.max() >= 65_536  # uint32 deltas
    order = np.argsort(ids, axis=1)
    ids, lp = np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)
    np.testing.assert_array_equal(shard.topk_ids[shard.has_pred], ids[shard.has_pred])
    return src, ids, lp


def test_a_version_2_store_reads_and_verifies_with_its_own_codecs():
    from xtcache.app.store_commands import verify_store
    from xtcache.store import codecs

    r = CacheReader(str(V2))
    assert r.manifest.format_version == 2 and r.is_complete()
    assert r.manifest.codecs["topk_logprobs"].name == codecs.QUANT_NAME
    shard = r.read_shard(r.shards[0].shard_id, verify=True)
    src, _, lp = _sorted_source(V2, shard)
    q8 = codecs.QuantizedLogProbs(8, -24.0)
    err = np.abs(shard.topk_logprobs - lp)[shard.has_pred]
    assert err.max() <= q8.max_abs_error + 1e-5
    assert shard.residual.dtype == np.float32 and shard.realized_logprob.dtype == np.float32
    np.testing.assert_array_equal(shard.residual, np.concatenate([src["residual0"], src["residual1"]]))
    assert verify_store(str(V2)) == []


def test_a_version_3_store_reads_and_verifies_with_ids_sorted_by_id():
    from xtcache.app.store_commands import verify_store
    from xtcache.store import codecs

    r = CacheReader(str(V3))
    assert r.manifest.format_version == 3 and r.is_complete()
    assert r.manifest.codecs["topk_ids"].name == codecs.IDS_NAME
    assert r.manifest.codecs["topk_logprobs"].name == codecs.SQRT_NAME
    assert "topk_id_dict" not in r.shards[0].arrays
    shard = r.read_shard(r.shards[0].shard_id, verify=True)
    src, _, lp = _sorted_source(V3, shard)
    has = shard.has_pred
    want = np.exp(0.5 * lp[has].astype(np.float64))
    assert np.abs(np.exp(0.5 * shard.topk_logprobs[has].astype(np.float64)) - want).max() <= 0.5 / 127 + 1e-6
    np.testing.assert_allclose(shard.residual, np.concatenate([src["residual0"], src["residual1"]]), rtol=2.0**-11)
    assert verify_store(str(V3)) == []


@pytest.mark.parametrize("store, version, arrays", [
    (V2, 2, {"residual": ("float32", None), "topk_logprobs": (None, "xtcache.quantized_logprobs")}),
    (V3, 3, {"topk_ids": (None, "xtcache.sorted_delta_ids")}),
], ids=["v2", "v3"])
def test_a_writer_resuming_an_older_store_writes_parts_of_its_version(tmp_path, store, version, arrays):
    """arrays: name -> (stored dtype, transform name) the resumed part must have (None: not checked)."""
    copy = tmp_path / store.name
    shutil.copytree(store, copy)
    r = CacheReader(str(copy))
    shard = r.read_shard(r.shards[0].shard_id)
    with CacheWriter(str(copy), r.manifest, resume=True) as w:
        meta = w.write_part(1, [_record_from(shard)])
    assert meta.format_version == version and "topk_id_dict" not in meta.arrays
    for name, (dtype, transform) in arrays.items():
        assert dtype is None or meta.arrays[name].dtype == dtype
        assert transform is None or meta.arrays[name].transform.name == transform
    assert CacheReader(str(copy)).read_shard(meta.shard_id, verify=True).texts == [shard.texts[0]]


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_this_writer_writes_and_reads_every_version(tmp_path, version):
    """A store of each version this xtcache reads, written with that version's default codecs: its manifest,
    part index and done marker carry the version, its arrays are that version's, and it reads back exactly."""
    from schemas.models import Manifest
    from xtcache.app.store_commands import verify_store
    from xtcache.store import DocRecord, codecs

    rng = np.random.default_rng(version)
    T, k, V = 40, 8, 70_000
    ids = np.stack([rng.choice(V, k, replace=False) for _ in range(T)]).astype(np.int32)
    lp = np.log(rng.dirichlet(np.full(k + 1, 0.5), T)[:, :k]).astype(np.float32)
    has = np.arange(T) > 0
    doc = DocRecord(source="s", row=0, text="x" * T, teacher_ids=rng.integers(0, V, T).astype(np.int32),
                    char_offsets=np.stack([np.arange(T), np.arange(T) + 1], 1).astype(np.int32), has_pred=has,
                    topk_ids=ids, topk_logprobs=lp, topk_counts=None,
                    residual=(1 - np.exp(lp.astype(np.float64)).sum(1)).astype(np.float32),
                    realized_logprob=np.where(has, lp[:, 0], np.nan).astype(np.float32))
    url = str(tmp_path / f"v{version}")
    with CacheWriter(url, Manifest(cache_key="v", mode="topk", k=k, teacher_vocab_size=V,
                                   format_version=version)) as w:
        meta = w.write_part(0, [doc])
        w.finish()
    r = CacheReader(url)
    assert r.manifest.format_version == meta.format_version == r.writer_summaries()[0].format_version == version
    want = codecs.default_codecs("topk", V, version, k=k)
    assert {n: c.model_dump() for n, c in r.manifest.codecs.items()} == want
    assert ("topk_id_dict" in meta.arrays) == (version >= 4)
    assert meta.arrays["residual"].dtype == codecs.side_dtype(version)
    got = r.read_shard(meta.shard_id, verify=True)
    by_id, order = np.argsort(got.topk_ids, axis=1), np.argsort(ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(got.topk_ids, by_id, 1)[has], np.take_along_axis(ids, order, 1)[has])
    np.testing.assert_array_equal(got.char_offsets, doc.char_offsets)
    lp_codec = codecs.codec_from_config(want["topk_logprobs"])
    stored = np.take_along_axis(got.topk_logprobs, by_id, 1)[has]
    np.testing.assert_array_equal(stored, lp_codec.decode(lp_codec.encode(np.take_along_axis(lp, order, 1)))[has])
    assert verify_store(url) == []


def _record_from(shard):
    from xtcache.store import DocRecord

    n = int(shard.doc_pos_offsets[1])
    return DocRecord(source="again", row=0, text=shard.texts[0], teacher_ids=shard.teacher_ids[:n],
                     char_offsets=shard.char_offsets[:n], has_pred=shard.has_pred[:n], topk_ids=shard.topk_ids[:n],
                     topk_logprobs=shard.topk_logprobs[:n], topk_counts=None, residual=shard.residual[:n],
                     realized_logprob=shard.realized_logprob[:n])
