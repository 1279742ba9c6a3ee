"""`python -m stage2_student`: the train-student command for launchers that start modules.

    torchrun --standalone --nproc_per_node 2 -m stage2_student --cache CACHE --student DIR --out RUN
    deepspeed --num_gpus 8 --module stage2_student --cache CACHE --student DIR --out RUN

Takes exactly the flags of `xtcache train-student`. The `deepspeed` launcher adds
`--local_rank=N` before the flags; it also sets LOCAL_RANK in the environment, which is what the
trainer reads, so the argument is dropped here.
"""

from __future__ import annotations

import logging
import re
import sys

import click
import typer

from stage2_student.cli import train_student
from xtcache.errors import XtcacheError


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    args = [a for i, a in enumerate(args)
            if not re.fullmatch(r"--local[_-]rank(=\d+)?", a)
            and not (i > 0 and re.fullmatch(r"--local[_-]rank", args[i - 1]) and a.isdigit())]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(train_student)
    try:
        app(args, prog_name="python -m stage2_student", standalone_mode=False)
    except XtcacheError as err:
        typer.echo(f"error: {err}", err=True)
        raise SystemExit(2) from None
    except click.ClickException as err:
        err.show()
        raise SystemExit(err.exit_code) from None


if __name__ == "__main__":
    main()
