"""The self-check of a conversation alignment (`xtcache.chat`): the counts behind `inspect`'s
"misaligned chars", each a second method against the located message texts (`xtcache.chat_spans`),
not the layout repeated:

- `misaligned_chars`: exact content chunks whose two sides' rendered text differs;
- `misplaced_chars`: exact content chunks whose student and teacher characters are not the same
  character of the same message text (equal text at the wrong place: a short message paired with
  another occurrence of its text is caught here, not by comparing strings);
- `wrong_role_chars`: student tokens whose role code is not the one their characters call for
  (content of a message: that message's role; template text: 0, or the role of the turn whose
  tail it is), read per character, without the layout's region tables.

All numpy over a batch, in the batch coordinates of `flat_side` (renderings joined with one
separator character).

    python -c "from xtcache.chat_check import misplaced_chars; help(misplaced_chars)"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from xtcache.chat import Renderings


@dataclass
class Flat:
    """One side of a batch: tokens concatenated, offsets shifted into the joined texts."""

    ids: np.ndarray
    offs: np.ndarray  # batch-global character offsets (document d starts at base[d])
    counts: np.ndarray
    base: np.ndarray
    lens: np.ndarray  # characters of each rendering
    markers: np.ndarray  # bool [N]: end-of-turn candidates with a non-empty span


def flat_side(side: Renderings) -> Flat:
    lens = np.fromiter((len(x) for x in side.texts), dtype=np.int64, count=len(side))
    base = np.cumsum(lens + 1) - (lens + 1)
    offs = side.offsets + np.repeat(base, side.counts)[:, None]
    markers = np.isin(side.ids, side.marker_ids) & (offs[:, 1] > offs[:, 0])
    return Flat(side.ids, offs, side.counts, base, lens, markers)


def _exact_ranges(aligns, fs: Flat, ft: Flat) -> tuple[np.ndarray, ...]:
    """Document and character ranges (batch coordinates) on each side of every exact chunk that is
    not an end-of-turn pair and has tokens on both sides."""
    n_docs = len(aligns)
    n_chunks = np.fromiter((a.num_chunks for a in aligns), dtype=np.int64, count=n_docs)
    ends = []
    for f, key in ((fs, "student_end"), (ft, "teacher_end")):
        tok_base = np.cumsum(f.counts) - f.counts
        e = np.concatenate([getattr(a, key) for a in aligns] + [np.zeros(0, np.int32)]).astype(np.int64)
        e += np.repeat(tok_base, n_chunks)
        first = np.concatenate(([0], e[:-1])) if e.shape[0] else e
        starts_doc = np.cumsum(n_chunks) - n_chunks
        has = n_chunks > 0
        first[starts_doc[has]] = tok_base[has]
        ends.append((first, e))
    doc = np.repeat(np.arange(n_docs), n_chunks)
    exact = np.concatenate([a.exact for a in aligns] + [np.zeros(0, bool)])
    (sf, se), (tf, te) = ends
    sel = exact & (se > sf) & (te > tf)
    sel[sel] &= ~fs.markers[sf[sel]] & ~ft.markers[tf[sel]]
    return (doc[sel], fs.offs[sf[sel], 0], fs.offs[se[sel] - 1, 1], ft.offs[tf[sel], 0], ft.offs[te[sel] - 1, 1])


def misaligned_chars(aligns, students: Renderings, teachers: Renderings, fs: Flat | None = None,
                     ft: Flat | None = None) -> np.ndarray:
    """Per conversation: characters of exact content chunks whose two sides' rendered text differs
    (0 unless the alignment is wrong). Runs of chunks that continue each other are compared as
    whole strings, a differing run chunk by chunk."""
    fs, ft = fs or flat_side(students), ft or flat_side(teachers)
    doc, a_s, b_s, a_t, b_t = _exact_ranges(aligns, fs, ft)
    width = b_s - a_s
    bad = width != (b_t - a_t)
    same = np.flatnonzero(~bad & (width > 0))
    if same.shape[0]:
        s_text, t_text = ("\x00".join(r.texts) + "\x00" for r in (students, teachers))  # flat_side's coordinates
        a_s, b_s, a_t, b_t = a_s[same], b_s[same], a_t[same], b_t[same]
        run = np.flatnonzero(np.concatenate(([True], (a_s[1:] != b_s[:-1]) | (a_t[1:] != b_t[:-1]))))
        last = np.concatenate((run[1:], [same.shape[0]])) - 1
        for r0, r1, x0, x1, y0 in zip(run.tolist(), last.tolist(), a_s[run].tolist(), b_s[last].tolist(),
                                      a_t[run].tolist()):
            if s_text[x0:x1] != t_text[y0:y0 + x1 - x0]:
                for c in range(r0, r1 + 1):
                    x, y, w = int(a_s[c]), int(a_t[c]), int(b_s[c] - a_s[c])
                    bad[same[c]] = s_text[x:x + w] != t_text[y:y + w]
    return np.bincount(doc[bad], weights=width[bad], minlength=len(aligns)).astype(np.int64)


def text_positions(side: Renderings, f: Flat) -> np.ndarray:
    """int64 [characters of the joined renderings]: for each character, which character of the
    batch's message texts it renders (its index in all texts concatenated), -1 for template text.
    The characters of each located text's core are read from the marked rendering (which run, and
    where in it), not from where the text was located; its kept whitespace from `Located`."""
    out = np.full(int((f.lens + 1).sum()), -1, dtype=np.int64)
    text_base = 0
    for d, loc in enumerate(side.located):
        begin = int(f.base[d])
        lengths = [len(s) for _, _, s in loc.texts]
        starts = np.cumsum([text_base] + lengths[:-1]) if lengths else np.zeros(0, np.int64)
        got = [k for k, a in enumerate(loc.at) if a >= 0]
        for k in got:  # the whole located span, from Located
            a, w = loc.at[k] + begin, loc.width[k]
            out[a:a + w] = starts[k] + loc.skip[k] + np.arange(w)
        if got:
            code = np.frombuffer(loc.marked.encode("utf-32-le"), dtype=np.uint32).astype(np.int64) - loc.base
            own = np.where((code >= 0) & (code < len(lengths)), code, -1)
            pos = np.arange(own.shape[0])
            run_start = np.maximum.accumulate(np.where(np.concatenate(([True], own[1:] != own[:-1])), pos, 0))
            lead = np.array([len(s) - len(s.lstrip()) for _, _, s in loc.texts], dtype=np.int64)
            in_text = np.where(own >= 0, starts[np.maximum(own, 0)] + lead[np.maximum(own, 0)] + pos - run_start, -1)
            for k in got:  # the core, from the marked rendering
                c0 = loc.at[k] + int(lead[k]) - loc.skip[k]  # where the core starts in the rendering
                m0, n_core = c0 - loc.shift[k], len(loc.texts[k][2].strip())
                out[begin + c0:begin + c0 + n_core] = in_text[m0:m0 + n_core]
        text_base += sum(lengths)
    return out


def misplaced_chars(aligns, students: Renderings, teachers: Renderings, fs: Flat, ft: Flat,
                    s_positions: np.ndarray | None = None) -> np.ndarray:
    """Per conversation: characters of exact content chunks where the student's character and the
    teacher's are not the same character of the same message text (or are template text).
    `s_positions`: the students' `text_positions`, when already at hand."""
    doc, a_s, b_s, a_t, b_t = _exact_ranges(aligns, fs, ft)
    width = b_s - a_s
    bad = np.zeros(len(aligns), dtype=np.int64)
    uneven = width != (b_t - a_t)
    np.add.at(bad, doc[uneven], width[uneven])
    even = np.flatnonzero(~uneven)
    w = width[even]
    inner = np.arange(int(w.sum())) - np.repeat(np.cumsum(w) - w, w)
    s_pos = (text_positions(students, fs) if s_positions is None else s_positions)[np.repeat(a_s[even], w) + inner]
    t_pos = text_positions(teachers, ft)[np.repeat(a_t[even], w) + inner]
    wrong = (s_pos != t_pos) | (s_pos < 0)
    return bad + np.bincount(np.repeat(doc[even], w)[wrong], minlength=len(aligns)).astype(np.int64)


