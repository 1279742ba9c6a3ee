"""One way from a config dataclass to a command line: typer options, a `--config` file, one merge.

A command's settings are one kw-only dataclass whose fields are either leaves or sections (fields
whose type is itself such a dataclass, one level deep). Every leaf has exactly one flag, its name
with dashes (`top_k` <-> `--top-k`), and a docstring (the string literal on the line after it),
which is the flag's help text. Leaf names are unique across sections, so a config file may use
flat keys (`top-k: 64`) or nested ones (`capture: {top_k: 64}`). Precedence: flags given on the
command line, then the `--config` file (YAML, TOML or JSON), then the dataclass defaults.

    train_student = command(TrainConfig, run, name="train_student", help="Train a student ...")

A leaf whose field carries `metadata={"positional": True}` is a command-line argument instead of
a flag (`xtcache align STORE`); one with `metadata={"after_dashes": True}` (a `list[str]`) takes the
arguments after `--`, which the command passes on to another one (`xtcache rounds ... -- --lr 1e-4`). Leaf types and their flags: `int`, `float`, `str` (`X | None` for
optional ones), `bool` and `bool | None` (`--x/--no-x`), `list[str]` (repeatable), `dict` (a JSON
object on the command line, read by `parse_storage_options`, a mapping in a config file). A leaf
without a default is required: given as a flag or in the file. Bad values raise ConfigError naming the flag (one line,
exit 2 from the CLI); cross-field checks stay in the dataclass's `__post_init__` and raise
ValueError naming the flag, which the command turns into ConfigError. A command names the leaves
that hold local paths (`paths={"student": "dir", "projection": "file"}`): each one given must exist
before the command reads anything, else one line naming the flag (fsspec URLs are left to their readers).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import typing
from pathlib import Path
from typing import Any, Callable, List, Optional

from xtcache.errors import ConfigError

_EXPLICIT_SOURCES = ("COMMANDLINE", "ENVIRONMENT")
STORAGE_OPTIONS_HELP = "fsspec storage options for remote stores (JSON object)."


def parse_storage_options(text: str | dict | None, flag: str = "--storage-options") -> dict | None:
    """fsspec storage options from a JSON object string (None or blank: None); ConfigError naming `flag`.

    The one parser of every `--storage-options` / `--data-storage-options` of xtcache.
    """
    if text is None or isinstance(text, dict):
        return text
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{flag}: not a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: not a JSON object ({text.strip()[:60]!r}); e.g. '{{\"anon\": true}}'")
    return value


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One flag-backed field: where it lives and what it holds."""

    name: str
    section: str | None
    type: Any  # the resolved annotation
    default: Any  # dataclasses.MISSING when required
    help: str
    positional: bool = False  # a command-line argument (field metadata {"positional": True}), not a flag
    after_dashes: bool = False  # takes the arguments after `--` (field metadata {"after_dashes": True})

    @property
    def flag(self) -> str:
        return self.name.upper() if self.positional else "--" + self.name.replace("_", "-")

    @property
    def base(self) -> Any:
        """The type without `| None`."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        return args[0] if typing.get_origin(self.type) in (typing.Union, _UnionType) and len(args) == 1 else self.type

    @property
    def nullable(self) -> bool:
        return type(None) in typing.get_args(self.type)


try:
    from types import UnionType as _UnionType
except ImportError:  # pragma: no cover
    _UnionType = typing.Union


@functools.lru_cache(maxsize=None)
def _docstrings(cls: type) -> dict[str, str]:
    """Field name -> its docstring (whitespace folded to one line), from the class source (parsed once a class:
    every config built and every path check reads it; callers only read the dict)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    return {a.target.id: " ".join(b.value.value.split()) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def sections(cls: type) -> dict[str, type]:
    """Section name -> its dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}


def leaf_fields(cls: type) -> dict[str, Leaf]:
    """Every flag-backed field of `cls`, in declaration order (top-level ones and each section's)."""
    out: dict[str, Leaf] = {}
    secs = sections(cls)
    for owner, section in [(cls, None), *((t, name) for name, t in secs.items())]:
        hints, docs = typing.get_type_hints(owner), _docstrings(owner)
        for f in dataclasses.fields(owner):
            if section is None and f.name in secs:
                continue
            if f.name in out:
                raise TypeError(f"{cls.__name__}: field {f.name} defined twice (flag names must be unique)")
            if f.name not in docs:
                raise TypeError(f"{owner.__name__}.{f.name}: give the field a docstring (it is the flag's help)")
            out[f.name] = Leaf(f.name, section, hints[f.name], _default(f), docs[f.name],
                               positional=bool(f.metadata.get("positional")),
                               after_dashes=bool(f.metadata.get("after_dashes")))
    return out


def _check(leaf: Leaf, value: Any) -> Any:
    """`value` as the leaf's type (a file gives `top_k: "8"` or `data: one.jsonl`); ConfigError otherwise."""
    if value is None:
        if leaf.nullable:
            return None
        raise ConfigError(f"{leaf.flag}: give a value (null is not one)")
    base, origin = leaf.base, typing.get_origin(leaf.base)
    if base is bool or origin is None and base in (int, float, str):
        ok = isinstance(value, base) and not (base is int and isinstance(value, bool))
        if base is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ConfigError(f"{leaf.flag} {value!r}: expected {base.__name__}")
        return value
    if origin is list:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{leaf.flag} {value!r}: expected a list of strings")
        return list(value)
    if base is dict or origin is dict:
        parsed = parse_storage_options(value, leaf.flag) if isinstance(value, str) else value
        if parsed is None:  # a blank string: the default
            return leaf.default if leaf.default is not dataclasses.MISSING else None
        if not isinstance(parsed, dict):
            raise ConfigError(f"{leaf.flag}: not a JSON object ({value!r})")
        return parsed
    return value


def flatten(cls: type, data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Nested sections to flat field names (`{"capture": {"top-k": 8}}` -> `{"top_k": 8}`).

    A section name whose value is not a mapping is the leaf of that name (`teacher: /models/t`
    is --teacher, `loss: pkl` is --loss). Unknown keys raise ConfigError naming `where`.
    """
    leaves, secs = leaf_fields(cls), sections(cls)
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in secs and isinstance(value, dict):
            for sub, v in value.items():
                sname = str(sub).replace("-", "_")
                if sname not in leaves or leaves[sname].section != name:
                    raise ConfigError(f"{where}unknown key {key}.{sub} (keys mirror the command-line flags)")
                flat[sname] = v
        elif name in leaves:
            flat[name] = value
        elif isinstance(value, dict):
            raise ConfigError(f"{where}unknown section {key!r}: the sections are {', '.join(secs)} (keys mirror "
                              "the command-line flags, flat or under these sections)")
        else:
            raise ConfigError(f"{where}unknown key {key!r} (keys mirror the command-line flags)")
    return flat


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping stored in a .yaml/.yml, .toml or .json file; ConfigError naming --config otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"--config {path}: use a .yaml, .yml, .toml or .json file")
    except ConfigError:
        raise
    except Exception as e:  # the parsers' own errors: one line naming the file
        raise ConfigError(f"--config {path}: not valid {suffix[1:].upper()} ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of flag names to values")
    return data


def read_config_file(cls: type, path: str | Path) -> dict[str, Any]:
    """Flat {field: value} of a `--config` file for `cls` (flat or sectioned keys, '-' or '_'); a key or
    value that is wrong raises ConfigError naming the file."""
    flat = flatten(cls, read_mapping(path), where=f"--config {path}: ")
    leaves = leaf_fields(cls)
    for name, value in flat.items():
        if value is None and not leaves[name].nullable:  # as from_flat: not given
            continue
        try:
            _check(leaves[name], value)
        except ConfigError as e:
            raise ConfigError(f"--config {path}: {e}") from None
    return flat


def from_flat(cls: type, values: dict[str, Any]):
    """An instance of `cls` from flat {field: value} (dashes allowed); absent fields keep their defaults.

    None for a field whose default is not None means "not given". Unknown keys raise ValueError;
    a required field left out raises ConfigError naming its flag.
    """
    leaves = leaf_fields(cls)
    top: dict[str, Any] = {}
    by_section: dict[str, dict[str, Any]] = {name: {} for name in sections(cls)}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in leaves:
            raise ValueError(f"unknown setting {key!r}: see the command's --help")
        leaf = leaves[name]
        if value is None and not leaf.nullable:
            continue
        (by_section[leaf.section] if leaf.section else top)[name] = _check(leaf, value)
    missing = [leaf.flag for leaf in leaves.values() if leaf.default is dataclasses.MISSING
               and leaf.name not in (by_section[leaf.section] if leaf.section else top)]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}: give them as flags or in the --config file")
    return cls(**top, **{name: t(**by_section[name]) for name, t in sections(cls).items()})


PATH_KINDS = ("dir", "file")


def require_path(flag: str, path: str, kind: str = "dir") -> None:
    """A local `path` given as `flag` is an existing directory (`kind` "dir") or file ("file");
    ConfigError naming the flag otherwise (`--student art/studnet: no such directory`). fsspec URLs
    are left to their readers, which name what is missing."""
    import os

    if "://" in str(path):
        return
    if kind == "dir" and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: {'not a directory' if os.path.exists(path) else 'no such directory'}")
    if kind == "file" and not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: {'not a file' if os.path.exists(path) else 'no such file'}")


def check_paths(cfg: Any, paths: dict[str, str], *, only: Callable[[str], bool] | None = None) -> None:
    """`require_path` on each path given for a leaf of `paths` (leaf name -> "dir" or "file"), or on those of
    them `only` accepts."""
    leaves = leaf_fields(type(cfg))
    for name, kind in paths.items():
        leaf = leaves[name]
        value = getattr(getattr(cfg, leaf.section) if leaf.section else cfg, name)
        for path in [] if value is None else value if isinstance(value, list) else [value]:
            if only is None or only(path):
                require_path(leaf.flag, path, kind)


def _option(leaf: Leaf, panel: str | None):
    """(annotation, typer.Option) of one leaf."""
    import typer

    base, origin = leaf.base, typing.get_origin(leaf.base)
    default = None if leaf.default is dataclasses.MISSING else leaf.default
    if leaf.positional:  # optional on the command line: a --config file may give it instead
        return Optional[base], typer.Argument(default, metavar=leaf.flag, help=leaf.help, show_default=False)
    decls = [leaf.flag]
    if base is bool:
        decls = [f"{leaf.flag}/--no-{leaf.flag[2:]}"]
        annotation = Optional[bool] if leaf.nullable else bool
    elif origin is list:
        annotation, default = Optional[List[str]], None
    elif base is dict or origin is dict:
        annotation, default = Optional[str], None
    else:
        annotation = Optional[base] if default is None else base
    return annotation, typer.Option(default, *decls, help=leaf.help, rich_help_panel=panel)


def command(cls: type, run: Callable[[Any], None], *, name: str, help: str,
            panels: dict[str | None, str] | None = None, on_error: tuple[type[Exception], ...] = (),
            paths: dict[str, str] | None = None) -> Callable:
    """A typer command callable: `--config FILE` plus one option per leaf of `cls`; calls `run(cfg)`.

    `panels` maps a section name (None: the top-level fields) to its `--help` panel title.
    ValueError and TypeError raised while building the config (the dataclass's checks) become
    ConfigError, as do the exception types in `on_error`. `paths` maps the leaves holding local
    paths to "dir" or "file": `check_paths` runs on them before `run(cfg)`.
    """
    import typer

    panels, paths = panels or {}, paths or {}
    leaves = leaf_fields(cls)
    for leaf_name, kind in paths.items():
        if leaf_name not in leaves or kind not in PATH_KINDS:
            raise TypeError(f"{cls.__name__}: paths[{leaf_name!r}] = {kind!r}: a leaf name and one of {PATH_KINDS}")
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
              inspect.Parameter("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[str],
                                default=typer.Option(None, "--config", rich_help_panel=panels.get(None),
                                                     help="YAML/TOML/JSON file of settings (keys as the flags, "
                                                          "flat or by section); flags given here win."))]
    for leaf in leaves.values():
        if leaf.after_dashes:
            continue
        annotation, option = _option(leaf, panels.get(leaf.section))
        params.append(inspect.Parameter(leaf.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        annotation=annotation, default=option))

    def build(ctx: typer.Context, config: Optional[str] = None, **given: Any) -> Any:
        values = read_config_file(cls, config) if config else {}
        for key, value in given.items():
            source = getattr(ctx.get_parameter_source(key), "name", "")  # typer may ship its own click enum
            if source in _EXPLICIT_SOURCES:
                values[key] = value
        values.update({leaf.name: list(ctx.args) for leaf in leaves.values() if leaf.after_dashes and ctx.args})
        try:
            return from_flat(cls, values)
        except (ValueError, TypeError, *on_error) as err:
            raise ConfigError(str(err)) from None

    def callback(ctx: typer.Context, config: Optional[str] = None, **given: Any) -> None:
        cfg = build(ctx, config, **given)
        check_paths(cfg, paths)
        run(cfg)

    callback.__name__ = callback.__qualname__ = name
    callback.__doc__ = help
    callback.required = [leaf.name for leaf in leaves.values() if leaf.default is dataclasses.MISSING]  # for clidoc
    callback.config_class = cls  # tests/test_doc_commands.py builds the documented commands' configs
    callback.build, callback.paths = build, paths  # config_of: the config of a command line, not run
    # a command whose config takes the arguments after `--` lets click pass them on (ctx.args), unparsed
    callback.context_settings = {"allow_extra_args": True, "ignore_unknown_options": True} \
        if any(leaf.after_dashes for leaf in leaves.values()) else {}
    callback.__signature__ = inspect.Signature(params)
    callback.__annotations__ = {p.name: p.annotation for p in params}
    return callback


@functools.lru_cache(maxsize=None)
def _click_command(cmd: Callable):
    """The click command typer makes of `cmd` (built once: `xtcache rounds` parses three a round)."""
    import typer

    app = typer.Typer()
    app.command(context_settings=cmd.context_settings)(cmd)
    return typer.main.get_command(app)


def config_of(cmd: Callable, argv: list[str]) -> tuple[Any, dict[str, str]]:
    """(config, its path leaves) that `cmd`, a `command(...)` callable, would build from `argv`, without running
    it or checking its paths; ConfigError naming the flag for an unknown flag, a value of the wrong type or one
    the config's checks refuse."""
    try:
        ctx = _click_command(cmd).make_context(cmd.__name__, list(argv))
    except Exception as err:  # click's usage errors (typer may ship its own click): the message names the flag
        if not hasattr(err, "format_message"):
            raise
        raise ConfigError(err.format_message()) from None
    return cmd.build(ctx, **ctx.params), cmd.paths
