"""`xtcache inspect`, `xtcache verify` and `xtcache cache ls`: look into teacher-cache stores.

    xtcache inspect out/cache                 # documents, positions, bytes/position, alignment groups
    xtcache inspect out/chat --seq-len 2048   # + how --train-on packs a conversation store into windows
    xtcache verify out/cache [--all]          # checksums, counts, schema, format version of every part
    xtcache cache ls --cache-dir ~/.cache/xtcache

Every command takes `--storage-options '{"anon": false}'` (JSON) for fsspec URLs such as s3://.
The heavy imports (zarr) happen inside the functions so `xtcache --help` stays fast.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import typer

from schemas.models import Manifest, ShardPlanFile
from schemas.roles import ROLE_NAMES
from xtcache.chat.render import trained_roles
from xtcache.cliconfig import STORAGE_OPTIONS_HELP, parse_storage_options, require_path
from xtcache.errors import StoreError, XtcacheError
from xtcache.packing import common_boundaries, group_trained, pack
from xtcache.store import CacheReader, list_caches
from xtcache.store.headtail import check_rows
from xtcache.store.writer import ROLLOUT_COUNTS


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


@dataclass
class StoreSummary:
    """What `xtcache inspect` prints about a store (the demo and tests read it too)."""

    url: str
    manifest: Manifest
    shards: list  # the committed parts' records
    complete: bool
    writers_done: int
    documents: int
    positions: int  # teacher positions
    predicted: int  # positions with a stored prediction
    store_bytes: int  # every file of the store
    bytes_per_position: float | None
    bytes_by_array: dict[str, int]  # teacher parts' arrays, summed over parts
    total_array_bytes: int
    topk_bytes: int
    ratio_topk_vs_raw: float  # raw fp32 values + int32 ids over the stored top-k arrays
    mean_topk_mass: float
    groups: dict  # alignment groups by fingerprint
    warnings: list[str]
    conversation: dict[str, dict]  # conversation stores: `conversation_summary` per alignment group
    rollouts: dict[str, dict]  # rollout stores (conversations or text): the sampled turns' counts per group


def store_summary(url: str, storage_options: dict | None = None) -> StoreSummary:
    """Numbers `xtcache inspect` prints.

    `bytes_per_position` is the one definition of a store's bytes per position that inspect and the
    demo print: every byte of the store (teacher and alignment parts, metadata) over its teacher
    positions; `total_array_bytes` holds the teacher parts' arrays only (inspect's table).
    """
    r = CacheReader(url, storage_options)
    r.check_indexes()  # indexes against the manifest and the array table; arrays are read by verify
    m = r.manifest
    groups = r.alignment_groups()
    counts = {fp: part_counts(r, fp) for fp in groups}
    warnings = r.incomplete() + [
        f"alignment group {fp[:12]}.. covers {len(r.shards) - len(missing)} of {len(r.shards)} committed parts "
        f"(first missing: {missing[0]})" for fp in groups for missing in [r.unaligned_parts(fp)] if missing]
    positions = sum(s.num_positions for s in r.shards)
    predicted = sum(s.num_predicted for s in r.shards)
    per_array: dict[str, int] = {}
    for s in r.shards:
        for name, spec in s.arrays.items():
            per_array[name] = per_array.get(name, 0) + spec.stored_bytes
    masses = [(s.stats.get("mean_topk_mass"), s.num_predicted) for s in r.shards]
    masses = [(v, n) for v, n in masses if v is not None and v == v and n]
    mean_mass = sum(v * n for v, n in masses) / sum(n for _, n in masses) if masses else float("nan")
    topk_bytes = sum(per_array.get(n, 0) for n in ("topk_ids", "topk_id_dict", "topk_logprobs", "topk_counts"))
    raw_topk = m.k * 8 * positions
    store_bytes = r.total_bytes()
    return StoreSummary(
        url=url, manifest=m, shards=r.shards, complete=r.is_complete(), writers_done=len(r.writer_summaries()),
        documents=sum(s.num_docs for s in r.shards), positions=positions, predicted=predicted,
        store_bytes=store_bytes, bytes_per_position=store_bytes / positions if positions else None,
        bytes_by_array=per_array, total_array_bytes=sum(per_array.values()), topk_bytes=topk_bytes,
        ratio_topk_vs_raw=raw_topk / topk_bytes if topk_bytes else float("nan"), mean_topk_mass=mean_mass,
        groups=groups, warnings=warnings,
        conversation={fp: conversation_summary(c) for fp, c in counts.items()} if m.conversation else {},
        rollouts={fp: c for fp, total in counts.items() if (c := rollout_summary(total))})


def part_counts(reader, fp: str) -> dict[str, int]:
    """One alignment group's part counts (each part index's `conversation`: a conversation part's characters
    and tokens by role, a rollout part's sampled turns), summed over its committed parts."""
    total: dict[str, int] = {}
    for part in reader.alignment_parts(fp).values():
        for k, v in part.conversation.items():
            total[k] = total.get(k, 0) + v
    return total


