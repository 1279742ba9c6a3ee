"""Stage 2 runs as fresh processes forked from one process that imported DeepSpeed once.

A new Python process that imports DeepSpeed (torch, torch._dynamo, transformers) spends ~9 s on
imports before stage 2 starts; a test module with a dozen runs spent most of its time there. Here
one server process imports them once and forks a child per rank of each run: every run is still
its own process (own process group, own DeepSpeed and RNG state, never the server's), started the
way a launcher starts a rank (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT as torchrun sets them).
The children run the commands' own entry points: `python -m stage2_student` and `xtcache`.

    with Stage2Procs() as procs:
        run = procs.run(out, "--cache", ..., nproc=2)     # like tests.test_train_kd.run_stage2
        proc = procs.cli("train-student", ...)            # `xtcache ...`: returncode, stdout, stderr
"""

from __future__ import annotations

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


def _child(entry: str, argv: list[str], env: dict, log: str) -> None:
    """In a forked child: this rank's environment, stdout (LOG.out) and stderr (LOG.err), then the
    entry point; never returns."""
    code = 1
    try:
        for fd, name in ((1, log + ".out"), (2, log + ".err")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.update(env)
        if entry == "xtcache":
            from xtcache.cli import main

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


def _wait(pids: list[int]) -> list[int]:
    """The exit codes of the ranks `pids`; ranks still running after TIMEOUT_S are killed (-9)."""
    codes, deadline = {}, time.time() + TIMEOUT_S
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
                elif time.time() > deadline:
                    os.kill(pid, 9)
        time.sleep(0.05)
    return [codes[p] for p in pids]


def serve() -> None:
    """The server: import the heavy modules once, then one forked run per request line on stdin."""
    import deepspeed  # noqa: F401
    import transformers  # noqa: F401

    import stage2_student.__main__  # noqa: F401
    import stage2_student.trainer  # noqa: F401
    import xtcache.cli  # noqa: F401

    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        pids = []
        for rank, log in enumerate(req["logs"]):
            pid = os.fork()
            if pid == 0:
                _child(req["entry"], req["argv"], _rank_env(rank, len(req["logs"]), port), log)
            pids.append(pid)
        out.write(json.dumps({"codes": _wait(pids)}) + "\n")
        out.flush()


class Stage2Procs:
    """The client: starts the server (its imports overlap whatever the test does meanwhile)."""

    def __init__(self) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="stage2_procs_"))
        self.n = 0
        self.server = subprocess.Popen([sys.executable, "-c", "from tests.stage2_procs import serve; serve()"],
                                       cwd=REPO, env=cpu_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True)
        self.ready = False

    def _call(self, entry: str, argv: list[str], nproc: int) -> tuple[list[int], str, str]:
        if not self.ready:
            assert self.server.stdout.readline().strip() == "ready", "the stage 2 server did not start"
            self.ready = True
        self.n += 1
        logs = [str(self.logs / f"{self.n}-rank{r}.log") for r in range(nproc)]
        self.server.stdin.write(json.dumps({"entry": entry, "argv": argv, "logs": logs}) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        assert reply, "the stage 2 server exited"
        out, err = ("".join(Path(p + end).read_text(errors="replace") for p in logs) for end in (".out", ".err"))
        return json.loads(reply)["codes"], out, err

    def run(self, out: Path, *flags: str, nproc: int = 1) -> dict:
        """`python -m stage2_student --out OUT FLAGS` on `nproc` ranks; returns summary and metrics."""
        codes, stdout, stderr = self._call("stage2", ["--out", str(out), *flags], nproc)
        assert codes == [0] * nproc, f"exit codes {codes}:\n{stdout[-3000:]}{stderr[-6000:]}"
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {"summary": json.loads((out / "summary.json").read_text()),
                "train": [r for r in rows if r["kind"] == "train"], "eval": [r for r in rows if r["kind"] == "eval"]}

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """`xtcache ARGS` in one process: its exit status, stdout and stderr."""
        codes, stdout, stderr = self._call("xtcache", list(args), 1)
        return subprocess.CompletedProcess(["xtcache", *args], codes[0], stdout, stderr)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)
        shutil.rmtree(self.logs, ignore_errors=True)

    def __enter__(self) -> Stage2Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
