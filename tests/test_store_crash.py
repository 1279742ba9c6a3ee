"""Crash safety: a writer SIGKILLed in the middle of a part leaves a valid store that a resume completes.

The writer runs in a subprocess that kills itself with SIGKILL after some arrays of its second part
are on disk, before that part's index is written. No cleanup code can run, as after a real crash.

    .venv/bin/python -m pytest -q tests/test_store_crash.py
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from xtcache.app.store_commands import verify_store
from xtcache.errors import StoreError
from xtcache.store import CacheReader, CacheWriter, shard_id

REPO = Path(__file__).resolve().parents[1]

# Writes parts 0, 1, 2 of writer 0; with KILL_AT > 0 it SIGKILLs itself while writing part 1.
WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from schemas.models import AlignGroupMeta, Manifest
    from xtcache.store import writer as store_writer
    from xtcache.store import AlignmentRecord, CacheWriter, DocRecord

    url, kill_at, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"

    class Al:
        def __init__(self, T):
            self.student_end = np.arange(1, T + 1, dtype=np.int32)
            self.teacher_end = np.arange(1, T + 1, dtype=np.int32)
            self.exact = np.ones(T, dtype=bool)

    def docs(part):
        rng = np.random.default_rng(part)
        out = []
        for i in range(4):
            T = int(rng.integers(0, 50)) if i else 0  # first document empty
            lp = np.log(rng.dirichlet(np.ones(9), size=T)[:, :8]).astype(np.float32) if T else np.zeros((0, 8), np.float32)
            out.append(DocRecord(
                source="c.jsonl", row=part * 10 + i, text="x" * T, teacher_ids=rng.integers(0, 90000, T).astype(np.int32),
                char_offsets=np.stack([np.arange(T), np.arange(T) + 1], 1).astype(np.int32).reshape(T, 2),
                has_pred=np.arange(T) > 0,
                topk_ids=np.array([rng.choice(90000, 8, replace=False) for _ in range(T)], np.int32).reshape(T, 8),
                topk_logprobs=lp, topk_counts=None, residual=(1 - np.exp(lp).sum(1)).astype(np.float32),
                realized_logprob=np.full(T, -2.0, np.float32)))
        return out

    group = AlignGroupMeta(fingerprint="s" * 64, tokenizer_name="same", vocab_size=90000, identity=True)
    manifest = Manifest(cache_key="crash", mode="topk", k=8, teacher_vocab_size=90000, alignment_groups=[group])
    writer = CacheWriter(url, manifest, resume=resume)
    done = {m.part_index for m in writer.committed_parts()}
    calls = [0, False]  # write_array calls in part 1, counting on
    original = store_writer.write_array

    def write_array(*args, **kwargs):
        calls[0] += calls[1]
        if kill_at and calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    store_writer.write_array = write_array
    for part in range(3):
        if part in done:
            continue
        calls[1] = part == 1
        ds = docs(part)
        writer.write_part(part, ds, {group.fingerprint: [AlignmentRecord(np.zeros(len(d.teacher_ids), np.int32),
                                                                         Al(len(d.teacher_ids))) for d in ds]})
    writer.finish({"parts": 3})
""")


def _run(url: str, kill_at: int, resume: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WRITER, url, str(kill_at), "1" if resume else "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kill_at", [4, 12])  # among the teacher arrays / among the alignment arrays
def test_sigkill_mid_part_then_resume(tmp_path, kill_at):
    url = str(tmp_path / "cache")
    killed = _run(url, kill_at, resume=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (tmp_path / "cache" / "shards" / shard_id(0, 1)).exists()  # leftovers of the killed part

    reader = CacheReader(url)
    assert [s.shard_id for s in reader.shards] == [shard_id(0, 0)]
    assert not reader.is_complete()
    assert verify_store(url, stop_first=False) == []
    with pytest.raises(StoreError, match="is claimed by pid"):
        CacheWriter(url, reader.manifest)

    resumed = _run(url, 0, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    reader = CacheReader(url)
    assert [s.shard_id for s in reader.shards] == [shard_id(0, p) for p in range(3)]
    assert reader.is_complete() and verify_store(url, stop_first=False) == []

    clean_url = str(tmp_path / "clean")
    assert _run(clean_url, 0, resume=False).returncode == 0
    clean = CacheReader(clean_url)
    for a, b in zip(reader.shards, clean.shards, strict=True):
        assert {n: s.sha256 for n, s in a.arrays.items()} == {n: s.sha256 for n, s in b.arrays.items()}
    fp = "s" * 64
    assert set(reader.alignment_parts(fp)) == {shard_id(0, p) for p in range(3)}
    np.testing.assert_array_equal(reader.read_alignment(fp, shard_id(0, 1)).teacher_end,
                                  clean.read_alignment(fp, shard_id(0, 1)).teacher_end)
