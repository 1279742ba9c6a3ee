"""Split a test's CacheDataset keyword arguments into the LoaderConfig it takes and the rest."""

from __future__ import annotations

import dataclasses

from stage2_student.config import LoaderConfig

FIELDS = {f.name for f in dataclasses.fields(LoaderConfig)}


def loader_settings(args: dict) -> tuple[LoaderConfig]:
    """(LoaderConfig of the loader fields in `args`,), removing them from `args` (the rest are CacheDataset's)."""
    return (LoaderConfig(**{k: args.pop(k) for k in list(args) if k in FIELDS}),)
