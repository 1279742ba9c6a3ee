"""The writer of a teacher-cache store: `CacheWriter`, one per writer process.

Each writer owns the parts "w{writer:05d}-p{part:06d}". A part becomes visible only when its index
file `index/<shard>.json` is written, last and atomically; readers list index files only, so a
half-written part is invisible and a rewrite of the same part on resume is deterministic. The
arrays a part holds are the table of `schemas/arrays.py`; the layout is `schemas/STORE_FORMAT.md`.

A writer holds its claim (`xtcache/store/claims.py`) and checks it before committing each part;
`xtcache align` writes through a writer that holds the alignment lock instead (`for_align`).
"""

from __future__ import annotations

import logging

import numpy as np

from schemas.arrays import align_arrays, entry_widths, teacher_arrays
from schemas.models import (
    DRAWN_MODES,
    FORMAT_VERSION,
    READ_VERSIONS,
    AlignGroupMeta,
    AlignPartMeta,
    CodecConfig,
    DocId,
    Manifest,
    ShardMeta,
    WriterDone,
)
from schemas.roles import LAST_ASSISTANT, ROLE_NAMES
from xtcache.align import chunks as align
from xtcache.errors import FormatVersionError, StoreError, XtcacheError
from xtcache.location import Location, check_version, now_iso, read_model
from xtcache.store import codecs
from xtcache.store.arrays import concat as _concat
from xtcache.store.arrays import default_compression, read_arrays, write_array
from xtcache.store.arrays import offsets as _offsets
from xtcache.store.claims import Claim, acquire_align_lock, writer_claim_path
from xtcache.store.reader import list_shards
from xtcache.store.records import AlignmentRecord, DocRecord

log = logging.getLogger(__name__)


def shard_id(writer_index: int, part_index: int) -> str:
    return f"w{writer_index:05d}-p{part_index:06d}"



