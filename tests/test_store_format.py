"""schemas/STORE_FORMAT.md says what the code does: its array tables are the one in schemas/arrays.py."""

from __future__ import annotations

import re
from pathlib import Path

from schemas.arrays import ALIGN_ARRAYS, TEACHER_ARRAYS

DOC = Path(__file__).resolve().parents[1] / "schemas" / "STORE_FORMAT.md"


def _table_after(heading: str) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(name, dtypes, shape) of each row of the first table after `heading`."""
    text = DOC.read_text(encoding="utf-8")
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| array"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, dtypes, shape = (c.strip() for c in line.strip("|").split("|")[:3])
        rows.append((name.strip("`"), tuple(d.strip() for d in dtypes.split("/")),
                     tuple(d.strip() for d in re.sub(r"[\[\]]", "", shape).split(","))))
    return rows


def test_teacher_array_table_matches_the_code():
    assert _table_after("### 4.1 Arrays") == [(a.name, a.dtypes, a.shape) for a in TEACHER_ARRAYS]


def test_alignment_array_table_matches_the_code():
    assert _table_after("## 5. Alignment groups") == [(a.name, a.dtypes, a.shape) for a in ALIGN_ARRAYS]


def test_the_format_names_the_checksum_codec_and_the_reader_checks():
    from schemas.arrays import CHECKSUM_CODEC

    text = DOC.read_text(encoding="utf-8")
    assert f"`{CHECKSUM_CODEC}`" in text and "## 9. Reading: what a reader must check, in order" in text
