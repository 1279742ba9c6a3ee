"""Conversations: each model renders a transcript with its own chat template; the renderings are aligned.

A conversation is `{"messages": [{role, content, ...}], "tools": [...]}` (tool calls, a `name` and a
reasoning field such as `reasoning_content` pass through to the template as they are). The teacher
and each student render it with the chat template of their own tokenizer, so the two texts differ
in everything the templates add (role headers, separators, injected system text) and agree only
on the messages' text. This module aligns two such renderings:

1. `locate` finds each message's reasoning and content, in order, in a rendering (a cursor search
   of the exact string; a template that trims whitespace is matched on the trimmed string, the
   trimmed characters counted as unaligned; a text the template changed otherwise is not found:
   the whole piece is counted unaligned and gets no KD, it is never forced into alignment);
2. the pieces found in both renderings are laid out once in a virtual text, each side's template
   text in a block of its own next to the other side's, and each side's tokens are mapped into
   that text by their character offsets; `xtcache.align.align_flat` then cuts the chunks: shared
   content gives exact chunks, template text gives chunks with an empty other side (no KD);
3. the end-of-turn markers of the two templates (the first special added token after a message's
   last piece) are mapped onto one shared character, so they form one chunk: the student learns
   from the teacher when a turn ends;
4. every student token gets a role code (`ROLE_*`, bit `LAST_ASSISTANT` for the final assistant
   turn): the message's role for its content, for the template text between its content and its
   end-of-turn marker (tool calls) and for the marker itself; 0 for headers and other template
   text. Stage 2 builds its `--train-on` masks from these codes.

A token that straddles a piece boundary (BPE merging a template newline into the content) is mapped
onto the piece and its chunk marked inexact. The work per token is numpy over the whole batch; only
pieces (a handful per message) are walked in Python.

    python -c "from xtcache.chat import render; help(render)"
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from xtcache.align import Alignment, align_flat
from xtcache.errors import ConfigError

ROLE_TEMPLATE, ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL, ROLE_OTHER = 0, 1, 2, 3, 4, 5
LAST_ASSISTANT = 0x80  # bit set on the tokens of the conversation's last assistant message
ROLE_NAMES = {ROLE_TEMPLATE: "template", ROLE_SYSTEM: "system", ROLE_USER: "user", ROLE_ASSISTANT: "assistant",
              ROLE_TOOL: "tool", ROLE_OTHER: "other"}
_ROLE_CODES = {"system": ROLE_SYSTEM, "developer": ROLE_SYSTEM, "user": ROLE_USER, "human": ROLE_USER,
               "assistant": ROLE_ASSISTANT, "model": ROLE_ASSISTANT, "gpt": ROLE_ASSISTANT, "tool": ROLE_TOOL,
               "ipython": ROLE_TOOL, "function": ROLE_TOOL}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
TRAIN_ON = ("assistant", "all", "last-assistant")


class ConversationError(ConfigError):
    """A conversation row or a chat template that cannot be used (names the row or the tokenizer)."""


def role_code(role: str) -> int:
    return _ROLE_CODES.get(role, ROLE_OTHER)


def trained_roles(codes: np.ndarray, train_on: str) -> np.ndarray:
    """bool mask of the role codes `--train-on` trains on: assistant (every assistant message,
    end-of-turn included), last-assistant (the final assistant message only) or all (everything)."""
    if train_on == "all":
        return np.ones(codes.shape, dtype=bool)
    if train_on == "assistant":
        return (codes & 0x7F) == ROLE_ASSISTANT
    if train_on == "last-assistant":
        return (codes & LAST_ASSISTANT) != 0
    raise ConfigError(f"--train-on {train_on!r}: use one of {', '.join(TRAIN_ON)}")


# ------------------------------------------------------------------------------------ rows


def parse_conversation(messages, tools=None) -> dict | str:
    """`{"messages": [...], "tools": [...]}` from a corpus row's values, or the reason it is unusable.

    Messages are dicts with a string `role` and a string (or null, for a tool-call-only turn)
    `content`; every other key (tool_calls, name, reasoning_content, ...) passes to the template.
    `tools` may be a list or its JSON text.
    """
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except ValueError:
            return "messages field is not a list"
    if not isinstance(messages, (list, tuple)) or not messages:
        return "messages field is not a list" if not isinstance(messages, (list, tuple)) else "empty conversation"
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "message without a role"
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            return "message content is not a string"
        # Parquet/Arrow list-of-struct columns give every key of the schema: drop the absent ones
        clean = {k: v for k, v in m.items() if v is not None or k == "content"}
        for key in ("tool_calls",):
            if isinstance(clean.get(key), str):
                try:
                    clean[key] = json.loads(clean[key])
                except ValueError:
                    return f"{key} is not JSON"
        for call in clean.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:  # templates render arguments as a mapping (tojson / items())
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
        out.append(clean)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            return "tools field is not JSON"
    if tools is not None and not isinstance(tools, (list, tuple)):
        return "tools field is not a list"
    if not any(isinstance(m.get("content"), str) and m["content"] for m in out):
        return "empty conversation"
    conv = {"messages": out}
    if tools:
        conv["tools"] = list(tools)
    return conv


def conversation_json(conv: dict) -> str:
    """The canonical JSON text of a conversation (what the store keeps per document)."""
    return json.dumps(conv, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------ templates


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template text (a named set is serialised as sorted JSON); None without one."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return json.dumps(t, sort_keys=True)
    return t or None


def require_template(tokenizer, side: str) -> str:
    t = chat_template(tokenizer)
    if t is None:
        raise ConversationError(f"the {side} has no chat template (no chat_template in its tokenizer_config.json "
                                "or chat_template.jinja): a conversation corpus is rendered with each model's own "
                                "template; give a tokenizer with one")
    return t


def chat_fingerprint(tokenizer) -> str:
    """Fingerprint of a tokenizer together with its chat template: what keys conversation caches
    and their alignment groups (a changed template is another tokenizer)."""
    from xtcache.fingerprint import tokenizer_fingerprint

    body = json.dumps({"chat_template": chat_template(tokenizer), "tokenizer": tokenizer_fingerprint(tokenizer)},
                      sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def turn_marker_ids(tokenizer) -> list[int]:
    """Ids of the tokenizer's special added tokens: the candidates for end-of-turn markers."""
    return sorted(int(i) for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False))


