"""Bytes per position, fidelity and speed of the teacher-cache codecs on a toy teacher and a real one.

    .venv/bin/python bench/store_codec.py [--teacher toy|real] [--teacher-steps 240] [--positions 20000] [--reads]

`--teacher toy` (the default) builds once (cached in .xtcache_bench_cache/, `bench/store_codec_teachers.py`):
a byte-level BPE tokenizer with a vocabulary above 65,536 (ids need 17 bits, as for Qwen3 or Llama-3)
trained on the standard library's source plus 30 MB of installed site-packages source (the stdlib alone
stops near 61k BPE tokens), and a tiny Qwen2 teacher trained on that text for a fixed number of steps (the
same recipe on any machine, not the same weights: see `bench/store_codec_teachers.py`). Then takes the teacher's real T=1 distributions on held-out documents and,
for k in {8, 64, 256}, prints for each codec variant: bytes/position (ids, values, total with residual +
realized log-prob), mean KL(original top-k+rest || decoded), encode/decode positions/s on one core, and
the ratio against raw fp32 values + int32 ids. The process pins itself to one CPU core; speeds are the
best of 5 runs in CPU time of the process (`time.process_time`), so that other work on a shared machine
does not count as codec time.

`--teacher real` takes the distributions of a trained teacher instead: SmolLM2-135M-Instruct (49,152 ids,
xtcache.testing.real) run with transformers on the real tier's held-out documentation topics (up to 2,048
tokens each), and measures k=64 only, printing `real k=64 v<N> (format <F>): <B> B/position` per codec; its
candidates add the ideal coder with context on the real tier's training documents too (about 88k positions,
one store part's worth: the teacher runs over them once, cached beside the held-out distributions).

Both teachers: the candidates for each piece of a position at k=64 (`bench/store_codec_candidates.py`,
`bench/store_codec_refs.py`, the ideal coder with context of `bench/store_codec_bounds.py`), then the whole store written and read through `CacheWriter` and
`CacheReader` with each codec version (v1: format 2, v2: format 3, v3: format 4) side by side, in the same run.

`--write-docs` also writes, for the toy teacher, docs/benchmarks.md's `store-codec` block (the default codecs' row
per k) and `checked-reads` block (the checked-read table) and docs/store.md's `store-codec-toy` block (the
candidates and the whole store per codec version), and for the real teacher docs/store.md's
`store-codec-real` block, stamped with the command (xtcache.app.docblock).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.store_codec_bounds import context_bound_rows  # noqa: E402
from bench.store_codec_candidates import (  # noqa: E402
    best_rate,
    candidate_rows,
    candidate_table,
    chunk_blobs,
    kl_top_rest,
)
from bench.store_codec_teachers import (  # noqa: E402
    build_teacher,
    real_teacher,
    real_training_texts,
    teacher_documents,
)
from xtcache.store import codecs  # noqa: E402
from xtcache.store.arrays import default_compression  # noqa: E402

DOC_BLOCKS = {"store-codec": "docs/benchmarks.md", "checked-reads": "docs/benchmarks.md",
              "store-codec-toy": "docs/store.md", "store-codec-real": "docs/store.md"}  # --write-docs: block -> file
TEACHER_BLOCKS = {"toy": ("store-codec", "checked-reads", "store-codec-toy"), "real": ("store-codec-real",)}
DEFAULT_VARIANTS = {8: "v3 sqrt127", 64: "v3 sqrt127", 256: "v3 sqrt255"}  # the store's codecs per k (format 4)
VERSIONS = {2: "v1 (format 2)", 3: "v2 (format 3)", 4: "v3 (format 4)"}  # store format version -> codec name
TOY_KS, REAL_KS = (8, 64, 256), (64,)


def kl_error(lp: np.ndarray, decoded: np.ndarray) -> float:
    """Mean over rows of KL(p || q): p = top-k probs + rest, q = decoded probs + the same rest, renormalized."""
    p = np.exp(lp.astype(np.float64))
    rest = np.clip(1 - p.sum(1, keepdims=True), 0, None)
    q = np.exp(decoded.astype(np.float64))
    pf = np.concatenate([p, rest], 1)
    qf = np.concatenate([q, rest], 1)
    qf /= qf.sum(1, keepdims=True)
    pf /= pf.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(pf > 0, pf * (np.log(pf) - np.log(np.maximum(qf, 1e-300))), 0.0)
    return float(terms.sum(1).mean())


def measure(ids, lp, ids_codec, lp_codec, comp_ids, comp_lp, repeat: int = 5) -> dict:
    """Sizes, KL error and encode/decode rates of one id and value codec (a `DictDeltaIds` with its dictionary,
    counted in the ids' bytes and compressed as the store compresses `topk_id_dict`)."""
    P = len(ids)
    best_enc = best_dec = float("inf")
    dict_comp = default_compression("topk_id_dict")
    for _ in range(repeat):
        t0 = time.process_time()
        dict_blobs: list = []
        if isinstance(ids_codec, codecs.DictDeltaIds):
            dictionary = ids_codec.dictionary(ids)
            deltas, order = ids_codec.encode(ids, dictionary)
            dict_blobs, dict_c = chunk_blobs(ids_codec.encode_dictionary(dictionary)[:, None], dict_comp)
        else:
            deltas, order = ids_codec.encode(ids)
        vals = lp_codec.encode(np.take_along_axis(lp, order, 1))
        id_blobs, id_c = chunk_blobs(deltas, comp_ids)
        lp_blobs, lp_c = chunk_blobs(vals, comp_lp)
        best_enc = min(best_enc, time.process_time() - t0)
        t0 = time.process_time()
        d2 = np.concatenate([np.frombuffer(id_c.decode(b), dtype=deltas.dtype) for b in id_blobs]).reshape(deltas.shape)
        v2 = np.concatenate([np.frombuffer(lp_c.decode(b), dtype=vals.dtype) for b in lp_blobs]).reshape(vals.shape)
        if dict_blobs:
            stored = np.concatenate([np.frombuffer(dict_c.decode(b), dtype=np.int32) for b in dict_blobs])
            dec_ids = ids_codec.decode(d2, ids_codec.decode_dictionary(stored))
        else:
            dec_ids = ids_codec.decode(d2)
        dec_lp = lp_codec.decode(v2)
        best_dec = min(best_dec, time.process_time() - t0)
    sorted_ids = np.take_along_axis(ids, order, 1)
    if not np.array_equal(dec_ids, sorted_ids):
        raise SystemExit("id round trip failed")
    return {
        "ids_B": (sum(map(len, id_blobs)) + sum(map(len, dict_blobs))) / P, "vals_B": sum(map(len, lp_blobs)) / P,
        "kl": kl_error(np.take_along_axis(lp, order, 1), dec_lp),
        "enc": P / best_enc, "dec": P / best_dec,
        "max_err": float(np.abs(dec_lp - np.take_along_axis(lp, order, 1)).max()),
    }


def side_bytes(lp: np.ndarray, realized: np.ndarray) -> float:
    """Bytes/position of residual + realized log-prob (float32) with the store's default compression."""
    rest = np.clip(1 - np.exp(lp.astype(np.float64)).sum(1), 0, None).astype(np.float32)
    total = 0
    for name, values in (("residual", rest), ("realized_logprob", np.ascontiguousarray(realized))):
        total += sum(map(len, chunk_blobs(values[:, None], default_compression(name))[0]))
    return total / len(lp)


def _records(docs: list[dict], k: int) -> list:
    from xtcache.store import DocRecord

    records = []
    for n, d in enumerate(docs):
        T = len(d["ids"])
        lp = d["topk_logprobs"][:, :k]
        rest = np.clip(1 - np.exp(lp.astype(np.float64)).sum(1), 0, None).astype(np.float32)
        rest[0] = 0
        records.append(DocRecord(
            source="heldout", row=n, text=d["text"], teacher_ids=d["ids"], char_offsets=d["offsets"],
            has_pred=np.arange(T) > 0, topk_ids=d["topk_ids"][:, :k], topk_logprobs=lp, topk_counts=None,
            residual=rest, realized_logprob=d["realized"]))
    return records


def _without_crc32c(src: str, dst: str, sid: str) -> int:
    """Copy of one part's arrays with the codec chain of stores written before checked reads (no
    crc32c, empty chunks skipped): the unchecked baseline. Returns its stored bytes."""
    import shutil

    import zarr

    shutil.copytree(src, dst)
    total = 0
    for path in sorted(Path(dst, "shards", sid).iterdir()):
        if not (path / "zarr.json").is_file():
            continue
        arr = zarr.open_array(str(path), mode="r")
        values, meta = arr[...], arr.metadata
        inner = meta.codecs[0]
        shutil.rmtree(path)
        new = zarr.create_array(str(path.parent), name=path.name, shape=values.shape, dtype=values.dtype,
                                chunks=inner.chunk_shape, shards=meta.chunk_grid.chunk_shape,
                                compressors=[c for c in inner.codecs[1:] if type(c).__name__ != "Crc32cCodec"],
                                fill_value=0, zarr_format=3, attributes=dict(arr.attrs))
        new[...] = values
        total += sum(f.stat().st_size for f in (path / "c").rglob("*") if f.is_file())
    return total


def _zarr_decode(url: str, meta) -> None:
    """Read one part's arrays with a plain Zarr reader and invert the transforms, no other check."""
    import zarr

    group = zarr.open_group(url, mode="r", path=f"shards/{meta.shard_id}")
    values = {name: group[name][...] for name in meta.arrays}
    for name, spec in meta.arrays.items():
        codec = codecs.codec_from_config(spec.transform) if spec.transform is not None else None
        if name == "char_offsets" and codec is not None:
            codec.decode(values[name], values["doc_pos_offsets"])
        elif name == "topk_ids" and isinstance(codec, codecs.DictDeltaIds):
            codec.decode(values[name], codec.decode_dictionary(values["topk_id_dict"]))
        elif codec is not None and name != "topk_id_dict":  # the dictionary: decoded with the ids
            codec.decode(values[name])


def store_round_trip(docs: list[dict], k: int, vocab: int, docs_per_part: int = 256, format_version: int = 3) -> dict:
    """Write through CacheWriter (default codecs) and read back, checked and unchecked side by side.

    Sizes come from one part of the distinct held-out documents; speeds from a part of
    `docs_per_part` documents (stage 1's default part size; the held-out documents repeated).
    Reads: a plain Zarr read + transform decode of the part without crc32c (stores before checked
    reads) and with it (the crc32c cost alone); `CacheReader.read_shard` (what the trainer runs:
    crc32c, missing objects, index, offsets, id range); `read_shard(verify=True)` (what `xtcache
    verify` runs: + sha256 of every array and the content hash of every document).
    """
    import tempfile

    from schemas.models import Manifest
    from xtcache.app.store_commands import store_summary
    from xtcache.store import CacheReader, CacheWriter

    manifest = Manifest(cache_key="bench", mode="topk", k=k, teacher_vocab_size=vocab, format_version=format_version)
    with tempfile.TemporaryDirectory() as tmp:
        with CacheWriter(f"{tmp}/sizes", manifest) as w:
            w.write_part(0, _records(docs, k))
        summary = store_summary(f"{tmp}/sizes")
        sid = summary.shards[0].shard_id
        kl = _stored_kl(CacheReader(f"{tmp}/sizes").read_shard(sid), docs, k)
        bytes_unchecked = _without_crc32c(f"{tmp}/sizes", f"{tmp}/sizes-unchecked", sid)
        records = _records((docs * (1 + docs_per_part // len(docs)))[:docs_per_part], k)
        t0 = time.process_time()
        with CacheWriter(f"{tmp}/speed", manifest) as w:
            meta = w.write_part(0, records)
        write_s = time.process_time() - t0
        _without_crc32c(f"{tmp}/speed", f"{tmp}/speed-unchecked", meta.shard_id)
        reader = CacheReader(f"{tmp}/speed")
        n = meta.num_positions
        reads = {
            "zarr, no crc32c": best_rate(lambda: _zarr_decode(f"{tmp}/speed-unchecked", meta), n, repeat=5),
            "zarr + crc32c": best_rate(lambda: _zarr_decode(f"{tmp}/speed", meta), n, repeat=5),
            "read_shard": best_rate(lambda: reader.read_shard(meta.shard_id), n, repeat=5),
            "read_shard verify": best_rate(lambda: reader.read_shard(meta.shard_id, verify=True), n, repeat=5),
        }
    P = summary.positions
    return {"part_positions": n, "write": n / write_s, "reads": reads, "kl": kl,
            "bytes": {name: b / P for name, b in summary.bytes_by_array.items()},
            "total": summary.total_array_bytes / P, "total_unchecked": bytes_unchecked / P}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", choices=("toy", "real"), default="toy",
                    help="toy: the tiny teacher trained here (80k ids); real: SmolLM2-135M-Instruct (49,152 ids)")
    ap.add_argument("--teacher-steps", type=int, default=240, help="toy teacher training steps (first run; cached)")
    ap.add_argument("--positions", type=int, default=20_000, help="held-out teacher positions to encode")
    ap.add_argument("--write-docs", action="store_true",
                    help="also write the teacher's doc blocks (toy: docs/benchmarks.md's store-codec, checked-reads, "
                         "docs/store.md's store-codec-toy; real: docs/store.md's store-codec-real)")
    ap.add_argument("--reads", action="store_true",
                    help="quick: only the whole store at k=64 (every codec version) and its checked reads; writes no docs")
    args = ap.parse_args()
    if args.reads and args.write_docs:
        raise SystemExit("--reads measures part of the tables: run without it to --write-docs")
    if args.write_docs:
        from xtcache.app.docblock import require_blocks

        require_blocks(REPO, {b: DOC_BLOCKS[b] for b in TEACHER_BLOCKS[args.teacher]})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    ks = TOY_KS if args.teacher == "toy" else REAL_KS
    if args.teacher == "toy":
        model_dir, held = build_teacher(args.teacher_steps)
        docs = teacher_documents(model_dir, held, args.positions, max(TOY_KS))
    else:  # k_max of the toy's largest k: one cache of distributions serves any k
        model_dir, held, cache_dir = real_teacher()
        docs = teacher_documents(model_dir, held, args.positions, max(TOY_KS), cache_dir=cache_dir, max_tokens=2048)
        if not args.reads:  # before the pinning below: the teacher's first run over them uses every core
            train = teacher_documents(model_dir, real_training_texts(), 100_000, 64, cache_dir=cache_dir,
                                      max_tokens=2048, corpus="train")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import numcodecs

    numcodecs.blosc.set_nthreads(1)
    numcodecs.blosc.use_threads = False
    if args.reads:
        store_rows(docs, (64,), vocab, args.teacher)
        return
    ids = np.concatenate([d["topk_ids"][1:] for d in docs])
    lp = np.concatenate([d["topk_logprobs"][1:] for d in docs])
    realized = np.concatenate([d["realized"][1:] for d in docs])
    if args.teacher == "toy":
        info = json.loads((model_dir.parent / "DONE").read_text())
        about = f"toy teacher: vocab {vocab}, {info['steps']} training steps, loss {info['first_loss']:.2f} -> {info['last_loss']:.2f}"
    else:
        about = f"real teacher: {model_dir.name}, vocab {vocab}"
    mass = float(np.exp(lp[:, :64].astype(np.float64)).sum(1).mean())
    teacher_line = (f"{about}; {len(ids)} held-out positions in {len(docs)} documents; mean top-64 mass {mass:.3f}; "
                    f"largest top-{max(ks)} id {int(ids[:, :max(ks)].max())} "
                    f"({int((ids[:, :max(ks)] >= 65536).sum())} ids >= 65536); one core")
    print(teacher_line)
    default_rows = variant_table(ids, lp, realized, ks, vocab) if args.teacher == "toy" else []
    more = training_context_rows(train, vocab) if args.teacher == "real" else []
    candidates = candidate_table(candidate_rows(docs, ids, lp, realized, 64, vocab) + more, 64)
    print("codec candidates (each piece of a position encoded one way; same distributions, one core):")
    print("\n".join(candidates))
    print()
    rows = store_rows(docs, ks, vocab, args.teacher)
    if args.write_docs:
        from xtcache.app.docblock import write_block

        store_block = "\n".join([teacher_line, "", *candidates, "", *whole_store_table(rows)])
        if args.teacher == "real":
            write_block(REPO / "docs/store.md", "store-codec-real", store_block)
            return
        write_block(REPO / DOC_BLOCKS["store-codec"], "store-codec",
                    "\n".join([teacher_line, "", *codec_table(default_rows)]))
        write_block(REPO / DOC_BLOCKS["checked-reads"], "checked-reads", "\n".join(checked_reads_table(rows)))
        write_block(REPO / "docs/store.md", "store-codec-toy", store_block)


def training_context_rows(train: list[dict], vocab: int) -> list[tuple[str, str, float, float]]:
    """The ideal coder with context on the real tier's training documents: one store part's worth of positions,
    four times the held-out documents', to show what the context models gain from more rows."""
    ids = np.concatenate([d["topk_ids"][1:, :64] for d in train])
    lp = np.concatenate([d["topk_logprobs"][1:, :64] for d in train])
    sqrt = codecs.SqrtProbs(127)
    vals = sqrt.encode(lp)
    return context_bound_rows(train, ids, vals, kl_top_rest(lp, sqrt.decode(vals)), vocab,
                              where=f"; the training documents, {len(ids):,} positions")


def variant_table(ids: np.ndarray, lp: np.ndarray, realized: np.ndarray, ks, vocab: int) -> list:
    """Print every id + value codec variant per k (sizes, KL, speeds); the rows of the store's defaults."""
    id_dtype = "uint16" if vocab <= 65536 else "uint32"
    permuted = np.random.default_rng(0).permutation(vocab).astype(np.int32)[ids]
    q8 = codecs.QuantizedLogProbs(8, -24.0)
    zstd3, byte3 = codecs.Compression(3, "none"), codecs.Compression(3, "byte")
    sorted_ids, dict_ids = codecs.SortedDeltaIds(id_dtype), codecs.DictDeltaIds(id_dtype)
    v3_ids, v3_lp = default_compression("topk_ids"), default_compression("topk_logprobs")
    variants = [
        ("q8 zstd3", sorted_ids, q8, zstd3, zstd3),
        ("q8 shuf3", sorted_ids, q8, byte3, zstd3),
        ("sqrt127 shuf3", sorted_ids, codecs.SqrtProbs(127), byte3, zstd3),
        ("sqrt255 shuf3", sorted_ids, codecs.SqrtProbs(255), byte3, zstd3),
        ("q8 shuf7", sorted_ids, q8, codecs.Compression(7, "byte"), codecs.Compression(7, "none")),
        ("q8 bitshuf5", sorted_ids, q8, codecs.Compression(5, "bit"), codecs.Compression(5, "bit")),
        ("q8 zstd9", sorted_ids, q8, codecs.Compression(9, "none"), codecs.Compression(9, "none")),
        ("q8/L38 shuf3", sorted_ids, codecs.QuantizedLogProbs(8, -38.25), byte3, zstd3),
        ("q16 shuf3", sorted_ids, codecs.QuantizedLogProbs(16, -24.0), byte3, byte3),
        ("f16 shuf3", sorted_ids, codecs.FloatLogProbs("float16"), byte3, byte3),
        ("f32 shuf3", sorted_ids, codecs.FloatLogProbs("float32"), byte3, byte3),
        ("v3 sqrt127", dict_ids, codecs.SqrtProbs(127), v3_ids, v3_lp),
        ("v3 sqrt255", dict_ids, codecs.SqrtProbs(255), v3_ids, v3_lp),
    ]
    hdr = (f"{'k':>4} {'variant':<13} {'ids B':>6} {'vals B':>7} {'side B':>6} {'total B':>7} {'vs raw':>6} "
           f"{'mean KL':>9} {'max|err|':>8} {'enc pos/s':>10} {'dec pos/s':>11}")
    print(hdr)
    print("-" * len(hdr))
    default_rows = []  # (k, measure, total, raw) of the store's own codecs

    def show(k, name, r, side, raw):
        total = r["ids_B"] + r["vals_B"] + side
        print(f"{k:>4} {name:<13} {r['ids_B']:>6.1f} {r['vals_B']:>7.1f} {side:>6.1f} {total:>7.1f} "
              f"{raw / total:>5.1f}x {r['kl']:>9.2e} {r['max_err']:>8.4f} {r['enc']:>10,.0f} {r['dec']:>11,.0f}")
        return total

    for k in ks:
        ids_k, lp_k = ids[:, :k], lp[:, :k]
        side = side_bytes(lp_k, realized)
        raw = k * 8 + 8
        for name, ids_codec, lp_codec, c_ids, c_lp in variants:
            r = measure(ids_k, lp_k, ids_codec, lp_codec, c_ids, c_lp)
            total = show(k, name, r, side, raw)
            if name == DEFAULT_VARIANTS[k]:
                default_rows.append((k, r, total, raw))
        # worst case for delta coding: a vocabulary whose id order says nothing about frequency
        show(k, "q8 shuf3 perm", measure(permuted[:, :k], lp_k, sorted_ids, q8, byte3, zstd3), side, raw)
        show(k, "v3 perm", measure(permuted[:, :k], lp_k, dict_ids, codecs.SqrtProbs(127), v3_ids, v3_lp), side, raw)
    print("perm: the same distributions with teacher ids relabelled by a fixed random permutation of "
          f"[0, {vocab}) (ids spread over all 17 bits, id order unrelated to frequency)")
    print("v3: ids as dictionary codes (the dictionary counted in ids B), blosc level 6 in 1 MiB blocks; values "
          "zstd 9 (the store's format 4); vs raw: k x (4 B int32 id + 4 B fp32 log-prob) + 8 B fp32 residual and "
          "realized log-prob (520 B at k=64) over total; side B: residual + realized log-prob (float32)")
    print()
    return default_rows


def store_rows(docs: list[dict], ks, vocab: int, teacher: str) -> list[tuple[int, dict]]:
    """The whole store per k and codec version: sizes, write rate, and the checked reads, printed; the rows.

    One line per store reads exactly `{teacher} k={k} v<N> (format <F>): <B> B/position`, the bytes by
    array on the next."""
    print("whole store (sizes from the held-out part, speeds on a part of 256 documents; one core):")
    rows = []
    for k in ks:
        for version, name in VERSIONS.items():
            r = store_round_trip(docs, k, vocab, format_version=version)
            parts = ", ".join(f"{n} {b:.1f}" for n, b in sorted(r["bytes"].items(), key=lambda kv: -kv[1]))
            print(f"{teacher} k={k} {name}: {r['total']:.1f} B/position")
            print(f"        {parts}; mean KL error {r['kl']:.2e}")
            print(f"        part of {r['part_positions']:,} positions: write {r['write']:,.0f} pos/s, read_shard "
                  f"{r['reads']['read_shard']:,.0f} pos/s")
            r["codec"] = name
            rows.append((k, r))
    print()
    print("checked reads (same part, same run; read+decode positions/s, one core):")
    names = list(rows[0][1]["reads"])
    hdr = f"{'k':>4} {'':<2} {'B/pos no crc':>12} {'B/pos crc32c':>12} " + " ".join(f"{n:>18}" for n in names) + \
        f" {'read_shard / zarr no crc':>25}"
    print(hdr)
    print("-" * len(hdr))
    for k, r in rows:
        reads = r["reads"]
        print(f"{k:>4} {r['codec'][:2]} {r['total_unchecked']:>12.2f} {r['total']:>12.2f} " + " ".join(f"{reads[n]:>18,.0f}" for n in names)
              + f" {reads['read_shard'] / reads['zarr, no crc32c']:>25.2f}")
    print("zarr, no crc32c: a plain Zarr read of the part as written before checked reads (no check at all); "
          "zarr + crc32c: the same with the crc32c codec; read_shard: what train-student reads (crc32c, "
          "missing objects, index, offsets, id range); read_shard verify: what `xtcache verify` reads (+ sha256, "
          "content hashes)")
    return rows


def _stored_kl(shard, docs: list[dict], k: int) -> float:
    """Mean KL(original top-k + rest || stored top-k + stored residual) over the predicted positions."""
    from bench.store_codec_candidates import kl_top_rest

    ids = np.concatenate([d["topk_ids"][:, :k] for d in docs])
    lp = np.concatenate([d["topk_logprobs"][:, :k] for d in docs])
    has = shard.has_pred
    lp_sorted = np.take_along_axis(lp, np.argsort(ids, axis=1, kind="stable"), 1)
    by_id = np.argsort(shard.topk_ids, axis=1, kind="stable")  # the stored rows, in whatever order, by id
    if not np.array_equal(np.take_along_axis(shard.topk_ids, by_id, 1)[has], np.sort(ids, axis=1)[has]):
        raise SystemExit("the store's ids differ from the teacher's")
    return kl_top_rest(lp_sorted[has], np.take_along_axis(shard.topk_logprobs, by_id, 1)[has], shard.residual[has])


PER_ARRAY = ("topk_ids", "topk_id_dict", "topk_logprobs", "residual", "realized_logprob", "teacher_ids", "doc_text",
             "char_offsets")  # the columns of the whole-store table; the other arrays are summed as "other"


def whole_store_table(rows) -> list[str]:
    """docs/store.md's whole-store table: each codec version per k, bytes by array, stored KL error, rates."""
    lines = ["| k | codec | B/position | " + " | ".join(f"`{n}`" for n in PER_ARRAY) + " | other | mean KL error (nats) "
             "| read_shard pos/s (1 core) | read_shard verify pos/s | write pos/s |", "| --- " * (len(PER_ARRAY) + 8) + "|"]
    for k, r in rows:
        b = r["bytes"]
        other = r["total"] - sum(b.get(n, 0.0) for n in PER_ARRAY)
        cells = " | ".join(f"{b[n]:.2f}" if n in b else "-" for n in PER_ARRAY)
        lines.append(f"| {k} | {r['codec']} | {r['total']:.1f} | {cells} | {other:.2f} | {r['kl']:.2e} | "
                     f"{r['reads']['read_shard']:,.0f} | {r['reads']['read_shard verify']:,.0f} | {r['write']:,.0f} |")
    return lines


def codec_table(rows) -> list[str]:
    """The store-codec table: the store's own value code (DEFAULT_VARIANTS) per k."""
    lines = ["| k | ids B/pos | values B/pos | total B/pos | vs raw | mean KL error (nats) | decode pos/s (1 core) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for k, r, total, raw in rows:
        lines.append(f"| {k} | {r['ids_B']:.1f} | {r['vals_B']:.1f} | {total:.1f} | {raw / total:.1f}x | "
                     f"{r['kl']:.2e} | {r['dec']:,.0f} |")
    return lines


def checked_reads_table(rows) -> list[str]:
    """The checked-reads table: read + decode positions/s of one part, four ways, per k."""
    lines = ["| k | codec | B/pos without crc32c | B/pos with crc32c | Zarr, no checks | Zarr + crc32c | read_shard (trainer) "
             "| read_shard verify | trainer read / unchecked |", "| --- " * 9 + "|"]
    for k, r in rows:
        reads = r["reads"]
        lines.append(f"| {k} | {r['codec']} | {r['total_unchecked']:.2f} | {r['total']:.2f} | " + " | ".join(
            f"{reads[n]:,.0f}" for n in ("zarr, no crc32c", "zarr + crc32c", "read_shard", "read_shard verify"))
            + f" | {reads['read_shard'] / reads['zarr, no crc32c']:.2f}x |")
    return lines


if __name__ == "__main__":
    main()
