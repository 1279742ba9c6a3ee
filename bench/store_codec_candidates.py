"""Codec v2 candidates measured on the same teacher distributions: bytes/position and KL error per piece.

Imported by `bench/store_codec.py` (which builds the teacher and its held-out top-k distributions and
prints this table beside today's codec); each row encodes one piece of a position (values, ids, side
arrays, offsets) one way, compressed per inner chunk as the store compresses it (zstd 3, byte or bit
shuffle), so that the store's default (format version 3) is chosen by these numbers.

    .venv/bin/python bench/store_codec.py      # prints "codec v2 candidates" among its tables
"""

from __future__ import annotations

import numpy as np

from xtcache import codecs

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


def kl_top_rest(lp: np.ndarray, decoded: np.ndarray, rest: np.ndarray | None = None) -> float:
    """Mean KL(p || q) over rows: p = top-k probs + their rest mass, q = decoded probs + `rest` (the
    original rest when None), renormalised; float64."""
    p = np.exp(lp.astype(np.float64))
    p_rest = np.clip(1 - p.sum(1, keepdims=True), 0, None)
    q_rest = p_rest if rest is None else np.clip(rest.astype(np.float64), 0, None)[:, None]
    pf = np.concatenate([p, p_rest], 1)
    qf = np.concatenate([np.exp(decoded.astype(np.float64)), q_rest], 1)
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


def _id_rows(ids: np.ndarray, P: int) -> list[tuple[str, str, float, float]]:
    """(piece, candidate, B/position, 0) of the top-k ids coded several ways."""
    sorted_ids = np.sort(ids, axis=1)
    deltas, _ = codecs.SortedDeltaIds("uint32").encode(ids)
    rows = [("ids", "sorted, delta uint32, byte shuffle (v1)", compressed_bytes(deltas, "byte") / P, 0.0),
            ("ids", "sorted, delta uint32, bitshuffle", compressed_bytes(deltas, "bit") / P, 0.0),
            ("ids", "sorted, delta uint32, byte shuffle, level 6", compressed_bytes(deltas, "byte", 6) / P, 0.0),
            ("ids", "sorted, delta uint32, byte shuffle, level 6, 1 MiB blocks (v2)",
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


def _side_rows(lp: np.ndarray, realized: np.ndarray, P: int) -> list[tuple[str, str, float, float]]:
    rest = np.clip(1 - np.exp(lp.astype(np.float64)).sum(1), 0, None)
    rest16 = rest.astype(np.float16).astype(np.float64)
    kl16 = kl_top_rest(lp, lp, rest16)
    real = np.ascontiguousarray(realized)
    return [
        ("residual + realized", "float32 x 2 (v1)",
         (compressed_bytes(rest.astype(np.float32), "byte") + compressed_bytes(real.astype(np.float32), "byte")) / P,
         0.0),
        ("residual + realized", "float16 x 2 (v2)",
         (compressed_bytes(rest.astype(np.float16), "byte") + compressed_bytes(real.astype(np.float16), "byte")) / P,
         kl16),
    ]


def _offset_rows(docs: list[dict], P: int) -> list[tuple[str, str, float, float]]:
    offs = np.concatenate([d["offsets"][1:] for d in docs]).astype(np.int32)  # [P, 2]
    starts = offs[:, 0].astype(np.int64)
    prev_end = np.concatenate([[0], offs[:-1, 1]]).astype(np.int64)
    delta = np.stack([starts - prev_end, offs[:, 1] - starts], 1).astype(np.int32)
    return [("char offsets", "int32 (start, end) (v1)", compressed_bytes(offs) / P, 0.0),
            ("char offsets", "int32 (start - previous end, length)", compressed_bytes(delta, "byte") / P, 0.0)]


def candidate_rows(docs: list[dict], ids: np.ndarray, lp: np.ndarray, realized: np.ndarray,
                   k: int) -> list[tuple[str, str, float, float]]:
    """Every candidate row at `k`: (piece, candidate, B/position, mean KL error in nats)."""
    ids_k, lp_k = ids[:, :k], lp[:, :k]
    P = len(ids_k)
    order = np.argsort(ids_k, axis=1, kind="stable")
    lp_sorted = np.take_along_axis(lp_k, order, 1)
    return [*_value_rows(lp_sorted, P), *_id_rows(ids_k, P), *_side_rows(lp_k, realized, P), *_offset_rows(docs, P)]


def candidate_table(rows: list[tuple[str, str, float, float]], k: int) -> list[str]:
    """The candidates as a markdown table (printed by the bench, written to docs/store.md)."""
    lines = [f"| piece (k={k}) | candidate | B/position | mean KL error (nats) |", "| --- | --- | --- | --- |"]
    for piece, name, b, kl in rows:
        lines.append(f"| {piece} | {name} | {b:.2f} | {kl:.2e} |")
    return lines