def render(tokenizer, conv: dict, *, where: str = "") -> str:
    """The conversation in the tokenizer's chat template (no generation prompt).
    ConversationError naming `where` when the template rejects it."""
    try:
        text = tokenizer.apply_chat_template(conv["messages"], tools=conv.get("tools") or None, tokenize=False,
                                             add_generation_prompt=False)
    except Exception as e:  # jinja's TemplateError, raise_exception(), a template's own type errors
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversationError(f"{where or 'a conversation'}: the chat template rejects it ({msg})") from None
    if not isinstance(text, str):
        raise ConversationError(f"{where or 'a conversation'}: the chat template did not render to text")
    return text


# ------------------------------------------------------------------------------ locating


@dataclass
class Piece:
    """One message text (reasoning or content) found in a rendering at [start, end)."""

    msg: int
    field: int  # 0 reasoning, 1 content
    start: int
    end: int
    text: str


@dataclass
class Located:
    """The pieces of one rendering and what of the messages' text was not found verbatim."""

    pieces: list[Piece]
    content_chars: int = 0
    unaligned_chars: int = 0
    unaligned_spans: int = 0


def message_texts(conv: dict) -> list[tuple[int, int, str]]:
    """(message, field, text) of every non-empty reasoning and content string, in order."""
    out = []
    for i, m in enumerate(conv["messages"]):
        for f in REASONING_FIELDS:
            if isinstance(m.get(f), str) and m[f]:
                out.append((i, 0, m[f]))
                break
        if isinstance(m.get("content"), str) and m["content"]:
            out.append((i, 1, m["content"]))
    return out


