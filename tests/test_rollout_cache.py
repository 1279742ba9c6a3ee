"""Rollouts of `xtcache generate` through `teacher-dump` into a store that keeps the sampling log-probs
of the student that sampled them (`sampled_logprobs`, optional array of its alignment group), and
`train-student --loss rkl-pg` with the importance ratio on (the default --is-cap) reading them.

The chat toy setup: a Llama-3-style student (BPE) generates with --engine hf, the ChatML teacher
scores with --engine hf, cross-tokenizer. Cost: one generate, three dumps, two short trainings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from xtcache.testing.suite import REPO

SEQ = "64"


def _cli(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "xtcache.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(parts: Path) -> dict[tuple[str, int], dict]:
    return {(p.name, i): json.loads(line) for p in sorted(parts.glob("*.jsonl"))
            for i, line in enumerate(p.read_text().splitlines())}


def _write_rows(parts: Path, rows: dict[tuple[str, int], dict]) -> None:
    parts.mkdir(parents=True)
    by_file: dict[str, list] = {}
    for (name, _), row in sorted(rows.items()):
        by_file.setdefault(name, []).append(row)
    for name, lines in by_file.items():
        (parts / name).write_text("".join(json.dumps(r) + "\n" for r in lines))


def _dump(setup, parts: Path, out: Path) -> Path:
    _cli("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", setup.student_model, "--data",
         f"{parts}/*.jsonl", "--out", out, "--engine", "hf")
    return out


CLEAN = ("The cache stores ids and log-probs for every turn.", "Rounds of samples, scored offline.",
         "A student learns from its own text.", "The teacher never enters training memory.")


@pytest.fixture(scope="module")
def rollouts(toy_setup, tmp_path_factory):
    """(chat setup, generated rollout parts, a store of them, clean rollout parts, a store of those).

    The untrained toy student writes noise: byte tokens decode to U+FFFD and the Llama-3 template trims a
    leading space, so most generated turns are not spelled by their sampled ids. The clean rows are the
    generated rows with a text whose ids (the student's tokenization, end-of-turn appended when it
    stopped) spell it, as generate writes them for a turn that round-trips.
    """
    from xtcache.testing.chat import build_chat_setup
    from xtcache.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("rollcache")
    setup = build_chat_setup(toy_setup, root / "chat", num_train=4, num_heldout=2, teacher_steps=0)
    prompts = []
    for row in map(json.loads, setup.train_jsonl.read_text().splitlines()):
        last_user = max(i for i, m in enumerate(row["messages"]) if m["role"] == "user")
        prompts.append({**row, "messages": row["messages"][:last_user + 1]})
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    _cli("generate", "--student", setup.student_model, "--data", root / "prompts.jsonl", "--out", root / "r",
         "--engine", "hf", "--samples-per-prompt", "2", "--max-new-tokens", "12", "--seed", "1")
    tok = load_tokenizer(setup.student_model)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    clean = {}
    for j, (key, row) in enumerate(sorted(_rows(root / "r" / "parts").items())):
        text = CLEAN[j % len(CLEAN)]
        stop = j % 3 != 2  # every third row cut by --max-new-tokens: no end-of-turn sampled
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([eot] if stop else [])
        messages = [*row["messages"][:-1], {"role": "assistant", "content": text}]
        clean[key] = {**row, "messages": messages, "sampled_ids": ids, "stop_reason": "stop" if stop else "length",
                      "sampled_logprobs": [round(-0.01 * (j + 1) * (i + 1), 6) for i in range(len(ids))]}
    _write_rows(root / "clean", clean)
    return (setup, root / "r" / "parts", _dump(setup, root / "r" / "parts", root / "cache"), root / "clean",
            _dump(setup, root / "clean", root / "clean-cache"))


def _group(store: Path, setup):
    """(reader, the sampling student's fingerprint, its groups' stats summed over parts, docs by (file, row)
    -> (student ids, roles, sampled log-probs or None))."""
    from xtcache.chat import chat_fingerprint
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    r = CacheReader(str(store))
    fp = chat_fingerprint(load_tokenizer(setup.student_model))
    assert fp in r.alignment_groups()
    totals: dict[str, int] = {}
    docs = {}
    for sid, part in r.alignment_parts(fp).items():
        for k, v in part.conversation.items():
            totals[k] = totals.get(k, 0) + v
        meta, al = r.shard(sid), r.read_alignment(fp, sid, verify=True)
        for i, d in enumerate(meta.docs):
            rec = al.record(i)
            docs[(d.source, d.row)] = (rec.student_ids, rec.student_role, rec.sampled_logprobs)
    return r, fp, totals, docs


def test_stored_sampling_log_probs_are_the_rollouts_on_the_generated_turn_nan_elsewhere(rollouts):
    from xtcache.chat import LAST_ASSISTANT

    setup, _, _, parts, store = rollouts
    rows = _rows(parts)
    _, _, totals, docs = _group(store, setup)
    assert set(docs) == set(rows) and len(rows) == 8
    assert totals["sampled_turns"] == 8 and totals["sampled_mismatch"] == 0  # a BPE student: the same ids
    assert any(r["stop_reason"] == "length" for r in rows.values())
    for key, row in rows.items():
        ids, roles, lp = docs[key]
        n = len(row["sampled_ids"])
        turn = np.flatnonzero(lp == lp)  # the finite entries
        assert len(turn) == n and np.all(np.diff(turn) == 1)
        assert ids[turn].tolist() == row["sampled_ids"]
        np.testing.assert_array_equal(lp[turn], np.asarray(row["sampled_logprobs"], dtype=np.float32))
        assert np.all(roles[turn] & LAST_ASSISTANT)  # the generated turn, and nothing before it
        assert not np.any(roles[turn[-1] + 1:] & LAST_ASSISTANT)  # after a length stop: the template's marker
        if row["stop_reason"] == "length":
            assert turn[-1] + 1 < len(ids)  # the template wrote its end-of-turn after the cut: not sampled
    assert _cli("verify", store).returncode == 0
    out = _cli("inspect", store).stdout
    assert "sampled turns 8" in out and "not the sampled ids 0" in out


def test_generated_turns_not_spelled_by_their_ids_are_counted_and_get_no_log_probs(rollouts):
    """The toy student's own rollouts: a turn gets its log-probs exactly when its sampled ids (the stop
    token aside) decode to the turn's text and are that text's tokenization (computed here, apart)."""
    from xtcache.tokenizer import load_tokenizer

    setup, parts, store, _, _ = rollouts
    tok = load_tokenizer(setup.student_model)
    rows = _rows(parts)
    _, _, totals, docs = _group(store, setup)
    spelled = {}
    for key, row in rows.items():
        body = row["sampled_ids"][:-1] if row["stop_reason"] == "stop" else row["sampled_ids"]
        text = row["messages"][-1]["content"]
        spelled[key] = tok.decode(body) == text and tok(text, add_special_tokens=False)["input_ids"] == body
    assert totals["sampled_turns"] == len(rows) == 8
    assert totals["sampled_mismatch"] == sum(not ok for ok in spelled.values())
    same = 0
    for key, ok in spelled.items():
        body = rows[key]["sampled_ids"][:-1] if rows[key]["stop_reason"] == "stop" else rows[key]["sampled_ids"]
        text = tok.decode(body)
        same += not ok and "\ufffd" not in text and text == rows[key]["messages"][-1]["content"].strip()
    assert totals["sampled_same_text"] == same
    for key, ok in spelled.items():
        lp = docs[key][2]
        assert int(np.isfinite(lp).sum()) == (len(rows[key]["sampled_ids"]) if ok else 0)


def test_tampered_sampled_ids_are_counted_and_get_no_log_probs(rollouts, tmp_path):
    from xtcache.tokenizer import load_tokenizer

    setup, _, _, parts, _ = rollouts
    tok = load_tokenizer(setup.student_model)
    rows = _rows(parts)
    key = sorted(rows)[1]
    first = rows[key]["sampled_ids"][0]
    rows[key] = {**rows[key], "sampled_ids": [first - 1 if first > 0 else 1, *rows[key]["sampled_ids"][1:]]}
    other = sorted(rows)[3]  # the same text in other tokens: split inside a word, each half tokenized alone
    text = rows[other]["messages"][-1]["content"]
    stop = rows[other]["sampled_ids"][-1:] * (rows[other]["stop_reason"] == "stop")
    ids = next(ids for k in range(1, len(text)) if (ids := tok(text[:k], add_special_tokens=False)["input_ids"]
               + tok(text[k:], add_special_tokens=False)["input_ids"] + stop) != rows[other]["sampled_ids"])
    assert tok.decode(ids, skip_special_tokens=True) == text
    rows[other] = {**rows[other], "sampled_ids": ids, "sampled_logprobs": [-0.5] * len(ids)}
    _write_rows(tmp_path / "parts", rows)
    store = _dump(setup, tmp_path / "parts", tmp_path / "cache")
    _, _, totals, docs = _group(store, setup)
    assert totals["sampled_turns"] == 8 and totals["sampled_mismatch"] == 2 and totals["sampled_same_text"] == 1
    assert np.all(np.isnan(docs[key][2])) and np.all(np.isnan(docs[other][2]))
    assert sum(int(np.isfinite(lp).sum()) > 0 for _, _, lp in docs.values()) == 6
    assert "not the sampled ids 2 (no sampling log-probs there; of them spelling the same text 1)" in _cli(
        "inspect", store).stdout


def _train(setup, store: Path, out: Path, *extra, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "stage2_student", "--out", str(out), "--cache", str(store),
                           "--student", str(setup.student_model), "--seq-len", SEQ, "--micro-batch-size", "2",
                           "--max-steps", "2", "--loss", "rkl-pg", "--train-on", "last-assistant", "--zero-stage", "0",
                           "--seed", "3", *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_rkl_pg_trains_with_the_ratio_on_and_a_store_without_the_array_still_trains(rollouts, tmp_path):
    setup, _, _, parts, store = rollouts
    _train(setup, store, tmp_path / "run")  # the default --is-cap: the ratio reads the stored log-probs
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) for r in train)
    assert all(r["chunks"] > 0 for r in train)

    plain = {k: {f: v for f, v in row.items() if f not in ("sampled_ids", "sampled_logprobs", "chat_fingerprint")}
             for k, row in _rows(parts).items()}
    _write_rows(tmp_path / "plain", plain)
    bare = _dump(setup, tmp_path / "plain", tmp_path / "bare")
    _, _, totals, docs = _group(bare, setup)
    assert "sampled_turns" not in totals and all(lp is None for _, _, lp in docs.values())
    assert _cli("verify", bare).returncode == 0
    refused = _train(setup, bare, tmp_path / "bare-run", check=False)
    assert refused.returncode != 0 and "--is-cap 0" in refused.stdout + refused.stderr
    _train(setup, bare, tmp_path / "bare-run0", "--is-cap", "0")


def test_a_sampling_log_prob_that_is_no_log_prob_is_damage():
    from xtcache.errors import CorruptionError
    from xtcache.store.reader import check_sampled_logprobs

    check_sampled_logprobs(np.array([np.nan, -1.5, 0.0], dtype=np.float32), "part")
    for bad in (np.inf, -np.inf, 0.5):
        with pytest.raises(CorruptionError, match="sampled_logprobs"):
            check_sampled_logprobs(np.array([np.nan, bad], dtype=np.float32), "part")


def test_the_batch_lays_sampling_log_probs_out_like_labels():
    """At logit (b, i) the batch holds the stored log-prob of labels[b, i] (the token that logit predicts)."""
    from stage2_student.batches import IGNORE, ShardSource, build_micro_batch

    n = 5
    ends = np.arange(1, n + 1, dtype=np.int32)
    offs = np.array([0, n], dtype=np.int64)
    stored = np.array([np.nan, np.nan, -1.0, -2.0, -3.0], dtype=np.float32)
    src = ShardSource(doc_pos_offsets=offs, doc_student_offsets=offs, doc_chunk_offsets=offs,
                      student_ids=np.arange(10, 10 + n, dtype=np.int32), student_end=ends, teacher_end=ends,
                      exact=np.ones(n, bool), has_pred=np.ones(n, bool), topk_ids=np.zeros((n, 2), np.int32),
                      topk_logprobs=np.zeros((n, 2), np.float32), topk_counts=None, residual=np.zeros(n, np.float32),
                      realized_logprob=np.zeros(n, np.float32), sampled_logprobs=stored)
    batch = build_micro_batch([[(src, 0, 0, n, 0)]], seq_len=8, pad_id=0)
    assert batch["labels"][0, :4].tolist() == [11, 12, 13, 14] and np.all(batch["labels"][0, 4:] == IGNORE)
    np.testing.assert_array_equal(batch["sampled_logprobs"][0], [np.nan, -1, -2, -3, *[np.nan] * 4])
    plain = build_micro_batch([[(replace(src, sampled_logprobs=None), 0, 0, n, 0)]], seq_len=8, pad_id=0)
    assert "sampled_logprobs" not in plain  # a store without the array: no key (--is-cap 0 only)
