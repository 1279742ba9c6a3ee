"""Chat roles by construction: adversarial short messages in all five template families.

The ground truth is built here, independently of `xtcache.chat.spans`: for each message text, the
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

from schemas.roles import ROLE_ASSISTANT
from xtcache.chat.layout import align_conversations
from xtcache.chat.render import ConversationError, render, renderings
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


# Templates that change a text (strip only newlines, escape, upper-case, write a text twice): the batch reading
# of the marked renderings (`xtcache.chat.runs.read`) leaves such conversations to the general walk.
CHANGING = {
    "strip-newlines": (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
        "{{ m.reasoning_content.strip('\\n') }}\n</think>\n\n{% endif %}{{ (m.content or '').lstrip('\\n') }}"
        "<|im_end|>\n{% endfor %}"),
    "escape": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ (m.content or '') | replace('a', '&a;') }}"
              "<|im_end|>\n{% endfor %}",
    "upper": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ (m.content or '') | upper }}<|im_end|>\n{% endfor %}",
    "twice": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% if m.role == 'user' %}"
             " ({{ m.content }}){% endif %}<|im_end|>\n{% endfor %}",
}


@pytest.fixture(scope="module")
def changing(toks):
    from transformers import AutoTokenizer

    out = {}
    for name, template in CHANGING.items():
        tok = AutoTokenizer.from_pretrained(toks[("chatml", "student")].name_or_path)
        tok.chat_template = template
        out[name] = tok
    return out


def _core_at(loc, k):
    s = loc.texts[k][2]
    return loc.at[k] + (len(s) - len(s.lstrip())) - loc.skip[k] if loc.at[k] >= 0 else -1


def _kept(loc, k):
    """(leading, trailing) whitespace characters of text k that `loc` locates."""
    s = loc.texts[k][2]
    lead = len(s) - len(s.lstrip())
    return lead - loc.skip[k], loc.width[k] - (lead - loc.skip[k]) - len(s.strip())


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                      HealthCheck.too_slow])
@given(data=st.data())
def test_batch_reading_agrees_with_the_general_walk(toks, changing, data):
    """One marked rendering read for a batch locates every text where the walk (marked and quiet
    renderings, run by run) does, with at least the whitespace the walk finds kept; a conversation
    it cannot read is the walk's; and the alignment of either has no error against the truth."""
    from xtcache.chat.runs import locate_one, marked_conversations, plan, read
    from xtcache.chat.spans import message_texts

    names = sorted(FAMILIES) + sorted(CHANGING)
    tok_of = lambda n: changing[n] if n in CHANGING else toks[(n, "student")]  # noqa: E731
    name = data.draw(st.sampled_from(names), label="template")
    tok = tok_of(name)
    convs = [data.draw(conversations(name not in ("mistral", *CHANGING)), label="conversation") for _ in range(3)]
    specials = set(tok.all_special_tokens)
    convs = [c for c in convs if not any(sp in (m.get("content") or "") + (m.get("reasoning_content") or "")
                                         for m in c["messages"] for sp in specials)]
    try:
        texts = [render(tok, c) for c in convs]
    except ConversationError:
        return
    msg_texts = [message_texts(c) for c in convs]
    p = plan(texts, msg_texts)
    marked = []
    for c in marked_conversations(convs, p):
        try:
            marked.append(render(tok, c))
        except ConversationError:
            marked.append(None)
    got = read(texts, marked, p)
    for d, conv in enumerate(convs):
        walk = locate_one(lambda c: render(tok, c), texts[d], conv, msg_texts[d])  # noqa: B023
        if got[d] is None:
            continue
        for k in range(len(msg_texts[d])):
            assert _core_at(got[d], k) == _core_at(walk, k), (name, conv, k)
            if walk.at[k] >= 0:
                assert all(x >= y for x, y in zip(_kept(got[d], k), _kept(walk, k))), (name, conv, k)
        assert got[d].unaligned_chars <= walk.unaligned_chars
    other = toks[("llama3", "teacher")]
    for conv in convs if name != "upper" else ():  # the truth cannot judge a text rewritten at its length
        try:
            found = errors(conv, tok, other)
        except ConversationError:
            continue
        if name in CHANGING:  # the walk leaves a text between two changed ones unaligned (role 0), by design
            found["wrong_role"] = 0
        assert found == {"outside": 0, "wrong_role": 0, "mispaired": 0, "self_check": 0}, (name, conv)


def test_a_template_that_changes_texts_is_walked_and_locates_the_rest(changing, toks):
    """Texts a template strips of newlines or escapes: the batch reading leaves the conversation to
    the walk, which locates the texts the template wrote verbatim."""
    from xtcache.chat.runs import marked_conversations, plan, read
    from xtcache.chat.spans import message_texts

    conv = {"messages": [{"role": "user", "content": "\nhello there\n"},
                         {"role": "assistant", "content": "ok", "reasoning_content": "\nthink first\n"},
                         {"role": "user", "content": "a cat"}, {"role": "assistant", "content": "done"}]}
    verbatim = {"strip-newlines": {"hello there", "think first", "ok", "a cat", "done"},
                "escape": {"hello there", "ok", "done"}}  # "a cat" escaped; no reasoning rendered
    for name, cores in verbatim.items():
        tok = changing[name]
        text = render(tok, conv)
        p = plan([text], [message_texts(conv)])
        assert read([text], [render(tok, c) for c in marked_conversations([conv], p)], p) == [None]
        (loc,) = renderings(tok, [text], [conv]).located
        assert {piece.text.strip() for piece in loc.pieces} == cores
        assert errors(conv, tok, toks[("llama3", "teacher")]) == {"outside": 0, "wrong_role": 0, "mispaired": 0,
                                                                   "self_check": 0}


