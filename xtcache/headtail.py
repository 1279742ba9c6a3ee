"""The exact head + sampled tail layout of a headtail-mode part: which slot of a row is what, and its checks.

A headtail store keeps per teacher position the `top_k` most likely ids with their log-probs (the
head), `num_samples` draws from the teacher's distribution restricted to the ids outside the head
(the tail: distinct ids with their counts) and the tail mass `R` in `residual`
(schemas/STORE_FORMAT.md 4.1). The ids of a row are stored ascending (`xtcache.sorted_delta_ids`),
head and tail mixed, padding last repeating the row's last real id, so a reader tells the slots
apart by their content:

    tail     topk_counts > 0
    padding  topk_counts == 0 and the same id as the slot before it
    head     the other slots (topk_counts == 0, a distinct id)

`slot_masks` is that rule, the one place that knows it (the stage-2 batches and `xtcache verify`
use it); `check_rows` is what `xtcache verify` checks on top of the reader's checks.

    python -c "from xtcache.headtail import slot_masks; import numpy as np; print(slot_masks(np.array([[3, 5, 5]]), np.array([[0, 4, 0]])))"
"""

from __future__ import annotations

import numpy as np


def slot_masks(ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail) bool [P, k] of decoded rows `ids` [P, k] (ascending, padding repeats) and `counts` [P, k]."""
    tail = counts > 0
    repeat = np.zeros(ids.shape, dtype=bool)
    repeat[:, 1:] = ids[:, 1:] == ids[:, :-1]
    return ~tail & ~repeat, tail


def check_rows(ids: np.ndarray, counts: np.ndarray, logprobs: np.ndarray, residual: np.ndarray,
               has_pred: np.ndarray, *, top_k: int, num_samples: int) -> str | None:
    """What is wrong with a headtail part's decoded rows (None: nothing), checked on the predicted rows:

    exactly `top_k` head slots per row (a count written into a head slot leaves fewer), the real ids
    strictly ascending (a count on a padding slot repeats an id), head log-probs finite and at most 0,
    `residual` (the tail mass R) in [0, 1], and the tail counts summing to `num_samples` wherever R > 0
    (to 0 or `num_samples` elsewhere: R may round to 0 in float16 after its draws were made).
    """
    rows = np.flatnonzero(has_pred)
    if rows.size == 0:
        return None
    ids, counts, logprobs = ids[rows], counts[rows].astype(np.int64), logprobs[rows]
    r = residual[rows].astype(np.float64)
    head, tail = slot_masks(ids, counts)
    n_head = head.sum(axis=1)
    if np.any(n_head != top_k):
        i = int(np.flatnonzero(n_head != top_k)[0])
        return (f"array 'topk_counts' is damaged: position {int(rows[i])} has {int(n_head[i])} head entries "
                f"(count 0), the manifest's top_k is {top_k}")
    real = head | tail
    prev = np.where(real, ids, -1)
    prev = np.maximum.accumulate(prev, axis=1)  # the largest real id so far in the row
    if np.any(tail[:, 1:] & (ids[:, 1:] <= prev[:, :-1])):
        return "array 'topk_counts' is damaged: a count sits on a padding slot (an id repeated in its row)"
    lp = np.where(head, logprobs, 0.0)
    if np.any(~np.isfinite(lp)) or np.any(lp > 0):
        return "array 'topk_logprobs' is damaged: a head log-prob is not finite or above 0"
    if np.any(~(r >= 0)) or np.any(r > 1):
        return "array 'residual' is damaged: a tail mass outside [0, 1]"
    n = np.where(tail, counts, 0).sum(axis=1)
    bad = ((r > 0) & (n != num_samples)) | ((n != 0) & (n != num_samples))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        return (f"array 'topk_counts' is damaged: position {int(rows[i])} has {int(n[i])} tail draws, the "
                f"manifest's num_samples is {num_samples} (tail mass {r[i]:.3g})")
    return None
