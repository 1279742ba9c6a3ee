"""The `xtcache` command line: the app layer, composed from the commands of each part.

    xtcache --help

Layers (enforced by import-linter, see `[tool.importlinter]` in pyproject.toml and
docs/architecture.md): `schemas` <- the `xtcache` core <- `stage1_teacher`, `stage2_student` <-
the test scaffolding <- this app and the demo. The core never imports a stage; this module is the
one place that names the stages' commands. Every command imports its heavy dependencies (vLLM,
DeepSpeed, torch, zarr) inside its function, so `xtcache --help` and `xtcache inspect` start fast.
"""

from __future__ import annotations

import logging

import click
import typer
from typer.core import TyperGroup

from stage1_teacher import cli as stage1_cli
from stage2_student import cli as stage2_cli
from xtcache.app import projection_commands, rounds, store_commands
from xtcache.app.demo.command import demo
from xtcache.errors import XtcacheError


class _SortedGroup(TyperGroup):
    """The root group: its commands in alphabetical order, whichever part defines them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(super().list_commands(ctx))


app = typer.Typer(
    name="xtcache",
    cls=_SortedGroup,
    help="Offline, reusable, cross-tokenizer teacher caches for knowledge distillation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Caches found under a cache directory.", no_args_is_help=True)

app.command("teacher-dump")(stage1_cli.teacher_dump)
app.command("align")(stage1_cli.align)
app.command("generate")(stage1_cli.generate)
app.command("policy-eval")(stage1_cli.policy_eval)
app.command("train-student")(stage2_cli.train_student)
app.command("inspect")(store_commands.inspect)
app.command("verify")(store_commands.verify)
cache_app.command("ls")(store_commands.cache_ls)
app.add_typer(cache_app, name="cache")
app.add_typer(projection_commands.app, name="projection")
app.command("demo")(demo)
app.command("rounds", context_settings=rounds.rounds.context_settings)(rounds.rounds)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def main() -> None:
    """Entry point: usage errors are printed by click; an XtcacheError becomes one line and exit 2."""
    try:
        app()
    except XtcacheError as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
