"""Streaming corpus reader for `xtcache teacher-dump`: Parquet, Arrow IPC, JSONL and plain text.

Documents are yielded one at a time from bounded batches, so a corpus larger than memory streams
through. Every document carries a stable id: its source (the file's base name), its 0-based row in
that file, and a hash of its text. Rows that cannot become a document (missing or non-string text
field, invalid UTF-8, empty text) are yielded as `Skipped` with a reason, so the caller can count
them in its summary instead of dropping them silently.

It reads a resolved `Corpus` (`stage1_teacher.corpus.files`: the files, their formats and sizes).
Parallel jobs read only their share: `iter_corpus(..., plan=, job=)` opens the ranges that
`stage1_teacher.shard_plan` gave the job (Parquet row groups, whole files otherwise).

Files are local paths or fsspec URLs (s3://bucket/corpus.parquet, gs://..., with the dump's
`--storage-options`); remote files are streamed, never downloaded whole.

Conversation corpora: rows whose `--messages-field` (detected as `messages` when the text field
is absent from the first row) holds a list of messages `{role, content, ...}`, with an optional
per-row `tools` list (or its JSON text), in any format but .txt. Such a row becomes a Document
with `conversation=True` whose text is the conversation's JSON (`xtcache.chat.render.conversation_json`); stage 1 renders it with
each model's chat template (`xtcache.chat.layout`). A JSONL rollout row of `xtcache generate` also carries its
`sampled_ids`, `sampled_logprobs`, `chat_fingerprint` and `policy` (`Document.sampled`), which stage 1
stores for the sampling student's alignment group (`stage1_teacher.onpolicy.sampled`).

Formats by file suffix:
  .parquet                       pyarrow ParquetFile.iter_batches on the text column
  .arrow .feather .ipc           Arrow IPC file (or stream) record batches
  .jsonl .json .ndjson           one JSON object per line
  .txt                           one document per line (the newline is not part of the text)

    python -m stage1_teacher.corpus data.jsonl --text-field text   # prints counts
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Iterator

from stage1_teacher.corpus.files import Corpus, read_lines
from xtcache.chat.render import conversation_json, parse_conversation
from xtcache.errors import ConfigError, StoreError
from xtcache.fingerprint import content_hash, doc_id
from xtcache.location import file_system, is_local


@dataclass(frozen=True)
class Sampled:
    """What a rollout row of `xtcache generate` records about its generated (last assistant) turn."""

    ids: tuple[int, ...]  # the student token ids sampled, the stop token included
    logprobs: tuple[float, ...]  # their log-probs under the sampling policy
    chat: str  # the sampling student's chat fingerprint (xtcache.chat.render.chat_fingerprint)
    policy: str = ""  # the policy fingerprint
    stop_reason: str = ""  # "stop" (the student ended the turn) or "length" (cut by --max-new-tokens)


@dataclass(frozen=True)
class Document:
    """One corpus row that holds text."""

    source: str
    row: int
    text: str
    content_hash: str = field(default="")
    conversation: bool = False  # text is a conversation's JSON (xtcache.chat.render.conversation_json)
    sampled: Sampled | None = None  # rollout rows (JSONL): the sampled turn's ids and log-probs
    prefix_chars: int | None = None  # a text rollout: the characters of its prompt (its completion follows)

    def __post_init__(self):
        if not self.content_hash:
            object.__setattr__(self, "content_hash", content_hash(self.text))

    @property
    def doc_id(self) -> str:
        return doc_id(self.source, self.row, self.content_hash)


@dataclass(frozen=True)
class Skipped:
    """A corpus row that is not a usable document, with the reason (a short stable phrase)."""

    source: str
    row: int
    reason: str


def _text_of(source: str, row: int, value) -> Document | Skipped:
    if value is None:
        return Skipped(source, row, "missing text field")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return Skipped(source, row, "invalid UTF-8")
    if not isinstance(value, str):
        return Skipped(source, row, "text field is not a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON escapes
        return Skipped(source, row, "invalid UTF-8")
    if not value.strip():
        return Skipped(source, row, "empty document")
    return Document(source, row, value)


TOOLS_FIELD = "tools"


def _conversation_of(source: str, row: int, messages, tools=None, sampled: Sampled | None = None) -> Document | Skipped:
    if messages is None:
        return Skipped(source, row, "missing messages field")
    conv = parse_conversation(messages, tools)
    if isinstance(conv, str):
        return Skipped(source, row, conv)
    return Document(source, row, conversation_json(conv), conversation=True, sampled=sampled)


def _sampled_of(obj: dict) -> Sampled | None | str:
    """The sampling record of a rollout row (`xtcache generate`), None for other rows, or the reason it is
    unusable (a row with `sampled_ids` but no matching log-probs or no chat fingerprint)."""
    ids, lps = obj.get("sampled_ids"), obj.get("sampled_logprobs")
    if ids is None:
        return None
    chat = obj.get("chat_fingerprint")
    if (not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps) or not isinstance(chat, str)
            or not all(isinstance(i, int) for i in ids) or not all(isinstance(x, (int, float)) for x in lps)):
        return "rollout row without matching sampled_ids, sampled_logprobs and chat_fingerprint"
    return Sampled(tuple(ids), tuple(float(x) for x in lps), chat, str(obj.get("policy", "")),
                   str(obj.get("stop_reason") or ""))


def _iter_conversations(table_columns, names, source: str, row0: int, messages_field: str):
    """Conversation rows of Arrow columns (a list-of-struct messages column, an optional tools column)."""
    msgs = table_columns[names.index(messages_field)].to_pylist()
    tools = table_columns[names.index(TOOLS_FIELD)].to_pylist() if TOOLS_FIELD in names else [None] * len(msgs)
    for i, (m, t) in enumerate(zip(msgs, tools)):
        yield _conversation_of(source, row0 + i, m, t)


def _iter_parquet(f, path: str, source: str, text_field: str, batch_rows: int, groups: tuple[int, int] | None = None,
                  planned: tuple | None = None, messages_field: str | None = None, metadata=None):
    """Rows of row groups [groups[0], groups[1]) (None: all), numbered from their row in the file.

    `planned`: the (rows, bytes) per row group the shard plan saw; a file that changed since is refused.
    `metadata`: the file's footer (pyarrow FileMetaData) when the corpus has read it already.
    """
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f, metadata=metadata)
    column = messages_field or text_field
    if column not in pf.schema_arrow.names:
        raise ConfigError(f"--data {path}: no column {column!r} (columns: {pf.schema_arrow.names}); "
                          f"set {'--messages-field' if messages_field else '--text-field'}")
    columns = [column] + ([TOOLS_FIELD] if messages_field and TOOLS_FIELD in pf.schema_arrow.names else [])
    md = pf.metadata
    counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    if planned is not None and counts != [n for n, _ in planned]:
        raise StoreError(f"--data {path}: its row groups differ from the shard plan's; the corpus changed since the "
                         "plan, start a new --out")
    start, stop = groups if groups is not None else (0, len(counts))
    if start == stop:
        return
    row = sum(counts[:start])
    for batch in pf.iter_batches(batch_size=batch_rows, columns=columns, row_groups=range(start, stop)):
        if messages_field:
            yield from _iter_conversations(batch.columns, batch.schema.names, source, row, messages_field)
        else:
            yield from _iter_arrow_column(batch.column(0), source, row)
        row += batch.num_rows


def _iter_arrow_column(column, source: str, row0: int):
    import pyarrow as pa

    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        # read as bytes so a row of invalid UTF-8 is one skipped row, not a failed batch
        column = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
    for i, value in enumerate(column.to_pylist()):
        yield _text_of(source, row0 + i, value)


def _iter_arrow(f, path: str, source: str, text_field: str, batch_rows: int, messages_field: str | None = None):
    import pyarrow as pa

    with (pa.memory_map(f, "r") if isinstance(f, str) else pa.PythonFile(f, mode="r")) as src:
        try:
            reader = pa.ipc.open_file(src)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            schema = reader.schema
        except pa.ArrowInvalid:
            src.seek(0)
            reader = pa.ipc.open_stream(src)
            batches, schema = iter(reader), reader.schema
        column = messages_field or text_field
        if column not in schema.names:
            raise ConfigError(f"--data {path}: no column {column!r} (columns: {schema.names}); "
                              f"set {'--messages-field' if messages_field else '--text-field'}")
        row = 0
        for batch in batches:
            col = batch.column(schema.get_field_index(text_field if not messages_field else column))
            for start in range(0, batch.num_rows, batch_rows):
                if messages_field:
                    part = batch.slice(start, batch_rows)
                    yield from _iter_conversations(part.columns, schema.names, source, row + start, messages_field)
                else:
                    yield from _iter_arrow_column(col.slice(start, batch_rows), source, row + start)
            row += batch.num_rows


def _iter_jsonl(f, source: str, text_field: str, messages_field: str | None = None):
    for row, line in enumerate(read_lines(f)):
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            yield Skipped(source, row, "invalid UTF-8")
            continue
        except ValueError:
            if not line.strip():
                yield Skipped(source, row, "empty document")
            else:
                yield Skipped(source, row, "invalid JSON")
            continue
        if messages_field:
            if not isinstance(obj, dict):
                yield Skipped(source, row, "missing messages field")
                continue
            sampled = _sampled_of(obj)
            yield (Skipped(source, row, sampled) if isinstance(sampled, str) else
                   _conversation_of(source, row, obj.get(messages_field), obj.get(TOOLS_FIELD), sampled))
            continue
        if not isinstance(obj, dict) or text_field not in obj:
            yield Skipped(source, row, "missing text field")
            continue
        doc = _text_of(source, row, obj[text_field])
        yield doc if isinstance(doc, Skipped) or "prefix_chars" not in obj else _text_rollout(doc, obj)


def _text_rollout(doc: Document, obj: dict) -> Document | Skipped:
    """A text rollout row of `xtcache generate` (prefix + completion, `prefix_chars`): the document with the
    prompt's length and the sampling record, or the reason it is unusable."""
    prefix = obj["prefix_chars"]
    if not isinstance(prefix, int) or isinstance(prefix, bool) or not 0 <= prefix <= len(doc.text):
        return Skipped(doc.source, doc.row, f"prefix_chars {prefix!r} is not a character count of its text")
    sampled = _sampled_of(obj)
    if isinstance(sampled, str):
        return Skipped(doc.source, doc.row, sampled)
    return replace(doc, prefix_chars=prefix, sampled=sampled)


