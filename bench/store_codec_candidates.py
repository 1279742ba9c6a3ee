"""Codec candidates measured on the same teacher distributions: bytes/position and KL error per piece.

Imported by `bench/store_codec.py` (which takes a teacher's held-out top-k distributions, the toy's or the
real one's, and prints this table beside the store's codecs); each row encodes one piece of a position
(values, ids, side arrays, offsets) one way, compressed per inner chunk as the store compresses it (zstd,
or blosc-zstd with a byte or bit shuffle), so that the store's defaults (format versions 3 and 4) are
chosen by these numbers. Rows marked "bound" are entropies of a model, not codecs: what no coder of that
model beats. The id codings against earlier rows (reference coding) live in `store_codec_refs.py`.

    .venv/bin/python bench/store_codec.py [--teacher real]     # prints "codec candidates" among its tables
"""

from __future__ import annotations

import numpy as np

from xtcache.store import codecs

CHUNK_BYTES = 1 << 20


def chunk_blobs(values: np.ndarray, comp: codecs.Compression) -> tuple[list, object]:
    """(blobs, codec): `values` compressed per 1 MiB inner chunk of rows with the numcodecs compressor
    behind the store's Zarr codec for `comp` (zstd, or blosc-zstd with a byte or bit shuffle in blocks of
    `comp.blocksize` bytes, 0: blosc's choice); `codec.decode` reads a blob back."""
    import numcodecs

    codec = (numcodecs.Zstd(level=comp.level) if comp.shuffle == "none" else
             numcodecs.Blosc(cname="zstd", clevel=comp.level, blocksize=comp.blocksize,
                             shuffle=numcodecs.Blosc.SHUFFLE if comp.shuffle == "byte" else numcodecs.Blosc.BITSHUFFLE))
    if values.size == 0:
        return [], codec
    flat = np.ascontiguousarray(values).reshape(len(values), -1)
    rows = max(1, CHUNK_BYTES // max(1, flat.dtype.itemsize * flat.shape[1]))
    return [codec.encode(np.ascontiguousarray(flat[i:i + rows])) for i in range(0, len(flat), rows)], codec


def compressed_bytes(values: np.ndarray, shuffle: str = "none", level: int = 3, blocksize: int = 0) -> int:
    """Bytes of `values` compressed per inner chunk, as the store compresses an array (`chunk_blobs`)."""
    return sum(map(len, chunk_blobs(values, codecs.Compression(level, shuffle, blocksize))[0]))


def best_rate(fn, rows: int, *args, repeat: int = 3) -> float:
    """`rows` per CPU second of `fn(*args)` (`time.process_time`), the best of `repeat` runs."""
    import time

    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn(*args)
        best = min(best, time.process_time() - t0)
    return rows / max(best, 1e-9)


def compress_rate(values: np.ndarray, shuffle: str = "none", level: int = 3, blocksize: int = 0) -> float:
    """Rows of `values` compressed per CPU second (best of 3), as `compressed_bytes` compresses them."""
    return best_rate(lambda: compressed_bytes(values, shuffle, level, blocksize), len(values))


def kl_top_rest(lp: np.ndarray, decoded: np.ndarray, rest: np.ndarray | None = None) -> float:
    """Mean KL(p || q) over rows: p = top-k probs + their rest mass, q = decoded probs + `rest` (the
    original rest when None), renormalised; float64."""
    p = np.exp(lp.astype(np.float64))
    p_rest = np.clip(1 - p.sum(1, keepdims=True), 0, None)
    q_rest = p_rest if rest is None else np.clip(rest.astype(np.float64), 0, None)[:, None]
    return _mean_kl(np.concatenate([p, p_rest], 1), np.concatenate([np.exp(decoded.astype(np.float64)), q_rest], 1))


def _mean_kl(pf: np.ndarray, qf: np.ndarray) -> float:
    """Mean KL(p || q) over rows of two [P, n] float64 mass arrays, each row renormalised (in place)."""
    pf /= pf.sum(1, keepdims=True)
    qf /= qf.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(pf > 0, pf * (np.log(pf) - np.log(np.maximum(qf, 1e-300))), 0.0)
    return float(terms.sum(1).mean())


def _value_rows(ids_sorted_lp: np.ndarray, P: int) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, mean KL) of the value codes, values in id order."""
    rows = []
    for name, codec in (("8-bit log p over [-24, 0] (v1)", codecs.QuantizedLogProbs(8, -24.0)),
                        ("sqrt(p), 255 levels", codecs.SqrtProbs(255)),
                        ("sqrt(p), 127 levels (v2)", codecs.SqrtProbs(127)),
                        ("sqrt(p), 103 levels", codecs.SqrtProbs(103))):
        codes = codec.encode(ids_sorted_lp)
        kl = kl_top_rest(ids_sorted_lp, codec.decode(codes))
        rows.append(("values", name, compressed_bytes(codes) / P, kl))
        if codec == codecs.SqrtProbs(127):
            rows.append(("values", "sqrt(p), 127 levels, bitshuffle", compressed_bytes(codes, "bit") / P, kl))
            rows.append(("values", "sqrt(p), 127 levels, zstd 19", compressed_bytes(codes, level=19) / P, kl))
            ranked = -np.sort(-codes.astype(np.int16), axis=1)  # [P, k] descending: rank-ordered values
            deltas = ranked.copy()
            deltas[:, 1:] = ranked[:, :-1] - ranked[:, 1:]
            rows.append(("values", "sqrt(p) 127, rank-ordered, delta", compressed_bytes(deltas.astype(np.uint8)) / P,
                         kl))
    return rows


def _id_rows(ids: np.ndarray, P: int, dtype: str) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, 0) of the top-k ids coded several ways, deltas of `dtype` (the store's)."""
    sorted_ids = np.sort(ids, axis=1)
    deltas, _ = codecs.SortedDeltaIds(dtype).encode(ids)
    rows = [("ids", f"sorted, delta {dtype}, byte shuffle (v1)", compressed_bytes(deltas, "byte") / P, 0.0),
            ("ids", f"sorted, delta {dtype}, bitshuffle", compressed_bytes(deltas, "bit") / P, 0.0),
            ("ids", f"sorted, delta {dtype}, byte shuffle, level 6", compressed_bytes(deltas, "byte", 6) / P, 0.0),
            ("ids", f"sorted, delta {dtype}, byte shuffle, level 6, 1 MiB blocks (v2)",
             compressed_bytes(deltas, "byte", 6, CHUNK_BYTES) / P, 0.0)]
    small = deltas.astype(np.int64)
    rows.append(("ids", "sorted, delta uint16 + escapes >= 65535",
                 (compressed_bytes(np.minimum(small, 65535).astype(np.uint16), "byte")
                  + compressed_bytes(small[small >= 65535].astype(np.uint32), "byte")) / P, 0.0))
    # against the previous position's ids: a bitmask of which are kept, the new ids delta coded
    V = int(ids.max()) + 1
    prev = np.zeros_like(sorted_ids)
    prev[1:] = sorted_ids[:-1]
    keys = sorted_ids.astype(np.int64) + np.arange(P)[:, None] * V
    prev_keys = (prev.astype(np.int64) + np.arange(P)[:, None] * V).ravel()
    kept = np.isin(keys, prev_keys)  # [P, k]
    new = np.where(kept, -1, sorted_ids)
    new_sorted = np.sort(np.where(new < 0, V, new), axis=1)
    nd = new_sorted.copy()
    nd[:, 1:] = new_sorted[:, 1:] - new_sorted[:, :-1]
    nd = nd[new_sorted < V]  # only the new ids' deltas
    rows.append(("ids", f"vs previous position: kept mask + new deltas ({kept.mean():.0%} kept)",
                 (compressed_bytes(np.packbits(kept, axis=1)) + compressed_bytes(nd.astype(np.uint32)[:, None], "byte"))
                 / P, 0.0))
    return rows


