"""The corpus of `xtcache teacher-dump`: `--data` resolved once (`files.Corpus`: files, formats,
sizes, Parquet footers, the document field) and read as a stream of documents (`rows`).

Only this package opens `--data` files with pyarrow (an import-linter contract in pyproject.toml).

    python -m stage1_teacher.corpus data.jsonl --text-field text   # prints counts
"""

from stage1_teacher.corpus.rows import (
                                        ARROW,
                                        JSONL,
                                        PARQUET,
                                        SUFFIXES,
                                        TEXT,
                                        TOOLS_FIELD,
                                        Document,
                                        Skipped,
                                        check_sources,
                                        detect_messages_field,
                                        file_format,
                                        iter_corpus,
                                        read_lines,
)

__all__ = ["ARROW", "JSONL", "PARQUET", "SUFFIXES", "TEXT", "TOOLS_FIELD", "Document", "Skipped", "check_sources",
           "detect_messages_field", "file_format", "iter_corpus", "read_lines"]
