"""Chat roles by construction: adversarial short messages in all five template families.

The ground truth is built here, independently of `xtcache.chat_spans`: for each message text, the
conversation is rendered again with that one text's non-whitespace characters replaced by a
character the rendering does not contain; the positions where the two renderings differ are that
text's characters (a text whose rendering changes length or elsewhere is left out of the truth).
Against it: no located text holds another text's characters, no student token has a role other
than its message's (or, for template text, 0 or its turn's tail), no exact chunk pairs two
different characters of the message texts, and the self-check counts 0.

    pytest -q tests/test_chat_roles.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xtcache.chat import ROLE_ASSISTANT, ConversationError, align_conversations, render, renderings
from xtcache.testing.chat import FAMILIES, chat_tokenizer

_CODES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
MARK = "\U0010fffd"
VOCAB = ["user", "assistant", "system", "model", "tool", "ipython", "im", "im_start", "eot", "_id", "header", "INST",
         "start_of", "turn", "<|", "[", "]", "/", "<", "Today", "Date", "Cutting Knowledge", "think", "Yes.", "OK",
         "42", "1", "a", ".", "\n", " ", "Tool result:", "lookup", "café", "end", "start"]


@pytest.fixture(scope="module")
def toks(toy_setup, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_roles")
    return {(fam, side): chat_tokenizer(base, fam, root / f"{fam}-{side}") for fam in FAMILIES
            for side, base in (("teacher", toy_setup.teacher_tokenizer), ("student", toy_setup.student_tokenizer))}


def _texts(conv):
    """(message, key, text) of every non-empty reasoning and content string."""
    out = []
    for i, m in enumerate(conv["messages"]):
        for key in ("reasoning_content", "content"):
            if isinstance(m.get(key), str) and m[key]:
                out.append((i, key, m[key]))
    return out


def truth(tok, conv, text: str) -> np.ndarray:
    """int64 [len(text)]: for each character of the rendering, (text index << 32 | its offset in the
    text) where a single-text mutation shows it is that text's character, -1 elsewhere."""
    owner = np.full(len(text), -1, dtype=np.int64)
    for k, (i, key, s) in enumerate(_texts(conv)):
        msgs = [dict(m) for m in conv["messages"]]
        msgs[i][key] = "".join(c if c.isspace() else MARK for c in s)
        other = render(tok, {**conv, "messages": msgs})
        if len(other) != len(text):
            continue
        diff = [p for p in range(len(text)) if other[p] != text[p]]
        offsets = [o for o, c in enumerate(s) if not c.isspace()]
        if not diff or len(diff) % len(offsets) or any(other[p] != MARK for p in diff):
            continue
        for n, p in enumerate(diff):  # each rendered copy of the text, in order
            assert text[p] == s[offsets[n % len(offsets)]]
            owner[p] = (k << 32) | offsets[n % len(offsets)]
    return owner


def _roles(conv):
    roles = [_CODES.get(m["role"], 5) for m in conv["messages"]]
    last = [i for i, r in enumerate(roles) if r == ROLE_ASSISTANT]
    if last:
        roles[last[-1]] |= 0x80
    return roles


def errors(conv, s_tok, t_tok) -> dict:
    """Counts of what the ground truth finds wrong in the alignment of `conv` (student `s_tok`)."""
    s_text, t_text = render(s_tok, conv), render(t_tok, conv)
    ss, ts = renderings(s_tok, [s_text], [conv]), renderings(t_tok, [t_text], [conv])
    (ca,) = align_conversations([conv], ss, ts)
    s_own, t_own = truth(s_tok, conv, s_text), truth(t_tok, conv, t_text)
    texts = _texts(conv)
    out = {"outside": 0, "wrong_role": 0, "mispaired": 0, "self_check": ca.stats["misaligned_chars"]}
    for r, own in ((ss[0], s_own), (ts[0], t_own)):
        for p in r.located.pieces:
            k = next(j for j, (i, key, _) in enumerate(texts) if i == p.msg and (key == "content") == (p.field == 1))
            span = own[p.start:p.end]
            out["outside"] += int(np.count_nonzero((span >= 0) & ((span >> 32) != k)))
            out["outside"] += sum(1 for c, o in zip(p.text, span.tolist()) if o < 0 and not c.isspace())
    # the texts both templates render verbatim (the truth knows every core character on both sides)
    cores = [len([c for c in s if not c.isspace()]) for _, _, s in texts]
    shared = {k for k in range(len(texts)) if all(np.count_nonzero((own >= 0) & ((own >> 32) == k)) >= cores[k]
                                                  for own in (s_own, t_own))}
    roles, msg_of = _roles(conv), [i for i, _, _ in texts]
    specials = set(s_tok.all_special_ids)
    tail = 0  # the role a template token may carry: the last message's, until its end-of-turn marker
    for tid, (a, b), role in zip(ss[0].ids.tolist(), ss[0].offsets.tolist(), ca.student_role.tolist()):
        if b <= a:
            continue
        ks = {int(o >> 32) for o in s_own[a:b].tolist() if o >= 0}
        if ks:
            allowed = {roles[msg_of[k]] for k in ks if k in shared} or {0} | {roles[msg_of[k]] for k in ks}
            tail = roles[msg_of[max(ks)]]
        else:
            allowed = {0, tail}
            if s_text[a:b].isspace():  # the truth cannot tell a text's own leading whitespace from the template's
                nxt = next((int(o >> 32) for o in s_own[b:].tolist() if o >= 0), None)
                allowed |= {roles[msg_of[nxt]]} if nxt is not None else set()
            if tid in specials:
                tail = 0
        out["wrong_role"] += int(role not in allowed)
    a = ca.alignment
    bs, bt = np.concatenate(([0], a.student_end[:-1])), np.concatenate(([0], a.teacher_end[:-1]))
    for c in np.flatnonzero(a.exact):
        if a.student_end[c] > bs[c] and a.teacher_end[c] > bt[c]:
            x0, x1 = ss[0].offsets[bs[c], 0], ss[0].offsets[a.student_end[c] - 1, 1]
            y0, y1 = ts[0].offsets[bt[c], 0], ts[0].offsets[a.teacher_end[c] - 1, 1]
            if x1 - x0 == y1 - y0:
                x, y = s_own[x0:x1], t_own[y0:y1]
                out["mispaired"] += int(np.count_nonzero((x >= 0) & (y >= 0) & (x != y)))
    return out