def wrong_role_chars(f: Flat, token_roles: np.ndarray, owner: np.ndarray, msg_roles: np.ndarray) -> np.ndarray:
    """Per conversation: characters of student tokens whose role code differs from what their
    characters call for. `owner` [joined characters]: the batch-global message index of the shared
    message text each character renders (-1: template text); `msg_roles`: each message's role code.
    A token with message text carries the role of its first or last such character's message; one
    of template text only carries 0 or the role of the message text before it in its conversation
    (a turn's tail: tool calls, its end-of-turn marker)."""
    n = owner.shape[0]
    n_docs = f.counts.shape[0]
    if n == 0 or f.offs.shape[0] == 0:
        return np.zeros(n_docs, dtype=np.int64)
    pos = np.arange(n)
    is_text = owner >= 0
    prev_text = np.maximum.accumulate(np.where(is_text, pos, -1))  # last text character at or before
    next_text = np.minimum.accumulate(np.where(is_text, pos, n)[::-1])[::-1]  # first at or after
    a, b = f.offs[:, 0], f.offs[:, 1]
    doc = np.repeat(np.arange(n_docs), f.counts)
    roles = token_roles.astype(np.int64)
    role_of = lambda i: np.where(i >= 0, msg_roles[owner[np.clip(i, 0, n - 1)]], 0)  # noqa: E731
    first = next_text[np.minimum(a, n - 1)]
    has_text = first < b
    last = prev_text[np.maximum(b - 1, 0)]
    ok_text = (roles == role_of(np.where(has_text, first, -1))) | (roles == role_of(np.where(has_text, last, -1)))
    before = prev_text[np.maximum(a - 1, 0)]
    tail = role_of(np.where((a > 0) & (before >= f.base[doc]), before, -1))
    ok_template = (roles == 0) | (roles == tail)
    bad = (b > a) & np.where(has_text, ~ok_text, ~ok_template)
    return np.bincount(doc[bad], weights=(b - a)[bad], minlength=n_docs).astype(np.int64)
