"""File access for the teacher-cache store: one store root on any fsspec URL.

`Location` reads and writes the store's JSON metadata (atomically: temp file + rename on local
disks, a single PUT on object stores), creates claim files exclusively, lists parts and hands the
Zarr v3 store to `xtcache.store`. `check_version` and `read_model` refuse metadata of another
format version or schema before anything else is read.

    python -c "from xtcache.store_io import Location; print(Location('out/cache').listdir('index'))"
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from schemas.models import READ_VERSIONS
from xtcache.errors import CorruptionError, FormatVersionError, StoreError


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def check_version(raw: dict, what: str) -> None:
    """Refuse metadata of another format version before validating anything else."""
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version not in READ_VERSIONS:
        raise FormatVersionError(
            f"{what} has format version {version!r}; this xtcache reads format version {max(READ_VERSIONS)} and "
            f"earlier ({', '.join(map(str, READ_VERSIONS))}) only: upgrade xtcache (newer stores) or re-create "
            "the cache")


def read_model(model, raw: dict, where: str):
    from pydantic import ValidationError

    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ())) or "(the object)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise StoreError(f"{where} does not match the xtcache schema: {field}: {first.get('msg', '')}{more}") from None


def is_local(path: str) -> bool:
    """A plain path or a file:// URL."""
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    """The OS path of a plain path or file:// URL."""
    return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)


def file_system(path: str, storage_options: dict | None = None):
    """(fsspec filesystem, path on it) of one file: local paths (plain or file://) use the OS, any
    other URL (s3://, gs://, hf://, ...) its fsspec filesystem with `storage_options`."""
    import fsspec.core

    if is_local(path):
        return fsspec.filesystem("file"), local_path(path)
    return fsspec.core.url_to_fs(path, **dict(storage_options or {}))


class Location:
    """A store root on an fsspec filesystem plus the matching Zarr store.

    Local paths (plain or file://) use the OS directly: exclusive create with O_EXCL and atomic
    writes with a temp file + os.replace. Other filesystems write small JSON files in one put, which
    object stores make visible atomically.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.local = is_local(url)
        self.fs, root = file_system(url, self.storage_options)
        self.root = root if self.local else root.rstrip("/")
        self._zarr_store = None

    @property
    def zarr_store(self):
        if self._zarr_store is None:
            from zarr.storage import FsspecStore, LocalStore

            if self.local:
                os.makedirs(self.root, exist_ok=True)
                self._zarr_store = LocalStore(self.root)
            else:
                self._zarr_store = FsspecStore.from_url(self.url, storage_options=self.storage_options or None)
        return self._zarr_store

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def read_json(self, rel: str) -> dict | None:
        try:
            with self.fs.open(self.path(rel), "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise CorruptionError(f"{self.url}/{rel} is not valid JSON: {e}") from None

    def write_json_atomic(self, rel: str, obj: dict) -> None:
        data = json.dumps(obj, indent=1, sort_keys=True).encode("utf-8")
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        else:
            self.fs.pipe_file(path, data)

    def create_exclusive(self, rel: str, obj: dict) -> bool:
        """Create a JSON file only if absent; False when it already exists."""
        data = json.dumps(obj, indent=1, sort_keys=True).encode("utf-8")
        path = self.path(rel)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        # object stores: check then put (no portable conditional put through fsspec)
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)
        return True

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except (FileNotFoundError, NotADirectoryError):
            pass

    def groups(self) -> list[str]:
        """Alignment group directories under align/ (fingerprints), skipping Zarr's own metadata."""
        return [n for n in self.listdir("align") if n != "zarr.json"]

    def remove_tree(self, rel: str) -> None:
        if self.fs.exists(self.path(rel)):
            self.fs.rm(self.path(rel), recursive=True)
            self._zarr_store = None  # drop cached listings of the removed tree

    def listdir(self, rel: str) -> list[str]:
        self.fs.invalidate_cache(self.path(rel))  # object-store listings are cached by fsspec
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def du(self, rel: str) -> int:
        try:
            return int(self.fs.du(self.path(rel), total=True))
        except FileNotFoundError:
            return 0
