"""Micro-batch assembly of stage 2: packed windows of document segments -> one numpy micro-batch.

A window is a list of segments (a shard's decoded arrays as a `ShardSource`, a document, its chunk
range and leading context chunks); `build_micro_batch` lays the windows' student tokens, CE labels
and valid chunks out as the "Stage 2 batch" of docs/architecture.md and gathers the teacher rows of
the valid chunks. Pure numpy: no store access, no torch.

A chunk is valid when both sides are non-empty, its first student token has a predicting logit in
the window and all its teacher rows have a prediction. Conversation caches: each student token has
a stored role (`xtcache.chat.layout`) and `train_on` (assistant, last-assistant or all) picks the tokens
trained (`ShardSource.trained`); a position whose predicted token is not one of them gets no CE
label (-100), and a chunk is valid only when every student token in it is trained and both sides
spell the same text (template-only and straddling chunks get no KD). Rollout caches that store the
sampling policy's log-probs (`ShardSource.sampled_logprobs`) also give `sampled_logprobs` [B, L],
laid out like `labels` (NaN where the label was not sampled), for `--loss rkl-pg`'s ratio.

    batch = build_micro_batch([[(src, doc, lo, hi, ctx)], ...], seq_len=512, pad_id=0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IGNORE = -100


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lengths[i]), int64."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(total, dtype=np.int64)


@dataclass
class ShardSource:
    """Decoded arrays of one shard as the batch builder needs them (plain numpy)."""

    doc_pos_offsets: np.ndarray  # int64 [D+1] into teacher rows
    doc_student_offsets: np.ndarray  # int64 [D+1] into student_ids
    doc_chunk_offsets: np.ndarray  # int64 [D+1] into the chunk arrays
    student_ids: np.ndarray  # int32 [S]
    student_end: np.ndarray  # int32 [C] document-local exclusive ends
    teacher_end: np.ndarray  # int32 [C]
    exact: np.ndarray  # bool [C]
    has_pred: np.ndarray  # bool [P]
    topk_ids: np.ndarray  # int32 [P, k]
    topk_logprobs: np.ndarray | None  # float32 [P, k_head] (schemas.arrays.entry_widths)
    topk_counts: np.ndarray | None  # uint16 [P, k_tail]
    residual: np.ndarray  # float32 [P]
    realized_logprob: np.ndarray  # float32 [P]
    trained: np.ndarray | None = None  # bool [S] conversation caches: the student tokens --train-on trains
    sampled_logprobs: np.ndarray | None = None  # float32 [S] rollout caches: sampling log-probs, NaN: not sampled
    skip_turn_starts: bool = False  # conversation caches: each trained turn's first row trains CE only (no KD)


@dataclass(frozen=True)
class Segment:
    """Chunks [lo, hi) of one document, as a window holds them. Arrays are [hi - lo], one per chunk;
    student positions count from the document's first student token, teacher positions from its
    first teacher row."""

    c0: int  # the document's first chunk in the shard's chunk arrays
    s_begin: int  # the segment's first student token
    s_start: np.ndarray  # int64: each chunk's first student token
    s_end: np.ndarray  # int64: each chunk's exclusive student end
    s_len: np.ndarray  # int64: student tokens per chunk
    t_start: np.ndarray  # int64: each chunk's first teacher row
    t_len: np.ndarray  # int64: teacher rows per chunk
    p_off: int  # the document's first row in the shard's position arrays
    real: np.ndarray  # bool: both sides non-empty
    valid: np.ndarray  # bool: real, predicted inside the segment, trained, past the context chunks

    @property
    def s_stop(self) -> int:
        """The exclusive end of the segment's student tokens."""
        return int(self.s_end[-1])