def rollout_summary(counts: dict[str, int]) -> dict[str, int]:
    """The sampled turns of a group's rollouts, from its `part_counts` ({} without rollouts)."""
    return {k: counts[k] for k in ROLLOUT_COUNTS if k in counts}


def conversation_summary(total: dict[str, int]) -> dict[str, Any]:
    """One alignment group of a conversation store, from its `part_counts`: its parts' character counts and
    student tokens by role, with each --train-on choice's share of the student positions."""
    tokens = sum(v for k, v in total.items() if k.startswith("role_") and k != "role_last_assistant")
    share = {"assistant": total.get("role_assistant", 0), "last-assistant": total.get("role_last_assistant", 0),
             "all": tokens}
    return {**total, "student_tokens": tokens, "trained_share": {k: v / max(1, tokens) for k, v in share.items()}}


def window_summary(reader, fp: str, seq_len: int, train_on: str) -> dict[str, int]:
    """How `train-student --seq-len seq_len --train-on train_on` packs one alignment group of a
    conversation store (`xtcache.packing`, every document, one part at a time as the loader does):
    windows, trained positions, context tokens read for them, trained chunks longer than a window."""
    import numpy as np

    out = {"windows": 0, "trained": 0, "context": 0, "skipped_chunks": 0}
    for sid in reader.alignment_parts(fp):
        al = reader.read_alignment(fp, sid)
        trained = trained_roles(al.student_role, train_on)
        c_off, s_off = al.doc_chunk_offsets, al.doc_student_offsets
        ends = [al.student_end[c_off[d]:c_off[d + 1]].astype(np.int64) for d in range(len(c_off) - 1)]
        bounds = [common_boundaries([e]) for e in ends]
        lengths = [np.diff(b, prepend=0) for b in bounds]
        counts = [group_trained(b, trained[s_off[d]:s_off[d + 1]]) for d, b in enumerate(bounds)]
        plan = pack(range(len(ends)), lengths, None if train_on == "all" else counts, seq_len)
        out["windows"] += plan.num_windows
        out["trained"] += plan.trained_tokens
        out["context"] += plan.read_tokens - plan.trained_tokens
        out["skipped_chunks"] += plan.skipped_chunks
    return out


def _print_windows(url: str, storage_options: dict | None, groups, seq_len: int) -> None:
    reader = CacheReader(url, storage_options)
    rows = []
    for fp in groups:
        for train_on in ("assistant", "last-assistant", "all"):
            w = window_summary(reader, fp, seq_len, train_on)
            rows.append((fp[:16], train_on, f"{w['windows']:,}", f"{w['trained']:,}", f"{w['context']:,}",
                         f"{(w['trained'] + w['context']) / max(1, w['trained']):.2f}", f"{w['skipped_chunks']:,}"))
    print()
    print(f"windows of --seq-len {seq_len} per --train-on: trained positions, context tokens read for them, "
          "tokens read per trained position, trained chunks longer than a window (never trained)")
    print(_table(rows, ("alignment group", "--train-on", "windows", "trained", "context", "read/trained",
                        "skipped chunks")))


