"""The multi-teacher micro-batch: one student side, each teacher's keys (teacher i > 0 prefixed `t{i}/`).

    batch = join_views([view_0, view_1], num_groups)      # the loader's micro-batch of two teachers
    view_1 = teacher_view(batch, 1)                       # what teacher 1's objective reads
"""

from __future__ import annotations

TEACHER_KEYS = ("student_chunk", "teacher_ids", "teacher_logprobs", "teacher_counts", "teacher_residual",
                "teacher_realized", "teacher_chunk", "num_chunks", "chunk_exact", "chunk_group")
"""The keys of a micro-batch that belong to one teacher; teacher i > 0 holds them as `t{i}/KEY`."""


def num_teachers(batch: dict) -> int:
    """How many teachers a micro-batch carries (1 for a single-cache batch)."""
    return int(batch.get("num_teachers", 1))


def teacher_view(batch: dict, i: int) -> dict:
    """Teacher i's single-teacher micro-batch: the student keys plus that teacher's keys unprefixed."""
    view = {k: v for k, v in batch.items() if "/" not in k and k not in TEACHER_KEYS}
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
