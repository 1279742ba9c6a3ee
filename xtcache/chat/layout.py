"""Conversations: each model renders a transcript with its own chat template; the renderings are aligned.

A conversation is `{"messages": [{role, content, ...}], "tools": [...]}` (tool calls, a `name` and a
reasoning field such as `reasoning_content` pass through to the template as they are). The teacher
and each student render it with the chat template of their own tokenizer, so the two texts differ
in everything the templates add (role headers, separators, injected system text) and agree only
on the messages' text. This module aligns two such renderings:

1. `xtcache.chat.runs.locate_all` places each message's reasoning and content in a rendering by
   construction: the template renders the conversation again with each text replaced by a
   same-length run of a private-use character (`xtcache.chat.runs`, `xtcache.chat.spans`); a text
   the template changed, dropped or trimmed is unaligned (counted, no KD, never trained), never
   searched for or forced into alignment;
2. the pieces found in both renderings are laid out once in a virtual text, each side's template
   text in a block of its own next to the other side's, and each side's tokens are mapped into
   that text by their character offsets; `xtcache.align.chunks.align_flat` then cuts the chunks: shared
   content gives exact chunks, template text gives chunks with an empty other side (no KD);
3. the end-of-turn markers of the two templates (the first special added token after a message's
   last piece) are mapped onto one shared character, so they form one chunk: the student learns
   from the teacher when a turn ends;
4. every student token gets a role code (`ROLE_*`, bit `LAST_ASSISTANT` for the final assistant
   turn): the message's role for its content, for the template text between its content and its
   end-of-turn marker (tool calls) and for the marker itself; 0 for headers and other template
   text. Stage 2 builds its `--train-on` masks from these codes.

A token that straddles a piece boundary (BPE merging a template newline into the content) is mapped
onto the piece and its chunk marked inexact. Rendering runs in Python per conversation; reading
the marked renderings, the layout of every gap and piece, the token mapping, the chunk walk and
the self-check (`xtcache.chat.check`) are numpy over the whole batch.

    python -c "from xtcache.chat.layout import render; help(render)"
"""


from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from schemas.roles import LAST_ASSISTANT, ROLE_ASSISTANT, ROLE_TEMPLATE
from xtcache.align.chunks import Alignment, align_flat
from xtcache.chat.check import exact_ranges, misaligned_chars, misplaced_chars, text_positions, wrong_role_chars
from xtcache.chat.render import Flat, Renderings, flat_side, role_code
from xtcache.chat.spans import pair_spans


@dataclass
class ConversationAlignment:
    alignment: Alignment
    student_role: np.ndarray  # uint8 [S]
    stats: dict = field(default_factory=dict)


def _map_tokens(offsets: np.ndarray, table: np.ndarray):
    """Virtual offsets [N, 2], straddle flags [N] and region index [N] of one side's tokens
    (batch-global coordinates) given its region table rows (start, end, vstart, vlen, piece, role)."""
    # [R] each region's rendered span, virtual start and length, and whether it is a shared piece
    region_start, region_end, region_vstart, region_vlen, is_piece = table[:, :5].T
    tok_start, tok_end = offsets[:, 0], offsets[:, 1]  # [N] each token's rendered characters
    # the region of each character position: the last one starting at or before it (-1 before the first)
    n_pos = int(max(tok_end.max(initial=0), region_start[-1] if region_start.shape[0] else 0)) + 1
    edges = np.concatenate(([0], np.minimum(region_start, n_pos), [n_pos]))
    region_at = np.repeat(np.arange(-1, region_start.shape[0]), np.diff(edges))  # [n_pos]
    first_region = region_at[tok_start]  # [N] the region of each token's first character
    # a token straddles when the next region starts before its last character
    straddle = (tok_end > tok_start) & (region_at[np.maximum(tok_end - 1, tok_start)] != first_region)
    region = first_region.copy()  # [N] the region each token is mapped into: a straddling one's first piece
    over = np.flatnonzero(straddle)
    last_region = np.searchsorted(region_start, tok_end[over] - 1, side="right") - 1  # of each straddling token
    for i, last in zip(over.tolist(), last_region.tolist()):
        hit = [r for r in range(int(first_region[i]), last + 1)
               if is_piece[r] and region_end[r] > tok_start[i] and region_start[r] < tok_end[i]]
        region[i] = hit[0] if hit else first_region[i]
    origin, vlen = region_start[region], region_vlen[region]  # [N] the mapped region's start and length
    v_start = region_vstart[region] + np.clip(tok_start - origin, 0, vlen)
    v_end = region_vstart[region] + np.clip(tok_end - origin, 0, vlen)
    # a straddling token keeps a character
    v_end = np.maximum(v_end, v_start + ((tok_end > tok_start) & straddle & (v_end == v_start)))
    return np.stack([v_start, v_end], axis=1), straddle, region


