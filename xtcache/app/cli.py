"""The `xtcache` command line: the app layer, composed from the commands of each part.

    xtcache --help

Layers (enforced by import-linter, see `[tool.importlinter]` in pyproject.toml and
docs/architecture.md): `schemas` <- the `xtcache` core <- `stage1_teacher`, `stage2_student` <-
this app and the demo. The core never imports a stage; this module is the one place that names
the stages' commands, and it imports a stage only inside `_stage_command`, when that command is
listed or run. Every command imports its heavy dependencies (vLLM, DeepSpeed, torch) inside its
function, so `xtcache --help` and `xtcache inspect` start fast.
"""

from __future__ import annotations

import logging

import click
import typer
from typer.core import TyperGroup

from xtcache.app import projection_commands, rounds, store_commands
from xtcache.app.demo.command import demo


def _stage_command(name: str) -> click.Command:
    """The click command `name` of a stage, built from the stage's own typer function."""
    if name in ("teacher-dump", "align", "generate", "policy-eval"):
        from stage1_teacher import cli as stage1_cli

        fn = {"teacher-dump": stage1_cli.teacher_dump, "align": stage1_cli.align, "generate": stage1_cli.generate,
              "policy-eval": stage1_cli.policy_eval}[name]
    else:
        from stage2_student import cli as stage2_cli

        fn = stage2_cli.train_student
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command(name)(fn)
    return typer.main.get_command(one)


STAGE_COMMANDS = ("teacher-dump", "align", "generate", "policy-eval", "train-student")


class _AppGroup(TyperGroup):
    """The root group: its own commands plus the stages' commands, loaded when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *STAGE_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in STAGE_COMMANDS:
            return _stage_command(name)
        return super().get_command(ctx, name)


app = typer.Typer(
    name="xtcache",
    cls=_AppGroup,
    help="Offline, reusable, cross-tokenizer teacher caches for knowledge distillation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="Caches found under a cache directory.", no_args_is_help=True)

app.command("inspect")(store_commands.inspect)
app.command("verify")(store_commands.verify)
cache_app.command("ls")(store_commands.cache_ls)
app.add_typer(cache_app, name="cache")
app.add_typer(projection_commands.app, name="projection")
app.command("demo")(demo)
app.command("rounds", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    rounds.rounds)


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