def _iter_text(f, source: str):
    for row, line in enumerate(read_lines(f)):
        yield _text_of(source, row, line.rstrip(b"\r"))


def iter_corpus(files: Corpus | list[str], text_field: str = "text", *, batch_rows: int = 1024,
                storage_options: dict | None = None, plan=None, job: int = 0,
                messages_field: str | None = None) -> Iterator[Document | Skipped]:
    """Every row of every file, in order, as a Document or a Skipped row (streaming).

    `files`: a resolved `Corpus` (its fields and options are used), or URLs to resolve with
    `text_field`, `messages_field` and `storage_options`. With a messages field, rows are
    conversations (Documents with `conversation=True`).

    With a `shard_plan.ShardPlan`, only job `job`'s ranges are opened and read (Parquet: its row
    groups; other formats: its whole files), with the same row numbers as a read of everything.
    """
    corpus = files if isinstance(files, Corpus) else Corpus.resolve(
        files, text_field, messages_field=messages_field, storage_options=storage_options)
    if plan is None:
        todo = [(fi, None, None) for fi in range(len(corpus.files))]
    else:
        corpus.check_plan(plan, job)
        todo = [(r.file, (r.start, r.stop), plan.files[r.file].row_groups) for r in plan.jobs[job]]
    for fi, groups, planned in todo:
        yield from iter_file(corpus, fi, batch_rows, groups, planned)


