"""File access for the teacher-cache store: one store root on any fsspec URL.

`Location` reads and writes the store's JSON metadata (atomically: temp file + rename on local
disks, a single PUT on object stores), creates claim files exclusively (a hard link of a whole temp file locally, a
conditional PUT on S3 and GCS), lists parts and hands the Zarr v3 store to `xtcache.store`.
`check_version` and `read_model` refuse metadata of another format version or schema before
anything else is read.

Every call to the filesystem goes through `retry`: timeouts, dropped connections, throttling and
5xx answers (`is_transient`) are tried again with bounded exponential backoff (RETRY_ATTEMPTS in
all, logged), then raised as a `StoreError` that says the store could not be reached. A missing
object is never retried: it is missing.

    python -c "from xtcache.location import Location; print(Location('out/cache').listdir('index'))"
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import tempfile
import time

from schemas.models import READ_VERSIONS
from xtcache.errors import CorruptionError, FormatVersionError, StoreError

log = logging.getLogger(__name__)

RETRY_ATTEMPTS = 5  # tries of one object-store call before its error is raised
RETRY_BASE_S = 0.2  # first backoff; doubled per retry, jittered, capped at RETRY_MAX_S
RETRY_MAX_S = 5.0
# errnos of a call that may succeed when repeated: s3fs maps 503/SlowDown to EBUSY, 500 to EREMOTEIO and
# unknown answers (502, 504, throttling codes it does not name) to EIO
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                              errno.ECONNABORTED, errno.EPIPE, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EIO,
                              getattr(errno, "EREMOTEIO", 121)})
# exception classes of botocore, aiohttp and fsspec that mean "no answer", matched by name so that
# none of those packages has to be installed
TRANSIENT_NAMES = frozenset({"ReadTimeoutError", "ConnectTimeoutError", "EndpointConnectionError",
                             "ConnectionClosedError", "IncompleteReadError", "ResponseStreamingError",
                             "ServerDisconnectedError", "ClientPayloadError", "ClientConnectionError",
                             "ClientOSError", "FSTimeoutError", "ProtocolError"})
TRANSIENT_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                             "RequestTimeout", "RequestTimeTooSkewed", "InternalError", "ServiceUnavailable",
                             "500", "502", "503", "504", "429", "408"})
_jitter = random.Random()  # private: never touches the global random state a training run seeds


def is_transient(exc: BaseException) -> bool:
    """Whether a filesystem call that raised `exc` may succeed when repeated: a timeout, a dropped
    connection, throttling or a 5xx answer. A missing object, a refused permission or bytes that
    arrived are never transient."""
    for e in (exc, exc.__cause__):
        if e is None or isinstance(e, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
                                       FileExistsError)):
            continue
        if isinstance(e, (TimeoutError, ConnectionError)) or type(e).__name__ in TRANSIENT_NAMES:
            return True
        if isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS:
            return True
        response = getattr(e, "response", None)  # botocore ClientError; gcsfs HttpError has .code
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else getattr(e, "code", None)
        if str(code) in TRANSIENT_CODES:
            return True
    return False


def _delay(attempt: int) -> float:
    return min(RETRY_MAX_S, RETRY_BASE_S * 2 ** attempt) * _jitter.uniform(0.5, 1.0)


def _give_up(what: str, exc: BaseException) -> StoreError:
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return StoreError(f"{what}: the object store did not answer after {RETRY_ATTEMPTS} attempts "
                      f"({type(exc).__name__}: {first}); the store is unreachable or throttling: rerun "
                      "(teacher-dump with --resume) once it answers")


def retry(what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, repeated on transient errors with exponential backoff; `what` names the
    object in the log and in the StoreError raised once RETRY_ATTEMPTS are spent."""
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001  (classified in _backoff)
            time.sleep(_backoff(what, e, attempt))


async def retry_async(what: str, make):
    """`await make()`, repeated on transient errors like `retry` (`make` returns a new awaitable each time)."""
    for attempt in range(RETRY_ATTEMPTS):
        try:
            return await make()
        except Exception as e:  # noqa: BLE001  (classified in _backoff)
            await asyncio.sleep(_backoff(what, e, attempt))


def _backoff(what: str, e: Exception, attempt: int) -> float:
    """Seconds to wait before retrying after `e` on attempt `attempt`; re-raises `e` when it is not
    transient, and the give-up StoreError once RETRY_ATTEMPTS are spent. Must run in an except block."""
    if not is_transient(e):
        raise e
    if attempt == RETRY_ATTEMPTS - 1:
        raise _give_up(what, e) from e
    delay = _delay(attempt)
    log.warning("%s: %s (%s); retry %d of %d in %.1f s", what, type(e).__name__, e, attempt + 1,
                RETRY_ATTEMPTS - 1, delay)
    return delay


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


# object stores whose fsspec filesystem creates an object only if it is absent, in one request:
# s3fs sends `If-None-Match: *` (AWS S3 since 2024, MinIO, moto), gcsfs `ifGenerationMatch=0`
ATOMIC_CREATE = {"s3": "If-None-Match", "s3a": "If-None-Match", "gs": "ifGenerationMatch=0",
                 "gcs": "ifGenerationMatch=0"}
