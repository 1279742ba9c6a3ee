"""The teacher-cache store: a Zarr v3 hierarchy on any fsspec URL, written by independent writers.

Split along the store contract (`schemas/STORE_FORMAT.md`):

- `records.py`: what a part holds (DocRecord, AlignmentRecord, ShardData, AlignShardData);
- the arrays: their table is `schemas/arrays.py`; `arrays.py` encodes them and reads them back, checked;
- `writer.py`: `CacheWriter`, one per writer process, commit protocol;
- `reader.py`: `CacheReader`, the one read path of verify, inspect, align and the stage-2 loader;
- `caches.py`: cache directories (`find_cache`, `list_caches`).

    python -c "from xtcache.store import CacheReader; r = CacheReader('out/cache'); print(r.shards)"
"""

from schemas.models import (
    FORMAT_VERSION,
    AlignGroupMeta,
    AlignPartMeta,
    ArraySpec,
    CodecConfig,
    Manifest,
    ShardMeta,
)
from xtcache.store.caches import CacheInfo, cache_path_for, find_cache, list_caches
from xtcache.store.reader import CacheReader
from xtcache.store.records import AlignmentRecord, AlignShardData, DocRecord, ShardData
from xtcache.store.writer import CacheWriter, chunk_shape_counts, shard_id

__all__ = [
    "FORMAT_VERSION", "AlignGroupMeta", "AlignPartMeta", "AlignShardData", "AlignmentRecord", "ArraySpec",
    "CacheInfo", "CacheReader", "CacheWriter", "CodecConfig", "DocRecord", "Manifest", "ShardData", "ShardMeta",
    "cache_path_for", "chunk_shape_counts", "find_cache", "list_caches", "shard_id",
]
