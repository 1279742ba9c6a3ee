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
from bisect import bisect_left
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
    """The JSON text of a conversation as the store keeps it: compact, keys in the row's own order
    (templates render mappings such as tool schemas in insertion order, so sorting would change
    the rendered text)."""
    return json.dumps(conv, separators=(",", ":"), ensure_ascii=False)


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
    texts: list = field(default_factory=list)  # message_texts() of the conversation


def message_texts(conv: dict) -> list[tuple[int, int, str]]:
    """(message, field, text) of every non-empty reasoning and content string, in order."""
    out = []
    for i, m in enumerate(conv["messages"]):
        r = m.get("reasoning_content") or m.get("reasoning") or m.get("thinking")
        if r and isinstance(r, str):
            out.append((i, 0, r))
        c = m.get("content")
        if c and isinstance(c, str):
            out.append((i, 1, c))
    return out


def locate(text: str, conv: dict) -> Located:
    """Find each message text of `conv` in `text`, in order from a cursor."""
    out = Located([], texts=message_texts(conv))
    cursor = 0
    for msg, fld, s in out.texts:
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
    marker_ids: np.ndarray  # int64: the tokenizer's end-of-turn candidates (special added tokens)

    @property
    def markers(self) -> np.ndarray:
        """bool [N]: the tokens that are end-of-turn candidates."""
        return np.isin(self.ids, self.marker_ids)


@dataclass
class ConversationAlignment:
    alignment: Alignment
    student_role: np.ndarray  # uint8 [S]
    stats: dict = field(default_factory=dict)


def _layout(s: Rendering, t: Rendering, conv: dict, marks, out, v: int, bases: tuple[int, int]) -> tuple[int, dict]:
    """Append the regions of one conversation to `out` (per side: rows (start, end, vstart, vlen,
    is_piece, role) in batch coordinates: rendered offsets plus `bases`, virtual starts from `v`);
    `marks` per side: sorted starts and ends of its end-of-turn candidates. Empty regions are left
    out. Returns the virtual end and the text counts."""
    pairs = shared_pieces(s.located.pieces, t.located.pieces)
    roles = [_ROLE_CODES.get(m.get("role"), ROLE_OTHER) for m in conv["messages"]]
    last_asst = max((i for i, r in enumerate(roles) if r == ROLE_ASSISTANT), default=-1)
    if last_asst >= 0:
        roles[last_asst] |= LAST_ASSISTANT
    out_s, out_t = out
    bs, bt = bases
    (ms_start, ms_end), (mt_start, mt_end) = marks
    ps = pt = 0  # end of the previous piece on each side
    prev_msg = -1
    n = len(pairs)
    shared = 0
    for g in range(n + 1):
        if g < n:
            p, q = pairs[g]
            es, et = p.start, q.start
            ends_turn = prev_msg >= 0 and p.msg != prev_msg
        else:
            es, et = len(s.text), len(t.text)
            ends_turn = prev_msg >= 0
        eot_s = eot_t = None
        if ends_turn:
            j = bisect_left(ms_start, ps)
            if j < len(ms_start) and ms_end[j] <= es:
                eot_s = (ms_start[j], ms_end[j])
            j = bisect_left(mt_start, pt)
            if j < len(mt_start) and mt_end[j] <= et:
                eot_t = (mt_start[j], mt_end[j])
        turn_role = roles[prev_msg] if prev_msg >= 0 else ROLE_TEMPLATE
        pre_role = turn_role if prev_msg >= 0 and (not ends_turn or eot_s is not None) else ROLE_TEMPLATE
        e1 = eot_s[0] if eot_s else es
        if e1 > ps:
            out_s.append((ps + bs, e1 + bs, v, e1 - ps, 0, pre_role))
            v += e1 - ps
        e2 = eot_t[0] if eot_t else et
        if e2 > pt:
            out_t.append((pt + bt, e2 + bt, v, e2 - pt, 0, pre_role))
            v += e2 - pt
        if eot_s or eot_t:
            if eot_s:
                out_s.append((eot_s[0] + bs, eot_s[1] + bs, v, 1, 0, turn_role))
            if eot_t:
                out_t.append((eot_t[0] + bt, eot_t[1] + bt, v, 1, 0, turn_role))
            v += 1
        a1 = eot_s[1] if eot_s else es
        if es > a1:
            out_s.append((a1 + bs, es + bs, v, es - a1, 0, ROLE_TEMPLATE))
            v += es - a1
        a2 = eot_t[1] if eot_t else et
        if et > a2:
            out_t.append((a2 + bt, et + bt, v, et - a2, 0, ROLE_TEMPLATE))
            v += et - a2
        if g < n:
            width = p.end - p.start
            role = roles[p.msg]
            out_s.append((p.start + bs, p.end + bs, v, width, 1, role))
            out_t.append((q.start + bt, q.end + bt, v, width, 1, role))
            v += width
            shared += width
            ps, pt = p.end, q.end
            prev_msg = p.msg
    texts = s.located.texts
    content = sum(len(x) for _, _, x in texts)
    got = {(p.msg, p.field): p.end - p.start for p, _ in pairs}
    spans = sum(1 for m, f, x in texts if got.get((m, f), 0) < len(x))
    return v, {"content_chars": content, "shared_chars": shared, "unaligned_spans": spans,
               "unaligned_chars": content - shared}


