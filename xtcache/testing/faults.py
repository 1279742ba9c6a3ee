"""A filesystem that fails some object reads the way an object store does: `faulty://PATH`.

`FaultyFileSystem` is the local filesystem under the protocol `faulty`, except that each read of
a file (`open` for reading, hence `cat_file` and every Zarr chunk read) first fails with a
transient error at rate XTCACHE_FAULT_RATE (default 0.05), drawn from a generator seeded with
XTCACHE_FAULT_SEED (default 0): a timeout, a dropped connection or a 503 SlowDown as s3fs raises
it (OSError EBUSY). A path never fails more than MAX_RUN times in a row (a burst, not an outage),
so xtcache's bounded retries always get through and a test cannot flake on an unlucky draw;
an outage is `rate=1.0`. Each injected fault is appended as a line to XTCACHE_FAULT_LOG when set, so a
test in another process can count them. Listings, writes and missing files are left alone.

A process opts in with `register()`; a subprocess does through a `sitecustomize.py` on its
PYTHONPATH (`sitecustomize_source()`), so production code never imports this module.

    python -c "from xtcache.testing.faults import register; register(); import fsspec; print(fsspec.filesystem('faulty'))"
"""

from __future__ import annotations

import errno
import os
import random
import threading

from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faulty"
MAX_RUN = 2  # consecutive failures of one path at most (xtcache retries 5 times)


class FaultyFileSystem(LocalFileSystem):
    """Local files; reads fail transiently at `rate` (see the module docstring)."""

    protocol = PROTOCOL

    def __init__(self, *args, rate: float | None = None, seed: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rate = float(os.environ.get("XTCACHE_FAULT_RATE", "0.05")) if rate is None else rate
        self._rng = random.Random(int(os.environ.get("XTCACHE_FAULT_SEED", "0")) if seed is None else seed)
        self._lock = threading.Lock()
        self._run: dict[str, int] = {}  # consecutive failures per path
        self.injected = 0

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"{PROTOCOL}://{self._strip_protocol(name)}"

    def _fault(self, path: str) -> None:
        with self._lock:
            run = self._run.get(path, 0)
            if self._rng.random() >= self.rate or (run >= MAX_RUN and self.rate < 1.0):
                self._run.pop(path, None)
                return
            self._run[path] = run + 1
            self.injected += 1
            n = self.injected
        log = os.environ.get("XTCACHE_FAULT_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {path}\n")
        kind = n % 3
        if kind == 0:
            raise TimeoutError(f"injected read timeout on {path}")
        if kind == 1:
            raise ConnectionResetError(errno.ECONNRESET, f"injected connection reset on {path}")
        raise OSError(errno.EBUSY, f"injected 503 SlowDown on {path}")

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode and os.path.isfile(self._strip_protocol(path)):
            self._fault(path)
        return super()._open(path, mode=mode, **kwargs)


def register() -> None:
    """Make `faulty://` URLs resolve to FaultyFileSystem in this process."""
    import fsspec

    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)


def sitecustomize_source() -> str:
    """A sitecustomize.py that registers `faulty://` in every Python process started with it on PYTHONPATH."""
    return ("import fsspec\n"
            f"fsspec.register_implementation({PROTOCOL!r}, 'xtcache.testing.faults.FaultyFileSystem', clobber=True)\n")
