"""A store travels: written from one directory with relative paths, copied to another path with its
teacher gone (another machine's layout), it trains from a third directory with only what docs/store.md
says to ship, the store and the student: the store carries its teacher's tokenizer.

Stage 1 runs in this process from its own working directory (`xtcache teacher-dump --engine hf`, a
few documents); `xtcache train-student` runs in a process of its own, forked from the warm server,
whose working directory is the repository.

    pytest -q tests/test_store_travel.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.commands import xtcache


def test_a_copied_store_trains_elsewhere_without_its_teacher(toy_setup, procs, tmp_path, monkeypatch):
    from xtcache.store import CacheReader
    from xtcache.store.tokenizer import TOKENIZER_DIR

    origin = tmp_path / "origin"
    shutil.copytree(toy_setup.teacher_model, origin / "art" / "teacher")
    lines = toy_setup.train_jsonl.read_text().splitlines(keepends=True)[:12]
    (origin / "d.jsonl").write_text("".join(lines))
    monkeypatch.chdir(origin)  # every path as a user types it there: relative
    proc = xtcache("teacher-dump", "--teacher", "art/teacher", "--student-tokenizer", toy_setup.student_tokenizer,
                   "--data", "d.jsonl", "--out", "art/cache", "--mode", "topk", "--top-k", "8", "--engine", "hf")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = CacheReader("art/cache").manifest
    assert manifest.teacher_name == str(origin / "art" / "teacher")  # resolved, not as typed
    assert (origin / "art" / "cache" / TOKENIZER_DIR / "tokenizer.json").is_file()

    moved = tmp_path / "elsewhere" / "store"
    shutil.copytree(origin / "art" / "cache", moved)
    shutil.rmtree(origin)  # the teacher, its tokenizer and the original store are gone
    out = tmp_path / "run"  # trained from the repository, the warm server's working directory
    proc = procs.cli("train-student", "--cache", str(moved), "--student", str(toy_setup.student_model), "--out",
                     str(out), "--seq-len", "64", "--micro-batch-size", "2", "--max-steps", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"building the projection map from {moved}/{TOKENIZER_DIR}" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and Path(out / "hf").is_dir()