ONE_JOB_ENV = "XTCACHE_ONE_JOB_PER_INDEX"  # "1": the scheduler guarantees one job per writer index


def _written_temp(path: str, data: bytes) -> str:
    """A `.tmp-` file beside the local `path` holding `data`, flushed to disk (listings skip `.tmp-` entries): what
    an atomic write renames and an exclusive create links into place, so the path never shows partial bytes. The
    caller removes it if it does not become the file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


class Location:
    """A store root on an fsspec filesystem plus the matching Zarr store.

    Local paths (plain or file://) use the OS directly: exclusive create by hard-linking a whole temp file and atomic
    writes with a temp file + os.replace. Other filesystems write small JSON files in one put, which
    object stores make visible atomically, and create exclusively with a conditional put where
    the store offers one (`atomic_create`). Every filesystem call is retried on transient errors.
    """

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.local = is_local(url)
        self.fs, root = file_system(url, self.storage_options)
        self.root = root if self.local else root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.create_condition = "link(2)" if self.local else next(
            (ATOMIC_CREATE[p] for p in protocols if p in ATOMIC_CREATE), None)
        self._zarr_store = None

    @property
    def atomic_create(self) -> bool:
        """Whether `create_exclusive` is atomic here (two processes can never both create one file)."""
        return self.create_condition is not None

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

    def _what(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def read_json(self, rel: str) -> dict | None:
        def read():
            try:
                with self.fs.open(self.path(rel), "rb") as f:
                    return f.read()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None

        data = retry(self._what(rel), read)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise CorruptionError(f"{self.url}/{rel} is not valid JSON: {e}") from None

    def write_json_atomic(self, rel: str, obj: dict) -> None:
        self.write_bytes_atomic(rel, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Write `rel` whole (local: temp file, fsync, rename; remote: one PUT, which object stores
        make visible atomically)."""
        path = self.path(rel)
        if self.local:
            tmp = _written_temp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        else:
            retry(self._what(rel), self.fs.pipe_file, path, data)

    def create_exclusive(self, rel: str, obj: dict) -> bool:
        """Create a JSON file only if absent; False when it already exists.

        Atomic locally (link(2) of a whole temp file) and on S3/GCS (conditional put); elsewhere a check then a put, which
        two processes can both pass (`atomic_create` is False: callers decide whether that is safe).
        A create whose answer was lost and whose retry finds the file compares the bytes: the same
        bytes (claims carry a unique token) are our own create.
        """
        data = json.dumps(obj, indent=1, sort_keys=True).encode("utf-8")
        path = self.path(rel)
        if self.local:  # written whole to a temp file, then hard-linked: an O_EXCL create would show readers an
            # empty file until its bytes are written (a concurrent job read manifest.json as "not valid JSON")
            tmp = _written_temp(path, data)
            try:
                os.chmod(tmp, 0o644)
                os.link(tmp, path)  # atomic and exclusive: FileExistsError when the file is there
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
            return True

        def create() -> bool:
            try:
                if self.atomic_create:
                    self.fs.pipe_file(path, data, mode="create")
                elif self.fs.exists(path):
                    return False
                else:
                    self.fs.pipe_file(path, data)
                return True
            except FileExistsError:
                return False
            except (NotImplementedError, OSError) as e:
                if isinstance(e, NotImplementedError) or e.errno == errno.ENOSYS:
                    raise StoreError(f"store {self.url}: the object store refuses conditional writes "
                                     f"({self.create_condition}), so writer claims cannot be exclusive; run one job "
                                     f"per --shard-index and set {ONE_JOB_ENV}=1 (docs/store.md)") from e
                raise

        if retry(self._what(rel), create):
            return True
        self.fs.invalidate_cache(path)
        return retry(self._what(rel), self.fs.cat_file, path) == data

    def exists(self, rel: str) -> bool:
        return retry(self._what(rel), self.fs.exists, self.path(rel))

    def remove(self, rel: str) -> None:
        def rm():
            try:
                self.fs.rm_file(self.path(rel))
            except (FileNotFoundError, NotADirectoryError):
                pass

        retry(self._what(rel), rm)

    def groups(self) -> list[str]:
        """Alignment group directories under align/ (fingerprints), skipping Zarr's own metadata."""
        return [n for n in self.listdir("align") if n != "zarr.json"]

    def remove_tree(self, rel: str) -> None:
        def rm():
            try:
                self.fs.rm(self.path(rel), recursive=True)
            except FileNotFoundError:
                pass

        if self.exists(rel):
            retry(self._what(rel), rm)
            self._zarr_store = None  # drop cached listings of the removed tree

    def listdir(self, rel: str) -> list[str]:
        self.fs.invalidate_cache(self.path(rel))  # object-store listings are cached by fsspec

        def ls():
            try:
                return self.fs.ls(self.path(rel), detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []

        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in retry(self._what(rel), ls))

    def du(self, rel: str) -> int:
        def du():
            try:
                return int(self.fs.du(self.path(rel), total=True))
            except FileNotFoundError:
                return 0

        return retry(self._what(rel), du)
