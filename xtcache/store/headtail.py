"""The exact head + sampled tail layout of a headtail-mode part, and what `xtcache verify` checks on it.

A headtail store keeps per teacher position the `top_k` most likely ids with their log-probs (the
head), `num_samples` draws from the teacher's distribution restricted to the ids outside the head
(the tail: distinct ids with their counts) and the tail mass `R` in `residual`
(schemas/STORE_FORMAT.md 4.8). A decoded part holds them by position:

    topk_ids       [P, k]           the head's top_k ids, then the tail's k - top_k ids (each run ascending)
    topk_logprobs  [P, top_k]       the head's log-probs
    topk_counts    [P, k - top_k]   the tail's draw counts; 0 = padding (after the drawn ids, repeating the last)

`check_rows` is what `xtcache verify` checks on top of the reader's checks.

    python -c "from xtcache.store.headtail import check_rows; import numpy as np; print(check_rows(np.array([[3, 5, 7, 7]]), np.array([[2, 0]]), np.log(np.array([[0.5, 0.2]])), np.array([0.3]), np.array([True]), top_k=2, num_samples=2))"
"""

from __future__ import annotations

import numpy as np


def check_rows(ids: np.ndarray, counts: np.ndarray, logprobs: np.ndarray, residual: np.ndarray,
               has_pred: np.ndarray, *, top_k: int, num_samples: int) -> str | None:
    """What is wrong with a headtail part's decoded rows (None: nothing), checked on the predicted rows:

    no id twice in a row (the head's ids, and the tail's drawn ids, which lie outside the head: a
    count on a padding slot repeats an id), head log-probs finite and at most 0, `residual` (the
    tail mass R) in [0, 1], and the tail counts summing to `num_samples` wherever R > 0 (to 0 or
    `num_samples` elsewhere: R may round to 0 in float16 after its draws were made).
    """
    rows = np.flatnonzero(has_pred)
    if rows.size == 0:
        return None
    ids, counts, logprobs = ids[rows].astype(np.int64), counts[rows].astype(np.int64), logprobs[rows]
    r = residual[rows].astype(np.float64)
    drawn = counts > 0  # [R, k - top_k]
    span = int(ids.max()) + 1
    row = np.arange(rows.size, dtype=np.int64)[:, None]
    keys = np.concatenate([(row * span + ids[:, :top_k]).ravel(), (row * span + ids[:, top_k:])[drawn]])
    keys.sort()
    twice = keys[1:][keys[1:] == keys[:-1]]
    if twice.size:
        return (f"array 'topk_counts' (or 'topk_ids') is damaged: position {int(rows[int(twice[0] // span)])} holds id "
                f"{int(twice[0] % span)} twice (head and tail overlap, or a count sits on a padding slot)")
    if np.any(~np.isfinite(logprobs)) or np.any(logprobs > 0):
        return "array 'topk_logprobs' is damaged: a head log-prob is not finite or above 0"
    if np.any(~(r >= 0)) or np.any(r > 1):
        return "array 'residual' is damaged: a tail mass outside [0, 1]"
    n = counts.sum(axis=1)
    bad = ((r > 0) & (n != num_samples)) | ((n != 0) & (n != num_samples))
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        return (f"array 'topk_counts' is damaged: position {int(rows[i])} has {int(n[i])} tail draws, the "
                f"manifest's num_samples is {num_samples} (tail mass {r[i]:.3g})")
    return None
