"""Rollouts of `xtcache generate` through `teacher-dump` into a store that keeps the sampling log-probs
of the student that sampled them (`sampled_logprobs`, optional array of its alignment group), and
`train-student --loss rkl-pg` with the importance ratio on (the default --is-cap) reading them.

The chat toy setup: a Llama-3-style student (BPE) generates with --engine hf, the ChatML teacher
scores with --engine hf, cross-tokenizer. Cost: one generate, six dumps and the store commands in the test
process (`tests.commands.xtcache`: the same entry point, no new interpreter), five short trainings (a process each, forked from one that imported DeepSpeed once).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.commands import xtcache

SEQ = "64"


def _cli(*args, check=True) -> subprocess.CompletedProcess:
    proc = xtcache(*args)
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


def _dump(setup, parts: Path, out: Path, student=None) -> Path:
    _cli("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", student or setup.student_model,
         "--data", f"{parts}/*.jsonl", "--out", out, "--engine", "hf")
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
    from xtcache.testing.chat import build_chat_setup, write_prompts
    from xtcache.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("rollcache")
    setup = build_chat_setup(toy_setup, root / "chat", num_train=4, num_heldout=2, teacher_steps=0)
    write_prompts(setup.train_jsonl, root / "prompts.jsonl")
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


def _group(store: Path, setup, *, text: bool = False):
    """(reader, the sampling student's fingerprint, its groups' stats summed over parts, docs by (file, row)
    -> (student ids, roles, sampled log-probs or None)). `text`: a plain-text store, its one group (keyed by
    the tokenizer, not the chat template)."""
    from xtcache.chat.render import chat_fingerprint
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    r = CacheReader(str(store))
    if text:
        (fp,) = r.alignment_groups()
    else:
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


def _alignments(store: Path, fp: str) -> dict:
    """The chunk alignment of every document of alignment group `fp`, by (file, row)."""
    from xtcache.store import CacheReader

    r = CacheReader(str(store))
    return {(d.source, d.row): r.read_alignment(fp, sid, verify=True).record(i).alignment
            for sid in r.alignment_parts(fp) for i, d in enumerate(r.shard(sid).docs)}


def test_stored_sampling_log_probs_are_the_rollouts_on_the_generated_turn_nan_elsewhere(rollouts):
    from schemas.roles import LAST_ASSISTANT

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
    assert "sampled turns 8" in out and "not the re-tokenized ids 0" in out


def _split_ids(tok, text: str, stop: list[int]) -> list[int]:
    """Another tokenization of `text` than the tokenizer's: cut inside it, each half tokenized alone."""
    canonical = tok(text, add_special_tokens=False)["input_ids"]
    ids = next(ids for k in range(1, len(text)) if (ids := tok(text[:k], add_special_tokens=False)["input_ids"]
               + tok(text[k:], add_special_tokens=False)["input_ids"]) != canonical)
    assert tok.decode(ids) == text
    return ids + stop


def test_generated_turns_are_spliced_exactly_when_their_ids_spell_the_rendered_turn(rollouts):
    """The toy student's own rollouts: a turn gets its log-probs exactly when its sampled ids (the stop
    token aside) decode to the message's text (byte tokens that are no UTF-8 decoding to U+FFFD, whitespace
    the Llama-3 template trims included) and it stopped on the template's end-of-turn or by length;
    computed here from decoded text, apart from the splice's bytes."""
    from xtcache.tokenizer import load_tokenizer

    setup, parts, store, _, _ = rollouts
    tok = load_tokenizer(setup.student_model)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    rows = _rows(parts)
    _, fp, totals, docs = _group(store, setup)
    spelled, retokenized = {}, {}
    for key, row in rows.items():
        ids, text = row["sampled_ids"], row["messages"][-1]["content"]
        stopped = bool(ids) and ids[-1] in tok.all_special_ids
        body = ids[:-1] if stopped else ids
        spelled[key] = (tok.decode(body) == text and text.strip() != "" and (not stopped or ids[-1] == eot))
        retokenized[key] = tok(text.strip(), add_special_tokens=False)["input_ids"] + [eot] * stopped == ids
    assert totals["sampled_turns"] == len(rows) == 8
    odd = [k for k in rows if "\ufffd" in rows[k]["messages"][-1]["content"]
           or rows[k]["messages"][-1]["content"] != rows[k]["messages"][-1]["content"].strip()]
    assert sum(spelled[k] for k in odd) >= 2, odd  # U+FFFD or trimmed whitespace, spliced all the same
    from xtcache.app.store_commands import store_summary

    assert store_summary(str(store)).conversation[fp]["misaligned_chars"] == 0 and _cli("verify", store).returncode == 0
    assert totals["sampled_mismatch"] == sum(not ok for ok in retokenized.values())
    assert totals["sampled_same_text"] == sum(spelled[k] and not retokenized[k] for k in rows)
    for key in rows:
        ids, lp = docs[key][0], docs[key][2]
        assert int(np.isfinite(lp).sum()) == (len(rows[key]["sampled_ids"]) if spelled[key] else 0)
        if spelled[key]:
            assert ids[np.isfinite(lp)].tolist() == rows[key]["sampled_ids"]
    # no exact chunk holds student bytes that are no UTF-8 (sampled bytes the text reads as U+FFFD)
    from stage1_teacher.onpolicy.splice import piece_bytes
    from xtcache.align.tokenizer import tokenizer_info

    info, aligns = tokenizer_info(tok), _alignments(store, fp)
    replaced = [k for k in rows if spelled[k] and "\ufffd" in rows[k]["messages"][-1]["content"]]
    assert replaced
    for key in replaced:
        al, ids = aligns[key], docs[key][0]
        ends = np.asarray(al.student_end)
        for c in np.flatnonzero(np.asarray(al.exact)):
            piece = piece_bytes(info, ids[(ends[c - 1] if c else 0):ends[c]].astype(np.int64))
            piece.decode("utf-8")  # raises on an exact chunk over invalid bytes


