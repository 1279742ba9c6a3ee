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
instead of giving a wrong alignment.

    python -c "from xtcache.align import align_text; help(align_text)"
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from xtcache.errors import AlignmentError

log = logging.getLogger(__name__)

# Role bits of special tokens; two specials pair when their role bits intersect.
ROLE_BOS, ROLE_EOS, ROLE_PAD, ROLE_UNK, ROLE_SEP, ROLE_CLS, ROLE_OTHER = 1, 2, 4, 8, 16, 32, 64
_ROLE_ATTRS = (("bos_token_id", ROLE_BOS), ("eos_token_id", ROLE_EOS), ("pad_token_id", ROLE_PAD),
               ("unk_token_id", ROLE_UNK), ("sep_token_id", ROLE_SEP), ("cls_token_id", ROLE_CLS))


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


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """Per-vocabulary tables the aligner needs, built once per tokenizer by `tokenizer_info`.

    `piece_data[piece_start[i]:piece_start[i+1]]` are the UTF-8 bytes token `i` stands for in the
    text (byte-level and `<0xNN>` byte-fallback pieces decoded, `▁` turned into a space). Entry `V`
    (one past the vocabulary) is the aligner's document separator, spelled "\\x00".
    """

    fingerprint: str
    piece_data: np.ndarray  # uint8 [total bytes + 8 zero bytes of padding]
    piece_start: np.ndarray  # int64 [V + 2]
    role: np.ndarray  # int32 [V + 1]: role bits, 0 for ordinary tokens
    special: np.ndarray  # bool [V + 1]: control tokens (all special ids except unk)
    added: np.ndarray  # bool [V + 1]: added tokens (matched literally in the text)
    unk_id: int  # -1 when the tokenizer has no unknown token
    metaspace: bool = False  # SentencePiece style: a literal "▁" in the text reads as a space
    trims_offsets: bool = False  # post-processor trims whitespace off offsets (trim_offsets=True)

    @property
    def vocab_size(self) -> int:
        return int(self.piece_start.shape[0] - 2)


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the other 68
    byte values for the characters 256, 257, ... in byte order."""
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _decoder_kinds(decoder: dict | None) -> set[str]:
    """Decoder types in a spec; a Replace of "▁" (the Llama-2 conversion) counts as Metaspace."""
    if decoder is None or decoder.get("type") == "Sequence":
        return {k for d in (decoder or {}).get("decoders", []) for k in _decoder_kinds(d)}
    is_meta = decoder.get("type") == "Replace" and decoder.get("pattern", {}).get("String") == "▁"
    return {"Metaspace" if is_meta else decoder.get("type", "")}


_INFO_CACHE: "weakref.WeakKeyDictionary[object, TokenizerInfo]" = weakref.WeakKeyDictionary()
_UNTRIMMED: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()


def _cached(cache: weakref.WeakKeyDictionary, tokenizer, build):
    """cache[tokenizer], built on first use (tokenizers that cannot be weakly referenced: uncached)."""
    try:
        return cache[tokenizer]
    except (KeyError, TypeError):
        value = build()
    try:
        cache[tokenizer] = value
    except TypeError:
        pass
    return value


def _untrim(node):
    """A post-processor spec with every `trim_offsets` turned off (equal to `node` if none was on)."""
    if isinstance(node, dict):
        return {k: (False if k == "trim_offsets" else _untrim(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_untrim(v) for v in node]
    return node


def _offsets_backend(tokenizer, backend):
    """The backend to encode with: a copy that keeps whitespace in offsets when the tokenizer's
    post-processor trims it (token ids are the same; only offsets differ). Cached per tokenizer."""
    def build():
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        if _untrim(spec.get("post_processor")) == spec.get("post_processor"):
            return backend
        log.info("tokenizer trims whitespace off offsets (trim_offsets=True): encoding with an untrimmed copy")
        return Tokenizer.from_str(json.dumps({**spec, "post_processor": _untrim(spec["post_processor"])}))

    return _cached(_UNTRIMMED, tokenizer, build)


def require_fast(tokenizer, side: str = "tokenizer"):
    """The Rust backend of a transformers fast tokenizer; AlignmentError for slow ones."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", True):
        raise AlignmentError(
            f"the {side} ({type(tokenizer).__name__}) is a slow tokenizer without character offsets: "
            "load it with AutoTokenizer.from_pretrained(..., use_fast=True) from a directory with tokenizer.json")
    return backend


