"""The README's CLI reference is the one the typer app generates (it cannot drift)."""

from xtcache import clidoc


def test_readme_cli_reference_matches_the_app():
    text = clidoc.README.read_text(encoding="utf-8")
    assert clidoc.readme_section(text) == clidoc.cli_reference_markdown(), (
        "README.md's CLI reference is stale: run `python -m xtcache.clidoc --write`"
    )


def test_every_command_is_documented():
    ref = clidoc.cli_reference_markdown()
    for cmd in ["teacher-dump", "align", "train-student", "inspect", "verify", "cache ls",
                "projection build", "projection import", "projection inspect", "demo"]:
        assert f"`xtcache {cmd}`" in ref
