"""bench/prototypes/*.patch: the measured prototypes that docs/on-policy.md and docs/losses.md cite, each to be
applied to the tree as it is (`git apply PATCH`, its header says how). A patch that no longer applies is a
citation nobody can rerun: this fails on it."""

from __future__ import annotations

import subprocess

import pytest

from xtcache.testing.suite import REPO

PATCHES = sorted((REPO / "bench" / "prototypes").glob("*.patch"))


def test_there_are_prototypes():
    assert PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_each_prototype_patch_applies_to_the_tree(patch):
    proc = subprocess.run(["git", "apply", "--check", str(patch)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"{patch.name} no longer applies: regenerate it against the tree\n{proc.stderr}"
    assert "git apply" in patch.read_text().split("diff --git")[0]  # its header says how to use it


@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_each_prototype_header_names_the_rows_it_adds(patch):
    """The header's `only={...}` rows are the rows the patch appends to the converged section's ROWS: the indices
    after the tree's last row (a row added to the tree moves them)."""
    import re

    from bench.quality_onpolicy_converged import ROWS

    text = patch.read_text()
    named = {int(n) for group in re.findall(r"only=\{([\d, ]+)\}", text.split("diff --git")[0])
             for n in group.split(",")}
    bench = next(s for s in text.split("diff --git")[1:] if s.startswith(" a/bench/quality_onpolicy_converged.py"))
    added = sum(line.startswith("+    (") for line in bench.splitlines())
    assert added and named == set(range(len(ROWS), len(ROWS) + added)), (patch.name, sorted(named), len(ROWS), added)
