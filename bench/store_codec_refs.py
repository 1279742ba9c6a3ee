"""Reference coding candidates: each position's top-k ids coded against an earlier position's.

Imported by `bench/store_codec_candidates.py`. A row that shares ids with an earlier row (the previous
one, the last one after the same input token, the best match among the last W rows) stores which of
that row's ids it keeps (a bit per entry), the kept ids' value codes as differences from that row's, and
its other ids as sorted dictionary-code deltas with their values. Sizes only: a reader would rebuild each
row from a row it has already decoded, a chain of dependent steps that numpy cannot run as a few passes
over a part, which is why the store does not code ids this way (see docs/store.md). The "at depth" rows
bound that chain (`shallow_refs`): a reader decodes them level by level (`shallow_decode`, checked against
the rows coded and timed).

    .venv/bin/python bench/store_codec.py --teacher real      # the "vs ..." rows of "codec candidates"
"""

from __future__ import annotations

import numpy as np

from bench.store_codec_candidates import (
    CHUNK_BYTES,
    best_rate,
    code_table,
    compressed_bytes,
    dictionary_bytes,
    group_dictionary,
    kl_top_rest,
    sorted_code_deltas,
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
    """int64 [P]: among the `window` rows before each row, the one sharing most of its codes (-1 for row 0):
    `shallow_refs` with no bound on the depth and no least share."""
    return shallow_refs(codes, window, depth=len(codes), min_shared=0)[0]


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


def shallow_refs(codes: np.ndarray, window: int, depth: int, min_shared: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(ref, level) int64 [P]: for each row the earlier row among the `window` before it that shares most of its
    codes and sits at a level below `depth`, its level one more than that row's; -1 and level 0 (a row coded
    alone) where no such row shares `min_shared` codes. A reader then decodes level by level: `depth` + 1
    passes over the part, each a few numpy operations, instead of a step per row."""
    P, _ = codes.shape
    member = np.zeros(int(codes.max(initial=0)) + 1, bool)
    ref = np.full(P, -1, np.int64)
    level = np.zeros(P, np.int64)
    for t in range(1, P):
        member[codes[t]] = True
        lo = max(0, t - window)
        shared = np.where(level[lo:t] < depth, member[codes[lo:t]].sum(axis=1), -1)
        best = t - 1 - int(np.argmax(shared[::-1]))  # the nearest of the best
        if shared[best - lo] >= min_shared:
            ref[t], level[t] = best, level[best] + 1
        member[codes[t]] = False
    return ref, level


def shallow_encode(codes: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(kept [P, k] bool over each reference row's codes in ascending order, new code deltas [n] int64): a row's
    codes are the kept ones of its reference and its new ones, sorted and delta coded (the first absolute)."""
    rows = np.sort(codes, axis=1)
    P, k = rows.shape
    kept = np.zeros((P, k), bool)
    new = []
    for t in range(P):
        fresh = rows[t]
        if ref[t] >= 0:
            kept[t] = np.isin(rows[ref[t]], rows[t])
            fresh = rows[t][~np.isin(rows[t], rows[ref[t]])]
        d = fresh.astype(np.int64)
        d[1:] -= fresh[:-1]
        new.append(d)
    return kept, np.concatenate(new)


def shallow_decode(dist: np.ndarray, kept_bits: np.ndarray, new_deltas: np.ndarray, k: int, depth: int) -> np.ndarray:
    """Every row's codes [P, k] in ascending order from what a part would store: each row's distance to its
    reference (0: coded alone), its packed kept bits and the new codes' deltas. Numpy, no step per row: the
    levels in `depth` passes over the distances, then the rows level by level."""
    P = len(dist)
    kept = np.unpackbits(kept_bits, axis=1, count=k).astype(bool)
    ref = np.where(dist > 0, np.arange(P) - dist.astype(np.int64), -1)
    level = np.zeros(P, np.int64)
    has_ref = ref >= 0
    for _ in range(depth):
        level[has_ref] = level[ref[has_ref]] + 1
    counts = k - kept.sum(axis=1)  # new codes per row
    starts = np.cumsum(counts) - counts
    summed = np.cumsum(new_deltas, dtype=np.int64)
    before = np.where(starts > 0, summed[np.maximum(starts - 1, 0)], 0)  # each row's running sum before it
    new = summed - np.repeat(before, counts)  # absolute codes, each row's run restarted
    out = np.empty((P, k), new.dtype)
    for lvl in range(int(level.max(initial=0)) + 1):
        rows = np.flatnonzero(level == lvl)
        n_new = counts[rows]
        at = np.repeat(starts[rows] - (np.cumsum(n_new) - n_new), n_new) + np.arange(int(n_new.sum()))
        if lvl == 0:
            out[rows] = new[at].reshape(len(rows), k)
            continue
        keep = kept[rows]
        row = np.empty((len(rows), k), new.dtype)
        first = np.arange(k)[None, :] < (k - n_new)[:, None]  # the kept codes first, then the new ones
        row[first] = out[ref[rows]][keep]
        row[~first] = new[at]
        out[rows] = np.sort(row, axis=1)
    return out


def shallow_rows(ids: np.ndarray, vals: np.ndarray, kl: float) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, KL) of ids coded against the best earlier row at a bounded depth (kept bits,
    the distance, the new codes' deltas at blosc 6; values in code order at zstd 9, as codec v3), with the
    rate of `shallow_decode` after decompression against codec v3's (a cumulative sum per row), in CPU time.
    `ids` [P, k] in rank order, `vals` their sqrt codes, `kl` that code's error."""
    dictionary = group_dictionary(ids)
    codes = code_table(dictionary)[ids]
    order = np.argsort(codes, axis=1, kind="stable")
    val_b = compressed_bytes(np.take_along_axis(vals, order, 1), level=9) / len(ids)
    sorted_codes = np.sort(codes, axis=1)
    v3_deltas = sorted_code_deltas(codes)
    v3_rate = best_rate(np.cumsum, len(ids), v3_deltas, 1)
    rows = []
    for depth in (1, 3):
        ref, _ = shallow_refs(codes, 1024, depth)
        kept, new = shallow_encode(codes, ref)
        dist = np.where(ref >= 0, np.arange(len(ids)) - ref, 0).astype(np.uint16)  # < 1,024
        bits = np.packbits(kept, axis=1)
        new = new.astype(np.uint16 if len(dictionary) <= 65_536 else np.uint32)  # the store's code dtype
        decoded = shallow_decode(dist, bits, new, ids.shape[1], depth)
        if not np.array_equal(decoded, sorted_codes):
            raise AssertionError(f"shallow reference coding at depth {depth} does not decode to the rows it coded")
        id_b = (compressed_bytes(bits) + compressed_bytes(dist[:, None], "byte", 6, CHUNK_BYTES)
                + compressed_bytes(new[:, None], "byte", 6, CHUNK_BYTES) + dictionary_bytes(dictionary)) / len(ids)
        r = best_rate(shallow_decode, len(ids), dist, bits, new, ids.shape[1], depth)
        rows.append(("ids + values", f"vs the best of the previous 1,024 positions at depth <= {depth} "
                     f"({kept.sum(axis=1).mean():.0f} of {ids.shape[1]} ids kept, {(ref < 0).mean():.0%} of rows "
                     f"alone): ids {id_b:.1f} + values {val_b:.1f}; ids decoded {r / 1e6:.2f}M positions/s after "
                     f"decompression against v3's {v3_rate / 1e6:.1f}M", id_b + val_b, kl))
    return rows