def locate(text: str, conv: dict) -> Located:
    """Find each message text of `conv` in `text`, in order from a cursor."""
    out = Located([])
    cursor = 0
    for msg, fld, s in message_texts(conv):
        out.content_chars += len(s)
        at = text.find(s, cursor)
        found = s
        if at < 0:
            core = s.strip()
            at = text.find(core, cursor) if core and core != s else -1
            found = core
        if at < 0:
            out.unaligned_chars += len(s)
            out.unaligned_spans += 1
            continue
        if len(found) < len(s):
            out.unaligned_chars += len(s) - len(found)
            out.unaligned_spans += 1
        out.pieces.append(Piece(msg, fld, at, at + len(found), found))
        cursor = at + len(found)
    return out


def shared_pieces(a: list[Piece], b: list[Piece]) -> list[tuple[Piece, Piece]]:
    """Pieces found on both sides with the same text (a side that kept whitespace the other trimmed
    is narrowed to the trimmed core)."""
    by_key = {(p.msg, p.field): p for p in b}
    out = []
    for p in a:
        q = by_key.get((p.msg, p.field))
        if q is None:
            continue
        if p.text != q.text:
            short, long_ = (p, q) if len(p.text) < len(q.text) else (q, p)
            lead = long_.text.find(short.text)
            if lead < 0:
                continue
            narrowed = Piece(long_.msg, long_.field, long_.start + lead, long_.start + lead + len(short.text),
                             short.text)
            p, q = (narrowed, q) if long_ is p else (p, narrowed)
        out.append((p, q))
    return out


# ------------------------------------------------------------------------------ alignment


@dataclass
class Rendering:
    """One side of a conversation: its rendered text, its tokens and where the messages are."""

    text: str
    ids: np.ndarray  # int64 [N]
    offsets: np.ndarray  # int64 [N, 2] character offsets in `text`
    located: Located
    markers: np.ndarray  # bool [N] end-of-turn candidates (special added tokens)


@dataclass
class ConversationAlignment:
    alignment: Alignment
    student_role: np.ndarray  # uint8 [S]
    stats: dict = field(default_factory=dict)


def _layout(s: Rendering, t: Rendering, conv: dict):
    """Region tables of both sides for one conversation: per side (starts, ends, virtual starts,
    virtual lengths, is_piece, role code) in rendered coordinates, and the virtual text length."""
    pairs = shared_pieces(s.located.pieces, t.located.pieces)
    roles = [role_code(m.get("role", "")) for m in conv["messages"]]
    last_asst = max((i for i, r in enumerate(roles) if r == ROLE_ASSISTANT), default=-1)
    code = [r | (LAST_ASSISTANT if i == last_asst else 0) for i, r in enumerate(roles)]
    regions = ([], [])  # per side: lists of (start, end, vstart, vlen, piece, role)
    v = 0
    prev = (0, 0)  # end of the previous piece on each side
    prev_msg = -1
    sides = (s, t)
    for g in range(len(pairs) + 1):
        nxt = pairs[g] if g < len(pairs) else None
        gap = [(prev[k], nxt[k].start if nxt else len(sides[k].text)) for k in (0, 1)]
        ends_turn = prev_msg >= 0 and (nxt is None or nxt[0].msg != prev_msg)
        eot = [None, None]
        if ends_turn:
            for k in (0, 1):
                r = sides[k]
                if r.ids.shape[0]:
                    cand = np.flatnonzero(r.markers & (r.offsets[:, 0] >= gap[k][0]) & (r.offsets[:, 1] <= gap[k][1])
                                          & (r.offsets[:, 1] > r.offsets[:, 0]))
                    if cand.shape[0]:
                        eot[k] = (int(r.offsets[cand[0], 0]), int(r.offsets[cand[0], 1]))
        in_turn = prev_msg >= 0 and (not ends_turn or eot[0] is not None)
        turn_role = code[prev_msg] if prev_msg >= 0 else ROLE_TEMPLATE
        pre = [(gap[k][0], eot[k][0] if eot[k] else gap[k][1]) for k in (0, 1)]
        post = [(eot[k][1], gap[k][1]) if eot[k] else (gap[k][1], gap[k][1]) for k in (0, 1)]
        for k in (0, 1):
            regions[k].append((*pre[k], v, pre[k][1] - pre[k][0], False, turn_role if in_turn else ROLE_TEMPLATE))
            v += pre[k][1] - pre[k][0]
        if eot[0] or eot[1]:
            for k in (0, 1):
                if eot[k]:
                    regions[k].append((*eot[k], v, 1, False, turn_role))
            v += 1
        for k in (0, 1):
            regions[k].append((*post[k], v, post[k][1] - post[k][0], False, ROLE_TEMPLATE))
            v += post[k][1] - post[k][0]
        if nxt is not None:
            for k in (0, 1):
                regions[k].append((nxt[k].start, nxt[k].end, v, nxt[k].end - nxt[k].start, True, code[nxt[0].msg]))
            v += nxt[0].end - nxt[0].start
            prev = (nxt[0].end, nxt[1].end)
            prev_msg = nxt[0].msg
    got = {(p.msg, p.field): p.end - p.start for p, _ in pairs}
    texts = message_texts(conv)
    stats = {"content_chars": sum(len(x) for _, _, x in texts), "shared_chars": sum(got.values()),
             "unaligned_spans": sum(got.get((m, f), 0) < len(x) for m, f, x in texts)}
    stats["unaligned_chars"] = stats["content_chars"] - stats["shared_chars"]
    return regions, v, stats


