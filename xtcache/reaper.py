"""Engine processes never outlive the xtcache process that started them, even after `kill -9`.

vLLM runs its engine in child processes (`VLLM::EngineCore`, which starts `VLLM::Worker`). The
workers watch the engine core, but the engine core does not watch its parent: when a
`teacher-dump` is killed with SIGKILL (an OOM kill, a preempted node, `kill -9`), the engine
keeps its GPU memory, or on CPU its KV-cache reservation, and the `--resume` run that follows
cannot start its own.

`guard_children()` runs a small watcher process (this module's `__main__`, in its own session so
that Ctrl-C or a process-group kill aimed at the job leaves it in place to clean up). This
process writes each guarded process to the watcher's stdin as `pid create_time`; the watcher
checks twice a second whether this process is still alive. Once it is gone, however it went,
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
                                        stdin=subprocess.PIPE, start_new_session=True, close_fds=True,
                                        env={**os.environ, "PYTHONPATH": _package_root()})
        return _watcher.stdin


def _package_root() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prev = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + prev if prev else "")


def guard(pids) -> None:
    """Have the watcher end these processes (and their descendants) when this process dies."""
    import psutil

    lines = []
    for pid in pids:
        try:
            lines.append(f"{pid} {psutil.Process(pid).create_time()!r}\n")
        except psutil.NoSuchProcess:
            continue
    if lines:
        stdin = _pipe_to_watcher()
        stdin.write("".join(lines).encode())
        stdin.flush()
        log.debug("guarding processes %s", " ".join(line.split()[0] for line in lines))


@contextlib.contextmanager
def guard_children():
    """Guard every child process started while the block runs (even if it raises)."""
    import psutil

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        yield
    finally:
        guard(p.pid for p in me.children(recursive=True) if p.pid not in before)


def _watch(parent_pid: int) -> None:
    """Watcher main: collect `pid create_time` lines while the parent lives, then end what is left.

    It polls the parent rather than waiting for EOF on the pipe: children forked after the watcher
    started inherit the pipe's write end, so EOF may never come while they live.
    """
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    guarded: dict[int, float] = {}

    def read():
        for line in sys.stdin.buffer:
            pid, created = line.split()
            guarded[int(pid)] = float(created)

    threading.Thread(target=read, daemon=True).start()
    try:
        parent = psutil.Process(parent_pid)
        while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
            time.sleep(POLL_SECONDS)
    except psutil.NoSuchProcess:
        pass
    procs = []
    for pid, created in list(guarded.items()):
        try:
            p = psutil.Process(pid)
            if p.create_time() != created:  # the pid was reused by another process
                continue
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    if not procs:
        return
    print(f"xtcache: process {parent_pid} exited; stopping {len(procs)} engine processes it left behind",
          file=sys.stderr, flush=True)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=GRACE_SECONDS)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


if __name__ == "__main__":
    _watch(int(sys.argv[1]) if len(sys.argv) > 1 else -1)
