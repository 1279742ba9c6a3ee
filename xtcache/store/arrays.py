"""Zarr encoding of a part's arrays, and the one checked way to read them back.

Every array is one Zarr v3 shard object whose inner chunks end in a `crc32c` codec, written with
every inner chunk present (`write_empty_chunks`), so that a read detects:

- a flipped bit or a truncated object: zarr compares the crc32c of each inner chunk and of the
  shard index and raises (reported as "damaged");
- a missing object: zarr would return the fill value for it, so reads go through
  `_ObjectsMustExist`, which turns an absent chunk object into an error (reported as "missing").

Only wrong or missing bytes are damage. A read that gets no answer (a timeout, a dropped
connection, throttling, a 5xx) is tried again with backoff (`xtcache.location.retry_async`) and,
once the attempts are spent, raised as a `StoreError` saying the store did not answer; any other
I/O error (a refused permission) is raised as what it is, never as "damaged".

An array laid out as `write_array` writes it (`ShardLayout`: one shard object, inner chunks along
the first axis, `bytes` + zstd or blosc + `crc32c`, the index at the end) is fetched whole in one
request and decoded here, checking the crc32c of the index and of every inner chunk as zarr does,
without zarr's per-array and per-chunk machinery (what a read of a part mostly cost); any other
layout is read by zarr. Stores written before the crc32c codec (same format version, no `crc32c`
in an array's chain) are read with every array compared against the sha256 in its part index
instead (slower; logged once per store). `schemas/STORE_FORMAT.md` section 4.2 and 9 state the
same rules for other readers.

    python -c "from xtcache.store.arrays import array_sha256; import numpy as np; print(array_sha256(np.arange(3)))"
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import numpy as np

from schemas.arrays import array_def
from schemas.models import FORMAT_VERSION, ArraySpec, CodecConfig
from xtcache.errors import CorruptionError, StoreError
from xtcache.location import Location, retry, retry_async
from xtcache.store import codecs

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # raw bytes per inner Zarr chunk; each array of a part is one shard object


def array_sha256(values: np.ndarray) -> str:
    """sha256 of an array's values in C order as little-endian bytes (bool as one byte 0/1)."""
    arr = np.ascontiguousarray(values)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return hashlib.sha256(arr.tobytes()).hexdigest()


CODEC_COMPRESSION = {
    3: {"topk_logprobs": codecs.Compression(9), "topk_ids": codecs.Compression(6, "byte", CHUNK_BYTES)},
    4: {"topk_logprobs": codecs.Compression(9), "topk_ids": codecs.Compression(6, "byte", CHUNK_BYTES),
        "topk_id_dict": codecs.Compression(6, "byte", CHUNK_BYTES)},
}
"""Compression of the top-k arrays by the format version that introduced it (codec v2: version 3; codec v3:
version 4); zstd 3 elsewhere. At k=64 on the toy teacher (bench/store_codec.py) sqrt-prob codes shrink from 24.8
to 22.7 B/position at zstd 9, and id deltas from 14.3 to 10.6 at blosc level 6 and to 9.6 with each inner chunk
shuffled as one block (blosc's own blocks, smaller than a chunk, each restart zstd's window). Blosc level 9 codes
the real teacher's dictionary codes 1.2 B/position smaller than level 6 but runs zstd at its slowest level (29k
positions/s against 393k on one core, --teacher real); any level and block size decodes the same."""


def default_compression(name: str, format_version: int = FORMAT_VERSION) -> codecs.Compression:
    """Compression of one array by name (schemas/arrays.py): byte shuffle before zstd where it measured
    smaller (bench/store_codec.py: topk_ids at k=64 shrink by a third), plain zstd elsewhere; from format
    version 3 the top-k arrays as `CODEC_COMPRESSION` says."""
    table = CODEC_COMPRESSION.get(min(format_version, max(CODEC_COMPRESSION)), {})
    if name in table:
        return table[name]
    return codecs.Compression(level=3, shuffle="byte" if array_def(name).shuffle else "none")


def write_array(loc: Location, group: str, name: str, values: np.ndarray, *,
                compression: codecs.Compression, transform: dict | None = None) -> ArraySpec:
    """Write one array as a single checked shard object; its ArraySpec for the part index."""
    values = np.ascontiguousarray(values)
    chunks = retry(f"{loc.url}/{group}/{name}", _write, loc, group, name, values, compression, transform)
    return ArraySpec(
        name=name, dtype=values.dtype.name, shape=list(values.shape), chunks=list(chunks),
        transform=CodecConfig(**transform) if transform else None,
        compressors=[CodecConfig(**compression.to_config())], sha256=array_sha256(values),
        stored_bytes=loc.du(f"{group}/{name}/c"))


