"""The corpus of `xtcache teacher-dump`, resolved once from `--data`: its files, formats, sizes,
Parquet footers and the field that holds the documents.

`Corpus.resolve` asks each file's metadata once (several at once: an object store answers in tens
of ms), refuses a missing file, an unknown suffix or two files with the same base name (document
ids use the base name), and keeps names, formats and sizes. A Parquet file's footer (row counts,
the compressed bytes of each column, the byte offset of each row group, the column names)
is read the first time something asks for it and kept, so the first-rows check, the messages-field
detection, the shard planner, the per-job corpus digests and the reader share one read. Everything in stage 1 that reads `--data`
goes through this package (an import-linter contract keeps pyarrow inside it); the documents
themselves are read by `stage1_teacher.corpus.rows`.

    python -c "from stage1_teacher.corpus import Corpus; print(Corpus.resolve(['c.jsonl']).files)"
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from xtcache.errors import ConfigError, StoreError
from xtcache.location import file_system, is_local, local_path

PARQUET = (".parquet",)
ARROW = (".arrow", ".feather", ".ipc")
JSONL = (".jsonl", ".json", ".ndjson")
TEXT = (".txt",)
SUFFIXES = PARQUET + ARROW + JSONL + TEXT
LIST_THREADS = 16  # files whose metadata is asked for at once


def file_format(path: str) -> str:
    """'parquet', 'arrow', 'jsonl' or 'text' from the file suffix; ConfigError otherwise."""
    low = path.lower()
    for suffixes, name in ((PARQUET, "parquet"), (ARROW, "arrow"), (JSONL, "jsonl"), (TEXT, "text")):
        if low.endswith(suffixes):
            return name
    raise ConfigError(f"--data {path}: unknown corpus format; use one of {', '.join(SUFFIXES)}")


@dataclass(frozen=True)
class CorpusFile:
    """One `--data` file."""

    url: str  # as given (a local path or an fsspec URL)
    name: str  # base name: the document ids' source
    format: str  # parquet | arrow | jsonl | text
    size: int  # bytes


@dataclass(frozen=True)
class ParquetFooter:
    """What a Parquet file's footer says, without reading a data page."""

    columns: tuple[str, ...]
    rows: tuple[int, ...]  # per row group
    starts: tuple[int, ...]  # byte offset where each row group's first column chunk begins
    column_bytes: tuple[dict[str, int], ...]  # per row group: compressed bytes of each top-level column
    metadata: Any = field(default=None, compare=False, repr=False)  # pyarrow FileMetaData: the reader reuses it

    def row_groups(self, column: str) -> tuple[tuple[int, int], ...]:
        """(rows, compressed bytes of `column`) per row group: what reading the documents costs."""
        return tuple((n, b.get(column, 0)) for n, b in zip(self.rows, self.column_bytes))


