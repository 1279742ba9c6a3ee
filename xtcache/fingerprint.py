"""Stable content hashes of everything a teacher cache depends on.

A cache is reusable only for the same teacher weights, teacher tokenizer, corpus and capture
settings (the capture engine and its version among them); `cache_key` combines their fingerprints into one hex string that names the cache. Every
fingerprint is a sha256 hex digest of canonical bytes (sorted-key JSON, file contents), so it is the
same across runs, processes and machines. The corpus fingerprint covers every byte of every file
(`xtcache.file_digest` says how the bytes are read at most once per version of a file).

    python -m xtcache.fingerprint path/to/tokenizer_or_model_dir
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

from xtcache.errors import XtcacheError
from xtcache.file_digest import FileHasher
from xtcache.location import file_system

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

# A process fingerprints the same loaded tokenizer several times (train-student: the loader of each cache,
# the held-out check, the projection check). For a 128k-id vocabulary the canonical form costs about 1.2 s a
# time, the backend's own serialisation 0.25 s: the last few serialisations, compared whole, keep their
# fingerprints, so a tokenizer changed in between (an added token) is fingerprinted again.
_RECENT_TOKENIZERS: OrderedDict[str, str] = OrderedDict()  # oldest first
_RECENT_MAX = 4


def canonical_json(obj: Any, *, ascii_only: bool = False) -> bytes:
    """The bytes a fingerprint hashes: JSON with sorted keys, no whitespace, UTF-8.

    `ascii_only` escapes non-ASCII characters (\\uXXXX): the shard plan's fingerprint has always been
    taken so, and stored plans and cache keys keep it, so their file names hash as they did."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only).encode("utf-8")


def canonical_sha256(obj: Any, *, ascii_only: bool = False) -> str:
    """sha256 hex digest of `canonical_json(obj)`."""
    return hashlib.sha256(canonical_json(obj, ascii_only=ascii_only)).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tokenizer_fingerprint(path_or_tokenizer: Any) -> str:
    """sha256 of the canonical `tokenizer.json` content (keys sorted, whitespace removed).

    Accepts a tokenizer directory, a `tokenizer.json` path, a `tokenizers.Tokenizer`, or a
    transformers fast tokenizer (its backend tokenizer is serialised). Added special tokens are part
    of `tokenizer.json`, so two tokenizers with the same fingerprint split every text identically.
    Its `truncation` and `padding` settings are left out: they do not change how a text is split,
    and `xtcache.tokenizer.load_tokenizer` turns both off, so a file and its loaded tokenizer agree.
    """
    if isinstance(path_or_tokenizer, (str, os.PathLike)):
        path = Path(path_or_tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise XtcacheError(
                f"no tokenizer.json at {path}: xtcache needs a fast (Rust) tokenizer saved with save_pretrained")
        content = json.loads(path.read_text(encoding="utf-8"))
    else:
        backend = getattr(path_or_tokenizer, "backend_tokenizer", path_or_tokenizer)
        if not hasattr(backend, "to_str"):
            raise XtcacheError(
                f"cannot fingerprint {type(path_or_tokenizer).__name__}: pass a fast tokenizer or its directory")
        serialised = backend.to_str()
        fingerprint = _RECENT_TOKENIZERS.get(serialised)
        if fingerprint is None:
            fingerprint = _RECENT_TOKENIZERS[serialised] = _tokenizer_sha256(json.loads(serialised))
            while len(_RECENT_TOKENIZERS) > _RECENT_MAX:
                _RECENT_TOKENIZERS.popitem(last=False)
        return fingerprint
    return _tokenizer_sha256(content)


def _tokenizer_sha256(content: Any) -> str:
    if isinstance(content, dict):
        content = {**content, "truncation": None, "padding": None}
    return canonical_sha256(content)


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over the canonical config.json and the sha256 of every weight file (by name)."""
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise XtcacheError(f"{root} has no config.json: pass a Hugging Face model directory")
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise XtcacheError(
            f"{root} has no weight files ({', '.join(WEIGHT_SUFFIXES)}): the teacher fingerprint needs the weights")
    parts = {
        "config": json.loads(config.read_text(encoding="utf-8")),
        "weights": {p.name: sha256_file(p) for p in weights},
    }
    return canonical_sha256(parts)


def corpus_fingerprint(files: Iterable[str | os.PathLike], storage_options: dict | None = None,
                       hasher=None) -> str:
    """sha256 over each file's name, size and whole-content sha256, in the given order.

    Any byte of any file, a renamed, added, removed or reordered file changes it. Files may be
    local paths or fsspec URLs (`storage_options` for the latter); the same bytes under the same
    base name give the same fingerprint wherever they live. Digests come from `hasher`
    (`xtcache.file_digest.FileHasher`: hash cache, validators, else one full read per file).
    """
    hasher = hasher or FileHasher(storage_options)
    digests = []
    for f in files:
        fs, path = file_system(str(f), storage_options)
        if not fs.isfile(path):
            raise XtcacheError(f"corpus file {f} does not exist")
        digests.append(hasher.digest(str(f)))
    return content_fingerprint(digests)


def content_fingerprint(digests: Iterable) -> str:
    """`corpus_fingerprint` of already computed `FileDigest`s (name, size, sha256; in order)."""
    entries = [{"name": d.name, "size": d.size, "sha256": d.sha256} for d in digests]
    if not entries:
        raise XtcacheError("corpus fingerprint: no corpus files given")
    return canonical_sha256({"files": entries, "content": "sha256"})


def listing_fingerprint(names_and_sizes: Iterable[tuple[str, int]]) -> str:
    """sha256 over each file's base name and size, in order (no content: a multi-job store's key,
    whose jobs check the content of their own files against the digests the store records)."""
    entries = [{"name": str(n), "size": int(s)} for n, s in names_and_sizes]
    if not entries:
        raise XtcacheError("corpus fingerprint: no corpus files given")
    return canonical_sha256({"files": entries, "content": "per-job digests"})


def settings_fingerprint(settings: dict[str, Any]) -> str:
    """sha256 of the settings as sorted-key JSON (values must be JSON-serialisable)."""
    try:
        return canonical_sha256(settings)
    except TypeError as e:
        raise XtcacheError(f"capture settings are not JSON-serialisable: {e}") from None


def cache_key(*, teacher_model: str, teacher_tokenizer: str, corpus: str, settings: str) -> str:
    """One hex key from the four component fingerprints; names the cache directory."""
    parts = {"teacher_model": teacher_model, "teacher_tokenizer": teacher_tokenizer,
             "corpus": corpus, "settings": settings, "xtcache_cache_key": 1}
    return canonical_sha256(parts)


def content_hash(text: str) -> str:
    """Short sha256 of a document's utf-8 text, part of its document id."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def doc_id(source: str, row: int, content_hash: str) -> str:
    """A document's id, 'source:row:content_hash': its file's base name, its 0-based row in that
    file and the hash of its text."""
    return f"{source}:{row}:{content_hash}"


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        p = Path(arg)
        if (p / "config.json").is_file():
            print(f"model     {model_fingerprint(p)}  {p}")
        if (p / "tokenizer.json").is_file() or p.name == "tokenizer.json":
            print(f"tokenizer {tokenizer_fingerprint(p)}  {p}")