def _write(loc: Location, group: str, name: str, values: np.ndarray, compression: codecs.Compression,
           transform: dict | None) -> tuple[int, ...]:
    """Create (overwrite) the array and write its values; its inner chunk shape. Idempotent, so retried whole."""
    import zarr
    import zarr.codecs as zc

    row_bytes = max(1, values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64)))
    rows = max(1, min(values.shape[0], CHUNK_BYTES // row_bytes))
    chunks = (rows, *[max(1, s) for s in values.shape[1:]])
    n_chunks = max(1, -(-values.shape[0] // rows))
    shards = (rows * n_chunks, *chunks[1:])
    arr = zarr.create_array(
        loc.zarr_store, name=f"{group}/{name}", shape=values.shape, dtype=values.dtype, chunks=chunks,
        shards=shards, compressors=[*compression.zarr_codecs(values.dtype.itemsize), zc.Crc32cCodec()],
        fill_value=0, attributes={"xtcache_transform": transform} if transform else {}, zarr_format=3,
        overwrite=True, config={"write_empty_chunks": True})
    if values.size:
        arr[...] = values
    return chunks


class MissingObject(Exception):
    """A chunk object that an array needs is not in the store."""


def _checked_store(store):
    """`store` wrapped so that reading an absent chunk object raises MissingObject (not the fill value)."""
    from zarr.storage import WrapperStore

    class _ObjectsMustExist(WrapperStore):
        async def get(self, key, prototype, byte_range=None):
            out = await self._store.get(key, prototype, byte_range)
            if out is None and "/c/" in f"/{key}" and not key.endswith("zarr.json"):
                raise MissingObject(key)
            return out

    return _ObjectsMustExist(store)


def _has_checksum(meta) -> bool:
    """Whether the array's inner chunks end in the crc32c codec (stores written since checked reads)."""
    from zarr.codecs import Crc32cCodec

    return any(isinstance(c, Crc32cCodec) for codec in meta.codecs for c in getattr(codec, "codecs", ()))


_unchecked_notice: set[str] = set()


def read_arrays(loc: Location, group: str, specs: list[ArraySpec], *, where: str,
                sha256: bool = False) -> dict[str, np.ndarray]:
    """Read arrays of one Zarr group concurrently, each checked; CorruptionError names `where` and the array.

    Checked always: crc32c of every inner chunk and of the shard index, presence of every chunk
    object and of every inner chunk, shape and dtype against the index. `sha256` also compares each
    array's sha256 (always done for arrays written without crc32c). Transient errors are retried; a
    store that stops answering raises StoreError, never CorruptionError.
    """
    import asyncio

    from zarr.core.sync import sync

    checked = _checked_store(loc.zarr_store)

    async def gather():
        return await asyncio.gather(*(_fetch(loc, checked, f"{group}/{spec.name}", where) for spec in specs))

    out = {}
    for spec, (values, has_crc) in zip(specs, sync(gather())):
        if isinstance(values, _Fetched):
            values = values.decode()
        if isinstance(values, Exception):
            raise _read_error(where, spec.name, values) from values
        if list(values.shape) != spec.shape or values.dtype.name != spec.dtype:
            raise CorruptionError(
                f"{where}: array {spec.name!r} is damaged: shape {list(values.shape)} dtype {values.dtype.name}, "
                f"its index says {spec.shape} {spec.dtype}")
        if not has_crc and loc.url not in _unchecked_notice:
            _unchecked_notice.add(loc.url)
            log.warning("store %s was written before chunk checksums (crc32c): every array read is checked "
                        "against its sha256 instead (slower)", loc.url)
        if (sha256 or not has_crc) and array_sha256(values) != spec.sha256:
            raise CorruptionError(f"{where}: array {spec.name!r} is damaged (sha256 mismatch with its index)")
        out[spec.name] = values
    return out


_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                     "float32", "float64"})
_INDEX_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
_ABSENT = (1 << 64) - 1  # the shard index entry of an inner chunk that was never written


@dataclass(frozen=True)
class ShardLayout:
    """An array exactly as `write_array` lays it out (STORE_FORMAT.md 4.2), read from its `zarr.json`:
    one shard object `key` of `chunks` inner chunks of `rows` rows along the first axis, each
    `bytes` (little-endian), then zstd or blosc, then crc32c; the shard index (offset, nbytes as
    little-endian uint64 per inner chunk, then its crc32c) at the end of the object."""

    key: str  # the shard object under the array: "c/0" (1-d), "c/0/0" (2-d)
    shape: tuple[int, ...]
    dtype: np.dtype
    rows: int
    chunks: int
    compressor: str  # "zstd" | "blosc"

    @classmethod
    def parse(cls, raw: bytes) -> ShardLayout | None:
        """The layout `zarr.json` describes, or None when it describes anything else (zarr reads those,
        and raises its own errors on a damaged one)."""
        try:
            m = json.loads(raw)
            (shard,) = m["codecs"]
            conf = shard["configuration"]
            plain, comp, crc = conf["codecs"]
            shape, inner = tuple(m["shape"]), tuple(conf["chunk_shape"])
            grid = tuple(m["chunk_grid"]["configuration"]["chunk_shape"])
            ok = (m["zarr_format"] == 3 and m["node_type"] == "array" and not m.get("storage_transformers")
                  and m["data_type"] in _DTYPES and m["chunk_grid"]["name"] == "regular"
                  and m["chunk_key_encoding"] == {"name": "default", "configuration": {"separator": "/"}}
                  and shard["name"] == "sharding_indexed" and conf.get("index_location", "end") == "end"
                  and conf["index_codecs"] == _INDEX_CODECS and crc == {"name": "crc32c"}
                  and plain["name"] == "bytes" and plain.get("configuration", {}).get("endian", "little") == "little"
                  and comp["name"] in ("zstd", "blosc") and 1 <= len(shape) == len(grid) == len(inner)
                  and shape[1:] == grid[1:] == inner[1:] and 0 < inner[0] and shape[0] <= grid[0]
                  and grid[0] % inner[0] == 0 and all(isinstance(n, int) and n >= 0 for n in shape + grid + inner))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        if not ok:
            return None
        return cls(key="c/" + "/".join("0" * len(shape)), shape=shape, dtype=np.dtype(m["data_type"]).newbyteorder("<"),
                   rows=inner[0], chunks=grid[0] // inner[0], compressor=comp["name"])

    def decode(self, data: np.ndarray) -> np.ndarray:
        """The array from the bytes of its shard object (uint8), every crc32c checked: ValueError names
        what is damaged (a checksum, an index that does not fit the object, an inner chunk absent)."""
        out = np.empty(self.shape, self.dtype)
        start = data.size - (16 * self.chunks + 4)
        if start < 0:
            raise ValueError(f"the shard object ({data.size} bytes) is shorter than its index")
        _check_crc32c(data[start:], "shard index")
        index = data[start:-4].view("<u8").reshape(self.chunks, 2)
        flat = out.reshape(-1).view(np.uint8)
        chunk_bytes = self.rows * (out.itemsize * int(np.prod(self.shape[1:], dtype=np.int64)))
        for i in range(-(-self.shape[0] // self.rows)):
            offset, nbytes = int(index[i, 0]), int(index[i, 1])
            if offset == _ABSENT or nbytes < 4 or offset + nbytes > start:
                raise ValueError(f"inner chunk {i} is {'absent from' if offset == _ABSENT else 'outside'} the shard")
            _check_crc32c(data[offset:offset + nbytes], f"inner chunk {i}")
            lo = i * chunk_bytes
            whole = lo + chunk_bytes <= flat.size  # the last inner chunk may reach past the array: padding
            target = flat[lo:lo + chunk_bytes] if whole else np.empty(chunk_bytes, np.uint8)
            _decompress(self.compressor, data[offset:offset + nbytes - 4], target)
            if not whole:
                flat[lo:] = target[:flat.size - lo]
        return out


def _check_crc32c(chunk: np.ndarray, what: str) -> None:
    """`chunk` is payload + its crc32c (4 bytes, little-endian), as zarr's crc32c codec writes it."""
    import google_crc32c

    if google_crc32c.value(chunk[:-4]) != int.from_bytes(chunk[-4:].tobytes(), "little"):
        raise ValueError(f"{what}: stored and computed crc32c checksum differ")


def _decompress(name: str, src: np.ndarray, target: np.ndarray) -> None:
    """Decompress one inner chunk into `target` (uint8), which it must fill exactly."""
    import numcodecs

    if name == "blosc":  # the header's byte count (bytes 4-8) sizes the output: checked before decoding into it
        if src.size < 16 or int.from_bytes(src[4:8].tobytes(), "little") != target.size:
            raise ValueError(f"a blosc chunk that does not decompress to {target.size} bytes")
        numcodecs.Blosc().decode(src, out=target)
        return
    raw = numcodecs.Zstd().decode(src)
    if len(raw) != target.size:
        raise ValueError(f"a zstd chunk of {len(raw)} bytes, not {target.size}")
    target[:] = np.frombuffer(raw, np.uint8)


@dataclass(frozen=True)
class _Fetched:
    """A shard object fetched whole, decoded (and checked) by `read_arrays` outside the event loop."""

    layout: ShardLayout
    data: np.ndarray  # uint8: the shard object's bytes

    def decode(self) -> np.ndarray | Exception:
        try:
            return self.layout.decode(self.data)
        except Exception as e:  # noqa: BLE001  (numcodecs raises many kinds on damaged bytes; classified later)
            return e


async def _fetch(loc: Location, checked, path: str, where: str):
    """(what was read, has_crc) of one array: for a `ShardLayout` array its shard object fetched whole
    (`_Fetched`, two requests with its zarr.json), decoded by the caller; any other array read by zarr
    (`_read_one`); or the exception, classified by the caller."""
    from zarr.core.buffer import default_buffer_prototype

    what = f"{where}: array {path.rsplit('/', 1)[-1]!r} ({loc.url}/{path})"
    proto = default_buffer_prototype()
    try:
        meta = await retry_async(what, lambda: checked.get(f"{path}/zarr.json", proto))
        layout = ShardLayout.parse(meta.to_bytes()) if meta is not None else None
        if layout is None:
            return await _read_one(loc, checked, path, where)
        if 0 in layout.shape:  # no shard object (4.2)
            return np.zeros(layout.shape, layout.dtype), True
        data = await retry_async(what, lambda: checked.get(f"{path}/{layout.key}", proto))
        return _Fetched(layout, data.as_numpy_array().view(np.uint8)), True
    except Exception as e:  # noqa: BLE001  (classified by the caller)
        return e, True


async def _read_one(loc: Location, checked, path: str, where: str):
    """(values, has_crc) of one array read by zarr, or (the exception, has_crc): errors are classified by the caller."""
    from zarr.api import asynchronous as zarr_async

    what = f"{where}: array {path.rsplit('/', 1)[-1]!r} ({loc.url}/{path})"
    try:
        arr = await retry_async(what, lambda: zarr_async.open_array(store=checked, path=path, mode="r"))
    except FileNotFoundError:
        return MissingObject(f"{path}/zarr.json"), False
    except Exception as e:  # noqa: BLE001  (zarr raises many kinds on damaged metadata)
        return e, False
    has_crc = _has_checksum(arr.metadata)
    try:
        if not has_crc:  # written before checked reads: an all-zero array may have no object
            arr = await retry_async(what, lambda: zarr_async.open_array(store=loc.zarr_store, path=path, mode="r"))
        return await retry_async(what, lambda: arr.getitem(Ellipsis)), has_crc
    except Exception as e:  # noqa: BLE001  (zarr/numcodecs raise many kinds on damaged bytes)
        return e, has_crc


def _read_error(where: str, name: str, e: Exception) -> Exception:
    """The error to raise for a failed read: missing or wrong bytes are damage, I/O failures are not."""
    if isinstance(e, (MissingObject, FileNotFoundError)):
        return CorruptionError(f"{where}: array {name!r} is missing (no object {e})")
    if isinstance(e, StoreError):  # retries spent: the store did not answer
        return e
    first = str(e).splitlines()[0][:200] if str(e) else ""
    if isinstance(e, OSError):  # bytes never arrived (a refused permission, a dead disk): not damage
        return StoreError(f"{where}: array {name!r} cannot be read: {type(e).__name__}: {first}")
    why = "crc32c mismatch" if "checksum" in str(e).lower() else f"cannot be decoded: {type(e).__name__}: {first}"
    return CorruptionError(f"{where}: array {name!r} is damaged ({why})")


def concat(parts: list[np.ndarray], dtype, tail: tuple[int, ...] = ()) -> np.ndarray:
    if not parts:
        return np.zeros((0, *tail), dtype=dtype)
    return np.concatenate([np.asarray(p, dtype=dtype).reshape(-1, *tail) for p in parts])


def offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out