class Corpus:
    """The `--data` files and the field that holds their documents (`messages_field`, when set,
    holds conversations; otherwise `text_field` holds text)."""

    def __init__(self, files: list[CorpusFile], *, text_field: str = "text", messages_field: str | None = None,
                 storage_options: dict | None = None):
        self.files = files
        self.text_field = text_field
        self.messages_field = messages_field
        self.storage_options = storage_options
        self._footers: dict[int, ParquetFooter] = {}
        self._lock = threading.Lock()

    @classmethod
    def resolve(cls, urls: list[str], text_field: str = "text", *, messages_field: str | None = None,
                storage_options: dict | None = None) -> Corpus:
        """Check every file (exists, known format, unique base name) and keep its size: one metadata
        request per file."""
        if not urls:
            raise ConfigError("--data: give at least one corpus file")
        urls = [str(u) for u in urls]
        with ThreadPoolExecutor(max_workers=min(LIST_THREADS, len(urls))) as pool:
            files = list(pool.map(lambda u: _stat(u, storage_options), urls))
        names = [f.name for f in files]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"--data: two corpus files share the base name {dup[0]!r}; document ids use the base "
                              "name, so rename one of them")
        return cls(files, text_field=text_field, messages_field=messages_field, storage_options=storage_options)

    @classmethod
    def of(cls, corpus: Corpus | list[str], text_field: str = "text", storage_options: dict | None = None) -> Corpus:
        """`corpus` itself, or the corpus of a list of URLs."""
        if isinstance(corpus, Corpus):
            return corpus
        return cls.resolve(corpus, text_field, storage_options=storage_options)

    @property
    def urls(self) -> list[str]:
        return [f.url for f in self.files]

    @property
    def field(self) -> str:
        """The column (or JSON key) that holds the documents."""
        return self.messages_field or self.text_field

    @contextmanager
    def open(self, fi: int):
        """File `fi` opened for binary reading; remote files without fsspec's read-ahead cache (its
        default fetches 50 MiB past every range pyarrow asks for)."""
        url = self.files[fi].url
        fs, path = file_system(url, self.storage_options)
        with fs.open(path, "rb", **({} if is_local(url) else {"cache_type": "none"})) as f:
            yield f

    def footer(self, fi: int) -> ParquetFooter:
        """The footer of Parquet file `fi`, read once."""
        with self._lock:
            if fi in self._footers:
                return self._footers[fi]
        footer = self._read_footer(fi)
        with self._lock:
            return self._footers.setdefault(fi, footer)

    def footers(self) -> dict[int, ParquetFooter]:
        """Every Parquet file's footer (several read at once)."""
        todo = [fi for fi, f in enumerate(self.files) if f.format == "parquet"]
        with ThreadPoolExecutor(max_workers=min(LIST_THREADS, max(1, len(todo)))) as pool:
            return dict(zip(todo, pool.map(self.footer, todo)))

    def _read_footer(self, fi: int) -> ParquetFooter:
        import pyarrow.parquet as pq

        with self.open(fi) as f:
            md = pq.ParquetFile(f).metadata
        rows, starts, column_bytes = [], [], []
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            chunks = [rg.column(c) for c in range(rg.num_columns)]
            nbytes: dict[str, int] = {}
            for c in chunks:
                top = c.path_in_schema.split(".")[0]
                nbytes[top] = nbytes.get(top, 0) + int(c.total_compressed_size)
            rows.append(rg.num_rows)
            column_bytes.append(nbytes)
            starts.append(min(c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset is not None
                              else c.data_page_offset for c in chunks))
        return ParquetFooter(columns=tuple(md.schema.to_arrow_schema().names), rows=tuple(rows),
                             starts=tuple(starts), column_bytes=tuple(column_bytes), metadata=md)

    def detect_messages_field(self) -> str | None:
        """'messages' when the first file's first row (or schema) has no `text_field` but a `messages` field."""
        first = self.files[0]
        if first.format == "text":
            return None
        if first.format == "parquet":
            names = list(self.footer(0).columns)
        else:
            with self.open(0) as f:
                names = _jsonl_keys(f) if first.format == "jsonl" else _arrow_names(f)
        return "messages" if self.text_field not in names and "messages" in names else None

    def check_plan(self, plan, job: int) -> None:
        """The sizes of job `job`'s files against the shard plan's: a corpus changed since the plan is refused."""
        for fi in sorted({r.file for r in plan.jobs[job]}):
            f, planned = self.files[fi], plan.files[fi].size
            if f.size != planned:
                raise StoreError(f"--data {f.url}: {f.size} bytes, but the shard plan was made for {planned} bytes; "
                                 "the corpus changed since the plan, start a new --out")

    def count_lines(self, fi: int) -> int | None:
        """Newlines of local file `fi` (a read of the file: for a progress bar's ETA); None when it is
        remote or cannot be read."""
        url = self.files[fi].url
        if not is_local(url):
            return None
        try:
            with open(local_path(url), "rb") as f:
                return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 22), b""))
        except OSError:
            return None


def _stat(url: str, storage_options: dict | None) -> CorpusFile:
    try:
        fs, path = file_system(url, storage_options)
    except (ImportError, ValueError, OSError) as e:
        raise ConfigError(f"--data {url}: cannot reach it ({type(e).__name__}: {e}); for remote files check the "
                          "fsspec backend (s3fs, gcsfs, ...) and --storage-options") from None
    try:
        info = fs.info(path)
    except Exception:  # as fsspec's isfile: whatever the file system says, the file is not there for us
        info = None
    if info is None or info.get("type") != "file":
        raise ConfigError(f"--data {url}: no such file")
    fmt = file_format(url)
    return CorpusFile(url=url, name=os.path.basename(path.rstrip("/")), format=fmt, size=int(info["size"]))


def _jsonl_keys(f) -> list[str]:
    for line in read_lines(f):
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        return list(obj) if isinstance(obj, dict) else []
    return []


def read_lines(f, block: int = 1 << 22):
    """Lines of a binary file (without the newline), read in 4 MiB blocks: remote files' readline
    would copy their whole read-ahead buffer for every line."""
    tail = b""
    while True:
        buf = f.read(block)
        if not buf:
            break
        parts = (tail + buf).split(b"\n")
        tail = parts.pop()
        yield from parts
    if tail:
        yield tail


def _arrow_names(f) -> list[str]:
    import pyarrow as pa

    data = f.read()
    try:
        return pa.ipc.open_file(pa.BufferReader(data)).schema.names
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(pa.BufferReader(data)).schema.names


def check_sources(files: list[str], storage_options: dict | None = None) -> list[str]:
    """Validate the corpus files and return their source names (base names, which must be unique)."""
    return [f.name for f in Corpus.resolve(files, storage_options=storage_options).files]


def detect_messages_field(url: str, text_field: str, storage_options: dict | None = None) -> str | None:
    """'messages' when the file's first row (or schema) has no `text_field` but a `messages` field."""
    return Corpus.resolve([url], text_field, storage_options=storage_options).detect_messages_field()
