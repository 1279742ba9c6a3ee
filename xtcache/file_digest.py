"""Content sha256 digests of corpus files, read at most once per version of a file.

A corpus file's digest is the sha256 of all its bytes (or of a byte span [lo, hi) of it, for a
file that several jobs share), so any edit anywhere in it changes the digest. Reading every byte
is the cost; it is paid once per version of a file, as git and DVC do:

* a **validator** says which version of a file this is without reading it: for a local file its
  size, mtime_ns, ctime_ns and inode (os.stat); on an object store the checksums or generation it
  keeps per object (S3 `ETag` / `ChecksumSHA256` / `VersionId`, GCS `generation` / `md5Hash` /
  `crc32c`, Azure `etag`), which change whenever the content does. A file system that gives none
  (plain HTTP) has no validator: its files are read in full every time, and counted.
* a **hash cache** (sqlite, `$XTCACHE_HASH_CACHE`, default `~/.cache/xtcache/file_digests.sqlite`;
  `off` disables it) maps (file, validator) to the digest, so a second run on the same machine
  reads nothing. A local file modified less than `RACY_S` before it was hashed is not cached
  (git's "racily clean" rule: a later edit within the same mtime tick would keep the validator).
* a digest recorded earlier (in a store) is trusted without a read when its validator equals the
  file's current one (`FileHasher.digest(url, recorded=...)`): a rerun on a fresh cluster node,
  whose hash cache is empty, reads nothing for unchanged files either.

`DigestStats` counts files, bytes read and time, so the cost is reported, never hidden.

    python -m xtcache.file_digest corpus/*.jsonl   # prints each digest and how it was obtained
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import sys
import time
from dataclasses import dataclass, field

from xtcache.errors import ConfigError
from xtcache.location import file_system, is_local

log = logging.getLogger(__name__)

READ_BLOCK = 8 << 20  # bytes per read while hashing (one ranged GET each on an object store)
RACY_S = 2.0  # a local file modified this recently is hashed but not cached
STORE_VALIDATORS = ("ChecksumSHA256", "ETag", "etag", "VersionId", "generation", "md5Hash", "crc32c")


@dataclass(frozen=True)
class FileDigest:
    """The sha256 of a corpus file's bytes (or of the byte span [lo, hi) of it) and the validator
    of the version that was hashed."""

    name: str  # base name (the document ids' source)
    size: int  # of the whole file
    sha256: str
    validator: dict = field(default_factory=dict)  # {}: no validator, never trusted without a read
    span: tuple[int, int] | None = None  # None: the whole file

    def as_json(self) -> dict:
        return {"name": self.name, "size": self.size, "sha256": self.sha256, "validator": self.validator,
                "span": None if self.span is None else list(self.span)}

    @staticmethod
    def from_json(d: dict) -> FileDigest:
        span = d.get("span")
        return FileDigest(name=str(d["name"]), size=int(d["size"]), sha256=str(d["sha256"]),
                          validator=dict(d.get("validator") or {}),
                          span=None if span is None else (int(span[0]), int(span[1])))


@dataclass
class DigestStats:
    """What obtaining digests cost: files, how each digest was obtained, bytes read, seconds."""

    files: int = 0
    read: int = 0  # files (or spans) read
    bytes_read: int = 0
    from_cache: int = 0  # hash cache hits
    from_record: int = 0  # validator equal to a recorded digest's
    seconds: float = 0.0

    def line(self) -> str:
        return (f"{self.files} corpus files digested in {self.seconds:.2f} s: {self.read} read "
                f"({self.bytes_read / 1e6:,.1f} MB), {self.from_cache} from the hash cache, {self.from_record} from "
                "a recorded digest with an unchanged validator")


def validator(info: dict | os.stat_result) -> dict:
    """The version of a file without reading it: os.stat fields, or an object store's checksums."""
    if isinstance(info, os.stat_result):
        return {"size": info.st_size, "mtime_ns": info.st_mtime_ns, "ctime_ns": info.st_ctime_ns, "ino": info.st_ino}
    found = {k: str(info[k]) for k in STORE_VALIDATORS if info.get(k) not in (None, "")}
    return {"size": int(info["size"]), **found} if found else {}


