"""The teacher tokenizer a store carries: `teacher_tokenizer/` beside its manifest (schemas/STORE_FORMAT.md
section 2), so that a store trains from any directory or machine with nothing else shipped.

A cross-tokenizer store is read through a projection map between the student's tokenizer and the
teacher's: `train-student` builds it when no --projection is given, and `xtcache align` checks the
teacher side's bytes with it. teacher-dump copies the teacher's tokenizer files into the store (a few
MB); the readers load that copy, checked against the manifest's `teacher_tokenizer` fingerprint. A process
parses each version of those files once (`_LOADED`, keyed by their content): a run whose corpus cache, rollouts
and held-out set all carry one teacher reads the files three times and loads the tokenizer once.

    save_teacher_tokenizer(url, teacher_dir, storage_options)   # teacher-dump: the files, where absent
    tok = load_store_tokenizer(url, manifest, storage_options)   # the copy; None in a store without one
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

from xtcache.errors import CorruptionError
from xtcache.fingerprint import tokenizer_fingerprint
from xtcache.location import Location, retry
from xtcache.tokenizer import load_tokenizer

TOKENIZER_DIR = "teacher_tokenizer"
"""The directory of a store that holds its teacher's tokenizer files."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")
"""The files of a Hugging Face model directory that make its tokenizer (those present are copied)."""

_LOADED: OrderedDict[str, object] = OrderedDict()  # sha256 of the files' names and bytes -> the tokenizer they make
_LOADED_MAX = 4  # tokenizers kept (a large vocabulary holds tens of MB)


def save_teacher_tokenizer(url: str, teacher_dir: str | os.PathLike, storage_options: dict | None = None) -> list[str]:
    """Copy the tokenizer files of `teacher_dir` into the store at `url` (each one absent there: several
    writers of one store write the same bytes); returns the names written."""
    loc = Location(url, storage_options)
    written = []
    for name in TOKENIZER_FILES:
        src = Path(teacher_dir) / name
        rel = f"{TOKENIZER_DIR}/{name}"
        if src.is_file() and not loc.exists(rel):
            loc.write_bytes_atomic(rel, src.read_bytes())
            written.append(name)
    return written


def load_store_tokenizer(url: str, manifest, storage_options: dict | None = None):
    """The teacher tokenizer stored in the store at `url`, or None when the store holds none (stores
    written before teacher-dump stored it). A copy whose fingerprint is not the manifest's
    `teacher_tokenizer` is damage: CorruptionError naming the store. The tokenizer is shared with every
    caller given the same files in this process: read it, do not modify it."""
    loc = Location(url, storage_options)
    names = [n for n in loc.listdir(TOKENIZER_DIR) if n in TOKENIZER_FILES]
    if "tokenizer.json" not in names:
        return None
    files = {name: retry(f"{url}/{TOKENIZER_DIR}/{name}", loc.fs.cat_file, loc.path(f"{TOKENIZER_DIR}/{name}"))
             for name in sorted(names)}
    tok = _load_files(files, url)
    if tokenizer_fingerprint(tok) != manifest.fingerprints.get("teacher_tokenizer"):
        raise CorruptionError(f"store {url}: {TOKENIZER_DIR}/ does not hold the tokenizer of the manifest's "
                              "teacher_tokenizer fingerprint: the directory was edited or damaged")
    return tok


def _load_files(files: dict[str, bytes], url: str):
    """The tokenizer that `files` (name -> bytes) make, loaded once per content in this process: the key is
    their bytes, so an edited file is a new key, never a stale tokenizer."""
    h = hashlib.sha256()
    for name, data in files.items():
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    key = h.hexdigest()
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]
    with tempfile.TemporaryDirectory(prefix="xtcache-teacher-tok-") as tmp:
        for name, data in files.items():
            Path(tmp, name).write_bytes(data)
        tok = _LOADED[key] = load_tokenizer(tmp, f"the teacher tokenizer stored in {url}")
    while len(_LOADED) > _LOADED_MAX:
        _LOADED.popitem(last=False)
    return tok