def inspect(
    store: str = typer.Argument(..., help="Store path or fsspec URL."),
    seq_len: int = typer.Option(None, "--seq-len", min=2,
                                help="Conversation stores: also pack every alignment group into windows of this "
                                     "many student tokens as `train-student --seq-len` does, and print each "
                                     "--train-on choice's windows, trained positions and context tokens read "
                                     "(reads every alignment part's chunk ends and roles)."),
    storage_options: str = typer.Option(None, "--storage-options", help=STORAGE_OPTIONS_HELP),
) -> None:
    """Print what a teacher-cache store holds: sizes, compression, alignment groups, fingerprints."""
    options = parse_storage_options(storage_options)
    require_path("STORE", store)
    s = store_summary(store, options)
    m = s.manifest
    P = max(1, s.positions)
    print(f"store           {store}")
    print(f"format version  {m.format_version}    mode {m.mode}    k {m.k}    teacher vocab {m.teacher_vocab_size}"
          + (f"    head {m.top_k}" if m.top_k else "") + (f"    samples {m.num_samples}" if m.num_samples else ""))
    print(f"teacher         {m.teacher_name or '-'}")
    print(f"created         {m.created}    complete: {'yes' if s.complete else 'no'} "
          f"({s.writers_done}/{m.num_writers} writers done)    shards {len(s.shards)}")
    print(f"documents       {s.documents:,}    teacher positions {s.positions:,}    "
          f"with prediction {s.predicted:,}")
    if m.mode != "sampled":
        print(f"mean top-k mass {s.mean_topk_mass:.4f}")
    print(f"store size      {_human(s.store_bytes)}, {s.bytes_per_position or 0:.1f} B/position (every file of "
          "the store; the teacher arrays alone: the table's total)")
    print(f"cache key       {m.cache_key}")
    for name, fp in sorted(m.fingerprints.items()):
        print(f"  {name:<18} {fp}")
    rows = [(name, _human(b), f"{b / P:.2f}", f"{100 * b / max(1, s.total_array_bytes):.1f}%")
            for name, b in sorted(s.bytes_by_array.items(), key=lambda kv: -kv[1])]
    rows.append(("total", _human(s.total_array_bytes), f"{s.total_array_bytes / P:.2f}", "100%"))
    print()
    print(_table(rows, ("array", "bytes", "B/position", "share")))
    print(f"top-k arrays: {s.topk_bytes / P:.1f} B/position vs raw fp32 values + int32 ids {m.k * 8} B/position "
          f"= {s.ratio_topk_vs_raw:.1f}x smaller")
    for w in s.warnings:
        typer.echo(f"warning: {w}", err=True)
    print("checked         indexes against the manifest; array bytes are checked on every read and by "
          "`xtcache verify`")
    codec_rows = [(n, c.name, json.dumps(c.configuration, sort_keys=True)) for n, c in sorted(m.codecs.items())]
    print()
    print(_table(codec_rows, ("array", "transform", "configuration")))
    groups = s.groups
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
    if s.conversation:
        c_rows = []
        for fp, c in s.conversation.items():
            n = max(1, c["student_tokens"])
            mix = ", ".join(f"{name} {100 * c.get(f'role_{name}', 0) / n:.1f}%" for name in ROLE_NAMES.values()
                            if c.get(f"role_{name}", 0))
            trained = ", ".join(f"{k} {100 * v:.1f}%" for k, v in c["trained_share"].items())
            c_rows.append((fp[:16], mix or "-", trained, f"{c.get('content_chars', 0):,}",
                           f"{c.get('unaligned_spans', 0):,} / {c.get('unaligned_chars', 0):,}",
                           f"{c.get('misaligned_chars', 0):,}"))
        print()
        print("conversations: student tokens by role; trained share of positions per --train-on; message text "
              "characters; spans / characters a template changed (no KD); characters aligned to other text")
        print(_table(c_rows, ("alignment group", "role mix", "trained share", "content chars",
                              "unaligned spans / chars", "misaligned chars")))
        if seq_len is not None:
            _print_windows(store, options, s.conversation, seq_len)
    for fp, c in s.rollouts.items():  # rollouts (stage1_teacher.onpolicy.sampled), conversations or text
        print(_rollout_line(fp, c))