def segment_chunks(src: ShardSource, d: int, lo: int, hi: int, n_ctx: int = 0) -> Segment:
    """The chunks [lo, hi) of document d as one window segment: student/teacher spans and validity.

    A chunk is `real` when both sides are non-empty and `valid` when it is real, its first student
    token has a predicting logit inside the segment, all its teacher rows have a prediction and it
    is not one of the segment's first `n_ctx` (context) chunks. Independent of where the segment
    lies in its window.
    """
    c0 = int(src.doc_chunk_offsets[d])
    s_end = src.student_end[c0 + lo:c0 + hi].astype(np.int64)  # [n]
    t_end = src.teacher_end[c0 + lo:c0 + hi].astype(np.int64)
    s_begin = int(src.student_end[c0 + lo - 1]) if lo > 0 else 0
    t_begin = int(src.teacher_end[c0 + lo - 1]) if lo > 0 else 0
    s_start = np.concatenate([[s_begin], s_end[:-1]])  # [n]
    t_start = np.concatenate([[t_begin], t_end[:-1]])
    s_len, t_len = s_end - s_start, t_end - t_start
    p_off = int(src.doc_pos_offsets[d])
    no_pred = np.concatenate([[0], np.cumsum(~src.has_pred[p_off + t_begin:p_off + int(t_end[-1])])])
    all_pred = (no_pred[t_end - t_begin] - no_pred[t_start - t_begin]) == 0
    real = (s_len > 0) & (t_len > 0)
    valid = real & (s_start > s_begin) & all_pred  # predicted from inside the segment
    if src.trained is not None:  # conversation cache: every student token of the chunk trained, same text
        s_off = int(src.doc_student_offsets[d])
        untrained = np.concatenate([[0], np.cumsum(~src.trained[s_off + s_begin:s_off + int(s_end[-1])])])
        valid &= (untrained[s_end - s_begin] == untrained[s_start - s_begin]) & src.exact[c0 + lo:c0 + hi]
    valid[:n_ctx] = False
    return Segment(c0=c0, s_begin=s_begin, s_start=s_start, s_end=s_end, s_len=s_len, t_start=t_start,
                   t_len=t_len, p_off=p_off, real=real, valid=valid)


def build_micro_batch(windows: list[list[tuple]], seq_len: int, pad_id: int) -> dict[str, np.ndarray | int]:
    """Numpy micro-batch (docs/architecture.md "Stage 2 batch") from windows of segments.

    Each window is a list of segments (source, doc, chunk_lo, chunk_hi, context) where `context`
    is the number of leading context chunks (only a window's first segment has any), optionally followed by
    (group, keep): int64 [hi - lo] the micro-batch's chunk group of each chunk (the
    `chunk_group` of the valid chunks) and bool [hi - lo] which chunks may be valid at all.
    """
    b = len(windows)
    input_ids = np.full((b, seq_len), pad_id, dtype=np.int64)
    attention = np.zeros((b, seq_len), dtype=np.int64)
    labels = np.full((b, seq_len), IGNORE, dtype=np.int64)
    position_ids = np.zeros((b, seq_len), dtype=np.int64)
    student_chunk = np.full((b, seq_len), -1, dtype=np.int64)
    sampled = None  # float32 [b, seq_len], laid out like labels, once a source has sampling log-probs
    rows_by_src: list[tuple[ShardSource, np.ndarray]] = []
    teacher_chunk, exact, groups = [], [], []
    n_chunks = 0
    for wi, segments in enumerate(windows):
        pos = 0
        masked_until = 0  # CE labels predicting context tokens are dropped
        for src, d, lo, hi, ctx, *extra in segments:
            n_ctx = int(ctx)
            seg = segment_chunks(src, d, lo, hi, n_ctx)
            s_begin, s_start, s_len, t_len = seg.s_begin, seg.s_start, seg.s_len, seg.t_len
            valid = seg.valid if not extra else seg.valid & extra[1]
            s_off = int(src.doc_student_offsets[d])
            toks = src.student_ids[s_off + s_begin:s_off + seg.s_stop]
            input_ids[wi, pos:pos + len(toks)] = toks
            position_ids[wi, pos:pos + len(toks)] = np.arange(len(toks))  # each segment attends to itself only
            labels[wi, pos:pos + len(toks) - 1] = toks[1:]  # never across a segment boundary
            if src.sampled_logprobs is not None:  # the sampling policy's log-prob of each label
                if sampled is None:
                    sampled = np.full((b, seq_len), np.nan, dtype=np.float32)
                sampled[wi, pos:pos + len(toks) - 1] = src.sampled_logprobs[s_off + s_begin + 1:
                                                                            s_off + seg.s_stop]
            if src.trained is not None:  # conversation cache: only positions predicting trained tokens
                trained = src.trained[s_off + s_begin:s_off + seg.s_stop]
                labels[wi, pos:pos + len(toks) - 1][~trained[1:]] = IGNORE
            first = pos + (s_start - s_begin)  # [n] window position of each chunk's first token
            if src.skip_turn_starts and src.trained is not None:
                valid = valid & ~_turn_starts(trained, s_start - s_begin)
            if n_ctx:
                masked_until = pos + int(s_len[:n_ctx].sum())
            ids = n_chunks + np.arange(int(valid.sum()), dtype=np.int64)
            n_chunks += ids.shape[0]
            student_chunk[wi, _ranges(first[valid] - 1, s_len[valid])] = np.repeat(ids, s_len[valid])
            rows_by_src.append((src, _ranges(seg.p_off + seg.t_start[valid], t_len[valid])))
            teacher_chunk.append(np.repeat(ids, t_len[valid]))
            exact.append(src.exact[seg.c0 + lo:seg.c0 + hi][valid])
            if extra:
                groups.append(extra[0][valid])
            pos += len(toks)
        attention[wi, :pos] = 1
        position_ids[wi, pos:] = np.arange(seq_len - pos)  # padding is a segment of its own
        labels[wi, :max(masked_until - 1, 0)] = IGNORE
    out: dict[str, np.ndarray | int] = {
        "input_ids": input_ids, "attention_mask": attention, "position_ids": position_ids, "labels": labels,
        "student_chunk": student_chunk,
        "teacher_chunk": np.concatenate(teacher_chunk) if teacher_chunk else np.zeros(0, np.int64),
        "chunk_exact": np.concatenate(exact) if exact else np.zeros(0, bool), "num_chunks": n_chunks}
    if sampled is not None:
        out["sampled_logprobs"] = sampled  # stage2_student.onpolicy.SAMPLED_KEY
    if groups:
        out["chunk_group"] = np.concatenate(groups).astype(np.int64)
    out.update(_teacher_side(rows_by_src))
    return out


