"""The `xtcache` command line: one typer app composed from the commands of each part.

    xtcache --help

Each command lives beside the code it drives (store, projection, stage 1, stage 2, demo) and
imports its heavy dependencies (vLLM, DeepSpeed, torch) inside the function, so `xtcache --help`
and `xtcache inspect` start fast.
"""

from __future__ import annotations

import logging

import typer

from stage1_teacher import cli as stage1_cli
from stage2_student import cli as stage2_cli
from xtcache import commands_projection, commands_store, demo

app = typer.Typer(
    name="xtcache",
    help="Offline, reusable, cross-tokenizer teacher caches for knowledge distillation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Caches found under a cache directory.", no_args_is_help=True)

app.command("teacher-dump")(stage1_cli.teacher_dump)
app.command("align")(stage1_cli.align)
app.command("train-student")(stage2_cli.train_student)
app.command("inspect")(commands_store.inspect)
app.command("verify")(commands_store.verify)
cache_app.command("ls")(commands_store.cache_ls)
app.add_typer(cache_app, name="cache")
app.add_typer(commands_projection.app, name="projection")
app.command("demo")(demo.demo)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def main() -> None:
    """Entry point: usage errors are printed by click; an XtcacheError becomes one line and exit 2."""
    from xtcache.errors import XtcacheError

    try:
        app()
    except XtcacheError as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
