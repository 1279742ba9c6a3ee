"""The one exception hierarchy of xtcache.

Every error a user can cause (bad input, a wrong store, mismatched tokenizers) raises a subclass of
`XtcacheError` with a message that says what went wrong and what to do about it. `assert` is kept
for internal invariants only.
"""


class XtcacheError(Exception):
    """Base class: a problem the user can fix (bad input, wrong store, mismatched artifacts)."""


class StoreError(XtcacheError):
    """The store is missing, not an xtcache store, corrupted, or written for something else."""


class FormatVersionError(StoreError):
    """The store (or one shard) was written with a format version this reader does not know."""


class CorruptionError(StoreError):
    """A checksum, count or decode check failed; the message names the shard and the array."""


class AlignmentError(XtcacheError):
    """Two tokenizations cannot be aligned exactly (untrusted offsets, mismatched text, ...)."""


class ProjectionError(XtcacheError):
    """A projection map is malformed or was built for other tokenizers."""


class ConfigError(XtcacheError):
    """Flags or config-file values that contradict each other or the cache."""


class CaptureError(XtcacheError):
    """The teacher capture failed a check (fast path vs reference mismatch, bad teacher dir, ...)."""
