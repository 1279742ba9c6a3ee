"""Streaming loader of stage 2: committed cache shards -> packed student windows -> micro-batches.

A `CacheDataset` reads the store lazily through `xtcache.store.CacheReader` (any fsspec URL) and
a `CacheLoader` wraps it in a torch DataLoader, so shard decoding and batch building happen in
worker processes. Micro-batches follow the "Stage 2 batch" table of docs/architecture.md; they are
built by `stage2_student.batches`, several caches joined by `stage2_student.join`.

Packing (`xtcache.packing`). Each shard's documents (train or held-out split) are packed, in stored
order, into windows of `seq_len` student tokens, cut only at chunk boundaries; several documents may
share a window. Plain text (and `--train-on all`): when a document continues in the next window, its
last chunk of the previous window is repeated first as context (it is never a valid chunk there and
its CE labels are masked), so that every chunk of a long document is predicted exactly once.
`--train-on assistant|last-assistant`: windows are cut around the chunks holding a trained token
(`pack_trained`): each is trained once, after as much of its document as fits (context chunks
already trained are masked the same way), and no window holds only text that trains nothing. A
chunk longer than a window is skipped (counted in `skipped_chunks`).

Order (`stage2_student.order`): an epoch permutes the shards and the windows inside each shard
with (seed, epoch); rank r, accumulation index a of step s reads global micro-batch
g = s*W*A + r*A + a. Worker w of n builds the rank's micro-batches j with j % n == w, and the
DataLoader returns them in order, so the sequence depends on neither the number of workers nor
prefetching, and `state_dict()` (micro-batches consumed) resumes exactly.

    ds = CacheDataset(url, student_fingerprint, LoaderConfig(seq_len=512, micro_batch_size=4), rank=0, world_size=1)
    for batch in CacheLoader(ds, num_workers=2): ...
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np
import torch

from stage2_student.batches import ShardSource
from stage2_student.config import LoaderConfig
from stage2_student.join import build_joined_batch, chunk_group_lengths, join_counts, join_segment
from stage2_student.order import epoch_window_order, global_micro_batch, is_held_out
from xtcache.chat.render import TRAIN_ON, trained_roles, turn_openers
from xtcache.chat.side import tokenizer_side
from xtcache.errors import ConfigError, XtcacheError
from xtcache.fingerprint import doc_id
from xtcache.packing import pack
from xtcache.store import CacheReader
from xtcache.store.tokenizer import load_store_tokenizer
from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class ReadFailure:
    """An XtcacheError met while building a micro-batch (a damaged store), carried out of a worker
    process as a value so that the caller raises it with its one-line message (torch would re-raise
    it with the worker's traceback folded into the message)."""

    error_type: type
    message: str


def to_tensors(batch: dict | ReadFailure) -> dict | ReadFailure:
    """Collate: numpy micro-batch -> torch tensors (`num_chunks` stays an int)."""
    if isinstance(batch, ReadFailure):
        return batch
    return {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}


# --------------------------------------------------------------------------------------------
# the dataset over a store


def student_fingerprint(tokenizer_or_path, *, chat: bool = False) -> str:
    """Fingerprint of a student tokenizer (directory, tokenizer object, or a fingerprint string);
    `chat`: of the tokenizer with its chat template (what keys a conversation cache's groups)."""
    if isinstance(tokenizer_or_path, str) and len(tokenizer_or_path) == 64 and all(
            ch in "0123456789abcdef" for ch in tokenizer_or_path):
        return tokenizer_or_path
    return tokenizer_side(tokenizer_or_path, "student tokenizer", conversation=chat).fingerprint


def check_token_roles(reader: CacheReader, fingerprint: str, *, conversation: bool, train_on: str | None, name: str,
                      identity: bool | None = None, parts: set[str] | None = None) -> None:
    """Refuse `--train-on assistant|last-assistant` on a plain-text cache with a part that keeps no token roles:
    only text rollouts of `xtcache generate` record them, in their alignment parts (`student_role`); a cache read by
    identity (`identity`, else looked up: `CacheReader.student_group`) holds none. Conversation caches, and plain
    text trained on every token (`train_on` None or all), pass. `fingerprint`: the student tokenizer's, as the
    cache's groups key it; `name` begins the refusal ("the cache URL", or the flag and the store). `parts`: the
    part ids that will be read (the loader's usable parts; None: every part). Parts without this student's
    alignment are not read (the loader refuses or, with --allow-incomplete, skips them)."""
    if conversation or train_on in (None, "all"):
        return
    if identity is None:
        identity = reader.student_group(fingerprint, name) is None
    if identity:
        bare = sorted(m.shard_id for m in reader.shards)
    else:
        bare = sorted(sid for sid, part in reader.alignment_parts(fingerprint).items()
                      if "student_role" not in part.arrays)
    if parts is not None:
        bare = [sid for sid in bare if sid in parts]
    if bare:
        raise ConfigError(f"--train-on {train_on}: {name} holds plain text whose part {bare[0]} keeps no token roles "
                          "(text rollouts of `xtcache generate` keep them); --train-on applies to conversation caches "
                          "and text rollouts")


def _check_settings(*, rank: int, world_size: int, grad_accum: int, split: str, holdout_fraction: float) -> None:
    """Refuse a rank or split that cannot work (the LoaderConfig checked its own settings)."""
    if not 0 <= rank < world_size or grad_accum < 1:
        raise ConfigError(f"rank {rank} of world size {world_size} with grad accumulation {grad_accum}: invalid")
    if split not in ("train", "eval", "all"):
        raise ValueError(f"split {split!r}: use train, eval or all")
    if split == "eval" and holdout_fraction <= 0:
        raise ConfigError("an eval split needs --holdout-fraction > 0 (or pass a second cache with split='all')")


@dataclass
class TeacherCache:
    """One teacher cache of a CacheDataset: what the objective needs to know of it, and its parts."""

    url: str
    mode: str
    k: int
    teacher_vocab_size: int
    teacher_fingerprint: str
    identity: bool  # same tokenizer as the student, no alignment group: chunk = token
    student_vocab_size: int
    shard_ids: list[str]
    turn_openers: tuple[int, ...] = ()  # teacher ids opening a structure at a turn's start the student cannot


class CacheDataset(torch.utils.data.IterableDataset):
    """Micro-batches of one rank from one or several teacher caches, for one student tokenizer.

    split: "train" (documents not held out), "eval" (held out by `holdout_fraction`, read once,
    in stored order, last micro-batch possibly short) or "all" (every document, train-style; a
    second cache used for evaluation takes split="all", epochs=1, shuffle=False).

    Several caches (`url` a list, one teacher each) are joined by document id (source, row,
    content hash): `missing="drop"` keeps the documents every cache holds, `"partial"` also those
    some caches lack (their chunks then carry only the teachers present). Windows are packed over
    chunk groups (`common_boundaries`), so every teacher sees the same windows, and a micro-batch
    carries each teacher's view (`teacher_view`); with one cache it is that cache's batch.
    """

    def __init__(self, url: str | list[str], student: str, loader: LoaderConfig, *, pad_id: int = 0, rank: int = 0,
                 world_size: int = 1, grad_accum: int = 1, seed: int = 0, split: str = "train",
                 holdout_fraction: float = 0.0, epochs: int | None = None, shuffle: bool | None = None,
                 shard_cache: int = 2):
        _check_settings(rank=rank, world_size=world_size, grad_accum=grad_accum, split=split,
                        holdout_fraction=holdout_fraction)
        seq_len, micro_batch_size, storage_options = loader.seq_len, loader.micro_batch_size, loader.storage_options
        allow_incomplete, missing, train_on = loader.allow_incomplete, loader.teachers_missing, loader.train_on
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ConfigError("--cache: give at least one teacher cache")
        self.urls, self.url, self.storage_options = urls, urls[0], storage_options
        self.seq_len, self.micro_batch_size, self.pad_id = seq_len, micro_batch_size, pad_id
        self.rank, self.world_size, self.grad_accum, self.seed = rank, world_size, grad_accum, seed
        self.split, self.holdout_fraction, self.missing = split, holdout_fraction, missing
        self.epochs = 1 if split == "eval" else epochs
        self.shuffle = (split != "eval") if shuffle is None else shuffle
        self.shard_cache = shard_cache
        t0 = time.perf_counter()
        readers = [CacheReader(u, storage_options) for u in urls]
        self._resolve_student(readers, student, train_on)
        self.caches = [self._open_cache(u, r, allow_incomplete) for u, r in zip(urls, readers)]
        self.cache_keys = [r.manifest.cache_key for r in readers]  # which caches (teacher, corpus, settings)
        if self.conversation:
            self.caches = [self._with_turn_openers(c, r, student) for c, r in zip(self.caches, readers)]
        first = self.caches[0]
        self.mode, self.k, self.teacher_vocab_size = first.mode, first.k, first.teacher_vocab_size
        self.identity, self.student_vocab_size = first.identity, first.student_vocab_size
        # documents of every cache: doc id -> (shard index, doc index), in stored order
        where: list[dict[str, tuple[int, int]]] = []
        for c, r in zip(self.caches, readers):
            metas = {m.shard_id: m for m in r.shards}
            where.append({doc_id(d.source, d.row, d.content_hash): (si, di)
                          for si, sid in enumerate(c.shard_ids) for di, d in enumerate(metas[sid].docs)})
        counts = join_counts(where, urls)
        self._plan_units(readers, where, split, holdout_fraction)
        if len(urls) > 1:
            log.info("joined %d caches by document id: %d documents in every cache, %d in only some of them "
                     "(--teachers-missing %s: %s)", len(urls), counts[0], counts[1], missing,
                     "dropped" if missing == "drop" else "trained with the teachers present")
        if self.skipped_chunks:
            log.warning("%d chunk(s) longer than --seq-len %d were skipped", self.skipped_chunks, seq_len)
        self.num_windows = sum(p.num_windows for p in self.plans)
        self.batches_per_epoch = self._batches_per_epoch()
        read = sum(p.read_tokens for p in self.plans)
        trained = sum(p.trained_tokens for p in self.plans)
        log.info("loader %s split=%s: %d documents, %d windows, %d shards, %d micro-batches/epoch on rank %d; "
                 "%s: %d trained positions, %d context tokens read for them (%.2f tokens read per trained "
                 "position; planned in %.1fs)", ", ".join(urls), split, self.documents, self.num_windows,
                 len(self.plans), self.batches_per_epoch, rank, f"--train-on {self.train_on}" if self.train_on
                 else "plain text", trained, read - trained, read / max(1, trained), time.perf_counter() - t0)
        self.plan_tokens = {"trained": trained, "context": read - trained}
        self.start = (0, 0)  # (epoch, micro-batches consumed in it): set by CacheLoader before iterating
        self._readers: dict[int, object] = {}
        self._cache: OrderedDict[tuple[int, int], ShardSource] = OrderedDict()
        self._order: tuple[int, np.ndarray] | None = None

    def foreign_rows(self) -> str | None:
        """Where a cache whose alignment group for this student records its rollouts (each one a sampled turn,
        `sampled_turns`: STORE_FORMAT.md 5.1) also holds documents that are none (corpus rows, or rollouts of
        another policy): the first such part, as `CACHE part SID: N of its D documents`, else None."""
        for ci, c in enumerate(self.caches):
            if c.identity:  # no alignment group: no rollouts of this student are recorded
                continue
            parts = self._reader(ci).alignment_parts(self.fingerprint)
            if not any("sampled_turns" in parts[sid].conversation for sid in c.shard_ids):
                continue  # no rollouts of this student recorded here
            for sid in c.shard_ids:
                meta = parts[sid]
                other = meta.num_docs - meta.conversation.get("sampled_turns", 0)
                if other > 0:
                    return f"{c.url} part {sid}: {other} of its {meta.num_docs} documents"
        return None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_readers"], state["_cache"], state["_order"] = {}, OrderedDict(), None
        return state

    # -- planning

    def _resolve_student(self, readers, student, train_on: str | None) -> None:
        """`conversation` (all caches one kind), the student `fingerprint` that keys their alignment
        groups, and `train_on` (conversation caches: default assistant; plain text: None)."""
        kinds = {bool(r.manifest.conversation) for r in readers}
        if len(kinds) > 1:
            raise ConfigError(f"the caches {', '.join(self.urls)} mix conversation and plain-text caches: "
                              "join caches written from the same corpus")
        self.conversation = kinds.pop()
        self.fingerprint = student_fingerprint(student, chat=self.conversation)
        if train_on is not None and train_on not in TRAIN_ON:
            raise ConfigError(f"--train-on {train_on!r}: use one of {', '.join(TRAIN_ON)}")
        # plain text: --train-on selects by role only on text rollouts (their parts hold the roles: `check_token_roles`)
        self.train_on = (train_on or "assistant") if self.conversation else (
            None if train_on in (None, "all") else train_on)

    def _with_turn_openers(self, cache: TeacherCache, reader, student) -> TeacherCache:
        """`cache` with the teacher ids that open a structure at the start of an assistant turn which the
        student's template does not write (`xtcache.chat.render.turn_openers`). The teacher's distribution at a
        turn's first row then mixes them with the content's first token, so that row trains CE only
        (`batches.ShardSource.skip_turn_starts`; docs/conversations.md, "Turn starts across templates")."""
        if cache.identity or isinstance(student, str) and not os.path.isdir(student):
            return cache  # one template on both sides (the fingerprint covers it), or a fingerprint only
        teacher_tok = load_store_tokenizer(cache.url, reader.manifest, self.storage_options)
        if teacher_tok is None:
            log.warning("cache %s stores no teacher tokenizer: whether its template opens a structure at a turn's "
                        "start is not known, and each turn's first row trains KD as stored", cache.url)
            return cache
        student_tok = load_tokenizer(student, "student tokenizer") if isinstance(student, str) else student
        openers = turn_openers(teacher_tok, student_tok)
        if not openers:
            return cache
        log.info("cache %s: the teacher's template can open %s at the start of an assistant turn, where the "
                 "student's does not: each trained turn's first row trains CE only (no KD)", cache.url,
                 ", ".join(f"{what} ({teacher_tok.convert_ids_to_tokens(i)!r}, id {i})" for what, i in openers.items()))
        return replace(cache, turn_openers=tuple(sorted(set(openers.values()))))

    def _batches_per_epoch(self) -> int:
        """Micro-batches per epoch on this rank: whole optimizer steps (eval: every window, once)."""
        b, world, accum = self.micro_batch_size, self.world_size, self.grad_accum
        if self.split == "eval":
            return len(range(self.rank, -(-self.num_windows // b), world))
        step_windows = b * world * accum
        n = (self.num_windows // step_windows) * accum
        if n == 0:
            raise ConfigError(
                f"the {self.split} split of {', '.join(self.urls)} packs into {self.num_windows} windows of "
                f"{self.seq_len} tokens, fewer than one optimizer step needs ({step_windows} = micro-batch {b} "
                f"x world {world} x grad-accum {accum}); lower --seq-len or --micro-batch-size")
        return n

    def _open_cache(self, url: str, reader, allow_incomplete: bool) -> TeacherCache:
        """A cache's settings and usable parts; refuses a cache without an alignment for this student."""
        group = reader.student_group(self.fingerprint, f"the cache {url}")
        identity = group is None
        teacher_fp = reader.manifest.fingerprints.get("teacher_tokenizer", "")
        m = reader.manifest
        # an incomplete store, or parts without this student's alignment, is refused (or, with
        # allow_incomplete, read as far as it is committed: usable_parts logs "N of M parts")
        usable = set(reader.usable_parts(None if identity else self.fingerprint, allow_incomplete=allow_incomplete))
        check_token_roles(reader, self.fingerprint, conversation=self.conversation, train_on=self.train_on,
                          name=f"the cache {url}", identity=identity, parts=usable)
        return TeacherCache(url=url, mode=m.mode, k=m.k, teacher_vocab_size=m.teacher_vocab_size,
                            teacher_fingerprint=teacher_fp, identity=identity,
                            student_vocab_size=m.teacher_vocab_size if identity else group.vocab_size,
                            shard_ids=[s.shard_id for s in reader.shards if s.shard_id in usable])

    def _plan_units(self, readers, where: list[dict[str, tuple[int, int]]], split: str, fraction: float) -> None:
        """Pack the documents of the split into windows: `plans`, `members`, `skipped_chunks`, `documents`.

        Plan units: the documents first stored in cache ci's shard si (every document of a joined run
        is in cache 0 with --teachers-missing drop), members [D, N, 2]: (shard, doc) per cache.
        """
        n, urls = len(self.urls), self.urls
        parts: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray | None]]] = {}

        def doc_chunks(ci: int, si: int, di: int) -> tuple[np.ndarray, np.ndarray | None]:
            if (ci, si) not in parts:
                parts[(ci, si)] = self._chunk_ends(readers[ci], self.caches[ci], self.caches[ci].shard_ids[si])
            return parts[(ci, si)][di]

        self.plans, self.members = [], []
        self.skipped_chunks = self.documents = 0
        taken: set[str] = set()
        for ci in range(n if self.missing == "partial" else 1):
            by_shard: dict[int, list[str]] = {}
            for doc, (si, _) in where[ci].items():
                if doc in taken or (self.missing == "drop" and not all(doc in w for w in where)):
                    continue
                if split != "all" and is_held_out(doc, fraction) != (split == "eval"):
                    continue
                by_shard.setdefault(si, []).append(doc)
            for si in sorted(by_shard):
                docs = by_shard[si]
                taken.update(docs)
                members = np.full((len(docs), n, 2), -1, dtype=np.int64)
                lengths, trained = [], []
                for i, doc in enumerate(docs):
                    per = []
                    for cj in range(n):
                        if doc in where[cj]:
                            members[i, cj] = where[cj][doc]
                            per.append((cj, *doc_chunks(cj, *where[cj][doc])))
                    group_lengths, group_trained = chunk_group_lengths(doc, per, urls)
                    lengths.append(group_lengths)
                    if group_trained is not None:
                        trained.append(group_trained)
                plan = pack(range(len(docs)), lengths, trained if self.train_on not in (None, "all") else None,
                            self.seq_len)
                self.skipped_chunks += plan.skipped_chunks
                self.documents += len(docs)
                if plan.num_windows:
                    self.plans.append(plan)
                    self.members.append(members)

    def _chunk_ends(self, reader, cache: TeacherCache, sid: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Every document's student chunk ends (document-local, int64) in one part of one cache, with
        its trained student tokens (bool, conversation caches; else None)."""
        if cache.identity:
            offs = reader.doc_pos_offsets(sid)
            return [(np.arange(1, int(x) + 1, dtype=np.int64), None) for x in np.diff(offs)]
        al = reader.read_alignment(self.fingerprint, sid)
        trained = None
        if self.train_on is not None and al.student_role is not None:
            trained = trained_roles(al.student_role, self.train_on)
        c_off, s_off = al.doc_chunk_offsets, al.doc_student_offsets
        return [(al.student_end[c_off[d]:c_off[d + 1]].astype(np.int64),
                 None if trained is None else trained[s_off[d]:s_off[d + 1]]) for d in range(c_off.shape[0] - 1)]

    # -- reading

    def _reader(self, cache_index: int) -> CacheReader:
        """This process's reader of one cache (opened once)."""
        if cache_index not in self._readers:
            self._readers[cache_index] = CacheReader(self.caches[cache_index].url, self.storage_options)
        return self._readers[cache_index]

    def source(self, cache_index: int, shard_index: int) -> ShardSource:
        """Decoded part of one cache (LRU cache of `shard_cache` parts per cache and process)."""
        key = (cache_index, shard_index)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]

        cache, reader = self.caches[cache_index], self._reader(cache_index)
        sid = cache.shard_ids[shard_index]
        sd = reader.read_shard(sid)
        if cache.identity:
            n = np.diff(sd.doc_pos_offsets)
            ends = np.concatenate([np.arange(1, int(x) + 1, dtype=np.int32) for x in n]) if len(n) else \
                np.zeros(0, np.int32)
            al = dict(doc_student_offsets=sd.doc_pos_offsets, doc_chunk_offsets=sd.doc_pos_offsets,
                      student_ids=sd.teacher_ids, student_end=ends, teacher_end=ends,
                      exact=np.ones(ends.shape[0], dtype=bool))
        else:
            # checked: same documents as the part, each document's chunks ending at its token counts
            a = reader.read_alignment(self.fingerprint, sid, doc_pos_offsets=sd.doc_pos_offsets)
            al = dict(doc_student_offsets=a.doc_student_offsets, doc_chunk_offsets=a.doc_chunk_offsets,
                      student_ids=a.student_ids, student_end=a.student_end, teacher_end=a.teacher_end, exact=a.exact,
                      sampled_logprobs=a.sampled_logprobs)
            if self.train_on is not None:
                al["trained"] = trained_roles(a.student_role, self.train_on)
                # every teacher of a joined batch skips the same rows, so that all see the same chunks
                al["skip_turn_starts"] = any(c.turn_openers for c in self.caches)
        src = ShardSource(doc_pos_offsets=sd.doc_pos_offsets, has_pred=sd.has_pred, topk_ids=sd.topk_ids,
                          topk_logprobs=sd.topk_logprobs, topk_counts=sd.topk_counts, residual=sd.residual,
                          realized_logprob=sd.realized_logprob, **al)
        self._cache[key] = src
        while len(self._cache) > self.shard_cache * len(self.caches):
            self._cache.popitem(last=False)
        return src

    # -- order

    def window_order(self, epoch: int) -> np.ndarray:
        """[N, 2] (plan unit, window index) of every window of an epoch, in global order."""
        if self._order is None or self._order[0] != epoch:
            order = epoch_window_order([p.num_windows for p in self.plans], self.seed, epoch, shuffle=self.shuffle)
            self._order = (epoch, order)
        return self._order[1]

    def micro_batch_windows(self, epoch: int, j: int) -> np.ndarray:
        """[b, 2] windows of this rank's j-th micro-batch of an epoch."""
        b = self.micro_batch_size
        if self.split == "eval":
            g = self.rank + j * self.world_size
        else:
            g = global_micro_batch(j, rank=self.rank, world_size=self.world_size, grad_accum=self.grad_accum)
        return self.window_order(epoch)[g * b:(g + 1) * b]

    def micro_batch(self, epoch: int, j: int) -> dict:
        """The rank's j-th micro-batch of an epoch as numpy arrays (every teacher's view, joined)."""
        n = len(self.caches)
        # per teacher, per window: segments with their chunk groups; group validity across teachers
        windows: list[list[list]] = [[] for _ in range(n)]
        group_ok: list[np.ndarray] = []
        n_groups = 0
        for s, w in self.micro_batch_windows(epoch, j):
            plan, members = self.plans[s], self.members[s]
            for i in range(n):
                windows[i].append([])
            for x in range(plan.window_offsets[w], plan.window_offsets[w + 1]):
                docs = members[int(plan.seg_doc[x])]  # [N, 2]
                present = docs[:, 0] >= 0
                ref = int(np.argmax(present))  # a teacher missing the document lays out its student side
                at = [ci if present[ci] else ref for ci in range(n)]
                srcs = [self.source(a, int(docs[a, 0])) for a in at]
                segs, ok = join_segment(srcs, [int(docs[a, 1]) for a in at], present, int(plan.seg_lo[x]),
                                        int(plan.seg_hi[x]), int(plan.seg_ctx[x]), n_groups)
                group_ok.append(ok)
                n_groups += ok.shape[0]
                for ci in range(n):
                    windows[ci][-1].append(segs[ci])
        batch = build_joined_batch(windows, group_ok, self.seq_len, self.pad_id, self.urls)
        if self.train_on is not None:  # conversation caches: which messages the labels train
            batch["train_on"] = self.train_on
        return batch

    def positions(self, start: tuple[int, int]):
        """(epoch, j) of the rank's micro-batches from `start` on, across epochs."""
        epoch, j = start
        while self.epochs is None or epoch < self.epochs:
            while j < self.batches_per_epoch:
                yield epoch, j
                j += 1
            epoch, j = epoch + 1, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for n, (epoch, j) in enumerate(self.positions(self.start)):
            if n % workers == worker:
                try:
                    batch = self.micro_batch(epoch, j)
                except XtcacheError as e:
                    yield ReadFailure(type(e), str(e))
                    return
                yield batch


class CacheLoader:
    """The rank's micro-batch stream: a DataLoader over a CacheDataset, resumable.

    Iterating yields tensor micro-batches; `state_dict()` records how many were consumed (handed
    to the caller, not merely prefetched), and a loader given that state yields exactly the
    micro-batches an uninterrupted run would have yielded next. A finite stream (`epochs` set,
    e.g. the eval split) that was read to its end starts over when iterated again.
    """

    def __init__(self, dataset: CacheDataset, *, num_workers: int = 0, prefetch_factor: int = 2,
                 pin_memory: bool | None = None):
        self.dataset = dataset
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.epoch, self.consumed = 0, 0

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return self.dataset.batches_per_epoch

    def __iter__(self):
        ds = self.dataset
        if ds.epochs is not None and self.epoch >= ds.epochs:  # a finished finite stream starts over
            self.epoch, self.consumed = 0, 0
        ds.start = (self.epoch, self.consumed)
        kw = {"prefetch_factor": self.prefetch_factor, "persistent_workers": False} if self.num_workers else {}
        # Its own generator: a DataLoader draws its workers' base seed from torch's global RNG otherwise,
        # so a resumed run (one more iterator, after the checkpoint restored that RNG) would draw dropout
        # masks one step out of line with the uninterrupted run. The batches themselves use no RNG.
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                             collate_fn=to_tensors, pin_memory=self.pin_memory,
                                             generator=torch.Generator().manual_seed(ds.seed), **kw)
        for batch in loader:
            if isinstance(batch, ReadFailure):
                raise batch.error_type(batch.message)
            self.consumed += 1
            if self.consumed == ds.batches_per_epoch:
                self.epoch, self.consumed = self.epoch + 1, 0
            yield batch

    def state_dict(self) -> dict:
        d = self.dataset
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": d.seed, "rank": d.rank,
                "world_size": d.world_size, "grad_accum": d.grad_accum, "micro_batch_size": d.micro_batch_size,
                "seq_len": d.seq_len, "split": d.split, "fingerprint": d.fingerprint,
                "num_windows": d.num_windows, "caches": d.cache_keys}

    def differences(self, state: dict) -> list[str]:
        """`setting saved -> now` for each setting of a saved stream `state` that another position means for this
        stream (none: `load_state_dict` continues it)."""
        mine = self.state_dict()
        keys = ("seed", "rank", "world_size", "grad_accum", "micro_batch_size", "seq_len", "split", "fingerprint",
                "num_windows", *(("caches",) if "caches" in state else ()))  # caches: recorded since 2026-12-01
        return [f"{k} {state.get(k)!r} -> {mine[k]!r}" for k in keys if state.get(k) != mine[k]]

    def load_state_dict(self, state: dict) -> None:
        if diff := self.differences(state):
            raise ConfigError("cannot resume the data stream: " + ", ".join(diff)
                              + "; resume with the settings (and committed shards) of the interrupted run")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def reshard_state(state: dict, *, rank: int, world_size: int, grad_accum: int) -> dict:
    """A loader state saved at one world size, for rank `rank` of `world_size` ranks.

    The global sample order depends only on (seed, epoch) and the global batch; each optimizer
    step takes the next world_size x grad_accum micro-batches of it. So a run saved at W ranks x A
    accumulation continues exactly at W' x A' = W x A: the position is steps done x A'.
    """
    if "mixture" in state:  # stage2_student.rollout_mix: each rank's draws depend on the rank layout
        raise ConfigError("a run mixing --corpus-cache into rollouts resumes on its own ranks x --grad-accum only")
    old = state["world_size"] * state["grad_accum"]
    if world_size * grad_accum != old:
        saved = f"cannot resume the data stream of {state['world_size']} ranks x --grad-accum {state['grad_accum']}"
        raise ConfigError(f"{saved} on {world_size} ranks x --grad-accum {grad_accum}: keep ranks x --grad-accum = "
                          f"{old} (e.g. --grad-accum {old // world_size})" if old % world_size == 0 else
                          f"{saved} on {world_size} ranks: {old} micro-batches per step do not divide over "
                          f"{world_size} ranks")
    steps, rest = divmod(int(state["consumed"]), int(state["grad_accum"]))
    if rest:
        raise ConfigError("the checkpoint was saved in the middle of an accumulated step; resume at its own world size")
    return {**state, "rank": rank, "world_size": world_size, "grad_accum": grad_accum, "consumed": steps * grad_accum}
