"""Conversations: each model renders in its own chat template; renderings aligned; roles drive the masks.

Templates in the style of ChatML (with thinking and tool calls), Llama-3 headers, Gemma turns and
Mistral [INST] are put on the toy tokenizers (`xtcache.testing.chat`). The end-to-end test runs
stage 1 (`teacher-dump --engine hf`) on a chat JSONL with tool calls and thinking, adds a student
with a third template through `xtcache align`, trains it with `--train-on assistant`, and checks
from the loader's own batches that no KD or CE position falls outside assistant turns.

    pytest -q tests/test_chat.py
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.roles import LAST_ASSISTANT, ROLE_ASSISTANT
from tests.commands import xtcache
from xtcache.chat.check import misaligned_chars
from xtcache.chat.layout import align_conversations
from xtcache.chat.render import render, renderings
from xtcache.chat.spans import shared_pieces
from xtcache.testing.chat import FAMILIES, chat_corpus, chat_tokenizer, write_chat_jsonl
from xtcache.testing.suite import REPO


@pytest.fixture(scope="module")
def chat_toks(toy_setup, tmp_path_factory):
    """Every family on both toy tokenizers: {(family, 'teacher'|'student'): (dir, tokenizer)}."""
    root = tmp_path_factory.mktemp("chat_toks")
    out = {}
    for fam in FAMILIES:
        for side, base in (("teacher", toy_setup.teacher_tokenizer), ("student", toy_setup.student_tokenizer)):
            d = root / f"{fam}-{side}"
            out[(fam, side)] = (d, chat_tokenizer(base, fam, d))
    return out


def _no_tools(convs):
    out = []
    for c in convs:
        msgs = [m for m in c["messages"] if m["role"] != "tool" and not m.get("tool_calls")]
        out.append({"messages": msgs})
    return out


def _aligned(s_tok, t_tok, convs):
    ss = renderings(s_tok, [render(s_tok, c) for c in convs], convs)
    ts = renderings(t_tok, [render(t_tok, c) for c in convs], convs)
    return ss, ts, align_conversations(convs, ss, ts)


def _check_exact_cover(conv, s, t, ca):
    """Every shared content character (outside tokens that straddle a piece boundary) lies in exactly
    one exact chunk on each side, the same chunk on both sides."""
    a = ca.alignment
    chunk_of = []
    for r, ends in ((s, a.student_end), (t, a.teacher_end)):
        cover = np.zeros(len(r.text), dtype=np.int64)
        owner = np.full(len(r.text), -1, dtype=np.int64)
        begin = np.concatenate(([0], ends[:-1]))
        for c in np.flatnonzero(a.exact):
            if ends[c] > begin[c]:
                lo, hi = r.offsets[begin[c], 0], r.offsets[ends[c] - 1, 1]
                cover[lo:hi] += 1
                owner[lo:hi] = c
        chunk_of.append((cover, owner))
    checked = 0
    for p, q in shared_pieces(s.located, t.located):
        for r, piece, k in ((s, p, 0), (t, q, 1)):
            inside = (r.offsets[:, 0] >= piece.start) & (r.offsets[:, 1] <= piece.end)
            straddle = ~inside & (r.offsets[:, 0] < piece.end) & (r.offsets[:, 1] > piece.start)
            for i in np.flatnonzero(straddle):
                chunk_of[k][1][max(r.offsets[i, 0], piece.start):min(r.offsets[i, 1], piece.end)] = -2
        for i in range(piece.end - piece.start):
            cs, ct = chunk_of[0][1][p.start + i], chunk_of[1][1][q.start + i]
            if cs == -2 or ct == -2:
                continue
            assert chunk_of[0][0][p.start + i] == 1 and chunk_of[1][0][q.start + i] == 1
            assert cs == ct >= 0, (conv, i, cs, ct)
            checked += 1
    return checked


PAIRS = [("chatml-thinking", "llama3"), ("llama3", "gemma"), ("gemma", "mistral"), ("chatml", "chatml-thinking"),
         ("mistral", "llama3")]


@pytest.mark.parametrize("teacher_family,student_family", PAIRS)
def test_families_align_content_exactly_and_pair_turn_ends(chat_toks, teacher_family, student_family):
    convs = chat_corpus(12, seed=3)
    if "mistral" in (teacher_family, student_family):
        convs = _no_tools(convs)
    _, t_tok = chat_toks[(teacher_family, "teacher")]
    _, s_tok = chat_toks[(student_family, "student")]
    ss, ts, out = _aligned(s_tok, t_tok, convs)
    checked = 0
    for conv, s, t, ca in zip(convs, ss, ts, out):
        assert ca.stats["misaligned_chars"] == 0
        assert ca.stats["shared_chars"] > 0.5 * ca.stats["content_chars"]
        checked += _check_exact_cover(conv, s, t, ca)
        a = ca.alignment
        # each end-of-turn pair is one exact 1:1 chunk of the two templates' markers
        begin_s, begin_t = np.concatenate(([0], a.student_end[:-1])), np.concatenate(([0], a.teacher_end[:-1]))
        pairs = [(s.ids[b], t.ids[e]) for b, e, bs, et in zip(begin_s, begin_t, a.student_end, a.teacher_end)
                 if bs - b == 1 and et - e == 1 and s.markers[b] and t.markers[e]]
        assert pairs and all(x for x in pairs)
        roles = ca.student_role
        assert roles.shape == s.ids.shape
        last = np.flatnonzero((roles & LAST_ASSISTANT) != 0)
        assert last.size and np.all((roles[last] & 0x7F) == ROLE_ASSISTANT)
        assert s.markers[last[-1]]  # the final assistant turn ends with its marker, trained
    assert checked > 1000


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_shared_character_is_in_one_exact_chunk_on_both_sides(chat_toks, data):
    text = st.text(alphabet=st.sampled_from(list("ab c1 23\n\té東 .?!-x")), min_size=1, max_size=40)
    n = data.draw(st.integers(1, 4))
    msgs = []
    if data.draw(st.booleans()):
        msgs.append({"role": "system", "content": data.draw(text)})
    for _ in range(n):
        msgs.append({"role": "user", "content": data.draw(text)})
        msgs.append({"role": "assistant", "content": data.draw(text)})
    conv = {"messages": msgs}
    t_fam, s_fam = data.draw(st.sampled_from(PAIRS))
    _, t_tok = chat_toks[(t_fam, "teacher")]
    _, s_tok = chat_toks[(s_fam, "student")]
    ss, ts, out = _aligned(s_tok, t_tok, [conv])
    assert out[0].stats["misaligned_chars"] == 0
    _check_exact_cover(conv, ss[0], ts[0], out[0])
    # the chunks cover both token sequences completely, in order
    a = out[0].alignment
    assert a.student_end[-1] == len(ss[0].ids) and a.teacher_end[-1] == len(ts[0].ids)
    assert np.all(np.diff(a.student_end) >= 0) and np.all(np.diff(a.teacher_end) >= 0)


def test_a_batch_and_its_parts_align_alike(chat_toks):
    """A batch's Renderings hold each conversation's tokens as its own rendering would, and aligning a
    subset taken from the batch (as stage 1 does after skipping rows) equals aligning those rows alone."""
    convs = chat_corpus(9, seed=5)
    _, t_tok = chat_toks[("chatml-thinking", "teacher")]
    _, s_tok = chat_toks[("llama3", "student")]
    ss, ts, out = _aligned(s_tok, t_tok, convs)
    for k, (conv, r) in enumerate(zip(convs, ss)):
        alone = renderings(s_tok, [render(s_tok, conv)], [conv])
        assert np.array_equal(r.ids, alone.ids) and np.array_equal(r.offsets, alone.offsets)
        assert r.text == ss[k].text and np.array_equal(r.ids, ss[k].ids)
    rows = [7, 2, 4]
    part = align_conversations([convs[i] for i in rows], ss.take(rows), ts.take(rows))
    _, _, alone = _aligned(s_tok, t_tok, [convs[i] for i in rows])
    for i, a, b in zip(rows, part, alone):
        assert a.alignment == b.alignment == out[i].alignment
        assert np.array_equal(a.student_role, b.student_role) and a.stats == b.stats


def test_misaligned_count_sees_a_shifted_alignment(chat_toks):
    convs = _no_tools(chat_corpus(4, seed=1))
    _, t_tok = chat_toks[("chatml", "teacher")]
    _, s_tok = chat_toks[("llama3", "student")]
    ss, ts, out = _aligned(s_tok, t_tok, convs)
    a = out[0].alignment
    wrong = np.flatnonzero(a.exact[:-2] & (np.diff(a.teacher_end)[:-1] > 0))[len(a.exact) // 3]
    shifted = dataclasses.replace(a, teacher_end=a.teacher_end.copy())
    shifted.teacher_end[wrong] += 1  # one teacher token moves to the wrong chunk
    bad = [shifted] + [o.alignment for o in out[1:]]
    assert np.all(misaligned_chars([o.alignment for o in out], ss, ts) == 0)
    counts = misaligned_chars(bad, ss, ts)
    assert counts[0] > 0 and np.all(counts[1:] == 0)


def test_trimming_template_counts_unaligned_characters(chat_toks):
    conv = {"messages": [{"role": "user", "content": "  hello there  "},
                         {"role": "assistant", "content": "fine\n", "reasoning_content": "think a bit"}]}
    _, t_tok = chat_toks[("chatml-thinking", "teacher")]
    _, s_tok = chat_toks[("llama3", "student")]
    ss, ts, out = _aligned(s_tok, t_tok, [conv])
    st_ = out[0].stats
    # llama3 trims both contents (4 + 1 characters) and drops the reasoning (11)
    assert st_["content_chars"] == 15 + 5 + 11 and st_["unaligned_chars"] == 4 + 1 + 11
    assert st_["unaligned_spans"] == 3 and st_["misaligned_chars"] == 0


def test_corpus_reads_conversations_from_jsonl_parquet_and_arrow(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stage1_teacher.corpus import Skipped, detect_messages_field, iter_corpus

    rows = _no_tools(chat_corpus(5, seed=2))
    rows[1]["tools"] = json.dumps([{"type": "function", "function": {"name": "f"}}])
    write_chat_jsonl(tmp_path / "c.jsonl", rows + [{"messages": "nope"}, {"text": "plain"}])
    table = pa.table({"messages": [r["messages"] for r in rows], "tools": [r.get("tools") for r in rows]})
    pq.write_table(table, tmp_path / "c.parquet")
    with pa.OSFile(str(tmp_path / "c.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    for path in ("c.jsonl", "c.parquet", "c.arrow"):
        url = str(tmp_path / path)
        assert detect_messages_field(url, "text") == "messages"
        got = list(iter_corpus([url], messages_field="messages"))
        docs = [d for d in got if not isinstance(d, Skipped)]
        assert [json.loads(d.text)["messages"] for d in docs] == [r["messages"] for r in rows]
        assert all(d.conversation for d in docs)
        assert json.loads(docs[1].text)["tools"] == [{"type": "function", "function": {"name": "f"}}]
        if path == "c.jsonl":
            assert [s.reason for s in got if isinstance(s, Skipped)] == ["messages field is not a list",
                                                                         "missing messages field"]


# ------------------------------------------------------------------------------------- end to end


def _cli(*args, ok=True):
    """`xtcache ARGS` in this process (`tests.commands.xtcache`)."""
    proc = xtcache(*args)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def chat_run(toy_setup, chat_toks, procs, tmp_path_factory):
    """A chat JSONL with tool calls and thinking -> teacher-dump (ChatML teacher, Llama-3 student) ->
    align (a Gemma-template student). The warm process server (`procs`) imports meanwhile."""
    from xtcache.testing.toy import build_tiny_model

    root = tmp_path_factory.mktemp("chat_run")
    t_dir, _ = chat_toks[("chatml-thinking", "teacher")]
    s_dir, _ = chat_toks[("llama3", "student")]
    g_dir, _ = chat_toks[("gemma", "student")]
    build_tiny_model("qwen2", t_dir, root / "teacher", hidden=64, layers=1)
    build_tiny_model("llama", g_dir, root / "student", hidden=64, layers=1)
    data = write_chat_jsonl(root / "chat.jsonl", chat_corpus(40, seed=5) + [{"messages": []}])
    store = root / "store"
    dump = _cli("teacher-dump", "--teacher", root / "teacher", "--student-tokenizer", s_dir, "--data", data,
                "--out", store, "--engine", "hf", "--top-k", "8", "--docs-per-part", "16", "--max-seq-len", "256")
    _cli("align", store, "--student-tokenizer", g_dir)
    return {"root": root, "store": store, "teacher_tok": t_dir, "student_tok": s_dir, "third_tok": g_dir,
            "dump": dump.stdout + dump.stderr}


def test_chat_corpus_through_dump_and_align_has_no_misaligned_characters(chat_run):
    from xtcache.app.store_commands import store_summary
    from xtcache.chat.render import chat_fingerprint
    from xtcache.store import CacheReader
    from xtcache.tokenizer import load_tokenizer

    assert "empty conversation: 1" in chat_run["dump"]
    r = CacheReader(str(chat_run["store"]))
    from xtcache.store import FORMAT_VERSION

    assert r.manifest.conversation and r.manifest.format_version == FORMAT_VERSION and r.is_complete()
    summary = store_summary(str(chat_run["store"]))
    third = chat_fingerprint(load_tokenizer(str(chat_run["third_tok"])))
    assert set(summary.conversation) == {chat_fingerprint(load_tokenizer(str(chat_run["student_tok"]))), third}
    for c in summary.conversation.values():
        assert c["misaligned_chars"] == 0 and c["content_chars"] > 0
        assert c["role_assistant"] > 0 and c["role_template"] > 0
        assert 0 < c["trained_share"]["last-assistant"] < c["trained_share"]["assistant"] < 1
    shard = r.read_shard(r.shards[0].shard_id)
    conv = json.loads(shard.conversations[0])
    assert shard.texts[0] == render(load_tokenizer(str(chat_run["teacher_tok"])), conv)
    out = _cli("inspect", chat_run["store"]).stdout
    assert "misaligned chars" in out and "trained share" in out
    _cli("verify", chat_run["store"])  # every array of every part and group, checks on


def test_align_needs_the_teacher_template_to_locate_messages(chat_run):
    """`xtcache align` locates a conversation store's messages by rendering them again in the
    teacher's template: without the teacher tokenizer, or with another template, it refuses."""
    from stage1_teacher.align_cmd import align_store
    from xtcache.errors import StoreError
    from xtcache.tokenizer import load_tokenizer

    with pytest.raises(StoreError, match="--teacher-tokenizer .* .it was not found"):
        align_store(str(chat_run["store"]), str(chat_run["third_tok"]), teacher_tok=None)
    with pytest.raises(StoreError, match="its chat template is not the store's"):
        align_store(str(chat_run["store"]), str(chat_run["third_tok"]),
                    teacher_tok=load_tokenizer(str(chat_run["student_tok"])))


