"""What the store takes and returns: a lease, and the results of its operations.
Below every store module, so that none imports another for these."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from runlane.domain.states import RunStatus

S = RunStatus


@dataclass
class Lease:
    """A worker's right to execute one attempt of a run."""

    run_id: str
    task_id: str
    attempt_no: int
    fencing_token: int
    worker_id: str
    expires_at: float
    tenant: str
    repo: str  # the run's canonical repository (its identity); the task's is cloned
    queue: str
    priority: int
    max_attempts: int
    limits: dict[str, Any] = field(default_factory=dict)  # the run's limits snapshot
    stage: RunStatus = S.CLAIMED

    @property
    def attempt_id(self) -> str:
        return f"{self.run_id}/{self.attempt_no}"


def _lease(claimed: Any, run: Any, worker_id: str, lease_ttl: float) -> Lease:
    """The lease of a claimed run: ``claimed`` is the claim's write (token, attempt,
    time), ``run`` the run as the claim read it."""
    limits = run.limits if isinstance(run.limits, dict) else json.loads(run.limits or "{}")
    return Lease(
        run_id=claimed.run_id, task_id=run.task_id, attempt_no=claimed.attempt_count,
        fencing_token=claimed.fencing_token, worker_id=worker_id,
        expires_at=claimed.now + lease_ttl, tenant=run.tenant, repo=run.repo,
        queue=run.queue, priority=run.priority, max_attempts=run.max_attempts,
        limits=limits or {})


@dataclass(frozen=True)
class Submission:
    task_id: str
    run_id: str
    status: str
    created: bool
    truncated_sections: tuple[str, ...] = ()
    payload_bytes: int = 0
    reason_code: str | None = None  # why a run was denied or deferred at admission


@dataclass(frozen=True)
class Look:
    """What a worker's look found (``Store.look``): ``ready``, a claim may find a run
    now; else ``next_in``, the seconds until the earliest run it may serve becomes
    claimable (by the database's clock), or None when it may serve none queued."""

    ready: bool
    next_in: float | None = None


@dataclass(frozen=True)
class HeartbeatResult:
    extended: dict[str, float] = field(default_factory=dict)  # run_id -> new expiry
    cancel_requested: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Completion:
    """What ``complete_many`` did: the leases whose runs it completed, and why each
    other lease was refused (``LeaseLost``, ``CancelRequested``, ``TransitionRefused``
    or ``IllegalTransition``); a refused lease changed nothing."""

    completed: tuple[Lease, ...] = ()
    refused: tuple[tuple[Lease, Exception], ...] = ()


@dataclass(frozen=True)
class CancelResult:
    task_id: str
    runs: dict[str, str]  # run_id -> status after the request


@dataclass(frozen=True)
class SideEffect:
    run_id: str
    effect_key: str
    status: str  # INTENT or DONE
    attempt_no: int
    fencing_token: int
    result: dict[str, Any] | None


@dataclass(frozen=True)
class Violation:
    """One broken invariant, about a run (``run_id``), a lane (``lane_id``) or a limit
    scope (``scope``)."""

    check: str
    run_id: str | None
    detail: str
    lane_id: int | None = None
    scope: str | None = None

    @property
    def subject(self) -> str:
        """What the violation is about, for a reader: "run r-1", "lane 3", "scope x"."""
        if self.lane_id is not None:
            return f"lane {self.lane_id}"
        if self.scope is not None:
            return f"scope {self.scope}"
        return f"run {self.run_id}"


@dataclass(frozen=True)
class _Snapshot:
    """A run and one of its attempts, read under the run's row lock."""

    run_id: str
    task_id: str
    status: RunStatus
    run_token: int
    attempt_count: int
    charged_attempts: int  # attempts that count against max_attempts (not drained ones)
    max_attempts: int
    created_at: float
    cost_usd: float
    attempt_no: int
    fencing_token: int
    lease_status: str
    lease_expires_at: float
    now: float
    # Attempts numbered above it are finalize-only (store/evidence.py); None: none yet.
    finalize_only_after: int | None = None
    worker_id: str | None = None  # the attempt's

    @property
    def lease_live(self) -> bool:
        return (
            self.lease_status == "ACTIVE"
            and self.run_token == self.fencing_token
            and self.lease_expires_at > self.now
        )