def test_the_tokens_before_the_turn_are_the_ids_generate_prompted_with(rollouts):
    """The context the student trains its first answer token after is the one it sampled after: the stored
    ids up to the generated turn are `generate`'s prompt ids (the generation prompt encoded alone), also
    where encoding the whole rendering merges the prompt's last newlines otherwise (some rows of each store
    here: checked, so that the test can fail)."""
    from schemas.roles import LAST_ASSISTANT
    from stage1_teacher.corpus import Document
    from stage1_teacher.onpolicy.rollouts import prompt_of
    from xtcache.chat.render import render
    from xtcache.tokenizer import load_tokenizer

    setup, parts, store, clean_parts, clean_store = rollouts
    tok = load_tokenizer(setup.student_model)
    for where, cache in ((parts, store), (clean_parts, clean_store)):
        rows, (_, _, _, docs) = _rows(where), _group(cache, setup)
        merged = 0
        for key, row in rows.items():
            prompt = {k: v for k, v in row.items() if k in ("messages", "tools")}
            prompt["messages"] = prompt["messages"][:-1]
            want = prompt_of(Document("p.jsonl", 0, json.dumps(prompt), conversation=True), tok).token_ids
            ids, roles, _ = docs[key]
            first = int(np.argmax(roles & LAST_ASSISTANT))
            assert ids[:first].tolist() == want, key
            whole = tok(render(tok, {**prompt, "messages": row["messages"]}), add_special_tokens=False)["input_ids"]
            merged += whole[:len(want)] != want
        assert merged >= 1


def test_sampled_ids_that_spell_the_turn_are_spliced_others_counted(rollouts, tmp_path):
    from xtcache.app.store_commands import store_summary
    from xtcache.tokenizer import load_tokenizer

    setup, _, _, parts, _ = rollouts
    tok = load_tokenizer(setup.student_model)
    rows = _rows(parts)
    key = sorted(rows)[1]
    first = rows[key]["sampled_ids"][0]
    rows[key] = {**rows[key], "sampled_ids": [first - 1 if first > 0 else 1, *rows[key]["sampled_ids"][1:]]}
    other = sorted(rows)[3]  # the same text in other tokens
    stop = rows[other]["sampled_ids"][-1:] * (rows[other]["stop_reason"] == "stop")
    ids = _split_ids(tok, rows[other]["messages"][-1]["content"], stop)
    rows[other] = {**rows[other], "sampled_ids": ids, "sampled_logprobs": [-0.5] * len(ids)}
    _write_rows(tmp_path / "parts", rows)
    store = _dump(setup, tmp_path / "parts", tmp_path / "cache")
    r, fp, totals, docs = _group(store, setup)
    assert totals["sampled_turns"] == 8 and totals["sampled_mismatch"] == 2 and totals["sampled_same_text"] == 1
    assert np.all(np.isnan(docs[key][2]))  # not spelled: the re-tokenized ids, no log-probs
    stored, _, lp = docs[other]
    assert stored[np.isfinite(lp)].tolist() == ids and np.all(lp[np.isfinite(lp)] == -0.5)
    assert sum(int(np.isfinite(lp).sum()) > 0 for _, _, lp in docs.values()) == 7
    assert store_summary(str(store)).conversation[fp]["misaligned_chars"] == 0
    assert ("not the re-tokenized ids 2 (spliced, trained on the sampled ids: 1; not spelling the turn's text, "
            "no sampling log-probs: 1)") in _cli("inspect", store).stdout