class HashCache:
    """(file, validator) -> sha256 in a sqlite file; shared by the jobs of one machine."""

    def __init__(self, path: str | None):
        self.path = path
        self.db = None
        if path is None:
            return
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.db = sqlite3.connect(path, timeout=30.0, check_same_thread=False)
            self.db.execute("CREATE TABLE IF NOT EXISTS digests (key TEXT PRIMARY KEY, sha256 TEXT NOT NULL)")
            self.db.commit()
        except (OSError, sqlite3.Error) as e:
            log.warning("FALLBACK: hash cache %s unusable (%s: %s); every corpus file without a recorded digest is "
                        "read in full (set XTCACHE_HASH_CACHE to a writable file)", path, type(e).__name__, e)
            self.db = None

    @staticmethod
    def default_path() -> str | None:
        env = os.environ.get("XTCACHE_HASH_CACHE")
        if env:
            return None if env.lower() == "off" else env
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "xtcache", "file_digests.sqlite")

    def get(self, key: str) -> str | None:
        if self.db is None:
            return None
        row = self.db.execute("SELECT sha256 FROM digests WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, sha256: str) -> None:
        if self.db is None:
            return
        try:
            self.db.execute("INSERT OR REPLACE INTO digests (key, sha256) VALUES (?, ?)", (key, sha256))
            self.db.commit()
        except sqlite3.Error as e:  # a locked or full cache costs a re-read next time, nothing else
            log.warning("hash cache %s: %s; this digest is not cached", self.path, e)


class FileHasher:
    """Digests of local or fsspec files through validators, a hash cache and recorded digests."""

    def __init__(self, storage_options: dict | None = None, cache_path: str | None = "default"):
        self.storage_options = storage_options
        self.cache = HashCache(HashCache.default_path() if cache_path == "default" else cache_path)
        self.stats = DigestStats()
        self._no_validator_logged = False

    def digest(self, url: str, recorded: FileDigest | None = None, span: tuple[int, int] | None = None
               ) -> FileDigest:
        """The digest of the file (or of its bytes [lo, hi) with `span`); a recorded digest of the same
        span with the file's current validator is returned as is."""
        t0 = time.perf_counter()
        fs, path = file_system(url, self.storage_options)
        local = is_local(url)
        try:
            if not local:  # a cached listing (a --data glob's) may hold the ETag of an older version
                fs.invalidate_cache(path)
            info = os.stat(path) if local else fs.info(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--data {url}: cannot reach it ({type(e).__name__}: {e})") from None
        v = validator(info)
        size = int(v["size"]) if v else int(info["size"])
        name = os.path.basename(path.rstrip("/"))
        self.stats.files += 1
        try:
            if recorded is not None and v and recorded.validator == v and recorded.span == span:
                self.stats.from_record += 1
                return recorded
            key = json.dumps({"file": os.path.realpath(path) if local else url, **v,
                              **({"span": list(span)} if span is not None else {})}, sort_keys=True)
            sha = self.cache.get(key) if v else None
            if sha is not None:
                self.stats.from_cache += 1
                return FileDigest(name, size, sha, v, span)
            if not v and not self._no_validator_logged:
                log.warning("%s: the file system gives no checksum or generation for its files; each is read in full "
                            "to check it", url)
                self._no_validator_logged = True
            sha = self._read(fs, path, local, span or (0, size))
            racy = local and time.time_ns() - max(info.st_mtime_ns, info.st_ctime_ns) < RACY_S * 1e9
            if v and not racy:
                self.cache.put(key, sha)
            return FileDigest(name, size, sha, v if not racy else {}, span)
        finally:
            self.stats.seconds += time.perf_counter() - t0

    def _read(self, fs, path: str, local: bool, span: tuple[int, int]) -> str:
        h = hashlib.sha256()
        lo, hi = span
        with (open(path, "rb") if local else fs.open(path, "rb", block_size=READ_BLOCK, cache_type="none")) as f:
            f.seek(lo)
            while lo < hi and (block := f.read(min(READ_BLOCK, hi - lo))):
                h.update(block)
                lo += len(block)
                self.stats.bytes_read += len(block)
        self.stats.read += 1
        return h.hexdigest()


def main(argv: list[str]) -> None:
    hasher = FileHasher()
    for url in argv:
        before = (hasher.stats.read, hasher.stats.from_cache)
        d = hasher.digest(url)
        how = "read" if hasher.stats.read > before[0] else "hash cache"
        print(f"{d.sha256}  {d.size:>14,}  {how:<10}  {url}")
    print(hasher.stats.line())


if __name__ == "__main__":
    main(sys.argv[1:])
