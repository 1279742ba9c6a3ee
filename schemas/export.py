"""Export the JSON Schema of every store metadata model to schemas/<name>.schema.json.

    python -m schemas.export          # rewrite the files
    python -m schemas.export --check  # exit 1 if a committed file differs from a fresh export
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from schemas.models import EXPORTED_MODELS, FORMAT_VERSION

HERE = Path(__file__).resolve().parent


def render() -> dict[str, str]:
    """File name -> JSON text of each model's schema (stable: sorted keys, trailing newline)."""
    out = {}
    for name, model in EXPORTED_MODELS.items():
        schema = model.model_json_schema()
        schema["$id"] = f"xtcache/store/v{FORMAT_VERSION}/{name}.schema.json"
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[f"{name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return out


def main(argv: list[str]) -> int:
    files = render()
    if "--check" in argv:
        stale = [n for n, text in files.items()
                 if not (HERE / n).is_file() or (HERE / n).read_text(encoding="utf-8") != text]
        if stale:
            print(f"stale JSON Schema files: {', '.join(stale)}; run `python -m schemas.export`")
            return 1
        return 0
    for name, text in files.items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"wrote schemas/{name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