def _train(procs, setup, store: Path, out: Path, *extra, check=True, student=None) -> subprocess.CompletedProcess:
    """`xtcache train-student` (the flags of `python -m stage2_student`) in a process of its own."""
    proc = procs.cli("train-student", "--out", str(out), "--cache", str(store), "--student",
                       str(student or setup.student_model), "--seq-len", SEQ, "--micro-batch-size", "2", "--max-steps",
                       "2", "--loss", "rkl-pg", "--train-on", "last-assistant", "--zero-stage", "0", "--seed", "3",
                       *extra)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_rkl_pg_trains_with_the_ratio_on_and_a_store_without_the_array_still_trains(rollouts, procs, tmp_path):
    setup, _, _, parts, store = rollouts
    _train(procs, setup, store, tmp_path / "run")  # the default --is-cap: the ratio reads the stored log-probs
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
    refused = _train(procs, setup, bare, tmp_path / "bare-run", check=False)
    assert refused.returncode != 0 and "--is-cap 0" in refused.stdout + refused.stderr
    _train(procs, setup, bare, tmp_path / "bare-run0", "--is-cap", "0")
    # a held-out cache without sampling log-probs (a corpus cache, or this one) is evaluated without the ratio
    _train(procs, setup, store, tmp_path / "eval-run", "--eval-cache", str(bare))
    evals = [r for r in map(json.loads, (tmp_path / "eval-run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert evals and all(np.isfinite(r["kl"]) and r["objective_kd_name"] == "rkl-pg" for r in evals)


def test_rkl_pg_refuses_a_rollout_cache_that_also_holds_rows_that_are_no_rollouts(rollouts, procs, tmp_path):
    setup, _, _, parts, _ = rollouts
    rows = _rows(parts)
    key = sorted(rows)[0]
    corpus = {f: v for f, v in rows[key].items() if f not in ("sampled_ids", "sampled_logprobs", "chat_fingerprint")}
    _write_rows(tmp_path / "mixed", {**rows, ("corpus.jsonl", 0): corpus})  # a conversation nobody sampled
    store = _dump(setup, tmp_path / "mixed", tmp_path / "mixed-cache")
    _, _, totals, _ = _group(store, setup)
    assert totals["sampled_turns"] == len(rows)
    for cap in ("2", "0"):  # the data is wrong for the policy gradient, with the ratio or without it
        refused = _train(procs, setup, store, tmp_path / f"run{cap}", "--is-cap", cap, check=False)
        assert refused.returncode != 0
        assert re.search(rf"--loss rkl-pg trains the student on its own samples, and the cache {store} part \S+: "
                         rf"1 of its {len(rows) + 1} documents are no rollouts of it", refused.stderr), refused.stderr[-2000:]
    _train(procs, setup, store, tmp_path / "pkl", "--loss", "pkl")  # any other loss trains on every row


def test_non_canonical_sampled_ids_are_stored_aligned_and_trained_with_the_ratio(rollouts, procs, tmp_path):
    """Every turn sampled as another tokenization of its text (a word in two tokens): the stored student
    ids are the sampled ids, with their log-probs on every one of them, the trained positions are
    exactly those tokens, the alignment is exact, and --loss rkl-pg --is-cap 2 trains on it."""
    from xtcache.app.store_commands import store_summary
    from xtcache.chat.render import trained_roles
    from xtcache.tokenizer import load_tokenizer

    setup, _, _, parts, _ = rollouts
    tok = load_tokenizer(setup.student_model)
    rows = {}
    for key, row in _rows(parts).items():
        ids = _split_ids(tok, row["messages"][-1]["content"], row["sampled_ids"][-1:] * (row["stop_reason"] == "stop"))
        rows[key] = {**row, "sampled_ids": ids, "sampled_logprobs": [-0.25] * len(ids)}
    _write_rows(tmp_path / "parts", rows)
    store = _dump(setup, tmp_path / "parts", tmp_path / "cache")
    _, fp, totals, docs = _group(store, setup)
    assert totals["sampled_turns"] == totals["sampled_mismatch"] == totals["sampled_same_text"] == 8
    for key, row in rows.items():
        ids, roles, lp = docs[key]
        sampled = np.flatnonzero(np.isfinite(lp))
        assert ids[sampled].tolist() == row["sampled_ids"] and np.all(np.diff(sampled) == 1)
        assert np.array_equal(np.flatnonzero(trained_roles(roles, "last-assistant")), sampled)
    assert store_summary(str(store)).conversation[fp]["misaligned_chars"] == 0
    assert _cli("verify", store).returncode == 0
    _train(procs, setup, store, tmp_path / "run", "--is-cap", "2")
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) and r["chunks"] > 0 for r in train)


def test_a_same_tokenizer_rollout_cache_stores_and_trains_with_the_ratio(rollouts, procs, tmp_path):
    """Rollouts of a student with the teacher's tokenizer and template (the teacher model trains as that
    student): its alignment group is the identity, holds the sampled log-probs on the sampled tokens, and
    train-student --loss rkl-pg --is-cap 2 reads them (not the teacher arrays' tokens without them)."""
    from xtcache.chat.render import chat_fingerprint, trained_roles
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    setup, _, _, parts, _ = rollouts
    tok = load_tokenizer(str(setup.teacher_model))
    fp, im_end = chat_fingerprint(tok), tok.convert_tokens_to_ids("<|im_end|>")
    rows = {}
    for key, row in _rows(parts).items():
        ids = tok(row["messages"][-1]["content"], add_special_tokens=False)["input_ids"]
        ids += [im_end] * (row["stop_reason"] == "stop")
        rows[key] = {**row, "chat_fingerprint": fp, "sampled_ids": ids, "sampled_logprobs": [-0.25] * len(ids)}
    _write_rows(tmp_path / "parts", rows)
    store = _dump(setup, tmp_path / "parts", tmp_path / "cache", student=setup.teacher_model)
    reader = CacheReader(str(store))
    assert reader.alignment_groups()[fp].identity
    seen = 0
    for shard in reader.shards:
        al = reader.read_alignment(fp, shard.shard_id, verify=True)
        for d in range(len(al.doc_student_offsets) - 1):
            a, b = int(al.doc_student_offsets[d]), int(al.doc_student_offsets[d + 1])
            lp = al.sampled_logprobs[a:b]
            sampled = np.flatnonzero(np.isfinite(lp))
            assert np.array_equal(np.flatnonzero(trained_roles(al.student_role[a:b], "last-assistant")), sampled)
            assert al.student_ids[a:b][sampled].tolist() in [r["sampled_ids"] for r in rows.values()]
            seen += 1
    assert seen == len(rows) == 8
    _train(procs, setup, store, tmp_path / "run", "--is-cap", "2", student=setup.teacher_model)
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) for r in train)
    corpus = {f: v for f, v in rows[sorted(rows)[0]].items() if f not in ("sampled_ids", "sampled_logprobs",
                                                                          "chat_fingerprint")}
    _write_rows(tmp_path / "mixed", {**rows, ("corpus.jsonl", 0): corpus})  # the identity group refuses it too
    mixed = _dump(setup, tmp_path / "mixed", tmp_path / "mixed-cache", student=setup.teacher_model)
    refused = _train(procs, setup, mixed, tmp_path / "mixed-run", student=setup.teacher_model, check=False)
    assert refused.returncode != 0 and "1 of its 9 documents are no rollouts of it" in refused.stderr


