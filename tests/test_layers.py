"""The layers are enforced by import-linter (contracts in pyproject.toml), and the contracts bite.

    schemas <- xtcache core <- stage1_teacher | stage2_student <- xtcache.testing <- xtcache.app

`make lint` runs `lint-imports` and `ruff check` before the tests; this test shows that each kind of
deliberate wrong arrow (a back-arrow between layers, a circle, a module placed in no layer, the
scaffolding or pyarrow imported where they do not belong) breaks its contract, so the tool cannot
pass vacuously.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "xtcache", "stage1_teacher", "stage2_student")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("layers")
    for name in PACKAGES:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_tree_keeps_every_contract(tree_copy):
    proc = lint_imports(tree_copy)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and " 0 broken" in proc.stdout


LAYERS = "the layers: the app on top"


@pytest.mark.parametrize("module, back_arrow, contract", [
    ("stage2_student/loader.py", "from xtcache.app import cli", LAYERS),
    ("stage1_teacher/prep.py", "import stage2_student.objective", LAYERS),
    ("xtcache/align/chunks.py", "import stage1_teacher.corpus", LAYERS),
    ("xtcache/errors.py", "import xtcache.store", LAYERS),
    ("schemas/models.py", "import xtcache.errors", LAYERS),
    ("xtcache/chat/spans.py", "import xtcache.chat.runs", "no import circle among the modules of any package"),
    ("stage1_teacher/capture/head.py", "import stage1_teacher.capture.run", "no import circle"),
    ("xtcache/extra.py", "import xtcache.errors", "every module of the xtcache package has its place"),
    ("stage1_teacher/dump.py", "from xtcache.testing import toy", "the test scaffolding"),
    ("xtcache/app/docblock.py", "from xtcache.testing import toy", "the test scaffolding"),
    ("stage1_teacher/shard_plan.py", "import pyarrow.parquet", "the corpus is read behind its owner"),
])
def test_a_wrong_arrow_breaks_a_contract(tree_copy, tmp_path, module, back_arrow, contract):
    root = tmp_path / "tree"
    shutil.copytree(tree_copy, root)
    path = root / module
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    path.write_text(before + f"\n{back_arrow}  # a deliberate wrong arrow\n", encoding="utf-8")
    proc = lint_imports(root)
    assert proc.returncode != 0
    assert contract in proc.stdout and "BROKEN" in proc.stdout, proc.stdout[-3000:]
