"""`xtcache teacher-dump`: run the teacher once over a corpus and write the teacher-cache store.

The run is a three-stage pipeline so that the teacher never waits for the disk:

  prep thread     reads the corpus, tokenizes, aligns, plans windows, packs batches (bounded queue)
  main thread     runs the teacher on batch n+1 ...
  post thread     ... while batch n becomes top-k / full / sampled targets (lm_head on the device)
  writer thread   and finished parts are encoded, compressed and committed to the store

Queues hold at most two items each; the time the main thread spends blocked handing a batch to
the post thread is reported as "teacher waited on writer". Before any teacher work the cache key
(teacher, tokenizers, corpus and capture settings fingerprints) is looked up: a complete store
for the same request is reused and the run says so. `--resume` keeps committed parts (checked
against the corpus) and recomputes the rest; part boundaries are fixed runs of the writer's
document stream, so the finished store equals an uninterrupted run.

    xtcache teacher-dump --teacher T --student-tokenizer S --data corpus.jsonl --out store
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from schemas.models import support_width
from stage1_teacher import preflight
from stage1_teacher.cache_inputs import capture_identity, record_digests, share_digests
from stage1_teacher.capture import needs_check
from stage1_teacher.config import TeacherDumpConfig, settings_for_fingerprint
from stage1_teacher.corpus import iter_corpus
from stage1_teacher.prep import Part, Preparer, StudentSide, iter_parts, part_batches
from stage1_teacher.shard_plan import PLAN_FILE, obtain_plan
from stage1_teacher.windows import window_has_pred
from xtcache.errors import CaptureError, ConfigError, CorruptionError, StoreError
from xtcache.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class Summary:
    """What a dump did; printed at the end and stored in the writer's done marker."""

    store: str = ""
    reused: bool = False
    capture_path: str = ""
    notes: list[str] = field(default_factory=list)
    documents: int = 0
    positions: int = 0
    predicted: int = 0
    windows: int = 0
    parts_written: int = 0
    parts_resumed: int = 0
    bytes_written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    engine_start_s: float = 0.0
    capture_s: float = 0.0
    prep_s: float = 0.0
    teacher_s: float = 0.0
    post_s: float = 0.0
    write_s: float = 0.0
    teacher_wait_s: float = 0.0
    input_wait_s: float = 0.0
    check_gap: float | None = None
    check_source: str = ""
    alignment_groups_added: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def lines(self) -> list[str]:
        if self.reused:
            out = [f"reused complete cache {self.store}: no teacher work done"]
            if self.alignment_groups_added:
                out.append(f"added alignment groups: {', '.join(self.alignment_groups_added)}")
            return out + [f"note: {n}" for n in self.notes]
        capture = max(self.capture_s, 1e-9)
        out = [
            f"store               {self.store}",
            f"capture path        {self.capture_path}" + (f" (first-batch check gap {self.check_gap:.2g}: "
                                                          f"{self.check_source})" if self.check_gap is not None
                                                          else ""),
            f"documents           {self.documents} in {self.parts_written} new parts"
            + (f" (+{self.parts_resumed} parts kept from the interrupted run)" if self.parts_resumed else ""),
            f"positions           {self.positions} ({self.predicted} with a prediction, {self.windows} windows)",
            f"bytes written       {self.bytes_written} ({self.bytes_written / max(1, self.positions):.1f} B/position)",
            f"wall time           {self.wall_s:.1f} s (engine start {self.engine_start_s:.1f} s); "
            f"{self.positions / capture:,.0f} positions/s over {self.capture_s:.1f} s of capture",
            f"time split          tokenize+align {self.prep_s:.1f} s, teacher {self.teacher_s:.1f} s, "
            f"targets {self.post_s:.1f} s, encode+write {self.write_s:.1f} s (threads overlap)",
            f"teacher waited      {self.teacher_wait_s:.2f} s on the writer, {self.input_wait_s:.2f} s on input",
            "skipped documents   " + (", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"),
        ]
        out += [f"WARNING             {n}" for n in self.notes]
        return out


# ------------------------------------------------------------------------------------ setup


