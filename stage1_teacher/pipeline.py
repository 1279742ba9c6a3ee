"""The threads of `xtcache teacher-dump`, so that the teacher never waits for the disk:

  prep thread     reads the corpus, tokenizes, aligns, plans windows, packs batches (bounded queue)
  main thread     runs the teacher on a batch ...
  post thread     ... while the windows the engine has finished (each forward or call, see
                  `stage1_teacher.capture.progress`) become top-k / full / sampled targets (lm_head on the
                  device) and move the progress bar
  writer thread   and finished parts are encoded, compressed and committed to the store

Queues hold at most two items each; the time the main thread spends blocked handing finished
windows to the post thread is reported as "teacher waited on writer". A stage that fails stops
the others and its error is raised by the main thread.

    python -c "from stage1_teacher.pipeline import run_pipeline"   # used by stage1_teacher.dump
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time

import numpy as np

from schemas.arrays import entry_widths
from schemas.models import DRAWN_MODES
from stage1_teacher.capture.progress import CaptureProgress
from stage1_teacher.capture.run import open_capture
from stage1_teacher.check_records import DEFERRED, CheckRecords
from stage1_teacher.corpus import iter_corpus
from stage1_teacher.placement import share_cpu_with_vllm
from stage1_teacher.plan import Plan
from stage1_teacher.prep import Part, Preparer, iter_parts, part_batches
from stage1_teacher.summary import Summary
from stage1_teacher.windows import window_has_pred
from xtcache.errors import CaptureError, StoreError
from xtcache.store import DocRecord

log = logging.getLogger(__name__)


class _PartState:
    """Per-document output arrays of one part, filled batch by batch by the post thread."""

    def __init__(self, part: Part, k: int, mode: str, top_k: int | None = None):
        self.part = part
        self.arrays = []
        widths = entry_widths(mode, k, top_k)  # headtail: the head's log-probs and the tail's counts
        for pd in part.docs:
            T = pd.num_tokens
            self.arrays.append({
                "has_pred": np.zeros(T, dtype=bool), "ids": np.zeros((T, k), dtype=np.int32),
                "logprobs": None if mode == "sampled" else np.zeros((T, widths["k_head"]), dtype=np.float32),
                "counts": np.zeros((T, widths["k_tail"]), dtype=np.uint16) if mode in DRAWN_MODES else None,
                "residual": np.zeros(T, dtype=np.float32), "realized": np.full(T, np.nan, dtype=np.float32)})

    def records(self):
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



def run_pipeline(cfg, plan: Plan, writer, committed: dict, summary: Summary, engines, progress: bool,
                 checks: CheckRecords | None) -> None:
    """Capture and write every part of this job that is not in `committed` (part index -> its
    committed meta, checked against the corpus), filling `summary`."""
    _Pipeline(cfg, plan, writer, committed, summary, progress).run(engines, checks)


class _Pipeline:
    """One run's threads, their queues and the summary they fill (under `lock`)."""

    def __init__(self, cfg, plan: Plan, writer, committed: dict, summary: Summary, progress: bool):
        self.cfg, self.plan, self.writer, self.committed, self.summary = cfg, plan, writer, committed, summary
        self.prep = Preparer(plan.teacher_tok, plan.students, window_len=plan.window_len,
                             overlap=cfg.capture.window_overlap, conversation=plan.messages_field is not None)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.q_in: queue.Queue = queue.Queue(maxsize=2)
        self.q_post: queue.Queue = queue.Queue(maxsize=2)
        self.q_write: queue.Queue = queue.Queue(maxsize=2)
        self.lock = threading.Lock()
        self.progress = CaptureProgress.for_job(plan.corpus, plan.shard_plan, cfg.store.shard_index, progress)
        self.cap = None

    def run(self, engines, checks: CheckRecords | None) -> None:
        threads = [threading.Thread(target=self._guarded(f), name=f"xtcache-{f.__name__}", daemon=True)
                   for f in (self.produce, self.post, self.write)]
        threads[0].start()
        restore_threads = share_cpu_with_vllm(self.cfg)
        try:
            first = self._next_input()
            if first is None:
                log.info("nothing to capture: every part is committed or the stream is empty")
            else:
                self.cap = _start_capture(self.cfg, self.plan, self.summary, first, engines, checks)
                self.progress.start()
            t_pos = time.perf_counter()
            for th in threads[1:]:
                th.start()
            self._run_teacher(first)
            for th in threads:
                th.join()
            self.progress.close()
            if self.cap is not None:
                self.summary.capture_s = time.perf_counter() - t_pos
            self.summary.prep_s = self.prep.seconds
        except _Stopped:
            pass
        except BaseException:
            self.stop.set()
            raise
        finally:
            self._close(threads, restore_threads)
        if self.errors:
            raise self.errors[0]

    def _close(self, threads: list, restore_threads) -> None:
        if self.errors:
            self.stop.set()
        restore_threads()
        self.progress.close()
        if self.cap is not None:
            self.cap.close()
        for th in threads:
            if th.is_alive() and self.errors:
                th.join(timeout=5)

    def _next_input(self):
        t_wait = time.perf_counter()
        item = _get(self.q_in, self.stop)
        self.summary.input_wait_s += time.perf_counter() - t_wait
        return item

    def _run_teacher(self, item) -> None:
        """The main thread: the teacher on each batch; the windows the engine reports finished go to
        the post thread as they come, so targets are made while the engine runs the rest."""
        summary = self.summary
        while item is not None:
            state, batch, last = item
            left = [len(batch)]
            t0, waited = time.perf_counter(), summary.teacher_wait_s
            self.cap.engine.run([w.tokens for w in batch],
                                done=functools.partial(self._hand_over, state, batch, last, left))
            summary.teacher_s += time.perf_counter() - t0 - (summary.teacher_wait_s - waited)
            summary.windows += len(batch)
            item = self._next_input()
        _put(self.q_post, None, self.stop)

    def _hand_over(self, state: _PartState, batch: list, last: bool, left: list[int], indices, raws: list) -> None:
        """The engine finished windows `indices` of `batch` (outputs `raws`): to the post thread, the
        final ones of the part's last batch flagged `last`."""
        left[0] -= len(indices)
        sub = [batch[i] for i in indices]
        self.summary.teacher_wait_s += _put(self.q_post, (state, sub, last and left[0] == 0, raws), self.stop)

    def _guarded(self, fn):
        def run():
            try:
                fn()
            except _Stopped:
                pass
            except BaseException as e:  # handed to the main thread
                self.errors.append(e)
                self.stop.set()
        return run

    def produce(self) -> None:
        cfg, plan, summary = self.cfg, self.plan, self.summary
        rows = iter_corpus(plan.corpus, plan=plan.shard_plan, job=cfg.store.shard_index)
        for part in iter_parts(rows, self.prep, docs_per_part=cfg.store.docs_per_part, max_positions=plan.part_positions):
            with self.lock:
                for s in part.skipped:
                    summary.skipped[s.reason] = summary.skipped.get(s.reason, 0) + 1
            positions = sum(pd.num_tokens for pd in part.docs)
            self.progress.planned(len(part.docs) + len(part.skipped), positions)
            if not part.docs:
                continue
            if part.index in self.committed:
                check_committed(self.committed[part.index], part)
                with self.lock:
                    summary.parts_resumed += 1
                self.progress.resumed(positions)
                continue
            state = _PartState(part, plan.k, cfg.capture.mode, cfg.capture.top_k)
            batches = part_batches(part, self.prep, cfg.capture.batch_tokens)
            for i, b in enumerate(batches):
                _put(self.q_in, (state, b, i == len(batches) - 1), self.stop)
        self.progress.planned_everything()
        _put(self.q_in, None, self.stop)

    def post(self) -> None:
        while True:
            item = _get(self.q_post, self.stop)
            if item is None:
                _put(self.q_write, None, self.stop)
                return
            state, batch, last, raw = item
            t0 = time.perf_counter()
            _fill_batch(state, batch, raw, self.cap)
            with self.lock:
                self.summary.post_s += time.perf_counter() - t0
            self.progress.captured(sum(_kept_positions(state.part, wi) for wi in batch))
            if last:
                _put(self.q_write, state, self.stop)

    def write(self) -> None:
        summary = self.summary
        while True:
            state = _get(self.q_write, self.stop)
            if state is None:
                return
            t0 = time.perf_counter()
            docs, aligns = state.records()
            meta = self.writer.write_part(state.part.index, docs, aligns)
            nbytes = sum(a.stored_bytes for a in meta.arrays.values())
            with self.lock:
                summary.write_s += time.perf_counter() - t0
                summary.parts_written += 1
                summary.documents += meta.num_docs
                summary.positions += meta.num_positions
                summary.predicted += meta.num_predicted
                summary.bytes_written += nbytes
            self.progress.written(meta.num_docs, nbytes)


def _start_capture(cfg, plan: Plan, summary: Summary, first, engines, checks: CheckRecords | None):
    """Open the capture path on the first batch (checked, or trusting the store's record) and note in
    `summary` which path runs and where its first-batch check comes from."""
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
    return cap


def _kept_positions(part: Part, wi) -> int:
    """Positions of its document that window item `wi` keeps (each position is kept by one window)."""
    w = part.docs[wi.doc].windows[wi.window]
    return w.end - w.store_start


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



def check_committed(meta, part: Part) -> None:
    want = [(d.doc.source, d.doc.row, d.doc.content_hash) for d in part.docs]
    have = [(d.source, d.row, d.content_hash) for d in meta.docs]
    if want != have:
        raise StoreError(f"committed part {meta.shard_id} holds other documents than the corpus gives now "
                         "(the corpus or --docs-per-part changed since the interrupted run); start a new --out")