def _positions_by_character(side, f) -> np.ndarray:
    """`xtcache.chat.check.text_positions` read one conversation at a time, every character of its
    marked rendering (the reference for the batch reading)."""
    out = np.full(int((f.lens + 1).sum()), -1, dtype=np.int64)
    text_base = 0
    for d, loc in enumerate(side.located):
        begin, lengths = int(f.base[d]), [len(s) for _, _, s in loc.texts]
        starts = np.cumsum([text_base] + lengths[:-1]) if lengths else np.zeros(0, np.int64)
        got = [k for k, a in enumerate(loc.at) if a >= 0]
        for k in got:
            out[loc.at[k] + begin:loc.at[k] + begin + loc.width[k]] = starts[k] + loc.skip[k] + np.arange(loc.width[k])
        if got:
            own = np.frombuffer(loc.marked.encode("utf-32-le"), dtype=np.uint32).astype(np.int64) - loc.base
            own = np.where((own >= 0) & (own < len(lengths)), own, -1)
            pos = np.arange(own.shape[0])
            run_start = np.maximum.accumulate(np.where(np.concatenate(([True], own[1:] != own[:-1])), pos, 0))
            lead = np.array([len(s) - len(s.lstrip()) for _, _, s in loc.texts], dtype=np.int64)
            in_text = np.where(own >= 0, starts[np.maximum(own, 0)] + lead[np.maximum(own, 0)] + pos - run_start, -1)
            for k in got:
                c0 = loc.at[k] + int(lead[k]) - loc.skip[k]
                m0, n = c0 - loc.shift[k], len(loc.texts[k][2].strip())
                out[begin + c0:begin + c0 + n] = in_text[m0:m0 + n]
        text_base += sum(lengths)
    return out


def test_self_check_reads_the_marked_renderings_under_a_wrong_layout(toks):
    """The batch's text positions equal a character-by-character reading of every marked rendering,
    for the true layout and for one whose text is moved a character (and its marked run with it, or
    not); a moved text is counted misaligned."""
    import dataclasses

    from xtcache.chat.check import text_positions
    from xtcache.chat.render import flat_side
    from xtcache.testing.chat import chat_corpus

    s_tok, t_tok = toks[("chatml-thinking", "student")], toks[("llama3", "teacher")]
    convs = chat_corpus(6, max_turns=4)
    ss = renderings(s_tok, [render(s_tok, c) for c in convs], convs)
    ts = renderings(t_tok, [render(t_tok, c) for c in convs], convs)
    f = flat_side(ss)
    assert np.array_equal(text_positions(ss, f), _positions_by_character(ss, f))
    for d, moves_run in ((1, False), (3, True)):
        loc = ss.located[d]
        k = max(range(len(loc.texts)), key=lambda j: loc.width[j])
        at = list(loc.at)
        at[k] += 1
        shift = list(loc.shift)
        shift[k] += 1 if moves_run else 0
        located = list(ss.located)
        located[d] = dataclasses.replace(loc, at=at, shift=shift)
        moved = dataclasses.replace(ss, located=located)
        assert np.array_equal(text_positions(moved, f), _positions_by_character(moved, f))
        out = align_conversations(convs, moved, ts)
        # a run moved with it reads as the layout says: the rendered text differs, not the place
        assert out[d].stats["text_mismatch_chars" if moves_run else "misplaced_chars"] > 0, out[d].stats
        assert all(o.stats["misaligned_chars"] == 0 for i, o in enumerate(out) if i != d)


def test_wrong_role_count_sees_tokens_given_another_role(toks, monkeypatch):
    """The self-check's role count is 0 for the layout's roles and counts exactly the characters of
    the tokens whose role is changed (content given another message's role, template text given a
    role that is not its turn's tail)."""
    import xtcache.chat.layout as chat
    from xtcache.testing.chat import chat_corpus

    seen = []
    real = chat.wrong_role_chars
    monkeypatch.setattr(chat, "wrong_role_chars", lambda *a: seen.append(a) or real(*a))
    s_tok, t_tok = toks[("llama3", "student")], toks[("chatml-thinking", "teacher")]
    convs = chat_corpus(5, max_turns=4)
    ss = renderings(s_tok, [render(s_tok, c) for c in convs], convs)
    ts = renderings(t_tok, [render(t_tok, c) for c in convs], convs)
    out = align_conversations(convs, ss, ts)
    (f, roles, text_at, text_msg, msg_roles), = seen
    assert not real(f, roles, text_at, text_msg, msg_roles).any()
    is_text = np.isin(np.arange(int((f.lens + 1).sum())), text_at)
    a, b = f.offs[:, 0], f.offs[:, 1]
    doc = np.repeat(np.arange(len(convs)), f.counts)
    content = [i for i in range(len(roles)) if b[i] > a[i] and is_text[a[i]:b[i]].all() and roles[i] & 0x7F == 3]
    template = [i for i in range(len(roles)) if b[i] > a[i] and not is_text[a[i]:b[i]].any() and roles[i] == 0
                and not is_text[f.base[doc[i]]:a[i]].any()]  # before the conversation's first text: no tail
    changed = roles.copy()
    changed[content[::7]] = 2  # assistant content given the user's role
    changed[template[::5]] = 3  # a header given the assistant's role
    want = np.bincount(doc[content[::7] + template[::5]], weights=(b - a)[content[::7] + template[::5]],
                       minlength=len(convs))
    assert content and template
    assert np.array_equal(real(f, changed, text_at, text_msg, msg_roles), want)
    assert all(o.stats["wrong_role_chars"] == 0 for o in out)