@dataclass
class Plan:
    """Everything resolved before the teacher runs."""

    teacher_tok: object
    students: list[StudentSide]
    vocab_size: int
    k: int  # the store's k: --top-k in topk mode, V in full, min(--num-samples, V) in sampled
    window_len: int
    max_model_len: int
    cache_key: str
    fingerprints: dict
    settings: dict
    out: str
    shard_plan: object  # shard_plan.ShardPlan
    messages_field: str | None = None  # conversation corpus: the field holding the messages
    corpus_digests: object = None  # cache_inputs.ShareDigests: this job's files, checked against the store


def make_plan(cfg: TeacherDumpConfig) -> Plan:
    from stage1_teacher.head import read_config, weight_files
    from xtcache import fingerprint as fpr
    from xtcache.store import cache_path_for

    t, c = cfg.teacher, cfg.capture
    if not os.path.isdir(t.teacher):
        raise ConfigError(f"--teacher {t.teacher}: no such directory")
    model_cfg = read_config(t.teacher)
    weight_files(t.teacher)
    teacher_tok = load_tokenizer(t.teacher, "teacher tokenizer")
    vocab_size = len(teacher_tok)
    t_fp = fpr.tokenizer_fingerprint(teacher_tok)
    messages_field = preflight.resolve_messages_field(cfg)
    conversation = None
    if messages_field:  # every model renders with its own template: refuse one without, before the teacher loads
        from xtcache.chat import chat_fingerprint, require_template, turn_marker_ids

        require_template(teacher_tok, f"teacher tokenizer ({t.teacher})")
        conversation = {"messages_field": messages_field, "teacher_chat": chat_fingerprint(teacher_tok),
                        "teacher_turn_markers": turn_marker_ids(teacher_tok)}
    students = []
    own_fp = conversation["teacher_chat"] if conversation else t_fp
    for path in cfg.student_tokenizer:
        tok = load_tokenizer(path, "student tokenizer")
        if conversation:
            require_template(tok, f"student tokenizer ({path})")
        fp = chat_fingerprint(tok) if conversation else fpr.tokenizer_fingerprint(tok)
        if any(s.fingerprint == fp for s in students):
            continue
        students.append(StudentSide(name=path, tokenizer=tok, fingerprint=fp, identity=fp == own_fp))

    try:
        k = support_width(c.mode, c.top_k, c.num_samples, vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    max_pos = int(model_cfg.get("max_position_embeddings") or model_cfg.get("text_config", {}).get(
        "max_position_embeddings") or (c.max_seq_len + 1))
    max_model_len = t.max_model_len or min(c.max_seq_len + 1, max_pos)
    window_len = min(c.max_seq_len, max_model_len - 1)
    if window_len < c.max_seq_len:
        log.warning("--max-seq-len %d exceeds the teacher's context (%d positions): windows of %d tokens",
                    c.max_seq_len, max_pos, window_len)
    if c.window_overlap > window_len - 3:
        raise ConfigError(f"--window-overlap {c.window_overlap}: must be below the window of {window_len} - 2")
    part_bytes = cfg.store.docs_per_part * window_len * k * 8
    if part_bytes > 8 << 30:
        log.warning("one part may hold up to %.0f GiB of targets in memory (%d docs x %d tokens x %d ids); "
                    "lower --docs-per-part if that does not fit", part_bytes / (1 << 30), cfg.store.docs_per_part,
                    window_len, k)
    boundary = sorted(s.fingerprint for s in students if not s.identity)
    s = cfg.store
    shards = obtain_plan(cfg.input.data, messages_field or cfg.input.text_field, num_jobs=s.num_shards, job=s.shard_index,
                         out=s.out,
                         storage_options=cfg.data_options, store_options=s.storage_options, dry_run=cfg.dry_run)
    settings = settings_for_fingerprint(cfg, window_len=window_len, boundary_tokenizers=boundary,
                                        shard_plan=shards.fingerprint, conversation=conversation)
    settings["capture_engine"] = capture_identity(t)
    # one job: every byte's digest is in the key; several: each job checks its files against the store
    share = None if s.num_shards > 1 else share_digests(
        cfg.input.data, shards, 0, s.out, storage_options=cfg.data_options, store_options=s.storage_options)
    fingerprints = {"teacher_model": fpr.model_fingerprint(t.teacher), "teacher_tokenizer": t_fp,
                    "corpus": shards.corpus_fingerprint if share is None else fpr.content_fingerprint(
                        share.files.values()), "settings": fpr.settings_fingerprint(settings)}
    key = fpr.cache_key(**fingerprints)
    out = s.out or cache_path_for(s.cache_dir, key)
    share = share or share_digests(cfg.input.data, shards, s.shard_index, out, storage_options=cfg.data_options,
                                   store_options=s.storage_options)
    log.info("corpus check, job %d: %s", s.shard_index, share.stats.line())
    return Plan(teacher_tok=teacher_tok, students=students, vocab_size=vocab_size, k=k,
                window_len=window_len, max_model_len=max_model_len, cache_key=key, fingerprints=fingerprints,
                settings=settings, out=out, shard_plan=shards, messages_field=messages_field, corpus_digests=share)


def manifest_for(cfg: TeacherDumpConfig, plan: Plan):
    import xtcache
    from schemas.models import AlignGroupMeta, Manifest

    groups = [AlignGroupMeta(fingerprint=s.fingerprint, tokenizer_name=s.name, vocab_size=len(s.tokenizer),
                             identity=s.identity) for s in plan.students]
    return Manifest(cache_key=plan.cache_key, mode=cfg.capture.mode, k=plan.k, teacher_vocab_size=plan.vocab_size,
                    num_samples=cfg.capture.num_samples if cfg.capture.mode == "sampled" else None,
                    num_writers=cfg.store.num_shards, teacher_name=cfg.teacher.teacher,
                    fingerprints=plan.fingerprints, settings=plan.settings, alignment_groups=groups,
                    xtcache_version=getattr(xtcache, "__version__", ""),
                    shard_plan=plan.shard_plan.meta() if cfg.store.num_shards > 1 else None,
                    conversation=plan.messages_field is not None)


def find_reusable(cfg: TeacherDumpConfig, plan: Plan) -> str | None:
    """URL of a complete store for this cache key (at --out or under --cache-dir), else None."""
    from xtcache.store import CacheReader, find_cache

    try:
        r = CacheReader(plan.out, cfg.store.storage_options)
    except StoreError:
        r = None
    if r is not None:
        if r.manifest.cache_key != plan.cache_key and preflight.replace_stub(r, plan.out):
            return None
        had = r.manifest.shard_plan
        if had is not None and had.fingerprint != plan.shard_plan.fingerprint:
            raise StoreError(f"--out {plan.out} was filled under another shard plan ({had.num_jobs} jobs, fingerprint "
                             f"{had.fingerprint[:12]}..); a store keeps one plan: use another --out")
        if r.manifest.cache_key != plan.cache_key:
            raise StoreError(f"--out {plan.out} holds a cache written for another teacher, corpus or settings "
                             f"(cache key {r.manifest.cache_key[:16]}.. != {plan.cache_key[:16]}..); "
                             "use another --out or delete that store")
        if r.is_complete():
            return plan.out
    if cfg.store.cache_dir:
        return find_cache(cfg.store.cache_dir, plan.cache_key, cfg.store.storage_options)
    return None


# ------------------------------------------------------------------------------------- dry run


def dry_run(cfg: TeacherDumpConfig, plan: Plan) -> dict:
    """Documents, positions and an estimated store size, without the teacher."""
    import numpy as np

    from xtcache.codecs import default_codecs

    prep = Preparer(plan.teacher_tok, plan.students, window_len=plan.window_len, overlap=cfg.capture.window_overlap,
                    conversation=plan.messages_field is not None)
    docs = positions = windows = student_tokens = chunks = 0
    skipped: dict[str, int] = {}
    rows = iter_corpus(cfg.input.data, cfg.input.text_field, storage_options=cfg.data_options, plan=plan.shard_plan,
                       job=cfg.store.shard_index, messages_field=plan.messages_field)
    for part in iter_parts(rows, prep, docs_per_part=cfg.store.docs_per_part):
        for s in part.skipped:
            skipped[s.reason] = skipped.get(s.reason, 0) + 1
        for pd in part.docs:
            docs += 1
            positions += pd.num_tokens
            windows += len(pd.windows)
            for r in pd.alignments.values():
                student_tokens += len(r.student_ids)
                chunks += len(r.alignment.student_end)
    codec = default_codecs(cfg.capture.mode, plan.vocab_size)
    id_bytes = np.dtype(codec["topk_ids"]["configuration"].get("dtype", "uint32")).itemsize
    lp_bytes = 0
    if "topk_logprobs" in codec:
        lp_bytes = 1 if codec["topk_logprobs"]["configuration"].get("bits", 16) <= 8 else 2
    if cfg.capture.mode == "sampled":
        lp_bytes = 2  # uint16 counts
    per_position = plan.k * (id_bytes + lp_bytes) + 4 + 8 + 1 + 4 + 4
    raw = positions * per_position + student_tokens * 4 + chunks * 9
    return {"documents": docs, "positions": positions, "windows": windows, "skipped": skipped,
            "student_tokens": student_tokens, "chunks": chunks, "estimated_bytes_before_compression": raw,
            "bytes_per_position_before_compression": per_position, "store": plan.out, "cache_key": plan.cache_key}


# ------------------------------------------------------------------------------------ pipeline


class _PartState:
    """Per-document output arrays of one part, filled batch by batch by the post thread."""

    def __init__(self, part: Part, k: int, mode: str):
        self.part = part
        self.arrays = []
        for pd in part.docs:
            T = pd.num_tokens
            self.arrays.append({
                "has_pred": np.zeros(T, dtype=bool), "ids": np.zeros((T, k), dtype=np.int32),
                "logprobs": None if mode == "sampled" else np.zeros((T, k), dtype=np.float32),
                "counts": np.zeros((T, k), dtype=np.uint16) if mode == "sampled" else None,
                "residual": np.zeros(T, dtype=np.float32), "realized": np.full(T, np.nan, dtype=np.float32)})

    def records(self):
        from xtcache.store import DocRecord

        docs, aligns = [], {}
        for pd, a in zip(self.part.docs, self.arrays):
            docs.append(DocRecord(source=pd.doc.source, row=pd.doc.row, text=pd.doc.text, teacher_ids=pd.teacher_ids,
                                  char_offsets=pd.offsets, has_pred=a["has_pred"], topk_ids=a["ids"],
                                  topk_logprobs=a["logprobs"], topk_counts=a["counts"], residual=a["residual"],
                                  realized_logprob=a["realized"], content_hash=pd.doc.content_hash,
                                  conversation=pd.conversation))
            for fp, rec in pd.alignments.items():
                aligns.setdefault(fp, []).append(rec)
        return docs, aligns


def _put(q: queue.Queue, item, stop: threading.Event) -> float:
    """Blocking put that gives up when another stage failed; returns the seconds spent blocked."""
    t0 = time.perf_counter()
    while True:
        try:
            q.put(item, timeout=0.2)
            return time.perf_counter() - t0
        except queue.Full:
            if stop.is_set():
                raise _Stopped() from None


def _get(q: queue.Queue, stop: threading.Event):
    while True:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if stop.is_set():
                raise _Stopped() from None


class _Stopped(Exception):
    """Another pipeline stage failed; its error is re-raised by the main thread."""


def run_teacher_dump(cfg: TeacherDumpConfig, *, engines=None, progress: bool = True) -> Summary | dict:
    """Run `xtcache teacher-dump`; returns the Summary (or the dry-run counts with --dry-run).

    `engines`: an optional `capture.EngineCache` shared between several dumps in one process
    (tests); without it the engines are started here and always shut down before returning.
    """
    from xtcache.store import CacheWriter

    t_start = time.perf_counter()
    _place_job(cfg)
    preflight.check_inputs(cfg)  # corpus rows and output location, before the teacher is hashed or loaded
    plan = make_plan(cfg)
    if cfg.dry_run:
        return dry_run(cfg, plan)
    summary = Summary(store=plan.out)
    reusable = find_reusable(cfg, plan)
    if reusable is not None:
        from stage1_teacher.align_cmd import ensure_groups

        summary.store, summary.reused = reusable, True
        if reusable != plan.out:
            summary.notes.append(f"--out {plan.out} was not written: the cache for this request is {reusable}")
        summary.alignment_groups_added = ensure_groups(reusable, plan.students, plan.teacher_tok,
                                                       cfg.store.storage_options)
        log.info("complete cache for this request found at %s: no teacher work", reusable)
        return summary
    if cfg.store.cache_dir and not cfg.store.out:
        log.info("writing cache %s", plan.out)
    log.info("job %d of %d (index from %s): %d corpus ranges, %d of %d bytes", cfg.store.shard_index,
             cfg.store.num_shards, cfg.store.shard_source, len(plan.shard_plan.jobs[cfg.store.shard_index]),
             plan.shard_plan.job_bytes()[cfg.store.shard_index], plan.shard_plan.corpus_bytes())
    writer = CacheWriter(plan.out, manifest_for(cfg, plan), writer_index=cfg.store.shard_index,
                         storage_options=cfg.store.storage_options, resume=cfg.store.resume)
    try:
        if cfg.store.num_shards > 1:
            _store_plan(plan, cfg.store.storage_options)
        record_digests(plan.out, plan.corpus_digests, plan.shard_plan.fingerprint, cfg.store.storage_options)
        committed = {m.part_index: m for m in writer.committed_parts()}
        if committed and not cfg.store.resume:
            raise ConfigError(f"--out {plan.out}: writer {cfg.store.shard_index} already has {len(committed)} "
                              "committed parts from an earlier run; pass --resume to continue it")
        checks = CheckRecords(cfg, plan) if needs_check(cfg) else None
        _pipeline(cfg, plan, writer, committed, summary, engines, progress, checks)
        # parts captured on the strength of another writer's check (deferred here, or by an earlier
        # run of this writer when nothing was left to capture) wait for its passed record
        if checks is not None and (summary.check_source == DEFERRED or
                                   (summary.check_source == "" and not checks.checker)):
            rec = checks.wait_for_passed()
            summary.check_gap, summary.check_source = rec.max_gap, f"checked by writer {rec.writer_index}"
        summary.wall_s = time.perf_counter() - t_start
        if summary.documents == 0 and not committed and summary.skipped:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(summary.skipped.items()))
            field_flag = (f"--messages-field {plan.messages_field!r}" if plan.messages_field else
                          f"--text-field {cfg.input.text_field!r}")
            raise ConfigError(f"no usable document in --data (skipped: {reasons}); check {field_flag} and the "
                              "corpus files")
        writer.finish(summary.as_dict())
    finally:
        writer.close()
    return summary


