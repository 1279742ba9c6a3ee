"""Cache directories: where the cache of a cache key lives, and which stores a directory holds.

    python -c "from xtcache.store import list_caches; print(list_caches('out'))"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xtcache.errors import StoreError, XtcacheError
from xtcache.location import Location
from xtcache.store.reader import CacheReader


@dataclass
class CacheInfo:
    url: str
    key: str
    size: int
    created: str
    documents: int
    positions: int
    complete: bool
    problem: str = ""
    extra: dict = field(default_factory=dict)


def cache_path_for(cache_dir: str, cache_key: str) -> str:
    """Where the cache with `cache_key` lives under `cache_dir` (a local path or fsspec URL)."""
    return f"{cache_dir.rstrip('/')}/xtc-{cache_key[:16]}"


def find_cache(cache_dir: str, cache_key: str, storage_options: dict | None = None) -> str | None:
    """URL of the complete cache for `cache_key` under `cache_dir`, or None."""
    url = cache_path_for(cache_dir, cache_key)
    try:
        reader = CacheReader(url, storage_options)
    except StoreError:
        return None
    if reader.manifest.cache_key != cache_key or not reader.is_complete():
        return None
    return url


def list_caches(cache_dir: str, storage_options: dict | None = None) -> list[CacheInfo]:
    """Every xtcache store directly under `cache_dir`, complete or not."""
    loc = Location(cache_dir, storage_options)
    out = []
    for name in sorted(loc.listdir("")):
        url = f"{cache_dir.rstrip('/')}/{name}"
        if not loc.exists(f"{name}/manifest.json"):
            continue
        try:
            r = CacheReader(url, storage_options)
        except XtcacheError as e:
            out.append(CacheInfo(url=url, key="?", size=0, created="", documents=0, positions=0,
                                 complete=False, problem=str(e)))
            continue
        out.append(CacheInfo(url=url, key=r.manifest.cache_key, size=r.total_bytes(), created=r.manifest.created,
                             documents=sum(s.num_docs for s in r.shards),
                             positions=sum(s.num_positions for s in r.shards), complete=r.is_complete()))
    return out
