"""The multi-teacher join: several teacher caches of one corpus read as one micro-batch stream.

Documents are matched across caches by document id (source, row, content hash). A chunk group is
the smallest run of student tokens that whole chunks of every teacher holding the document cover
(`xtcache.packing.common_boundaries`); windows are packed over chunk groups, so every teacher sees
the same windows, and a group is trained when each teacher present has all its real chunks there
valid. The micro-batch carries one student side and each teacher's keys (teacher i > 0 prefixed
`t{i}/`, docs/architecture.md "Stage 2 batch"). With one cache, a group is a chunk.

    lengths, trained = chunk_group_lengths(doc_id, [(0, ends_a, None), (1, ends_b, None)], urls)
    segments, ok = join_segment(sources, doc_indices, present, g_lo, g_hi, g_ctx, group_offset)
    batch = join_views([view_0, view_1], num_groups)      # the loader's micro-batch of two teachers
    view_1 = teacher_view(batch, 1)                       # what teacher 1's objective reads
"""

from __future__ import annotations

import numpy as np

from stage2_student.batches import ShardSource, build_micro_batch, segment_chunks
from xtcache.errors import ConfigError
from xtcache.packing import common_boundaries, group_trained

TEACHER_KEYS = ("student_chunk", "teacher_ids", "teacher_logprobs", "teacher_counts", "teacher_residual",
                "teacher_realized", "teacher_chunk", "num_chunks", "chunk_exact", "chunk_group")
"""The keys of a micro-batch that belong to one teacher; teacher i > 0 holds them as `t{i}/KEY`."""


def num_teachers(batch: dict) -> int:
    """How many teachers a micro-batch carries (1 for a single-cache batch)."""
    return int(batch.get("num_teachers", 1))


def student_view(batch: dict) -> dict:
    """The student keys of a micro-batch: none of any teacher's (unprefixed or `t{i}/`)."""
    return {k: v for k, v in batch.items() if "/" not in k and k not in TEACHER_KEYS}


def teacher_view(batch: dict, i: int) -> dict:
    """Teacher i's single-teacher micro-batch: the student keys plus that teacher's keys unprefixed."""
    view = student_view(batch)
    prefix = "" if i == 0 else f"t{i}/"
    for key in TEACHER_KEYS:
        if prefix + key in batch:
            view[key] = batch[prefix + key]
    return view


def join_views(views: list[dict], num_groups: int) -> dict:
    """One micro-batch of several teachers' views (same student side): view 0 as is, the others prefixed."""
    out = dict(views[0])
    for i, v in enumerate(views[1:], start=1):
        out.update({f"t{i}/{k}": v[k] for k in TEACHER_KEYS if k in v})
    out["num_teachers"], out["num_groups"] = len(views), num_groups
    return out


def join_counts(where: list[dict], urls: list[str]) -> tuple[int, int]:
    """(documents in every cache, documents in only some) of the caches' document indexes (doc id ->
    (shard, doc)); caches that share no document are refused."""
    if len(where) == 1:
        return len(where[0]), 0
    common = set(where[0]).intersection(*where[1:])
    union = set().union(*where)
    if not common:
        raise ConfigError(f"the caches {', '.join(urls)} share no document (matched by source, row and "
                          "content hash): they were written from different corpora")
    return len(common), len(union) - len(common)


def chunk_group_lengths(doc: str, per: list[tuple[int, np.ndarray, np.ndarray | None]], urls: list[str]
                        ) -> tuple[np.ndarray, np.ndarray | None]:
    """(student tokens of each chunk group [G], trained student tokens of each group [G] or None) of
    document `doc`, from each cache holding it: (cache index, student chunk ends [C], trained student
    tokens bool [S] of a conversation cache, else None). Refuses caches that disagree on the
    document's student length."""
    totals = {int(e[-1]) if e.size else 0 for _, e, _ in per}
    if len(totals) > 1:
        raise ConfigError(
            f"document {doc} has {' vs '.join(str(int(e[-1]) if e.size else 0) for _, e, _ in per)} "
            f"student tokens in {' vs '.join(urls[cj] for cj, _, _ in per)}: the caches were aligned "
            "differently for this student tokenizer; re-run `xtcache align` on them")
    bounds = common_boundaries([e for _, e, _ in per])
    trained = None
    if per[0][2] is not None:  # the student side (and its roles) is the same in every cache
        trained = group_trained(bounds, per[0][2])
    return np.diff(bounds, prepend=0), trained