def tokenizer_info(tokenizer) -> TokenizerInfo:
    """The byte pieces and roles of a fast tokenizer (built once per tokenizer object)."""
    return _cached(_INFO_CACHE, tokenizer, lambda: _build_info(tokenizer))


def _build_info(tokenizer) -> TokenizerInfo:
    from xtcache.fingerprint import tokenizer_fingerprint

    backend = require_fast(tokenizer)
    spec = json.loads(backend.to_str())
    kinds = _decoder_kinds(spec.get("decoder"))
    byte_level = "ByteLevel" in kinds
    metaspace = "Metaspace" in kinds
    if not (byte_level or metaspace):
        raise AlignmentError(
            f"tokenizer decoder {sorted(kinds) or 'none'} is not supported for alignment: xtcache aligns "
            "byte-level BPE (GPT-2/Llama-3/Qwen style) and SentencePiece-style (Metaspace, byte fallback) tokenizers")
    vocab_size = len(tokenizer)
    added = {int(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
    byte_map = _byte_decoder()
    pieces: list[bytes] = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(vocab_size)))):
        if i in added:
            pieces.append(added[i].encode("utf-8"))
        elif tok is None:
            pieces.append(b"")
        elif byte_level:
            pieces.append(bytes(byte_map.get(ch, 0x3F) for ch in tok) if all(ch in byte_map for ch in tok)
                          else tok.encode("utf-8"))
        elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            pieces.append(bytes([int(tok[3:5], 16)]))
        else:
            pieces.append(tok.replace("▁", " ").encode("utf-8"))
    pieces.append(b"\x00")  # the separator between documents of a batch
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=vocab_size + 1)
    piece_start = np.zeros(vocab_size + 2, dtype=np.int64)
    np.cumsum(lengths, out=piece_start[1:])
    piece_data = np.frombuffer(b"".join(pieces) + bytes(8), dtype=np.uint8).copy()  # 8 bytes padding for _words
    role = np.zeros(vocab_size + 1, dtype=np.int32)
    for attr, bit in _ROLE_ATTRS:
        tid = getattr(tokenizer, attr, None)
        if tid is not None and 0 <= tid < vocab_size:
            role[tid] |= bit
    unk_id = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else -1
    special = np.zeros(vocab_size + 1, dtype=bool)
    special[[i for i in tokenizer.all_special_ids if 0 <= i < vocab_size and i != unk_id]] = True
    role[special & (role == 0)] = ROLE_OTHER
    added_mask = np.zeros(vocab_size + 1, dtype=bool)
    added_mask[[i for i in added if i < vocab_size]] = True
    return TokenizerInfo(fingerprint=tokenizer_fingerprint(tokenizer), piece_data=piece_data,
                         piece_start=piece_start, role=role, special=special, added=added_mask, unk_id=unk_id,
                         metaspace=metaspace and not byte_level,
                         trims_offsets=_untrim(spec.get("post_processor")) != spec.get("post_processor"))


def identity_alignment(n_tokens: int) -> Alignment:
    """Same tokenizer on both sides: every token is its own exact 1:1 chunk."""
    ends = np.arange(1, n_tokens + 1, dtype=np.int32)
    return Alignment(student_end=ends, teacher_end=ends.copy(), exact=np.ones(n_tokens, dtype=bool))


@dataclass
class _Side:
    """One side of a batch: the documents' tokens concatenated, one separator token after each
    document (spanning a virtual separator character, so documents never share a chunk), split into
    content tokens (non-empty spans, in global character positions) and zero-width tokens."""

    name: str
    ids: np.ndarray             # int64 [N + D] token ids, separators included (id V, or 0 without info)
    sep_full: np.ndarray        # int64 [D] index of each document's separator in `ids`
    content: np.ndarray         # int64 [M] indices into `ids` of content tokens
    start: np.ndarray           # int64 [M] global character spans
    end: np.ndarray             # int64 [M]
    is_sep: np.ndarray          # bool  [M] separator tokens
    unk: np.ndarray             # bool  [M] unknown tokens: not compared with the text, chunk inexact
    flagged: np.ndarray         # bool  [M] unknown or special token: its chunk is not exact
    atom_end: np.ndarray        # int64 [A] content counts at this side's own clean cuts
    zero_slot: np.ndarray       # int64 [Z] content tokens before each zero-width token
    zero_role: np.ndarray       # int32 [Z]


