"""Idempotent external side effects through the ledger (invariant 8).

Every effect has a deterministic identity (``key``). Before acting, the intent is
recorded with the lease's fencing token (refused if the lease is gone or the run is
being cancelled), with what is about to be done (``intent``: the push's commit); then
the effect's marker is looked up outside (``find``) and adopted if present; only
then, the lease and cancellation checked again (a cancel during the lookup opened a
pull request after it), is it performed (``do``); the result is recorded last. A
finalizer that dies anywhere in between is retried by a new attempt that finds either
the DONE row or the marker, and never acts twice.

A call once begun cannot be taken back: a worker paused inside it (SIGSTOP, a VM
pause) finishes it when resumed, after its lease is gone, and the ledger refuses the
result (LeaseLost). It is recorded anyway, as late evidence
(``Store.record_late_effect``): what the code host holds is never left unrecorded
by a worker that lived to see it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import structlog
from sqlalchemy.exc import DBAPIError

from runlane.errors import LeaseLost
from runlane.faults import crash_point
from runlane.observability import metrics
from runlane.store.records import Lease
from runlane.store.store import Store

log = structlog.get_logger("runlane.worker")

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
        metrics.side_effect(key, "already_done")
        return recorded.result
    found = find()
    if found is None:  # about to act: a cancel or a lost lease since the intent stops it
        (check or (lambda: store.check_lease(lease)))()
    try:
        result = found if found is not None else do()
    except Exception:
        metrics.side_effect(key, "failed")
        raise
    if found is not None:
        result = {**found, "adopted": True}
    crash_point(f"after_effect:{key}")  # done outside, not yet recorded (drill 4)
    try:
        store.effect_done(lease, key, result)
    except LeaseLost:
        metrics.side_effect(key, "late")
        _record_late(store, lease, key, result)
        raise
    metrics.side_effect(key, "adopted" if found is not None else "performed")
    return result


def _record_late(store: Store, lease: Lease, key: str, result: EffectResult) -> None:
    """The effect was made, its lease is gone: late evidence, without changing any
    state. A database that cannot take it leaves the effect to the audit
    (``runlane audit --remote-checks``); the attempt stops on LeaseLost either way."""
    try:
        store.record_late_effect(lease, key, result)
    except DBAPIError as exc:
        log.error("late_effect_not_recorded", run_id=lease.run_id, effect=key,
                  fencing_token=lease.fencing_token, result=result,
                  error=str(exc.orig or exc).strip().splitlines()[0][:300])
