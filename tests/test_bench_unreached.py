"""bench/unreached.py's pure parts: the chat row counts the positions of assistant text only, and a span that
covers a whole text counts what no span does."""

from __future__ import annotations

import pytest


def test_assistant_spans_are_the_assistant_messages_in_the_rendering(toy_setup, tmp_path):
    from bench.unreached import assistant_spans
    from xtcache.testing.chat import chat_tokenizer

    tok = chat_tokenizer(toy_setup.teacher_tokenizer, "chatml", tmp_path / "t")
    conv = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a cache?"},
                         {"role": "assistant", "content": "the teacher's log-probs, stored once"},
                         {"role": "user", "content": "and a student?"},
                         {"role": "assistant", "content": "a smaller model that reads them"}]}
    (text,), (spans,) = assistant_spans(tok, [conv])
    assert [text[a:b] for a, b in spans] == ["the teacher's log-probs, stored once", "a smaller model that reads them"]


def test_spans_restrict_the_positions_counted(toy_setup):
    from bench.unreached import measure

    text = "def cache(teacher):\n    return teacher.log_probs()\n"
    whole = measure("t", toy_setup.student_tokenizer, toy_setup.teacher_model, [text], 1024)
    spanned = measure("t", toy_setup.student_tokenizer, toy_setup.teacher_model, [text], 1024, [[(0, len(text))]])
    none = measure("t", toy_setup.student_tokenizer, toy_setup.teacher_model, [text], 1024, [[]])
    assert spanned["positions"] == whole["positions"] > 0  # every token after the first starts in the span
    assert spanned["mass"] == pytest.approx(whole["mass"]) and spanned["realized"] == whole["realized"]
    assert none["positions"] == 0
    half = measure("t", toy_setup.student_tokenizer, toy_setup.teacher_model, [text], 1024, [[(20, len(text))]])
    assert 0 < half["positions"] < whole["positions"]
