"""Chunk alignment: hand-made offsets, the toy tokenizers, a SentencePiece-style tokenizer, bad input.

Property tests (hypothesis) draw random Unicode text (emoji, CJK, combining marks, whitespace runs,
digits, mixed scripts) and check, with each tokenizer's own `decode`, that chunks partition both
token sequences and that every exact chunk spells the same text on both sides.

    pytest -x -q tests/test_align.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtcache.align.chunks import (
    Alignment,
    align_batch,
    align_offsets,
    align_text,
    align_texts,
    alignment_stats,
    identity_alignment,
)
from xtcache.align.tokenizer import encode_with_offsets, tokenizer_info
from xtcache.errors import AlignmentError, XtcacheError

PIECES = ["a", "Z", "é", "ß", "ñ", "ж", "Ω", "ا", "ب", "中", "文", "字", "日本", "😀", "👍🏽", "🇫🇷", "\u0301",
          "\u0308", "e\u0301", "0", "7", "123", "4567", "3.14", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n",
          "\u00a0", "\u3000", "def ", "return", "(", ")", ":", "_x", "ĠĠ", "▁", "<", ">", "'", '"', "ﬁ"]
TEXTS = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=30).map("".join),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=40),
)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_partition(a: Alignment, n_student: int, n_teacher: int) -> None:
    assert a.student_end.dtype == np.int32 and a.teacher_end.dtype == np.int32 and a.exact.dtype == bool
    assert a.student_end.shape == a.teacher_end.shape == a.exact.shape
    for ends, n in ((a.student_end, n_student), (a.teacher_end, n_teacher)):
        assert np.all(np.diff(ends, prepend=0) >= 0)
        assert (int(ends[-1]) if ends.size else 0) == n
    sizes = np.diff(a.student_end, prepend=0) + np.diff(a.teacher_end, prepend=0)
    assert np.all(sizes > 0), "no chunk may be empty on both sides"


def decoded_chunks(tok, ids, ends) -> list[str]:
    """Each chunk's text by prefix decoding (works for byte-level and SentencePiece decoders)."""
    prev, out = "", []
    for end in ends.tolist():
        cur = tok.decode(ids[:end].tolist(), skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert cur.startswith(prev)
        out.append(cur[len(prev):])
        prev = cur
    return out


def check_exact_chunks(text, s_tok, t_tok, s_ids, t_ids, a: Alignment, *, strip_first_space=False) -> None:
    s_text = decoded_chunks(s_tok, s_ids, a.student_end)
    t_text = decoded_chunks(t_tok, t_ids, a.teacher_end)
    begin = np.concatenate(([0], a.char_end[:-1]))
    for c in np.flatnonzero(a.exact):
        want = text[begin[c]:a.char_end[c]]
        allowed = {want}
        if strip_first_space and begin[c] == 0 and want.startswith(" "):
            allowed.add(want[1:])  # some SentencePiece decoders drop a text-initial space by design
        if (a.student_end[c] - (a.student_end[c - 1] if c else 0)) > 0 and want:
            assert s_text[c] in allowed, (c, s_text[c], want)
            assert t_text[c] == want, (c, t_text[c], want)


# --- hand-made offsets -------------------------------------------------------------------------

def test_two_pointer_walk_on_plain_offsets():
    text = "hello world"
    s_off = [(0, 5), (5, 11)]
    t_off = [(0, 2), (2, 5), (5, 6), (6, 11)]
    a = align_offsets(text, [1, 2], s_off, [1, 2, 3, 4], t_off)
    assert a.student_end.tolist() == [1, 2] and a.teacher_end.tolist() == [2, 4]
    assert a.exact.tolist() == [True, True] and a.char_end.tolist() == [5, 11]


def test_gap_on_one_side_gets_its_own_inexact_chunk():
    # teacher drops the space: the student's space token stands alone with an empty teacher side
    a = align_offsets("ab c", [1, 2, 3], [(0, 2), (2, 3), (3, 4)], [1, 2], [(0, 2), (3, 4)])
    assert a.student_end.tolist() == [1, 2, 3] and a.teacher_end.tolist() == [1, 1, 2]
    assert a.exact.tolist() == [True, False, True]


def test_overlapping_byte_tokens_are_absorbed():
    # one emoji split into 4 byte tokens on one side, 2 on the other, all with the same span
    a = align_offsets("x😀", [1, 2, 2, 2, 2], [(0, 1)] + [(1, 2)] * 4, [1, 3, 3], [(0, 1), (1, 2), (1, 2)])
    assert a.student_end.tolist() == [1, 5] and a.teacher_end.tolist() == [1, 3]
    assert a.exact.all()


def test_specials_pair_by_role_or_stand_alone(student_tokenizer, teacher_tokenizer):
    s_info, t_info = tokenizer_info(student_tokenizer), tokenizer_info(teacher_tokenizer)
    text = "x = 1"
    s_ids, s_off = encode_with_offsets(student_tokenizer, text)  # <s> x ...
    t_ids, t_off = encode_with_offsets(teacher_tokenizer, text)  # no BOS
    s_ids = np.append(s_ids, student_tokenizer.eos_token_id)
    s_off = np.vstack([s_off, [0, 0]])
    t_ids = np.append(t_ids, teacher_tokenizer.eos_token_id)
    t_off = np.vstack([t_off, [0, 0]])
    a = align_offsets(text, s_ids, s_off, t_ids, t_off, student_info=s_info, teacher_info=t_info)
    check_partition(a, len(s_ids), len(t_ids))
    ns, nt = np.diff(a.student_end, prepend=0), np.diff(a.teacher_end, prepend=0)
    assert (ns[0], nt[0], a.exact[0]) == (1, 0, False)  # BOS: no teacher counterpart
    assert (ns[-1], nt[-1], a.exact[-1]) == (1, 1, True)  # EOS paired with EOS
    assert a.exact[1:-1].all()


def test_different_roles_at_one_place_do_not_pair(student_tokenizer, teacher_tokenizer):
    s_info, t_info = tokenizer_info(student_tokenizer), tokenizer_info(teacher_tokenizer)
    a = align_offsets("", [student_tokenizer.bos_token_id], [(0, 0)], [teacher_tokenizer.eos_token_id], [(0, 0)],
                      student_info=s_info, teacher_info=t_info)
    assert a.student_end.tolist() == [1, 1] and a.teacher_end.tolist() == [0, 1]
    assert not a.exact.any()


def test_zero_width_token_inside_a_chunk_is_absorbed():
    # a special between two tokens of one side, where the other side has no cut: absorbed, inexact
    a = align_offsets("abcd", [1, 9, 2], [(0, 2), (0, 0), (2, 4)], [5], [(0, 4)], [False, True, False], None)
    assert a.student_end.tolist() == [3] and a.teacher_end.tolist() == [1] and a.exact.tolist() == [False]


def test_empty_inputs():
    a = align_offsets("", [], np.zeros((0, 2)), [], np.zeros((0, 2)))
    assert a.num_chunks == 0
    assert alignment_stats(a)["chunks"] == 0


def test_identity_alignment_and_stats():
    a = identity_alignment(4)
    assert a.student_end.tolist() == a.teacher_end.tolist() == [1, 2, 3, 4] and a.exact.all()
    stats = alignment_stats([a, identity_alignment(2)])
    assert stats["chunks"] == 6 and stats["1:1"] == 6 and stats["exact_student_token_share"] == 1.0


def test_stats_count_shapes():
    a = Alignment(student_end=np.array([1, 2, 5, 7, 7, 8], dtype=np.int32),
                  teacher_end=np.array([0, 3, 4, 6, 7, 8], dtype=np.int32),
                  exact=np.array([False, True, True, True, False, True]),
                  char_end=np.array([0, 3, 6, 8, 9, 10], dtype=np.int32))
    s = alignment_stats(a)
    assert (s["empty_teacher"], s["1:n"], s["n:1"], s["n:m"], s["empty_student"], s["1:1"]) == (1, 1, 1, 1, 1, 1)
    assert s["exact_char_share"] == pytest.approx(9 / 10)


@pytest.mark.parametrize("offsets, match", [
    ([(0, 2), (2, 9)], "outside its text"),
    ([(0, 3), (2, 3)], None),  # overlapping but monotone: fine
    ([(2, 3), (0, 2)], "go backwards"),
    ([(0, 2)], "offset pair"),
])
def test_untrusted_offsets_raise(offsets, match):
    if match is None:
        align_offsets("abc", [1, 2], offsets, [1], [(0, 3)])
        return
    with pytest.raises(AlignmentError, match=match):
        align_offsets("abc", [1, 2], offsets, [1], [(0, 3)])


# --- the toy tokenizers ------------------------------------------------------------------------

def test_toy_tokenizers_digits_emoji_whitespace(student_tokenizer, teacher_tokenizer):
    text = "total = 123456 + 7\n\t\tvalue  = 'é😀中文'  # a\u0301\n"
    s_ids, t_ids, a = align_text(text, student_tokenizer, teacher_tokenizer)
    assert s_ids.tolist() == student_tokenizer(text)["input_ids"]
    assert t_ids.tolist() == teacher_tokenizer(text)["input_ids"]
    check_partition(a, len(s_ids), len(t_ids))
    check_exact_chunks(text, student_tokenizer, teacher_tokenizer, s_ids, t_ids, a)
    stats = alignment_stats(a)
    print("toy alignment stats:", stats)
    assert stats["empty_teacher"] == 1  # the student's BOS
    assert stats["1:n"] + stats["n:m"] >= 1  # digit groups "123" vs "1","2","3", byte splits
    assert stats["exact_char_share"] == 1.0


def test_same_tokenizer_is_identity(student_tokenizer):
    text = "def f(x):\n    return x * 2  # 😀\n"
    s_ids, t_ids, a = align_text(text, student_tokenizer, student_tokenizer)
    assert np.array_equal(s_ids, t_ids) and a == identity_alignment(len(s_ids))
    # the full walk agrees, except that it groups the byte tokens of one emoji (BOS/BOS is exact too)
    s_off = encode_with_offsets(student_tokenizer, text)[1]
    info = tokenizer_info(student_tokenizer)
    walked = align_offsets(text, s_ids, s_off, s_ids, s_off, student_info=info, teacher_info=info)
    assert np.array_equal(walked.student_end, walked.teacher_end) and walked.exact.all()
    assert set(walked.student_end.tolist()) <= set(a.student_end.tolist())
    assert walked.num_chunks == len(s_ids) - 3  # the emoji's 4 byte tokens are one chunk


def test_text_longer_than_model_context(student_tokenizer, teacher_tokenizer, toy_setup):
    docs = [json.loads(line)["text"] for line in toy_setup.train_jsonl.read_text().splitlines()[:12]]
    text = "\n".join(docs)
    s_ids, t_ids, a = align_text(text, student_tokenizer, teacher_tokenizer)
    assert len(t_ids) > 2048 and len(s_ids) > 2048
    check_partition(a, len(s_ids), len(t_ids))
    stats = alignment_stats(a)
    assert stats["exact_char_share"] == 1.0 and stats["1:1"] > stats["chunks"] // 2


@PROPERTY
@given(text=TEXTS)
def test_property_toy_tokenizers(text, student_tokenizer, teacher_tokenizer):
    s_ids, t_ids, a = align_text(text, student_tokenizer, teacher_tokenizer)
    check_partition(a, len(s_ids), len(t_ids))
    check_exact_chunks(text, student_tokenizer, teacher_tokenizer, s_ids, t_ids, a)
    # both byte-level tokenizers are lossless: exact chunks cover the whole text (unless it spells a
    # special token, which the tokenizer reads as a control token: that chunk is inexact)
    begin = np.concatenate(([0], a.char_end[:-1]))
    if not any(sp in text for sp in student_tokenizer.all_special_tokens + teacher_tokenizer.all_special_tokens):
        assert int(((a.char_end - begin) * a.exact).sum()) == len(text)


def test_special_token_spelled_in_text_is_inexact(student_tokenizer, teacher_tokenizer):
    text = "a<|pad|>b"
    s_ids, t_ids, a = align_text(text, student_tokenizer, teacher_tokenizer)
    assert teacher_tokenizer.pad_token_id in t_ids.tolist()
    check_partition(a, len(s_ids), len(t_ids))
    begin = np.concatenate(([0], a.char_end[:-1]))
    holds = (begin <= 1) & (a.char_end >= 8) & (a.char_end > begin)
    assert holds.sum() == 1 and not a.exact[holds].any()
    assert a.exact[a.char_end == 1].all() and a.exact[begin == 8].all()


def test_an_added_control_token_spelled_in_text_is_inexact(student_tokenizer, teacher_tokenizer):
    """An added token marked special but not among the tokenizer's special tokens (Llama-3's 251 reserved tokens
    and its chat headers) is matched in plain text as one id, as `<|pad|>` is: a control token, not the text its
    name spells, so its chunk is inexact; the same text without it stays exact."""
    import copy

    from tokenizers import AddedToken

    s_tok = copy.deepcopy(student_tokenizer)
    s_tok.add_tokens([AddedToken("<|reserved_0|>", special=True)])
    rid = s_tok.convert_tokens_to_ids("<|reserved_0|>")
    assert rid not in s_tok.all_special_ids and s_tok.added_tokens_decoder[rid].special
    info = tokenizer_info(s_tok)
    assert info.control[rid]
    text = "a <|reserved_0|> b"
    s_ids, t_ids, a = align_text(text, s_tok, teacher_tokenizer)
    assert rid in s_ids.tolist() and rid not in t_ids.tolist()
    check_partition(a, len(s_ids), len(t_ids))
    begin = np.concatenate(([0], a.char_end[:-1]))
    holds = (begin <= 2) & (a.char_end >= 16) & (a.char_end > begin)
    assert holds.sum() == 1 and not a.exact[holds].any(), (a.exact, begin, a.char_end)
    text_chunks = a.char_end > begin  # (a BOS alone is a chunk of no text, inexact on its own)
    assert a.exact[text_chunks & (begin >= 16)].all() and a.exact[text_chunks & (a.char_end <= 1)].all()
    _, _, plain = align_text("a reserved b", s_tok, teacher_tokenizer)
    p_begin = np.concatenate(([0], plain.char_end[:-1]))
    assert plain.exact[plain.char_end > p_begin].all()


# --- SentencePiece style (Metaspace + byte fallback) against byte-level BPE -----------------------

def test_sentencepiece_style_examples(sp_tokenizer, teacher_tokenizer):
    for text in ["Hello world", "def  f():\n\treturn 42", " leading space", "é😀中文 a\u0301b", "x\u3000y"]:
        s_ids, t_ids, a = align_text(text, sp_tokenizer, teacher_tokenizer)
        check_partition(a, len(s_ids), len(t_ids))
        check_exact_chunks(text, sp_tokenizer, teacher_tokenizer, s_ids, t_ids, a, strip_first_space=True)
        assert alignment_stats(a)["exact_char_share"] == 1.0, text
        assert not a.exact[0] and a.student_end[0] == 1 and a.teacher_end[0] == 0  # <s> alone


def check_metaspace_student(text, s_tok, teacher_tokenizer):
    """Partition, exact chunks, and full exact coverage for a Metaspace (SentencePiece-style) student."""
    s_ids, t_ids, a = align_text(text, s_tok, teacher_tokenizer)
    check_partition(a, len(s_ids), len(t_ids))
    check_exact_chunks(text, s_tok, teacher_tokenizer, s_ids, t_ids, a, strip_first_space=True)
    begin = np.concatenate(([0], a.char_end[:-1]))
    specials = s_tok.all_special_tokens + teacher_tokenizer.all_special_tokens
    if "\u2581" not in text and not any(sp in text for sp in specials):  # byte fallback: lossless, except
        # that SentencePiece reads a literal "▁" as a space, and spelled special tokens are control tokens
        assert int(((a.char_end - begin) * a.exact).sum()) == len(text)


@PROPERTY
@given(text=TEXTS)
def test_property_sentencepiece_vs_byte_level(text, sp_tokenizer, teacher_tokenizer):
    check_metaspace_student(text, sp_tokenizer, teacher_tokenizer)


def test_sentencepiece_literal_metaspace_char_is_inexact_not_an_error(sp_tokenizer, teacher_tokenizer):
    text = "a \u2581 b"
    s_ids, t_ids, a = align_text(text, sp_tokenizer, teacher_tokenizer)
    check_partition(a, len(s_ids), len(t_ids))
    begin = np.concatenate(([0], a.char_end[:-1]))
    holds = (begin <= 2) & (a.char_end > 2)
    assert holds.sum() == 1 and not a.exact[holds].any()  # the chunk holding the literal "▁" is inexact
    # and only that chunk: every other chunk with text is exact, and together they cover the rest of the text
    assert a.exact[(a.char_end > begin) & ~holds].all()
    assert int(((a.char_end - begin) * a.exact).sum()) == len(text) - int((a.char_end - begin)[holds].sum())
    assert int((a.char_end - begin)[holds].sum()) == 1


# --- tokenizers the aligner must refuse or handle ----------------------------------------------

def _tiny_byte_level(tmp_path, name, *, normalizer=None, add_prefix_space=False, trim_offsets=False):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if normalizer == "lowercase":
        tok.normalizer = normalizers.Lowercase()
    elif normalizer == "nfkc":
        tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the quick brown fox", "def f(x): return x"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(tmp_path / name))
    return fast


@pytest.mark.parametrize("normalizer, text", [("lowercase", "Hello World"), ("nfkc", "ﬁle ① x")])
def test_text_changing_normalizer_raises(tmp_path, teacher_tokenizer, normalizer, text):
    tok = _tiny_byte_level(tmp_path, normalizer, normalizer=normalizer)
    with pytest.raises(AlignmentError, match="changes the text"):
        align_text(text, tok, teacher_tokenizer)


def test_add_prefix_space_is_exact(tmp_path, teacher_tokenizer):
    tok = _tiny_byte_level(tmp_path, "prefix", add_prefix_space=True)
    text = "hello world"
    s_ids, t_ids, a = align_text(text, tok, teacher_tokenizer)
    assert tok.convert_ids_to_tokens(int(s_ids[0])).startswith("Ġ")
    check_partition(a, len(s_ids), len(t_ids))
    assert a.exact.all()


def test_slow_tokenizer_raises(teacher_tokenizer):
    class Slow:
        is_fast = False

    with pytest.raises(AlignmentError, match="slow tokenizer"):
        align_text("x", Slow(), teacher_tokenizer)
    assert issubclass(AlignmentError, XtcacheError)


def test_ids_outside_vocab_raise(student_tokenizer, teacher_tokenizer):
    info = tokenizer_info(student_tokenizer)
    with pytest.raises(AlignmentError, match="vocabulary"):
        align_offsets("a", [10**6], [(0, 1)], [1], [(0, 1)], student_info=info)


def test_offsets_of_another_text_raise(student_tokenizer, teacher_tokenizer):
    s_ids, s_off = encode_with_offsets(student_tokenizer, "hello world")
    t_ids, t_off = encode_with_offsets(teacher_tokenizer, "hello world")
    with pytest.raises(AlignmentError):
        align_offsets("jello wOrld", s_ids, s_off, t_ids, t_off, student_info=tokenizer_info(student_tokenizer),
                      teacher_info=tokenizer_info(teacher_tokenizer))


def test_trimmed_offsets_are_untrimmed_or_refused(tmp_path, teacher_tokenizer):
    tok = _tiny_byte_level(tmp_path, "trim", trim_offsets=True)
    text = "hello world  the\n\n  fox x"
    raw = tok.backend_tokenizer.encode(text)
    assert (6, 11) in raw.offsets  # "Ġworld" with its space trimmed off
    s_ids, t_ids, a = align_text(text, tok, teacher_tokenizer)  # encodes with an untrimmed copy
    assert s_ids.tolist() == raw.ids
    check_partition(a, len(s_ids), len(t_ids))
    assert alignment_stats(a)["exact_char_share"] == 1.0
    t_ids, t_off = encode_with_offsets(teacher_tokenizer, text)
    with pytest.raises(AlignmentError, match="trim_offsets"):
        align_offsets(text, np.array(raw.ids), np.array(raw.offsets), t_ids, t_off,
                      student_info=tokenizer_info(tok), teacher_info=tokenizer_info(teacher_tokenizer))


@pytest.fixture(scope="module")
def llama2_style_tokenizer(toy_setup, tmp_path_factory):
    """SentencePiece converted the Llama-2 way: no pre-tokenizer, a normalizer that prepends "▁"
    and turns spaces into "▁", byte fallback, a Replace/ByteFallback/Fuse/Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in toy_setup.train_jsonl.read_text().splitlines()[:60]]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    draft.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False, max_token_length=8))
    learned = json.loads(draft.to_str())["model"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + bytes_)}
    for t, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    out = tmp_path_factory.mktemp("llama2")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


@PROPERTY
@given(text=TEXTS)
def test_property_llama2_style_normalizer(text, llama2_style_tokenizer, teacher_tokenizer):
    check_metaspace_student(text, llama2_style_tokenizer, teacher_tokenizer)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, min_size=1, max_size=5))
def test_property_batch_equals_one_at_a_time(texts, student_tokenizer, teacher_tokenizer, sp_tokenizer):
    """Invariance: aligning a batch in one walk gives each document's alignment alone."""
    for s_tok in (student_tokenizer, sp_tokenizer):
        batch = align_texts(texts, s_tok, teacher_tokenizer)
        for text, (s_ids, t_ids, a) in zip(texts, batch):
            s1, t1, a1 = align_text(text, s_tok, teacher_tokenizer)
            assert np.array_equal(s_ids, s1) and np.array_equal(t_ids, t1)
            assert a == a1 and np.array_equal(a.char_end, a1.char_end)
    encs = [(encode_with_offsets(student_tokenizer, x), encode_with_offsets(teacher_tokenizer, x)) for x in texts]
    plain = align_batch(texts, [e[0][0] for e in encs], [e[0][1] for e in encs], [e[1][0] for e in encs],
                        [e[1][1] for e in encs])
    for text, e, a in zip(texts, encs, plain):
        assert a == align_offsets(text, e[0][0], e[0][1], e[1][0], e[1][1])
