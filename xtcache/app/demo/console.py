"""The demo's stage runner: each `xtcache` stage a subprocess, its console kept to xtcache's own lines.

    runner = StageRunner(workdir / "demo.log")   # truncates the log, names it on the console
    runner.xtcache("teacher-dump", "--teacher", ...)
    runner.close()                               # names the log again

Every line a stage writes (stdout and stderr together) goes to the engine log. The console gets only
the lines xtcache itself writes: its log records (`HH:MM:SS LEVEL name: ...` from a logger of
`xtcache`, `stage1_teacher` or `stage2_student`), its one-line errors (`error: ...`) and the
commands `xtcache rounds` prints (`$ xtcache ...`). vLLM's and DeepSpeed's start-up notices, Python
warnings and progress bars stay in the log. A stage that fails prints the last lines of its output
(from the log, whatever their source) to the console's stderr and raises `StageFailed`, so no
failure is hidden.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import typer

from xtcache.errors import XtcacheError

log = logging.getLogger(__name__)
TAIL_LINES = 40
# xtcache.app.cli's log format: "%(asctime)s %(levelname)s %(name)s: %(message)s" with datefmt %H:%M:%S
_OWN_RECORD = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) (xtcache|stage1_teacher|stage2_student)"
                         r"[\w.]*: ")
_OWN_PREFIXES = ("error: ", "$ xtcache ")


class StageFailed(XtcacheError):
    """A stage the demo ran exited with an error; its last lines were printed above the message."""


def is_console_line(line: str) -> bool:
    """Whether a line a stage wrote is xtcache's own (console) rather than an engine's (log only)."""
    return bool(_OWN_RECORD.match(line)) or line.startswith(_OWN_PREFIXES)


class StageRunner:
    """Runs `xtcache` stages as subprocesses, xtcache's lines to the console and every line to `log_path`."""

    def __init__(self, log_path: Path):
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        typer.echo(f"engine logs: {self.log_path}", err=True)

    def close(self) -> None:
        typer.echo(f"engine logs: {self.log_path}", err=True)

    def xtcache(self, *args: str) -> None:
        """Run `xtcache ARGS`; raise StageFailed (after printing its last lines) on a failed exit."""
        line = "xtcache " + shlex.join(args)
        log.info("$ %s", line)
        self.run([sys.executable, "-m", "xtcache.app.cli", *args], line)

    def run(self, cmd: list[str], name: str) -> None:
        """Run `cmd`, routing its merged output line by line (see the module docstring)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        with open(self.log_path, "a", encoding="utf-8", buffering=1) as logf:  # line-buffered: a killed demo keeps its log
            logf.write(f"\n===== $ {name}\n")
            logf.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", bufsize=1)
            try:
                for text in proc.stdout:
                    logf.write(text)
                    tail.append(text.rstrip("\n"))
                    if is_console_line(text):
                        typer.echo(text.rstrip("\n"), err=True)
                rc = proc.wait()
            finally:
                if proc.poll() is None:  # interrupted: stop the stage with the demo
                    proc.kill()
                    proc.wait()
            logf.write(f"===== exit {rc}\n")
        if rc != 0:
            typer.echo(f"--- last {len(tail)} lines of `{name}` (exit {rc}; all of it in {self.log_path}):", err=True)
            typer.echo("\n".join(tail), err=True)
            raise StageFailed(f"demo stage failed (exit {rc}): {name}; its last lines are above, the whole output "
                              f"in {self.log_path}")