@pytest.mark.parametrize("train_on", ["assistant", "last-assistant", "all"])
def test_loader_masks_keep_kd_and_ce_inside_the_trained_turns(chat_run, train_on):
    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset
    from xtcache.chat.render import trained_roles
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(str(chat_run["third_tok"]))
    ds = CacheDataset(str(chat_run["store"]), tok, LoaderConfig(seq_len=96, micro_batch_size=2, train_on=train_on),
                      shard_cache=1000)
    seen_ce = seen_kd = 0
    shard_ids = ds.caches[0].shard_ids
    for i in range(len(shard_ids)):
        src = ds.source(0, i)
        roles = ds._readers[0].read_alignment(ds.fingerprint, shard_ids[i]).student_role
        # the same batches with every student id replaced by its role code
        ds._cache[(0, i)] = dataclasses.replace(src, student_ids=roles.astype(np.int32))
    for j in range(ds.batches_per_epoch):
        b = ds.micro_batch(0, j)
        nxt = np.concatenate([b["input_ids"][:, 1:], np.zeros((b["input_ids"].shape[0], 1), np.int64)], axis=1)
        ce = b["labels"] != -100
        kd = b["student_chunk"] >= 0
        assert np.all(trained_roles(b["labels"][ce].astype(np.uint8), train_on))
        assert np.all(trained_roles(nxt[kd].astype(np.uint8), train_on))
        seen_ce, seen_kd = seen_ce + int(ce.sum()), seen_kd + int(kd.sum())
    assert seen_ce > 0 and seen_kd > 0


