"""Run states and the one table of allowed transitions.

Every status write in the store derives its compare-and-set guard from
``TRANSITIONS``: a write to state X only matches rows whose current status is
in ``sources_of(X)``. Adding a transition here is the only way to make a new
status change possible.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from enum import StrEnum


class RunStatus(StrEnum):
    ADMITTED = "ADMITTED"
    # Held for a person's approval (a policy approval gate): no lane, no slot, no claim.
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    WAITING_CAPACITY = "WAITING_CAPACITY"
    QUEUED = "QUEUED"
    CLAIMED = "CLAIMED"
    PREPARING_SANDBOX = "PREPARING_SANDBOX"
    RUNNING = "RUNNING"
    VERIFYING = "VERIFYING"
    JUDGING = "JUDGING"
    FINALIZING = "FINALIZING"
    SUCCEEDED = "SUCCEEDED"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED = "FAILED"
    POLICY_DENIED = "POLICY_DENIED"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    CANCELLING = "CANCELLING"
    CANCELLED = "CANCELLED"
    STALE_LEASE = "STALE_LEASE"


S = RunStatus

TERMINAL: frozenset[RunStatus] = frozenset({S.SUCCEEDED, S.FAILED, S.POLICY_DENIED, S.CANCELLED})

# States in which a worker holds (or held, until the reaper notices) a lease.
LEASED: frozenset[RunStatus] = frozenset(
    {S.CLAIMED, S.PREPARING_SANDBOX, S.RUNNING, S.VERIFYING, S.JUDGING, S.FINALIZING}
)

# States in which no worker may hold a lease and the run waits to be claimed.
WAITING: frozenset[RunStatus] = frozenset(
    {S.ADMITTED, S.AWAITING_APPROVAL, S.WAITING_CAPACITY, S.QUEUED})

# The stages a worker walks through, in order, while it holds the lease.
STAGES: tuple[RunStatus, ...] = (
    S.CLAIMED,
    S.PREPARING_SANDBOX,
    S.RUNNING,
    S.VERIFYING,
    S.JUDGING,
    S.FINALIZING,
)

# Statuses a run may be created in (the "from" of its first event is None).
INITIAL: frozenset[RunStatus] = frozenset(
    {S.ADMITTED, S.QUEUED, S.WAITING_CAPACITY, S.POLICY_DENIED, S.AWAITING_APPROVAL}
)

_LEAVE_STAGE = frozenset(
    {S.FAILED_RETRYABLE, S.FAILED, S.POLICY_DENIED, S.STALE_LEASE, S.CANCEL_REQUESTED}
)


def _stage_targets(stage: RunStatus) -> frozenset[RunStatus]:
    """A stage moves forward only: to any later stage (a run without a verifier or a
    judge skips those), or out of the stages through failure, cancellation or recovery.
    Success is reachable only from FINALIZING: the finalizer is the door to it (and
    the end of an attempt whose run's pull request is already recorded, which only
    completes what the finalizer did: ``Store._end_attempt``)."""
    later = STAGES[STAGES.index(stage) + 1 :]
    success = {S.SUCCEEDED} if stage is S.FINALIZING else set()
    return frozenset(later) | _LEAVE_STAGE | success


TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    S.ADMITTED: frozenset({S.QUEUED, S.WAITING_CAPACITY, S.POLICY_DENIED, S.CANCELLED}),
    # AWAITING_APPROVAL: a deferred run an approval gate holds when it is admitted.
    S.WAITING_CAPACITY: frozenset(
        {S.ADMITTED, S.QUEUED, S.POLICY_DENIED, S.CANCELLED, S.FAILED, S.AWAITING_APPROVAL}),
    # Approved: admitted again under the policy in force (queued, waiting for its
    # dependencies or capacity, or denied); rejected or expired: POLICY_DENIED.
    S.AWAITING_APPROVAL: frozenset(
        {S.QUEUED, S.ADMITTED, S.WAITING_CAPACITY, S.POLICY_DENIED, S.CANCELLED}),
    S.QUEUED: frozenset({S.CLAIMED, S.WAITING_CAPACITY, S.POLICY_DENIED, S.CANCELLED}),
    **{stage: _stage_targets(stage) for stage in STAGES},
    S.STALE_LEASE: frozenset({S.FAILED_RETRYABLE, S.FAILED, S.CANCELLED}),
    S.FAILED_RETRYABLE: frozenset({S.QUEUED, S.FAILED}),
    S.CANCEL_REQUESTED: frozenset({S.CANCELLING, S.CANCELLED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.POLICY_DENIED: frozenset(),
    S.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """A status change that the transition table does not allow."""


def is_allowed(source: RunStatus | None, target: RunStatus) -> bool:
    if source is None:
        return target in INITIAL
    return target in TRANSITIONS[source]


def sources_of(target: RunStatus) -> frozenset[RunStatus]:
    """Every status from which ``target`` may be reached in one step."""
    return frozenset(s for s, targets in TRANSITIONS.items() if target in targets)


def check_path(sources: Iterable[RunStatus], path: Sequence[RunStatus]) -> frozenset[RunStatus]:
    """Validate a multi-hop path and return the sources it may start from.

    A path such as ``[FAILED_RETRYABLE, QUEUED]`` is written as one UPDATE but
    recorded as one event per hop; every hop must be in the table.
    """
    if not path:
        raise IllegalTransition("empty transition path")
    for a, b in itertools.pairwise(path):
        if not is_allowed(a, b):
            raise IllegalTransition(f"{a} -> {b} is not an allowed transition")
    allowed = frozenset(s for s in sources if is_allowed(s, path[0]))
    if not allowed:
        raise IllegalTransition(f"no source state among {sorted(sources)} may reach {path[0]}")
    return allowed