class CacheWriter:
    """Writes the parts of one writer index into a store; see the module docstring for the protocol."""

    def __init__(self, url: str, manifest: Manifest, *, writer_index: int = 0,
                 storage_options: dict | None = None, resume: bool = False,
                 compression: dict[str, codecs.Compression] | None = None, for_align: bool = False):
        """`for_align`: hold the store's alignment lock instead of a writer claim (`xtcache align`,
        which only adds alignment groups to committed parts)."""
        self.claim: Claim | None = None
        self.loc = Location(url, storage_options)
        self.url = url
        self.writer_index = writer_index
        self.compression = compression or {}
        self.manifest = self._open_manifest(manifest)
        if not 0 <= writer_index < self.manifest.num_writers:
            raise StoreError(f"writer index {writer_index} is outside [0, {self.manifest.num_writers}) "
                             f"of the store at {url}")
        self.ids_codec = codecs.codec_from_config(self.manifest.codecs["topk_ids"])
        problem = codecs.id_runs_problem(self.ids_codec, self.manifest.mode, self.manifest.top_k,
                                         self.manifest.format_version)
        if problem:
            raise XtcacheError(f"store {url}: {problem}")
        lp = self.manifest.codecs.get("topk_logprobs")
        self.lp_codec = codecs.codec_from_config(lp) if lp is not None else None
        if for_align:
            self.claim = acquire_align_lock(self.loc, "another `xtcache align`")
        else:
            self._claim(resume)
        # groups of an existing store, plus groups this writer brings (a later run adding a student)
        for group in [*self.manifest.alignment_groups, *manifest.alignment_groups]:
            self._declare_group(group)

    # -- setup

    def _open_manifest(self, manifest: Manifest) -> Manifest:
        manifest = manifest.model_copy(deep=True)
        # new stores get FORMAT_VERSION; an older store (read back to add an alignment group) keeps its own
        if manifest.format_version not in READ_VERSIONS or (manifest.conversation and manifest.format_version < 2):
            raise FormatVersionError(f"cannot write format version {manifest.format_version}"
                                     f"{' with conversations' if manifest.conversation else ''}: this xtcache writes "
                                     f"version {FORMAT_VERSION} (and adds alignment groups to version 1 stores)")
        if not manifest.codecs:
            manifest.codecs = {k: CodecConfig(**v) for k, v in codecs.default_codecs(
                manifest.mode, manifest.teacher_vocab_size, manifest.format_version, manifest.k,
                manifest.top_k).items()}
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
        claim = Claim(self.loc, writer_claim_path(self.writer_index), self.writer_index, f"writer {self.writer_index}")
        claim.require_exclusive(several=self.manifest.num_writers > 1)
        claim.acquire(resume=resume)
        self.claim = claim

    def _declare_group(self, group: AlignGroupMeta) -> None:
        path = f"align/{group.fingerprint}/group.json"
        if self.loc.read_json(path) is None:
            g = group.model_copy()
            g.created = g.created or now_iso()
            g.format_version = self.manifest.format_version
            self.loc.create_exclusive(path, g.model_dump(mode="json"))

    # -- API

    def committed_parts(self) -> list[ShardMeta]:
        prefix = f"w{self.writer_index:05d}-"
        return [m for m in list_shards(self.loc, self.url) if m.shard_id.startswith(prefix)]

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
        self._remove_part(sid, set(alignments))
        group = f"shards/{sid}"
        specs = {name: write_array(self.loc, group, name, values, compression=self._compression(name),
                                    transform=transform)
                 for name, (values, transform) in arrays.items()}
        for fp, recs in alignments.items():
            self._write_align_part(fp, sid, recs, [len(d.teacher_ids) for d in docs])
        stats = {"mean_topk_mass": _mean_topk_mass(docs, self.manifest.mode)}
        meta = ShardMeta(
            format_version=self.manifest.format_version, shard_id=sid, writer_index=self.writer_index, part_index=part_index, mode=self.manifest.mode,
            k=self.manifest.k, teacher_vocab_size=self.manifest.teacher_vocab_size, num_docs=len(docs), num_positions=int(sum(len(d.teacher_ids) for d in docs)),
            num_predicted=int(sum(int(np.count_nonzero(d.has_pred)) for d in docs)),
            docs=[DocId(source=d.source, row=d.row, content_hash=d.content_hash) for d in docs],
            arrays=specs, stats=stats, created=now_iso())
        self.claim.check(f"committing part {sid}")
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
        if self.loc.read_json(f"index/{shard_id}.json") != meta:  # the teacher part was rewritten meanwhile
            self.loc.remove(f"align/{group.fingerprint}/index/{shard_id}.json")
            raise StoreError(f"store {self.url}: teacher part {shard_id} was rewritten while its alignment was "
                             "written; run `xtcache align` again once the dump has finished")

    def finish(self, summary: dict | None = None) -> None:
        """Mark this writer done (all its parts written) and release its claim."""
        done = WriterDone(format_version=self.manifest.format_version, writer_index=self.writer_index, num_parts=len(self.committed_parts()),
                          time=now_iso(), summary=summary or {})
        self.claim.check("marking the writer done")
        self.loc.write_json_atomic(f"done/w{self.writer_index:05d}.json", done.model_dump(mode="json"))
        self.close()

    def close(self) -> None:
        """Release the writer's claim if it still holds it (idempotent)."""
        if getattr(self, "claim", None) is not None:
            self.claim.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals

    def _compression(self, array: str) -> codecs.Compression:
        return self.compression.get(array) or default_compression(array, self.manifest.format_version)

    def _remove_part(self, sid: str, own_groups: set[str]) -> None:
        """Remove what a part left behind before it is (re)written. Another group's alignment part of
        it (written by `xtcache align` while the part was committed) is removed under the alignment
        lock only, so a running `xtcache align` never loses a part to a dump, nor a dump to it."""
        others = [fp for fp in self.loc.groups() if fp not in own_groups and (
            self.loc.exists(f"align/{fp}/index/{sid}.json") or self.loc.exists(f"align/{fp}/shards/{sid}"))]
        lock = None
        if others or self.loc.exists(f"index/{sid}.json"):
            lock = acquire_align_lock(self.loc, f"writer {self.writer_index} (rewriting part {sid}, which that "
                                                "alignment covers)")
        try:
            self.loc.remove(f"index/{sid}.json")
            for fp in self.loc.groups():
                self.loc.remove(f"align/{fp}/index/{sid}.json")
                self.loc.remove_tree(f"align/{fp}/shards/{sid}")
            self.loc.remove_tree(f"shards/{sid}")
        finally:
            if lock is not None:
                lock.release()

    def _encode_docs(self, docs: list[DocRecord]) -> dict[str, tuple[np.ndarray, dict | None]]:
        m = self.manifest
        k, V = m.k, m.teacher_vocab_size
        widths = entry_widths(m.mode, k, m.top_k)
        for d in docs:
            _check_doc(d, widths, m.mode)
        texts = [d.text.encode("utf-8") for d in docs]
        has_pred = _concat([d.has_pred for d in docs], np.bool_)
        kh, kt = widths["k_head"], widths["k_tail"]
        ids = _concat([d.topk_ids for d in docs], np.int64, (k,))
        ids[~has_pred] = 0
        counts, lp = None, None
        if m.mode != "sampled":
            lp = _concat([d.topk_logprobs for d in docs], np.float32, (kh,))
            lp[~has_pred] = 0.0
            codecs.check_ids(ids[:, :kh][has_pred], V)
        if m.mode in DRAWN_MODES:  # the drawn entries: ids [:, kh:] with their counts
            counts = _concat([d.topk_counts for d in docs], np.uint16, (kt,))
            counts[~has_pred] = 0
            drawn, real = ids[:, kh:], counts > 0
            codecs.check_ids(drawn[real], V)
            # padding (count 0) sorts after the real ids and repeats the last real id (delta 0)
            pre = np.argsort(np.where(real, drawn, V), axis=1, kind="stable")
            drawn[:] = np.take_along_axis(np.where(real, drawn, 0), pre, axis=1)
            np.maximum.accumulate(drawn, axis=1, out=drawn)
            counts = np.take_along_axis(counts, pre, axis=1)
        id_dict = None
        if isinstance(self.ids_codec, codecs.DictDeltaIds):  # topk mode: codes into the part's dictionary
            dictionary = self.ids_codec.dictionary(ids)
            deltas, order = self.ids_codec.encode(ids, dictionary)
            id_dict = (self.ids_codec.encode_dictionary(dictionary), self.ids_codec.to_config())
        else:
            deltas, order = self.ids_codec.encode(ids)  # headtail: head and tail sorted apart (codec `head`)
        if counts is not None:
            counts = np.take_along_axis(counts, order[:, kh:] - kh, axis=1)  # the identity: sorted above
        out: dict[str, tuple[np.ndarray, dict | None]] = {
            "doc_pos_offsets": (_offsets([len(d.teacher_ids) for d in docs]), None),
            "doc_text_offsets": (_offsets([len(t) for t in texts]), None),
            "doc_text": (np.frombuffer(b"".join(texts), dtype=np.uint8), None),
            "teacher_ids": (_concat([d.teacher_ids for d in docs], np.int32), None),
            "char_offsets": self._char_offsets(docs),
            "has_pred": (has_pred, None),
            "topk_ids": (deltas, self.ids_codec.to_config()),
            "residual": (_concat([d.residual for d in docs], codecs.side_dtype(m.format_version)), None),
            "realized_logprob": (_concat([d.realized_logprob for d in docs], codecs.side_dtype(m.format_version)),
                                 None),
        }
        if counts is not None:
            out["topk_counts"] = (counts, None)
        if id_dict is not None:
            out["topk_id_dict"] = id_dict
        if lp is not None:
            lp = np.take_along_axis(lp, order[:, :kh], axis=1)
            out["topk_logprobs"] = (self.lp_codec.encode(lp), self.lp_codec.to_config())
        if m.conversation:
            if any(d.conversation is None for d in docs):
                raise XtcacheError("a conversation store needs every document's conversation (DocRecord.conversation)")
            convs = [d.conversation.encode("utf-8") for d in docs]
            out["doc_conversation_offsets"] = (_offsets([len(c) for c in convs]), None)
            out["doc_conversation"] = (np.frombuffer(b"".join(convs), dtype=np.uint8), None)
        arrays = teacher_arrays(m.mode, m.conversation, id_dictionary=id_dict is not None)
        return {a.name: out[a.name] for a in arrays}  # the contract's order

    def _char_offsets(self, docs: list[DocRecord]) -> tuple[np.ndarray, dict | None]:
        """The part's char_offsets, delta coded when the manifest names a transform for them (version 3)."""
        values = _concat([d.char_offsets for d in docs], np.int32, (2,))
        cfg = self.manifest.codecs.get("char_offsets")
        if cfg is None:
            return values, None
        codec = codecs.codec_from_config(cfg)
        return codec.encode(values, _offsets([len(d.teacher_ids) for d in docs])), codec.to_config()

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
        conversation = {}
        roles = [r.student_role is not None for r in records]
        if self.manifest.conversation or any(roles):  # conversations; text rollouts (prompt and completion roles)
            if not all(roles) or any(len(r.student_role) != len(r.student_ids) for r in records):
                kind = "a conversation store" if self.manifest.conversation else "a part of text rollouts"
                raise XtcacheError(f"alignment part {sid}: {kind} needs a role per student token of every document")
            arrays["student_role"] = _concat([r.student_role for r in records], np.uint8)
            if self.manifest.conversation:
                conversation = conversation_counts(records, arrays["student_role"])
            else:  # text rollouts: the sampled completions' counts only (STORE_FORMAT.md 5.2)
                conversation = rollout_counts(records)
            if any(r.sampled_logprobs is not None for r in records):  # the sampling student's group of rollouts
                arrays["sampled_logprobs"] = _sampled(records, sid)
        if list(arrays) != [a.name for a in align_arrays(self.manifest.conversation) if a.name in arrays or
                            not a.optional]:
            raise XtcacheError(f"alignment part {sid}: arrays {list(arrays)} are not the contract's "
                               "(schemas/arrays.py align_arrays)")
        group = f"{base}/shards/{sid}"
        specs = {n: write_array(self.loc, group, n, v, compression=self._compression(n)) for n, v in arrays.items()}
        meta = AlignPartMeta(
            fingerprint=fp, shard_id=sid, num_docs=len(records), num_student_tokens=len(arrays["student_ids"]),
            num_chunks=len(s_end), chunk_shapes=chunk_shape_counts(records), num_exact=int(exact.sum()),
            conversation=conversation, arrays=specs, created=now_iso(), format_version=self.manifest.format_version)
        self.loc.write_json_atomic(f"{base}/index/{sid}.json", meta.model_dump(mode="json"))


