"""Reading `--config FILE` for any xtcache command: YAML, TOML or JSON holding a mapping.

Each stage maps the keys onto its own config dataclass (keys mirror the command-line flags); this
module only parses the file and checks that it holds a mapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xtcache.errors import ConfigError


def read_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping stored in a .yaml/.yml, .toml or .json file; ConfigError naming --config otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
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
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: the file must hold a mapping of flag names to values")
    return data
