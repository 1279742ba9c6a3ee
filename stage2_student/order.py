"""The data order of stage 2: which windows an epoch visits, in which order, on which rank.

The packing is fixed per shard; an epoch permutes the shards and the windows inside each shard
with (seed, epoch). Global micro-batch g holds windows [g*B, (g+1)*B) of that order, truncated to
whole optimizer steps; rank r, accumulation index a of step s reads g = s*W*A + r*A + a. Pure
functions of their arguments (the loader's resume and resharding rest on that).

    order = epoch_window_order([p.num_windows for p in plans], seed=0, epoch=3)   # [N, 2]
    g = global_micro_batch(j, rank=1, world_size=2, grad_accum=4)
"""

from __future__ import annotations

import hashlib

import numpy as np


def epoch_window_order(num_windows: list[int], seed: int, epoch: int, *, shuffle: bool = True) -> np.ndarray:
    """Global window order of one epoch: int64 [N, 2] rows (shard index, window index).

    Shards are permuted, then the windows inside each shard, with generators seeded by
    (seed, epoch) and (seed, epoch, shard): a pure function of its arguments.
    """
    n = len(num_windows)
    shard_order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    parts = []
    for s in shard_order:
        w = np.arange(num_windows[s], dtype=np.int64)
        if shuffle:
            w = np.random.default_rng([seed, epoch, int(s)]).permutation(w)
        parts.append(np.stack([np.full_like(w, s), w], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64)


def global_micro_batch(j: int, *, rank: int, world_size: int, grad_accum: int) -> int:
    """Index of the rank's j-th micro-batch in the global micro-batch order."""
    step, a = divmod(j, grad_accum)
    return step * world_size * grad_accum + rank * grad_accum + a


def is_held_out(doc_id: str, fraction: float) -> bool:
    """Deterministic document holdout: sha256(doc_id) read as a number in [0, 1) below `fraction`."""
    if fraction <= 0:
        return False
    return int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "big") / 2**64 < fraction
