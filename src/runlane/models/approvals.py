"""Approval gates as the facade returns them (``Runlane.approvals``, ``approve``,
``reject``): what ``runlane approvals list --json`` and ``approve --json`` print and
the HTTP API serialises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from runlane.models.runs import Timestamp


class PendingApproval(BaseModel):
    """A run waiting for approval: what it is, why it waits and until when."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    task_id: str
    tenant: str
    repo: str
    queue: str
    priority: int
    user: str | None
    risk_class: str | None
    estimated_cost_usd: float | None
    policy_version: int
    created_at: Timestamp
    expires_at: Timestamp  # then it ends POLICY_DENIED, APPROVAL_EXPIRED
    message: str | None  # the gate that holds it


class ApprovalRecord(BaseModel):
    """A run's approval decision as recorded: APPROVED, REJECTED or EXPIRED, by whom
    (``token:<id>`` for an API token, the scheduler for an expiry), when, with what
    note, under which policy version."""

    model_config = ConfigDict(frozen=True)

    decision: str
    actor: str
    note: str | None
    policy_version: int
    decided_at: Timestamp


class ApprovalResult(ApprovalRecord):
    """An approve or reject: the decision, the run's status after it, and whether this
    request only found the same decision made before (``repeated``: nothing written)."""

    run_id: str
    tenant: str
    status: str
    repeated: bool
