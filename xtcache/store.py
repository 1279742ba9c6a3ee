"""The teacher-cache store: a Zarr v3 hierarchy on any fsspec URL, written by independent writers.

Stage 1 writes it with `CacheWriter` (one per writer process, each owning the parts
"w{writer:05d}-p{part:06d}"), stage 2 reads it with `CacheReader`. A part becomes visible only when
its index file `index/<shard>.json` is written, last and atomically; readers list index files only,
so a half-written part is invisible and a rewrite of the same part on resume is deterministic. The
full layout is in `schemas/STORE_FORMAT.md`.

    python -c "from xtcache.store import CacheReader; r = CacheReader('out/cache'); print(r.shards)"
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.models import (
    FORMAT_VERSION, AlignGroupMeta, AlignPartMeta, ArraySpec, CodecConfig, DocId, Manifest, ShardMeta,
    WriterClaim, WriterDone,
)
from xtcache import codecs
from xtcache.errors import CorruptionError, FormatVersionError, StoreError, XtcacheError
from xtcache.fingerprint import content_hash
from xtcache.store_io import Location, check_version, now_iso, read_model  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # raw bytes per inner Zarr chunk; each array of a part is one shard object


def shard_id(writer_index: int, part_index: int) -> str:
    return f"w{writer_index:05d}-p{part_index:06d}"


# ---------------------------------------------------------------------------------------- records


@dataclass
class DocRecord:
    """One document as stage 1 writes it (teacher-position-major arrays, see docs/architecture.md)."""

    source: str
    row: int
    text: str
    teacher_ids: np.ndarray  # int32 [T]
    char_offsets: np.ndarray  # int32 [T, 2]
    has_pred: np.ndarray  # bool [T]
    topk_ids: np.ndarray  # int32 [T, k]
    topk_logprobs: np.ndarray | None  # float32 [T, k]; None in sampled mode
    topk_counts: np.ndarray | None  # uint16 [T, k]; sampled mode only, 0 = padding
    residual: np.ndarray  # float32 [T]
    realized_logprob: np.ndarray  # float32 [T]; NaN where not has_pred
    content_hash: str = ""

    def __post_init__(self):
        if not self.content_hash:
            self.content_hash = content_hash(self.text)

    @property
    def doc_id(self) -> str:
        return f"{self.source}:{self.row}:{self.content_hash}"


@dataclass
class AlignmentRecord:
    """One document's student tokens and its chunk alignment (an xtcache.align.Alignment)."""

    student_ids: np.ndarray  # int32 [S]
    alignment: Any  # Alignment: student_end int32 [C], teacher_end int32 [C], exact bool [C]


@dataclass
class ShardData:
    """Decoded teacher arrays of one part, concatenated over its documents (plain numpy)."""

    shard_id: str
    docs: list[DocId]
    texts: list[str]
    doc_pos_offsets: np.ndarray  # int64 [D+1]
    teacher_ids: np.ndarray  # int32 [P]
    char_offsets: np.ndarray  # int32 [P, 2]
    has_pred: np.ndarray  # bool [P]
    topk_ids: np.ndarray  # int32 [P, k], each row ascending by id
    topk_logprobs: np.ndarray | None  # float32 [P, k]
    topk_counts: np.ndarray | None  # uint16 [P, k]
    residual: np.ndarray  # float32 [P]
    realized_logprob: np.ndarray  # float32 [P]

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    def doc_ids(self) -> list[str]:
        return [f"{d.source}:{d.row}:{d.content_hash}" for d in self.docs]

    def doc(self, i: int) -> DocRecord:
        a, b = int(self.doc_pos_offsets[i]), int(self.doc_pos_offsets[i + 1])
        d = self.docs[i]
        return DocRecord(
            source=d.source, row=d.row, text=self.texts[i], teacher_ids=self.teacher_ids[a:b],
            char_offsets=self.char_offsets[a:b], has_pred=self.has_pred[a:b], topk_ids=self.topk_ids[a:b],
            topk_logprobs=None if self.topk_logprobs is None else self.topk_logprobs[a:b],
            topk_counts=None if self.topk_counts is None else self.topk_counts[a:b],
            residual=self.residual[a:b], realized_logprob=self.realized_logprob[a:b], content_hash=d.content_hash)


