"""Claims are exclusive and kept by their holder; `xtcache align` and a dump never lose each other's parts.

    pytest -q tests/test_store_concurrency.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from schemas.models import Manifest
from tests.test_store import make_doc
from xtcache.errors import StoreError
from xtcache.store import CacheWriter, shard_id

REPO = Path(__file__).resolve().parents[1]
BUCKET = "xtcache-claims"


def manifest(**kw) -> Manifest:
    return Manifest(cache_key="claims", mode="topk", k=4, teacher_vocab_size=100, **kw)


@pytest.fixture(scope="module")
def s3():
    from xtcache.testing.s3 import s3_server

    with s3_server(BUCKET) as (options, _):
        yield options


# connects, says READY, reads a common start time from stdin and waits for it, then takes writer 1's
# claim; prints WON or the refusal
CLAIMER = textwrap.dedent("""
    import json, sys, time
    from schemas.models import Manifest
    from xtcache.errors import StoreError
    from xtcache.store import CacheWriter
    from xtcache.location import Location

    url, options = sys.argv[1], json.loads(sys.argv[2])
    m = Manifest(cache_key="claims", mode="topk", k=4, teacher_vocab_size=100, num_writers=2)
    Location(url, options).fs.exists(url)  # connect before the start
    print("READY", flush=True)
    start = float(sys.stdin.readline())
    while time.time() < start:  # both processes leave this loop within microseconds of each other
        pass
    try:
        CacheWriter(url, m, writer_index=1, storage_options=options)
        print("WON", flush=True)
    except StoreError as e:
        print("REFUSED", e, flush=True)
