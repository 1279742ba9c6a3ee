"""One side of a batch for the chunk walk: per-document tokens made flat, validated and split.

`flat_documents` joins per-document token lists; `prepare_side` checks one side's ids and offsets
against the documents' lengths and builds its `Side`: every document's tokens in one sequence of
batch-global character spans, a separator token after each document, content tokens apart from
zero-width ones (BOS, EOS, PAD), and the side's own clean cuts. `xtcache.align.chunks.align_flat` walks
two of them.

    python -c "from xtcache.align.sides import prepare_side; help(prepare_side)"
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xtcache.align.tokenizer import ROLE_OTHER
from xtcache.errors import AlignmentError


@dataclass
class Side:
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
    unk: np.ndarray             # bool  [M] unknown tokens, and tokens the caller flags that the tokenizer does not
    #                             call special (sampled bytes read as U+FFFD): not compared with the text, chunk inexact
    flagged: np.ndarray         # bool  [M] unknown or control token (TokenizerInfo.control): its chunk is not exact
    atom_end: np.ndarray        # int64 [A] content counts at this side's own clean cuts
    zero_slot: np.ndarray       # int64 [Z] content tokens before each zero-width token
    zero_role: np.ndarray       # int32 [Z]


def prepare_side(name, ids, offsets, counts, special, lens, base, info) -> Side:
    """Validate one side's flat tokens against the document lengths and build its `Side`. `special`: bool [N],
    the tokens whose chunk is not exact (None: the tokenizer's special tokens, `info.control`); with `info`,
    a flagged token that is no special token is not compared with the text either (`Side.unk`)."""
    n, n_docs = ids.shape[0], counts.shape[0]
    if offsets.shape != (n, 2):
        raise AlignmentError(f"{name} offsets have shape {tuple(offsets.shape)}, expected ({n}, 2) for {n} token ids")
    if info is not None and n and (ids.min() < 0 or ids.max() >= info.vocab_size):
        raise AlignmentError(f"{name} token ids outside the tokenizer's vocabulary of {info.vocab_size}: "
                             "ids and tokenizer do not belong together")
    if special is None:
        special = info.control[ids] if info is not None else np.zeros(n, dtype=bool)
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
    if info is not None:  # flagged by the caller, no special token: bytes that are not the text's
        unk |= (special & ~info.control[ids])[content]
    cut = np.append(c_start[1:] >= c_end[:-1], True)
    zero_idx = np.flatnonzero(zero)
    zero_role = info.role[ids[zero_idx]] if info is not None else np.where(special[zero_idx], ROLE_OTHER, 0)
    return Side(name, ids, sep_full, content, c_start, c_end, is_sep, unk, special[content] | unk,
                 np.flatnonzero(cut) + 1, zero_idx - np.arange(zero_idx.shape[0]), zero_role.astype(np.int32))


def flat_documents(ids_list, offsets_list, masks_list):
    """Per-document lists -> flat ids [N], offsets [N, 2], counts [D], special mask [N] or None."""
    ids = [np.asarray(x, dtype=np.int64).reshape(-1) for x in ids_list]
    offs = [np.asarray(o, dtype=np.int64).reshape(-1, 2) for o in offsets_list]
    if len(offs) != len(ids) or any(o.shape[0] != i.shape[0] for o, i in zip(offs, ids)):
        raise AlignmentError("every document needs one (start, end) offset pair per token id")
    masks = None if masks_list is None else np.concatenate([np.asarray(m, bool).reshape(-1) for m in masks_list] + [[]])
    counts = np.array([i.shape[0] for i in ids], dtype=np.int64)
    return np.concatenate(ids + [np.zeros(0, np.int64)]), np.concatenate(offs + [np.zeros((0, 2), np.int64)]), counts, \
        None if masks is None else masks.astype(bool)
