"""Engine processes never outlive the xtcache process that started them, even after `kill -9`.

vLLM runs its engine in child processes (`VLLM::EngineCore`, which starts `VLLM::Worker`). The
workers watch the engine core, but the engine core does not watch its parent: when a
`teacher-dump` is killed with SIGKILL (an OOM kill, a preempted node, `kill -9`), the engine
keeps its GPU memory, or on CPU its KV-cache reservation, and the `--resume` run that follows
cannot start its own.

`guard_children()` runs a small watcher process (this module's `__main__`, in its own session so
that Ctrl-C or a process-group kill aimed at the job leaves it in place to clean up). This
process writes each guarded process to the watcher's stdin as `pid create_time`, also while the
engine is still starting; the watcher checks twice a second whether it has been re-parented,
i.e. whether this process is gone. Once it is gone, however it went,
the watcher sends SIGTERM to every guarded process that is still alive, and to its descendants,
and SIGKILL to those still running 10 s later. After a normal shutdown the engines are already
gone and the watcher exits with nothing to do.

    with guard_children():          # every process started inside the block is guarded
        llm = vllm.LLM(...)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

GRACE_SECONDS = 10.0
POLL_SECONDS = 0.5

_lock = threading.Lock()
_watcher: subprocess.Popen | None = None


def _pipe_to_watcher():
    """The watcher's stdin (started once per process)."""
    global _watcher
    with _lock:
        if _watcher is None or _watcher.poll() is not None:
            _watcher = subprocess.Popen([sys.executable, "-m", "xtcache.reaper", str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                                        close_fds=True, env={**os.environ, "PYTHONPATH": _package_root()})
        return _watcher


def _package_root() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prev = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + prev if prev else "")


def guard(pids) -> None:
    """Have the watcher end these processes (and their descendants) when this process dies."""
    import psutil

    watcher = _pipe_to_watcher()
    lines = []
    for pid in pids:
        if pid == watcher.pid:
            continue
        try:
            lines.append(f"{pid} {psutil.Process(pid).create_time()!r}\n")
        except psutil.NoSuchProcess:
            continue
    if not lines:
        return
    try:
        watcher.stdin.write("".join(lines).encode())
        watcher.stdin.flush()
    except OSError as e:  # the watcher died: the engines run unguarded, which is no reason to fail
        log.warning("engine process watcher is gone (%s); a killed run may leave engine processes behind", e)
        return
    log.debug("guarding processes %s", " ".join(line.split()[0] for line in lines))


@contextlib.contextmanager
def guard_children():
    """Guard every child process started while the block runs (even if it raises).

    New descendants are registered every POLL_SECONDS while the block runs, not only at its end:
    an engine start can take minutes, and a kill during it must not orphan what started so far.
    """
    import psutil

    me = psutil.Process()
    _pipe_to_watcher()  # started before the block, so it never counts as a new child
    before = {p.pid for p in me.children(recursive=True)}
    seen: set[int] = set()
    done = threading.Event()

    def register():
        new = {p.pid for p in me.children(recursive=True)} - before - seen
        if new:
            guard(sorted(new))
            seen.update(new)

    def poll():
        while not done.wait(POLL_SECONDS):
            with contextlib.suppress(psutil.Error):
                register()

    thread = threading.Thread(target=poll, name="xtcache-guard-children", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        register()


def _watch(parent_pid: int) -> None:
    """Watcher main: collect `pid create_time` lines while the parent lives, then end what is left.

    The parent is gone once this process has been re-parented (`os.getppid()` changes, zombie or
    not). Lines are read with select() and drained once more after the parent's death, so a
    registration written just before a kill is never lost. EOF on stdin is not a death signal:
    children forked after the watcher started inherit the pipe's write end.
    """
    import select

    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    guarded: dict[int, float] = {}
    fd = sys.stdin.fileno()
    os.set_blocking(fd, False)
    pending = b""
    eof = False

    def drain():
        nonlocal pending, eof
        while not eof:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            pid, created = line.split()
            guarded[int(pid)] = float(created)

    while os.getppid() == parent_pid:
        if eof:
            time.sleep(POLL_SECONDS)
        else:
            select.select([fd], [], [], POLL_SECONDS)
        drain()
    drain()
    procs = {}
    for pid, created in guarded.items():
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) > 1.0:  # the pid was reused by another process
                continue
            for q in (p, *p.children(recursive=True)):
                procs[q.pid] = q
        except psutil.NoSuchProcess:
            continue
    if not procs:
        return
    for p in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(list(procs.values()), timeout=GRACE_SECONDS)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(OSError):
        print(f"xtcache: process {parent_pid} exited; stopped {len(procs)} engine processes it left behind",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    _watch(int(sys.argv[1]) if len(sys.argv) > 1 else -1)
