"""Clocks. The store passes ``clock.now()`` into every statement as ``:now``.

``DatabaseClock`` answers ``None``, which makes the SQL fall back to the
database's own clock: with workers on many hosts, every expiry is judged by
one clock. Tests use ``ManualClock`` to pin and advance time without sleeping.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float | None: ...


class DatabaseClock:
    def now(self) -> float | None:
        return None


class ManualClock:
    """A pinned clock that only moves when told to (thread-safe)."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self._now += seconds
            return self._now

    def set(self, value: float) -> None:
        with self._lock:
            self._now = value
