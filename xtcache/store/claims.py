"""Claims on a store: which process may write as a writer index, and the alignment lock.

`claims/w{W:05d}.json` says which process writes as writer W; `claims/align.json` is held by
`xtcache align` for its whole run, and by a dump writer for the moment it removes another
alignment group's part of a part it rewrites, so that neither removes what the other wrote.

A claim is created exclusively (`Location.create_exclusive`: O_EXCL on local disks, a conditional
PUT on S3 and GCS) and carries a random token. Its holder releases it only while the token on the
store is still its own, so a job whose claim was taken over by `--resume` never removes the new
holder's claim, and it stops before committing another part (`check`). On a filesystem without an
exclusive create, several writers are refused unless `XTCACHE_ONE_JOB_PER_INDEX=1` says that the
scheduler starts one job per index.

    python -c "from xtcache.store.claims import Claim; help(Claim)"
"""

from __future__ import annotations

import logging
import os
import secrets
import socket

from schemas.models import WriterClaim
from xtcache.errors import StoreError
from xtcache.location import ONE_JOB_ENV, Location, now_iso

log = logging.getLogger(__name__)

ALIGN_CLAIM = "claims/align.json"
ALIGN_INDEX = -1  # WriterClaim.writer_index of the alignment lock


def writer_claim_path(writer_index: int) -> str:
    return f"claims/w{writer_index:05d}.json"


class Claim:
    """One claim file of a store, held by this process once `acquire` (or `try_acquire`) succeeded."""

    def __init__(self, loc: Location, rel: str, writer_index: int, what: str):
        self.loc, self.rel, self.writer_index, self.what = loc, rel, writer_index, what
        self.token: str | None = None  # set while held

    def _body(self) -> dict:
        self.token = secrets.token_hex(16)
        return WriterClaim(writer_index=self.writer_index, pid=os.getpid(), host=socket.gethostname(),
                           time=now_iso(), token=self.token).model_dump()

    def held_by(self, other: dict) -> str:
        return (f"{self.what} of store {self.loc.url} is claimed by pid {other.get('pid')} on {other.get('host')} "
                f"since {other.get('time')}")

    def require_exclusive(self, several: bool) -> None:
        """Refuse several writers on a filesystem whose claims cannot be exclusive (unless told it is safe)."""
        if self.loc.atomic_create:
            return
        if several and os.environ.get(ONE_JOB_ENV) != "1":
            raise StoreError(f"store {self.loc.url}: this filesystem ({type(self.loc.fs).__name__}) has no exclusive "
                             "create, so two jobs with one --shard-index would both take its claim; start one job per "
                             f"--shard-index (a Slurm array, an indexed Job) and set {ONE_JOB_ENV}=1 to confirm it")
        log.warning("store %s: claims are not exclusive on %s (no conditional create): run one job per "
                    "--shard-index", self.loc.url, type(self.loc.fs).__name__)

    def try_acquire(self) -> dict | None:
        """Create the claim; None when this process now holds it, else the current holder's claim."""
        body = self._body()
        if self.loc.create_exclusive(self.rel, body):
            return None
        self.token = None
        return self.loc.read_json(self.rel) or {}

    def acquire(self, *, resume: bool = False) -> None:
        """Take the claim, or take it over with `resume` (the holder is gone); StoreError otherwise."""
        other = self.try_acquire()
        if other is None:
            return
        if not resume:
            raise StoreError(f"{self.held_by(other)}; if that process is gone, resume with --resume")
        self.take_over(other)

    def take_over(self, other: dict) -> None:
        """Replace a dead holder's claim with ours (a new token), refusing a holder alive on this host."""
        if other.get("host") == socket.gethostname() and pid_alive(other.get("pid")):
            raise StoreError(f"{self.held_by(other)}, and that process is still running: --resume only takes over "
                             "the claim of a job that died")
        log.warning("taking over the claim of %s in %s (pid %s on %s)", self.what, self.loc.url, other.get("pid"),
                    other.get("host"))
        body = self._body()
        self.loc.write_json_atomic(self.rel, body)
        if not self.holds():  # another --resume wrote after us: it holds the claim now
            self.token = None
            raise StoreError(f"{self.held_by(self.loc.read_json(self.rel) or {})}: two --resume runs took it over at "
                             "once; this one stops")

    def holds(self) -> bool:
        """Whether the claim on the store still carries this process's token."""
        current = self.loc.read_json(self.rel)
        return self.token is not None and current is not None and current.get("token") == self.token

    def check(self, doing: str) -> None:
        """Raise StoreError when the claim is no longer ours (taken over by --resume, or removed)."""
        if self.token is None:
            raise StoreError(f"{self.what} of store {self.loc.url}: this process holds no claim; cannot {doing}")
        current = self.loc.read_json(self.rel)
        if current is None or current.get("token") != self.token:
            who = f"pid {current.get('pid')} on {current.get('host')}" if current else "nobody (the claim was removed)"
            self.token = None
            raise StoreError(f"{self.what} of store {self.loc.url} is now claimed by {who}, not by this job (a "
                             f"--resume run took it over); this job stops without {doing}")

    def release(self) -> None:
        """Remove the claim if it still carries our token (idempotent); never removes another holder's claim."""
        if self.token is None:
            return
        current = self.loc.read_json(self.rel)
        if current is not None and current.get("token") == self.token:
            self.loc.remove(self.rel)
        elif current is not None:
            log.warning("%s of store %s: the claim is now held by pid %s on %s; left in place", self.what,
                        self.loc.url, current.get("pid"), current.get("host"))
        self.token = None


def align_lock(loc: Location) -> Claim:
    return Claim(loc, ALIGN_CLAIM, ALIGN_INDEX, "the alignment lock (claims/align.json)")


def acquire_align_lock(loc: Location, who: str) -> Claim:
    """The alignment lock, taken now; a dead holder on this host is replaced, a live or remote one (or
    another object of this process) refused."""
    lock = align_lock(loc)
    other = lock.try_acquire()
    if other is None:
        return lock
    if other.get("host") == socket.gethostname() and other.get("pid") != os.getpid() and not pid_alive(other.get("pid")):
        lock.take_over(other)
        return lock
    raise StoreError(f"{lock.held_by(other)}: `xtcache align` is running on this store, and {who} cannot run "
                     f"beside it; wait for it to end (or, if that process is gone, delete {loc.url}/{ALIGN_CLAIM})")


def pid_alive(pid) -> bool:
    """Whether a process with this pid runs on this host (never true for our own pid: we may resume ourselves)."""
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