def _turn_starts(trained: np.ndarray, first: np.ndarray) -> np.ndarray:
    """[n] whether each chunk (its first token `first`, an index into `trained` up to its length) begins a
    trained turn: its first token is trained and the token before it is not (the turn's header)."""
    begins = np.concatenate([[False], trained[1:] & ~trained[:-1], [False]])
    return begins[first]


def drawn_targets(ids: np.ndarray, head_logprobs: np.ndarray | None, counts: np.ndarray) -> dict[str, np.ndarray]:
    """The batch's teacher arrays of sampled or headtail rows, at the stored width k.

    ids [R, k]; counts [R, k_tail] of the last k_tail slots (the draws); head_logprobs [R, k - k_tail] of
    the first slots (headtail's exact head, xtcache.store.headtail) or None (sampled). Returns `teacher_ids`
    (-1 on padding), `teacher_counts` [R, k] (0 on the head) and, with a head, `teacher_logprobs` [R, k]
    (-inf on the draws): the layout `stage2_student.losses.teacher_logprobs` reads.
    """
    kh = ids.shape[1] - counts.shape[1]
    full = np.zeros(ids.shape, np.float32)  # [R, k]
    full[:, kh:] = counts
    keep = full > 0
    keep[:, :kh] = True
    out = {"teacher_ids": np.where(keep, ids, -1), "teacher_counts": full}
    if head_logprobs is not None:
        lp = np.full(ids.shape, -np.inf, np.float32)
        lp[:, :kh] = head_logprobs
        out["teacher_logprobs"] = lp
    return out


def _teacher_side(rows_by_src: list[tuple[ShardSource, np.ndarray]]) -> dict[str, np.ndarray]:
    """The teacher arrays of a micro-batch: rows `r` of each source, in order (ids -1 = padding)."""
    out: dict[str, np.ndarray] = {}
    first_src = rows_by_src[0][0] if rows_by_src else None
    k = first_src.topk_ids.shape[1] if first_src is not None else 0

    def gather(name, dtype, tail=()):
        parts = [getattr(s, name)[r] for s, r in rows_by_src]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros((0, *tail), dtype)

    ids = gather("topk_ids", np.int64, (k,))
    if first_src is not None and first_src.topk_counts is not None:
        kt = first_src.topk_counts.shape[1]
        lp = gather("topk_logprobs", np.float32, (k - kt,)) if first_src.topk_logprobs is not None else None
        out.update(drawn_targets(ids, lp, gather("topk_counts", np.float32, (kt,))))
    else:
        out["teacher_ids"] = ids
        out["teacher_logprobs"] = gather("topk_logprobs", np.float32, (k,))
    out["teacher_residual"] = gather("residual", np.float32)
    out["teacher_realized"] = gather("realized_logprob", np.float32)
    return out