def test_the_teacher_scores_the_ids_a_same_tokenizer_student_sampled(rollouts, tmp_path):
    """A student with the teacher's tokenizer and template samples its turns as other tokenizations than
    re-tokenizing gives (a word cut in two, a byte token that is no UTF-8, the text holding U+FFFD there). The
    teacher scores the sampled ids themselves: the stored teacher ids are the sampled ones, their log-probs are a
    forward of the teacher over those ids (computed here, apart from stage 1), and the identity group keeps
    the sampling log-probs there; a second, cross-tokenizer group of the same dump aligns against them, with
    the chunk over the teacher's replaced byte inexact, and `xtcache align` adding that group later to a store
    dumped for the sampling student alone finds the same chunks (also where the text holds a U+FFFD of its own,
    spelled in byte tokens). Conversations and text rollouts alike."""
    from stage1_teacher.onpolicy.splice import piece_bytes
    from tests.test_stage1_dump import hf_logprobs
    from xtcache.align.tokenizer import tokenizer_info
    from xtcache.chat.render import chat_fingerprint, trained_roles
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    setup, _, _, parts, _ = rollouts
    tok = load_tokenizer(str(setup.teacher_model))
    info = tokenizer_info(tok)
    fp, im_end = chat_fingerprint(tok), tok.convert_tokens_to_ids("<|im_end|>")
    lone = next(i for i in range(info.vocab_size) if piece_bytes(info, np.array([i])) == b"\xe2")  # a lead byte
    dot = tok(".", add_special_tokens=False)["input_ids"]
    convs, texts = {}, {}
    for j, (key, row) in enumerate(sorted(_rows(parts).items())[:4]):
        text = CLEAN[j]
        ids = _split_ids(tok, text, []) if j < 2 else tok(text[:-1], add_special_tokens=False)["input_ids"]
        if j >= 2:  # the last full stop sampled after a byte that is no UTF-8
            text, ids = text[:-1] + "\ufffd.", ids + [lone, *dot]
        assert ids != tok(text, add_special_tokens=False)["input_ids"]
        stop = [im_end] * (j % 2 == 0)
        convs[key] = {**row, "messages": [*row["messages"][:-1], {"role": "assistant", "content": text}],
                      "chat_fingerprint": fp, "sampled_ids": ids + stop, "stop_reason": "stop" if stop else "length",
                      "sampled_logprobs": [-0.25] * len(ids + stop)}
        prefix = "Offline teach" if j % 2 else "A note on caches. "
        texts[("t.jsonl", j)] = {"text": prefix + text, "prefix_chars": len(prefix), "chat_fingerprint": fp,
                                 "policy": "p", "sampled_ids": ids, "stop_reason": "length",
                                 "sampled_logprobs": [-0.25] * len(ids)}
    own = tok("\ufffd is a character too.", add_special_tokens=False)["input_ids"]  # the text's own U+FFFD, in bytes
    assert len(own) > len(tok(" is a character too.", add_special_tokens=False)["input_ids"]) + 1
    texts[("t.jsonl", 4)] = {**texts[("t.jsonl", 0)], "text": "Plain: \ufffd is a character too.", "prefix_chars": 7,
                             "sampled_ids": own, "sampled_logprobs": [-0.25] * len(own)}  # sampled as re-tokenized
    for kind, rows in (("chat", convs), ("text", texts)):
        _write_rows(tmp_path / kind, rows)
        store = tmp_path / f"{kind}-cache"
        _cli("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", setup.teacher_model,
             "--student-tokenizer", setup.student_model, "--data", f"{tmp_path / kind}/*.jsonl", "--out", store,
             "--engine", "hf")
        reader = CacheReader(str(store))
        group = fp if kind == "chat" else next(g for g, m in reader.alignment_groups().items() if m.identity)
        assert reader.alignment_groups()[group].identity
        cross = next(g for g, m in reader.alignment_groups().items() if not m.identity)
        seen = 0
        for shard in reader.shards:
            data, al = reader.read_shard(shard.shard_id, verify=True), reader.read_alignment(group, shard.shard_id)
            cal = reader.read_alignment(cross, shard.shard_id, verify=True)
            for d, meta in enumerate(shard.docs):
                row, doc, rec = rows[(meta.source, meta.row)], data.doc(d), al.record(d)
                want = row["sampled_ids"][:len(row["sampled_ids"]) - (row["stop_reason"] == "stop")]
                lp = rec.sampled_logprobs
                turn = np.flatnonzero(np.isfinite(lp))
                assert np.array_equal(rec.student_ids, doc.teacher_ids)  # the ids the teacher scored
                assert rec.student_ids[turn].tolist() == row["sampled_ids"], (kind, meta.row)
                assert np.array_equal(np.flatnonzero(trained_roles(rec.student_role, "last-assistant")),
                                      turn[:len(want) + (kind == "chat" and row["stop_reason"] == "stop")])
                ref = hf_logprobs(str(setup.teacher_model), doc.teacher_ids)[:-1]
                np.testing.assert_allclose(doc.realized_logprob[1:], ref[np.arange(len(ref)), doc.teacher_ids[1:]],
                                           rtol=2**-11, atol=1e-4)
                if lone in want:  # the cross group: the chunk over the teacher's replaced byte is not exact
                    c_al = cal.record(d).alignment
                    at = int(turn[0]) + want.index(lone)
                    assert not c_al.exact[int(np.searchsorted(np.asarray(c_al.teacher_end), at, side="right"))]
                seen += 1
        assert seen == len(rows)
        totals = {}
        for part in reader.alignment_parts(group).values():
            for k, v in part.conversation.items():
                totals[k] = totals.get(k, 0) + v
        assert (totals["sampled_turns"], totals["sampled_mismatch"], totals["sampled_same_text"]) == (len(rows), 4, 4)
        assert _cli("verify", store).returncode == 0
        alone = tmp_path / f"{kind}-alone"  # the sampling student alone, the cross group added by `xtcache align`
        _cli("teacher-dump", "--teacher", setup.teacher_model, "--student-tokenizer", setup.teacher_model,
             "--data", f"{tmp_path / kind}/*.jsonl", "--out", alone, "--engine", "hf")
        _cli("align", alone, "--student-tokenizer", setup.student_model, "--teacher-tokenizer", setup.teacher_model)
        assert _alignments(alone, cross) == _alignments(store, cross), kind


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


