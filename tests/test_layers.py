"""The layers are enforced by import-linter (contracts in pyproject.toml), and the contracts bite.

    schemas <- xtcache core <- stage1_teacher | stage2_student <- app (xtcache.cli, xtcache.demo)

`make lint` runs `lint-imports` and `ruff check` before the tests; this test shows that a
deliberate back-arrow (a stage importing the app) breaks a contract, so the tool cannot pass
vacuously.
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


@pytest.mark.parametrize("module, back_arrow, contract", [
    ("stage2_student/loader.py", "from xtcache import cli", "nothing below the app imports it"),
    ("stage1_teacher/prep.py", "import stage2_student.objective", "the two stages never import each other"),
    ("xtcache/align.py", "import stage1_teacher.corpus", "the xtcache core imports no stage"),
    ("schemas/models.py", "import xtcache.errors", "schemas (the store contract) imports no other"),
    ("stage1_teacher/dump.py", "from xtcache.testing import toy", "the product never imports the test scaffolding"),
    ("xtcache/docblock.py", "from xtcache.testing import toy", "the product never imports the test scaffolding"),
    ("stage1_teacher/shard_plan.py", "import pyarrow.parquet", "the corpus is read behind its owner"),
])
def test_a_back_arrow_breaks_a_contract(tree_copy, tmp_path, module, back_arrow, contract):
    root = tmp_path / "tree"
    shutil.copytree(tree_copy, root)
    path = root / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{back_arrow}  # a deliberate back-arrow\n",
                    encoding="utf-8")
    proc = lint_imports(root)
    assert proc.returncode != 0
    assert contract in proc.stdout and "BROKEN" in proc.stdout, proc.stdout[-3000:]
