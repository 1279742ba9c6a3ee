"""The threads of `xtcache teacher-dump`, so that the teacher never waits for the disk:

  prep thread     reads the corpus, tokenizes, aligns, plans windows, packs batches (bounded queue)
  main thread     runs the teacher on batch n+1 ...
  post thread     ... while batch n becomes top-k / full / sampled targets (lm_head on the device)
  writer thread   and finished parts are encoded, compressed and committed to the store

Queues hold at most two items each; the time the main thread spends blocked handing a batch to
the post thread is reported as "teacher waited on writer". A stage that fails stops the others
and its error is raised by the main thread.

    python -c "from stage1_teacher.pipeline import run_pipeline"   # used by stage1_teacher.dump
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from stage1_teacher.check_records import DEFERRED, CheckRecords
from stage1_teacher.corpus import iter_corpus
from stage1_teacher.dump_plan import Plan
from stage1_teacher.placement import share_cpu_with_vllm
from stage1_teacher.prep import Part, Preparer, iter_parts, part_batches
from stage1_teacher.progress import progress_bar
from stage1_teacher.summary import Summary
from stage1_teacher.windows import window_has_pred
from xtcache.errors import CaptureError, StoreError

log = logging.getLogger(__name__)


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



def run_pipeline(cfg, plan: Plan, writer, committed: dict, summary: Summary, engines, progress: bool,
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
    bar = progress_bar(cfg, plan.shard_plan, progress)

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
                check_committed(committed[part.index], part)
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
    restore_threads = share_cpu_with_vllm(cfg)
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



def check_committed(meta, part: Part) -> None:
    want = [(d.doc.source, d.doc.row, d.doc.content_hash) for d in part.docs]
    have = [(d.source, d.row, d.content_hash) for d in meta.docs]
    if want != have:
        raise StoreError(f"committed part {meta.shard_id} holds other documents than the corpus gives now "
                         "(the corpus or --docs-per-part changed since the interrupted run); start a new --out")
