"""Codec v3 (store format version 4): top-k ids as codes into a per-part dictionary.

Exact id round trips (hypothesis), the dictionary's order, the stated KL error of a version 4 store, damage
in the ids or their dictionary named by the reader and by `xtcache verify`, and ids transforms that a mode or
version cannot use refused. Older versions: tests/test_store_versions.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_codec_v3.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.models import CodecConfig, Manifest
from xtcache.errors import CorruptionError, XtcacheError
from xtcache.store import CacheReader, CacheWriter, DocRecord, codecs

SETTINGS = settings(max_examples=60, deadline=None)
PART = "w00000-p000000"


@st.composite
def id_rows(draw):
    """(ids [P, k] unique per row, some rows all 0 as the writer stores rows without a prediction, vocab)."""
    vocab = draw(st.sampled_from([1, 2, 7, 300, 49_152, 65_536, 65_537, 151_936]))
    k = draw(st.integers(1, min(vocab, 64)))
    P = draw(st.integers(0, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    skew = rng.zipf(1.3, vocab * 4) % vocab  # a few ids in most rows, as a trained teacher's top-k
    rows = []
    for _ in range(P):
        row = list(dict.fromkeys(skew[rng.integers(0, skew.size, 4 * k)].tolist()))[:k]
        rows.append(row + rng.choice(np.setdiff1d(np.arange(vocab), row), k - len(row), replace=False).tolist())
    ids = np.array(rows, np.int32).reshape(P, k)
    ids[rng.random(P) < 0.1] = 0
    return ids, vocab


@SETTINGS
@given(id_rows())
def test_dict_delta_ids_round_trip(case):
    ids, vocab = case
    codec = codecs.DictDeltaIds("uint16" if vocab <= 65_536 else "uint32")
    dictionary = codec.dictionary(ids)
    assert dictionary.dtype == np.int32 and sorted(dictionary.tolist()) == np.unique(ids).tolist()
    deltas, order = codec.encode(ids, dictionary)
    assert deltas.dtype == np.dtype(codec.dtype) and deltas.shape == ids.shape
    stored = codec.encode_dictionary(dictionary)
    assert stored.dtype == np.int32
    np.testing.assert_array_equal(codec.decode_dictionary(stored), dictionary)
    decoded = codec.decode(deltas, codec.decode_dictionary(stored))
    assert decoded.dtype == np.int32
    np.testing.assert_array_equal(decoded, np.take_along_axis(ids, order, 1))  # the values follow `order`
    np.testing.assert_array_equal(np.sort(decoded, axis=1), np.sort(ids, axis=1))
    assert codecs.codec_from_config(codec.to_config()) == codec


def test_the_dictionary_puts_frequent_ids_first():
    """Groups of equal floor(log2(count)), larger first, each ascending by id."""
    ids = np.array([[5, 9, 2], [5, 9, 7], [5, 1, 2], [5, 3, 8]])  # counts: 5: 4; 9, 2: 2; 7, 1, 3, 8: 1
    np.testing.assert_array_equal(codecs.DictDeltaIds.dictionary(ids), [5, 2, 9, 1, 3, 7, 8])
    assert codecs.DictDeltaIds.dictionary(np.zeros((0, 4), np.int32)).size == 0


def test_decode_refuses_codes_outside_the_dictionary():
    codec = codecs.DictDeltaIds("uint16")
    with pytest.raises(CorruptionError, match="code 3, outside its dictionary of 3 ids"):
        codec.decode(np.array([[0, 1, 2]], np.uint16), np.array([4, 8, 9], np.int32))
    with pytest.raises(CorruptionError, match="its dictionary .'topk_id_dict'. is empty"):
        codec.decode(np.array([[0]], np.uint16), np.zeros(0, np.int32))
    with pytest.raises(XtcacheError, match="does not fit uint16"):
        codec.encode(np.array([[0, 69_999]]), np.arange(70_000, dtype=np.int32))


def _dists(rng, P: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(top-k log-probs float64 [P, k] sorted descending, rest mass [P]) of Dirichlet draws over k + 1."""
    p = rng.dirichlet(np.full(k + 1, 0.3), size=P)
    with np.errstate(divide="ignore"):
        return np.log(-np.sort(-p[:, :k], axis=1)), p[:, k]


