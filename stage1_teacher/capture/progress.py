"""The progress bar of `xtcache teacher-dump`, in positions (teacher tokens of this job's documents),
and the pacing that cuts a batch into engine calls short enough for that bar to move.

Positions count as their windows' targets are made, inside a batch too: the transformers engine
hands over each forward's windows, the vLLM engines each call's, and `CallPacer` sizes those calls
to a few seconds at the rate the engine has shown. The bar shows positions/s and the time left
against a total that is exact once the prep thread has prepared every document of the job (at
once when one part holds them all), and until then is estimated from the positions per corpus row
prepared so far and the job's row count (`count_rows`); where rows cannot be counted cheaply it
has no total until then.

    python -c "from stage1_teacher.capture.progress import CaptureProgress, CallPacer"   # used by stage1_teacher.pipeline
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

from tqdm import tqdm

if TYPE_CHECKING:
    from stage1_teacher.corpus import Corpus

TARGET_CALL_S = 3.0  # seconds an engine call aims at, so the bar moves at least this often


class CaptureProgress:
    """Counts of one job's capture and, when `enabled`, the tqdm bar that shows them.

    The prep thread calls `planned` and `resumed`, the main thread `start`, the post thread
    `captured`, the writer thread `written`; a lock orders them.
    """

    def __init__(self, enabled: bool, rows: int | None = None):
        self.enabled = enabled
        self.rows = rows  # corpus rows of the job (None: not counted)
        self.lock = threading.Lock()
        self.bar: tqdm | None = None
        self.planned_rows = 0  # corpus rows prepared (documents and skipped rows)
        self.planned_positions = 0
        self.planned_all = False
        self.positions = 0  # with targets made, or kept from an interrupted run
        self.docs_written = 0
        self.bytes_written = 0

    @classmethod
    def for_job(cls, corpus: Corpus, shard_plan, job: int, enabled: bool) -> CaptureProgress:
        """The progress of job `job` of `shard_plan`; its rows are counted only when the bar is shown."""
        return cls(enabled, count_rows(corpus, shard_plan, job) if enabled else None)

    def planned(self, rows: int, positions: int) -> None:
        """The prep thread formed a part of `rows` corpus rows holding `positions` positions."""
        with self.lock:
            self.planned_rows += rows
            self.planned_positions += positions
            self._set_total()

    def planned_everything(self) -> None:
        """Every part of the job is formed: the total is exact."""
        with self.lock:
            self.planned_all = True
            self._set_total()

    def total(self) -> int | None:
        """Positions of the job: exact once planned, else estimated from the rows seen (None: unknown)."""
        if self.planned_all or (self.rows is not None and self.planned_rows >= self.rows):
            return self.planned_positions
        if not self.rows or not self.planned_rows:
            return None
        return max(self.positions, round(self.planned_positions * self.rows / self.planned_rows))

    def start(self) -> None:
        """The engine is up: show the bar, its rate counted from now."""
        if not self.enabled:
            return
        with self.lock:
            self.bar = tqdm(desc="capture", total=self.total(), initial=self.positions, unit=" pos", unit_scale=True,
                            dynamic_ncols=True, mininterval=1.0)
            self._set_postfix()

    def resumed(self, positions: int) -> None:
        """A part committed by an interrupted run is kept: its positions count as done."""
        self.captured(positions)

    def captured(self, positions: int) -> None:
        """The targets of windows that keep `positions` positions are made."""
        with self.lock:
            self.positions += positions
            if self.bar is not None:
                self.bar.update(positions)

    def written(self, docs: int, nbytes: int) -> None:
        """A part of `docs` documents and `nbytes` stored bytes is committed."""
        with self.lock:
            self.docs_written += docs
            self.bytes_written += nbytes
            if self.bar is not None:
                self._set_postfix(refresh=True)

    def close(self) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def _set_total(self) -> None:
        if self.bar is not None:
            self.bar.total = self.total()
            self.bar.refresh()

    def _set_postfix(self, refresh: bool = False) -> None:
        self.bar.set_postfix_str(f"{self.docs_written:,} docs written, {self.bytes_written / 1e6:.1f} MB",
                                 refresh=refresh)


def count_rows(corpus: Corpus, shard_plan, job: int) -> int | None:
    """Rows of job `job`'s ranges (cheap: the plan's row-group counts or a newline count of its local
    files), for the progress bar's estimated total. None for Arrow files and for remote text files,
    which would have to be read twice."""
    total = 0
    for r in shard_plan.jobs[job]:
        rows = shard_plan.range_rows(r)
        if rows is None and shard_plan.files[r.file].format != "arrow":
            rows = corpus.count_lines(r.file)
        if rows is None:
            return None
        total += rows
    return total


class CallPacer:
    """Cuts a batch of windows into engine calls of about `target_s` seconds each.

    The first call takes one window; each later call as many tokens as the last call ran in
    `target_s` seconds (at least one window). An engine that finishes a whole batch within
    `target_s` gets the rest of the batch in one call, so calls are only cut where the engine is
    slow enough for the cut to cost nothing but the progress report it buys.
    """

    def __init__(self, target_s: float = TARGET_CALL_S, clock: Callable[[], float] = time.perf_counter):
        self.target_s = target_s
        self.clock = clock
        self.rate: float | None = None  # tokens/s of the last call

    def run(self, windows: Sequence, call: Callable[[Sequence], list],
            done: Callable[[Sequence[int], list], None]) -> list:
        """`call` on consecutive slices of `windows`, then `done(indices, outputs)` of each; all
        outputs in order."""
        out: list = []
        a = 0
        while a < len(windows):
            b = self.end(windows, a)
            t0 = self.clock()
            got = call(windows[a:b])
            self.rate = sum(len(w) for w in windows[a:b]) / max(1e-6, self.clock() - t0)
            out.extend(got)
            done(range(a, b), got)
            a = b
        return out

    def end(self, windows: Sequence, a: int) -> int:
        """One past the last window of the call that starts at window `a`."""
        if self.rate is None:
            return a + 1
        budget = self.rate * self.target_s
        b, size = a + 1, len(windows[a])
        while b < len(windows) and size + len(windows[b]) <= budget:
            size += len(windows[b])
            b += 1
        return b