@dataclass
class AlignShardData:
    """Student tokens and chunks of one part for one student tokenizer (plain numpy)."""

    fingerprint: str
    shard_id: str
    doc_student_offsets: np.ndarray  # int64 [D+1]
    doc_chunk_offsets: np.ndarray  # int64 [D+1]
    student_ids: np.ndarray  # int32 [S]
    student_end: np.ndarray  # int32 [C] per-document exclusive ends
    teacher_end: np.ndarray  # int32 [C]
    exact: np.ndarray  # bool [C]

    def record(self, i: int) -> AlignmentRecord:
        from xtcache.align import Alignment

        a, b = int(self.doc_student_offsets[i]), int(self.doc_student_offsets[i + 1])
        c0, c1 = int(self.doc_chunk_offsets[i]), int(self.doc_chunk_offsets[i + 1])
        return AlignmentRecord(
            student_ids=self.student_ids[a:b],
            alignment=Alignment(student_end=self.student_end[c0:c1], teacher_end=self.teacher_end[c0:c1],
                                exact=self.exact[c0:c1]))


# ------------------------------------------------------------------------------- array encoding


def array_sha256(values: np.ndarray) -> str:
    """sha256 of an array's values in C order as little-endian bytes (bool as one byte 0/1)."""
    arr = np.ascontiguousarray(values)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _write_array(loc: Location, group: str, name: str, values: np.ndarray, *,
                 compression: codecs.Compression, transform: dict | None = None) -> ArraySpec:
    import zarr

    values = np.ascontiguousarray(values)
    row_bytes = max(1, values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64)))
    rows = max(1, min(values.shape[0], CHUNK_BYTES // row_bytes))
    chunks = (rows, *[max(1, s) for s in values.shape[1:]])
    n_chunks = max(1, -(-values.shape[0] // rows))
    shards = (rows * n_chunks, *chunks[1:])
    arr = zarr.create_array(
        loc.zarr_store, name=f"{group}/{name}", shape=values.shape, dtype=values.dtype, chunks=chunks,
        shards=shards, compressors=compression.zarr_codecs(values.dtype.itemsize), fill_value=0,
        attributes={"xtcache_transform": transform} if transform else {}, zarr_format=3, overwrite=True)
    if values.size:
        arr[...] = values
    return ArraySpec(
        name=name, dtype=values.dtype.name, shape=list(values.shape), chunks=list(chunks),
        transform=CodecConfig(**transform) if transform else None,
        compressors=[CodecConfig(**compression.to_config())], sha256=array_sha256(values),
        stored_bytes=loc.du(f"{group}/{name}/c"))


def _read_arrays(loc: Location, group: str, specs: list[ArraySpec], *, verify: bool,
                 shard: str) -> dict[str, np.ndarray]:
    """Read several arrays of one group concurrently (one round trip through Zarr's event loop)."""
    import asyncio

    from zarr.api import asynchronous as zarr_async
    from zarr.core.sync import sync

    async def one(spec: ArraySpec):
        try:
            arr = await zarr_async.open_array(store=loc.zarr_store, path=f"{group}/{spec.name}", mode="r")
            return await arr.getitem(Ellipsis)
        except Exception as e:  # zarr/numcodecs raise many kinds on damaged bytes
            return e

    async def gather():
        return await asyncio.gather(*(one(spec) for spec in specs))

    out = {}
    for spec, values in zip(specs, sync(gather())):
        if isinstance(values, Exception):
            raise CorruptionError(f"shard {shard}: array {spec.name!r} cannot be read: "
                                  f"{type(values).__name__}: {values}") from values
        out[spec.name] = _check_array(values, spec, verify=verify, shard=shard)
    return out


def _read_array(loc: Location, group: str, spec: ArraySpec, *, verify: bool, shard: str) -> np.ndarray:
    return _read_arrays(loc, group, [spec], verify=verify, shard=shard)[spec.name]


def _check_array(values: np.ndarray, spec: ArraySpec, *, verify: bool, shard: str) -> np.ndarray:
    if list(values.shape) != spec.shape or values.dtype.name != spec.dtype:
        raise CorruptionError(
            f"shard {shard}: array {spec.name!r} has shape {list(values.shape)} dtype {values.dtype.name}, "
            f"index says {spec.shape} {spec.dtype}")
    if verify and array_sha256(values) != spec.sha256:
        raise CorruptionError(f"shard {shard}: array {spec.name!r} checksum mismatch (stored bytes are damaged)")
    return values


def _concat(parts: list[np.ndarray], dtype, tail: tuple[int, ...] = ()) -> np.ndarray:
    if not parts:
        return np.zeros((0, *tail), dtype=dtype)
    return np.concatenate([np.asarray(p, dtype=dtype).reshape(-1, *tail) for p in parts])


def _offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


# ------------------------------------------------------------------------------------ the writer


class CacheWriter:
    """Writes the parts of one writer index into a store; see the module docstring for the protocol."""

    def __init__(self, url: str, manifest: Manifest, *, writer_index: int = 0,
                 storage_options: dict | None = None, resume: bool = False,
                 compression: dict[str, codecs.Compression] | None = None):
        self.loc = Location(url, storage_options)
        self.url = url
        self.writer_index = writer_index
        self.compression = compression or {}
        self.manifest = self._open_manifest(manifest)
        if not 0 <= writer_index < self.manifest.num_writers:
            raise StoreError(f"writer index {writer_index} is outside [0, {self.manifest.num_writers}) "
                             f"of the store at {url}")
        self.ids_codec = codecs.codec_from_config(self.manifest.codecs["topk_ids"])
        lp = self.manifest.codecs.get("topk_logprobs")
        self.lp_codec = codecs.codec_from_config(lp) if lp is not None else None
        self._claim(resume)
        # groups of an existing store, plus groups this writer brings (a later run adding a student)
        for group in [*self.manifest.alignment_groups, *manifest.alignment_groups]:
            self._declare_group(group)

    # -- setup

    def _open_manifest(self, manifest: Manifest) -> Manifest:
        manifest = manifest.model_copy(deep=True)
        if manifest.format_version != FORMAT_VERSION:
            raise FormatVersionError(f"cannot write format version {manifest.format_version}: "
                                     f"this xtcache writes version {FORMAT_VERSION}")
        if not manifest.codecs:
            manifest.codecs = {k: CodecConfig(**v) for k, v in
                               codecs.default_codecs(manifest.mode, manifest.teacher_vocab_size).items()}
        if manifest.mode == "full" and manifest.k != manifest.teacher_vocab_size:
            raise XtcacheError(f"full mode stores every id: k={manifest.k} must equal the vocab size "
                               f"{manifest.teacher_vocab_size}")
        if manifest.k > manifest.teacher_vocab_size:
            raise XtcacheError(f"k={manifest.k} is larger than the teacher vocabulary "
                               f"({manifest.teacher_vocab_size}); use --top-k at most the vocab size")
        if manifest.mode != "sampled" and "topk_logprobs" not in manifest.codecs:
            raise XtcacheError(f"mode {manifest.mode!r} needs a 'topk_logprobs' codec in the manifest")
        if not manifest.created:
            manifest.created = now_iso()
        if not manifest.xtcache_version:
            manifest.xtcache_version = _package_version()
        existing = self.loc.read_json("manifest.json")
        if existing is None:
            if self.loc.create_exclusive("manifest.json", manifest.model_dump(mode="json")):
                return manifest
            existing = self.loc.read_json("manifest.json")
        check_version(existing, f"store {self.url}")
        have = read_model(Manifest, existing, f"{self.url}/manifest.json")
        if have.cache_key != manifest.cache_key:
            raise StoreError(f"store at {self.url} was written for another teacher/corpus/settings: cache key "
                             f"{have.cache_key} != {manifest.cache_key}; use another --out")
        return have

    def _claim(self, resume: bool) -> None:
        self.claim_path = f"claims/w{self.writer_index:05d}.json"
        claim = WriterClaim(writer_index=self.writer_index, pid=os.getpid(), host=socket.gethostname(),
                            time=now_iso()).model_dump()
        if self.loc.create_exclusive(self.claim_path, claim):
            return
        other = self.loc.read_json(self.claim_path) or {}
        held_by = (f"writer {self.writer_index} of store {self.url} is claimed by pid {other.get('pid')} on "
                   f"{other.get('host')} since {other.get('time')}")
        if not resume:
            raise StoreError(f"{held_by}; if that process is gone, resume with --resume")
        if other.get("host") == socket.gethostname() and _pid_alive(other.get("pid")):
            raise StoreError(f"{held_by}, and that process is still running: --resume only takes over the "
                             "claim of a job that died")
        log.warning("taking over the claim of writer %d in %s (resume)", self.writer_index, self.url)
        self.loc.write_json_atomic(self.claim_path, claim)

    def _declare_group(self, group: AlignGroupMeta) -> None:
        path = f"align/{group.fingerprint}/group.json"
        if self.loc.read_json(path) is None:
            g = group.model_copy()
            g.created = g.created or now_iso()
            self.loc.create_exclusive(path, g.model_dump(mode="json"))

    # -- API

    def committed_parts(self) -> list[ShardMeta]:
        prefix = f"w{self.writer_index:05d}-"
        return [m for m in CacheReader.list_shards(self.loc, self.url) if m.shard_id.startswith(prefix)]

    def write_part(self, part_index: int, docs: list[DocRecord],
                   alignments: dict[str, list[AlignmentRecord]] | None = None) -> ShardMeta:
        """Write one part (teacher arrays + alignment groups) and commit it by writing its index last."""
        sid = shard_id(self.writer_index, part_index)
        alignments = alignments or {}
        for fp, recs in alignments.items():
            if not self.loc.exists(f"align/{fp}/group.json"):
                raise XtcacheError(f"alignment group {fp[:12]}.. is not declared: list it in "
                                   "Manifest.alignment_groups or call add_alignment_group")
            if len(recs) != len(docs):
                raise XtcacheError(f"alignment group {fp[:12]}..: {len(recs)} records for {len(docs)} documents")
        arrays = self._encode_docs(docs)
        self._remove_part(sid)
        group = f"shards/{sid}"
        specs = {name: _write_array(self.loc, group, name, values, compression=self._compression(name),
                                    transform=transform)
                 for name, (values, transform) in arrays.items()}
        for fp, recs in alignments.items():
            self._write_align_part(fp, sid, recs, [len(d.teacher_ids) for d in docs])
        stats = {"mean_topk_mass": _mean_topk_mass(docs, self.manifest.mode)}
        meta = ShardMeta(
            shard_id=sid, writer_index=self.writer_index, part_index=part_index, mode=self.manifest.mode,
            k=self.manifest.k, num_docs=len(docs), num_positions=int(sum(len(d.teacher_ids) for d in docs)),
            num_predicted=int(sum(int(np.count_nonzero(d.has_pred)) for d in docs)),
            docs=[DocId(source=d.source, row=d.row, content_hash=d.content_hash) for d in docs],
            arrays=specs, stats=stats, created=now_iso())
        self.loc.write_json_atomic(f"index/{sid}.json", meta.model_dump(mode="json"))
        return meta

    def add_alignment_group(self, group: AlignGroupMeta, shard_id: str, records: list[AlignmentRecord]) -> None:
        """Add (or rewrite) the alignment of one committed part for a student tokenizer."""
        meta = self.loc.read_json(f"index/{shard_id}.json")
        if meta is None:
            raise StoreError(f"shard {shard_id} is not committed in {self.url}; align only committed parts")
        shard = read_model(ShardMeta, meta, f"index/{shard_id}.json")
        if len(records) != shard.num_docs:
            raise XtcacheError(f"shard {shard_id} has {shard.num_docs} documents, got {len(records)} alignments")
        existing = self.loc.read_json(f"align/{group.fingerprint}/group.json")
        if existing is None:
            self._declare_group(group)
        lengths = _doc_lengths(self.loc, shard, self.url)
        self._write_align_part(group.fingerprint, shard_id, records, lengths)

    def finish(self, summary: dict | None = None) -> None:
        """Mark this writer done (all its parts written) and release its claim."""
        done = WriterDone(writer_index=self.writer_index, num_parts=len(self.committed_parts()),
                          time=now_iso(), summary=summary or {})
        self.loc.write_json_atomic(f"done/w{self.writer_index:05d}.json", done.model_dump(mode="json"))
        self.close()

    def close(self) -> None:
        """Release the writer's claim (idempotent)."""
        if getattr(self, "claim_path", None):
            self.loc.remove(self.claim_path)
            self.claim_path = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals

    def _compression(self, array: str) -> codecs.Compression:
        return self.compression.get(array) or codecs.default_compression(array)

    def _remove_part(self, sid: str) -> None:
        self.loc.remove(f"index/{sid}.json")
        for fp in self.loc.groups():
            self.loc.remove(f"align/{fp}/index/{sid}.json")
            self.loc.remove_tree(f"align/{fp}/shards/{sid}")
        self.loc.remove_tree(f"shards/{sid}")

    def _encode_docs(self, docs: list[DocRecord]) -> dict[str, tuple[np.ndarray, dict | None]]:
        m = self.manifest
        k, V = m.k, m.teacher_vocab_size
        for d in docs:
            _check_doc(d, k, m.mode)
        texts = [d.text.encode("utf-8") for d in docs]
        has_pred = _concat([d.has_pred for d in docs], np.bool_)
        ids = _concat([d.topk_ids for d in docs], np.int64, (k,))
        ids[~has_pred] = 0
        counts = None
        if m.mode == "sampled":
            counts = _concat([d.topk_counts for d in docs], np.uint16, (k,))
            counts[~has_pred] = 0
            codecs.check_ids(ids[counts > 0], V)
            # padding (count 0) sorts after the real ids and repeats the last real id (delta 0)
            order = np.argsort(np.where(counts > 0, ids, V), axis=1, kind="stable")
            ids = np.take_along_axis(np.where(counts > 0, ids, 0), order, axis=1)
            np.maximum.accumulate(ids, axis=1, out=ids)
            counts = np.take_along_axis(counts, order, axis=1)
        else:
            codecs.check_ids(ids[has_pred], V)
        deltas, order = self.ids_codec.encode(ids)
        if counts is not None:
            counts = np.take_along_axis(counts, order, axis=1)  # order is the identity here
        out: dict[str, tuple[np.ndarray, dict | None]] = {
            "doc_pos_offsets": (_offsets([len(d.teacher_ids) for d in docs]), None),
            "doc_text_offsets": (_offsets([len(t) for t in texts]), None),
            "doc_text": (np.frombuffer(b"".join(texts), dtype=np.uint8), None),
            "teacher_ids": (_concat([d.teacher_ids for d in docs], np.int32), None),
            "char_offsets": (_concat([d.char_offsets for d in docs], np.int32, (2,)), None),
            "has_pred": (has_pred, None),
            "topk_ids": (deltas, self.ids_codec.to_config()),
            "residual": (_concat([d.residual for d in docs], np.float32), None),
            "realized_logprob": (_concat([d.realized_logprob for d in docs], np.float32), None),
        }
        if counts is not None:
            out["topk_counts"] = (counts, None)
        else:
            lp = _concat([d.topk_logprobs for d in docs], np.float32, (k,))
            lp[~has_pred] = 0.0
            lp = np.take_along_axis(lp, order, axis=1)
            out["topk_logprobs"] = (self.lp_codec.encode(lp), self.lp_codec.to_config())
        return out

    def _write_align_part(self, fp: str, sid: str, records: list[AlignmentRecord], teacher_lengths: list[int]):
        for i, (r, t_len) in enumerate(zip(records, teacher_lengths)):
            a = r.alignment
            if len(a.teacher_end) and int(a.teacher_end[-1]) != t_len:
                raise XtcacheError(f"alignment of document {i} in shard {sid} ends at teacher token "
                                   f"{int(a.teacher_end[-1])}, the document has {t_len}")
            if len(a.student_end) and int(a.student_end[-1]) != len(r.student_ids):
                raise XtcacheError(f"alignment of document {i} in shard {sid} ends at student token "
                                   f"{int(a.student_end[-1])}, the document has {len(r.student_ids)}")
        base = f"align/{fp}"
        self.loc.remove(f"{base}/index/{sid}.json")
        self.loc.remove_tree(f"{base}/shards/{sid}")
        s_end = _concat([r.alignment.student_end for r in records], np.int32)
        t_end = _concat([r.alignment.teacher_end for r in records], np.int32)
        exact = _concat([r.alignment.exact for r in records], np.bool_)
        arrays = {
            "doc_student_offsets": _offsets([len(r.student_ids) for r in records]),
            "doc_chunk_offsets": _offsets([len(r.alignment.student_end) for r in records]),
            "student_ids": _concat([r.student_ids for r in records], np.int32),
            "student_end": s_end, "teacher_end": t_end, "exact": exact,
        }
        group = f"{base}/shards/{sid}"
        specs = {n: _write_array(self.loc, group, n, v, compression=self._compression(n)) for n, v in arrays.items()}
        meta = AlignPartMeta(
            fingerprint=fp, shard_id=sid, num_docs=len(records), num_student_tokens=len(arrays["student_ids"]),
            num_chunks=len(s_end), chunk_shapes=chunk_shape_counts(records), num_exact=int(exact.sum()),
            arrays=specs, created=now_iso())
        self.loc.write_json_atomic(f"{base}/index/{sid}.json", meta.model_dump(mode="json"))


def chunk_shape_counts(records: list[AlignmentRecord]) -> dict[str, int]:
    """Counts of chunks by (student tokens : teacher tokens) shape: 1:1, 1:n, n:1, n:m, empty."""
    out = {"1:1": 0, "1:n": 0, "n:1": 0, "n:m": 0, "empty": 0}
    for r in records:
        s = np.diff(np.asarray(r.alignment.student_end, dtype=np.int64), prepend=0)
        t = np.diff(np.asarray(r.alignment.teacher_end, dtype=np.int64), prepend=0)
        out["empty"] += int(np.count_nonzero((s == 0) | (t == 0)))
        out["1:1"] += int(np.count_nonzero((s == 1) & (t == 1)))
        out["1:n"] += int(np.count_nonzero((s == 1) & (t > 1)))
        out["n:1"] += int(np.count_nonzero((s > 1) & (t == 1)))
        out["n:m"] += int(np.count_nonzero((s > 1) & (t > 1)))
    return out


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xtcache")
    except PackageNotFoundError:
        return "unknown"


def _check_doc(d: DocRecord, k: int, mode: str) -> None:
    T = len(d.teacher_ids)
    want = {"char_offsets": (T, 2), "has_pred": (T,), "topk_ids": (T, k), "residual": (T,),
            "realized_logprob": (T,)}
    if mode == "sampled":
        want["topk_counts"] = (T, k)
        if d.topk_counts is None:
            raise XtcacheError(f"document {d.doc_id}: sampled mode needs topk_counts")
    else:
        want["topk_logprobs"] = (T, k)
        if d.topk_logprobs is None:
            raise XtcacheError(f"document {d.doc_id}: mode {mode!r} needs topk_logprobs")
    for name, shape in want.items():
        got = tuple(np.shape(getattr(d, name)))
        if got != shape and not (T == 0 and int(np.prod(got)) == 0):
            if name == "topk_ids" and len(got) == 2 and got[0] == T:
                raise XtcacheError(f"document {d.doc_id}: top-k width {got[1]} != k={k} of the store")
            raise XtcacheError(f"document {d.doc_id}: {name} has shape {got}, expected {shape}")


def _mean_topk_mass(docs: list[DocRecord], mode: str) -> float:
    if mode == "sampled":
        return float("nan")
    total, n = 0.0, 0
    for d in docs:
        if len(d.teacher_ids) == 0:
            continue
        lp = np.asarray(d.topk_logprobs, dtype=np.float64)[d.has_pred]
        total += float(np.exp(lp).sum())
        n += lp.shape[0]
    return total / n if n else float("nan")


def _doc_lengths(loc: Location, shard: ShardMeta, url: str) -> list[int]:
    offs = _read_array(loc, f"shards/{shard.shard_id}", shard.arrays["doc_pos_offsets"], verify=True,
                       shard=shard.shard_id)
    return np.diff(offs).tolist()


# ------------------------------------------------------------------------------------ the reader


def _pid_alive(pid) -> bool:
    """Whether a process with this pid runs on this host (never true for our own pid: we may resume ourselves)."""
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def missing_parts(done: dict[int, WriterDone], shards: list[ShardMeta]) -> dict[int, tuple[int, int]]:
    """Writers whose done marker counts more parts than are committed: {writer: (counted, committed)}."""
    committed: dict[int, int] = {}
    for m in shards:
        committed[m.writer_index] = committed.get(m.writer_index, 0) + 1
    return {i: (d.num_parts, committed.get(i, 0)) for i, d in done.items() if committed.get(i, 0) < d.num_parts}


class CacheReader:
    """Reads committed parts of a store; refuses stores of unknown format versions."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.loc = Location(url, storage_options)
        raw = self.loc.read_json("manifest.json")
        if raw is None:
            raise StoreError(f"{url} is not an xtcache store (no manifest.json); "
                             "pass the directory written by `xtcache teacher-dump`")
        check_version(raw, f"store {url}")
        self.manifest: Manifest = read_model(Manifest, raw, f"{url}/manifest.json")
        self.shards: list[ShardMeta] = self.list_shards(self.loc, url)
        self._codecs = {k: codecs.codec_from_config(v) for k, v in self.manifest.codecs.items()}

    @staticmethod
    def list_shards(loc: Location, url: str) -> list[ShardMeta]:
        out = []
        for name in sorted(loc.listdir("index")):
            if not name.endswith(".json"):
                continue
            raw = loc.read_json(f"index/{name}")
            if raw is None:
                continue
            check_version(raw, f"shard {name[:-5]} of {url}")
            out.append(read_model(ShardMeta, raw, f"{url}/index/{name}"))
        return out

    def refresh(self) -> None:
        self.shards = self.list_shards(self.loc, self.url)

    def shard(self, sid: str) -> ShardMeta:
        for m in self.shards:
            if m.shard_id == sid:
                return m
        raise StoreError(f"shard {sid} is not committed in {self.url}")

    def alignment_groups(self) -> dict[str, AlignGroupMeta]:
        """Alignment groups keyed by student tokenizer fingerprint, stats summed over committed parts."""
        out = {}
        for fp in self.loc.groups():
            raw = self.loc.read_json(f"align/{fp}/group.json")
            if raw is None:
                continue
            check_version(raw, f"alignment group {fp} of {self.url}")
            g = read_model(AlignGroupMeta, raw, f"{self.url}/align/{fp}/group.json")
            parts = self.alignment_parts(fp)
            stats = dict(g.stats)
            stats.update({"parts": len(parts), "documents": sum(p.num_docs for p in parts.values()),
                          "student_tokens": sum(p.num_student_tokens for p in parts.values()),
                          "chunks": sum(p.num_chunks for p in parts.values()),
                          "exact_chunks": sum(p.num_exact for p in parts.values())})
            for shape in ("1:1", "1:n", "n:1", "n:m", "empty"):
                stats[f"chunks_{shape}"] = sum(p.chunk_shapes.get(shape, 0) for p in parts.values())
            g.stats = stats
            out[fp] = g
        return out

    def alignment_parts(self, fingerprint: str) -> dict[str, AlignPartMeta]:
        """Committed alignment parts of one group whose teacher part is committed too."""
        committed = {m.shard_id for m in self.shards}
        out = {}
        for name in sorted(self.loc.listdir(f"align/{fingerprint}/index")):
            sid = name[:-5]
            if not name.endswith(".json") or sid not in committed:
                continue
            raw = self.loc.read_json(f"align/{fingerprint}/index/{name}")
            if raw is None:
                continue
            check_version(raw, f"alignment part {sid} of group {fingerprint}")
            out[sid] = read_model(AlignPartMeta, raw, f"{self.url}/align/{fingerprint}/index/{name}")
        return out

    def read_shard(self, sid: str, *, verify: bool = False) -> ShardData:
        """Decode one committed part; `verify` also checks every array's sha256."""
        meta = self.shard(sid)
        group = f"shards/{sid}"
        missing = [n for n in ("doc_pos_offsets", "doc_text_offsets", "doc_text", "teacher_ids", "char_offsets",
                               "has_pred", "topk_ids", "residual", "realized_logprob") if n not in meta.arrays]
        if missing:
            raise CorruptionError(f"shard {sid}: index lists no array {missing[0]!r}")
        raw = _read_arrays(self.loc, group, list(meta.arrays.values()), verify=verify, shard=sid)
        ids = codecs.codec_from_config(meta.arrays["topk_ids"].transform).decode(raw["topk_ids"])
        logprobs = None
        if "topk_logprobs" in raw:
            logprobs = codecs.codec_from_config(meta.arrays["topk_logprobs"].transform).decode(raw["topk_logprobs"])
        text_offs = raw["doc_text_offsets"]
        blob = raw["doc_text"].tobytes()
        texts = [blob[text_offs[i]:text_offs[i + 1]].decode("utf-8") for i in range(meta.num_docs)]
        pos = raw["doc_pos_offsets"]
        if len(pos) != meta.num_docs + 1 or int(pos[-1]) != meta.num_positions or len(ids) != meta.num_positions:
            raise CorruptionError(f"shard {sid}: array 'doc_pos_offsets' disagrees with the index counts "
                                  f"({meta.num_docs} docs, {meta.num_positions} positions)")
        return ShardData(
            shard_id=sid, docs=list(meta.docs), texts=texts, doc_pos_offsets=pos, teacher_ids=raw["teacher_ids"],
            char_offsets=raw["char_offsets"], has_pred=raw["has_pred"], topk_ids=ids, topk_logprobs=logprobs,
            topk_counts=raw.get("topk_counts"), residual=raw["residual"], realized_logprob=raw["realized_logprob"])

    def doc_pos_offsets(self, sid: str) -> np.ndarray:
        """int64 [D+1] position offsets of one part's documents, without decoding anything else."""
        meta = self.shard(sid)
        return _read_array(self.loc, f"shards/{sid}", meta.arrays["doc_pos_offsets"], verify=False, shard=sid)

    def read_alignment(self, fingerprint: str, sid: str, *, verify: bool = False) -> AlignShardData:
        parts = self.alignment_parts(fingerprint)
        if sid not in parts:
            raise StoreError(f"no committed alignment of shard {sid} for student tokenizer {fingerprint[:12]}.. "
                             f"in {self.url}; run `xtcache align` for that tokenizer")
        meta = parts[sid]
        group = f"align/{fingerprint}/shards/{sid}"
        raw = _read_arrays(self.loc, group, list(meta.arrays.values()), verify=verify,
                           shard=f"{sid} (alignment {fingerprint[:12]}..)")
        return AlignShardData(fingerprint=fingerprint, shard_id=sid, **raw)

    def is_complete(self) -> bool:
        """True when every writer of the manifest wrote its done marker and all the parts it counted
        are still committed (a part whose index was lost makes the store incomplete again)."""
        done = self.writer_summaries()
        if len(done) < self.manifest.num_writers:
            return False
        return not missing_parts(done, self.shards)

    def writer_summaries(self) -> dict[int, WriterDone]:
        out = {}
        for i in range(self.manifest.num_writers):
            raw = self.loc.read_json(f"done/w{i:05d}.json")
            if raw is not None:
                out[i] = read_model(WriterDone, raw, f"done/w{i:05d}.json")
        return out

    def total_bytes(self) -> int:
        return self.loc.du("")


# ------------------------------------------------------------------------------ cache directories


@dataclass
class CacheInfo:
    url: str
    key: str
    size: int
    created: str
    documents: int
    positions: int
    complete: bool
    problem: str = ""
    extra: dict = field(default_factory=dict)


def cache_path_for(cache_dir: str, cache_key: str) -> str:
    """Where the cache with `cache_key` lives under `cache_dir` (a local path or fsspec URL)."""
    return f"{cache_dir.rstrip('/')}/xtc-{cache_key[:16]}"


def find_cache(cache_dir: str, cache_key: str, storage_options: dict | None = None) -> str | None:
    """URL of the complete cache for `cache_key` under `cache_dir`, or None."""
    url = cache_path_for(cache_dir, cache_key)
    try:
        reader = CacheReader(url, storage_options)
    except StoreError:
        return None
    if reader.manifest.cache_key != cache_key or not reader.is_complete():
        return None
    return url


def list_caches(cache_dir: str, storage_options: dict | None = None) -> list[CacheInfo]:
    """Every xtcache store directly under `cache_dir`, complete or not."""
    loc = Location(cache_dir, storage_options)
    out = []
    for name in sorted(loc.listdir("")):
        url = f"{cache_dir.rstrip('/')}/{name}"
        if not loc.exists(f"{name}/manifest.json"):
            continue
        try:
            r = CacheReader(url, storage_options)
        except XtcacheError as e:
            out.append(CacheInfo(url=url, key="?", size=0, created="", documents=0, positions=0,
                                 complete=False, problem=str(e)))
            continue
        out.append(CacheInfo(url=url, key=r.manifest.cache_key, size=r.total_bytes(), created=r.manifest.created,
                             documents=sum(s.num_docs for s in r.shards),
                             positions=sum(s.num_positions for s in r.shards), complete=r.is_complete()))
    return out


__all__ = [
    "FORMAT_VERSION", "AlignGroupMeta", "AlignPartMeta", "AlignShardData", "AlignmentRecord", "ArraySpec",
    "CacheInfo", "CacheReader", "CacheWriter", "CodecConfig", "DocRecord", "Manifest", "ShardData", "ShardMeta",
    "cache_path_for", "find_cache", "list_caches", "shard_id",
]
