"""Waiting for a record that another writer of the same store writes (writer 0's shard plan, its
first-batch check): read it every few seconds until it is there or a deadline passes.

    python -c "from stage1_teacher.polling import poll_until"   # used by shard_plan and check_records
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from xtcache.errors import CorruptionError, XtcacheError

T = TypeVar("T")


def poll_until(read: Callable[[], T | None], *, timeout_s: float, poll_s: float,
               expired: Callable[[], XtcacheError]) -> T:
    """`read()` every `poll_s` seconds until it returns something other than None; `expired()` is
    raised after `timeout_s`. A record that reads as damaged (CorruptionError) is being written: read again."""
    deadline = time.monotonic() + timeout_s
    value = None
    while value is None:
        if time.monotonic() > deadline:
            raise expired()
        time.sleep(poll_s)
        try:
            value = read()
        except CorruptionError:
            value = None
    return value
