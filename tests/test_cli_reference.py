"""The CLI reference (docs/cli.md) and the frozen CLI surface are the ones the typer app generates.

`docs/cli-surface.json` lists every command's arguments and flags with type, default and whether
they are required or repeatable; users' scripts depend on exactly this, so a change to it must be
deliberate: regenerate with `python -m xtcache.app.clidoc --write` and review the diff.
"""

import json

from xtcache.app import clidoc

REGENERATE = "run `python -m xtcache.app.clidoc --write` and review the diff (docs/cli.md, docs/cli-surface.json)"


def test_cli_reference_matches_the_app():
    text = clidoc.REFERENCE.read_text(encoding="utf-8")
    assert clidoc.reference_section(text) == clidoc.cli_reference_markdown(), f"docs/cli.md's CLI reference is stale: {REGENERATE}"


def test_cli_surface_is_frozen():
    frozen = json.loads(clidoc.SURFACE.read_text(encoding="utf-8"))
    now = json.loads(clidoc.cli_surface_json())
    changes = [f"{cmd} {name}: {frozen.get(cmd, {}).get(name)} -> {now.get(cmd, {}).get(name)}"
               for cmd in sorted(set(frozen) | set(now))
               for name in sorted(set(frozen.get(cmd, {})) | set(now.get(cmd, {})))
               if frozen.get(cmd, {}).get(name) != now.get(cmd, {}).get(name)]
    assert not changes, "the command-line surface changed:\n  " + "\n  ".join(changes) + f"\nIf deliberate: {REGENERATE}"


def test_every_command_is_documented():
    ref = clidoc.cli_reference_markdown()
    for cmd in ["teacher-dump", "align", "train-student", "inspect", "verify", "cache ls",
                "projection build", "projection import", "projection inspect", "demo"]:
        assert f"`xtcache {cmd}`" in ref


def test_a_command_s_whole_help_is_in_the_reference():
    ref = clidoc.cli_reference_markdown()
    verify = ref.split("#### `xtcache verify`", 1)[1].split("| option", 1)[0]
    assert "lost parts); exit 1 on a problem" in verify and "exit 2, as `inspect`." in verify  # not cut at a line end
    rounds = ref.split("#### `xtcache rounds`", 1)[1].split("| option", 1)[0]
    assert "Arguments after `--` go to every train-student command" in rounds  # its second paragraph
