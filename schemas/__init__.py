"""The xtcache store contract: pydantic models of the store metadata and the format version.

See `schemas/STORE_FORMAT.md` for the full on-disk layout.
"""

from schemas.models import (
    FORMAT_VERSION,
    AlignGroupMeta,
    AlignPartMeta,
    ArraySpec,
    CodecConfig,
    DocId,
    Manifest,
    ShardMeta,
    WriterClaim,
    WriterDone,
)

__all__ = [
    "FORMAT_VERSION", "AlignGroupMeta", "AlignPartMeta", "ArraySpec", "CodecConfig", "DocId", "Manifest",
    "ShardMeta", "WriterClaim", "WriterDone",
]