def segments(s: Rendering, t: Rendering, conv: dict) -> list[tuple[str, str, str, int]]:
    """How one conversation's two renderings are laid out for alignment, in order: (student text,
    teacher text, kind, role code) with kind 'template' (one side only: no KD), 'content' (the same
    message text on both sides: exact chunks) or 'turn end' (the two end-of-turn markers, paired).
    For documentation and debugging; `align_conversations` does the same work for a batch."""
    marks = []
    for r in (s, t):
        m = r.markers & (r.offsets[:, 1] > r.offsets[:, 0])
        marks.append((r.offsets[m, 0].tolist(), r.offsets[m, 1].tolist()))
    rows: tuple[list, list] = ([], [])
    _layout(s, t, conv, marks, rows, 0, (0, 0))
    by_v: dict[int, list] = {}
    for k, side in enumerate(rows):
        for a, b, v, _, piece, role in side:
            entry = by_v.setdefault(v, ["", "", "template", role])
            entry[k] = (s, t)[k].text[a:b]
            if piece:
                entry[2] = "content"
            elif b - a and entry[0] and entry[1] and not piece:
                entry[2] = "turn end"
    return [tuple(by_v[v]) for v in sorted(by_v)]


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


@dataclass
class _Flat:
    """One side of a batch: tokens concatenated, offsets shifted into the joined texts."""

    ids: np.ndarray
    offs: np.ndarray  # batch-global character offsets (document d starts at base[d])
    counts: np.ndarray
    base: np.ndarray
    markers: np.ndarray  # bool [N]


def _flat_side(side: list[Rendering]) -> tuple[_Flat, list]:
    counts = np.fromiter((r.ids.shape[0] for r in side), dtype=np.int64, count=len(side))
    base = np.concatenate(([0], np.cumsum([len(r.text) + 1 for r in side])[:-1])).astype(np.int64)
    ids = np.concatenate([r.ids for r in side] + [np.zeros(0, np.int64)])
    offs = np.concatenate([r.offsets.reshape(-1, 2) for r in side] + [np.zeros((0, 2), np.int64)])
    offs = offs + np.repeat(base, counts)[:, None]
    markers = np.isin(ids, side[0].marker_ids) & (offs[:, 1] > offs[:, 0])
    mk = np.flatnonzero(markers)
    doc_of = np.searchsorted(np.cumsum(counts), mk, side="right")
    local = offs[mk] - base[doc_of][:, None]
    cuts = np.searchsorted(doc_of, np.arange(1, len(side)))
    spans = [(a.tolist(), b.tolist()) for a, b in zip(np.split(local[:, 0], cuts), np.split(local[:, 1], cuts))]
    return _Flat(ids, offs, counts, base, markers), spans