def test_offsets_of_sampled_ids_come_from_their_bytes():
    """A character split over byte tokens is covered by each of them, as a tokenizer's own offsets do."""
    from stage1_teacher.onpolicy.splice import byte_offsets

    text = "a\u00e9\u6771b"  # 1, 2 and 3 UTF-8 bytes, then 1
    got = byte_offsets(text, np.array([1, 1, 1, 2, 1, 1]))  # "a", e-acute in 1 + 1 bytes, the CJK in 2 + 1, "b"
    assert got.tolist() == [[0, 1], [1, 2], [1, 2], [2, 3], [2, 3], [3, 4]]


def test_a_turn_cut_by_max_new_tokens_does_not_train_its_end_marker_when_its_ids_were_retokenized():
    """A re-tokenized turn (its sampled ids spell it otherwise) keeps its content roles; its end-of-turn marker
    (a special added token) is trained after a `stop` and not after a `length` stop, which the student never
    wrote; sampled ids that are the stored ones keep their own rule (template tokens after them untrained)."""
    from schemas.roles import LAST_ASSISTANT, ROLE_ASSISTANT, ROLE_TEMPLATE, ROLE_USER
    from stage1_teacher.corpus.rows import Sampled
    from stage1_teacher.onpolicy.sampled import attach_sampled
    from xtcache.align.chunks import identity_alignment
    from xtcache.store import AlignmentRecord

    turn_role = ROLE_ASSISTANT | LAST_ASSISTANT
    ids = np.array([5, 6, 7, 20, 21, 22, 99, 8])  # 99: the end-of-turn marker, 8: template text after it
    roles = np.array([ROLE_USER, ROLE_USER, ROLE_TEMPLATE, turn_role, turn_role, turn_role, turn_role, ROLE_TEMPLATE],
                     dtype=np.uint8)
    record = AlignmentRecord(student_ids=ids, alignment=identity_alignment(len(ids)), student_role=roles)
    markers = np.array([99, 100])
    other = (30, 31)  # sampled ids that spell the turn another way: re-tokenized
    stop = attach_sampled(record, Sampled(other, (-1.0, -2.0), "fp", stop_reason="stop"), markers=markers)
    cut = attach_sampled(record, Sampled(other, (-1.0, -2.0), "fp", stop_reason="length"), markers=markers)
    assert stop.student_role.tolist() == roles.tolist()
    assert cut.student_role.tolist() == [*roles[:6].tolist(), ROLE_TEMPLATE, ROLE_TEMPLATE]
    assert np.isnan(cut.sampled_logprobs).all() and cut.stats["sampled_mismatch"] == 1
    same = attach_sampled(record, Sampled((20, 21, 22), (-1.0, -2.0, -3.0), "fp", stop_reason="length"),
                          markers=markers)
    assert same.student_role[6] == ROLE_TEMPLATE and same.sampled_logprobs[3:6].tolist() == [-1.0, -2.0, -3.0]