def _map_tokens(offsets: np.ndarray, table: np.ndarray):
    """Virtual offsets [N, 2], straddle flags [N] and region index [N] of one side's tokens
    (batch-global coordinates) given its region table rows (start, end, vstart, vlen, piece, role)."""
    starts, ends, vstart, vlen, piece = table[:, 0], table[:, 1], table[:, 2], table[:, 3], table[:, 4]
    a, b = offsets[:, 0], offsets[:, 1]
    ra = np.searchsorted(starts, a, side="right") - 1
    rb = np.searchsorted(starts, np.maximum(b - 1, a), side="right") - 1
    # an empty region shares its start with the next one: searchsorted picks the later (non-empty) one
    region = ra.copy()
    straddle = (ra != rb) & (b > a)
    for i in np.flatnonzero(straddle).tolist():
        hit = [r for r in range(int(ra[i]), int(rb[i]) + 1) if piece[r] and ends[r] > a[i] and starts[r] < b[i]]
        region[i] = hit[0] if hit else ra[i]
    r0, w = starts[region], vlen[region]
    va = vstart[region] + np.clip(a - r0, 0, w)
    vb = vstart[region] + np.clip(b - r0, 0, w)
    vb = np.maximum(vb, va + ((b > a) & straddle & (vb == va)))  # a straddling token keeps a character
    return np.stack([va, vb], axis=1), straddle, region


def align_conversations(convs: list[dict], students: list[Rendering], teachers: list[Rendering]) -> list[
        ConversationAlignment]:
    """Chunks and student roles of many conversations, each rendered by the student and the teacher
    (one vectorized `align_flat` walk over the batch)."""
    if not convs:
        return []
    tables = ([], [])
    vlens, shared = [], []
    for conv, s, t in zip(convs, students, teachers):
        regions, v, st = _layout(s, t, conv)
        vlens.append(v)
        shared.append(st)
        for k in (0, 1):
            tab = np.array(regions[k], dtype=np.int64).reshape(-1, 6)
            tables[k].append(tab)
    out_maps = []
    for k, side in enumerate((students, teachers)):
        # batch-global coordinates: rendered offsets by text base, virtual offsets by virtual base
        r_base = np.concatenate(([0], np.cumsum([len(r.text) + 1 for r in side])[:-1]))
        v_base = np.concatenate(([0], np.cumsum(vlens)[:-1]))
        tab = np.concatenate([tb + np.array([rb, rb, vb, 0, 0, 0]) for tb, rb, vb in zip(tables[k], r_base, v_base)])
        counts = np.array([r.ids.shape[0] for r in side], dtype=np.int64)
        offs = np.concatenate([r.offsets.reshape(-1, 2) for r in side] + [np.zeros((0, 2), np.int64)])
        offs = offs + np.repeat(r_base, counts)[:, None]
        voffs, straddle, region = _map_tokens(offs, tab)
        voffs = voffs - np.repeat(v_base, counts)[:, None]
        ids = np.concatenate([r.ids for r in side] + [np.zeros(0, np.int64)])
        out_maps.append((ids, voffs, counts, straddle, tab[region, 5] if region.shape[0] else np.zeros(0, np.int64),
                         offs))
    texts = [" " * n for n in vlens]  # only the lengths matter: the offsets are trusted, not byte-checked
    (s_ids, s_v, s_counts, s_flag, s_role, s_offs), (t_ids, t_v, t_counts, t_flag, _, t_offs) = out_maps
    aligns = align_flat(texts, (s_ids, s_v, s_counts, s_flag), (t_ids, t_v, t_counts, t_flag), None, None)
    wrong = misaligned_chars(aligns, students, teachers, (s_counts, s_offs), (t_counts, t_offs))
    for st, w in zip(shared, wrong.tolist()):
        st["misaligned_chars"] = w
    roles = np.split(s_role.astype(np.uint8), np.cumsum(s_counts)[:-1])
    return [ConversationAlignment(a, r, st) for a, r, st in zip(aligns, roles, shared)]