def _store(tmp_path: Path, k: int = 64, V: int = 49_152, T: int = 400) -> tuple[str, DocRecord]:
    rng = np.random.default_rng(4)
    lp, rest = _dists(rng, T, k)
    common = rng.choice(V, 3 * k, replace=False)  # rows share many ids, as a trained teacher's do
    ids = np.stack([np.concatenate([rng.choice(common, k // 2, replace=False),
                                    rng.choice(np.setdiff1d(np.arange(V), common), k - k // 2, replace=False)])
                    for _ in range(T)]).astype(np.int32)
    has = np.arange(T) > 0
    doc = DocRecord(source="c.jsonl", row=0, text="y" * T, teacher_ids=ids[:, 0].copy(),
                    char_offsets=np.stack([np.arange(T), np.arange(T) + 1], 1).astype(np.int32), has_pred=has,
                    topk_ids=ids, topk_logprobs=lp.astype(np.float32), topk_counts=None,
                    residual=rest.astype(np.float32), realized_logprob=np.where(has, lp[:, 0], np.nan).astype(np.float32))
    url = str(tmp_path / "v4")
    with CacheWriter(url, Manifest(cache_key="v4", mode="topk", k=k, teacher_vocab_size=V)) as w:
        w.write_part(0, [doc])
        w.finish()
    return url, doc


def test_a_version_4_store_round_trips_ids_exactly_and_values_within_the_stated_kl(tmp_path):
    from xtcache.app.store_commands import verify_store

    url, doc = _store(tmp_path)
    r = CacheReader(url)
    meta = r.shards[0]
    assert r.manifest.format_version == meta.format_version == 4
    assert meta.arrays["topk_ids"].transform.name == codecs.DICT_IDS_NAME
    assert meta.arrays["topk_id_dict"].transform == meta.arrays["topk_ids"].transform
    got = r.read_shard(PART, verify=True)
    hp = doc.has_pred
    by_id, order = np.argsort(got.topk_ids, axis=1), np.argsort(doc.topk_ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(got.topk_ids, by_id, 1)[hp],
                                  np.take_along_axis(doc.topk_ids, order, 1)[hp])
    assert (got.topk_ids[~hp] == 0).all()
    want = np.take_along_axis(doc.topk_logprobs, order, 1)[hp].astype(np.float64)  # [n, k] by id
    have = np.take_along_axis(got.topk_logprobs, by_id, 1)[hp].astype(np.float64)
    sqrt = codecs.SqrtProbs(127)
    assert np.abs(np.exp(have / 2) - np.exp(want / 2)).max() <= sqrt.max_sqrt_error + 1e-6
    # mean KL(original top-k + rest || stored top-k + the same rest), renormalised, in fp64 (the residual's own
    # float16 error: tests/test_codec_v2.py)
    rest = doc.residual[hp, None].astype(np.float64)
    p, q = np.concatenate([np.exp(want), rest], 1), np.concatenate([np.exp(have), rest], 1)
    p, q = p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)
    kl = float(np.where(p > 0, p * (np.log(np.maximum(p, 1e-300)) - np.log(q)), 0).sum(1).mean())
    assert 0 < kl <= 1.25 * 64 * sqrt.mean_kl_per_entry < 1e-3
    assert verify_store(url) == []


@pytest.mark.parametrize("array", ["topk_ids", "topk_id_dict"])
def test_a_flipped_byte_in_the_ids_or_their_dictionary_is_named(tmp_path, array):
    from xtcache.app.store_commands import verify_store

    url, _ = _store(tmp_path)
    (obj,) = [p for p in (Path(url) / "shards" / PART / array / "c").rglob("*") if p.is_file()]
    data = bytearray(obj.read_bytes())
    data[len(data) // 3] ^= 0x10
    obj.write_bytes(bytes(data))
    (problem,) = verify_store(url)
    assert f"teacher part {PART}" in problem and repr(array) in problem and "damaged" in problem
    assert "\n" not in problem
    with pytest.raises(CorruptionError, match=f"{PART}: array '{array}' is damaged"):
        CacheReader(url).read_shard(PART)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d[: d.size // 2], "array 'topk_ids' decodes to code .* outside its dictionary"),
    (lambda d: np.where(np.arange(d.size) == 0, 60_000, d), "array 'topk_id_dict' holds ids outside the teacher vocabulary"),
])
def test_a_dictionary_that_does_not_fit_the_ids_is_refused(tmp_path, edit, message):
    """A dictionary rewritten with valid checksums (shorter, or with an id beyond V) is still damage."""
    from xtcache.location import Location
    from xtcache.store.arrays import default_compression, write_array

    url, _ = _store(tmp_path)
    codec = codecs.DictDeltaIds("uint16")
    index = Path(url) / "index" / f"{PART}.json"
    raw = json.loads(index.read_text())
    dictionary = codec.decode_dictionary(_stored_dictionary(url))
    spec = write_array(Location(url), f"shards/{PART}", "topk_id_dict", codec.encode_dictionary(edit(dictionary)),
                       compression=default_compression("topk_id_dict"), transform=codec.to_config())
    raw["arrays"]["topk_id_dict"] = spec.model_dump(mode="json")
    index.write_text(json.dumps(raw))
    with pytest.raises(CorruptionError, match=f"{PART}: {message}"):
        CacheReader(url).read_shard(PART)


def _stored_dictionary(url: str) -> np.ndarray:
    import zarr

    return zarr.open_array(f"{url}/shards/{PART}/topk_id_dict", mode="r")[...]


def test_an_index_without_the_dictionary_is_refused(tmp_path):
    url, _ = _store(tmp_path)
    index = Path(url) / "index" / f"{PART}.json"
    raw = json.loads(index.read_text())
    del raw["arrays"]["topk_id_dict"]
    index.write_text(json.dumps(raw))
    with pytest.raises(CorruptionError, match="array 'topk_id_dict' is missing from its index"):
        CacheReader(url).read_shard(PART)


@pytest.mark.parametrize("mode,version", [("full", 4), ("sampled", 4), ("headtail", 4), ("topk", 3)])
def test_dictionary_coded_ids_are_refused_outside_topk_stores_of_version_4(tmp_path, mode, version):
    V = 300
    k, top_k = {"full": (V, None), "sampled": (8, None), "headtail": (10, 4), "topk": (8, None)}[mode]
    m = Manifest(cache_key="x", mode=mode, k=k, teacher_vocab_size=V, top_k=top_k, format_version=version,
                 num_samples={"sampled": 8, "headtail": 6}.get(mode))
    cfg = codecs.default_codecs(mode, V, version, k=k, top_k=top_k)
    cfg["topk_ids"] = codecs.DictDeltaIds("uint16").to_config()
    m.codecs = {n: CodecConfig(**c) for n, c in cfg.items()}
    with pytest.raises(XtcacheError, match=f"only topk stores of format version 4 and later .*mode {mode}"):
        CacheWriter(str(tmp_path / "s"), m)
