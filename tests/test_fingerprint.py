"""Fingerprints (xtcache.fingerprint) are content hashes: stable across processes, sensitive to content.

    .venv/bin/python -m pytest -q tests/test_fingerprint.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from xtcache import fingerprint as fpm
from xtcache.errors import XtcacheError

REPO = Path(__file__).resolve().parents[1]


def _in_subprocess(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True,
                          text=True, env={"PYTHONHASHSEED": "random", "PATH": ""}).stdout.strip()


def test_tokenizer_fingerprint_stable_and_specific(toy_setup, teacher_tokenizer, tmp_path):
    path_fp = fpm.tokenizer_fingerprint(toy_setup.teacher_tokenizer)
    assert path_fp == fpm.tokenizer_fingerprint(toy_setup.teacher_tokenizer / "tokenizer.json")
    assert path_fp == fpm.tokenizer_fingerprint(teacher_tokenizer)
    assert path_fp == _in_subprocess(
        f"from xtcache.fingerprint import tokenizer_fingerprint as f; print(f({str(toy_setup.teacher_tokenizer)!r}))")
    assert path_fp != fpm.tokenizer_fingerprint(toy_setup.student_tokenizer)
    # reformatting the JSON file does not change the fingerprint
    copy = tmp_path / "tokenizer.json"
    copy.write_text(json.dumps(json.loads((toy_setup.teacher_tokenizer / "tokenizer.json").read_text()), indent=4))
    assert fpm.tokenizer_fingerprint(copy) == path_fp
    with pytest.raises(XtcacheError, match="no tokenizer.json"):
        fpm.tokenizer_fingerprint(tmp_path / "nothing")


def test_a_tokenizer_changed_after_its_fingerprint_is_fingerprinted_again(toy_setup, tmp_path):
    """A loaded tokenizer's fingerprint is kept for its serialisation, compared whole: the same object fingerprinted
    again after a token was added gets the fingerprint of its saved file, not the one it had before."""
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(toy_setup.student_tokenizer)
    before = fpm.tokenizer_fingerprint(tok)
    assert fpm.tokenizer_fingerprint(tok) == before == fpm.tokenizer_fingerprint(toy_setup.student_tokenizer)
    tok.add_tokens(["<added-after-the-fingerprint>"])
    after = fpm.tokenizer_fingerprint(tok)
    tok.save_pretrained(str(tmp_path / "changed"))
    assert after != before and after == fpm.tokenizer_fingerprint(tmp_path / "changed")


def test_model_fingerprint(toy_setup, tmp_path):
    fp = fpm.model_fingerprint(toy_setup.teacher_model)
    assert fp == _in_subprocess(
        f"from xtcache.fingerprint import model_fingerprint as f; print(f({str(toy_setup.teacher_model)!r}))")
    assert fp != fpm.model_fingerprint(toy_setup.student_model)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(toy_setup.teacher_model / "config.json", bare / "config.json")
    with pytest.raises(XtcacheError, match="has no weight files"):
        fpm.model_fingerprint(bare)
    with pytest.raises(XtcacheError, match="has no config.json"):
        fpm.model_fingerprint(tmp_path)


def test_corpus_and_settings_fingerprints(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "one"}\n')
    fp = fpm.corpus_fingerprint([a])
    assert fp == _in_subprocess(f"from xtcache.fingerprint import corpus_fingerprint as f; print(f([{str(a)!r}]))")
    a.write_text('{"text": "two"}\n')
    assert fpm.corpus_fingerprint([a]) != fp
    with pytest.raises(XtcacheError, match="does not exist"):
        fpm.corpus_fingerprint([tmp_path / "missing.jsonl"])

    s1 = fpm.settings_fingerprint({"top_k": 64, "mode": "topk", "nested": {"b": 1, "a": 2}})
    s2 = fpm.settings_fingerprint({"nested": {"a": 2, "b": 1}, "mode": "topk", "top_k": 64})
    assert s1 == s2 != fpm.settings_fingerprint({"top_k": 32, "mode": "topk", "nested": {"b": 1, "a": 2}})
    assert s1 == _in_subprocess(
        "from xtcache.fingerprint import settings_fingerprint as f; "
        "print(f({'top_k': 64, 'mode': 'topk', 'nested': {'b': 1, 'a': 2}}))")
    with pytest.raises(XtcacheError, match="not JSON-serialisable"):
        fpm.settings_fingerprint({"x": object()})

    key = fpm.cache_key(teacher_model="m", teacher_tokenizer="t", corpus="c", settings=s1)
    assert len(key) == 64
    assert key != fpm.cache_key(teacher_model="m", teacher_tokenizer="t", corpus="c", settings=s2 + "x")


def test_tokenizer_fingerprint_of_a_file_with_truncation_and_padding_equals_the_loaded_one(toy_setup, tmp_path):
    """`python -m xtcache.fingerprint DIR` prints the value a store records for the loaded tokenizer."""
    from xtcache.tokenizer import load_tokenizer

    content = json.loads((toy_setup.teacher_tokenizer / "tokenizer.json").read_text())
    content["truncation"] = {"direction": "Right", "max_length": 16, "strategy": "LongestFirst", "stride": 0}
    content["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                          "pad_type_id": 0, "pad_token": "<pad>"}
    tok_dir = tmp_path / "tok"
    shutil.copytree(toy_setup.teacher_tokenizer, tok_dir)
    (tok_dir / "tokenizer.json").write_text(json.dumps(content))
    loaded = load_tokenizer(str(tok_dir), "teacher tokenizer")
    assert fpm.tokenizer_fingerprint(tok_dir) == fpm.tokenizer_fingerprint(loaded)
    assert fpm.tokenizer_fingerprint(tok_dir) == fpm.tokenizer_fingerprint(toy_setup.teacher_tokenizer)
    printed = subprocess.run([sys.executable, "-m", "xtcache.fingerprint", str(tok_dir)], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
    assert fpm.tokenizer_fingerprint(loaded) in printed
