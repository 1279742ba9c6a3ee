"""How the tests run xtcache's commands without paying a new interpreter's imports each time.

- `xtcache(*args)`: `xtcache ARGS` inside the test process, through the installed command's entry point
  (`xtcache.app.cli.main`): its exit status, stdout and stderr as a shell would see them, without a new
  interpreter importing torch and transformers again (about 5 s a command on 2 cores). For commands whose
  property is not about the process.
- `WarmProcs`: commands as fresh processes forked from one process that imported the heavy modules
  once. A new Python process that imports DeepSpeed (torch, torch._dynamo, transformers) spends ~9 s on
  imports before stage 2 starts; here one server process imports them once and forks a child per rank of
  each run: every run is still its own process (own pid, process group, DeepSpeed and RNG state, never
  the server's; SIGKILL kills it), each rank started with the environment torchrun gives it (RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT). Stage 2 runs here: DeepSpeed keeps its process groups for
  the life of a process, so two trainings cannot share one.

A test about what a real launch does (torchrun itself, vLLM's engine processes) still starts one.

    proc = xtcache("verify", url)                        # returncode, stdout, stderr
    with WarmProcs(env=cpu_env()) as procs:
        run = procs.run(out, "--cache", ..., nproc=2)     # like tests.test_train_kd.run_stage2
        proc = procs.cli("train-student", ...)            # `xtcache ...`: returncode, stdout, stderr
        pid = procs.start("teacher-dump", ...)            # `xtcache ...` in the background: poll/wait
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.test_train_kd import REPO, cpu_env

TIMEOUT_S = 600
STAGES = ("deepspeed", "transformers", "stage2_student.__main__", "stage2_student.trainer", "xtcache.app.cli",
          "stage1_teacher.cli", "stage1_teacher.dump", "stage1_teacher.capture.hf_engine", "stage1_teacher.onpolicy.generate")


def xtcache(*args) -> subprocess.CompletedProcess:
    """Run `xtcache ARGS` here; returns what `subprocess.run(..., capture_output=True, text=True)` would."""
    from xtcache.app.cli import main

    argv, out, err = [str(a) for a in args], io.StringIO(), io.StringIO()
    saved, sys.argv = sys.argv, ["xtcache", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as e:  # click ends every command with one, 0 on success; main() gives 2 for an XtcacheError
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, (int, type(None))):
            err.write(f"{e.code}\n")
    finally:
        sys.argv = saved
    return subprocess.CompletedProcess(["xtcache", *argv], code, out.getvalue(), err.getvalue())


def _child(entry: str, argv: list[str], env: dict, log: str) -> None:
    """In a forked child: this rank's environment, stdout (LOG.out) and stderr (LOG.err), then the
    entry point; never returns."""
    code = 1
    try:
        for fd, name in ((1, log + ".out"), (2, log + ".err")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.environ.update(env)
        if entry == "xtcache":
            from xtcache.app.cli import main

            sys.argv = ["xtcache", *argv]
            main()
        else:
            from stage2_student.__main__ import main

            sys.argv = ["stage2_student", *argv]
            main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  (the traceback goes to the rank's log)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _rank_env(rank: int, nproc: int, port: int) -> dict:
    if nproc == 1:
        return {}
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _reap(pid: int, done: dict, block: bool) -> int | None:
    """`pid`'s exit code (reaped once, kept in `done`); None while it runs and not `block`. A child
    still running after TIMEOUT_S of waiting is killed (-9)."""
    deadline = time.time() + TIMEOUT_S
    while pid not in done:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            done[pid] = os.waitstatus_to_exitcode(status)
        elif not block:
            return None
        elif time.time() > deadline:
            os.kill(pid, 9)
        else:
            time.sleep(0.05)
    return done[pid]


def _fork(req: dict) -> list[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pids = []
    for rank, log in enumerate(req["logs"]):
        pid = os.fork()
        if pid == 0:
            _child(req["entry"], req["argv"], _rank_env(rank, len(req["logs"]), port), log)
        pids.append(pid)
    return pids


def serve(modules: list[str]) -> None:
    """The server: import `modules` once, then answer one request line at a time on stdin: `run` (fork
    the ranks, wait for them), `start` (fork one, answer its pid), `poll` and `wait` (its exit code)."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    out, done = sys.stdout, {}
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            reply = {"codes": [_reap(pid, done, True) for pid in _fork(req)]}
        elif req["op"] == "start":
            reply = {"pid": _fork(req)[0]}
        else:
            reply = {"code": _reap(req["pid"], done, req["op"] == "wait")}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    out.flush()
    os._exit(0)  # no interpreter teardown of the imported modules: seconds, for nothing


class WarmProcs:
    """The client: starts the server (its imports overlap whatever the test does meanwhile)."""

    def __init__(self, env: dict | None = None, modules: tuple[str, ...] = STAGES) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="xtcache_procs_"))
        self.n, self.ready, self.pid_logs = 0, False, {}
        code = f"from tests.commands import serve; serve({list(modules)!r})"
        self.server = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=cpu_env() if env is None else env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, **req) -> dict:
        if not self.ready:
            assert self.server.stdout.readline().strip() == "ready", "the warm process server did not start"
            self.ready = True
        self.server.stdin.write(json.dumps(req) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        assert reply, "the warm process server exited"
        return json.loads(reply)

    def _logs(self, nproc: int) -> list[str]:
        self.n += 1
        return [str(self.logs / f"{self.n}-rank{r}") for r in range(nproc)]

    @staticmethod
    def _read(logs: list[str]) -> tuple[str, str]:
        out, err = ("".join(Path(p + end).read_text(errors="replace") for p in logs) for end in (".out", ".err"))
        return out, err

    def run(self, out: Path, *flags: str, nproc: int = 1) -> dict:
        """`python -m stage2_student --out OUT FLAGS` on `nproc` ranks; returns summary and metrics."""
        logs = self._logs(nproc)
        codes = self._ask(op="run", entry="stage2", argv=["--out", str(out), *flags], logs=logs)["codes"]
        stdout, stderr = self._read(logs)
        assert codes == [0] * nproc, f"exit codes {codes}:\n{stdout[-3000:]}{stderr[-6000:]}"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {"summary": json.loads((out / "summary.json").read_text()),
                "train": [r for r in rows if r["kind"] == "train"], "eval": [r for r in rows if r["kind"] == "eval"]}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """`xtcache ARGS` in one process: its exit status, stdout and stderr."""
        logs = self._logs(1)
        code = self._ask(op="run", entry="xtcache", argv=list(args), logs=logs)["codes"][0]
        return subprocess.CompletedProcess(["xtcache", *args], code, *self._read(logs))

    def start(self, *args: str) -> int:
        """`xtcache ARGS` started in the background: its pid (for `poll`, `wait`, or a signal)."""
        logs = self._logs(1)
        pid = self._ask(op="start", entry="xtcache", argv=list(args), logs=logs)["pid"]
        self.pid_logs[pid] = logs
        return pid

    def poll(self, pid: int) -> int | None:
        return self._ask(op="poll", pid=pid)["code"]

    def wait(self, pid: int) -> subprocess.CompletedProcess:
        code = self._ask(op="wait", pid=pid)["code"]
        return subprocess.CompletedProcess(["xtcache"], code, *self._read(self.pid_logs[pid]))

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)
        shutil.rmtree(self.logs, ignore_errors=True)

    def __enter__(self) -> WarmProcs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