class CheckRecords:
    """The store's first-batch checks of the vLLM fast path (`capture_checks/<key>.json`).

    The check costs a second engine start (the prompt-log-probs reference), so a store runs it
    once per (teacher, vLLM version, dtype, tensor-parallel size): writer 0 (or a single job) runs
    it when no record exists and records it; the other writers start only the hidden-state engine
    and, before marking themselves done, wait for a passed record. A writer whose key differs from
    the recorded ones runs its own check. A failed record stops every writer. With
    `--trust-check-from STORE` a writer whose store holds no record for its key trusts STORE's
    passed record instead (one teacher filling several stores checks once) and writer 0 keeps a
    copy in this store, naming STORE in its `reference`, for the other writers (`keep_borrowed`);
    STORE without one is an error before any engine starts.
    """

    def __init__(self, cfg: TeacherDumpConfig, plan: Plan):
        from stage1_teacher.capture import check_key
        from xtcache.store_io import Location

        t = cfg.teacher
        self.what = check_key(plan.fingerprints["teacher_model"], t)
        self.loc = Location(plan.out, cfg.store.storage_options)
        self.rel = f"capture_checks/{self.what['key']}.json"
        self.writer = cfg.store.shard_index
        self.checker = cfg.store.shard_index == 0 or cfg.store.num_shards == 1
        self.trust_from = t.trust_check_from
        self.borrowed_from: str | None = None  # the other store whose record `read` returned
        self.borrowed = None  # that record
        self.storage_options = cfg.store.storage_options

    def runs_here(self) -> bool:
        """No record for this key: writer 0 checks; another writer checks only when the store holds
        records for other keys only (writer 0 checked another vLLM version, dtype or TP size)."""
        return self.checker or any(n.endswith(".json") for n in self.loc.listdir("capture_checks"))

    def read(self):
        from schemas.models import CaptureCheck
        from xtcache.store_io import read_model

        raw = self.loc.read_json(self.rel)
        rec = None if raw is None else read_model(CaptureCheck, raw, f"{self.loc.url}/{self.rel}")
        if rec is None and self.trust_from:
            from xtcache.store_io import Location

            other = Location(self.trust_from, self.storage_options)
            raw = other.read_json(self.rel)
            if raw is None:
                raise CaptureError(f"--trust-check-from {self.trust_from}: that store holds no first-batch check of "
                                   f"this teacher, vLLM {self.what['vllm_version']} on {self.what['platform']}, "
                                   f"{'eager' if self.what['enforce_eager'] else 'compiled'}, dtype "
                                   f"{self.what['dtype']} and tensor-parallel size "
                                   f"{self.what['tensor_parallel_size']} ({self.rel}); drop the option to run the "
                                   "check here")
            rec = read_model(CaptureCheck, raw, f"{other.url}/{self.rel}")
            self.borrowed, self.borrowed_from = rec, other.url
        if rec is not None and any(getattr(rec, f) != v for f, v in self.what.items()):
            raise CorruptionError(f"{self.rel}: the record names another teacher, vLLM, platform or settings than "
                                  f"its key ({rec.platform or 'no platform'}, vLLM {rec.vllm_version}, dtype "
                                  f"{rec.dtype}); it was not written by xtcache for this key: remove it")
        if rec is not None and not rec.passed:
            raise CaptureError(f"writer {rec.writer_index}'s first-batch check of the fast path failed for this teacher "
                               f"(vLLM {rec.vllm_version}, dtype {rec.dtype}); rerun the store with --no-fast-path")
        return rec

    def keep_borrowed(self) -> None:
        """Writer 0 copies the passed record `read` took from --trust-check-from into this store, so
        that the store's other writers and its resumes trust it without the option."""
        if self.borrowed is not None and self.borrowed.passed and self.checker:
            copy = self.borrowed.model_copy(update={"reference": f"{self.borrowed.reference}; recorded in "
                                                                 f"{self.borrowed_from}"})
            self.loc.create_exclusive(self.rel, copy.model_dump(mode="json"))

    def write(self, check: dict) -> None:
        from schemas.models import CaptureCheck
        from xtcache.store_io import now_iso

        rec = CaptureCheck(**self.what, **check, writer_index=self.writer, created=now_iso())
        if not self.loc.create_exclusive(self.rel, rec.model_dump(mode="json")):
            log.info("a first-batch check record already exists at %s/%s", self.loc.url, self.rel)

    def wait_for_passed(self):
        deadline = time.monotonic() + CHECK_WAIT_S
        rec = self.read()
        if rec is None:
            log.info("waiting for writer 0's first-batch check record at %s/%s", self.loc.url, self.rel)
        while rec is None:
            if time.monotonic() > deadline:
                raise CaptureError(f"no first-batch check of the fast path was recorded in {self.loc.url} within "
                                   f"{CHECK_WAIT_S:.0f} s (writer 0 runs it); this writer's parts are committed but it "
                                   "is not marked done: rerun it with --resume once writer 0 has run")
            time.sleep(2.0)
            try:
                rec = self.read()
            except CorruptionError:  # being written
                rec = None
        return rec