def _message_roles(convs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Messages of each conversation (int64 [D]) and the role code of every message of the batch
    (int64 [M], conversation by conversation), with `LAST_ASSISTANT` set on each conversation's
    last assistant message."""
    n_docs = len(convs)
    n_msgs = np.fromiter((len(c["messages"]) for c in convs), dtype=np.int64, count=n_docs)
    roles = np.fromiter((role_code(m.get("role")) for c in convs for m in c["messages"]),
                        dtype=np.int64, count=int(n_msgs.sum()))
    msg_doc = np.repeat(np.arange(n_docs), n_msgs)
    asst = np.flatnonzero(roles == ROLE_ASSISTANT)
    last = np.ones(asst.shape[0], dtype=bool)
    last[:-1] = msg_doc[asst[1:]] != msg_doc[asst[:-1]]
    roles[asst[last]] |= LAST_ASSISTANT
    return n_msgs, roles


def _turn_markers(side: Flat, gap_start: np.ndarray, gap_end: np.ndarray, ends_turn: np.ndarray):
    """Per gap (arrays [G], batch coordinates): whether this side has an end-of-turn marker in the
    gap (looked for only where a turn ends), and the marker's start and end (`gap_end` without one)."""
    marks = side.offs[side.markers]  # [K, 2] the side's end-of-turn candidates
    if marks.shape[0] == 0:
        return np.zeros(gap_end.shape[0], dtype=bool), gap_end, gap_end
    j = np.minimum(np.searchsorted(marks[:, 0], gap_start, side="left"), marks.shape[0] - 1)
    has = ends_turn & (marks[j, 0] >= gap_start) & (marks[j, 1] <= gap_end)
    return has, np.where(has, marks[j, 0], gap_end), np.where(has, marks[j, 1], gap_end)


def _coverage_stats(n_docs: int, doc: np.ndarray, length: np.ndarray, paired: np.ndarray,
                    text_width: np.ndarray) -> list[dict]:
    """Each conversation's located message characters, those shared by both sides, and the texts
    and characters left unaligned. `doc`, `length`, `text_width`: each located text's conversation,
    length and shared width (int64 [T]); `paired`: the texts located on both sides (int64 [P])."""
    content_chars = np.bincount(doc, weights=length, minlength=n_docs).astype(np.int64)
    shared_chars = np.bincount(doc[paired], weights=text_width[paired], minlength=n_docs).astype(np.int64)
    got = np.zeros(length.shape[0], np.int64)
    got[paired] = text_width[paired]
    unaligned_spans = np.bincount(doc, weights=got < length, minlength=n_docs).astype(np.int64)
    return [{"content_chars": c, "shared_chars": s, "unaligned_spans": n, "unaligned_chars": c - s}
            for c, s, n in zip(content_chars.tolist(), shared_chars.tolist(), unaligned_spans.tolist())]


@dataclass
class SharedText:
    """The message characters both sides render, for the self-check: where each shared span starts on
    the student side (batch coordinates), its width, its message, each message's text length and role."""

    start: np.ndarray  # int64 [P] student-side start of each shared span
    width: np.ndarray  # int64 [P]
    msg: np.ndarray  # int64 [P] the span's message (batch-global index)
    length: np.ndarray  # int64 [M] characters of each message text
    roles: np.ndarray  # int64 [M] each message's role code


@dataclass
class Layout:
    """A batch laid out in one virtual text: each side's region table (rows of start, end, virtual
    start, virtual length, is-piece, role), each conversation's virtual start and length, its
    coverage stats and the shared text the self-check reads."""

    student_regions: np.ndarray  # int64 [Rs, 6]
    teacher_regions: np.ndarray  # int64 [Rt, 6]
    v_base: np.ndarray  # int64 [D]
    vlens: np.ndarray  # int64 [D]
    stats: list[dict]
    shared: SharedText


def _layout(convs: list[dict], students: Renderings, teachers: Renderings, fs: Flat, ft: Flat) -> Layout:
    """Region tables of a batch of conversations, one walk in numpy over all their gaps.

    A conversation with n shared pieces has n + 1 gaps (before each piece, and after the last);
    each gap lays out, in this order: the student's template text, the teacher's, the paired
    end-of-turn markers (one shared character), the template text after each side's marker, and
    the piece itself (shared by both sides). Per side the rows are (start, end, vstart, vlen,
    is_piece, role) in batch coordinates (rendered offsets in the joined texts, virtual starts
    running over the batch); empty regions are left out. Returns both tables, each conversation's
    virtual start and length, its text counts, and the shared texts' student spans (batch start,
    width), every text's global message index and length, and every message's role code (the self-check's
    input)."""
    n_docs = len(convs)
    # the message texts located in the renderings: T of them over the batch
    n_texts = np.fromiter((len(x.texts) for x in students.located), dtype=np.int64, count=n_docs)  # [D]
    texts = [x for loc in students.located for _, _, x in loc.texts]
    n_msgs, roles = _message_roles(convs)
    doc = np.repeat(np.arange(n_docs), n_texts)  # [T] each text's conversation
    total = int(n_texts.sum())
    msg = np.fromiter((m for loc in students.located for m, _, _ in loc.texts), dtype=np.int64, count=total)
    msg += (np.cumsum(n_msgs) - n_msgs)[doc]  # [T] batch-global message index
    length = np.fromiter((len(x) for x in texts), dtype=np.int64, count=total)  # [T]
    found = [np.fromiter(chain.from_iterable(getattr(loc, key) for loc in side.located), dtype=np.int64, count=total)
             for side in (students, teachers) for key in ("at", "skip", "width")]
    on_both, s_text_start, t_text_start, text_width = pair_spans(*found)  # [T]
    paired = np.flatnonzero(on_both)  # [P] the texts located on both sides: the shared pieces
    paired_doc = doc[paired]  # [P]
    n_paired = np.bincount(paired_doc, minlength=n_docs)  # [D]

    # gaps: pair i sits at gap i + its document; each document ends with a gap of its own (G gaps)
    n_gaps = paired.shape[0] + n_docs
    doc_first_gap = np.cumsum(n_paired) - n_paired + np.arange(n_docs)  # [D]
    doc_last_gap = doc_first_gap + n_paired  # [D] the closing gap
    paired_gap = np.arange(paired.shape[0]) + paired_doc  # [P] the gap each piece ends
    gap_has_piece = np.zeros(n_gaps, dtype=bool)
    gap_has_piece[paired_gap] = True
    # [G] where each gap ends on each side (its piece starts there), and its piece's width
    s_gap_end, t_gap_end, piece_width = (np.zeros(n_gaps, np.int64) for _ in range(3))
    piece_msg = np.full(n_gaps, -1, dtype=np.int64)  # the message of the gap's piece (-1: the closing gap)
    s_gap_end[paired_gap], s_gap_end[doc_last_gap] = s_text_start[paired] + fs.base[paired_doc], fs.base + fs.lens
    t_gap_end[paired_gap], t_gap_end[doc_last_gap] = t_text_start[paired] + ft.base[paired_doc], ft.base + ft.lens
    piece_width[paired_gap] = text_width[paired]
    piece_msg[paired_gap] = msg[paired]
    # [G] where each gap starts on each side (the previous piece ends there), and that piece's message
    s_gap_start, t_gap_start, prev_msg = np.empty_like(s_gap_end), np.empty_like(t_gap_end), np.empty_like(piece_msg)
    s_gap_start[1:], t_gap_start[1:] = (s_gap_end + piece_width)[:-1], (t_gap_end + piece_width)[:-1]
    prev_msg[1:] = piece_msg[:-1]
    s_gap_start[doc_first_gap], t_gap_start[doc_first_gap], prev_msg[doc_first_gap] = fs.base, ft.base, -1
    ends_turn = (prev_msg >= 0) & (~gap_has_piece | (piece_msg != prev_msg))
    turn_role = np.where(prev_msg >= 0, roles[np.maximum(prev_msg, 0)], ROLE_TEMPLATE)
    s_has_eot, s_eot_start, s_eot_end = _turn_markers(fs, s_gap_start, s_gap_end, ends_turn)
    t_has_eot, t_eot_start, t_eot_end = _turn_markers(ft, t_gap_start, t_gap_end, ends_turn)
    pre_role = np.where((prev_msg >= 0) & (~ends_turn | s_has_eot), turn_role, ROLE_TEMPLATE)
    # [G, 6] virtual length of each gap's slots: student / teacher template text before the marker,
    # the shared marker, student / teacher template text after it, the piece; then their virtual starts
    slot_len = np.maximum(np.stack([s_eot_start - s_gap_start, t_eot_start - t_gap_start, s_has_eot | t_has_eot,
                                    s_gap_end - s_eot_end, t_gap_end - t_eot_end, piece_width], axis=1), 0)
    slot_vstart = (np.cumsum(slot_len) - slot_len.reshape(-1)).reshape(n_gaps, 6)
    piece_role = roles[np.maximum(piece_msg, 0)]
    zero, one = np.zeros(n_gaps, np.int64), np.ones(n_gaps, np.int64)
    tables = []
    for k, (gap_start, eot_start, has_eot, eot_end, gap_end) in enumerate((
            (s_gap_start, s_eot_start, s_has_eot, s_eot_end, s_gap_end),
            (t_gap_start, t_eot_start, t_has_eot, t_eot_end, t_gap_end))):
        rows = np.stack([  # [G, 4, 6]: the side's four regions of each gap
            np.stack([gap_start, eot_start, slot_vstart[:, k], slot_len[:, k], zero, pre_role], axis=1),
            np.stack([eot_start, eot_end, slot_vstart[:, 2], one, zero, turn_role], axis=1),
            np.stack([eot_end, gap_end, slot_vstart[:, 3 + k], slot_len[:, 3 + k], zero, zero], axis=1),
            np.stack([gap_end, gap_end + piece_width, slot_vstart[:, 5], piece_width, one, piece_role], axis=1)],
            axis=1)
        keep = np.stack([slot_len[:, k] > 0, has_eot, slot_len[:, 3 + k] > 0, gap_has_piece], axis=1)
        tables.append(rows[keep])
    v_base = slot_vstart[doc_first_gap, 0]  # [D]
    vlens = slot_vstart[doc_last_gap, 5] - v_base  # [D]
    stats = _coverage_stats(n_docs, doc, length, paired, text_width)
    shared = SharedText(s_text_start[paired] + fs.base[paired_doc], text_width[paired], msg, length, roles)
    return Layout(tables[0], tables[1], v_base, vlens, stats, shared)


def segments(s: Renderings, t: Renderings, conv: dict) -> list[tuple[str, str, str, int]]:
    """How one conversation is laid out for alignment (`s`, `t`: its student and teacher Renderings,
    each a batch of one), in order: (student text, teacher text, kind, role code) with kind
    'template' (one side only: no KD), 'content' (the same message text on both sides: exact chunks)
    or 'turn end' (the two end-of-turn markers, paired). For documentation and debugging;
    `align_conversations` does the same work for a batch."""
    lay = _layout([conv], s, t, flat_side(s), flat_side(t))
    tab_s, tab_t = lay.student_regions, lay.teacher_regions
    by_v: dict[int, list] = {}
    for k, tab in enumerate((tab_s, tab_t)):
        for a, b, v, _, piece, role in tab.tolist():
            entry = by_v.setdefault(v, ["", "", "template", role])
            entry[k] = (s, t)[k].texts[0][a:b]
            if piece:
                entry[2] = "content"
            elif b - a and entry[0] and entry[1] and not piece:
                entry[2] = "turn end"
    return [tuple(by_v[v]) for v in sorted(by_v)]


def align_conversations(convs: list[dict], students: Renderings, teachers: Renderings) -> list[
        ConversationAlignment]:
    """Chunks and student roles of many conversations, each rendered by the student and the teacher
    (one vectorized `align_flat` walk over the batch; all renderings of a side from one tokenizer)."""
    if not convs:
        return []
    fs, ft = flat_side(students), flat_side(teachers)
    lay = _layout(convs, students, teachers, fs, ft)
    mapped = []
    for f, tab in zip((fs, ft), (lay.student_regions, lay.teacher_regions)):
        voffs, straddle, region = _map_tokens(f.offs, tab)
        voffs = voffs - np.repeat(lay.v_base, f.counts)[:, None]
        mapped.append((voffs, straddle, tab[region, 5]))
    texts = [" " * n for n in lay.vlens.tolist()]  # only the lengths matter: the offsets are trusted, not byte-checked
    (s_v, s_flag, s_role), (t_v, t_flag, _) = mapped
    if students.replaced is not None:  # their bytes are not the text's U+FFFD: no exact chunk
        s_flag = s_flag | students.replaced
    if teachers.replaced is not None:  # the ids of a same-template student, which the teacher scores, likewise
        t_flag = t_flag | teachers.replaced
    aligns = align_flat(texts, (fs.ids, s_v, fs.counts, s_flag), (ft.ids, t_v, ft.counts, t_flag), None, None)
    _self_check(aligns, students, teachers, fs, ft, s_role, lay.shared, lay.stats)
    roles = np.split(s_role.astype(np.uint8), np.cumsum(fs.counts)[:-1])
    return [ConversationAlignment(a, r, st) for a, r, st in zip(aligns, roles, lay.stats)]


def _self_check(aligns, students: Renderings, teachers: Renderings, fs: Flat, ft: Flat, s_role: np.ndarray,
                shared: SharedText, stats: list[dict]) -> None:
    """Fill each conversation's `misaligned_chars`: the characters that the checks of
    `xtcache.chat.check` find paired with other text (`text_mismatch_chars`), paired with another
    place of the message texts (`misplaced_chars`) or in a student token of the wrong role
    (`wrong_role_chars`); each count is kept in the stats as well."""
    start, width, msg, length, roles = shared.start, shared.width, shared.msg, shared.length, shared.roles
    # the message of each student character, read from the marked rendering, on the shared spans only
    # (a text located on one side is template text to the layout)
    pos = text_positions(students, fs)
    at = np.repeat(start - (np.cumsum(width) - width), width) + np.arange(int(width.sum()))  # the shared characters
    of_text = pos[at]
    at, of_text = at[of_text >= 0], of_text[of_text >= 0]
    text_msg = np.repeat(msg, length)[of_text] if of_text.shape[0] else of_text  # each one's message
    ranges = exact_ranges(aligns, fs, ft)
    counts = {"text_mismatch_chars": misaligned_chars(aligns, students, teachers, fs, ft, ranges),
              "misplaced_chars": misplaced_chars(aligns, students, teachers, fs, ft, pos, ranges),
              "wrong_role_chars": wrong_role_chars(fs, s_role, at, text_msg, roles)}
    for d, st in enumerate(stats):
        for key, c in counts.items():
            st[key] = int(c[d])
        st["misaligned_chars"] = sum(st[key] for key in counts)
