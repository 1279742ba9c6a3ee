"""Chunk alignment of a student and a teacher tokenization of the same text.

Two tokenizations of one text are cut into chunks: runs of student tokens and runs of teacher
tokens that cover the same characters. A chunk boundary is any character position that is a clean
cut on both sides (every token before it ends at or before it, every token after it starts at or
after it). The walk is the two-pointer merge over character end offsets, written as numpy array
operations (each side marks its clean-cut positions; both marks give the boundaries), so it runs in
linear time with no Python loop per token and no length limit. `align_batch`/`align_texts` walk
many documents at once (joined with a separator no chunk crosses), paying numpy's fixed costs once.

Special tokens with empty offsets (BOS, EOS, PAD) are placed where they sit in the token sequence
and paired by role when both sides have one at the same place; an unpaired one becomes a chunk of
its own with an empty other side. When a `TokenizerInfo` is given for a side, every group of
tokens is checked against the text: the tokens' bytes must reproduce `text[start:end]` (a leading
space that the tokenizer itself inserts, as SentencePiece's `▁` and `add_prefix_space` do, is
allowed where pre-tokenization starts). Offsets that fail the check raise `AlignmentError`
instead of giving a wrong alignment. A control token that the text spells (`<|pad|>`, or an added token
marked special such as Llama-3's `<|reserved_special_token_0|>` and chat headers, matched in plain text as one
id) and an unknown token make their chunk inexact: the token is not the text its name spells.

This module holds `Alignment`, the chunk walk (`align_flat`) and its entry points, and the chunk
statistics; the parts it walks over live beside it and are re-exported here:
`xtcache.align.tokenizer` (`TokenizerInfo`, `tokenizer_info`, `encode_flat`, the role bits),
`xtcache.align.sides` (one side's tokens validated and split for the walk) and `xtcache.align.bytes`
(the byte check of tokens against the text).

    python -c "from xtcache.align.chunks import align_text; help(align_text)"
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xtcache.align.bytes import check_pieces, text_bytes
from xtcache.align.sides import Side, flat_documents, prepare_side
from xtcache.align.tokenizer import (
    TokenizerInfo,
    encode_flat,
    tokenizer_info,
)
from xtcache.errors import AlignmentError


@dataclass(frozen=True, eq=False)
class Alignment:
    """Chunks of one document: exclusive end indices into the student and teacher tokens.

    Chunk `c` covers student tokens `[student_end[c-1], student_end[c])` and teacher tokens
    `[teacher_end[c-1], teacher_end[c])`. `exact[c]` says both sides spell exactly the same
    text (a pair of special tokens with the same role also counts as exact). `char_end` (optional,
    not stored in caches) is the exclusive character end of each chunk in the text.
    """

    student_end: np.ndarray  # int32 [C]
    teacher_end: np.ndarray  # int32 [C]
    exact: np.ndarray  # bool [C]
    char_end: np.ndarray | None = field(default=None, compare=False)  # int32 [C]

    @property
    def num_chunks(self) -> int:
        return int(self.student_end.shape[0])

    def __eq__(self, other) -> bool:
        if not isinstance(other, Alignment):
            return NotImplemented
        return (np.array_equal(self.student_end, other.student_end)
                and np.array_equal(self.teacher_end, other.teacher_end) and np.array_equal(self.exact, other.exact))

    __hash__ = None


def identity_alignment(n_tokens: int) -> Alignment:
    """Same tokenizer on both sides: every token is its own exact 1:1 chunk."""
    ends = np.arange(1, n_tokens + 1, dtype=np.int32)
    return Alignment(student_end=ends, teacher_end=ends.copy(), exact=np.ones(n_tokens, dtype=bool))


def _cuts_and_gaps(side: Side, n_pos: int) -> tuple[np.ndarray, tuple | None]:
    """Boolean [n_pos] of character positions that are clean cuts on this side, and its gaps (runs
    of characters no token covers) as (starts, widths, characters in earlier gaps), or None when
    the tokens cover every character. A gap is cut at its two ends only, so whatever the other
    side has there (a conversation's one-sided template text, a piece the template dropped) is one
    chunk with an empty side on this one."""
    a = side.atom_end
    lo = np.concatenate(([0], side.end[a - 1]))                     # after each group (and before the first)
    hi = np.concatenate(([side.start[0]], side.start[a[:-1]], [n_pos - 1]))  # up to where the next one starts
    cut = np.zeros(n_pos, dtype=bool)
    cut[lo] = True
    wide = np.flatnonzero(hi > lo)
    if wide.shape[0] == 0:
        return cut, None
    lo, hi = lo[wide], hi[wide]
    cut[hi] = True
    w = hi - lo
    return cut, (lo, w, np.cumsum(w) - w)


def _uncovered_before(gaps: tuple, pos: np.ndarray) -> np.ndarray:
    """Characters of `gaps` (as `_cuts_and_gaps` gives them) before each character position."""
    lo, w, before = gaps
    g = np.searchsorted(lo, pos, side="right") - 1  # the last gap starting at or before pos (-1: none)
    gi = np.maximum(g, 0)
    return np.where(g >= 0, before[gi] + np.clip(pos - lo[gi], 0, w[gi]), 0)


def _pair_specials(s_roles: list[int], t_roles: list[int]) -> list[tuple[int, int, bool]]:
    """Chunks (student count, teacher count, exact) for the zero-width tokens met at one boundary:
    in order, a student and a teacher token with a common role pair up; others stand alone."""
    out, i, j = [], 0, 0
    while i < len(s_roles) or j < len(t_roles):
        if i < len(s_roles) and j < len(t_roles) and s_roles[i] & t_roles[j]:
            out, i, j = out + [(1, 1, True)], i + 1, j + 1
        elif i < len(s_roles) and not any(s_roles[i] & r for r in t_roles[j:]):
            out, i = out + [(1, 0, False)], i + 1
        else:
            out, j = out + [(0, 1, False)], j + 1
    return out



def batch_or_each(n: int, batch, one) -> list:
    """`batch()` (n results) in one pass when it succeeds; otherwise `one(i)` for each of the n
    items, one by one: its result, or the AlignmentError that names why item i does not align.

    Every caller that aligns many documents at once uses this, so one document that does not
    align costs its batch a second pass, not the whole run.
    """
    try:
        return batch()
    except AlignmentError:
        pass
    out: list = []
    for i in range(n):
        try:
            out.append(one(i))
        except AlignmentError as e:
            out.append(e)
    return out


def align_batch(texts: list[str], student_ids, student_offsets, teacher_ids, teacher_offsets,
                student_special_masks=None, teacher_special_masks=None, *,
                student_info: TokenizerInfo | None = None,
                teacher_info: TokenizerInfo | None = None) -> list[Alignment]:
    """`align_offsets` for many documents in one vectorized walk (lists with one entry per document).

    Much faster than a loop of `align_offsets` on short documents: the fixed numpy overhead is paid
    once per batch instead of once per document.
    """
    s = flat_documents(student_ids, student_offsets, student_special_masks)
    t = flat_documents(teacher_ids, teacher_offsets, teacher_special_masks)
    if not (len(texts) == s[2].shape[0] == t[2].shape[0]):
        raise AlignmentError(f"{len(texts)} texts but {s[2].shape[0]} student and {t[2].shape[0]} teacher token lists")
    return align_flat(list(texts), s, t, student_info, teacher_info)


def align_flat(texts, s_flat, t_flat, s_info, t_info) -> list[Alignment]:
    """Align many documents whose tokens come flat: `s_flat`/`t_flat` are (ids [N], offsets [N, 2],
    per-document counts [D], special mask [N] or None), as `encode_flat` returns them (stage 1 encodes
    once and aligns each batch with this)."""
    n_docs = len(texts)
    if n_docs == 0:
        return []
    lens = np.fromiter((len(x) for x in texts), dtype=np.int64, count=n_docs)
    base = np.concatenate(([0], np.cumsum(lens + 1)[:-1]))
    s = prepare_side("student", *s_flat, lens, base, s_info)
    t = prepare_side("teacher", *t_flat, lens, base, t_info)
    if s_info is not None or t_info is not None:
        joined = "\x00".join(texts) + "\x00"
        plain = None
        for side, info in ((s, s_info), (t, t_info)):
            if info is None:
                continue
            if info.metaspace and "\u2581" in joined:
                # SentencePiece reads a literal "▁" as a space: compare it as one, and mark the tokens
                # that cover one inexact (they decode to a space, not to the text's character)
                marks = np.concatenate(([0], np.cumsum(np.frombuffer(joined.encode("utf-32-le"), "<u4") == 0x2581)))
                side.flagged = side.flagged | (marks[side.end] > marks[side.start])
                check_pieces(side, info, *text_bytes(joined.replace("\u2581", " ")), texts, base)
                continue
            plain = plain or text_bytes(joined)
            check_pieces(side, info, *plain, texts, base)
    # content chunks: boundaries at positions that are clean cuts on both sides, one per distinct
    # pair of token counts; a chunk is exact when neither side skips a character of it
    n_pos = int(base[-1] + lens[-1] + 2)  # character positions 0..L of the joined batch
    cut_s, gap_s = _cuts_and_gaps(s, n_pos)
    cut_t, gap_t = _cuts_and_gaps(t, n_pos)
    pos = np.flatnonzero(cut_s & cut_t)
    cs = np.searchsorted(s.end, pos, side="right")
    ct = np.searchsorted(t.end, pos, side="right")
    keep = np.ones(pos.shape[0], dtype=bool)
    keep[1:] = (cs[1:] != cs[:-1]) | (ct[1:] != ct[:-1])
    pos, cs, ct = pos[keep], cs[keep], ct[keep]
    n_b = pos.shape[0]
    ds, dt = cs[1:] - cs[:-1], ct[1:] - ct[:-1]
    fs = np.concatenate(([0], np.cumsum(s.flagged)))
    ft = np.concatenate(([0], np.cumsum(t.flagged)))
    exact = (ds > 0) & (dt > 0) & (fs[cs[1:]] == fs[cs[:-1]]) & (ft[ct[1:]] == ft[ct[:-1]])
    for gaps in (gap_s, gap_t):
        if gaps is not None:  # a chunk over characters one side leaves uncovered is not exact
            before = _uncovered_before(gaps, pos)
            exact &= before[1:] == before[:-1]

    # zero-width tokens: at a common boundary -> chunks of their own, paired by role; else absorbed
    at_boundary: dict[int, tuple[list[int], list[int]]] = {}
    for k, (side, counts, d) in enumerate(((s, cs, ds), (t, ct, dt))):
        b = np.searchsorted(counts, side.zero_slot, side="left")
        hit = (b < n_b) & (counts[np.minimum(b, n_b - 1)] == side.zero_slot)
        for z in np.flatnonzero(hit).tolist():
            at_boundary.setdefault(int(b[z]), ([], []))[k].append(int(side.zero_role[z]))
        inner = b[~hit] - 1
        np.add.at(d, inner, 1)
        exact[inner] = False
    # insert the zero-width chunks of boundary b before content chunk b (np.insert keeps their order)
    extra = [(b, *pair) for b in sorted(at_boundary) for pair in _pair_specials(*at_boundary[b])]
    where = [e[0] for e in extra]
    s_end = np.cumsum(np.insert(ds, where, [e[1] for e in extra]))
    t_end = np.cumsum(np.insert(dt, where, [e[2] for e in extra]))
    chunk_x = np.insert(exact, where, np.array([e[3] for e in extra], dtype=bool))
    chunk_p = np.insert(pos[1:], where, pos[where])

    # split at the separator chunks (each is 1:1 by construction)
    sep_chunk = np.searchsorted(s_end, s.sep_full + 1, side="left")
    if not (np.array_equal(s_end[sep_chunk], s.sep_full + 1) and np.array_equal(t_end[sep_chunk], t.sep_full + 1)):
        raise AlignmentError("the batch's document separators did not come out as 1:1 chunks, so its documents "
                             "cannot be told apart; align its documents one by one")
    # each document's chunks, counted from its own first token and character (one pass over the
    # batch, then a view per document)
    firsts = np.concatenate(([0], sep_chunk[:-1] + 1))
    per_doc = np.diff(np.concatenate(([-1], sep_chunk)))  # a document's chunks and its separator chunk
    s0, t0 = np.concatenate(([0], s.sep_full[:-1] + 1)), np.concatenate(([0], t.sep_full[:-1] + 1))
    rel = [(x - np.repeat(o, per_doc)).astype(np.int32) for x, o in ((s_end, s0), (t_end, t0), (chunk_p, base))]
    return [Alignment(student_end=rel[0][f:k], teacher_end=rel[1][f:k], exact=chunk_x[f:k], char_end=rel[2][f:k])
            for f, k in zip(firsts.tolist(), sep_chunk.tolist())]


def align_offsets(text: str, student_ids, student_offsets, teacher_ids, teacher_offsets,
                  student_special_mask=None, teacher_special_mask=None, *,
                  student_info: TokenizerInfo | None = None, teacher_info: TokenizerInfo | None = None) -> Alignment:
    """Align two tokenizations of `text` given their character offsets.

    Offsets are `[N, 2]` character spans as fast tokenizers return them (`return_offsets_mapping`).
    Tokens with empty spans are placed between their neighbours and paired by role (roles come
    from `*_info`; without it every flagged special has the same role). With `*_info` the tokens'
    bytes are checked against the text and unknown tokens make their chunk inexact (and are not
    checked), as do tokens a mask flags that the tokenizer does not call special; without it the
    offsets are trusted and a chunk is exact when both sides cover its characters without gaps.
    """
    s_masks = None if student_special_mask is None else [student_special_mask]
    t_masks = None if teacher_special_mask is None else [teacher_special_mask]
    return align_batch([text], [student_ids], [student_offsets], [teacher_ids], [teacher_offsets], s_masks, t_masks,
                       student_info=student_info, teacher_info=teacher_info)[0]


def align_texts(texts: list[str], student_tok, teacher_tok, *, add_special_tokens: bool = True):
    """`align_text` for many texts at once: a list of (student_ids, teacher_ids, Alignment)."""
    texts = list(texts)
    if not texts:
        return []
    s_info = tokenizer_info(student_tok)
    t_info = tokenizer_info(teacher_tok)
    s_ids, s_off, s_counts = encode_flat(student_tok, texts, add_special_tokens=add_special_tokens,
                                          side="student tokenizer")
    s_split = np.split(s_ids, np.cumsum(s_counts)[:-1])
    if s_info.fingerprint == t_info.fingerprint:
        return [(ids, ids.copy(), identity_alignment(ids.shape[0])) for ids in s_split]
    t_ids, t_off, t_counts = encode_flat(teacher_tok, texts, add_special_tokens=add_special_tokens,
                                          side="teacher tokenizer")
    aligns = align_flat(texts, (s_ids, s_off, s_counts, None), (t_ids, t_off, t_counts, None), s_info, t_info)
    return list(zip(s_split, np.split(t_ids, np.cumsum(t_counts)[:-1]), aligns))


def align_text(text: str, student_tok, teacher_tok, *, add_special_tokens: bool = True):
    """Tokenize `text` with both fast tokenizers and align them: (student_ids, teacher_ids, Alignment).

    The same tokenizer on both sides (equal fingerprints) gives the identity alignment without a walk.
    """
    return align_texts([text], student_tok, teacher_tok, add_special_tokens=add_special_tokens)[0]


def _concat(arrays, dtype) -> np.ndarray:
    return np.concatenate([np.asarray(x, dtype) for x in arrays] + [np.zeros(0, dtype)])


def _share(part, whole) -> float:
    return float(part) / float(whole) if whole else 1.0


def chunk_shape_counts(alignments) -> dict[str, int]:
    """Chunks by (student tokens : teacher tokens) shape over one or many alignments: 1:1, 1:n, n:1,
    n:m, and empty (either side has no token)."""
    alignments = [alignments] if isinstance(alignments, Alignment) else list(alignments)
    return _shape_counts(_concat((np.diff(a.student_end, prepend=0) for a in alignments), np.int64),
                         _concat((np.diff(a.teacher_end, prepend=0) for a in alignments), np.int64))


def _shape_counts(ns: np.ndarray, nt: np.ndarray) -> dict[str, int]:
    """`ns`, `nt`: student and teacher tokens of each chunk."""
    return {"1:1": int(np.sum((ns == 1) & (nt == 1))), "1:n": int(np.sum((ns == 1) & (nt > 1))),
            "n:1": int(np.sum((ns > 1) & (nt == 1))), "n:m": int(np.sum((ns > 1) & (nt > 1))),
            "empty": int(np.sum((ns == 0) | (nt == 0)))}


def alignment_stats(alignments) -> dict:
    """Chunk shape counts and exact shares over one or many alignments.

    Keys: chunks, 1:1, 1:n, n:1, n:m, empty_student, empty_teacher, exact_chunks,
    exact_student_token_share, exact_teacher_token_share and, when every alignment carries
    `char_end`, exact_char_share (share of the text inside exact chunks).
    """
    alignments = [alignments] if isinstance(alignments, Alignment) else list(alignments)
    cat = _concat
    ns = cat((np.diff(a.student_end, prepend=0) for a in alignments), np.int64)
    nt = cat((np.diff(a.teacher_end, prepend=0) for a in alignments), np.int64)
    ex = cat((a.exact for a in alignments), bool)
    shapes = _shape_counts(ns, nt)
    out = {"chunks": int(ns.shape[0]), **{k: shapes[k] for k in ("1:1", "1:n", "n:1", "n:m")},
           "empty_student": int(np.sum(ns == 0)), "empty_teacher": int(np.sum(nt == 0)), "exact_chunks": int(ex.sum()),
           "exact_student_token_share": _share(ns[ex].sum(), ns.sum()),
           "exact_teacher_token_share": _share(nt[ex].sum(), nt.sum())}
    if all(a.char_end is not None for a in alignments):
        width = cat((np.diff(a.char_end.astype(np.int64), prepend=0) for a in alignments), np.int64)
        out["exact_char_share"] = _share(width[ex].sum(), width.sum())
    return out