def group_dictionary(ids: np.ndarray) -> np.ndarray:
    """The store's dictionary (codec v3): distinct ids by floor(log2(count)) descending, then id."""
    return codecs.DictDeltaIds.dictionary(ids)


def code_table(dictionary: np.ndarray) -> np.ndarray:
    """int64 [max id + 1]: the code of each id of `dictionary` (its position)."""
    out = np.zeros(int(dictionary.max(initial=0)) + 1, np.int64)
    out[dictionary] = np.arange(dictionary.size)
    return out


def sorted_code_deltas(codes: np.ndarray) -> np.ndarray:
    s = np.sort(codes, axis=1)
    d = s.copy()
    d[:, 1:] = s[:, 1:] - s[:, :-1]
    return d


def dictionary_bytes(dictionary: np.ndarray) -> int:
    """The dictionary as the store keeps it: int32 deltas, byte shuffle, blosc level 6 in 1 MiB blocks."""
    return compressed_bytes(codecs.DictDeltaIds.encode_dictionary(dictionary)[:, None], "byte", 6, CHUNK_BYTES)


def _dictionary_rows(ids: np.ndarray, P: int, dtype: str) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, 0) of ids as codes into a per-part dictionary (dictionary bytes included)."""
    counts = np.bincount(ids.reshape(-1))
    used = np.flatnonzero(counts)
    orders = {"by count": used[np.lexsort((used, -counts[used]))], "of the ids in use, by id": used,
              "by log2 count group, then id (v3)": group_dictionary(ids)}
    rows = []
    for name, dictionary in orders.items():
        d = sorted_code_deltas(code_table(dictionary)[ids]).astype(dtype)
        rows.append(("ids", f"dictionary {name}, codes sorted, delta, byte shuffle, level 6, 1 MiB blocks",
                     (compressed_bytes(d, "byte", 6, CHUNK_BYTES) + dictionary_bytes(dictionary)) / P, 0.0))
    dictionary = orders["by log2 count group, then id (v3)"]
    codes = code_table(dictionary)[ids]  # [P, k] in rank order (ids arrive most likely first)
    d = sorted_code_deltas(codes)
    extra = dictionary_bytes(dictionary)
    slow = compress_rate(d.astype(dtype), "byte", 9, CHUNK_BYTES) / 1e3
    fast = compress_rate(d.astype(dtype), "byte", 6, CHUNK_BYTES) / 1e3
    rows.append(("ids", f"dictionary (v3), level 9 (zstd's slowest level: compresses {slow:.0f}k positions/s, "
                 f"level 6 {fast:.0f}k)", (compressed_bytes(d.astype(dtype), "byte", 9, CHUNK_BYTES) + extra) / P, 0.0))
    escapes = d[d >= 255]
    rows.append(("ids", f"dictionary (v3), uint8 codes + uint16 escapes >= 255 ({(d >= 255).mean():.0%})",
                 (compressed_bytes(np.minimum(d, 255).astype(np.uint8), level=9)
                  + compressed_bytes(escapes.astype(dtype)[:, None], "byte", 6, CHUNK_BYTES) + extra) / P, 0.0))
    rows.append(("ids", "dictionary (v3), codes in rank order (values then monotone)",
                 (compressed_bytes(codes.astype(dtype), "byte", 6, CHUNK_BYTES) + extra) / P, 0.0))
    present = counts[used] / P
    bits = -(present * np.log2(present) + (1 - present) * np.log2(np.maximum(1 - present, 1e-300)))
    rows.append(("ids", "bound: each id present or not with its own frequency (any static set code)",
                 float(np.nansum(bits)) / 8, 0.0))
    return rows


def _code_order_rows(ids: np.ndarray, lp: np.ndarray, P: int, dtype: str) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, KL) of other dictionary orders, layouts and levels, ids and values in code
    order (values: sqrt(p), 127 levels)."""
    values = codecs.SqrtProbs(127)
    vals = values.encode(lp)
    kl = kl_top_rest(lp, values.decode(vals))
    counts = np.bincount(ids.reshape(-1))
    used = np.flatnonzero(counts)
    mean_code = np.bincount(ids.reshape(-1), weights=vals.reshape(-1).astype(np.float64))[used] / counts[used]
    mass = np.bincount(ids.reshape(-1), weights=np.exp(lp.reshape(-1).astype(np.float64)))[used]
    group = np.frexp(counts[used].astype(np.float64))[1]
    orders = {"by total probability": used[np.argsort(-mass, kind="stable")],
              "by mean value code": used[np.argsort(-mean_code, kind="stable")],
              "by log2 count group, then mean value code": used[np.lexsort((-mean_code, -group))]}
    rows = []
    for name, dictionary in orders.items():
        codes = code_table(dictionary)[ids]
        by_code = np.argsort(codes, axis=1, kind="stable")
        rows.append(("ids + values", f"dictionary {name}: code deltas + values in code order",
                     (compressed_bytes(sorted_code_deltas(codes).astype(dtype), "byte", 6, CHUNK_BYTES)
                      + dictionary_bytes(dictionary) + compressed_bytes(np.take_along_axis(vals, by_code, 1), level=9))
                     / P, kl))
    dictionary = group_dictionary(ids)
    codes = code_table(dictionary)[ids]
    by_code = np.argsort(codes, axis=1, kind="stable")
    d = sorted_code_deltas(codes).astype(dtype)
    v = np.take_along_axis(vals, by_code, 1)
    for level in (5, 8):
        rows.append(("ids", f"dictionary (v3), level {level}",
                     (compressed_bytes(d, "byte", level, CHUNK_BYTES) + dictionary_bytes(dictionary)) / P, 0.0))
    rows.append(("ids", "dictionary (v3), each inner chunk stored column by column",
                 (compressed_bytes(_by_columns(d), "byte", 6, CHUNK_BYTES) + dictionary_bytes(dictionary)) / P, 0.0))
    for level in (3, 6, 9, 15, 19):
        rows.append(("values", f"sqrt(p), 127 levels, in code order, zstd {level}{' (v3)' if level == 9 else ''}: "
                     f"compresses {compress_rate(v, level=level) / 1e3:.0f}k positions/s",
                     compressed_bytes(v, level=level) / P, kl))
    rows.append(("values", "sqrt(p), 127 levels, in code order, each inner chunk column by column",
                 compressed_bytes(_by_columns(v), level=9) / P, kl))
    return rows


