"""The corpus of `xtcache teacher-dump`: `--data` resolved once (`files.Corpus`: files, formats,
sizes, Parquet footers, the document field) and read as a stream of documents (`rows`).

Only this package opens `--data` files with pyarrow (an import-linter contract in pyproject.toml).

    python -m stage1_teacher.corpus data.jsonl --text-field text   # prints counts
"""

from stage1_teacher.corpus.files import (
    ARROW,
    JSONL,
    PARQUET,
    SUFFIXES,
    TEXT,
    Corpus,
    CorpusFile,
    ParquetFooter,
    check_sources,
    detect_messages_field,
    file_format,
    read_lines,
)
from stage1_teacher.corpus.rows import TOOLS_FIELD, Document, Skipped, iter_corpus, iter_file

__all__ = ["ARROW", "JSONL", "PARQUET", "SUFFIXES", "TEXT", "TOOLS_FIELD", "Corpus", "CorpusFile", "Document",
           "ParquetFooter", "Skipped", "check_sources", "detect_messages_field", "file_format", "iter_corpus", "iter_file",
           "read_lines"]
