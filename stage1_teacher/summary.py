"""What a `xtcache teacher-dump` did: counts, bytes and times, printed at the end of the run and
stored in the writer's done marker.

    python -c "from stage1_teacher.summary import Summary; print(*Summary(store='s').lines(), sep='\\n')"
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Summary:
    """What a dump did; printed at the end and stored in the writer's done marker."""

    store: str = ""
    reused: bool = False
    capture_path: str = ""
    notes: list[str] = field(default_factory=list)
    documents: int = 0
    positions: int = 0
    predicted: int = 0
    windows: int = 0
    parts_written: int = 0
    parts_resumed: int = 0
    bytes_written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    engine_start_s: float = 0.0
    capture_s: float = 0.0
    prep_s: float = 0.0
    teacher_s: float = 0.0
    post_s: float = 0.0
    write_s: float = 0.0
    teacher_wait_s: float = 0.0
    input_wait_s: float = 0.0
    check_gap: float | None = None
    check_source: str = ""
    alignment_groups_added: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def lines(self) -> list[str]:
        if self.reused:
            out = [f"reused complete cache {self.store}: no teacher work done"]
            if self.alignment_groups_added:
                out.append(f"added alignment groups: {', '.join(self.alignment_groups_added)}")
            return out + [f"note: {n}" for n in self.notes]
        capture = max(self.capture_s, 1e-9)
        out = [
            f"store               {self.store}",
            f"capture path        {self.capture_path}" + (f" (first-batch check gap {self.check_gap:.2g}: "
                                                          f"{self.check_source})" if self.check_gap is not None
                                                          else ""),
            f"documents           {self.documents} in {self.parts_written} new parts"
            + (f" (+{self.parts_resumed} parts kept from the interrupted run)" if self.parts_resumed else ""),
            f"positions           {self.positions} ({self.predicted} with a prediction, {self.windows} windows)",
            f"bytes written       {self.bytes_written} ({self.bytes_written / max(1, self.positions):.1f} B/position)",
            f"wall time           {self.wall_s:.1f} s (engine start {self.engine_start_s:.1f} s); "
            f"{self.positions / capture:,.0f} positions/s over {self.capture_s:.1f} s of capture",
            f"time split          tokenize+align {self.prep_s:.1f} s, teacher {self.teacher_s:.1f} s, "
            f"targets {self.post_s:.1f} s, encode+write {self.write_s:.1f} s (threads overlap)",
            f"teacher waited      {self.teacher_wait_s:.2f} s on the writer, {self.input_wait_s:.2f} s on input",
            "skipped documents   " + (", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"),
        ]
        out += [f"WARNING             {n}" for n in self.notes]
        return out
