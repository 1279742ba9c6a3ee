"""`xtcache inspect`, `xtcache verify` and `xtcache cache ls`: look into teacher-cache stores.

    xtcache inspect out/cache                 # documents, positions, bytes/position, alignment groups
    xtcache verify out/cache [--all]          # checksums, counts, schema, format version of every part
    xtcache cache ls --cache-dir ~/.cache/xtcache

Every command takes `--storage-options '{"anon": false}'` (JSON) for fsspec URLs such as s3://.
The heavy imports (zarr) happen inside the functions so `xtcache --help` stays fast.
"""

from __future__ import annotations

import json
from typing import Any

import typer

REQUIRED_ARRAYS = ("doc_pos_offsets", "doc_text_offsets", "doc_text", "teacher_ids", "char_offsets", "has_pred",
                   "topk_ids", "residual", "realized_logprob")
ALIGN_ARRAYS = ("doc_student_offsets", "doc_chunk_offsets", "student_ids", "student_end", "teacher_end", "exact")


def _options(storage_options: str | None) -> dict | None:
    from xtcache.errors import ConfigError

    if not storage_options:
        return None
    try:
        value = json.loads(storage_options)
    except ValueError as e:
        raise ConfigError(f"--storage-options {storage_options!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError("--storage-options must be a JSON object, e.g. '{\"anon\": true}'")
    return value


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _table(rows: list[tuple], header: tuple) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def store_summary(url: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Numbers `xtcache inspect` prints, as a dict (also used by tests and the demo)."""
    from xtcache.store import CacheReader

    r = CacheReader(url, storage_options)
    m = r.manifest
    positions = sum(s.num_positions for s in r.shards)
    predicted = sum(s.num_predicted for s in r.shards)
    per_array: dict[str, int] = {}
    for s in r.shards:
        for name, spec in s.arrays.items():
            per_array[name] = per_array.get(name, 0) + spec.stored_bytes
    masses = [(s.stats.get("mean_topk_mass"), s.num_predicted) for s in r.shards]
    masses = [(v, n) for v, n in masses if v is not None and v == v and n]
    mean_mass = sum(v * n for v, n in masses) / sum(n for _, n in masses) if masses else float("nan")
    topk_bytes = per_array.get("topk_ids", 0) + per_array.get("topk_logprobs", 0) + per_array.get("topk_counts", 0)
    raw_topk = m.k * 8 * positions
    return {
        "url": url, "manifest": m, "shards": r.shards, "complete": r.is_complete(),
        "writers_done": len(r.writer_summaries()), "documents": sum(s.num_docs for s in r.shards),
        "positions": positions, "predicted": predicted, "bytes_by_array": per_array,
        "total_array_bytes": sum(per_array.values()), "topk_bytes": topk_bytes,
        "ratio_topk_vs_raw": raw_topk / topk_bytes if topk_bytes else float("nan"),
        "mean_topk_mass": mean_mass, "groups": r.alignment_groups(),
    }


def inspect(
    store: str = typer.Argument(..., help="Store path or fsspec URL."),
    storage_options: str = typer.Option(None, "--storage-options", help="fsspec storage options as JSON."),
) -> None:
    """Print what a teacher-cache store holds: sizes, compression, alignment groups, fingerprints."""
    s = store_summary(store, _options(storage_options))
    m = s["manifest"]
    P = max(1, s["positions"])
    print(f"store           {store}")
    print(f"format version  {m.format_version}    mode {m.mode}    k {m.k}    teacher vocab {m.teacher_vocab_size}"
          + (f"    samples {m.num_samples}" if m.num_samples else ""))
    print(f"teacher         {m.teacher_name or '-'}")
    print(f"created         {m.created}    complete: {'yes' if s['complete'] else 'no'} "
          f"({s['writers_done']}/{m.num_writers} writers done)    shards {len(s['shards'])}")
    print(f"documents       {s['documents']:,}    teacher positions {s['positions']:,}    "
          f"with prediction {s['predicted']:,}")
    if m.mode != "sampled":
        print(f"mean top-k mass {s['mean_topk_mass']:.4f}")
    print(f"cache key       {m.cache_key}")
    for name, fp in sorted(m.fingerprints.items()):
        print(f"  {name:<18} {fp}")
    rows = [(name, _human(b), f"{b / P:.2f}", f"{100 * b / max(1, s['total_array_bytes']):.1f}%")
            for name, b in sorted(s["bytes_by_array"].items(), key=lambda kv: -kv[1])]
    rows.append(("total", _human(s["total_array_bytes"]), f"{s['total_array_bytes'] / P:.2f}", "100%"))
    print()
    print(_table(rows, ("array", "bytes", "B/position", "share")))
    print(f"top-k arrays: {s['topk_bytes'] / P:.1f} B/position vs raw fp32 values + int32 ids {m.k * 8} B/position "
          f"= {s['ratio_topk_vs_raw']:.1f}x smaller")
    codec_rows = [(n, c.name, json.dumps(c.configuration, sort_keys=True)) for n, c in sorted(m.codecs.items())]
    print()
    print(_table(codec_rows, ("array", "transform", "configuration")))
    groups = s["groups"]
    print()
    if not groups:
        print("alignment groups: none")
        return
    g_rows = []
    for fp, g in groups.items():
        st = g.stats
        chunks = max(1, st.get("chunks", 0))
        shapes = ", ".join(f"{k} {100 * st.get(f'chunks_{k}', 0) / chunks:.1f}%"
                          for k in ("1:1", "1:n", "n:1", "n:m", "empty") if st.get(f"chunks_{k}", 0))
        g_rows.append((fp[:16], g.tokenizer_name or "-", g.vocab_size, "yes" if g.identity else "no",
                       f"{st.get('documents', 0):,}", f"{st.get('student_tokens', 0):,}", f"{st.get('chunks', 0):,}",
                       f"{100 * st.get('exact_chunks', 0) / chunks:.1f}%", shapes or "-"))
    print(_table(g_rows, ("alignment group", "tokenizer", "vocab", "identity", "documents", "student tokens",
                          "chunks", "exact", "chunk shapes")))


# ----------------------------------------------------------------------------------------- verify


def verify_store(url: str, storage_options: dict | None = None, *, stop_first: bool = True) -> list[str]:
    """Check every committed part (schema, version, checksums, counts, ids); return the problems found.

    With `stop_first`, returns as soon as one problem is found. Uncommitted leftovers are not problems.
    """
    from schemas.models import AlignGroupMeta, AlignPartMeta, Manifest, ShardMeta
    from xtcache.errors import XtcacheError
    from xtcache.store import CacheReader, Location, _read_array, check_version, missing_parts, read_model

    problems: list[str] = []

    class _Stop(Exception):
        pass

    def problem(msg: str) -> None:
        problems.append(msg)
        if stop_first:
            raise _Stop

    loc = Location(url, storage_options)
    try:
        raw = loc.read_json("manifest.json")
        if raw is None:
            problem(f"{url} is not an xtcache store (no manifest.json)")
            return problems
        check_version(raw, f"store {url}")
        manifest = read_model(Manifest, raw, f"{url}/manifest.json")
        for name in loc.listdir("index"):
            if not name.endswith(".json"):
                continue
            sid = name[:-5]
            try:
                raw = loc.read_json(f"index/{name}")
                check_version(raw, f"shard {sid}")
                meta = read_model(ShardMeta, raw, f"shard {sid} index")
                _verify_shard(loc, manifest, meta, sid, problem)
            except _Stop:
                raise
            except XtcacheError as e:
                problem(str(e))
        committed = {n[:-5] for n in loc.listdir("index") if n.endswith(".json")}
        for fp in loc.groups():
            try:
                raw = loc.read_json(f"align/{fp}/group.json")
                if raw is None:
                    problem(f"alignment group {fp}: group.json is missing")
                    continue
                check_version(raw, f"alignment group {fp}")
                read_model(AlignGroupMeta, raw, f"alignment group {fp}")
            except _Stop:
                raise
            except XtcacheError as e:
                problem(str(e))
                continue
            for name in loc.listdir(f"align/{fp}/index"):
                sid = name[:-5]
                if not name.endswith(".json") or sid not in committed:
                    continue
                where = f"shard {sid} (alignment {fp[:12]}..)"
                try:
                    raw = loc.read_json(f"align/{fp}/index/{name}")
                    check_version(raw, where)
                    part = read_model(AlignPartMeta, raw, where)
                    arrays = {}
                    for a in ALIGN_ARRAYS:
                        if a not in part.arrays:
                            problem(f"{where}: array {a!r} is missing from the index")
                            continue
                        arrays[a] = _read_array(loc, f"align/{fp}/shards/{sid}", part.arrays[a], verify=True,
                                                shard=where)
                    if len(arrays) == len(ALIGN_ARRAYS):
                        if int(arrays["doc_student_offsets"][-1]) != len(arrays["student_ids"]) or \
                                int(arrays["doc_chunk_offsets"][-1]) != len(arrays["exact"]):
                            problem(f"{where}: array 'doc_chunk_offsets' or 'doc_student_offsets' disagrees "
                                    "with the array lengths")
                        if len(arrays["student_ids"]) != part.num_student_tokens or len(arrays["exact"]) != part.num_chunks:
                            problem(f"{where}: array 'student_ids'/'exact' lengths disagree with the index counts")
                except _Stop:
                    raise
                except XtcacheError as e:
                    problem(str(e))
        reader = CacheReader(url, storage_options)
        for i, (counted, found) in sorted(missing_parts(reader.writer_summaries(), reader.shards).items()):
            problem(f"writer {i}: its done marker counts {counted} parts but only {found} are committed "
                    f"(a part index was lost); rerun that teacher-dump job with --resume after deleting "
                    f"done/w{i:05d}.json")
    except _Stop:
        pass
    except XtcacheError as e:
        problems.append(str(e))
    return problems


def _verify_shard(loc, manifest, meta, sid: str, problem) -> None:
    """Check one teacher part; `problem(msg)` records each finding (and may stop the walk)."""
    from xtcache import codecs
    from xtcache.fingerprint import content_hash
    from xtcache.store import _read_array

    if meta.shard_id != sid:
        problem(f"shard {sid}: index names shard {meta.shard_id}")
    if meta.mode != manifest.mode or meta.k != manifest.k:
        problem(f"shard {sid}: mode/k {meta.mode}/{meta.k} differ from the manifest's {manifest.mode}/{manifest.k}")
    need = list(REQUIRED_ARRAYS) + (["topk_counts"] if manifest.mode == "sampled" else ["topk_logprobs"])
    arrays = {}
    for name in need:
        if name not in meta.arrays:
            problem(f"shard {sid}: array {name!r} is missing from the index")
            continue
        try:
            arrays[name] = _read_array(loc, f"shards/{sid}", meta.arrays[name], verify=True, shard=sid)
        except Exception as e:  # CorruptionError names shard and array
            problem(str(e))
    P, D, k = meta.num_positions, meta.num_docs, meta.k
    shapes = {"doc_pos_offsets": (D + 1,), "doc_text_offsets": (D + 1,), "teacher_ids": (P,), "char_offsets": (P, 2),
              "has_pred": (P,), "topk_ids": (P, k), "topk_logprobs": (P, k), "topk_counts": (P, k),
              "residual": (P,), "realized_logprob": (P,)}
    for name, values in arrays.items():
        if name in shapes and values.shape != shapes[name]:
            problem(f"shard {sid}: array {name!r} has shape {list(values.shape)}, the index counts "
                    f"({D} documents, {P} positions, k={k}) need {list(shapes[name])}")
    if len(meta.docs) != D:
        problem(f"shard {sid}: index lists {len(meta.docs)} document ids for num_docs={D}")
    if "doc_pos_offsets" in arrays and arrays["doc_pos_offsets"].shape == (D + 1,) and \
            int(arrays["doc_pos_offsets"][-1]) != P:
        problem(f"shard {sid}: array 'doc_pos_offsets' ends at {int(arrays['doc_pos_offsets'][-1])}, index says {P}")
    if "has_pred" in arrays and int(arrays["has_pred"].sum()) != meta.num_predicted:
        problem(f"shard {sid}: array 'has_pred' has {int(arrays['has_pred'].sum())} predictions, "
                f"index says {meta.num_predicted}")
    if "topk_ids" in arrays and meta.arrays["topk_ids"].transform is not None:
        ids = codecs.codec_from_config(meta.arrays["topk_ids"].transform).decode(arrays["topk_ids"])
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= manifest.teacher_vocab_size):
            problem(f"shard {sid}: array 'topk_ids' decodes to ids outside [0, {manifest.teacher_vocab_size})")
    if "doc_text" in arrays and "doc_text_offsets" in arrays and len(meta.docs) == D:
        blob, offs = arrays["doc_text"].tobytes(), arrays["doc_text_offsets"]
        for i, d in enumerate(meta.docs):
            try:
                text = blob[int(offs[i]):int(offs[i + 1])].decode("utf-8")
            except (UnicodeDecodeError, IndexError):
                problem(f"shard {sid}: array 'doc_text' document {i} is not valid utf-8")
                continue
            if content_hash(text) != d.content_hash:
                problem(f"shard {sid}: array 'doc_text' document {i} does not match its content hash")


def verify(
    store: str = typer.Argument(..., help="Store path or fsspec URL."),
    all_problems: bool = typer.Option(False, "--all", help="List every problem instead of stopping at the first."),
    storage_options: str = typer.Option(None, "--storage-options", help="fsspec storage options as JSON."),
) -> None:
    """Check every committed shard's checksums, counts, schema and format version; exit 1 on a problem."""
    problems = verify_store(store, _options(storage_options), stop_first=not all_problems)
    if problems:
        for p in problems:
            typer.echo(f"error: {p}", err=True)
        typer.echo(f"{store}: {len(problems)} problem(s)" + ("" if all_problems else " (stopped at the first; "
                                                                   "--all lists every one)"), err=True)
        raise SystemExit(1)  # not typer.Exit: xtcache.cli.main runs click with standalone_mode=False
    from xtcache.store import CacheReader

    r = CacheReader(store, _options(storage_options))
    typer.echo(f"{store}: OK ({len(r.shards)} shards, {sum(s.num_positions for s in r.shards):,} positions, "
               f"{'complete' if r.is_complete() else 'incomplete'})")


def cache_ls(
    cache_dir: str = typer.Option("~/.cache/xtcache", "--cache-dir", help="Directory (or URL) holding caches."),
    storage_options: str = typer.Option(None, "--storage-options", help="fsspec storage options as JSON."),
) -> None:
    """List the teacher caches under a cache directory."""
    import os

    from xtcache.store import list_caches

    if "://" not in cache_dir:
        cache_dir = os.path.expanduser(cache_dir)
    infos = list_caches(cache_dir, _options(storage_options))
    if not infos:
        typer.echo(f"no caches under {cache_dir}")
        return
    rows = [(i.url, i.key[:16], _human(i.size), i.created, f"{i.documents:,}", f"{i.positions:,}",
             "yes" if i.complete else ("no: " + i.problem if i.problem else "no")) for i in infos]
    typer.echo(_table(rows, ("cache", "key", "size", "created", "documents", "positions", "complete")))
