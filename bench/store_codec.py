"""Bytes per position, fidelity and speed of the teacher-cache codecs on a real (tiny) teacher.

    .venv/bin/python bench/store_codec.py [--teacher-steps 240] [--positions 20000] [--reads]

Builds once (cached in .xtcache_bench_cache/): a byte-level BPE tokenizer with a vocabulary above
65,536 (ids need 17 bits, as for Qwen3 or Llama-3) trained on the standard library's source plus
30 MB of installed site-packages source (the stdlib alone stops near 61k BPE tokens), and a
tiny Qwen2 teacher trained on that text for a fixed number of steps (the same teacher on any machine). Then takes the teacher's real T=1
distributions on held-out documents and, for k in {8, 64, 256}, prints for each codec variant:
bytes/position (ids, values, total with residual + realized log-prob), mean KL(original top-k+rest ||
decoded), encode/decode positions/s on one core, and the ratio against raw fp32 values + int32 ids.
The process pins itself to one CPU core; speeds are the best of 5 runs (the machine may be shared).

Codec v2 (format version 3): the candidates for each piece of a position at k=64
(`bench/store_codec_candidates.py`), then the whole store written and read through `CacheWriter` and
`CacheReader` with today's codecs (format version 2) and with v2 (version 3) side by side, in the same run.

`--write-docs` also writes README.md's `store-codec` block (the default codecs' row per k) and
`checked-reads` block (the checked-read table), and docs/store.md's `store-codec-v2` block (the
candidates and the whole store, v1 against v2), stamped with the command (xtcache.docblock).
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

from bench.store_codec_candidates import candidate_rows, candidate_table, chunk_blobs  # noqa: E402
from xtcache import codecs  # noqa: E402
from xtcache.store.arrays import default_compression  # noqa: E402
from xtcache.testing import toy  # noqa: E402

CACHE = REPO / ".xtcache_bench_cache"
DOC_BLOCKS = {"store-codec": "README.md", "checked-reads": "README.md",
              "store-codec-v2": "docs/store.md"}  # --write-docs: block -> file
DEFAULT_VARIANTS = {8: "sqrt127 shuf3", 64: "sqrt127 shuf3", 256: "sqrt255 shuf3"}  # the v2 value code per k
VERSIONS = {2: "v1 (format 2)", 3: "v2 (format 3)"}  # store format version -> codec name in the tables
TARGET_VOCAB = 80_000
log = logging.getLogger("bench.store_codec")


def corpus(extra_mb: float = 30.0) -> list[str]:
    """The standard library's source plus `extra_mb` of installed site-packages source, ~2,000 chars each.

    BPE on the stdlib alone stops near 61k tokens (every word already one token), short of the
    17-bit ids this bench is about; the site-packages sources (numpy, torch, transformers, ...)
    are more real Python text of the same kind.
    """
    import random
    import sysconfig

    docs = toy.stdlib_corpus(max_docs=100_000, doc_chars=2000, seed=0)
    site = Path(sysconfig.get_paths()["purelib"])
    budget = int(extra_mb * 1e6)
    extra: list[str] = []
    for path in sorted(site.rglob("*.py")):
        if budget <= 0:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        budget -= len(text)
        piece, size = [], 0
        for line in text.splitlines(keepends=True):
            piece.append(line)
            size += len(line)
            if size >= 2000:
                extra.append("".join(piece))
                piece, size = [], 0
    random.Random(0).shuffle(extra)
    return docs + extra


def build_teacher(steps: int) -> tuple[Path, list[str]]:
    """Tokenizer (vocab > 65,536) and a tiny teacher trained on it; cached between runs."""
    docs = corpus()
    held, train = docs[:200], docs[200:]  # held-out: stdlib documents never seen in training
    root = CACHE / f"teacher-v{TARGET_VOCAB}-s{steps}"
    toy.build_once(root, lambda: _train_teacher(root, train, steps))
    return root / "model", held


def _train_teacher(root: Path, train: list[str], steps: int) -> str:
    tok_dir = root / "tokenizer"
    tok = toy.train_bpe_tokenizer(train, TARGET_VOCAB, "teacher", tok_dir)
    vocab = len(tok)
    log.info("BPE tokenizer: %d tokens from %d documents (%.1f MB)", vocab, len(train),
             sum(map(len, train)) / 1e6)
    if vocab <= 65_536:
        raise SystemExit(f"BPE reached only {vocab} tokens on the stdlib text; ids would fit 16 bits. "
                         "Add more text (e.g. site-packages sources) before trusting this bench.")
    toy.build_tiny_model("qwen2", tok_dir, root / "model", hidden=128, layers=2, heads=4, kv_heads=2,
                         intermediate=384, seed=0)
    log.info("training the teacher for %d steps", steps)
    losses = toy.train_tiny_lm(root / "model", train, steps=steps, seq_len=128, batch_size=8, lr=3e-3)
    return json.dumps({"vocab": vocab, "steps": steps, "first_loss": losses[0],
                       "last_loss": float(np.mean(losses[-20:]))})


def teacher_documents(model_dir: Path, held: list[str], positions: int, k_max: int) -> list[dict]:
    """Held-out documents with the teacher's real T=1 top-k_max distributions (cached as .npz).

    Each dict: text, ids int32 [T], offsets int32 [T, 2], topk_ids int32 [T, k_max],
    topk_logprobs float32 [T, k_max], realized float32 [T]; row 0 has no prediction (zeros / NaN).
    """
    cache = model_dir.parent / f"dists-{positions}-{k_max}.npz"
    if not cache.exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        arrays: dict[str, np.ndarray] = {}
        texts, total = [], 0
        with torch.inference_mode():
            for text in held:
                enc = tok(text, return_offsets_mapping=True)
                ids, offs = enc["input_ids"][:256], enc["offset_mapping"][:256]
                if len(ids) < 2:
                    continue
                text = text[: offs[-1][1]]
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
                top = torch.topk(logp[:-1], k_max, dim=-1)  # row t predicts token t+1
                T = len(ids)
                top_ids = np.zeros((T, k_max), np.int32)
                top_lp = np.zeros((T, k_max), np.float32)
                top_ids[1:], top_lp[1:] = top.indices.numpy(), top.values.numpy()
                realized = np.full(T, np.nan, np.float32)
                realized[1:] = logp[torch.arange(T - 1), torch.tensor(ids[1:])].numpy()
                n = len(texts)
                arrays.update({f"ids{n}": np.array(ids, np.int32), f"offsets{n}": np.array(offs, np.int32),
                               f"topk_ids{n}": top_ids, f"topk_logprobs{n}": top_lp, f"realized{n}": realized})
                texts.append(text)
                total += T - 1
                if total >= positions:
                    break
        arrays["texts"] = np.array(texts)
        np.savez(cache, **arrays)
    data = np.load(cache, allow_pickle=False)
    return [{"text": str(t), "ids": data[f"ids{n}"], "offsets": data[f"offsets{n}"],
             "topk_ids": data[f"topk_ids{n}"], "topk_logprobs": data[f"topk_logprobs{n}"],
             "realized": data[f"realized{n}"]} for n, t in enumerate(data["texts"])]


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
    P = len(ids)
    best_enc = best_dec = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        deltas, order = ids_codec.encode(ids)
        vals = lp_codec.encode(np.take_along_axis(lp, order, 1))
        id_blobs, id_c = chunk_blobs(deltas, comp_ids)
        lp_blobs, lp_c = chunk_blobs(vals, comp_lp)
        best_enc = min(best_enc, time.perf_counter() - t0)
        t0 = time.perf_counter()
        d2 = np.concatenate([np.frombuffer(id_c.decode(b), dtype=deltas.dtype) for b in id_blobs]).reshape(deltas.shape)
        v2 = np.concatenate([np.frombuffer(lp_c.decode(b), dtype=vals.dtype) for b in lp_blobs]).reshape(vals.shape)
        dec_ids = ids_codec.decode(d2)
        dec_lp = lp_codec.decode(v2)
        best_dec = min(best_dec, time.perf_counter() - t0)
    sorted_ids = np.take_along_axis(ids, order, 1)
    if not np.array_equal(dec_ids, sorted_ids):
        raise SystemExit("id round trip failed")
    return {
        "ids_B": sum(map(len, id_blobs)) / P, "vals_B": sum(map(len, lp_blobs)) / P,
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
    pos = group["doc_pos_offsets"][...]
    for name, spec in meta.arrays.items():
        values = group[name][...]
        if spec.transform is not None:
            codec = codecs.codec_from_config(spec.transform)
            codec.decode(values, pos) if name == "char_offsets" else codec.decode(values)


def _best_rate(fn, positions: int, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return positions / best


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
    from xtcache.commands_store import store_summary
    from xtcache.store import CacheReader, CacheWriter

    manifest = Manifest(cache_key="bench", mode="topk", k=k, teacher_vocab_size=vocab, format_version=format_version)
    with tempfile.TemporaryDirectory() as tmp:
        with CacheWriter(f"{tmp}/sizes", manifest) as w:
            w.write_part(0, _records(docs, k))
        summary = store_summary(f"{tmp}/sizes")
        sid = summary["shards"][0].shard_id
        kl = _stored_kl(CacheReader(f"{tmp}/sizes").read_shard(sid), docs, k)
        bytes_unchecked = _without_crc32c(f"{tmp}/sizes", f"{tmp}/sizes-unchecked", sid)
        records = _records((docs * (1 + docs_per_part // len(docs)))[:docs_per_part], k)
        t0 = time.perf_counter()
        with CacheWriter(f"{tmp}/speed", manifest) as w:
            meta = w.write_part(0, records)
        write_s = time.perf_counter() - t0
        _without_crc32c(f"{tmp}/speed", f"{tmp}/speed-unchecked", meta.shard_id)
        reader = CacheReader(f"{tmp}/speed")
        n = meta.num_positions
        reads = {
            "zarr, no crc32c": _best_rate(lambda: _zarr_decode(f"{tmp}/speed-unchecked", meta), n),
            "zarr + crc32c": _best_rate(lambda: _zarr_decode(f"{tmp}/speed", meta), n),
            "read_shard": _best_rate(lambda: reader.read_shard(meta.shard_id), n),
            "read_shard verify": _best_rate(lambda: reader.read_shard(meta.shard_id, verify=True), n),
        }
    P = summary["positions"]
    return {"part_positions": n, "write": n / write_s, "reads": reads, "kl": kl,
            "bytes": {name: b / P for name, b in summary["bytes_by_array"].items()},
            "total": summary["total_array_bytes"] / P, "total_unchecked": bytes_unchecked / P}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher-steps", type=int, default=240, help="teacher training steps (first run; cached)")
    ap.add_argument("--positions", type=int, default=20_000, help="held-out teacher positions to encode")
    ap.add_argument("--write-docs", action="store_true",
                    help="also write README.md's store-codec and checked-reads blocks")
    ap.add_argument("--reads", action="store_true",
                    help="quick: only the whole store at k=64 (v1 and v2) and its checked reads; writes no docs")
    args = ap.parse_args()
    if args.reads and args.write_docs:
        raise SystemExit("--reads measures part of the tables: run without it to --write-docs")
    if args.write_docs:
        from xtcache.docblock import require_blocks

        require_blocks(REPO, DOC_BLOCKS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    model_dir, held = build_teacher(args.teacher_steps)
    ks = (8, 64, 256)
    docs = teacher_documents(model_dir, held, args.positions, max(ks))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    import numcodecs

    numcodecs.blosc.set_nthreads(1)
    numcodecs.blosc.use_threads = False
    if args.reads:
        store_rows(docs, (64,), vocab)
        return
    ids = np.concatenate([d["topk_ids"][1:] for d in docs])
    lp = np.concatenate([d["topk_logprobs"][1:] for d in docs])
    realized = np.concatenate([d["realized"][1:] for d in docs])
    info = json.loads((model_dir.parent / "DONE").read_text())
    teacher_line = (f"teacher: vocab {vocab}, {info['steps']} training steps, loss {info['first_loss']:.2f} -> "
                    f"{info['last_loss']:.2f}; {len(ids)} held-out positions in {len(docs)} documents; "
                    f"largest top-{max(ks)} id {int(ids.max())} ({int((ids >= 65536).sum())} ids >= 65536); one core")
    print(teacher_line)
    id_dtype = "uint16" if vocab <= 65536 else "uint32"
    permuted = np.random.default_rng(0).permutation(vocab).astype(np.int32)[ids]
    q8 = codecs.QuantizedLogProbs(8, -24.0)
    zstd3, byte3 = codecs.Compression(3, "none"), codecs.Compression(3, "byte")
    variants = [
        ("q8 zstd3", q8, zstd3, zstd3),
        ("q8 shuf3", q8, byte3, zstd3),
        ("sqrt127 shuf3", codecs.SqrtProbs(127), byte3, zstd3),
        ("sqrt255 shuf3", codecs.SqrtProbs(255), byte3, zstd3),
        ("q8 shuf7", q8, codecs.Compression(7, "byte"), codecs.Compression(7, "none")),
        ("q8 bitshuf5", q8, codecs.Compression(5, "bit"), codecs.Compression(5, "bit")),
        ("q8 zstd9", q8, codecs.Compression(9, "none"), codecs.Compression(9, "none")),
        ("q8/L38 shuf3", codecs.QuantizedLogProbs(8, -38.25), byte3, zstd3),
        ("q16 shuf3", codecs.QuantizedLogProbs(16, -24.0), byte3, byte3),
        ("f16 shuf3", codecs.FloatLogProbs("float16"), byte3, byte3),
        ("f32 shuf3", codecs.FloatLogProbs("float32"), byte3, byte3),
    ]
    hdr = (f"{'k':>4} {'variant':<13} {'ids B':>6} {'vals B':>7} {'side B':>6} {'total B':>7} {'vs raw':>6} "
           f"{'mean KL':>9} {'max|err|':>8} {'enc pos/s':>10} {'dec pos/s':>11}")
    print(hdr)
    print("-" * len(hdr))
    default_rows = []  # (k, measure, total, raw) of the store's own codecs
    for k in ks:
        ids_k, lp_k = ids[:, :k], lp[:, :k]
        side = side_bytes(lp_k, realized)
        raw = k * 8 + 8
        for name, lp_codec, c_ids, c_lp in variants:
            r = measure(ids_k, lp_k, codecs.SortedDeltaIds(id_dtype), lp_codec, c_ids, c_lp)
            total = r["ids_B"] + r["vals_B"] + side
            if name == DEFAULT_VARIANTS[k]:
                default_rows.append((k, r, total, raw))
            print(f"{k:>4} {name:<13} {r['ids_B']:>6.1f} {r['vals_B']:>7.1f} {side:>6.1f} {total:>7.1f} "
                  f"{raw / total:>5.1f}x {r['kl']:>9.2e} {r['max_err']:>8.4f} {r['enc']:>10,.0f} {r['dec']:>11,.0f}")
        # worst case for delta coding: a vocabulary whose id order says nothing about frequency
        r = measure(permuted[:, :k], lp_k, codecs.SortedDeltaIds(id_dtype), q8, byte3, zstd3)
        total = r["ids_B"] + r["vals_B"] + side
        print(f"{k:>4} {'q8 shuf3 perm':<13} {r['ids_B']:>6.1f} {r['vals_B']:>7.1f} {side:>6.1f} {total:>7.1f} "
              f"{raw / total:>5.1f}x {r['kl']:>9.2e} {r['max_err']:>8.4f} {r['enc']:>10,.0f} {r['dec']:>11,.0f}")
    print("perm: the same distributions with teacher ids relabelled by a fixed random permutation of "
          f"[0, {vocab}) (ids spread over all 17 bits, id order unrelated to frequency)")
    print("vs raw: k x (4 B int32 id + 4 B fp32 log-prob) + 8 B fp32 residual and realized log-prob "
          "(520 B at k=64) over total; side B: residual + realized log-prob")
    print()
    candidates = candidate_table(candidate_rows(docs, ids, lp, realized, 64), 64)
    print("codec v2 candidates (each piece of a position encoded one way; same distributions, one core):")
    print("\n".join(candidates))
    print()
    rows = store_rows(docs, ks, vocab)
    if args.write_docs:
        from xtcache.docblock import write_block

        write_block(REPO / "README.md", "store-codec", "\n".join([teacher_line, "", *codec_table(default_rows)]))
        write_block(REPO / "README.md", "checked-reads", "\n".join(checked_reads_table(rows)))
        write_block(REPO / "docs/store.md", "store-codec-v2", "\n".join(
            [teacher_line, "", *candidates, "", *whole_store_table(rows)]))


def store_rows(docs: list[dict], ks, vocab: int) -> list[tuple[int, dict]]:
    """The whole store per k (default codecs): sizes, write rate, and the checked reads, printed; the rows."""
    print("whole store (sizes from the held-out part, speeds on a part of 256 documents; one core):")
    rows = []
    for k in ks:
        for version, name in VERSIONS.items():
            r = store_round_trip(docs, k, vocab, format_version=version)
            parts = ", ".join(f"{n} {b:.1f}" for n, b in sorted(r["bytes"].items(), key=lambda kv: -kv[1]))
            print(f"  k={k:<3} {name}: {r['total']:6.1f} B/position ({parts})")
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
    return kl_top_rest(lp_sorted[has], shard.topk_logprobs[has], shard.residual[has])


def whole_store_table(rows) -> list[str]:
    """docs/store.md's whole-store table: v1 and v2 per k, sizes by array, stored KL error, checked reads."""
    lines = ["| k | codec | B/position | values | ids | residual + realized | offsets, text, teacher ids | mean KL error "
             "(nats) | read_shard pos/s (1 core) | read_shard verify pos/s |", "| --- " * 10 + "|"]
    for k, r in rows:
        b = r["bytes"]
        side = b.get("residual", 0) + b.get("realized_logprob", 0)
        rest = r["total"] - b["topk_logprobs"] - b["topk_ids"] - side
        lines.append(f"| {k} | {r['codec']} | {r['total']:.1f} | {b['topk_logprobs']:.1f} | {b['topk_ids']:.1f} | "
                     f"{side:.1f} | {rest:.1f} | {r['kl']:.2e} | {r['reads']['read_shard']:,.0f} | "
                     f"{r['reads']['read_shard verify']:,.0f} |")
    return lines


def codec_table(rows) -> list[str]:
    """README's codec table: the store's own value code (DEFAULT_VARIANTS) per k."""
    lines = ["| k | ids B/pos | values B/pos | total B/pos | vs raw | mean KL error (nats) | decode pos/s (1 core) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for k, r, total, raw in rows:
        lines.append(f"| {k} | {r['ids_B']:.1f} | {r['vals_B']:.1f} | {total:.1f} | {raw / total:.1f}x | "
                     f"{r['kl']:.2e} | {r['dec']:,.0f} |")
    return lines


def checked_reads_table(rows) -> list[str]:
    """README's checked-reads table: read + decode positions/s of one part, four ways, per k."""
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
