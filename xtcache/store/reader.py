"""The reader of a teacher-cache store: `CacheReader`, the one read path of every consumer.

`xtcache verify`, `xtcache inspect`, `xtcache align` and the stage-2 loader all read through it.
Every read is checked (schemas/STORE_FORMAT.md section 9, in that order): format version and schema
of each JSON document, the part index against the manifest (mode, k, vocabulary, transforms) and
against the array table of `schemas/arrays.py`, every chunk object present and its crc32c
(`xtcache/store/arrays.py`), shapes against the index counts, offsets and decoded ids in range.
`verify=True` adds the sha256 of every array and the content hash of every document: `xtcache
verify` is that read of every part, and nothing else.

    python -c "from xtcache.store import CacheReader; r = CacheReader('out/cache'); print(r.shards)"
"""

from __future__ import annotations

import logging

import numpy as np

from schemas.arrays import ArrayDef, align_arrays, entry_widths, teacher_arrays
from schemas.models import AlignGroupMeta, AlignPartMeta, ArraySpec, Manifest, ShardMeta, WriterDone
from xtcache.errors import ConfigError, CorruptionError, StoreError, XtcacheError
from xtcache.fingerprint import content_hash
from xtcache.location import Location, check_version, read_model
from xtcache.store import codecs
from xtcache.store.arrays import read_arrays
from xtcache.store.records import AlignShardData, ShardData

log = logging.getLogger(__name__)


def list_shards(loc: Location, url: str, problems: list[str] | None = None) -> list[ShardMeta]:
    """Committed teacher parts (their index files), sorted; a bad index raises, or is appended to
    `problems` and skipped when a list is given (`xtcache verify --all`)."""
    out = []
    for name in sorted(loc.listdir("index")):
        if not name.endswith(".json"):
            continue
        try:
            raw = loc.read_json(f"index/{name}")
            if raw is None:
                continue
            check_version(raw, f"store {url}, teacher part {name[:-5]}")
            out.append(read_model(ShardMeta, raw, f"{url}/index/{name}"))
        except XtcacheError as e:
            if problems is None:
                raise
            problems.append(str(e))
    return out


def missing_parts(done: dict[int, WriterDone], shards: list[ShardMeta]) -> dict[int, tuple[int, int]]:
    """Writers whose done marker counts more parts than are committed: {writer: (counted, committed)}."""
    committed: dict[int, int] = {}
    for m in shards:
        committed[m.writer_index] = committed.get(m.writer_index, 0) + 1
    return {i: (d.num_parts, committed.get(i, 0)) for i, d in done.items() if committed.get(i, 0) < d.num_parts}


def _check_manifest(m: Manifest, url: str) -> None:
    # k against the vocabulary: Manifest's own validator (schemas.models.support_width)
    need = {"topk_ids"} | ({"topk_logprobs"} if m.mode != "sampled" else set())
    if not need <= set(m.codecs):
        raise CorruptionError(f"store {url}: manifest.json names no transform for {sorted(need - set(m.codecs))} "
                              f"(mode {m.mode})")


# the entries of a store's root (schemas/STORE_FORMAT.md, section 2, and the writers' corpus digests); `.tmp-`
# files are an atomic write's. Anything else there is not the store's, and no command removes it.
STORE_ENTRIES = frozenset({"manifest.json", "zarr.json", "claims", "done", "shard_plan.json", "capture_checks",
                           "teacher_tokenizer", "index", "shards", "align", "corpus_digests"})


def foreign_entries(loc: Location, known: frozenset[str] = STORE_ENTRIES) -> list[str]:
    """The entries at the root of `loc` that are not among `known` (a store's: STORE_ENTRIES) nor an atomic
    write's temp file, sorted."""
    return [e for e in loc.listdir("") if e not in known and not e.startswith(".tmp-")]