def conversation_counts(records: list[AlignmentRecord], roles: np.ndarray) -> dict[str, int]:
    """Character counts of a conversation part's alignment and its student tokens by role."""
    keys = ["content_chars", "shared_chars", "unaligned_chars", "unaligned_spans", "misaligned_chars"]
    out = {k: sum(int((r.stats or {}).get(k, 0)) for r in records) for k in keys} | rollout_counts(records)
    base = np.bincount(roles & 0x7F, minlength=len(ROLE_NAMES))
    for code, name in ROLE_NAMES.items():
        out[f"role_{name}"] = int(base[code])
    out["role_last_assistant"] = int(np.count_nonzero(roles & LAST_ASSISTANT))
    return out


ROLLOUT_COUNTS = ("sampled_turns", "sampled_mismatch", "sampled_same_text")  # stage1_teacher.onpolicy.sampled


def rollout_counts(records: list[AlignmentRecord]) -> dict[str, int]:
    """The sampled turns of a part's rollouts in the sampling student's group, those whose sampled ids are not
    the re-tokenized ids, and of them those spliced in; {} for a group or part without rollouts."""
    if not any("sampled_turns" in (r.stats or {}) for r in records):
        return {}
    return {k: sum(int((r.stats or {}).get(k, 0)) for r in records) for k in ROLLOUT_COUNTS}