CHECK_WAIT_S = 1800.0
DEFERRED = "deferred to writer 0's record"


def _pipeline(cfg, plan: Plan, writer, committed: dict, summary: Summary, engines, progress: bool,
              checks: CheckRecords | None) -> None:
    from stage1_teacher.capture import open_capture

    prep = Preparer(plan.teacher_tok, plan.students, window_len=plan.window_len, overlap=cfg.capture.window_overlap,
                    conversation=plan.messages_field is not None)
    stop = threading.Event()
    errors: list[BaseException] = []
    q_in: queue.Queue = queue.Queue(maxsize=2)
    q_post: queue.Queue = queue.Queue(maxsize=2)
    q_write: queue.Queue = queue.Queue(maxsize=2)
    lock = threading.Lock()
    bar = _progress_bar(cfg, plan.shard_plan, progress)

    def guarded(fn):
        def run():
            try:
                fn()
            except _Stopped:
                pass
            except BaseException as e:  # handed to the main thread
                errors.append(e)
                stop.set()
        return run

    def produce():
        rows = iter_corpus(cfg.input.data, cfg.input.text_field, storage_options=cfg.data_options,
                           plan=plan.shard_plan, job=cfg.store.shard_index, messages_field=plan.messages_field)
        for part in iter_parts(rows, prep, docs_per_part=cfg.store.docs_per_part):
            with lock:
                for s in part.skipped:
                    summary.skipped[s.reason] = summary.skipped.get(s.reason, 0) + 1
            if not part.docs:
                continue
            if part.index in committed:
                _check_committed(committed[part.index], part)
                with lock:
                    summary.parts_resumed += 1
                if bar is not None:
                    bar.update(len(part.docs))
                continue
            state = _PartState(part, plan.k, cfg.capture.mode)
            batches = part_batches(part, prep, cfg.capture.batch_tokens)
            for i, b in enumerate(batches):
                _put(q_in, (state, b, i == len(batches) - 1), stop)
        _put(q_in, None, stop)

    def post():
        while True:
            item = _get(q_post, stop)
            if item is None:
                _put(q_write, None, stop)
                return
            state, batch, last, raw = item
            t0 = time.perf_counter()
            _fill_batch(state, batch, raw, cap)
            with lock:
                summary.post_s += time.perf_counter() - t0
            if last:
                _put(q_write, state, stop)

    def write():
        while True:
            state = _get(q_write, stop)
            if state is None:
                return
            t0 = time.perf_counter()
            docs, aligns = state.records()
            meta = writer.write_part(state.part.index, docs, aligns)
            nbytes = sum(a.stored_bytes for a in meta.arrays.values())
            with lock:
                summary.write_s += time.perf_counter() - t0
                summary.parts_written += 1
                summary.documents += meta.num_docs
                summary.positions += meta.num_positions
                summary.predicted += meta.num_predicted
                summary.bytes_written += nbytes
            if bar is not None:
                bar.update(meta.num_docs)
                bar.set_postfix_str(f"{summary.positions:,} pos, {summary.bytes_written / 1e6:.1f} MB", refresh=False)

    threads = [threading.Thread(target=guarded(f), name=f"xtcache-{f.__name__}", daemon=True)
               for f in (produce, post, write)]
    threads[0].start()
    cap = None
    restore_threads = _share_cpu_with_vllm(cfg)
    try:
        t_wait = time.perf_counter()
        first = _get(q_in, stop)
        summary.input_wait_s += time.perf_counter() - t_wait
        if first is None:
            log.info("nothing to capture: every part is committed or the stream is empty")
        else:
            trusted = None
            if checks is not None:
                rec = checks.read()
                trusted = rec.model_dump() if rec is not None else (None if checks.runs_here() else {})
            try:
                cap = open_capture(cfg, vocab_size=plan.vocab_size, k=plan.k, window_len=plan.window_len,
                                   max_model_len=plan.max_model_len, first_batch=[w.tokens for w in first[1]],
                                   engines=engines, trusted=trusted)
            except CaptureError as e:
                if checks is not None and getattr(e, "check", None) is not None:
                    checks.write(e.check)
                raise
            if checks is not None and cap.check is not None:
                checks.write(cap.check)
                summary.check_source = "ran here"
            elif cap.kind != "hidden":  # the prompt log-probs path is the reference itself
                summary.check_source = "not needed (prompt log-probs)"
            elif trusted and checks.borrowed_from:
                checks.keep_borrowed()
                summary.check_source = f"trusted from {checks.borrowed_from}"
            elif trusted:
                summary.check_source = f"checked by writer {trusted['writer_index']}"
            elif trusted is not None:
                summary.check_source = DEFERRED
            summary.capture_path, summary.notes, summary.check_gap = cap.path, cap.notes, cap.check_gap
            summary.engine_start_s = cap.start_seconds
            t_pos = time.perf_counter()
        for th in threads[1:]:
            th.start()
        item = first
        while item is not None:
            state, batch, last = item
            t0 = time.perf_counter()
            raw = cap.engine.run([w.tokens for w in batch])
            summary.teacher_s += time.perf_counter() - t0
            summary.windows += len(batch)
            summary.teacher_wait_s += _put(q_post, (state, batch, last, raw), stop)
            t_wait = time.perf_counter()
            item = _get(q_in, stop)
            summary.input_wait_s += time.perf_counter() - t_wait
            if bar is not None:
                bar.set_description(f"{summary.positions / max(1e-9, time.perf_counter() - t_pos):,.0f} pos/s")
        _put(q_post, None, stop)
        for th in threads:
            th.join()
        if cap is not None:
            summary.capture_s = time.perf_counter() - t_pos
        summary.prep_s = prep.seconds
    except _Stopped:
        pass
    except BaseException:
        stop.set()
        raise
    finally:
        if errors:
            stop.set()
        restore_threads()
        if cap is not None:
            cap.close()
        if bar is not None:
            bar.close()
        for th in threads:
            if th.is_alive() and errors:
                th.join(timeout=5)
    if errors:
        raise errors[0]


