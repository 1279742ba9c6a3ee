"""Reference coding candidates: each position's top-k ids coded against an earlier position's.

Imported by `bench/store_codec_candidates.py`. A row that shares ids with an earlier row (the previous
one, the last one after the same input token, the best match among the last W rows) stores which of
that row's ids it keeps (a bit per entry), the kept ids' value codes as differences from that row's, and
its other ids as sorted dictionary-code deltas with their values. Sizes only: a reader would rebuild each
row from a row it has already decoded, a chain of dependent steps that numpy cannot run as a few passes
over a part, which is why the store does not code ids this way (see docs/store.md).

    .venv/bin/python bench/store_codec.py --teacher real      # the "vs ..." rows of "codec candidates"
"""

from __future__ import annotations

import numpy as np

from bench.store_codec_candidates import (
    CHUNK_BYTES,
    code_table,
    compressed_bytes,
    dictionary_bytes,
    group_dictionary,
    kl_top_rest,
)
from xtcache.store import codecs


def previous_same(keys: np.ndarray) -> np.ndarray:
    """int64 [P]: the last earlier row with the same key, -1 where none."""
    ref = np.full(keys.size, -1, np.int64)
    last: dict[int, int] = {}
    for t, key in enumerate(keys.tolist()):
        ref[t] = last.get(key, -1)
        last[key] = t
    return ref


def best_recent(codes: np.ndarray, window: int) -> np.ndarray:
    """int64 [P]: among the `window` rows before each row, the one sharing most of its codes (-1 for row 0)."""
    P, _ = codes.shape
    member = np.zeros(int(codes.max(initial=0)) + 1, bool)
    ref = np.full(P, -1, np.int64)
    for t in range(1, P):
        member[codes[t]] = True
        lo = max(0, t - window)
        shared = member[codes[lo:t]].sum(axis=1)  # [t - lo]
        ref[t] = t - 1 - int(np.argmax(shared[::-1]))  # the nearest of the best
        member[codes[t]] = False
    return ref


def reference_bytes(codes: np.ndarray, vals: np.ndarray, ref: np.ndarray) -> tuple[float, float, float]:
    """(ids B/position, values B/position, mean kept ids) of every row coded against row `ref[t]` (-1: alone).

    ids: the kept bits over the reference's entries, the new codes' sorted deltas, the distance to the
    reference; values: the kept entries' code differences, the new entries' codes.
    """
    P, k = codes.shape
    kept = np.zeros((P, k), bool)
    new_deltas, kept_diffs, new_vals = [], [], []
    for t in range(P):
        row_order = np.argsort(codes[t])
        row = codes[t][row_order]
        if ref[t] >= 0:
            r = ref[t]
            kept[t] = np.isin(codes[r], row)
            at = row_order[np.searchsorted(row, codes[r][kept[t]])]  # row t's columns of the kept ids
            kept_diffs.append(vals[t][at].astype(np.int16) - vals[r][kept[t]])
        fresh = ~np.isin(row, codes[ref[t]]) if ref[t] >= 0 else np.ones(k, bool)
        d = row[fresh].copy()
        d[1:] -= row[fresh][:-1]
        new_deltas.append(d)
        new_vals.append(vals[t][row_order][fresh])
    dist = np.where(ref >= 0, np.arange(P) - ref, 0).astype(np.uint32)[:, None]
    id_bytes = (compressed_bytes(np.packbits(kept, axis=1)) + compressed_bytes(dist, "byte", 6, CHUNK_BYTES)
                + compressed_bytes(np.concatenate(new_deltas).astype(np.uint32)[:, None], "byte", 6, CHUNK_BYTES))
    diffs = np.concatenate(kept_diffs) if kept_diffs else np.zeros(0, np.int16)
    val_bytes = (compressed_bytes(diffs.astype(np.int8).view(np.uint8)[:, None], level=9)
                 + compressed_bytes(np.concatenate(new_vals)[:, None], level=9))
    return id_bytes / P, val_bytes / P, float(kept.sum(axis=1).mean())


def reference_rows(docs: list[dict], ids: np.ndarray, lp: np.ndarray) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, KL) of ids + values coded against earlier rows (the part's dictionary
    bytes included), for `ids`, `lp` [P, k] in rank order: the rows of `docs` after each document's first."""
    dictionary = group_dictionary(ids)
    codes = code_table(dictionary)[ids]
    sqrt = codecs.SqrtProbs(127)
    vals = sqrt.encode(lp)
    kl = kl_top_rest(lp, sqrt.decode(vals))
    inputs = np.concatenate([d["ids"][:-1] for d in docs]).astype(np.int64)  # the token before each row's target
    refs = {"the previous position": np.arange(len(ids)) - 1,
            "the last position after the same input token": previous_same(inputs),
            "the best of the previous 64 positions": best_recent(codes, 64),
            "the best of the previous 1,024 positions": best_recent(codes, 1024)}
    extra = dictionary_bytes(dictionary) / len(ids)
    rows = []
    for name, ref in refs.items():
        id_b, val_b, shared = reference_bytes(codes, vals, ref)
        rows.append(("ids + values", f"vs {name} ({shared:.0f} of {ids.shape[1]} ids kept): ids {id_b + extra:.1f} "
                     f"+ values {val_b:.1f}", id_b + extra + val_b, kl))
    return rows