def _sampled(records: list[AlignmentRecord], sid: str) -> np.ndarray:
    """float32 [S] sampling log-probs of a part's student tokens; NaN for documents that have none."""
    out = []
    for i, r in enumerate(records):
        lp = r.sampled_logprobs
        if lp is not None and len(lp) != len(r.student_ids):
            raise XtcacheError(f"alignment part {sid}: document {i} has {len(lp)} sampling log-probs for "
                               f"{len(r.student_ids)} student tokens")
        out.append(np.full(len(r.student_ids), np.nan, np.float32) if lp is None else lp)
    return _concat(out, np.float32)


def chunk_shape_counts(records: list[AlignmentRecord]) -> dict[str, int]:
    """Counts of chunks by (student tokens : teacher tokens) shape: 1:1, 1:n, n:1, n:m, empty."""
    return align.chunk_shape_counts([r.alignment for r in records])


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xtcache")
    except PackageNotFoundError:
        return "unknown"


def _check_doc(d: DocRecord, widths: dict[str, int], mode: str) -> None:
    T, k = len(d.teacher_ids), widths["k"]
    want = {"char_offsets": (T, 2), "has_pred": (T,), "topk_ids": (T, k), "residual": (T,),
            "realized_logprob": (T,)}
    if mode in DRAWN_MODES:
        want["topk_counts"] = (T, widths["k_tail"])
        if d.topk_counts is None:
            raise XtcacheError(f"document {d.doc_id}: {mode} mode needs topk_counts")
    if mode != "sampled":
        want["topk_logprobs"] = (T, widths["k_head"])
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
    offs = read_arrays(loc, f"shards/{shard.shard_id}", [shard.arrays["doc_pos_offsets"]], sha256=True,
                       where=f"store {url}, teacher part {shard.shard_id}")["doc_pos_offsets"]
    return np.diff(offs).tolist()
