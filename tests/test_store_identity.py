"""A store's readers check every identity they rely on: an --eval-cache is measured through the
--cache's teacher vocabulary, projection map and student alignment, so a held-out store of another
teacher, or one without the student's alignment, is refused before any model loads, in one line
naming --eval-cache and what differs.

The stores are real (`xtcache.testing.caches.build_hf_cache`, a few documents each); the training
store is the toy teacher's (cross-tokenizer to the student). `xtcache train-student` runs in a process
of its own, forked from the warm server (tests/conftest.py `procs`).

    pytest -q tests/test_store_identity.py
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stores(toy_setup, tmp_path_factory) -> dict[str, str]:
    """train: the toy teacher, aligned for the student; the held-out stores: `other_tokenizer` a Llama
    teacher on the student's tokenizer (a smaller vocabulary), `other_model` another teacher of the toy
    teacher's tokenizer, `unaligned` the toy teacher without the student's alignment group."""
    from xtcache.testing.caches import build_hf_cache
    from xtcache.testing.toy import build_tiny_model

    root = tmp_path_factory.mktemp("identity")
    llama, qwen = root / "llama_teacher", root / "qwen_teacher"
    build_tiny_model("llama", toy_setup.student_tokenizer, llama, hidden=32, layers=1, intermediate=64, seed=3)
    build_tiny_model("qwen2", toy_setup.teacher_tokenizer, qwen, hidden=32, layers=1, intermediate=64, seed=4)
    student = [toy_setup.student_tokenizer]
    held = dict(k=8, max_docs=4)
    return {"train": build_hf_cache(root / "train", toy_setup.teacher_model, toy_setup.train_jsonl, student, k=8,
                                    max_docs=8),
            "other_tokenizer": build_hf_cache(root / "other_tok", llama, toy_setup.heldout_jsonl, student, **held),
            "other_model": build_hf_cache(root / "other_model", qwen, toy_setup.heldout_jsonl, student, **held),
            "unaligned": build_hf_cache(root / "unaligned", toy_setup.teacher_model, toy_setup.heldout_jsonl, [],
                                        **held)}


@pytest.mark.parametrize("held, says", [
    ("other_tokenizer", ["another teacher", "teacher tokenizer", "teacher vocabulary 1536 vs 2048"]),
    ("other_model", ["another teacher", "teacher model"]),
    ("unaligned", ["no alignment for the student tokenizer", "xtcache align"]),
])
def test_an_eval_cache_the_training_store_does_not_agree_with_is_refused_before_training(stores, held, says, toy_setup,
                                                                                         procs, tmp_path):
    out = tmp_path / "run"
    proc = procs.cli("train-student", "--cache", stores["train"], "--eval-cache", stores[held], "--student",
                     str(toy_setup.student_model), "--out", str(out), "--seq-len", "64", "--max-steps", "2")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith(f"error: --eval-cache {stores[held]} "), proc.stderr[-3000:]
    assert all(s in last for s in says), last
    if held == "other_model":
        assert "teacher tokenizer" not in last and "teacher vocabulary" not in last, last
    assert not (out / "metrics.jsonl").exists()  # refused before the first step