def align_conversations(convs: list[dict], students: list[Rendering], teachers: list[Rendering]) -> list[
        ConversationAlignment]:
    """Chunks and student roles of many conversations, each rendered by the student and the teacher
    (one vectorized `align_flat` walk over the batch; all renderings of a side from one tokenizer)."""
    if not convs:
        return []
    (fs, s_spans), (ft, t_spans) = _flat_side(students), _flat_side(teachers)
    rows: tuple[list, list] = ([], [])
    v_base, vlens, stats = [], [], []
    v = 0
    s_base, t_base = fs.base.tolist(), ft.base.tolist()
    for d, (conv, s, t) in enumerate(zip(convs, students, teachers)):
        end, st = _layout(s, t, conv, (s_spans[d], t_spans[d]), rows, v, (s_base[d], t_base[d]))
        v_base.append(v)
        vlens.append(end - v)
        stats.append(st)
        v = end
    v_base = np.asarray(v_base, dtype=np.int64)
    mapped = []
    for k, f in enumerate((fs, ft)):
        tab = np.array(rows[k], dtype=np.int64).reshape(-1, 6)
        voffs, straddle, region = _map_tokens(f.offs, tab)
        voffs = voffs - np.repeat(v_base, f.counts)[:, None]
        mapped.append((voffs, straddle, tab[region, 5]))
    texts = [" " * n for n in vlens]  # only the lengths matter: the offsets are trusted, not byte-checked
    (s_v, s_flag, s_role), (t_v, t_flag, _) = mapped
    aligns = align_flat(texts, (fs.ids, s_v, fs.counts, s_flag), (ft.ids, t_v, ft.counts, t_flag), None, None)
    wrong = misaligned_chars(aligns, students, teachers, fs, ft)
    for st, w in zip(stats, wrong.tolist()):
        st["misaligned_chars"] = w
    roles = np.split(s_role.astype(np.uint8), np.cumsum(fs.counts)[:-1])
    return [ConversationAlignment(a, r, st) for a, r, st in zip(aligns, roles, stats)]


def misaligned_chars(aligns, students: list[Rendering], teachers: list[Rendering], fs: _Flat | None = None,
                     ft: _Flat | None = None) -> np.ndarray:
    """Per conversation: characters of exact content chunks whose two sides' rendered text differs
    (0 unless the alignment is wrong): the check behind `inspect`'s "misaligned" count. Numpy over
    every exact chunk of the batch (end-of-turn pairs are not content and are left out)."""
    n_docs = len(aligns)
    fs = fs or _flat_side(students)[0]
    ft = ft or _flat_side(teachers)[0]
    ends, sides = [], []
    for f, rends, key in ((fs, students, "student_end"), (ft, teachers, "teacher_end")):
        tok_base = np.concatenate(([0], np.cumsum(f.counts)[:-1]))
        e = np.concatenate([getattr(a, key).astype(np.int64) + b for a, b in zip(aligns, tok_base.tolist())]
                           + [np.zeros(0, np.int64)])
        n_chunks = np.array([a.num_chunks for a in aligns], dtype=np.int64)
        first = np.concatenate(([0], e[:-1])) if e.shape[0] else e
        starts_doc = np.cumsum(n_chunks) - n_chunks
        has = n_chunks > 0
        first[starts_doc[has]] = tok_base[has]
        ends.append((first, e))
        joined = "\x00".join(r.text for r in rends) + "\x00"
        sides.append((f.offs, f.markers, np.frombuffer(joined.encode("utf-32-le"), dtype="<u4")))
    doc = np.repeat(np.arange(n_docs), [a.num_chunks for a in aligns])
    exact = np.concatenate([a.exact for a in aligns] + [np.zeros(0, bool)])
    (sf, se), (tf, te) = ends
    (so, sm, s_cp), (to, tm, t_cp) = sides
    sel = exact & (se > sf) & (te > tf)
    sel[sel] &= ~sm[sf[sel]] & ~tm[tf[sel]]
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
                     np.asarray(markers, dtype=np.int64))