def _prepare_side(name, ids, offsets, counts, special, lens, base, info) -> _Side:
    """Validate one side's flat tokens against the document lengths and build its `_Side`."""
    n, n_docs = ids.shape[0], counts.shape[0]
    if offsets.shape != (n, 2):
        raise AlignmentError(f"{name} offsets have shape {tuple(offsets.shape)}, expected ({n}, 2) for {n} token ids")
    if info is not None and n and (ids.min() < 0 or ids.max() >= info.vocab_size):
        raise AlignmentError(f"{name} token ids outside the tokenizer's vocabulary of {info.vocab_size}: "
                             "ids and tokenizer do not belong together")
    if special is None:
        special = info.special[ids] if info is not None else np.zeros(n, dtype=bool)
    elif special.shape[0] != n:
        raise AlignmentError(f"{name} special mask has {special.shape[0]} entries for {n} tokens")
    doc = np.repeat(np.arange(n_docs), counts)
    start, end = offsets[:, 0], offsets[:, 1]
    bad = (end < start) | (start < 0) | (end > lens[doc])
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise AlignmentError(f"{name} token {k - int(counts[:doc[k]].sum())} of document {doc[k]} has offsets "
                             f"{tuple(offsets[k].tolist())} outside its text of {int(lens[doc[k]])} characters: "
                             "offsets belong to another text or are byte offsets; pass character offsets "
                             "(return_offsets_mapping)")
    at = np.cumsum(counts)
    sep_full = at + np.arange(n_docs)
    sep_pos = lens + base
    ids = np.insert(ids, at, info.vocab_size if info is not None else 0)
    start = np.insert(start + base[doc], at, sep_pos)
    end = np.insert(end + base[doc], at, sep_pos + 1)
    special = np.insert(special, at, False)
    zero = end == start
    content = np.flatnonzero(~zero)
    c_start, c_end = start[content], end[content]
    back = (c_start[1:] < c_start[:-1]) | (c_end[1:] < c_end[:-1])
    if back.any():
        full = int(content[1:][back][0])
        d = int(np.searchsorted(sep_full, full))
        k = full - (int(sep_full[d - 1]) + 1 if d else 0)
        raise AlignmentError(f"{name} offsets go backwards at token {k} of document {d} "
                             f"{(int(start[full] - base[d]), int(end[full] - base[d]))}: offsets must be "
                             "non-decreasing character spans of the same text")
    is_sep = np.zeros(n + n_docs, dtype=bool)
    is_sep[sep_full] = True
    is_sep = is_sep[content]
    unk = ids[content] == (info.unk_id if info is not None and info.unk_id >= 0 else -2)
    cut = np.append(c_start[1:] >= c_end[:-1], True)
    zero_idx = np.flatnonzero(zero)
    zero_role = info.role[ids[zero_idx]] if info is not None else np.where(special[zero_idx], ROLE_OTHER, 0)
    return _Side(name, ids, sep_full, content, c_start, c_end, is_sep, unk, special[content] | unk,
                 np.flatnonzero(cut) + 1, zero_idx - np.arange(zero_idx.shape[0]), zero_role.astype(np.int32))


def _check_pieces(side: _Side, info: TokenizerInfo, text_bytes: np.ndarray, byte_of_char: np.ndarray,
                  texts: list[str], base: np.ndarray) -> None:
    """Raise AlignmentError unless every token group's bytes reproduce its span of the text.

    Groups holding an unknown token are not compared. A leading space that the tokenizer inserts
    itself ("▁" prepended, add_prefix_space) is allowed where pre-tokenization starts: a document's
    first group and right after an added token.
    """
    a_end = side.atom_end
    a_begin = np.concatenate(([0], a_end[:-1]))
    cids = side.ids[side.content]
    ps = info.piece_start
    src, size = ps[cids], ps[cids + 1] - ps[cids]
    run = np.concatenate(([0], np.cumsum(size)))
    lo = byte_of_char[side.start[a_begin]]
    text_len = byte_of_char[side.end[a_end - 1]] - lo
    # restart groups (few): a document's first one and those right after an added token
    after = np.concatenate(([0], np.flatnonzero(side.is_sep[:-1] | info.added[cids[:-1]]) + 1))
    restart = np.searchsorted(a_begin, after)
    restart = restart[a_begin[np.minimum(restart, a_begin.shape[0] - 1)] == after]
    first = info.piece_data[src[a_begin[restart]]]
    ins_tok = a_begin[restart[(run[a_end[restart]] - run[a_begin[restart]] == text_len[restart] + 1) & (first == 0x20)]]
    if ins_tok.size:
        src[ins_tok] += 1
        size[ins_tok] -= 1
        run = np.concatenate(([0], np.cumsum(size)))
    skip = np.zeros(a_end.shape[0], dtype=bool)
    if side.unk.any():
        ucum = np.concatenate(([0], np.cumsum(side.unk)))
        skip = (ucum[a_end] - ucum[a_begin]) > 0
        size[np.repeat(skip, a_end - a_begin)] = 0
    bad = np.flatnonzero((run[a_end] - run[a_begin] != text_len) & ~skip)
    if bad.size:
        _raise_mismatch(side, int(bad[0]), a_begin, a_end, info, texts, base)
    # each token's bytes must sit in the text at its group's start plus its running offset in the group
    shift = lo - run[a_begin]
    dst = run[:-1] + (np.repeat(shift, a_end - a_begin) if shift.any() else 0)
    wrong = _first_difference(info.piece_data, src, text_bytes, dst, size)
    if wrong >= 0:
        _raise_mismatch(side, int(np.searchsorted(a_end, wrong, side="right")), a_begin, a_end, info, texts, base)