def misaligned_chars(aligns, students, teachers, s_side, t_side) -> np.ndarray:
    """Per conversation: characters of exact content chunks whose two sides' rendered text differs
    (0 unless the alignment is wrong): the check behind `inspect`'s "misaligned" count. Numpy over
    every exact chunk of the batch (end-of-turn pairs are not content and are left out)."""
    n_docs = len(aligns)
    ends, sides = [], []
    for (counts, offs), rends, key in ((s_side, students, "student_end"), (t_side, teachers, "teacher_end")):
        base = np.concatenate(([0], np.cumsum(counts)[:-1]))
        e = np.concatenate([getattr(a, key).astype(np.int64) + b for a, b in zip(aligns, base)] + [np.zeros(0, np.int64)])
        first = np.concatenate([np.concatenate(([0], getattr(a, key)[:-1].astype(np.int64))) + b
                                for a, b in zip(aligns, base)] + [np.zeros(0, np.int64)])
        marker = np.concatenate([r.markers for r in rends] + [np.zeros(0, bool)])
        ends.append((first, e, marker))
        joined = "\x00".join(r.text for r in rends) + "\x00"
        sides.append((offs, np.frombuffer(joined.encode("utf-32-le"), dtype="<u4")))
    doc = np.repeat(np.arange(n_docs), [a.num_chunks for a in aligns])
    exact = np.concatenate([a.exact for a in aligns] + [np.zeros(0, bool)])
    (sf, se, sm), (tf, te, tm) = ends
    sel = exact & (se > sf) & (te > tf)
    sel[sel] &= ~sm[sf[sel]] & ~tm[tf[sel]]
    (so, s_cp), (to, t_cp) = sides
    a_s, b_s = so[sf[sel], 0], so[se[sel] - 1, 1]
    a_t, b_t = to[tf[sel], 0], to[te[sel] - 1, 1]
    width = b_s - a_s
    bad = width != (b_t - a_t)
    same = ~bad & (width > 0)
    if same.any():
        w = width[same]
        step = np.arange(int(w.sum())) - np.repeat(np.cumsum(w) - w, w)
        diff = s_cp[np.repeat(a_s[same], w) + step] != t_cp[np.repeat(a_t[same], w) + step]
        bad[np.flatnonzero(same)[np.add.reduceat(diff, np.concatenate(([0], np.cumsum(w)[:-1]))) > 0]] = True
    return np.bincount(doc[sel][bad], weights=width[bad], minlength=n_docs).astype(np.int64)


def rendering(tokenizer, text: str, conv: dict, markers: np.ndarray | None = None, *, side: str = "tokenizer",
              encoded=None) -> Rendering:
    """A Rendering of `text` (the conversation rendered by `tokenizer`'s template): tokens without
    added special tokens (the template writes its own), offsets, located pieces, marker flags."""
    from xtcache.align import encode_flat

    if encoded is None:
        ids, offs, _ = encode_flat(tokenizer, [text], add_special_tokens=False, side=side)
    else:
        ids, offs = encoded
    ids = np.asarray(ids, dtype=np.int64)
    if markers is None:
        markers = np.asarray(turn_marker_ids(tokenizer), dtype=np.int64)
    return Rendering(text, ids, np.asarray(offs, dtype=np.int64).reshape(-1, 2), locate(text, conv),
                     np.isin(ids, markers))
