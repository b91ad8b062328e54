"""The fleet as the facade shows it: workers and their leases, queues, tenants, the
policy in force and its versions (``Runlane.workers``, ``queues``, ``tenants``,
``policy``, ``policy_versions``): what ``runlane workers list --json`` prints and the
HTTP API serialises. What a tenant's principal sees of each is in docs/operations.md
("Views and who sees what")."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runlane.models.listing import Timestamp


class _View(BaseModel):
    model_config = ConfigDict(frozen=True)


class LeaseView(_View):
    """A lease a worker holds now: the attempt of one run, fenced by its token."""

    run_id: str
    task_id: str
    tenant: str
    queue: str
    status: str = Field(description="The run's status.")
    attempt_no: int
    fencing_token: int
    started_at: Timestamp
    lease_expires_at: Timestamp


class WorkerView(_View):
    """A worker process: what it serves, when it last beat, what it holds."""

    worker_id: str
    status: str = Field(description="STARTING, READY, DRAINING, STOPPED or DEAD.")
    version: str
    queues: list[str]
    capabilities: dict[str, Any]
    started_at: Timestamp
    heartbeat_at: Timestamp
    heartbeat_age_seconds: float = Field(description="Seconds since its last heartbeat, "
                                         "by the database's clock.")
    drain_requested_at: Timestamp | None = Field(
        default=None, description="When an operator asked it to drain (`runlane workers "
        "drain`); it drains at its next heartbeat.")
    leases_held: int = Field(description="Leases held now (a tenant's principal: of its "
                             "own runs only).")
    leases: list[LeaseView]


class LimitView(_View):
    """One concurrency limit of the policy in force and the runs it counts now."""

    scope: str = Field(description="global, tenant:T, queue:Q, repo:R, user:U or risk:K.")
    max_active: int
    active: int | None = Field(description="Runs holding a slot now; null where a "
                               "tenant's principal would see other tenants' runs.")


class QueueView(_View):
    """A queue: its backlog, how long its oldest ready run has waited, what runs."""

    queue: str
    queued: int = Field(description="Runs waiting in the queue (ready or in backoff).")
    oldest_ready_age_seconds: float | None = Field(
        description="Age of the oldest run ready to be claimed now; null when none is.")
    active: int = Field(description="Runs holding a lease now.")
    limits: list[LimitView]


class TenantView(_View):
    """A tenant: its backlog and active runs against its limits, its fair share, its
    spend today against its daily budget."""

    tenant: str
    queued: int
    oldest_ready_age_seconds: float | None
    active: int
    max_active: int | None = Field(description="The policy's limit of its active runs.")
    max_queued: int | None
    weight: float = Field(description="Fair-share weight among the tenants of a priority.")
    fair_share: float | None = Field(
        default=None, description="Its weight over the weights of every tenant with a run "
        "ready now: its share of free slots while they all wait at one priority; null "
        "without a ready run, and for a tenant's principal.")
    spent_today_usd: float = Field(description="Model spend this UTC day.")
    daily_budget_usd: float | None
    limits: list[LimitView]


class TenantLimits(_View):
    """A tenant's own terms in the policy in force (what a tenant's principal sees of
    the policy)."""

    tenant: str
    known: bool = Field(description="Whether the policy names this tenant.")
    admitted: bool = Field(description="Whether its runs are admitted at all.")
    weight: float
    max_active: int | None
    max_queued: int | None
    daily_budget_usd: float | None
    allowed_risk_classes: list[str] | None


class PolicyView(_View):
    """The policy in force. ``document`` (every tenant's terms) is the operator's only;
    a tenant's principal gets its own terms in ``tenant_limits``."""

    version: int = Field(description="0: no policy applied (everything admitted).")
    created_at: Timestamp | None
    digest: str | None = None
    source: str | None = None
    document: dict[str, Any] | None = None
    tenant_limits: TenantLimits | None = None


class PolicyApplied(_View):
    """What ``policy apply`` did: the version in force and whether it is new."""

    version: int
    digest: str
    created: bool = Field(description="False: the policy was unchanged, no new version.")


class PolicyVersionView(_View):
    """One stored version of the policy (content: ``runlane policy show``)."""

    version: int
    created_at: Timestamp
    in_force: bool
    digest: str | None = None
    source: str | None = None
    backlog_admitted_at: Timestamp | None = None