def shown_entries(names: list[str]) -> str:
    """The first three of `names` for an error message, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def read_manifest(url: str, storage_options: dict | None = None, *, loc: Location | None = None) -> Manifest:
    """The store's manifest.json, checked (version, fields, a transform for every array its mode stores); a
    directory without one is refused as not a store. The first thing `CacheReader` reads, and all that
    train-student reads of each store before it starts DeepSpeed (stage2_student.cli)."""
    loc = loc or Location(url, storage_options)
    raw = loc.read_json("manifest.json")
    if raw is None:
        raise StoreError(f"{url} is not an xtcache store (no manifest.json); "
                         "pass the directory written by `xtcache teacher-dump`")
    check_version(raw, f"store {url}")
    manifest: Manifest = read_model(Manifest, raw, f"{url}/manifest.json")
    _check_manifest(manifest, url)
    return manifest


class CacheReader:
    """Reads committed parts of a store, every read checked; refuses stores of unknown format versions.

    `problems`: when a list is given, bad part indexes are recorded there instead of raising.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, problems: list[str] | None = None):
        self.url = url
        self.loc = Location(url, storage_options)
        self.manifest: Manifest = read_manifest(url, loc=self.loc)
        self._problems = problems
        self.shards: list[ShardMeta] = list_shards(self.loc, url, problems)

    def refresh(self) -> None:
        self.shards = list_shards(self.loc, self.url, self._problems)

    def shard(self, sid: str) -> ShardMeta:
        for m in self.shards:
            if m.shard_id == sid:
                return m
        raise StoreError(f"store {self.url}: teacher part {sid} is not committed")

    # -- completeness

    def writer_summaries(self) -> dict[int, WriterDone]:
        out = {}
        for i in range(self.manifest.num_writers):
            raw = self.loc.read_json(f"done/w{i:05d}.json")
            if raw is not None:
                check_version(raw, f"store {self.url}, done/w{i:05d}.json")
                out[i] = read_model(WriterDone, raw, f"{self.url}/done/w{i:05d}.json")
        return out

    def lost_parts(self) -> list[str]:
        """Parts a finished writer counted that are no longer committed (damage, not a running job)."""
        return [f"store {self.url}: writer {i} finished with {counted} parts but only {found} are committed "
                f"(a part index was lost)"
                for i, (counted, found) in sorted(missing_parts(self.writer_summaries(), self.shards).items())]

    def incomplete(self) -> list[str]:
        """Why the store is not complete (empty when it is): writers not done, parts lost."""
        done = self.writer_summaries()
        out = []
        running = [i for i in range(self.manifest.num_writers) if i not in done]
        if running:
            out.append(f"store {self.url}: {len(running)} of {self.manifest.num_writers} writer(s) have not finished "
                       f"(no done marker for writer {', '.join(map(str, running[:8]))}"
                       f"{', ...' if len(running) > 8 else ''}): a teacher-dump job crashed or is still running")
        return out + self.lost_parts()

    def is_complete(self) -> bool:
        """True when every writer of the manifest wrote its done marker and all the parts it counted
        are still committed (a part whose index was lost makes the store incomplete again)."""
        return not self.incomplete()

    def unaligned_parts(self, fingerprint: str) -> list[str]:
        """Committed teacher parts without a committed alignment part in this group."""
        have = self.alignment_parts(fingerprint)
        return [m.shard_id for m in self.shards if m.shard_id not in have]

    def usable_parts(self, fingerprint: str | None, *, allow_incomplete: bool = False) -> list[str]:
        """The parts a consumer may read: all of a complete store (aligned for `fingerprint` when given).

        An incomplete store, or a group missing alignment parts, is refused with every reason, unless
        `allow_incomplete`: then the committed (and aligned) parts are returned and their count logged.
        """
        reasons = self.incomplete()
        unaligned = self.unaligned_parts(fingerprint) if fingerprint else []
        if unaligned:
            reasons.append(f"store {self.url}: alignment group {fingerprint[:12]}.. has no alignment part for "
                           f"{len(unaligned)} of {len(self.shards)} committed part(s) (first: {unaligned[0]}); "
                           f"run `xtcache align {self.url} --student-tokenizer <student>`")
        use = [m.shard_id for m in self.shards if m.shard_id not in set(unaligned)]
        if reasons and not allow_incomplete:
            raise StoreError("; ".join(reasons) + "; pass --allow-incomplete to use the committed parts only")
        done = self.writer_summaries()
        total = sum(d.num_parts for d in done.values()) + sum(m.writer_index not in done for m in self.shards)
        if reasons:
            log.warning("--allow-incomplete: reading %d of %d parts of %s (%s)", len(use), total, self.url,
                        "; ".join(reasons))
        return use

    # -- alignment groups

    def alignment_groups(self) -> dict[str, AlignGroupMeta]:
        """Alignment groups keyed by student tokenizer fingerprint, stats summed over committed parts."""
        out = {}
        for fp in self.loc.groups():
            raw = self.loc.read_json(f"align/{fp}/group.json")
            if raw is None:
                continue
            check_version(raw, f"store {self.url}, alignment group {fp}")
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

    def student_group(self, fingerprint: str, name: str) -> AlignGroupMeta | None:
        """The alignment group a student of tokenizer `fingerprint` reads this store through; None where that
        is the teacher's own tokenizer and the store holds no group for it (identity: nothing to align). A
        store with neither is refused in one line that begins with `name` (the flag and the store, or "the
        cache URL") and names the groups it holds and the `xtcache align` command that adds one."""
        groups = self.alignment_groups()
        if fingerprint in groups:
            return groups[fingerprint]
        if fingerprint == self.manifest.fingerprints.get("teacher_tokenizer", ""):
            return None
        have = ", ".join(f"{fp[:12]}.. ({g.tokenizer_name or '?'})" for fp, g in groups.items()) or "none"
        raise ConfigError(f"{name} has no alignment for the student tokenizer {fingerprint[:12]}.. (stored alignment "
                          f"groups: {have}); run `xtcache align {self.url} --student-tokenizer <student tokenizer "
                          "dir>` first, or pass the student tokenizer the cache was aligned for")

    def alignment_parts(self, fingerprint: str) -> dict[str, AlignPartMeta]:
        """Committed alignment parts of one group whose teacher part is committed too."""
        committed = {m.shard_id for m in self.shards}
        out = {}
        for name in sorted(self.loc.listdir(f"align/{fingerprint}/index")):
            sid = name[:-5]
            if not name.endswith(".json") or sid not in committed:
                continue
            where = self._where_align(fingerprint, sid)
            try:
                raw = self.loc.read_json(f"align/{fingerprint}/index/{name}")
                if raw is None:
                    continue
                check_version(raw, where)
                out[sid] = read_model(AlignPartMeta, raw, f"{self.url}/align/{fingerprint}/index/{name}")
            except XtcacheError as e:
                if self._problems is None:
                    raise
                self._problems.append(str(e))
        return out

    # -- reading parts

    def _where(self, sid: str) -> str:
        return f"store {self.url}, teacher part {sid}"

    def _where_align(self, fp: str, sid: str) -> str:
        return f"store {self.url}, alignment group {fp[:12]}.. part {sid}"

    def _specs(self, meta, defs: tuple[ArrayDef, ...], where: str, counts: dict[str, int],
               names: list[str] | None = None) -> list[ArraySpec]:
        """The index's specs of the contract's arrays, checked against the table (names, dtypes, shapes)."""
        wanted = {a.name for a in defs}
        extra = sorted(set(meta.arrays) - wanted)
        if extra:
            raise CorruptionError(f"{where}: its index lists array {extra[0]!r}, which this part cannot hold")
        out = []
        for a in defs:
            if names is not None and a.name not in names:
                continue
            spec = meta.arrays.get(a.name)
            if spec is None and a.optional:
                continue
            if spec is None:
                raise CorruptionError(f"{where}: array {a.name!r} is missing from its index")
            if spec.dtype not in a.dtypes or tuple(spec.shape) != a.resolve(counts):
                raise CorruptionError(
                    f"{where}: array {a.name!r} is damaged: its index says {spec.dtype} {spec.shape}, the contract "
                    f"and the counts need {'/'.join(a.dtypes)} {list(a.resolve(counts))}")
            out.append(spec)
        return out

    def _teacher_specs(self, meta: ShardMeta, names: list[str] | None = None) -> list[ArraySpec]:
        m, where = self.manifest, self._where(meta.shard_id)
        if meta.mode != m.mode or meta.k != m.k or meta.teacher_vocab_size not in (None, m.teacher_vocab_size):
            raise CorruptionError(
                f"{where}: written with mode {meta.mode} k={meta.k} teacher vocabulary "
                f"{meta.teacher_vocab_size or '?'}, the manifest says mode {m.mode} k={m.k} vocabulary "
                f"{m.teacher_vocab_size}: manifest.json was edited or damaged")
        for name, codec in m.codecs.items():
            spec = meta.arrays.get(name)
            if spec is not None and spec.transform != codec:
                raise CorruptionError(f"{where}: array {name!r} was written with transform {spec.transform}, the "
                                      f"manifest says {codec}: manifest.json was edited or damaged")
        blob, conv, id_dict = (meta.arrays.get(n) for n in ("doc_text", "doc_conversation", "topk_id_dict"))
        counts = {"D": meta.num_docs, "P": meta.num_positions, **entry_widths(m.mode, m.k, m.top_k),
                  "B": blob.shape[0] if blob else 0, "M": conv.shape[0] if conv else 0,
                  "U": id_dict.shape[0] if id_dict else 0}
        if len(meta.docs) != meta.num_docs:
            raise CorruptionError(f"{where}: its index lists {len(meta.docs)} document ids for {meta.num_docs} "
                                  "documents")
        if id_dict is not None and id_dict.transform != m.codecs["topk_ids"]:
            raise CorruptionError(f"{where}: array 'topk_id_dict' was written with transform {id_dict.transform}, "
                                  f"the manifest's ids transform is {m.codecs['topk_ids']}")
        arrays = teacher_arrays(m.mode, m.conversation, id_dictionary=m.codecs["topk_ids"].name == codecs.DICT_IDS_NAME)
        return self._specs(meta, arrays, where, counts, names)

    def check_indexes(self) -> None:
        """Check every committed index against the manifest and the array table, reading no array
        (what `xtcache inspect` can afford); CorruptionError names the first mismatch."""
        for meta in self.shards:
            self._teacher_specs(meta)
        for fp in self.loc.groups():
            for sid, part in self.alignment_parts(fp).items():
                counts = {"D": part.num_docs, "S": part.num_student_tokens, "C": part.num_chunks}
                self._specs(part, align_arrays(self.manifest.conversation), self._where_align(fp, sid), counts)

    def doc_pos_offsets(self, sid: str) -> np.ndarray:
        """int64 [D+1] position offsets of one part's documents, without decoding anything else."""
        meta = self.shard(sid)
        specs = self._teacher_specs(meta, ["doc_pos_offsets"])
        offs = read_arrays(self.loc, f"shards/{sid}", specs, where=self._where(sid))["doc_pos_offsets"]
        _check_offsets(offs, meta.num_positions, self._where(sid), "doc_pos_offsets")
        return offs

    def read_shard(self, sid: str, *, verify: bool = False) -> ShardData:
        """Decode one committed part, checked; `verify` also checks sha256s, content hashes and counts."""
        meta = self.shard(sid)
        where = self._where(sid)
        specs = self._teacher_specs(meta)
        raw = read_arrays(self.loc, f"shards/{sid}", specs, where=where, sha256=verify)
        pos, text_offs = raw["doc_pos_offsets"], raw["doc_text_offsets"]
        _check_offsets(pos, meta.num_positions, where, "doc_pos_offsets")
        _check_offsets(text_offs, raw["doc_text"].shape[0], where, "doc_text_offsets")
        ids = self._decode_ids(meta, raw, where)
        char_offsets = raw["char_offsets"]
        if meta.arrays["char_offsets"].transform is not None:
            char_offsets = codecs.codec_from_config(meta.arrays["char_offsets"].transform).decode(char_offsets, pos)
        logprobs = None
        if "topk_logprobs" in raw:
            logprobs = codecs.codec_from_config(meta.arrays["topk_logprobs"].transform).decode(raw["topk_logprobs"])
        conversations = None
        if "doc_conversation" in raw:
            conv_offs, conv_blob = raw["doc_conversation_offsets"], raw["doc_conversation"].tobytes()
            _check_offsets(conv_offs, len(conv_blob), where, "doc_conversation_offsets")
            try:
                conversations = [conv_blob[conv_offs[i]:conv_offs[i + 1]].decode("utf-8")
                                 for i in range(meta.num_docs)]
            except UnicodeDecodeError:
                raise CorruptionError(f"{where}: array 'doc_conversation' is damaged: not UTF-8") from None
        blob = raw["doc_text"].tobytes()
        texts = []
        for i in range(meta.num_docs):
            try:
                texts.append(blob[text_offs[i]:text_offs[i + 1]].decode("utf-8"))
            except UnicodeDecodeError:
                raise CorruptionError(f"{where}: array 'doc_text' is damaged: document {i} is not UTF-8") from None
        if verify:
            if int(raw["has_pred"].sum()) != meta.num_predicted:
                raise CorruptionError(f"{where}: array 'has_pred' has {int(raw['has_pred'].sum())} predictions, its "
                                      f"index says {meta.num_predicted}")
            for i, d in enumerate(meta.docs):
                if content_hash(texts[i]) != d.content_hash:
                    raise CorruptionError(f"{where}: array 'doc_text' is damaged: document {i} does not match its "
                                          "content hash")
        return ShardData(
            shard_id=sid, docs=list(meta.docs), texts=texts, doc_pos_offsets=pos, teacher_ids=raw["teacher_ids"],
            char_offsets=char_offsets, has_pred=raw["has_pred"], topk_ids=ids, topk_logprobs=logprobs,
            topk_counts=raw.get("topk_counts"), residual=raw["residual"].astype(np.float32, copy=False),
            realized_logprob=raw["realized_logprob"].astype(np.float32, copy=False),
            conversations=conversations)

    def _decode_ids(self, meta: ShardMeta, raw: dict[str, np.ndarray], where: str) -> np.ndarray:
        """The part's top-k ids int32 [P, k], each checked to lie in the teacher vocabulary (and, dictionary
        coded, each code in its dictionary)."""
        m, V = self.manifest, self.manifest.teacher_vocab_size
        ids_codec = codecs.codec_from_config(meta.arrays["topk_ids"].transform)
        problem = codecs.id_runs_problem(ids_codec, m.mode, m.top_k, m.format_version)
        if problem:
            raise CorruptionError(f"{where}: {problem}: its index or manifest.json is damaged")
        if not isinstance(ids_codec, codecs.DictDeltaIds):
            ids = ids_codec.decode(raw["topk_ids"], overwrite=True)  # the deltas' memory: read_shard keeps only ids
        else:
            dictionary = ids_codec.decode_dictionary(raw["topk_id_dict"])
            if dictionary.size and (int(dictionary.min()) < 0 or int(dictionary.max()) >= V):
                raise CorruptionError(f"{where}: array 'topk_id_dict' holds ids outside the teacher vocabulary "
                                      f"[0, {V}): the array or manifest.json is damaged")
            try:
                return ids_codec.decode(raw["topk_ids"], dictionary)
            except CorruptionError as e:
                raise CorruptionError(f"{where}: {e}: the arrays are damaged") from None
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise CorruptionError(f"{where}: array 'topk_ids' decodes to ids outside the teacher vocabulary [0, {V}): "
                                  "the array or manifest.json is damaged")
        return ids

    def read_alignment(self, fingerprint: str, sid: str, *, verify: bool = False,
                       doc_pos_offsets: np.ndarray | None = None) -> AlignShardData:
        """Decode one committed alignment part, checked (offsets, per-document chunk ends); `verify`
        also checks sha256s and, like passing the teacher part's `doc_pos_offsets` (a reader that
        decoded them already), that each document's chunks end at its token counts."""
        parts = self.alignment_parts(fingerprint)
        if sid not in parts:
            raise StoreError(f"{self._where_align(fingerprint, sid)}: no committed alignment; run `xtcache align` "
                             "for that tokenizer")
        meta, where, teacher = parts[sid], self._where_align(fingerprint, sid), self.shard(sid)
        if meta.num_docs != teacher.num_docs or meta.shard_id != sid or meta.fingerprint != fingerprint:
            raise CorruptionError(f"{where}: its index (part {meta.shard_id}, {meta.num_docs} documents) does not "
                                  f"match teacher part {sid} ({teacher.num_docs} documents)")
        counts = {"D": meta.num_docs, "S": meta.num_student_tokens, "C": meta.num_chunks}
        specs = self._specs(meta, align_arrays(self.manifest.conversation), where, counts)
        raw = read_arrays(self.loc, f"align/{fingerprint}/shards/{sid}", specs, where=where, sha256=verify)
        s_off, c_off = raw["doc_student_offsets"], raw["doc_chunk_offsets"]
        _check_offsets(s_off, meta.num_student_tokens, where, "doc_student_offsets")
        _check_offsets(c_off, meta.num_chunks, where, "doc_chunk_offsets")
        doc_of_chunk = np.repeat(np.arange(meta.num_docs), np.diff(c_off))
        first = np.zeros(meta.num_chunks, dtype=bool)
        first[c_off[:-1][np.diff(c_off) > 0]] = True
        for name, lengths in (("student_end", np.diff(s_off)), ("teacher_end", None)):
            ends = raw[name].astype(np.int64)
            step = np.diff(ends, prepend=0)
            if np.any((step < 0) & ~first) or np.any(ends < 0):
                raise CorruptionError(f"{where}: array {name!r} is damaged: chunk ends decrease inside a document")
            if lengths is not None and np.any(ends > lengths[doc_of_chunk]):
                raise CorruptionError(f"{where}: array {name!r} is damaged: a chunk ends past its document")
        if verify or doc_pos_offsets is not None:
            t_len = np.diff(self.doc_pos_offsets(sid) if doc_pos_offsets is None else doc_pos_offsets)
            last = c_off[1:][np.diff(c_off) > 0] - 1
            docs = np.flatnonzero(np.diff(c_off) > 0)
            if np.any(raw["teacher_end"][last] != t_len[docs]) or np.any(raw["student_end"][last] != np.diff(s_off)[docs]):
                raise CorruptionError(f"{where}: arrays 'student_end'/'teacher_end' are damaged: a document's last "
                                      "chunk does not end at its token count")
        check_sampled_logprobs(raw.get("sampled_logprobs"), where)
        return AlignShardData(fingerprint=fingerprint, shard_id=sid, **raw)

    def total_bytes(self) -> int:
        return self.loc.du("")


def _check_offsets(offs: np.ndarray, total: int, where: str, name: str) -> None:
    if offs.shape[0] == 0 or int(offs[0]) != 0 or int(offs[-1]) != total or np.any(np.diff(offs) < 0):
        raise CorruptionError(f"{where}: array {name!r} is damaged: offsets are not a non-decreasing run from 0 to "
                              f"{total}")


def check_sampled_logprobs(lp: np.ndarray | None, where: str) -> None:
    """`sampled_logprobs` (optional): a log-prob (finite, at most 0) or NaN (not sampled) per student token."""
    if lp is not None and (np.any(np.isinf(lp)) or np.any(lp > 0)):
        raise CorruptionError(f"{where}: array 'sampled_logprobs' is damaged: it holds values that are neither a "
                              "log-prob (finite, at most 0) nor NaN")
