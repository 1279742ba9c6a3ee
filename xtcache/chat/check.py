"""The self-check of a conversation alignment (`xtcache.chat.layout`): the counts behind `inspect`'s
"misaligned chars", each a second method against the located message texts (`xtcache.chat.spans`),
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

    python -c "from xtcache.chat.check import misplaced_chars; help(misplaced_chars)"
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from xtcache.chat.render import Flat, Renderings, flat_side


def exact_ranges(aligns, fs: Flat, ft: Flat) -> tuple[np.ndarray, ...]:
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
                     ft: Flat | None = None, ranges: tuple | None = None) -> np.ndarray:
    """Per conversation: characters of exact content chunks whose two sides' rendered text differs
    (0 unless the alignment is wrong). Runs of chunks that continue each other are compared as
    whole strings, a differing run chunk by chunk. `ranges`: the exact chunks' (`exact_ranges`),
    when already at hand."""
    fs, ft = fs or flat_side(students), ft or flat_side(teachers)
    doc, a_s, b_s, a_t, b_t = ranges or exact_ranges(aligns, fs, ft)
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
    locs = side.located
    n_texts = np.fromiter((len(x.texts) for x in locs), dtype=np.int64, count=len(locs))
    total = int(n_texts.sum())
    at = np.fromiter(chain.from_iterable(x.at for x in locs), dtype=np.int64, count=total)
    got = np.flatnonzero(at >= 0)
    if not got.shape[0]:
        return out
    skip, width, shift = (np.fromiter(chain.from_iterable(getattr(x, key) or [0] * len(x.texts) for x in locs),
                                      dtype=np.int64, count=total) for key in ("skip", "width", "shift"))
    texts = [s for x in locs for _, _, s in x.texts]
    length = np.fromiter(map(len, texts), dtype=np.int64, count=total)
    starts = np.cumsum(length) - length
    lead, n_core = np.zeros(total, dtype=np.int64), length.copy()
    for j in [j for j, s in enumerate(texts) if s[:1].isspace() or s[-1:].isspace()]:
        lead[j], n_core[j] = len(texts[j]) - len(texts[j].lstrip()), len(texts[j].strip())
    doc = np.repeat(np.arange(len(locs)), n_texts)
    # the located spans with kept whitespace, from Located (a span without is its core)
    ws = got[width[got] != n_core[got]]
    out[_ranges(at[ws] + f.base[doc[ws]], width[ws])] = _ranges(starts[ws] + skip[ws], width[ws])
    # the cores, from the marked renderings
    c0 = at[got] + lead[got] - skip[got]  # where the core starts in its rendering
    d = doc[got]
    out[_ranges(f.base[d] + c0, n_core[got])] = _cores_read(locs, n_texts, starts + lead, got, d, c0 - shift[got],
                                                           n_core[got])
    return out


def _ranges(starts: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """starts[i], starts[i] + 1, ..., starts[i] + widths[i] - 1 for every i, concatenated."""
    return np.repeat(starts - (np.cumsum(widths) - widths), widths) + np.arange(int(widths.sum()))


def _cores_read(locs, n_texts: np.ndarray, core_start: np.ndarray, got: np.ndarray, doc: np.ndarray,
                m0: np.ndarray, n_core: np.ndarray) -> np.ndarray:
    """For the characters [m0, m0 + n_core) of each located text's marked rendering (text `got` of
    conversation `doc`), the index in all texts concatenated of the core character each placeholder
    stands for (text k's run of chr(base + k): its core's character at the offset in the run), -1
    for template text. A range that is one run of its own text's placeholder, starting where the
    range starts, reads as its core; any other conversation is read character by character."""
    marked = [x.marked or "" for x in locs]
    lens = np.fromiter((len(m) + 1 for m in marked), dtype=np.int64, count=len(locs))
    m_base = np.cumsum(lens) - lens
    codes = np.frombuffer("".join(m + "\x00" for m in marked).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    base = np.fromiter((x.base for x in locs), dtype=np.int64, count=len(locs))
    k = got - (np.cumsum(n_texts) - n_texts)[doc]  # each text's index in its conversation
    inside = (m0 >= 0) & (m0 + n_core <= lens[doc] - 1)
    start = np.where(inside, m_base[doc] + m0, 0)
    idx = _ranges(start, n_core)
    own = (base[doc] + k).astype(np.uint32)
    at = np.cumsum(n_core) - n_core  # where each range's characters are in idx and out
    same = inside & (codes[np.maximum(start - 1, 0)] != own)  # the run starts at m0 (a separator precedes each)
    same[np.searchsorted(at, np.flatnonzero(codes[idx] != np.repeat(own, n_core)), side="right") - 1] = False
    out = _ranges(core_start[got], n_core)
    first = np.cumsum(n_texts) - n_texts
    for d in np.unique(doc[~same]).tolist():  # read character by character
        mine = np.flatnonzero(doc == d)
        n = int(n_texts[d])
        got_d = _doc_read(locs[d], core_start[first[d]:first[d] + n], m0[mine].tolist(), n_core[mine].tolist())
        out[at[mine[0]]:at[mine[0]] + got_d.shape[0]] = got_d
    return out


def _doc_read(loc, core_start: np.ndarray, m0: list[int], n_core: list[int]) -> np.ndarray:
    """`_cores_read` for one conversation, every character of its marked rendering read (its
    placeholder, and where its run starts)."""
    code = np.frombuffer(loc.marked.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64) - loc.base
    own = np.where((code >= 0) & (code < core_start.shape[0]), code, -1)
    pos = np.arange(own.shape[0])
    run_start = np.maximum.accumulate(np.where(np.concatenate(([True], own[1:] != own[:-1])), pos, 0))
    in_text = np.where(own >= 0, core_start[np.maximum(own, 0)] + pos - run_start, -1)
    return np.concatenate([in_text[a:a + w] for a, w in zip(m0, n_core)] + [np.zeros(0, np.int64)])


def misplaced_chars(aligns, students: Renderings, teachers: Renderings, fs: Flat, ft: Flat,
                    s_positions: np.ndarray | None = None, ranges: tuple | None = None) -> np.ndarray:
    """Per conversation: characters of exact content chunks where the student's character and the
    teacher's are not the same character of the same message text (or are template text).
    `s_positions`: the students' `text_positions`, when already at hand; `ranges`: the exact
    chunks' (`exact_ranges`), likewise."""
    doc, a_s, b_s, a_t, b_t = ranges or exact_ranges(aligns, fs, ft)
    width = b_s - a_s
    uneven = width != (b_t - a_t)
    bad = np.bincount(doc[uneven], weights=width[uneven], minlength=len(aligns)).astype(np.int64)
    even = np.flatnonzero(~uneven)
    w = width[even]
    s_at = _ranges(a_s[even], w)
    s_pos = (text_positions(students, fs) if s_positions is None else s_positions)[s_at]
    t_pos = text_positions(teachers, ft)[s_at + np.repeat(a_t[even] - a_s[even], w)]
    wrong = s_at[(s_pos != t_pos) | (s_pos < 0)]
    return bad + np.bincount(np.searchsorted(fs.base, wrong, side="right") - 1, minlength=len(aligns))