""")


def test_two_processes_racing_for_one_shard_index_on_s3_exactly_one_wins(s3):
    import json

    from xtcache.location import Location

    for round_ in range(3):
        url = f"s3://{BUCKET}/race{round_}"
        CacheWriter(url, manifest(num_writers=2), writer_index=0, storage_options=s3).close()  # manifest exists
        procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, url, json.dumps(s3)], cwd=REPO, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        ready = [p.stdout.readline().strip() for p in procs]  # both imported and connected
        assert ready == ["READY", "READY"], (ready, [p.stderr.read()[-2000:] for p in procs if p.poll() is not None])
        start = time.time() + 0.2
        for p in procs:  # the start time to both before either can pass it
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
        lines = [o[0].strip() for o in outs]
        assert sorted(line.split()[0] for line in lines) == ["REFUSED", "WON"], (lines, [o[1][-2000:] for o in outs])
        refusal = next(line for line in lines if line.startswith("REFUSED"))
        assert "writer 1 of store" in refusal and "is claimed by pid" in refusal
        assert Location(url, s3).read_json("claims/w00001.json")["token"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_writer_whose_claim_was_taken_over_never_removes_it_nor_commits(tmp_path, s3, where):
    url = str(tmp_path / "cache") if where == "local" else f"s3://{BUCKET}/takeover"
    options = None if where == "local" else s3
    old = CacheWriter(url, manifest(num_writers=2), writer_index=1, storage_options=options)
    new = CacheWriter(url, manifest(num_writers=2), writer_index=1, storage_options=options, resume=True)
    token = new.loc.read_json("claims/w00001.json")["token"]
    assert token and token != old.claim.token or old.claim.token is None
    with pytest.raises(StoreError, match="not by this job .a --resume run took it over.; this job stops without "
                                         "committing part w00001-p000000"):
        old.write_part(0, [make_doc(np.random.default_rng(0), 0, 5, 4, 100)])
    old.close()
    assert new.loc.read_json("claims/w00001.json")["token"] == token  # the new holder's claim is still there
    new.write_part(0, [make_doc(np.random.default_rng(0), 0, 5, 4, 100)])
    new.close()
    assert new.loc.read_json("claims/w00001.json") is None


def test_several_writers_on_a_store_without_exclusive_create_are_refused_by_name(monkeypatch):
    url = f"memory://claims-{time.time_ns()}"
    monkeypatch.delenv("XTCACHE_ONE_JOB_PER_INDEX", raising=False)
    with pytest.raises(StoreError, match=f"store {url}: .*no exclusive create.*XTCACHE_ONE_JOB_PER_INDEX=1"):
        CacheWriter(url, manifest(num_writers=2), writer_index=1)
    monkeypatch.setenv("XTCACHE_ONE_JOB_PER_INDEX", "1")
    CacheWriter(url, manifest(num_writers=2), writer_index=1).close()


def test_align_and_a_writer_rewriting_a_part_never_lose_each_others_parts(tmp_path, toy_setup, teacher_tokenizer,
                                                                         student_tokenizer, monkeypatch):
    """Repair while `xtcache align` runs: writer 0 rewrites part 1 (its index deleted by hand) just
    after align aligned it. The writer is refused while align holds the lock, so no part align
    reported is lost; once align is done the rewrite goes through and align completes the group."""
    from stage1_teacher.align_cmd import align_store
    from tests.test_loader import _write_store
    from xtcache.app.store_commands import verify_store
    from xtcache.store import CacheReader
    from xtcache.store.writer import CacheWriter as Writer

    url, _ = _write_store(tmp_path / "cache", toy_setup, teacher_tokenizer, student_tokenizer, n_docs=6, parts=2)
    reader = CacheReader(url)
    part = shard_id(0, 1)
    docs = [reader.read_shard(part).doc(i) for i in range(reader.shard(part).num_docs)]
    refusals = []
    original = Writer.add_alignment_group

    def add_then_race(self, group, sid, records):
        original(self, group, sid, records)
        if sid == part:  # align has just aligned part 1: the repair's writer starts now
            (Path(url) / "index" / f"{part}.json").unlink(missing_ok=True)
            try:
                with CacheWriter(url, reader.manifest, resume=True) as w:
                    w.write_part(1, docs)
            except StoreError as e:
                refusals.append(str(e))

    monkeypatch.setattr(Writer, "add_alignment_group", add_then_race)
    stats = align_store(url, str(toy_setup.teacher_tokenizer), reader=CacheReader(url))
    monkeypatch.setattr(Writer, "add_alignment_group", original)
    fp = stats["fingerprint"]
    assert len(refusals) == 1 and "`xtcache align` is running on this store" in refusals[0], refusals
    assert "\n" not in refusals[0]
    assert stats["parts_aligned"] == 2
    for sid in (shard_id(0, 0), part):  # every part align reported is still there
        assert (Path(url) / "align" / fp / "index" / f"{sid}.json").exists(), sid
    with CacheWriter(url, reader.manifest, resume=True) as w:  # align has ended: the rewrite goes through
        w.write_part(1, docs)
        w.finish()
    again = align_store(url, str(toy_setup.teacher_tokenizer))
    assert again["parts_aligned"] == 1 and again["parts_kept"] == 1
    align_store(url, str(toy_setup.student_tokenizer))  # the rewrite above wrote no group of its own
    assert verify_store(url, stop_first=False) == []


def test_an_exclusive_create_shows_no_reader_the_file_before_its_bytes_are_whole(tmp_path, monkeypatch):
    """A local `create_exclusive` (a manifest, a writer claim) publishes the file whole: while its bytes are being
    written the path does not exist, so a concurrent job never reads an empty manifest.json (a job read one as
    "not valid JSON" when the create opened the file with O_EXCL before writing it). A second create loses, and no
    temp file stays behind."""
    import json
    import os

    from xtcache.location import Location

    loc = Location(str(tmp_path / "store"))
    target = tmp_path / "store" / "manifest.json"
    seen = []
    real_fsync = os.fsync

    def fsync(fd):  # while the bytes are written: what a concurrent reader of the path would find
        seen.append(target.exists())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert loc.create_exclusive("manifest.json", {"a": 1})
    assert seen == [False] and json.loads(target.read_text()) == {"a": 1}
    assert not loc.create_exclusive("manifest.json", {"a": 2}) and json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in target.parent.iterdir()) == ["manifest.json"]
    assert target.stat().st_mode & 0o777 == 0o644
