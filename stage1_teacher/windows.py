"""Cutting a document's teacher tokens into teacher windows (pure functions, no I/O).

A document longer than the teacher window (`--max-seq-len`) is run as several windows. Window w
feeds tokens `[ctx_start, end)` (plus an optional BOS prefix) to the teacher and keeps the
predictions of rows `[store_start, end)` only; `store_start` is the previous window's `end`, so
every row's prediction comes from exactly one window and overlapped rows are stored once. With
`--window-overlap L` a window starts up to L tokens before `store_start` to give those rows left
context. Cuts fall on chunk boundaries of the alignment (`boundaries`) when one exists inside the
window, so no chunk straddles two windows.

Row `r` of a window has a prediction when it has at least one token before it in that window:
`r > ctx_start`, or any row when a BOS prefix is fed in front of a later window.

    python -c "from stage1_teacher.windows import plan_windows; print(plan_windows(10, 4, 1))"
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Window:
    """One teacher forward over tokens [ctx_start, end) of a document, keeping rows [store_start, end)."""

    ctx_start: int
    store_start: int
    end: int
    prefix: int = 0  # tokens (a BOS) fed before ctx_start; their outputs are dropped

    @property
    def length(self) -> int:
        """Tokens fed to the teacher."""
        return self.prefix + self.end - self.ctx_start


def plan_windows(n_tokens: int, max_len: int, overlap: int = 0, boundaries: np.ndarray | None = None,
                 *, bos_prefix: bool = False) -> list[Window]:
    """Windows covering rows [0, n_tokens) exactly once, each at most `max_len` tokens long.

    `boundaries`: sorted teacher token indices where a cut is allowed without splitting a chunk
    (chunk ends; `xtcache.packing.common_boundaries` of every alignment); None or empty allows a cut anywhere. `bos_prefix`: feed one BOS token before every window
    after the first (the document's own first token is that BOS).
    """
    if max_len < 2:
        raise ValueError(f"--max-seq-len {max_len}: must be at least 2")
    if not 0 <= overlap <= max_len - 2 - int(bos_prefix):
        raise ValueError(f"--window-overlap {overlap}: must be in [0, {max_len - 2 - int(bos_prefix)}] "
                         f"for --max-seq-len {max_len}")
    out: list[Window] = []
    store_start = 0
    while store_start < n_tokens:
        first = not out
        prefix = 0 if first or not bos_prefix else 1
        ctx_start = store_start if first else max(1 if prefix else 0, store_start - overlap)
        end = min(n_tokens, ctx_start + max_len - prefix)
        if end < n_tokens and boundaries is not None and len(boundaries):
            i = int(np.searchsorted(boundaries, end, side="right")) - 1
            if i >= 0 and int(boundaries[i]) > store_start:
                end = int(boundaries[i])
        out.append(Window(ctx_start=ctx_start, store_start=store_start, end=end, prefix=prefix))
        store_start = end
    return out


def window_has_pred(w: Window) -> np.ndarray:
    """bool [end - store_start]: which kept rows of window `w` have a prediction."""
    rows = np.arange(w.store_start, w.end)
    return (rows > w.ctx_start) | (w.prefix > 0)


def window_tokens(ids: np.ndarray, w: Window, bos_id: int | None) -> np.ndarray:
    """The token ids fed to the teacher for window `w` (int64)."""
    body = np.asarray(ids[w.ctx_start:w.end], dtype=np.int64)
    if w.prefix:
        return np.concatenate(([bos_id], body)).astype(np.int64)
    return body
