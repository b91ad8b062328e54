"""Idempotent external side effects through the ledger (invariant 8).

Every effect has a deterministic identity (``key``). Before acting, the intent is
recorded with the lease's fencing token (refused if the lease is gone or the run is
being cancelled), with what is about to be done (``intent``: the push's commit); then
the effect's marker is looked up outside (``find``) and adopted if present; only
then, the lease and cancellation checked again (a cancel during the lookup opened a
pull request after it), is it performed (``do``); the result is recorded last. A
finalizer that dies anywhere in between is retried by a new attempt that finds either
the DONE row or the marker, and never acts twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from runlane.faults import crash_point
from runlane.store.store import Lease, Store

EffectResult = dict[str, Any]


class LeaseWindow(Protocol):
    """What the finalizer asks right before every call that touches the world (a push,
    a pull request): no call may be made after the lease is lost, nor outlive it.
    ``AttemptState`` is the one implementation."""

    def open_window(self) -> float:
        """Check the lease in the database and the local deadline, now; the
        ``time.monotonic()`` by which a call made now must be over. Raises when the
        lease is lost, the run is being cancelled or the attempt must stop."""
        ...

    def time_left(self, deadline: float) -> float:
        """Seconds until ``deadline``, taken right before the call starts: raises when
        it has passed (the worker was paused since ``open_window``)."""
        ...


def perform_effect(store: Store, lease: Lease, key: str, *,
                   find: Callable[[], EffectResult | None],
                   do: Callable[[], EffectResult],
                   intent: dict[str, Any] | None = None,
                   check: Callable[[], object] | None = None) -> EffectResult:
    """``check`` replaces the lease check between ``find`` and ``do`` (the finalizer's
    ``do`` makes its own, right before its call)."""
    recorded = store.effect_intent(lease, key, intent=intent)
    if recorded.status == "DONE" and recorded.result is not None:
        return recorded.result
    found = find()
    if found is None:  # about to act: a cancel or a lost lease since the intent stops it
        (check or (lambda: store.check_lease(lease)))()
    result = found if found is not None else do()
    if found is not None:
        result = {**found, "adopted": True}
    crash_point(f"after_effect:{key}")  # done outside, not yet recorded (drill 4)
    store.effect_done(lease, key, result)
    return result