def _rollout_line(fp: str, c: dict) -> str:
    """`inspect`'s line on a rollout cache's sampled turns in alignment group `fp` (its conversation stats)."""
    spliced = c.get("sampled_same_text", 0)
    return (f"rollouts in {fp[:16]}: sampled turns {c['sampled_turns']:,}, whose sampled ids are not the "
            f"re-tokenized ids {c['sampled_mismatch']:,} (spliced, trained on the sampled ids: {spliced:,}; "
            f"not spelling the turn's text, no sampling log-probs: {c['sampled_mismatch'] - spliced:,})")


# ----------------------------------------------------------------------------------------- verify


def verify_store(url: str, storage_options: dict | None = None, *, stop_first: bool = True) -> list[str]:
    """Read every committed part and alignment part through `CacheReader` with every check on
    (`verify=True`); return the problems found: damage, lost parts, alignment parts missing.

    With `stop_first`, returns as soon as one problem is found. Uncommitted leftovers are not problems,
    and neither is a store whose writers are still running (`CacheReader.incomplete` says that).
    """
    problems: list[str] = []
    try:
        reader = CacheReader(url, storage_options, problems=problems)
    except XtcacheError as e:
        return [str(e)]

    owned = rows_owned_by_writer(reader.loc.read_json("shard_plan.json"), url)

    def read_part(meta):
        data = reader.read_shard(meta.shard_id, verify=True)
        found = [] if owned is None else outside_plan(data, owned, meta.writer_index, url)
        return found + headtail_problems(data, reader.manifest, url)

    def reads():
        """Each read of the store, one at a time, so that `stop_first` stops after the first problem."""
        for meta in reader.shards:
            yield lambda meta=meta: read_part(meta)
        for fp in reader.alignment_groups():
            for sid in reader.alignment_parts(fp):
                yield lambda fp=fp, sid=sid: reader.read_alignment(fp, sid, verify=True)
            yield lambda fp=fp: [f"store {url}, alignment group {fp[:12]}..: no alignment part for teacher part "
                                 f"{sid}; run `xtcache align {url} --student-tokenizer <student>` to add it"
                                 for sid in reader.unaligned_parts(fp)]
        yield reader.lost_parts

    for read in reads():
        if problems and stop_first:
            break
        try:
            found = read()
        except XtcacheError as e:
            problems.append(str(e))
            continue
        if isinstance(found, list):
            problems.extend(found)
    return problems[:1] if stop_first else problems


def headtail_problems(data, manifest, url: str) -> list[str]:
    """A headtail part's slots and masses against its manifest (`xtcache.store.headtail.check_rows`); [] in other modes."""
    if manifest.mode != "headtail":
        return []

    problem = check_rows(data.topk_ids, data.topk_counts, data.topk_logprobs, data.residual, data.has_pred,
                         top_k=manifest.top_k, num_samples=manifest.num_samples)
    return [] if problem is None else [f"store {url}, teacher part {data.shard_id}: {problem}"]


def rows_owned_by_writer(plan: dict | None, url: str) -> dict[int, dict[str, tuple[int, int | None]]] | None:
    """From a store's `shard_plan.json` (written when N jobs filled it): for each writer, the corpus
    rows its plan gave it, as {file base name: (first row, end row or None for the whole file)}."""
    if plan is None:
        return None

    try:
        p = ShardPlanFile.model_validate(plan)
    except ValueError as e:
        raise StoreError(f"store {url}: shard_plan.json does not match its schema ({e})") from None
    owned: dict[int, dict[str, tuple[int, int | None]]] = {}
    for job, ranges in enumerate(p.jobs):
        for file_index, first_group, end_group in ranges:
            entry = p.files[file_index]
            groups = entry.get("row_groups")
            if groups:  # Parquet: a contiguous run of row groups
                rows = [int(g[0]) for g in groups]
                span = (sum(rows[:first_group]), sum(rows[:end_group]))
            else:  # a whole file
                span = (0, None)
            owned.setdefault(job, {})[entry["name"]] = span
    return owned


