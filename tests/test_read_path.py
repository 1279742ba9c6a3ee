"""The checked read path of a part's arrays: shard objects decoded by xtcache (`ShardLayout`) give what
zarr gives, refuse what zarr refuses and what the format forbids; the in-place and blocked decodes
give what the plain ones give.

    .venv/bin/python -m pytest -q tests/test_read_path.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from schemas.models import ArraySpec
from xtcache.errors import CorruptionError
from xtcache.location import Location
from xtcache.store import codecs
from xtcache.store.arrays import CHUNK_BYTES, ShardLayout, array_sha256, read_arrays, write_array

RNG = np.random.default_rng(0)
ARRAYS = {
    "bool": RNG.integers(0, 2, 1000).astype(bool),
    "uint8-2d": RNG.integers(0, 256, (300, 64)).astype(np.uint8),
    "uint16-2d": RNG.integers(0, 70, (5000, 64)).astype(np.uint16),
    "uint32-2d-chunks": RNG.integers(0, 3000, (9000, 64)).astype(np.uint32),  # 3 inner chunks, the last partial
    "int32-chunks": RNG.integers(-5, 5, CHUNK_BYTES // 4 * 2 + 17).astype(np.int32),
    "int64": np.cumsum(RNG.integers(0, 9, 257)).astype(np.int64),
    "float16": np.where(RNG.random(777) < 0.1, np.nan, RNG.standard_normal(777)).astype(np.float16),
    "float32": RNG.standard_normal(1234).astype(np.float32),
    "empty": np.zeros((0, 8), np.uint16),
}


COMPRESSIONS = {"none": codecs.Compression(3), "byte": codecs.Compression(3, "byte"),
                "byte-1MiB-blocks": codecs.Compression(6, "byte", CHUNK_BYTES)}  # the last: format 3's topk_ids


def _write(root: Path, name: str, values: np.ndarray, shuffle: str) -> tuple[Location, ArraySpec]:
    loc = Location(str(root))
    spec = write_array(loc, "g", name, values, compression=COMPRESSIONS[shuffle])
    return loc, spec


def _object(root: Path, name: str) -> Path:
    (path,) = [p for p in (root / "g" / name / "c").rglob("*") if p.is_file()]
    return path


@pytest.mark.parametrize("shuffle", list(COMPRESSIONS))
@pytest.mark.parametrize("name", list(ARRAYS))
def test_a_written_array_reads_back_as_zarr_reads_it(tmp_path, name, shuffle):
    import zarr

    values = ARRAYS[name]
    loc, spec = _write(tmp_path, name, values, shuffle)
    layout = ShardLayout.parse((tmp_path / "g" / name / "zarr.json").read_bytes())
    assert layout is not None and layout.shape == values.shape  # read by xtcache, not zarr
    got = read_arrays(loc, "g", [spec], where="test", sha256=True)[name]
    want = zarr.open_array(str(tmp_path / "g" / name), mode="r")[...]
    assert got.dtype == want.dtype == values.dtype and got.flags.writeable
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, values)


def test_a_layout_xtcache_does_not_write_is_read_by_zarr(tmp_path):
    import zarr

    values = RNG.integers(0, 100, (50, 3)).astype(np.int32)
    zarr.create_array(str(tmp_path / "g" / "plain"), shape=values.shape, dtype=values.dtype, chunks=(7, 3),
                      zarr_format=3)[...] = values  # no sharding, no crc32c
    assert ShardLayout.parse((tmp_path / "g" / "plain" / "zarr.json").read_bytes()) is None
    spec = ArraySpec(name="plain", dtype="int32", shape=[50, 3], chunks=[7, 3],
                     sha256=array_sha256(values))
    got = read_arrays(Location(str(tmp_path)), "g", [spec], where="test")["plain"]
    np.testing.assert_array_equal(got, values)


def _set_index_entry(path: Path, chunks: int, entry: int, offset: int, nbytes: int) -> None:
    """Rewrite one shard index entry and the index's crc32c (a writer that skipped an inner chunk)."""
    import google_crc32c

    data = bytearray(path.read_bytes())
    start = len(data) - (16 * chunks + 4)
    index = np.frombuffer(bytes(data[start:-4]), "<u8").reshape(chunks, 2).copy()
    index[entry] = (offset, nbytes)
    data[start:-4] = index.tobytes()
    data[-4:] = google_crc32c.value(bytes(data[start:-4])).to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, words", [
    ("empty-object", "shorter than its index"),
    ("flip-chunk", "crc32c mismatch"),
    ("flip-index", "crc32c mismatch"),
    ("absent-chunk", "inner chunk 1 is absent"),
    ("chunk-outside", "inner chunk 0 is outside"),
])
def test_damaged_shard_objects_are_refused(tmp_path, damage, words):
    name = "uint32-2d-chunks"
    loc, spec = _write(tmp_path, name, ARRAYS[name], "byte")
    path, chunks = _object(tmp_path, name), ShardLayout.parse((tmp_path / "g" / name / "zarr.json").read_bytes()).chunks
    data = bytearray(path.read_bytes())
    if damage == "empty-object":
        data = bytearray()
    elif damage.startswith("flip"):
        data[10 if damage == "flip-chunk" else len(data) - 8] ^= 0x10
    path.write_bytes(bytes(data))
    if damage == "absent-chunk":
        _set_index_entry(path, chunks, 1, 2**64 - 1, 2**64 - 1)
    elif damage == "chunk-outside":
        _set_index_entry(path, chunks, 0, len(data), 100)
    with pytest.raises(CorruptionError, match=f"array {name!r} is damaged") as e:
        read_arrays(loc, "g", [spec], where="test")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_missing_shard_object_is_missing(tmp_path):
    name = "float32"
    loc, spec = _write(tmp_path, name, ARRAYS[name], "none")
    _object(tmp_path, name).unlink()
    with pytest.raises(CorruptionError, match=f"array {name!r} is missing"):
        read_arrays(loc, "g", [spec], where="test")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_sorted_delta_ids_overwrite_decodes_the_same_ids(dtype):
    ids = np.sort(RNG.choice(60_000, (500, 64)), axis=1).astype(np.int32)
    codec = codecs.SortedDeltaIds(dtype)
    deltas, _ = codec.encode(ids)
    kept = deltas.copy()
    np.testing.assert_array_equal(codec.decode(deltas), ids)
    np.testing.assert_array_equal(deltas, kept)  # a plain decode leaves its input alone
    out = codec.decode(deltas, overwrite=True)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, ids)
    assert np.shares_memory(out, deltas) == (dtype == "uint32")