def wrong_role_chars(f: Flat, token_roles: np.ndarray, text_at: np.ndarray, text_msg: np.ndarray,
                     msg_roles: np.ndarray) -> np.ndarray:
    """Per conversation: characters of student tokens whose role code differs from what their
    characters call for. `text_at` (sorted) and `text_msg`: the joined characters that render a
    shared message text and the batch-global index of that message; `msg_roles`: each message's
    role code. A token with message text carries the role of its first or last such character's
    message; one of template text only carries 0 or the role of the message text before it in its
    conversation (a turn's tail: tool calls, its end-of-turn marker)."""
    n_docs = f.counts.shape[0]
    if text_at.shape[0] == 0 or f.offs.shape[0] == 0:
        return np.zeros(n_docs, dtype=np.int64)
    a, b = f.offs[:, 0], f.offs[:, 1]
    text_role = msg_roles[text_msg]
    last = text_at.shape[0] - 1
    before_pos = np.zeros(int((f.lens + 1).sum()) + 1, dtype=np.int64)  # text characters before each position
    is_text = np.zeros(before_pos.shape[0] - 1, dtype=bool)
    is_text[text_at] = True
    np.cumsum(is_text, out=before_pos[1:])
    i_a, i_b = before_pos[a], before_pos[b]
    roles = token_roles.astype(np.int64)
    has_text = i_b > i_a
    ok_text = (roles == text_role[np.minimum(i_a, last)]) | (roles == text_role[np.maximum(i_b - 1, 0)])
    doc = np.repeat(np.arange(n_docs), f.counts)
    before = np.maximum(i_a - 1, 0)  # the last text character before the token, in its conversation or not
    tail = np.where((i_a > 0) & (text_at[before] >= f.base[doc]), text_role[before], 0)
    bad = (b > a) & np.where(has_text, ~ok_text, (roles != 0) & (roles != tail))
    return np.bincount(doc[bad], weights=(b - a)[bad], minlength=n_docs).astype(np.int64)