def join_segment(srcs: list[ShardSource], dids: list[int], present: np.ndarray, g_lo: int, g_hi: int, g_ctx: int,
                 group_offset: int) -> tuple[list[tuple], np.ndarray]:
    """One packed segment, the chunk groups [g_lo, g_hi) of a document whose first `g_ctx` are
    context, as each teacher's window segment, and which of its groups are valid (bool [g_hi - g_lo]).

    srcs[i], dids[i]: teacher i's part and document index (a teacher missing the document,
    `present[i]` False, is given another teacher's, which lays out its student side). A segment is
    (source, doc, chunk_lo, chunk_hi, context chunks, group + group_offset of each chunk, keep):
    `build_micro_batch`'s segment with chunk groups. A group is valid when each teacher present has
    all its real chunks there valid, and at least one.
    """
    n = len(srcs)
    ends = [srcs[ci].student_end[srcs[ci].doc_chunk_offsets[dids[ci]]:
                                 srcs[ci].doc_chunk_offsets[dids[ci] + 1]].astype(np.int64) for ci in range(n)]
    bounds = common_boundaries([ends[ci] for ci in range(n) if present[ci]])
    ok = np.ones(g_hi - g_lo, dtype=bool)
    segs = []
    for ci in range(n):
        group = np.searchsorted(bounds, ends[ci], side="left")  # [C] group of every chunk
        lo, hi = np.searchsorted(group, [g_lo, g_hi], side="left")
        n_ctx = int(np.searchsorted(group, g_lo + g_ctx, side="left") - lo)
        seg = segment_chunks(srcs[ci], dids[ci], int(lo), int(hi), n_ctx)
        local = group[lo:hi] - g_lo
        if present[ci]:  # a group counts when each teacher present has its real chunks there all valid
            bad = np.bincount(local[seg.real & ~seg.valid], minlength=g_hi - g_lo)
            good = np.bincount(local[seg.real & seg.valid], minlength=g_hi - g_lo)
            ok &= (bad == 0) & (good > 0)
        segs.append((srcs[ci], dids[ci], int(lo), int(hi), n_ctx, local + group_offset,
                     np.full(hi - lo, bool(present[ci]))))
    return segs, ok


def build_joined_batch(windows: list[list[list[tuple]]], group_ok: list[np.ndarray], seq_len: int, pad_id: int,
                       urls: list[str]) -> dict:
    """The micro-batch of N teachers: windows[i] teacher i's windows of `join_segment` segments,
    group_ok the validity of every chunk group, in order. Valid groups are numbered 0..G-1; the
    teachers' student token ids must agree (one student tokenizer)."""
    ok = np.concatenate(group_ok) if group_ok else np.zeros(0, bool)
    renumber = np.cumsum(ok) - 1
    views = []
    for ci in range(len(windows)):
        segments = [[(src, d, lo, hi, ctx, renumber[g], keep & ok[g]) for src, d, lo, hi, ctx, g, keep in win]
                    for win in windows[ci]]
        views.append(build_micro_batch(segments, seq_len, pad_id))
    for ci in range(1, len(views)):
        if not np.array_equal(views[ci]["input_ids"], views[0]["input_ids"]):
            raise ConfigError(f"the student token ids of the same documents differ between {urls[0]} and "
                              f"{urls[ci]}: they were aligned with differently configured student "
                              "tokenizers; re-run `xtcache align` on one of them")
    return join_views(views, int(ok.sum()))