_LOW_BYTES = np.array([(1 << (8 * n)) - 1 for n in range(8)] + [(1 << 64) - 1], dtype=np.uint64)


def _words(buf: np.ndarray) -> np.ndarray:
    """Little-endian uint64 view starting at every byte of `buf` (whose last 8 bytes are padding)."""
    return np.ndarray(shape=(buf.shape[0] - 7,), dtype="<u8", buffer=buf, strides=(1,))


def _first_difference(a: np.ndarray, a_start: np.ndarray, b: np.ndarray, b_start: np.ndarray,
                      size: np.ndarray) -> int:
    """Index i of a piece with a[a_start[i]:+size[i]] != b[b_start[i]:+size[i]], or -1 if none;
    compared 8 bytes at a time through unaligned uint64 views."""
    wa, wb = _words(a), _words(b)
    diff = np.flatnonzero((wa[a_start] ^ wb[b_start]) & _LOW_BYTES[np.minimum(size, 8)])
    if diff.size:
        return int(diff[0])
    offset = 8
    sel = np.flatnonzero(size > 8)
    while sel.size:
        n = np.minimum(size[sel] - offset, 8)
        diff = np.flatnonzero((wa[a_start[sel] + offset] ^ wb[b_start[sel] + offset]) & _LOW_BYTES[n])
        if diff.size:
            return int(sel[diff[0]])
        offset += 8
        sel = sel[size[sel] > offset]
    return -1


def _raise_mismatch(side, atom, atom_begin, atom_end, info, texts, base):
    lo, hi = atom_begin[atom], atom_end[atom]
    toks = side.ids[side.content[lo:hi]]
    pieces = b"".join(info.piece_data[info.piece_start[t]:info.piece_start[t + 1]].tobytes() for t in toks)
    d = int(np.searchsorted(base, side.start[lo], side="right") - 1)
    span = (int(side.start[lo] - base[d]), int(side.end[hi - 1] - base[d]))
    where = f" of document {d}" if len(texts) > 1 else ""
    hint = ""
    if info.trims_offsets:
        hint = (" (this tokenizer trims whitespace off its offsets, trim_offsets=True: encode with "
                "xtcache.align.encode_with_offsets or align_text, which keep the whitespace)")
    raise AlignmentError(
        f"{side.name} tokens {toks.tolist()}{where} spell {pieces.decode('utf-8', 'replace')!r} but their offsets "
        f"{span} cover {texts[d][span[0]:span[1]]!r}: the tokenizer changes the text (a normalizer such as "
        "lowercase or NFKC, or trimmed offsets), so its offsets cannot be trusted for alignment; use a "
        "tokenizer without a text-changing normalizer" + hint)


def _cuts_and_gaps(side: _Side, n_pos: int) -> tuple[np.ndarray, tuple | None]:
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


