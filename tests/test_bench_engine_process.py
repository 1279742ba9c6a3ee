"""bench/engine_process.py reads each dump's wall time, engine start and capture rate from the summary that
`xtcache teacher-dump` prints: the pattern matches the summary's own line (a renamed field would otherwise end
the bench after its first four-minute run, not here)."""

from __future__ import annotations


def test_the_bench_reads_the_summary_line_teacher_dump_prints():
    from bench.engine_process import REPORTED
    from stage1_teacher.summary import Summary

    summary = Summary(store="s", positions=12_345, wall_s=31.52, engine_start_s=13.24, capture_s=2.0)
    m = REPORTED.search("\n".join(summary.lines()))
    assert m is not None, summary.lines()
    assert (float(m.group(1)), float(m.group(2)), float(m.group(3).replace(",", ""))) == (31.5, 13.2, 6_172.0)
