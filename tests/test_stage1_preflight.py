"""teacher-dump's input checks: one-line refusals before any model loads, and nothing left behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from schemas.models import Manifest
from stage1_teacher.capture import preflight
from tests.commands import xtcache
from xtcache.errors import ConfigError
from xtcache.store import CacheReader, CacheWriter


@pytest.mark.parametrize("content, field, match", [
    (b"", "text", "the file is empty"),
    (bytes(range(256)) * 4, "text", "invalid UTF-8"),
    (b'{"body": "a document"}\n{"body": "another"}\n', "text", "2 missing text field"),
    (b"\n\n   \n", "text", "empty document"),
])
def test_first_rows_without_a_document_are_refused(tmp_path, content, field, match):
    f = tmp_path / "corpus.jsonl"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        preflight.check_first_rows(str(f), field, None)


def test_a_late_usable_row_is_enough(tmp_path):
    f = tmp_path / "corpus.jsonl"
    f.write_text('{"other": 1}\n{"text": "a document"}\n')
    preflight.check_first_rows(str(f), "text", None)


def test_output_locations(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is an existing file"):
        preflight.writable_location("--out", str(tmp_path / "file"), None)
    with pytest.raises(ConfigError, match="is a file, so the store cannot be created"):
        preflight.writable_location("--out", str(tmp_path / "file" / "store"), None)
    with pytest.raises(ConfigError, match="cannot write under /proc"):
        preflight.writable_location("--out", "/proc/xtcache-test/store", None)
    preflight.writable_location("--out", str(tmp_path / "new" / "deeper" / "store"), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe created nothing


def test_a_store_without_committed_parts_is_replaced_and_one_with_parts_is_not(tmp_path):
    from tests.test_store import make_doc

    url = str(tmp_path / "stub")
    CacheWriter(url, Manifest(cache_key="a", mode="topk", k=4, teacher_vocab_size=100)).close()
    assert preflight.replace_stub(CacheReader(url), url) and not Path(url).exists()
    with CacheWriter(url, Manifest(cache_key="a", mode="topk", k=4, teacher_vocab_size=100)) as w:
        w.write_part(0, [make_doc(np.random.default_rng(0), 0, 5, 4, 100)])
    assert not preflight.replace_stub(CacheReader(url), url) and (Path(url) / "manifest.json").exists()


def test_a_stub_beside_files_that_are_not_the_stores_is_refused_and_nothing_is_removed(tmp_path):
    url = str(tmp_path / "stub")
    CacheWriter(url, Manifest(cache_key="a", mode="topk", k=4, teacher_vocab_size=100)).close()
    (Path(url) / "notes.txt").write_text("the user's")
    (Path(url) / ".tmp-abc").write_text("an atomic write's")  # the store's own kind of entry
    with pytest.raises(ConfigError, match=r"holds a store of another cache key without any committed part, beside "
                                          r"entries that are not the store's \(notes\.txt\): nothing removed"):
        preflight.replace_stub(CacheReader(url), url)
    assert (Path(url) / "notes.txt").read_text() == "the user's" and (Path(url) / "manifest.json").exists()


@pytest.mark.parametrize("stub", [False, True])
def test_teacher_dump_writes_no_store_among_files_that_are_not_a_stores(stub, tmp_path, toy_setup):
    """--out holding the user's files, with no store or with a stub of another key (a failed run's, written
    there before this check): one line, the files untouched, no store written or removed."""
    out = tmp_path / "out"
    out.mkdir()
    if stub:
        CacheWriter(str(out), Manifest(cache_key="other", mode="topk", k=4, teacher_vocab_size=100)).close()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (out / name).write_text(name)
    before = sorted(p.name for p in out.iterdir())
    proc = xtcache("teacher-dump", "--teacher", toy_setup.teacher_model, "--student-tokenizer",
                   toy_setup.student_tokenizer, "--data", toy_setup.heldout_jsonl, "--out", out, "--engine", "hf",
                   "--top-k", "8")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    listed = "(a.txt, b.txt, c.txt and 1 more)"
    assert line == (f"error: --out {out} holds a store of another cache key without any committed part, beside "
                    f"entries that are not the store's {listed}: nothing removed; use another --out" if stub else
                    f"error: --out {out} holds no xtcache store but other entries {listed}; give a new or empty "
                    "directory for the store"), line
    assert sorted(p.name for p in out.iterdir()) == before and (out / "a.txt").read_text() == "a.txt"


def test_teacher_dump_refuses_an_empty_corpus_before_loading_and_creates_nothing(tmp_path, toy_setup):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    out = tmp_path / "store"
    proc = xtcache("teacher-dump", "--teacher", toy_setup.teacher_model, "--student-tokenizer", toy_setup.student_tokenizer,
                   "--data", data, "--out", out, "--engine", "hf", "--top-k", "8")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == f"error: --data {data}: the file is empty (no rows); give a " \
                                                   "corpus with documents"
    assert "Traceback" not in proc.stderr and not out.exists()