def _flat(ids_list, offsets_list, masks_list):
    """Per-document lists -> flat ids [N], offsets [N, 2], counts [D], special mask [N] or None."""
    ids = [np.asarray(x, dtype=np.int64).reshape(-1) for x in ids_list]
    offs = [np.asarray(o, dtype=np.int64).reshape(-1, 2) for o in offsets_list]
    if len(offs) != len(ids) or any(o.shape[0] != i.shape[0] for o, i in zip(offs, ids)):
        raise AlignmentError("every document needs one (start, end) offset pair per token id")
    masks = None if masks_list is None else np.concatenate([np.asarray(m, bool).reshape(-1) for m in masks_list] + [[]])
    counts = np.array([i.shape[0] for i in ids], dtype=np.int64)
    return np.concatenate(ids + [np.zeros(0, np.int64)]), np.concatenate(offs + [np.zeros((0, 2), np.int64)]), counts, \
        None if masks is None else masks.astype(bool)


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
    s = _flat(student_ids, student_offsets, student_special_masks)
    t = _flat(teacher_ids, teacher_offsets, teacher_special_masks)
    if not (len(texts) == s[2].shape[0] == t[2].shape[0]):
        raise AlignmentError(f"{len(texts)} texts but {s[2].shape[0]} student and {t[2].shape[0]} teacher token lists")
    return align_flat(list(texts), s, t, student_info, teacher_info)


def _text_bytes(text: str) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of `text` (plus 8 zero bytes of padding) and the byte offset of every character
    position (int64 [len + 1])."""
    try:
        raw = np.frombuffer(text.encode("utf-8") + bytes(8), dtype=np.uint8)
    except UnicodeEncodeError as e:
        raise AlignmentError(f"text is not valid Unicode (lone surrogate at character {e.start})") from None
    if raw.shape[0] == len(text) + 8:
        return raw, np.arange(len(text) + 1, dtype=np.int64)
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    char_bytes = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    return raw, np.concatenate(([0], np.cumsum(char_bytes)))


def align_flat(texts, s_flat, t_flat, s_info, t_info) -> list[Alignment]:
    """Align many documents whose tokens come flat: `s_flat`/`t_flat` are (ids [N], offsets [N, 2],
    per-document counts [D], special mask [N] or None), as `encode_flat` returns them (stage 1 encodes
    once and aligns each batch with this)."""
    n_docs = len(texts)
    if n_docs == 0:
        return []
    lens = np.fromiter((len(x) for x in texts), dtype=np.int64, count=n_docs)
    base = np.concatenate(([0], np.cumsum(lens + 1)[:-1]))
    s = _prepare_side("student", *s_flat, lens, base, s_info)
    t = _prepare_side("teacher", *t_flat, lens, base, t_info)
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
                _check_pieces(side, info, *_text_bytes(joined.replace("\u2581", " ")), texts, base)
                continue
            plain = plain or _text_bytes(joined)
            _check_pieces(side, info, *plain, texts, base)
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
    bytes are checked against the text and unknown tokens make their chunk inexact; without it the
    offsets are trusted and a chunk is exact when both sides cover its characters without gaps.
    """
    s_masks = None if student_special_mask is None else [student_special_mask]
    t_masks = None if teacher_special_mask is None else [teacher_special_mask]
    return align_batch([text], [student_ids], [student_offsets], [teacher_ids], [teacher_offsets], s_masks, t_masks,
                       student_info=student_info, teacher_info=teacher_info)[0]


def encode_with_offsets(tokenizer, text: str, *, add_special_tokens: bool = True, side: str = "tokenizer"):
    """(ids int64 [N], offsets int64 [N, 2]) from a fast tokenizer's Rust backend, no truncation."""
    ids, offsets, _ = encode_flat(tokenizer, [text], add_special_tokens=add_special_tokens, side=side)
    return ids, offsets


def encode_flat(tokenizer, texts: list[str], *, add_special_tokens: bool, side: str):
    """Flat ids int64 [N], offsets int64 [N, 2] and per-document counts int64 [D] for a batch."""
    backend = _offsets_backend(tokenizer, require_fast(tokenizer, side))
    if backend.truncation is not None:
        raise AlignmentError(f"the {side} has truncation enabled ({backend.truncation}): alignment needs the "
                             "whole text; call tokenizer.backend_tokenizer.no_truncation() first")
    encs = backend.encode_batch(texts, add_special_tokens=add_special_tokens) if len(texts) > 1 else \
        [backend.encode(texts[0], add_special_tokens=add_special_tokens)]
    counts = np.fromiter((len(e.ids) for e in encs), dtype=np.int64, count=len(encs))
    total = int(counts.sum())
    ids = np.fromiter(chain.from_iterable(e.ids for e in encs), dtype=np.int64, count=total)
    offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encs)), dtype=np.int64,
                          count=2 * total).reshape(-1, 2)
    return ids, offsets, counts


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
