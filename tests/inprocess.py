"""`xtcache ARGS` run inside the test process, through the same entry point as the installed command
(`xtcache.cli.main`): its exit status, stdout and stderr as a shell would see them, without a new
interpreter importing torch and transformers again (about 5 s a command on 2 cores).

A test about what a real process does (its exit on SIGKILL, a launcher's environment) still starts one, and
so does train-student: DeepSpeed keeps its process groups for the life of a process.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys


def xtcache(*args) -> subprocess.CompletedProcess:
    """Run `xtcache ARGS` here; returns what `subprocess.run(..., capture_output=True, text=True)` would."""
    from xtcache.cli import main

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
