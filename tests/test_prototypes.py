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
