"""The byte check: every group of a side's tokens must spell exactly the text its offsets cover.

`check_pieces` compares the tokens' bytes (from `TokenizerInfo`) with the text's UTF-8 bytes, 8
bytes at a time through unaligned uint64 views, and raises `AlignmentError` naming the first group
whose bytes differ (a text-changing normalizer, trimmed offsets). `text_bytes` gives a text's bytes
and the byte offset of every character.

    python -c "from xtcache.align.bytes import check_pieces; help(check_pieces)"
"""

from __future__ import annotations

import numpy as np

from xtcache.align.sides import Side
from xtcache.align.tokenizer import TokenizerInfo
from xtcache.errors import AlignmentError


def text_bytes(text: str) -> tuple[np.ndarray, np.ndarray]:
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


def check_pieces(side: Side, info: TokenizerInfo, text_bytes: np.ndarray, byte_of_char: np.ndarray,
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
                "xtcache.align.chunks.encode_with_offsets or align_text, which keep the whitespace)")
    raise AlignmentError(
        f"{side.name} tokens {toks.tolist()}{where} spell {pieces.decode('utf-8', 'replace')!r} but their offsets "
        f"{span} cover {texts[d][span[0]:span[1]]!r}: the tokenizer changes the text (a normalizer such as "
        "lowercase or NFKC, or trimmed offsets), so its offsets cannot be trusted for alignment; use a "
        "tokenizer without a text-changing normalizer" + hint)
