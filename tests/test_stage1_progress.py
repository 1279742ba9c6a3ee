"""The progress of `xtcache teacher-dump`: positions counted as the windows the engine finishes get
their targets, paced engine calls, and the bar's total.

    .venv/bin/python -m pytest -q tests/test_stage1_progress.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stage1_teacher.capture import progress
from stage1_teacher.capture.progress import CallPacer, CaptureProgress
from stage1_teacher.config import CaptureConfig, build_config
from stage1_teacher.dump import run_teacher_dump


class FakeClock:
    """A clock that an engine of `rate` tokens/s advances by the time each call takes."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def paced_calls(lengths: list[int], rate: float, target_s: float = 3.0) -> list[range]:
    clock = FakeClock()
    pacer = CallPacer(target_s, clock=clock)
    windows = [np.zeros(n, dtype=np.int64) + i for i, n in enumerate(lengths)]
    reported = []

    def call(ws):
        clock.t += sum(len(w) for w in ws) / rate
        return [int(w[0]) for w in ws]

    out = pacer.run(windows, call, lambda idx, outs: reported.append((idx, outs)))
    assert out == list(range(len(lengths)))  # every window's output, in order
    assert [i for idx, _ in reported for i in idx] == list(range(len(lengths)))  # each window handed over once
    assert all(list(idx) == outs for idx, outs in reported)  # with its own output
    return [idx for idx, _ in reported]


def test_a_slow_engine_gets_calls_of_a_few_seconds():
    lengths = [200] * 100  # 20,000 tokens
    reported = paced_calls(lengths, rate=150.0)  # a CPU teacher: 133 s for the batch
    assert len(reported[0]) == 1  # no rate known yet: one window
    for r in reported[1:]:
        assert 1 <= len(r) <= 3  # 3 s at 150 tokens/s: two 200-token windows, or one


def test_a_fast_engine_gets_the_rest_of_the_batch_in_one_call():
    reported = paced_calls([2048] * 32, rate=200_000.0)  # a GPU teacher: 0.3 s for the batch
    assert [len(r) for r in reported] == [1, 31]


def test_a_window_longer_than_the_budget_still_runs():
    reported = paced_calls([50, 4000, 4000, 10], rate=100.0)
    assert [list(r) for r in reported] == [[0], [1], [2], [3]]


def test_total_is_estimated_from_rows_until_every_part_is_planned():
    p = CaptureProgress(False, rows=40)
    assert p.total() is None
    p.planned(rows=10, positions=1000)
    assert p.total() == 4000
    p.planned(rows=10, positions=3000)
    assert p.total() == 8000
    p.planned_everything()  # fewer rows than counted (a last line without its newline, say): exact now
    assert p.total() == 4000
    unknown = CaptureProgress(False)  # rows not counted (Arrow, remote text): no total until planned
    unknown.planned(rows=10, positions=1000)
    assert unknown.total() is None
    unknown.planned_everything()
    assert unknown.total() == 1000


class RecordingBar:
    """Stands in for tqdm: keeps (n, total) after every update."""

    made: list[RecordingBar] = []

    def __init__(self, *, total, initial, **kw):
        self.n, self.total, self.kw, self.updates, self.closed = initial, total, kw, [], False
        RecordingBar.made.append(self)

    def update(self, n):
        self.n += n
        self.updates.append((self.n, self.total))

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s

    def refresh(self):
        pass

    def close(self):
        self.closed = True


@pytest.fixture
def one_batch_corpus(toy_setup, tmp_path) -> str:
    """64 documents (about 22k teacher tokens): one part and one batch at the default settings."""
    path = tmp_path / "docs.jsonl"
    lines = Path(toy_setup.train_jsonl).read_text().splitlines(keepends=True)[:64]
    path.write_text("".join(lines))
    return str(path)


def _dump(toy_setup, corpus, out, *, show):
    values = {"teacher": str(toy_setup.teacher_model), "student_tokenizer": [str(toy_setup.student_tokenizer)],
              "data": [corpus], "out": str(out), "engine": "hf", "top_k": 8, "max_seq_len": 256}
    return run_teacher_dump(build_config(values), progress=show)


def test_a_dump_in_one_batch_moves_its_bar_before_it_ends(toy_setup, one_batch_corpus, tmp_path, monkeypatch):
    """Every document in one part and one engine batch: the bar still counts positions several
    times before the end, its total is exact from the start, and it ends at the positions written."""
    RecordingBar.made = []
    monkeypatch.setattr(progress, "tqdm", RecordingBar)
    summary = _dump(toy_setup, one_batch_corpus, tmp_path / "store", show=True)
    assert summary.documents == 64 and summary.parts_written == 1
    assert summary.positions + summary.windows <= CaptureConfig().batch_tokens  # one batch (a BOS per window at most)
    [bar] = RecordingBar.made
    assert bar.closed and bar.kw["unit"] == " pos"
    assert bar.n == summary.positions
    assert all(total == summary.positions for _, total in bar.updates)
    before_end = [n for n, _ in bar.updates if 0 < n < summary.positions]
    assert len(before_end) >= 2, bar.updates
    assert "64 docs written" in bar.postfix


def test_no_bar_when_progress_is_off(toy_setup, one_batch_corpus, tmp_path, monkeypatch):
    def no_bar(**kw):
        raise AssertionError("a progress bar was made with progress off")

    monkeypatch.setattr(progress, "tqdm", no_bar)
    assert _dump(toy_setup, one_batch_corpus, tmp_path / "store", show=False).documents == 64
