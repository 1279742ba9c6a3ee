"""Codec v2 (store format version 3): the sqrt-prob value code against an fp64 reference, float16 side
arrays, and a version 3 store written, read and verified (damaged bytes in its arrays are named). Codec v3
(format version 4) keeps these and codes ids into a dictionary: tests/test_codec_v3.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_codec_v2.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.models import FORMAT_VERSION, Manifest
from xtcache.errors import CorruptionError, XtcacheError
from xtcache.store import CacheReader, CacheWriter, DocRecord, codecs

SETTINGS = settings(max_examples=60, deadline=None)


def _dists(rng, P: int, k: int, concentration: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """(top-k log-probs float64 [P, k] sorted descending, rest mass float64 [P]) of Dirichlet draws over k + 1."""
    p = rng.dirichlet(np.full(k + 1, concentration), size=P)
    top = -np.sort(-p[:, :k], axis=1)
    with np.errstate(divide="ignore"):
        return np.log(top), p[:, k]


@SETTINGS
@given(st.integers(0, 30), st.integers(1, 64), st.integers(1, 255), st.integers(0, 2**32 - 1))
def test_sqrt_probs_error_bound_against_fp64(P, k, levels, seed):
    rng = np.random.default_rng(seed)
    codec = codecs.SqrtProbs(levels)
    lp, _ = _dists(rng, P, k, concentration=rng.choice([0.05, 0.3, 3.0]))
    codes = codec.encode(lp)
    assert codes.dtype == np.uint8 and codes.max(initial=0) <= levels
    decoded = codec.decode(codes)
    assert decoded.dtype == np.float32 and np.isfinite(decoded).all() and decoded.max(initial=0) <= 0
    s_ref, s_dec = np.exp(0.5 * lp), np.exp(0.5 * decoded.astype(np.float64))
    float32_rounding = 2e-7  # float32 log-prob near 0, relative 2^-24 elsewhere
    assert np.abs(s_dec - s_ref).max(initial=0) <= codec.max_sqrt_error + float32_rounding
    cfg = codec.to_config()
    assert cfg["configuration"]["max_sqrt_error"] == codec.max_sqrt_error
    assert codecs.codec_from_config(cfg) == codec


@pytest.mark.parametrize("shape", [(0, 4), (3, 5), (40, 64)])
def test_sqrt_probs_pair_decode_equals_the_one_entry_table(shape):
    """The two-codes-at-a-time decode (even sizes) and the plain table (odd sizes) give the same values."""
    codec = codecs.SqrtProbs(101)
    codes = np.random.default_rng(1).integers(0, 256, shape).astype(np.uint8)
    np.testing.assert_array_equal(codec.decode(codes), codec.table()[codes])
    np.testing.assert_array_equal(codec.decode(codes[:, ::2]), codec.table()[codes[:, ::2]])


def test_sqrt_probs_nan_and_infinities_and_bad_levels():
    codec = codecs.SqrtProbs(127)
    codes = codec.encode(np.array([np.nan, -np.inf, np.inf, 0.0, -200.0]))
    np.testing.assert_array_equal(codes, [0, 0, 127, 127, 0])
    assert codec.decode(codes)[0] == np.float32(2 * np.log(0.25 / 127))
    with pytest.raises(XtcacheError, match="levels=256"):
        codecs.SqrtProbs(256)


@pytest.mark.parametrize("levels", [64, 127, 200])
def test_sqrt_probs_mean_kl_is_the_stated_one(levels):
    """Mean KL(top-k + rest || decoded + rest, renormalised) in fp64 is within 25% of k x mean_kl_per_entry
    (the second-order formula; 2,000 positions give about 2% sampling noise)."""
    rng = np.random.default_rng(levels)
    k = 64
    lp, rest = _dists(rng, 2000, k)
    q_top = np.exp(codecs.SqrtProbs(levels).decode(codecs.SqrtProbs(levels).encode(lp)).astype(np.float64))
    p = np.concatenate([np.exp(lp), rest[:, None]], 1)
    q = np.concatenate([q_top, rest[:, None]], 1)
    q /= q.sum(1, keepdims=True)
    kl = float(np.where(p > 0, p * (np.log(np.maximum(p, 1e-300)) - np.log(q)), 0).sum(1).mean())
    stated = k * codecs.SqrtProbs(levels).mean_kl_per_entry
    assert 0.75 * stated <= kl <= 1.25 * stated


@SETTINGS
@given(st.lists(st.integers(0, 12), max_size=6), st.integers(0, 2**32 - 1))
def test_delta_char_offsets_round_trip(lengths, seed):
    """Offsets restart at each document (empty documents included); the decode is exact."""
    rng = np.random.default_rng(seed)
    docs = []
    for n in lengths:
        gaps, sizes = rng.integers(0, 3, n), rng.integers(0, 6, n)
        ends = np.cumsum(gaps + sizes)
        docs.append(np.stack([ends - sizes, ends], 1).reshape(n, 2))
    offsets = np.concatenate(docs).astype(np.int32) if docs else np.zeros((0, 2), np.int32)
    pos = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    codec = codecs.DeltaCharOffsets()
    stored = codec.encode(offsets, pos)
    assert stored.dtype == np.int32 and (stored >= 0).all()
    np.testing.assert_array_equal(codec.decode(stored, pos), offsets)
    assert codecs.codec_from_config(codec.to_config()) == codec


def test_default_codecs_follow_the_format_version():
    assert FORMAT_VERSION == 4
    v3 = codecs.default_codecs("topk", 80_000, 3)
    assert v3["topk_logprobs"] == codecs.SqrtProbs(127).to_config()
    assert codecs.default_codecs("topk", 80_000, 2)["topk_logprobs"]["name"] == codecs.QUANT_NAME
    assert "topk_logprobs" not in codecs.default_codecs("sampled", 80_000)
    assert codecs.default_codecs("topk", 80_000, 3, k=256)["topk_logprobs"] == codecs.SqrtProbs(255).to_config()
    assert codecs.default_codecs("full", 300, k=300)["topk_logprobs"]["name"] == codecs.QUANT_NAME
    assert v3["char_offsets"]["name"] == codecs.OFFSETS_NAME
    assert "char_offsets" not in codecs.default_codecs("topk", 80_000, 2)
    assert (codecs.side_dtype(3), codecs.side_dtype(2)) == ("float16", "float32")


def _doc(rng, row: int, T: int, k: int, V: int) -> DocRecord:
    has = np.arange(T) > 0
    lp, rest = _dists(rng, T, k)
    ids = np.stack([rng.choice(V, k, replace=False) for _ in range(T)]).astype(np.int32)
    return DocRecord(source="c.jsonl", row=row, text="x" * T, teacher_ids=rng.integers(0, V, T).astype(np.int32),
                     char_offsets=np.stack([np.arange(T), np.arange(T) + 1], 1).astype(np.int32), has_pred=has,
                     topk_ids=ids, topk_logprobs=lp.astype(np.float32), topk_counts=None,
                     residual=rest.astype(np.float32),
                     realized_logprob=np.where(has, lp[:, 0] - 0.5, np.nan).astype(np.float32))


def _store(tmp_path: Path, k: int = 16, V: int = 80_000) -> tuple[str, DocRecord]:
    rng = np.random.default_rng(3)
    doc = _doc(rng, 0, 300, k, V)
    url = str(tmp_path / "v3")
    with CacheWriter(url, Manifest(cache_key="v3", mode="topk", k=k, teacher_vocab_size=V, format_version=3)) as w:
        w.write_part(0, [doc])
        w.finish()
    return url, doc


def test_a_version_3_store_round_trips_within_the_stated_errors(tmp_path):
    from xtcache.app.store_commands import verify_store

    url, doc = _store(tmp_path)
    r = CacheReader(url)
    assert r.manifest.format_version == 3
    meta = r.shards[0]
    assert meta.arrays["topk_logprobs"].transform.name == codecs.SQRT_NAME
    assert meta.arrays["residual"].dtype == "float16" and meta.arrays["realized_logprob"].dtype == "float16"
    assert meta.arrays["char_offsets"].transform.name == codecs.OFFSETS_NAME
    got = r.read_shard(meta.shard_id, verify=True)
    hp = doc.has_pred
    np.testing.assert_array_equal(got.char_offsets, doc.char_offsets)
    order = np.argsort(doc.topk_ids, axis=1, kind="stable")
    np.testing.assert_array_equal(got.topk_ids[hp], np.take_along_axis(doc.topk_ids, order, 1)[hp])
    want = np.exp(0.5 * np.take_along_axis(doc.topk_logprobs, order, 1)[hp].astype(np.float64))
    have = np.exp(0.5 * got.topk_logprobs[hp].astype(np.float64))
    assert np.abs(have - want).max() <= codecs.SqrtProbs(127).max_sqrt_error + 1e-6
    assert got.residual.dtype == np.float32 and got.realized_logprob.dtype == np.float32
    np.testing.assert_allclose(got.residual, doc.residual, rtol=2.0**-11, atol=2.0**-25)
    np.testing.assert_allclose(got.realized_logprob[hp], doc.realized_logprob[hp], rtol=2.0**-11)
    assert np.isnan(got.realized_logprob[~hp]).all()
    assert verify_store(url) == []


@pytest.mark.parametrize("array", ["topk_logprobs", "residual", "realized_logprob", "char_offsets"])
def test_verify_names_a_damaged_codec_v2_array(tmp_path, array):
    from xtcache.app.store_commands import verify_store

    url, _ = _store(tmp_path)
    (obj,) = [p for p in (Path(url) / "shards" / "w00000-p000000" / array / "c").rglob("*") if p.is_file()]
    data = bytearray(obj.read_bytes())
    data[len(data) // 3] ^= 0x10
    obj.write_bytes(bytes(data))
    (problem,) = verify_store(url)
    assert "teacher part w00000-p000000" in problem and repr(array) in problem and "damaged" in problem
    assert "\n" not in problem
    with pytest.raises(CorruptionError, match=f"array '{array}' is damaged"):
        CacheReader(url).read_shard("w00000-p000000")


def test_a_float16_side_array_listed_as_float64_is_refused(tmp_path):
    """The array table allows float32 and float16 only: an index that claims another dtype is damage."""
    import json

    url, _ = _store(tmp_path)
    path = Path(url) / "index" / "w00000-p000000.json"
    raw = json.loads(path.read_text())
    raw["arrays"]["residual"]["dtype"] = "float64"
    path.write_text(json.dumps(raw))
    with pytest.raises(CorruptionError, match="array 'residual' is damaged: its index says float64"):
        CacheReader(url).read_shard("w00000-p000000")
