"""Damaged and incomplete stores x every consumer: none reports OK on damage or trains on it.

A tiny store (two parts, one alignment group, written by CacheWriter with the toy tokenizers) is
damaged the way disks, object stores and people damage stores, then handed to each consumer:

- verify: `xtcache verify --all` (verify_store, then its refusal of an incomplete store);
- inspect: `xtcache inspect` (reads indexes only; it must refuse inconsistent ones and warn about
  incomplete stores, never claim the arrays are fine);
- align: `xtcache align` (with the teacher tokenizer: reads every teacher part; with the stored
  student tokenizer: checks the parts it keeps and re-aligns a damaged one);
- train-student: `stage2_student.data.make_loaders`, the data wiring `xtcache train-student`
  runs before any model loads, read for one whole epoch as the trainer would.

Each cell either works (and then the result is checked) or raises an XtcacheError whose one-line
message names the damage. Any other exception (IndexError, a zarr error) fails the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from schemas.arrays import align_arrays, teacher_arrays
from tests.test_loader import _write_store
from xtcache.errors import XtcacheError
from xtcache.store import CacheReader, shard_id

PART = shard_id(0, 1)  # the damaged part (the second of two)


@pytest.fixture(scope="module")
def template(tmp_path_factory, toy_setup, teacher_tokenizer, student_tokenizer):
    url, fp = _write_store(tmp_path_factory.mktemp("faults") / "cache", toy_setup, teacher_tokenizer,
                           student_tokenizer, n_docs=6, parts=2)
    return Path(url), fp


def _object(root: Path, group: str, name: str) -> Path:
    (path,) = [p for p in (root / group / name / "c").rglob("*") if p.is_file()]
    return path


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_manifest(root: Path, **changes) -> None:
    raw = json.loads((root / "manifest.json").read_text())
    raw.update(changes)
    (root / "manifest.json").write_text(json.dumps(raw))


def _damages(fp: str) -> dict:
    """damage name -> (function of the store root, words the refusal must contain)."""
    t, a = f"shards/{PART}", f"align/{fp}/shards/{PART}"
    out = {}
    for arr in teacher_arrays("topk"):
        out[f"flip-{arr.name}"] = (lambda r, n=arr.name: _flip(_object(r, t, n)), [PART, repr(arr.name), "damaged"])
    for arr in (d for d in align_arrays() if not d.optional):  # a plain-text store (conversations: tests/test_chat.py)
        out[f"flip-align-{arr.name}"] = (lambda r, n=arr.name: _flip(_object(r, a, n)),
                                         [PART, repr(arr.name), "damaged"])
    out["delete-object-topk_ids"] = (lambda r: _object(r, t, "topk_ids").unlink(), [PART, "'topk_ids'", "missing"])
    out["delete-object-align-student_end"] = (lambda r: _object(r, a, "student_end").unlink(),
                                              [PART, "'student_end'", "missing"])
    out["truncate-topk_logprobs"] = (lambda r: _truncate(_object(r, t, "topk_logprobs")),
                                     [PART, "'topk_logprobs'", "damaged"])
    out["delete-part-index"] = (lambda r: (r / "index" / f"{PART}.json").unlink(), ["writer 0", "2 parts", "only 1"])
    out["delete-align-index"] = (lambda r: (r / "align" / fp / "index" / f"{PART}.json").unlink(),
                                 [fp[:12], PART])
    out["manifest-k"] = (lambda r: _edit_manifest(r, k=7), ["manifest", "k=7"])
    out["manifest-vocab"] = (lambda r: _edit_manifest(r, teacher_vocab_size=1000), ["manifest", "1000"])
    out["manifest-mode"] = (lambda r: _edit_manifest(r, mode="sampled", num_samples=12), ["manifest", "sampled"])
    out["writer-not-done"] = (lambda r: (r / "done" / "w00000.json").unlink(), ["writer", "not finished"])
    return out


CONSUMERS = ["verify", "inspect", "align", "train-student"]


def _works(consumer: str, damage: str) -> bool:
    """Cells where the consumer is right to work: inspect reads no array; align re-aligns a damaged
    or missing alignment part of its own group (checked afterwards by verify)."""
    if consumer == "inspect":
        return damage.startswith(("flip-", "delete-object-", "truncate-"))
    if consumer == "align":
        return damage.startswith(("flip-align-", "delete-object-align-", "delete-align-index"))
    return False


def _run(consumer: str, url: str, fp: str, toy_setup, capsys) -> str:
    """Run one consumer; its report on success, raising XtcacheError with its message on refusal."""
    if consumer == "verify":
        from xtcache.app.store_commands import verify_store

        problems = verify_store(url, stop_first=False) or CacheReader(url).incomplete()
        if problems:
            raise XtcacheError("; ".join(problems))
        return "OK"
    if consumer == "inspect":
        from xtcache.app.store_commands import inspect

        inspect(url, seq_len=None, storage_options=None)
        out = capsys.readouterr()
        return out.out + out.err
    if consumer == "align":
        from stage1_teacher.align_cmd import run_align

        ours = run_align(url, str(toy_setup.student_tokenizer))  # checks (and repairs) its own group
        teacher = run_align(url, str(toy_setup.teacher_tokenizer))  # reads every teacher part
        return json.dumps([ours, teacher])
    from stage2_student.config import TrainConfig
    from stage2_student.data import make_loaders
    from xtcache.tokenizer import load_tokenizer

    cfg = TrainConfig.from_flat({"cache": url, "student": str(toy_setup.student_model), "out": "unused",
                                 "seq_len": 64, "micro_batch_size": 1})
    train, _ = make_loaders(cfg, load_tokenizer(toy_setup.student_model), 0, 1)
    n = sum(1 for _ in zip(range(len(train)), train))
    return f"read {n} of {len(train)} micro-batches"


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_undamaged_store_works_for_every_consumer(tmp_path, template, toy_setup, consumer, capsys):
    root = tmp_path / "cache"
    shutil.copytree(template[0], root)
    report = _run(consumer, str(root), template[1], toy_setup, capsys)
    assert "warning" not in report and "not finished" not in report


def _cells():
    fp = "f" * 64  # damage names do not depend on the fingerprint
    return [(d, c) for d in _damages(fp) for c in CONSUMERS]


@pytest.mark.parametrize("damage, consumer", _cells())
def test_damaged_store(tmp_path, template, toy_setup, damage, consumer, capsys):
    src, fp = template
    root = tmp_path / "cache"
    shutil.copytree(src, root)
    damage_fn, words = _damages(fp)[damage]
    damage_fn(root)
    works = _works(consumer, damage)
    try:
        report = _run(consumer, str(root), fp, toy_setup, capsys)
    except XtcacheError as e:
        message = str(e)
        assert "\n" not in message, message
        assert all(w in message for w in words), (words, message)
        return
    if damage == "writer-not-done" and consumer == "inspect":
        assert "not finished" in report  # not damage: a store still being written, said so
    elif consumer == "inspect" and damage in ("delete-part-index", "delete-align-index"):
        assert "warning:" in report and all(w in report for w in words), report
    elif works and consumer == "align":
        from xtcache.app.store_commands import verify_store

        assert verify_store(str(root), stop_first=False) == []  # the damaged alignment part was re-aligned
    else:
        assert works, f"{consumer} worked on a store with {damage}: {report}"


def test_damage_met_in_a_worker_process_is_raised_with_its_one_line_message(tmp_path, template, toy_setup):
    from stage2_student.config import TrainConfig
    from stage2_student.data import make_loaders
    from xtcache.errors import CorruptionError
    from xtcache.tokenizer import load_tokenizer

    root = tmp_path / "cache"
    shutil.copytree(template[0], root)
    _flip(_object(root, f"shards/{PART}", "topk_ids"))
    cfg = TrainConfig.from_flat({"cache": str(root), "student": str(toy_setup.student_model), "out": "unused",
                                 "seq_len": 64, "micro_batch_size": 1, "num_workers": 2})
    train, _ = make_loaders(cfg, load_tokenizer(toy_setup.student_model), 0, 1)
    with pytest.raises(CorruptionError) as info:
        for _ in zip(range(len(train)), train):
            pass
    assert str(info.value) == f"store {root}, teacher part {PART}: array 'topk_ids' is damaged (crc32c mismatch)"


def test_allow_incomplete_trains_on_committed_parts_and_says_how_many(tmp_path, template, toy_setup, caplog):
    from stage2_student.config import TrainConfig
    from stage2_student.data import make_loaders
    from xtcache.tokenizer import load_tokenizer

    root = tmp_path / "cache"
    shutil.copytree(template[0], root)
    (root / "done" / "w00000.json").unlink()
    (root / "align" / template[1] / "index" / f"{PART}.json").unlink()
    cfg = TrainConfig.from_flat({"cache": str(root), "student": str(toy_setup.student_model), "out": "unused",
                                 "seq_len": 64, "micro_batch_size": 1, "allow_incomplete": True})
    with caplog.at_level("WARNING"):
        train, _ = make_loaders(cfg, load_tokenizer(toy_setup.student_model), 0, 1)
    assert "reading 1 of 2 parts" in caplog.text
    assert train.dataset.caches[0].shard_ids == [shard_id(0, 0)]
    assert sum(1 for _ in zip(range(len(train)), train)) == len(train) > 0


def test_seq_len_above_the_students_positions_is_refused(tmp_path, template, toy_setup):
    from transformers import AutoConfig

    from stage2_student.config import TrainConfig
    from stage2_student.data import make_loaders
    from xtcache.errors import ConfigError
    from xtcache.tokenizer import load_tokenizer

    limit = AutoConfig.from_pretrained(toy_setup.student_model).max_position_embeddings
    cfg = TrainConfig.from_flat({"cache": str(template[0]), "student": str(toy_setup.student_model), "out": "unused",
                                 "seq_len": limit + 1})
    with pytest.raises(ConfigError, match=f"--seq-len {limit + 1} is above the student's max_position_embeddings"):
        make_loaders(cfg, load_tokenizer(toy_setup.student_model), 0, 1)


def test_old_store_without_crc32c_is_read_checked_by_sha256(tmp_path, template, caplog):
    """Stores written before chunk checksums (same format version): every read compares sha256."""
    import zarr

    root = tmp_path / "cache"
    shutil.copytree(template[0], root)
    reader = CacheReader(str(root))
    want = reader.read_shard(PART)
    # rewrite one part's arrays the old way: same values, codec chain without crc32c
    for arr in teacher_arrays("topk"):
        spec = reader.shard(PART).arrays[arr.name]
        old = zarr.open_array(str(root / "shards" / PART / arr.name), mode="r")[...]
        from xtcache.store.arrays import default_compression

        shutil.rmtree(root / "shards" / PART / arr.name)
        new = zarr.create_array(str(root / "shards" / PART), name=arr.name, shape=old.shape, dtype=old.dtype,
                                chunks=spec.chunks, shards=spec.shape if old.size else None,
                                compressors=default_compression(arr.name).zarr_codecs(old.dtype.itemsize),
                                fill_value=0, zarr_format=3,
                                attributes={"xtcache_transform": spec.transform.model_dump()} if spec.transform else {})
        new[...] = old
    with caplog.at_level("WARNING"):
        got = CacheReader(str(root)).read_shard(PART)
    assert "checked against its sha256" in caplog.text
    assert np.array_equal(got.topk_ids, want.topk_ids) and got.texts == want.texts
    (root / "shards" / PART / "residual" / "c" / "0").unlink()  # an old all-zero array may lack its object
    with pytest.raises(XtcacheError, match=f"{PART}: array 'residual' is damaged .sha256"):
        CacheReader(str(root)).read_shard(PART)