def _by_columns(values: np.ndarray) -> np.ndarray:
    """`values` [P, k] with each 1 MiB inner chunk's rows transposed (column-major bytes in a [P, k] array)."""
    rows = max(1, CHUNK_BYTES // (values.itemsize * values.shape[1]))
    return np.concatenate([np.ascontiguousarray(values[i:i + rows].T).reshape(-1, values.shape[1])
                           for i in range(0, len(values), rows)])


def _joint_rows(ids: np.ndarray, lp: np.ndarray, P: int, dtype: str) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, KL) of ids and values coded together (dictionary v3, sqrt(p) 127 levels):
    the order of a row decides which of the two pays for the pairing of ids and values."""
    from math import lgamma, log

    dictionary = group_dictionary(ids)
    extra = dictionary_bytes(dictionary)
    values = codecs.SqrtProbs(127)
    codes = code_table(dictionary)[ids]  # [P, k], rank order
    vals = values.encode(lp)  # [P, k] uint8, non-increasing along each row
    kl = kl_top_rest(lp, values.decode(vals))
    rows = []
    order = np.argsort(codes, axis=1, kind="stable")
    id_b = compressed_bytes(sorted_code_deltas(codes).astype(dtype), "byte", 6, CHUNK_BYTES)
    rows.append(("ids + values", "by code: code deltas + values in code order (v3)",
                 (id_b + extra + compressed_bytes(np.take_along_axis(vals, order, 1), level=9)) / P, kl))
    for head in (4, 8, 16):
        tail = np.sort(codes[:, head:], axis=1)
        tail_vals = np.take_along_axis(vals[:, head:], np.argsort(codes[:, head:], axis=1, kind="stable"), 1)
        td = tail.copy()
        td[:, 1:] = tail[:, 1:] - tail[:, :-1]
        hv = vals[:, :head].astype(np.int16)
        hv[:, 1:] = hv[:, :-1] - hv[:, 1:]
        b = (compressed_bytes(codes[:, :head].astype(dtype), "byte", 6, CHUNK_BYTES) + compressed_bytes(hv.astype(np.uint8))
             + compressed_bytes(td.astype(dtype), "byte", 6, CHUNK_BYTES) + compressed_bytes(tail_vals, level=9))
        rows.append(("ids + values", f"first {head} by rank (value deltas), the rest by code", (b + extra) / P, kl))
    key = (255 - vals.astype(np.int64)) << 32 | codes  # values descending, then code
    order = np.argsort(key, axis=1)
    by_value = np.take_along_axis(codes, order, 1)
    v = np.take_along_axis(vals, order, 1).astype(np.int16)
    same = np.zeros(by_value.shape, bool)
    same[:, 1:] = v[:, 1:] == v[:, :-1]
    run_d = by_value.copy()
    run_d[:, 1:] = np.where(same[:, 1:], by_value[:, 1:] - by_value[:, :-1], by_value[:, 1:])
    vd = v.copy()
    vd[:, 1:] = v[:, :-1] - v[:, 1:]
    rows.append(("ids + values", "by value, then code: code deltas within equal values + value deltas",
                 (compressed_bytes(run_d.astype(dtype), "byte", 6, CHUNK_BYTES) + extra
                  + compressed_bytes(vd.astype(np.uint8), level=9)) / P, kl))
    pairing = 0.0
    for row in vals:
        pairing += lgamma(row.size + 1) - sum(lgamma(c + 1) for c in np.unique(row, return_counts=True)[1])
    rows.append(("ids + values", "bound: pairing ids with values (log2 of each row's multinomial of value codes)",
                 pairing / log(2) / 8 / P, kl))
    return rows


def _side_rows(lp: np.ndarray, realized: np.ndarray, P: int) -> list[tuple[str, str, float, float]]:
    rest = np.clip(1 - np.exp(lp.astype(np.float64)).sum(1), 0, None)
    rest16 = rest.astype(np.float16).astype(np.float64)
    kl16 = kl_top_rest(lp, lp, rest16)
    real = np.ascontiguousarray(realized)
    sqrt_rest = np.rint(np.sqrt(rest) * 255).astype(np.uint8)
    return [
        ("residual + realized", "float32 x 2 (v1)",
         (compressed_bytes(rest.astype(np.float32), "byte") + compressed_bytes(real.astype(np.float32), "byte")) / P,
         0.0),
        ("residual + realized", "float16 x 2 (v2, v3)",
         (compressed_bytes(rest.astype(np.float16), "byte") + compressed_bytes(real.astype(np.float16), "byte")) / P,
         kl16),
        ("residual + realized", "residual as sqrt code of 255 levels (uint8), realized float16",
         (compressed_bytes(sqrt_rest, level=9) + compressed_bytes(real.astype(np.float16), "byte")) / P,
         kl_top_rest(lp, lp, (sqrt_rest / 255.0) ** 2)),
    ]


def _offset_rows(docs: list[dict], P: int) -> list[tuple[str, str, float, float]]:
    tids = np.concatenate([d["ids"] for d in docs]).astype(np.int32)
    text = np.frombuffer("".join(d["text"] for d in docs).encode("utf-8"), np.uint8)
    offs = np.concatenate([d["offsets"][1:] for d in docs]).astype(np.int32)  # [P, 2]
    starts = offs[:, 0].astype(np.int64)
    prev_end = np.concatenate([[0], offs[:-1, 1]]).astype(np.int64)
    delta = np.stack([starts - prev_end, offs[:, 1] - starts], 1).astype(np.int32)
    return [("char offsets", "int32 (start, end) (v1)", compressed_bytes(offs) / P, 0.0),
            ("char offsets", "int32 (start - previous end, length) (v2, v3)", compressed_bytes(delta, "byte") / P, 0.0),
            ("teacher ids", "int32, byte shuffle, level 3 (v1, v2, v3)", compressed_bytes(tids, "byte") / P, 0.0),
            ("teacher ids", "int32, byte shuffle, level 6, 1 MiB blocks",
             compressed_bytes(tids, "byte", 6, CHUNK_BYTES) / P, 0.0),
            ("doc text", "UTF-8, zstd 3 (v1, v2, v3)", compressed_bytes(text) / P, 0.0),
            ("doc text", "UTF-8, zstd 9", compressed_bytes(text, level=9) / P, 0.0)]


def kl_dropped(lp: np.ndarray, decoded: np.ndarray, keep: np.ndarray, vocab: int) -> float:
    """Mean KL(p || q) over rows on the stored top-k's own partition (its k ids and the rest): p the teacher's
    probabilities, q what a reader of a ragged row knows, the kept entries' `decoded` log-probs and, for each
    dropped entry and the ids beyond the top k, the mass the writer stores as the rest (the teacher's rest plus
    the dropped entries') spread evenly over every id the row does not store; float64."""
    p = np.exp(lp.astype(np.float64))
    p_rest = np.clip(1 - p.sum(1), 0, None)
    kept = keep.sum(1)
    q_rest = p_rest + np.where(keep, 0.0, p).sum(1)  # [P]: the row's stored rest
    each = q_rest / (vocab - kept)  # the reader's share of it for every id it does not store
    q = np.where(keep, np.exp(decoded.astype(np.float64)), each[:, None])
    return _mean_kl(np.concatenate([p, p_rest[:, None]], 1),
                    np.concatenate([q, (each * (vocab - lp.shape[1]))[:, None]], 1))


def ragged_rows(ids: np.ndarray, lp: np.ndarray, P: int, dtype: str, vocab: int) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, KL) of rows that keep only their entries of probability >= tau, the rest
    folded into the row's rest mass (a ragged top-k: a count per row, then the kept entries' code deltas and
    values in code order, codec v3's coding otherwise); KL on the top-k's own partition (`kl_dropped`)."""
    dictionary = group_dictionary(ids)
    codes = code_table(dictionary)[ids]
    values = codecs.SqrtProbs(127)
    vals = values.encode(lp)
    decoded = values.decode(vals)
    rows = []
    for tau, name in ((1 / 254 ** 2, "the sqrt code's floor, 1.55e-5"), (1e-4, "1e-4")):
        keep = lp >= np.log(tau)
        keep[:, 0] = True  # every row keeps its most likely entry
        kept_codes = np.where(keep, codes, np.iinfo(np.int64).max)  # dropped entries sort last
        d = sorted_code_deltas(kept_codes)
        order = np.argsort(kept_codes, axis=1, kind="stable")
        mask = np.sort(~keep, axis=1)  # the kept entries first in each sorted row
        flat_deltas = d[~mask].astype(dtype)[:, None]
        flat_vals = np.take_along_axis(vals, order, 1)[~mask][:, None]
        counts = keep.sum(1).astype(np.uint8)[:, None]
        b = (compressed_bytes(flat_deltas, "byte", 6, CHUNK_BYTES) + dictionary_bytes(dictionary)
             + compressed_bytes(flat_vals, level=9) + compressed_bytes(counts))
        kl = kl_dropped(lp, decoded, keep, vocab)
        rows.append(("ids + values", f"ragged rows: entries below {name} dropped into the rest ({keep.mean():.0%} of "
                     f"entries kept, {(keep.sum(1) == ids.shape[1]).mean():.0%} of rows whole)", b / P, kl))
    return rows


def candidate_rows(docs: list[dict], ids: np.ndarray, lp: np.ndarray, realized: np.ndarray,
                   k: int, vocab: int) -> list[tuple[str, str, float, float]]:
    """Every candidate row at `k`: (piece, candidate, B/position, mean KL error in nats). `ids` and `lp` [P, k]
    are in rank order (most likely first), as a teacher gives them."""
    ids_k, lp_k = ids[:, :k], lp[:, :k]
    P = len(ids_k)
    order = np.argsort(ids_k, axis=1, kind="stable")
    lp_sorted = np.take_along_axis(lp_k, order, 1)
    from bench.store_codec_bounds import context_bound_rows
    from bench.store_codec_refs import reference_rows, shallow_rows

    sqrt = codecs.SqrtProbs(127)
    vals = sqrt.encode(lp_k)
    kl = kl_top_rest(lp_k, sqrt.decode(vals))  # the sqrt code's, for the rows that keep every entry
    dtype = "uint16" if vocab <= 65_536 else "uint32"  # the store's id dtype
    return [*_value_rows(lp_sorted, P), *_id_rows(ids_k, P, dtype), *_dictionary_rows(ids_k, P, dtype),
            *_code_order_rows(ids_k, lp_k, P, dtype), *_joint_rows(ids_k, lp_k, P, dtype),
            *ragged_rows(ids_k, lp_k, P, dtype, vocab),
            *reference_rows(docs, ids_k, lp_k), *shallow_rows(ids_k, vals, kl),
            *context_bound_rows(docs, ids_k, vals, kl, vocab), *_side_rows(lp_k, realized, P), *_offset_rows(docs, P)]


def candidate_table(rows: list[tuple[str, str, float, float]], k: int) -> list[str]:
    """The candidates as a markdown table (printed by the bench, written to docs/store.md)."""
    lines = [f"| piece (k={k}) | candidate | B/position | mean KL error (nats) |", "| --- | --- | --- | --- |"]
    for piece, name, b, kl in rows:
        lines.append(f"| {piece} | {name} | {b:.2f} | {kl:.2e} |")
    return lines