def _content(draw) -> str:
    words = draw(st.lists(st.sampled_from(VOCAB), min_size=0, max_size=3))
    sep = draw(st.sampled_from(["", " ", "\n"]))
    pad = draw(st.sampled_from(["", "", " ", "\n", "  \n"]))
    return draw(st.sampled_from(["", pad])) + sep.join(words) + draw(st.sampled_from(["", pad]))


@st.composite
def conversations(draw, tools: bool):
    pool = [_content(draw) for _ in range(3)]  # texts repeated across turns
    text = lambda: draw(st.sampled_from(pool)) if draw(st.booleans()) else _content(draw)  # noqa: E731
    msgs = [{"role": "system", "content": text()}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": text()})
        if tools and draw(st.booleans()):
            msgs.append({"role": "assistant", "content": text(), "tool_calls": [{"type": "function", "function": {
                "name": "lookup", "arguments": {"word": draw(st.sampled_from(VOCAB))}}}]})
            msgs.append({"role": "tool", "name": "lookup", "content": text()})
        m = {"role": "assistant", "content": text()}
        if draw(st.booleans()):
            m["reasoning_content"] = text()
        msgs.append(m)
    conv = {"messages": msgs}
    if tools:
        conv["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    return conv


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                       HealthCheck.too_slow])
@given(data=st.data())
def test_adversarial_short_messages_get_their_roles_in_every_family(toks, data):
    t_fam = data.draw(st.sampled_from(sorted(FAMILIES)), label="teacher")
    s_fam = data.draw(st.sampled_from(sorted(FAMILIES)), label="student")
    conv = data.draw(conversations("mistral" not in (t_fam, s_fam)), label="conversation")
    s_tok, t_tok = toks[(s_fam, "student")], toks[(t_fam, "teacher")]
    specials = {t for tok in (s_tok, t_tok) for t in tok.all_special_tokens}
    if any(sp in (m.get("content") or "") + (m.get("reasoning_content") or "") for m in conv["messages"]
           for sp in specials):
        return
    try:
        got = errors(conv, s_tok, t_tok)
    except ConversationError:  # a template that rejects the row (stage 1 skips it, counted)
        return
    assert got == {"outside": 0, "wrong_role": 0, "mispaired": 0, "self_check": 0}, (t_fam, s_fam, conv)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_messages_that_are_template_words_are_located_in_their_turns(toks, family):
    """A user message "user" and an answer "start" or "assistant" (found inside the headers by a search)."""
    tok = toks[(family, "student")]
    other = toks[("chatml" if family != "chatml" else "llama3", "teacher")]
    for conv in ({"messages": [{"role": "system", "content": "end"}, {"role": "user", "content": "Today"},
                               {"role": "assistant", "content": "start"}]},
                 {"messages": [{"role": "user", "content": "user"}, {"role": "assistant", "content": "assistant"},
                               {"role": "user", "content": "1"}, {"role": "assistant", "content": "im"}]}):
        assert errors(conv, tok, other) == {"outside": 0, "wrong_role": 0, "mispaired": 0, "self_check": 0}
        ss = renderings(tok, [render(tok, conv)], [conv])
        ts = renderings(other, [render(other, conv)], [conv])
        (ca,) = align_conversations([conv], ss, ts)
        answer = conv["messages"][-1]["content"]
        trained = "".join(ss[0].text[a:b] for (a, b), r in zip(ss[0].offsets.tolist(), ca.student_role.tolist())
                          if r & 0x7F == ROLE_ASSISTANT)
        assert answer in trained and "user" not in trained.replace(answer, "")


def test_whitespace_only_and_dropped_texts_are_counted_unaligned(toks):
    conv = {"messages": [{"role": "user", "content": " \n"}, {"role": "assistant", "content": "ok",
                                                               "reasoning_content": "think"},
                         {"role": "user", "content": "again"}, {"role": "assistant", "content": "done"}]}
    s_tok, t_tok = toks[("llama3", "student")], toks[("chatml-thinking", "teacher")]
    ss = renderings(s_tok, [render(s_tok, conv)], [conv])
    ts = renderings(t_tok, [render(t_tok, conv)], [conv])
    (ca,) = align_conversations([conv], ss, ts)
    # the whitespace-only user text (2) and the reasoning the teacher drops before a later user turn (5)
    assert ca.stats["unaligned_spans"] == 2 and ca.stats["unaligned_chars"] == 2 + 5
    assert ca.stats["misaligned_chars"] == 0
