"""Stores of format version 1 (before conversations) still read, and stay version 1 when extended.

`tests/fixtures/store_v1` was written by the xtcache of format version 1 (commit 39ac103) with
`tests/fixtures/make_store_v1.py`:

    git archive 39ac103 | tar -x -C /tmp/old && cd /tmp/old && \
        PYTHONPATH=. python $REPO/tests/fixtures/make_store_v1.py $REPO/tests/fixtures/store_v1
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from schemas.models import FORMAT_VERSION, AlignGroupMeta
from xtcache.align import identity_alignment
from xtcache.errors import FormatVersionError
from xtcache.store import AlignmentRecord, CacheReader, CacheWriter

V1 = Path(__file__).resolve().parent / "fixtures" / "store_v1"


def test_a_version_1_store_reads_and_verifies():
    from xtcache.commands_store import store_summary, verify_store

    assert FORMAT_VERSION == 2
    r = CacheReader(str(V1))
    assert r.manifest.format_version == 1 and not r.manifest.conversation and r.is_complete()
    shard = r.read_shard(r.shards[0].shard_id, verify=True)
    assert shard.texts == ["hello world", "a second document"] and shard.conversations is None
    al = r.read_alignment("a" * 64, r.shards[0].shard_id, verify=True)
    assert al.student_role is None and al.student_ids.shape[0] == 5
    assert verify_store(str(V1)) == []
    assert store_summary(str(V1))["conversation"] == {}


def test_a_group_added_to_a_version_1_store_keeps_version_1(tmp_path):
    store = tmp_path / "v1"
    shutil.copytree(V1, store)
    r = CacheReader(str(store))
    sid = r.shards[0].shard_id
    group = AlignGroupMeta(fingerprint="c" * 64, tokenizer_name="added", vocab_size=50, identity=True)
    with CacheWriter(str(store), r.manifest) as w:
        lengths = np.diff(r.doc_pos_offsets(sid))
        w.add_alignment_group(group, sid, [AlignmentRecord(student_ids=np.zeros(int(n), np.int32),
                                                           alignment=identity_alignment(int(n))) for n in lengths])
    r = CacheReader(str(store))
    assert r.alignment_groups()["c" * 64].format_version == 1
    assert r.alignment_parts("c" * 64)[sid].format_version == 1
    assert r.read_alignment("c" * 64, sid, verify=True).student_ids.shape[0] == 5
    assert r.manifest.format_version == 1


def test_conversations_need_version_2(tmp_path):
    m = CacheReader(str(V1)).manifest.model_copy(update={"conversation": True})
    with pytest.raises(FormatVersionError, match="cannot write format version 1 with conversations"):
        CacheWriter(str(tmp_path / "x"), m)