def outside_plan(data, owned: dict, writer: int, url: str) -> list[str]:
    """Documents of a part that its writer's shard-plan ranges do not cover (none in a sound store)."""
    mine = owned.get(writer, {})
    bad = []
    for doc in data.docs:
        first, end = mine.get(doc.source, (0, -1))
        if doc.row < first or (end is not None and doc.row >= end):
            bad.append(f"{doc.source}:{doc.row}")
    if not bad:
        return []
    return [f"store {url}, teacher part {data.shard_id}: {len(bad)} documents outside writer {writer}'s shard-plan "
            f"ranges (first: {bad[0]})"]


def verify(
    store: str = typer.Argument(..., help="Store path or fsspec URL."),
    all_problems: bool = typer.Option(False, "--all", help="List every problem instead of stopping at the first."),
    allow_incomplete: bool = typer.Option(False, "--allow-incomplete",
                                          help="Exit 0 for a store whose writers are still running when its "
                                               "committed parts check out (default: exit 1, as train-student "
                                               "refuses it)."),
    storage_options: str = typer.Option(None, "--storage-options", help=STORAGE_OPTIONS_HELP),
) -> None:
    """Read every committed part with every check on (checksums, counts, schema, format version,
    alignment coverage, lost parts); exit 1 on a problem, or on a store whose writers are still
    running unless --allow-incomplete (its committed parts are checked either way). A path that does
    not exist is a mistyped argument, not a damaged store: one line, exit 2, as `inspect`."""
    options = parse_storage_options(storage_options)
    require_path("STORE", store)
    problems = verify_store(store, options, stop_first=not all_problems)
    if problems:
        for p in problems:
            typer.echo(f"error: {p}", err=True)
        typer.echo(f"{store}: {len(problems)} problem(s)" + ("" if all_problems else " (stopped at the first; "
                                                                   "--all lists every one)"), err=True)
        raise SystemExit(1)  # not typer.Exit: xtcache.app.cli.main runs click with standalone_mode=False

    r = CacheReader(store, options)
    reasons = r.incomplete()
    typer.echo(f"{store}: OK ({len(r.shards)} shards, {sum(s.num_positions for s in r.shards):,} positions, "
               f"{'incomplete' if reasons else 'complete'})")
    for reason in reasons:
        typer.echo(f"incomplete: {reason}", err=True)
    if reasons and not allow_incomplete:
        typer.echo(f"error: {store} is incomplete (the incomplete: lines above); --allow-incomplete accepts the "
                   "committed parts of a store still being written", err=True)
        raise SystemExit(1)


DEFAULT_CACHE_DIR = "~/.cache/xtcache"


def cache_ls(
    cache_dir: str = typer.Option(DEFAULT_CACHE_DIR, "--cache-dir", help="Directory (or URL) holding caches: "
                                  "the --cache-dir given to teacher-dump (stores written with --out are not listed)."),
    storage_options: str = typer.Option(None, "--storage-options", help=STORAGE_OPTIONS_HELP),
) -> None:
    """List the teacher caches under a cache directory (a --cache-dir that does not exist: exit 2)."""
    import os

    given, options = cache_dir, parse_storage_options(storage_options)
    if "://" not in cache_dir:
        cache_dir = os.path.expanduser(cache_dir)
    if given != DEFAULT_CACHE_DIR:  # the default may not exist yet; a directory the user typed must
        require_path("--cache-dir", cache_dir)
    infos = list_caches(cache_dir, options)
    if not infos:
        typer.echo(f"no caches under {cache_dir} (teacher-dump writes there when given --cache-dir {given}; "
                   "stores written with --out are not listed)")
        return
    rows = [(i.url, i.key[:16], _human(i.size), i.created, f"{i.documents:,}", f"{i.positions:,}",
             "yes" if i.complete else ("no: " + i.problem if i.problem else "no")) for i in infos]
    typer.echo(_table(rows, ("cache", "key", "size", "created", "documents", "positions", "complete")))
