"""Identifiers for tasks and runs: time-ordered UUIDs (the UUIDv7 layout).

A 48-bit Unix-millisecond prefix makes ids created together sort together, so the
primary-key and foreign-key B-trees of a large table take new entries on a few hot
pages instead of random ones (fewer cache misses and full-page WAL images per
claim), and runs created in the same millisecond still tie-break by their random
tail. Python 3.11 has no ``uuid.uuid7``; this is the same layout.
"""

from __future__ import annotations

import os
import time

_MILLIS = (1 << 48) - 1
_CLEAR = ~((0xF << 76) | (0x3 << 62))
_VERSION_VARIANT = (0x7 << 76) | (0x2 << 62)  # version 7, RFC 4122 variant


def new_id() -> str:
    """A UUIDv7 text, formatted directly: half the time of building a ``uuid.UUID``
    (a submit takes two ids per run)."""
    value = ((time.time_ns() // 1_000_000 & _MILLIS) << 80
             | int.from_bytes(os.urandom(10), "big")) & _CLEAR | _VERSION_VARIANT
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
