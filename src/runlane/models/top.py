"""What ``runlane top`` shows, as one model whatever it reads from: the facade on the
database (SQLite or PostgreSQL) or the HTTP API. ``TopSnapshot`` is what ``runlane top
--once --json`` prints; ``ClaimRates`` and ``FailureView`` are the facade's
``claim_rates`` and ``failures`` (``GET /v1/claim-rates``, ``GET /v1/failures``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from runlane.models.listing import Timestamp


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class QueueClaims(_View):
    """Claims of one queue in the span of a ``ClaimRates``."""

    queue: str
    claims: int = Field(description="Claims (attempts started) in the span.")
    per_minute: float


class ClaimRates(_View):
    """Claims per queue over the last ``span_seconds``: the window asked for, or the
    shorter span of the newest claims when more were made in the window than one read
    counts (the facade's ``CLAIM_SAMPLE``)."""

    window_seconds: float
    span_seconds: float
    queues: list[QueueClaims] = Field(description="Queues with claims in the span, by name.")


class FailureView(_View):
    """A run that moved to a failure status: an attempt that failed (its run retried,
    ``FAILED_RETRYABLE``, or not, ``FAILED``) or a run the policy denied."""

    run_id: str
    task_id: str
    tenant: str
    repo: str
    queue: str
    attempt_no: int | None = Field(description="Null for a run denied before any attempt.")
    status: str = Field(description="FAILED_RETRYABLE, FAILED or POLICY_DENIED.")
    reason_code: str | None
    message: str | None
    at: Timestamp


class TopQueue(_View):
    queue: str
    queued: int
    oldest_ready_age_seconds: float | None
    active: int
    max_active: int | None = Field(description="The queue's concurrency limit, if any.")
    claims_per_minute: float


class TopTenant(_View):
    tenant: str
    queued: int
    active: int
    max_active: int | None
    weight: float
    fair_share: float | None = Field(description="Its share of free slots among the "
                                     "tenants with a run ready now (TenantView.fair_share).")
    spent_today_usd: float
    daily_budget_usd: float | None


class TopWorker(_View):
    worker_id: str
    status: str
    heartbeat_age_seconds: float
    leases_held: int
    draining: bool = Field(description="DRAINING, or asked to drain at its next heartbeat.")


class TopSnapshot(_View):
    """One frame of ``runlane top``."""

    source: str = Field(description="The database (password hidden) or the API's URL.")
    taken_at: Timestamp
    claim_span_seconds: float = Field(description="The span the claim rates cover.")
    queues: list[TopQueue]
    tenants: list[TopTenant]
    workers: list[TopWorker]
    failures: list[FailureView] = Field(description="Newest first.")
    awaiting_approval: int = Field(0, description="Runs an approval gate holds "
                                   "(AWAITING_APPROVAL), up to 10,000.")
