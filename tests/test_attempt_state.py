"""The attempt's local lease deadline: a heartbeat stuck on a silent network must not
keep an attempt running past the lease the database already considers expired."""

from __future__ import annotations

import time
from typing import Any

from runlane.agents.base import StopReason
from runlane.worker.attempt import AttemptState


def test_local_deadline_stops_the_attempt_without_any_heartbeat_answer() -> None:
    state = AttemptState(lease=Any, store=Any)  # type: ignore[arg-type]
    assert state.stop_reason() is None  # no deadline yet
    state.extended(time.monotonic(), ttl=60)
    assert state.stop_reason() is None
    state.extended(time.monotonic() - 59, ttl=60)  # sent 59 s ago: inside the margin
    assert state.stop_reason() is StopReason.LEASE_LOST
    assert state.lost.is_set()


def test_cancel_and_drain_signals() -> None:
    state = AttemptState(lease=Any, store=Any)  # type: ignore[arg-type]
    state.drain.set()
    assert state.stop_reason() is StopReason.DRAINING
    state.cancel.set()
    assert state.stop_reason() is StopReason.CANCELLED
