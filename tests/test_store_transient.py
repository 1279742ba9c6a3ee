"""Transient object-store errors are retried; only wrong or missing bytes are damage.

Reads go through `faulty://` (xtcache/testing/faults.py): the local store, with a seeded share of
object reads failing as object stores fail (timeout, connection reset, 503 SlowDown).

    pytest -q tests/test_store_transient.py
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_loader import _write_store
from tests.test_train_kd import run_stage2
from xtcache import location as store_io
from xtcache.errors import CorruptionError, StoreError
from xtcache.store import CacheReader
from xtcache.testing import faults


@pytest.fixture(scope="module")
def store(tmp_path_factory, toy_setup, teacher_tokenizer, student_tokenizer):
    url, _ = _write_store(tmp_path_factory.mktemp("transient") / "cache", toy_setup, teacher_tokenizer,
                          student_tokenizer, n_docs=8, parts=2)
    return Path(url)


@pytest.fixture
def fast_retries(monkeypatch):
    faults.register()
    monkeypatch.setattr(store_io, "RETRY_BASE_S", 0.001)


class _ClientError(Exception):  # the shape of botocore's ClientError, without botocore
    def __init__(self, code):
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


@pytest.mark.parametrize("exc, transient", [
    (TimeoutError("read timeout"), True), (ConnectionResetError(), True), (OSError(errno.EBUSY, "SlowDown"), True),
    (OSError(121, "InternalError"), True), (_ClientError("SlowDown"), True), (_ClientError("503"), True),
    (FileNotFoundError("gone"), False), (PermissionError("403"), False), (ValueError("checksum"), False),
    (_ClientError("AccessDenied"), False)])
def test_transient_errors_are_told_from_the_rest(exc, transient):
    assert store_io.is_transient(exc) is transient


def test_faulty_reads_give_the_same_arrays_and_a_deleted_object_is_still_refused_by_name(tmp_path, store,
                                                                                         fast_retries, caplog):
    import shutil

    want = CacheReader(str(store))
    with caplog.at_level("WARNING", logger="xtcache.location"):
        got = CacheReader(f"faulty://{store}", {"rate": 0.3, "seed": 1})
        for m in want.shards:
            a, b = want.read_shard(m.shard_id), got.read_shard(m.shard_id, verify=True)
            assert np.array_equal(a.topk_ids, b.topk_ids) and a.texts == b.texts
    assert "injected" in caplog.text and "retry 1 of 4" in caplog.text  # faults were met, and retried

    root = tmp_path / "cache"
    shutil.copytree(store, root)
    sid = want.shards[1].shard_id
    (obj,) = [p for p in (root / "shards" / sid / "topk_ids" / "c").rglob("*") if p.is_file()]
    obj.unlink()
    reader = CacheReader(f"faulty://{root}", {"rate": 0.3, "seed": 2})
    with pytest.raises(CorruptionError, match=f"{sid}: array 'topk_ids' is missing"):
        reader.read_shard(sid)


def test_a_store_that_never_answers_is_unreachable_not_damaged(store, fast_retries):
    reader = CacheReader(str(store))
    reader.loc = store_io.Location(f"faulty://{store}", {"rate": 1.0})
    sid = reader.shards[0].shard_id
    with pytest.raises(StoreError, match="did not answer after 5 attempts") as info:
        reader.read_shard(sid)
    assert not isinstance(info.value, CorruptionError) and "damaged" not in str(info.value)
    assert sid in str(info.value)


def test_train_student_over_faulty_reads_has_the_losses_of_an_undisturbed_run(tmp_path, store, toy_setup, procs,
                                                                              monkeypatch):
    """5% of object reads fail transiently in every process of the run: same losses, step for step. The
    undisturbed run is forked from the worker's warm process; the faulty one is a new interpreter, which
    installs the faults at its start (sitecustomize)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(faults.sitecustomize_source())
    flags = ["--student", str(toy_setup.student_model), "--seq-len", "64", "--micro-batch-size", "2",
             "--max-steps", "4", "--lr", "1e-3", "--zero-stage", "0", "--loss", "alm"]
    clean = procs.run(tmp_path / "clean", "--cache", str(store), *flags)
    log = tmp_path / "faults.log"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}")
    monkeypatch.setenv("XTCACHE_FAULT_RATE", "0.05")
    monkeypatch.setenv("XTCACHE_FAULT_SEED", "3")
    monkeypatch.setenv("XTCACHE_FAULT_LOG", str(log))
    faulty = run_stage2(tmp_path / "faulty", "--cache", f"faulty://{store}", *flags)
    assert log.exists() and len(log.read_text().splitlines()) > 0  # reads did fail, and were retried
    losses = [[r["step"], r["loss"]] for r in clean["train"]]
    assert losses == [[r["step"], r["loss"]] for r in faulty["train"]], json.dumps([losses, faulty["train"]])
    assert len(losses) == 4