def test_train_student_on_assistant_turns(chat_run, procs, tmp_path):
    """`python -m stage2_student` in a process of its own (forked from the warm server; it asserts exit code 0)."""
    train = procs.run(tmp_path / "run", "--cache", str(chat_run["store"]), "--student", str(chat_run["root"] / "student"),
                      "--seq-len", "96", "--micro-batch-size", "2", "--max-steps", "3", "--loss", "alm", "--train-on",
                      "assistant", "--zero-stage", "0")["train"]
    assert len(train) == 3 and all(np.isfinite(r["loss"]) for r in train)


def test_plain_text_cache_refuses_train_on_assistant(toy_setup, tmp_path):
    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset
    from xtcache.errors import ConfigError
    from xtcache.testing.caches import build_hf_cache

    url = build_hf_cache(tmp_path / "plain", toy_setup.teacher_model, toy_setup.train_jsonl,
                         [toy_setup.student_tokenizer], max_docs=4)
    with pytest.raises(ConfigError, match="--train-on assistant: the cache .* holds plain text"):
        CacheDataset(url, str(toy_setup.student_tokenizer), LoaderConfig(seq_len=64, micro_batch_size=1, train_on="assistant"))


def test_tokenizer_without_template_and_rejected_rows(chat_run, chat_toks, toy_setup, procs, tmp_path):
    """The refusal runs in this process; the dump that warns runs as a process of its own (forked from the
    warm server), whose stderr carries the command line's log as a shell sees it."""
    data = chat_run["root"] / "chat.jsonl"
    proc = _cli("teacher-dump", "--teacher", chat_run["root"] / "teacher", "--student-tokenizer",
                toy_setup.student_tokenizer, "--data", data, "--out", tmp_path / "s", "--engine", "hf", ok=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "has no chat template" in lines[-1] and "Traceback" not in proc.stderr
    # a template that rejects tool turns: those rows are counted skips, named in a warning
    m_dir, _ = chat_toks[("mistral", "student")]
    proc = procs.cli("teacher-dump", "--teacher", str(chat_run["root"] / "teacher"), "--student-tokenizer", str(m_dir),
                     "--data", str(data), "--out", str(tmp_path / "m"), "--engine", "hf", "--top-k", "4",
                     "--max-seq-len", "256")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "chat template rejected the row: 14" in proc.stdout + proc.stderr
    assert "row 0 of chat.jsonl (student template" in proc.stderr


def test_the_documented_example_is_what_the_code_renders(chat_toks):
    from xtcache.testing.chat import DOC_BEGIN, DOC_END, doc_example

    doc = (REPO / "docs" / "conversations.md").read_text(encoding="utf-8")
    shown = doc[doc.index(DOC_BEGIN):doc.index(DOC_END) + len(DOC_END)]
    assert shown == doc_example(chat_toks[("chatml-thinking", "teacher")][1], chat_toks[("llama3", "student")][1])


def test_same_tokenizer_and_template_is_the_identity_with_roles(chat_toks):
    from stage1_teacher.corpus import Document
    from stage1_teacher.prep import Preparer, StudentSide
    from xtcache.chat.render import chat_fingerprint, conversation_json

    _, tok = chat_toks[("chatml-thinking", "teacher")]
    _, other = chat_toks[("chatml", "teacher")]  # the same tokenizer.json, another template: not the identity
    fp, fp_other = chat_fingerprint(tok), chat_fingerprint(other)
    assert fp != fp_other
    prep = Preparer(tok, [StudentSide("same", tok, fp, True), StudentSide("other", other, fp_other, False)],
                    window_len=512, overlap=0, conversation=True)
    convs = chat_corpus(6, seed=4)
    out = prep.prepare([Document("c.jsonl", i, conversation_json(c), conversation=True) for i, c in enumerate(convs)])
    for pd, conv in zip(out, convs):
        assert pd.doc.text == render(tok, conv) and json.loads(pd.conversation)["messages"] == conv["messages"]
        same = pd.alignments[fp]
        assert np.array_equal(same.student_ids, pd.teacher_ids)
        assert np.all(np.diff(same.alignment.student_end, prepend=0) == 1) and same.alignment.exact.all()
        assert np.any((same.student_role & 0x7F) == ROLE_ASSISTANT)
        assert pd.alignments[fp_other].stats["misaligned_chars"] == 0


@pytest.mark.parametrize("group,array", [("shards", "doc_conversation"), ("align", "student_role")])
def test_a_flipped_bit_in_a_conversation_array_is_named(chat_run, tmp_path, group, array):
    """The conversation arrays are checked like every other array: verify and the trainer's loader name them."""
    import shutil

    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset, student_fingerprint
    from xtcache.app.store_commands import verify_store
    from xtcache.errors import XtcacheError
    from xtcache.tokenizer import load_tokenizer

    root = tmp_path / "cache"
    shutil.copytree(chat_run["store"], root)
    tok = load_tokenizer(str(chat_run["third_tok"]))
    where = f"align/{student_fingerprint(tok, chat=True)}" if group == "align" else group
    (path,) = sorted(p for p in root.glob(f"{where}/**/{array}/c/**/*") if p.is_file())[:1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    problems = verify_store(str(root), stop_first=False)
    assert any(repr(array) in p and "damaged" in p for p in problems), problems
    with pytest.raises(XtcacheError, match=f"'{array}'.*damaged|damaged.*'{array}'"):
        ds = CacheDataset(str(root), tok, LoaderConfig(seq_len=96, micro_batch_size=2), shard_cache=1000)
        for ci, cache in enumerate(ds.caches):
            for i in range(len(cache.shard_ids)):
                ds.source(ci, i)


def test_turn_openers_are_the_structures_the_student_template_does_not_open_alike(chat_toks):
    """ChatML with thinking writes a reasoning block (`<think>` in text) and a tool call (`\\n<tool_call>`) at the
    start of an assistant turn; Llama-3's template drops reasoning and writes a tool call as JSON (`{`): the
    teacher's `<` and newline are openers for a Llama-3 student, none for a student of the same template."""
    from xtcache.chat.render import turn_openers

    _, chatml = chat_toks[("chatml-thinking", "teacher")]
    _, llama = chat_toks[("llama3", "student")]
    _, chatml_student = chat_toks[("chatml-thinking", "student")]
    ids = chatml.convert_tokens_to_ids
    assert turn_openers(chatml, llama) == {"reasoning": ids("<"), "tool call": ids("Ċ")}
    assert turn_openers(chatml, chatml_student) == {}  # another tokenizer, the same template: it opens them alike
    assert turn_openers(llama, chatml) == {"tool call": llama.convert_tokens_to_ids("{")}
    _, chatml_plain = chat_toks[("chatml", "teacher")]
    assert turn_openers(chatml_plain, llama) == {}  # it writes neither (an empty turn with a tool call just ends)


def test_each_trained_turns_first_row_trains_ce_only_where_the_teacher_template_opens_a_structure(chat_run):
    """The loader's batches for a Llama-3 student of a ChatML-with-thinking store against the same batches with no
    turn opener known: the KD positions that predict a trained turn's first token (by the tokens' roles) are
    gone, with their CE labels kept; every other KD position keeps its teacher rows."""
    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset
    from xtcache.tokenizer import load_tokenizer

    tok = load_tokenizer(str(chat_run["student_tok"]))
    cfg = LoaderConfig(seq_len=96, micro_batch_size=2, train_on="assistant")
    ds = CacheDataset(str(chat_run["store"]), tok, cfg, shard_cache=1000)
    assert ds.caches[0].turn_openers  # ChatML with thinking against Llama-3 (the test above)
    plain = CacheDataset(str(chat_run["store"]), tok, cfg, shard_cache=1000)
    plain.caches = [dataclasses.replace(c, turn_openers=()) for c in plain.caches]
    starts_seen = kept = 0
    for j in range(ds.batches_per_epoch):
        b0, b1 = _with_roles(plain).micro_batch(0, j), _with_roles(ds).micro_batch(0, j)
        for key in ("input_ids", "labels", "attention_mask"):
            assert np.array_equal(b0[key], b1[key]), key
        starts = _turn_starts_at(b0)
        starts_seen += int(starts.sum())
        assert np.all(b0["student_chunk"][starts] >= 0) and np.all(b1["student_chunk"][starts] < 0)
        assert np.all(b1["labels"][starts] != -100)  # CE still trains the turn's first token
        rest = (b0["student_chunk"] >= 0) & ~np.isin(b0["student_chunk"], b0["student_chunk"][starts])
        assert np.array_equal(b1["student_chunk"] >= 0, rest)
        for c0, c1 in zip(b0["student_chunk"][rest], b1["student_chunk"][rest]):
            r0, r1 = np.flatnonzero(b0["teacher_chunk"] == c0), np.flatnonzero(b1["teacher_chunk"] == c1)
            for key in ("teacher_ids", "teacher_logprobs", "teacher_residual"):
                assert np.array_equal(b0[key][r0], b1[key][r1]), key
            kept += 1
    assert starts_seen > 10 and kept > 100


def test_a_stores_teacher_tokenizer_loads_once_per_content_in_a_process(chat_run, chat_toks, tmp_path, monkeypatch):
    """A run opens several datasets over stores of one teacher (the training split, the held-out one, a corpus
    cache): the turn-opener probe loads that teacher's tokenizer once. A store whose tokenizer files were edited
    since (here: the template without thinking, which opens nothing a Llama-3 student cannot) is loaded anew."""
    import shutil
    from collections import OrderedDict

    import xtcache.store.tokenizer as store_tokenizer
    from stage2_student.config import LoaderConfig
    from stage2_student.loader import CacheDataset
    from xtcache.tokenizer import load_tokenizer

    loads, real = [], store_tokenizer.load_tokenizer
    monkeypatch.setattr(store_tokenizer, "_LOADED", OrderedDict())  # what earlier tests loaded is not counted
    monkeypatch.setattr(store_tokenizer, "load_tokenizer", lambda path, side: loads.append(side) or real(path, side))
    tok = load_tokenizer(str(chat_run["student_tok"]))
    cfg = LoaderConfig(seq_len=96, micro_batch_size=2, train_on="assistant")
    other = tmp_path / "other"  # another store of the same teacher
    shutil.copytree(chat_run["store"], other)
    openers = [CacheDataset(str(url), tok, cfg, shard_cache=1000).caches[0].turn_openers
               for url in (chat_run["store"], chat_run["store"], other)]
    assert openers[0] and openers == [openers[0]] * 3
    assert len(loads) == 1, loads
    plain_dir, _ = chat_toks[("chatml", "teacher")]
    for f in (other / "teacher_tokenizer").iterdir():
        if f.name != "tokenizer.json" and (plain_dir / f.name).is_file():
            f.write_bytes((plain_dir / f.name).read_bytes())
    assert CacheDataset(str(other), tok, cfg, shard_cache=1000).caches[0].turn_openers == ()
    assert len(loads) == 2, loads


def _with_roles(ds):
    """`ds` with each source's student ids replaced by the tokens' role codes (its batches' input_ids say roles)."""
    for i, sid in enumerate(ds.caches[0].shard_ids):
        if (0, i) not in ds._cache or ds._cache[(0, i)].student_ids.dtype != np.uint8:
            src = ds.source(0, i)
            roles = ds._readers[0].read_alignment(ds.fingerprint, sid).student_role
            ds._cache[(0, i)] = dataclasses.replace(src, student_ids=roles.astype(np.uint8))
    return ds


def _turn_starts_at(batch) -> np.ndarray:
    """[B, L] the KD positions that predict a turn's first trained token: by the tokens' roles (input_ids hold role
    codes), the predicted token is trained and the token at the position is not."""
    from xtcache.chat.render import trained_roles

    sc, roles = batch["student_chunk"], batch["input_ids"].astype(np.uint8)
    trained = trained_roles(roles.ravel(), "assistant").reshape(roles.shape)
    at = np.zeros_like(sc, dtype=bool)
    at[:, :-1] = (sc[:, :-1] >= 0) & trained[:, 1:] & ~trained[:, :-1]
    return at