def test_sqrt_probs_decode_in_blocks_equals_the_table():
    """More code pairs than one decode block, and a size that ends inside a block."""
    codec = codecs.SqrtProbs(127)
    codes = RNG.integers(0, 256, (2 * codecs._DECODE_BLOCK // 32 + 3, 64)).astype(np.uint8)
    np.testing.assert_array_equal(codec.decode(codes), codec.table()[codes])


def test_the_compression_record_round_trips_and_older_records_read_as_blosc_blocks():
    from xtcache.errors import XtcacheError
    from xtcache.store.arrays import default_compression

    ids = default_compression("topk_ids")  # format 3: each inner chunk shuffled as one blosc block
    assert ids == codecs.Compression(6, "byte", CHUNK_BYTES)
    assert default_compression("topk_ids", 2) == codecs.Compression(3, "byte", 0)
    assert codecs.codec_from_config(ids.to_config()) == ids
    older = {"name": "xtcache.compression", "configuration": {"level": 6, "shuffle": "byte"}}  # before blocksize
    assert codecs.codec_from_config(older) == codecs.Compression(6, "byte", 0)
    (blosc,) = ids.zarr_codecs(4)
    assert blosc.blocksize == CHUNK_BYTES and blosc.clevel == 6
    for bad in ({"level": 3, "shuffle": "none", "blocksize": 4096}, {"level": 3, "shuffle": "byte", "blocksize": -1}):
        with pytest.raises(XtcacheError, match="blocksize"):
            codecs.Compression(**bad)