def iter_file(corpus: Corpus, fi: int, batch_rows: int = 1024, groups: tuple[int, int] | None = None,
              planned: tuple | None = None) -> Iterator[Document | Skipped]:
    """The rows of file `fi` (Parquet: of row groups `groups`, planned as `planned`; None: all)."""
    url, source, fmt = corpus.files[fi].url, corpus.files[fi].name, corpus.files[fi].format
    text_field, messages_field = corpus.text_field, corpus.messages_field
    if fmt == "arrow" and is_local(url):
        path = file_system(url, corpus.storage_options)[1]
        yield from _iter_arrow(path, url, source, text_field, batch_rows, messages_field)  # memory-mapped
        return
    if fmt == "text" and messages_field:
        raise ConfigError(f"--data {url}: a .txt corpus holds plain text, not conversations (--messages-field)")
    with corpus.open(fi) as f:
        if fmt == "parquet":
            yield from _iter_parquet(f, url, source, text_field, batch_rows, groups, planned, messages_field,
                                     corpus.footer(fi).metadata)
        elif fmt == "arrow":
            yield from _iter_arrow(f, url, source, text_field, batch_rows, messages_field)
        elif fmt == "jsonl":
            yield from _iter_jsonl(f, source, text_field, messages_field)
        else:
            yield from _iter_text(f, source)


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--text-field", default="text")
    args = p.parse_args(argv)
    docs, skipped, chars = 0, {}, 0
    for item in iter_corpus(args.files, args.text_field):
        if isinstance(item, Skipped):
            skipped[item.reason] = skipped.get(item.reason, 0) + 1
        else:
            docs += 1
            chars += len(item.text)
    print(f"documents {docs}  characters {chars}  skipped {skipped}")
