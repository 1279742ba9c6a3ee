"""`xtcache.cliconfig`: one config dataclass -> typer options + `--config` file, for every command.

    pytest -q tests/test_cliconfig.py
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from stage1_teacher.config import AlignConfig, TeacherDumpConfig
from stage2_student.config import TrainConfig
from xtcache.cliconfig import command, from_flat, leaf_fields, parse_storage_options, read_config_file
from xtcache.errors import ConfigError


@dataclass(kw_only=True)
class Inner:
    top_k: int = 64
    """Ids kept per position."""
    ratio: float = 0.5
    """A fraction."""
    fast: bool = True
    """Go fast."""
    opts: dict[str, Any] | None = None
    """fsspec options."""


@dataclass(kw_only=True)
class Outer:
    name: str
    """Required name."""
    files: list[str] = field(default_factory=list)
    """Input files (repeatable)."""
    cap: Inner = field(default_factory=Inner)

    def __post_init__(self):
        if self.cap.top_k < 1:
            raise ValueError(f"--top-k {self.cap.top_k}: must be at least 1")


def _invoke(args: list[str]):
    seen = {}
    app = typer.Typer()
    app.command()(command(Outer, lambda cfg: seen.update(cfg=cfg), name="toy", help="A toy command."))
    result = CliRunner().invoke(app, args)
    return result, seen.get("cfg")


def test_options_are_made_from_the_fields():
    params = {p.name: p for p in typer.main.get_command(
        _app(command(Outer, print, name="toy", help="h"))).params}
    assert set(params) == {"config", "name", "files", "top_k", "ratio", "fast", "opts"}
    assert params["top_k"].opts == ["--top-k"] and params["top_k"].default == 64
    assert params["top_k"].help == "Ids kept per position."
    assert params["fast"].secondary_opts == ["--no-fast"] and params["fast"].default is True
    assert params["files"].multiple


def _app(fn):
    app = typer.Typer(add_completion=False)
    app.command()(fn)
    return app


@pytest.mark.parametrize("cls, fn", [(TeacherDumpConfig, "stage1_teacher.cli:teacher_dump"),
                                     (AlignConfig, "stage1_teacher.cli:align"),
                                     (TrainConfig, "stage2_student.cli:train_student")])
def test_every_field_of_both_stages_is_one_flag_with_its_docstring_as_help(cls, fn):
    import importlib

    module, name = fn.split(":")
    callback = getattr(importlib.import_module(module), name)
    assert callback.__name__ == name
    params = {p.name: p for p in typer.main.get_command(_app(callback)).params}
    leaves = leaf_fields(cls)
    assert set(params) - {"config"} == set(leaves)
    for leaf in leaves.values():
        p = params[leaf.name]
        if leaf.positional:  # `xtcache align STORE`: an argument, documented like a flag
            assert p.param_type_name == "argument" and p.metavar == leaf.flag and p.help == leaf.help, leaf.name
            continue
        assert p.opts == [leaf.flag] and p.help == leaf.help and leaf.help, leaf.name
        if leaf.default is not dataclasses.MISSING and not isinstance(leaf.default, (list, dict)):
            assert p.default == leaf.default, leaf.name


def test_a_field_without_docstring_is_refused():
    @dataclass(kw_only=True)
    class Bad:
        x: int = 1

    with pytest.raises(TypeError, match="docstring"):
        leaf_fields(Bad)


@pytest.mark.parametrize("suffix, text", [
    (".yaml", "name: from-file\ncap: {top_k: 8, ratio: 0.25}\nfiles: one.txt\n"),
    (".toml", 'name = "from-file"\nfiles = ["one.txt"]\n[cap]\ntop-k = 8\nratio = 0.25\n'),
    (".json", json.dumps({"name": "from-file", "top-k": 8, "ratio": 0.25, "files": ["one.txt"]})),
])
def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    result, cfg = _invoke(["--config", str(path), "--top-k", "3", "--no-fast"])
    assert result.exit_code == 0, result.output
    assert (cfg.name, cfg.files, cfg.cap.top_k, cfg.cap.ratio, cfg.cap.fast) == ("from-file", ["one.txt"], 3, 0.25, False)
    result, cfg = _invoke(["--config", str(path)])
    assert (cfg.cap.top_k, cfg.cap.fast, cfg.cap.opts) == (8, True, None)


@pytest.mark.parametrize("text, message", [
    ("name: n\ntop_k: eight\n", "--top-k 'eight': expected int"),
    ("name: n\ncap: {topk: 8}\n", "unknown key cap.topk"),
    ("name: n\nwidth: 8\n", "unknown key 'width'"),
    ("name: n\nopts: '[1]'\n", "--opts: not a JSON object"),
    ("name: n\ntop_k: 0\n", "--top-k 0: must be at least 1"),
    ("top_k: 8\n", "missing --name"),
    ("- a list\n", "must hold a mapping"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_bad_settings_are_one_config_error_naming_the_flag(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    result, cfg = _invoke(["--config", str(path)])
    assert cfg is None and isinstance(result.exception, ConfigError)
    assert message in str(result.exception) and "\n" not in str(result.exception)


def test_storage_options_parser():
    assert parse_storage_options('{"anon": true}') == {"anon": True}
    assert parse_storage_options(None) is None and parse_storage_options("  ") is None
    for bad in ("[1]", "{anon: true}", '"s"'):
        with pytest.raises(ConfigError, match=r"^--data-storage-options: not a JSON object \("):
            parse_storage_options(bad, "--data-storage-options")


def test_dict_fields_take_json_on_the_command_line_and_mappings_in_files(tmp_path):
    result, cfg = _invoke(["--name", "n", "--opts", '{"anon": true}'])
    assert result.exit_code == 0 and cfg.cap.opts == {"anon": True}
    assert from_flat(Outer, {"name": "n", "opts": {"token": "x"}}).cap.opts == {"token": "x"}
    assert read_config_file(Outer, _write(tmp_path / "c.yaml", "cap: {opts: {a: 1}}\n")) == {"opts": {"a": 1}}


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("argv", [
    ["inspect", "STORE", "--storage-options", "[1]"],
    ["verify", "STORE", "--storage-options", "{bad"],
    ["cache", "ls", "--cache-dir", "D", "--storage-options", "[1]"],
    ["align", "STORE", "--student-tokenizer", "S", "--storage-options", "[1]"],
    ["teacher-dump", "--teacher", "T", "--student-tokenizer", "S", "--data", "d.jsonl", "--out", "o",
     "--storage-options", "[1]"],
    ["train-student", "--cache", "C", "--student", "S", "--out", "O", "--storage-options", "[1]"],
])
def test_every_storage_options_flag_fails_with_the_same_one_line_error(argv):
    r = subprocess.run([sys.executable, "-m", "xtcache.app.cli", *argv], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: --storage-options: not a JSON object (") and r.stderr.count("\n") == 1, r.stderr


def test_a_positional_field_comes_from_the_command_line_or_the_file(tmp_path):
    @dataclass(kw_only=True)
    class WithArg:
        store: str = field(metadata={"positional": True})
        """A store."""
        top_k: int = 8
        """Ids kept."""

    seen = {}
    app = _app(command(WithArg, lambda cfg: seen.update(cfg=cfg), name="toy", help="h"))
    r = CliRunner().invoke(app, ["s3://bucket/store", "--top-k", "4"])
    assert r.exit_code == 0, r.output
    assert seen.pop("cfg") == WithArg(store="s3://bucket/store", top_k=4)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("store: /data/store\n")
    r = CliRunner().invoke(app, ["--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert seen.pop("cfg") == WithArg(store="/data/store")
    r = CliRunner().invoke(app, ["/cli/store", "--config", str(cfg)])  # the command line wins
    assert seen.pop("cfg").store == "/cli/store"
    r = CliRunner().invoke(app, [])
    assert r.exit_code != 0 and "missing STORE" in str(r.exception), r.output