def _fill_batch(state: _PartState, batch: list, raws: list, cap) -> None:
    """Compute the targets of one teacher batch and place them into the documents' arrays."""
    todo, where = [], []
    for wi, raw in zip(batch, raws):
        pd = state.part.docs[wi.doc]
        w = pd.windows[wi.window]
        doc_rows = np.arange(w.store_start, w.end)[window_has_pred(w)]
        state.arrays[wi.doc]["has_pred"][doc_rows] = True
        if len(doc_rows):
            rows = w.prefix + (doc_rows - w.ctx_start)  # window rows, all >= 1
            todo.append((raw, rows, wi.tokens, pd.doc.content_hash, wi.window))
            where.append((wi.doc, doc_rows))
    for (doc, doc_rows), t in zip(where, cap.targets_many(todo)):
        a = state.arrays[doc]
        a["ids"][doc_rows] = t.ids
        if a["logprobs"] is not None:
            a["logprobs"][doc_rows] = t.logprobs
        if a["counts"] is not None:
            a["counts"][doc_rows] = t.counts
        a["residual"][doc_rows] = t.residual
        a["realized"][doc_rows] = t.realized


def _place_job(cfg) -> None:
    """Under a launcher that starts several jobs per node, give this job its own GPUs (before
    anything asks CUDA a question: the engine's workers inherit CUDA_VISIBLE_DEVICES)."""
    from xtcache.devices import cuda_present, job_devices

    if not cuda_present():
        return
    devices = job_devices(cfg.teacher.tensor_parallel_size)
    if devices is not None:
        log.info("job with LOCAL_RANK %s of %s on this node: CUDA_VISIBLE_DEVICES=%s", os.environ["LOCAL_RANK"],
                 os.environ["LOCAL_WORLD_SIZE"], devices)
        os.environ["CUDA_VISIBLE_DEVICES"] = devices