def test_text_rollouts_store_the_ids_the_student_read_and_sampled(rollouts, procs, tmp_path, caplog):
    """Text rollouts (a prefix and its completion, no template) whose sampled ids are not what re-tokenizing
    the whole text gives: a completion sampled as another tokenization, prefixes cut inside a word (the
    whole text's tokenization merges across the cut), a special token sampled inside, and a byte token that
    is no UTF-8 (the text holds U+FFFD there). The store holds the prefix as the tokenizer encodes it alone,
    then the sampled ids with their log-probs; the tokens whose bytes are not the text's sit in an inexact
    chunk (no KD), every other chunk of the completion is exact, and the special token trains nothing. A row
    whose ids spell other text keeps the re-tokenized ids and no log-probs; an empty completion (stopped at
    once) is not counted as re-tokenized."""
    from schemas.roles import LAST_ASSISTANT
    from stage1_teacher.onpolicy.splice import piece_bytes
    from xtcache.align.tokenizer import tokenizer_info
    from xtcache.chat.render import chat_fingerprint, trained_roles
    from xtcache.tokenizer import load_tokenizer

    setup = rollouts[0]
    tok = load_tokenizer(setup.student_model)
    info = tokenizer_info(tok)
    fp = chat_fingerprint(tok)
    cases = [("A note on caches. ", CLEAN[0], True), ("The cach", "e keeps every turn.", False),
             ("Offline teach", "ers score samples.", False), ("Students", " learn.", True)]
    rows = {}
    for j, (prefix, completion, split) in enumerate(cases):
        ids = _split_ids(tok, completion, []) if split else tok(completion, add_special_tokens=False)["input_ids"]
        assert ids != tok(prefix + completion, add_special_tokens=False)["input_ids"][-len(ids):] or split
        rows[("r.jsonl", j)] = {"text": prefix + completion, "prefix_chars": len(prefix), "sampled_ids": ids,
                                "sampled_logprobs": [-0.125] * len(ids), "chat_fingerprint": fp, "policy": "p",
                                "stop_reason": "length"}
    base = rows[("r.jsonl", 3)]
    rows[("r.jsonl", 4)] = {**base, "sampled_ids": [i + 1 for i in base["sampled_ids"]]}  # other ids: other text
    bos = tok.convert_tokens_to_ids("<s>")
    assert info.control[bos]
    with_bos = [bos, *base["sampled_ids"]]  # a special token sampled inside: the text leaves it out
    rows[("r.jsonl", 5)] = {**base, "sampled_ids": with_bos, "sampled_logprobs": [-0.125] * len(with_bos)}
    lone = next(i for i in range(info.vocab_size) if piece_bytes(info, np.array([i])) == b"\xe2")  # a lead byte
    words = tok(" learn", add_special_tokens=False)["input_ids"]
    dot = tok(".", add_special_tokens=False)["input_ids"]
    bad = [*words, lone, *dot]
    rows[("r.jsonl", 6)] = {**base, "text": "Students learn\ufffd.", "sampled_ids": bad,
                            "sampled_logprobs": [-0.125] * len(bad)}
    rows[("r.jsonl", 7)] = {**base, "text": "Students", "sampled_ids": [bos], "sampled_logprobs": [-0.5],
                            "stop_reason": "stop"}
    lead, cont = (next(i for i in range(info.vocab_size) if piece_bytes(info, np.array([i])) == b)
                  for b in (b"\xc3", b"\xa9"))  # the two bytes of e-acute, a special token sampled between them
    split = [*tok(" caf", add_special_tokens=False)["input_ids"], lead, bos, cont]
    rows[("r.jsonl", 8)] = {**base, "text": "Students caf\u00e9", "sampled_ids": split,
                            "sampled_logprobs": [-0.125] * len(split)}
    _write_rows(tmp_path / "parts", rows)
    store = _dump(setup, tmp_path / "parts", tmp_path / "cache")
    _, fp_store, totals, docs = _group(store, setup, text=True)
    for j in (0, 1, 2, 3, 5, 6, 8):
        prefix = cases[j][0] if j < 4 else "Students"
        ids, roles, lp = docs[("r.jsonl", j)]
        want = rows[("r.jsonl", j)]["sampled_ids"]
        head = tok(prefix, add_special_tokens=True)["input_ids"]
        assert ids.tolist() == head + want, j
        assert np.flatnonzero(np.isfinite(lp)).tolist() == list(range(len(head), len(head) + len(want)))
        assert np.all(lp[len(head):] == -0.125)
        trained = trained_roles(roles, "last-assistant")
        assert trained[len(head):].tolist() == [i != bos for i in want], j  # the special token: not trained
        assert not trained[:len(head)].any()
    ids, _, lp = docs[("r.jsonl", 4)]  # kept, on the re-tokenized ids, without log-probs
    assert ids.tolist() == tok(rows[("r.jsonl", 4)]["text"], add_special_tokens=True)["input_ids"]
    assert np.all(np.isnan(lp))
    ids, roles, lp = docs[("r.jsonl", 7)]  # stopped at once: the prefix, nothing of the turn
    assert ids.tolist() == tok("Students", add_special_tokens=True)["input_ids"] and np.all(np.isnan(lp))
    assert not (roles & LAST_ASSISTANT).any()
    # the chunks of the replaced byte's row: inexact exactly where a student token covers the U+FFFD
    al = _alignments(store, fp_store)[("r.jsonl", 6)]
    s_end = np.asarray(al.student_end)
    at = len(tok("Students", add_special_tokens=True)["input_ids"]) + len(words)  # the lone byte's index
    chunk = int(np.searchsorted(s_end, at, side="right"))
    assert not al.exact[chunk] and al.exact[chunk - 1] and al.exact[chunk + 1]
    al = _alignments(store, fp_store)[("r.jsonl", 8)]  # the special token inside e-acute: its chunk inexact
    at = len(tok("Students", add_special_tokens=True)["input_ids"]) + len(split) - 2
    assert not al.exact[int(np.searchsorted(np.asarray(al.student_end), at, side="right"))]
    assert totals["sampled_turns"] == 9 and totals["sampled_mismatch"] == 8 and totals["sampled_same_text"] == 7
    assert _cli("verify", store).returncode == 0
    assert ("sampled turns 9, whose sampled ids are not the re-tokenized ids 8 (spliced, trained on the sampled "
            "ids: 7; not spelling the turn's text, no sampling log-probs: 1)") in _cli("inspect", store).stdout
    # `xtcache rounds --loss rkl-pg` says, before train-student, that the turn trains without the ratio
    import logging

    from xtcache.app.rounds import RoundsConfig, check_sampled, round_dir

    def cfg(loss, *train_args):
        return RoundsConfig(student="S", teacher="T", prompts=["p.jsonl"], rounds=1, loss=loss, engine="hf",
                            workdir=str(tmp_path / "w"), train_on="last-assistant", train_args=list(train_args))

    round_dir(cfg("rkl-pg"), 0).mkdir(parents=True)
    (round_dir(cfg("rkl-pg"), 0) / "cache").symlink_to(store)
    for c, says in ((cfg("rkl-pg"), True), (cfg("rkl-pg", "--is-cap", "0"), False), (cfg("rkl-pg", "--is-cap=0.0"), False),
                    (cfg("forward"), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="xtcache.app.rounds"):
            check_sampled(c, 0)
        assert ("round 0: 1 of the 9 generated turns in" in caplog.text
                and "trains them without its importance ratio" in caplog.text) == says, caplog.text
    # and train-student trains the whole store with the ratio on (its 3 windows in one step: every row, the
    # re-tokenized one too)
    run = procs.cli("train-student", "--out", str(tmp_path / "run"), "--cache", str(store), "--student",
                    str(setup.student_model), "--seq-len", SEQ, "--micro-batch-size", "3", "--max-steps", "1",
                    "--loss", "rkl-pg", "--train-on", "last-assistant", "--zero-stage", "0", "--seed", "3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "train without the importance ratio (w = 1)" in run.stdout + run.stderr
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert len(train) == 1 and np.isfinite(train[0]["loss"]) and train[0]["sampled_labels"] > 0


def test_special_tokens_sampled_inside_a_turn_are_kept_where_they_were_sampled(rollouts, tmp_path):
    """A weak student samples `<s>` or `</s>` (added tokens marked special, which decoding with
    skip_special_tokens leaves out of the turn's text) inside its turn: the stored ids are still the sampled
    ids, each special one with an empty character span and the template role (no loss trains it), every one
    with its sampling log-prob, aligned exactly."""
    from xtcache.app.store_commands import store_summary
    from xtcache.tokenizer import load_tokenizer

    setup, _, _, parts, _ = rollouts
    tok = load_tokenizer(setup.student_model)
    bos, eos = tok.convert_tokens_to_ids(["<s>", "</s>"])
    assert bos not in tok.all_special_ids and tok.added_tokens_decoder[bos].special  # only marked special
    rows = _rows(parts)
    keys = sorted(rows)[:2]
    for j, key in enumerate(keys):
        ids = list(rows[key]["sampled_ids"])
        ids.insert(0 if j == 0 else len(ids) // 2, bos if j == 0 else eos)
        assert tok.decode(ids, skip_special_tokens=True) == tok.decode(rows[key]["sampled_ids"], skip_special_tokens=True)
        rows[key] = {**rows[key], "sampled_ids": ids, "sampled_logprobs": [-0.75] * len(ids)}
    _write_rows(tmp_path / "parts", rows)
    store = _dump(setup, tmp_path / "parts", tmp_path / "cache")
    _, fp, totals, docs = _group(store, setup)
    from xtcache.chat.render import trained_roles

    for key in keys:
        stored, roles, lp = docs[key]
        assert stored[np.isfinite(lp)].tolist() == rows[key]["sampled_ids"] and np.all(lp[np.isfinite(lp)] == -0.75)
        turn = np.flatnonzero(np.isfinite(lp))
        trained = trained_roles(roles, "last-assistant")[turn]
        inserted = np.isin(stored[turn], [bos, eos])
        assert inserted.sum() == 1 and not trained[inserted].any()  # kept where sampled, trained by no loss
        assert trained[~inserted][:-1].all()  # the rest of the turn trains (its last token: the stop, or cut)
    assert totals["sampled_same_text"] >= 2 and totals["sampled_mismatch"] == totals["sampled_same_text"]
    assert store_summary(str(store)).conversation[fp]["misaligned_chars"] == 0
    assert _cli("verify", store).returncode == 0


def test_a_text_rollout_with_an_id_past_the_vocabulary_keeps_the_re_tokenized_ids(student_tokenizer):
    """A sampled stop id outside the tokenizer (an lm_head padded past it) is no id of this student: nothing is
    spliced, and it is not looked up (it used to index the special-id mask first: IndexError)."""
    from types import SimpleNamespace

    from stage1_teacher.corpus.rows import Sampled
    from stage1_teacher.onpolicy.splice import text_splice
    from xtcache.align.tokenizer import encode_with_offsets, tokenizer_info

    tok, info = student_tokenizer, tokenizer_info(student_tokenizer)
    prefix, completion = "The cache stores ", "ids and log-probs."
    body = tok(completion, add_special_tokens=False)["input_ids"]
    ids, offsets = encode_with_offsets(tok, prefix + completion, add_special_tokens=True, side="student tokenizer")
    student = SimpleNamespace(tokenizer=tok, info=info, appended=0)
    for stop in (info.vocab_size, info.vocab_size + 5):
        sampled = Sampled(ids=(*body, stop), logprobs=(-0.1,) * (len(body) + 1), chat="c", stop_reason="stop")
        assert text_splice(student, prefix + completion, len(prefix), sampled, ids, offsets) is None
