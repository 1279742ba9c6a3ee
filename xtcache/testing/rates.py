"""Rates measured by benchmarks: a stage 2 loader alone, without a model."""

from __future__ import annotations

import time


def measure_rate(loader, num_batches: int) -> dict:
    """Iterate `num_batches` micro-batches and report the loader's rate alone (no model).

    Returns the counts (micro-batches, positions: attention-mask tokens, valid chunks), the
    seconds, and each count per second.
    """
    t0 = time.perf_counter()
    n = positions = chunks = 0
    for batch in loader:
        positions += int(batch["attention_mask"].sum())
        chunks += int(batch["num_chunks"])
        n += 1
        if n >= num_batches:
            break
    dt = max(time.perf_counter() - t0, 1e-9)
    return {"micro_batches": n, "positions": positions, "chunks": chunks, "seconds": dt,
            "micro_batches_per_s": n / dt, "positions_per_s": positions / dt, "chunks_per_s": chunks / dt}