def _share_cpu_with_vllm(cfg):
    """On a CPU host, use one torch thread while vLLM's worker holds the other cores.

    vLLM's CPU worker binds its OpenMP threads to all cores but the reserved one; two OpenMP
    teams contending for the same cores made our lm_head/top-k 4x slower (measured on 2 cores:
    10k vs 40k rows/s). Returns the function that restores the previous setting.
    """
    import torch

    from xtcache.devices import cuda_present

    if cfg.teacher.engine != "vllm" or cuda_present():
        return lambda: None
    before = torch.get_num_threads()
    reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 1)
    torch.set_num_threads(max(1, min(before, reserved)))
    return lambda: torch.set_num_threads(before)


def _store_plan(plan: Plan, storage_options: dict) -> None:
    """The store keeps the plan its writers read by (written here when no writer 0 stored it first)."""
    from xtcache.store_io import Location

    loc = Location(plan.out, storage_options)
    if loc.read_json(PLAN_FILE) is None:
        loc.create_exclusive(PLAN_FILE, plan.shard_plan.as_json())


def _check_committed(meta, part: Part) -> None:
    want = [(d.doc.source, d.doc.row, d.doc.content_hash) for d in part.docs]
    have = [(d.source, d.row, d.content_hash) for d in meta.docs]
    if want != have:
        raise StoreError(f"committed part {meta.shard_id} holds other documents than the corpus gives now "
                         "(the corpus or --docs-per-part changed since the interrupted run); start a new --out")


def _progress_bar(cfg: TeacherDumpConfig, shard_plan, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=_count_rows(shard_plan, cfg), unit="doc", dynamic_ncols=True, mininterval=1.0)


def _count_rows(shard_plan, cfg: TeacherDumpConfig) -> int | None:
    """Rows of this job's ranges (cheap: the plan's row-group counts or a newline count of its local
    files), for the progress bar's ETA. None (no ETA) for Arrow files and for remote text files,
    which would have to be read twice."""
    from xtcache.store_io import is_local, local_path

    total = 0
    for r in shard_plan.jobs[cfg.store.shard_index]:
        rows = shard_plan.range_rows(r)
        url = cfg.input.data[r.file]
        if rows is not None:
            total += rows
        elif shard_plan.files[r.file].format == "arrow" or not is_local(url):
            return None
        else:
            try:
                with open(local_path(url), "rb") as f:
                    total += sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 22), b""))
            except OSError:
                return None
    return total


__all__ = ["Summary", "run_teacher_dump", "make_plan", "dry_run"]
