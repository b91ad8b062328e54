"""Approval gates (as `runlane approvals list`, `approve`, `reject`): the runs waiting
for approval, and a decision on one. Deciding needs an `approve` or `admin` token; a
tenant's token sees and decides its own tenant's runs only (another tenant's is a 404)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from runlane.api_approvals import MAX_NOTE
from runlane.http.auth import Lane, Who
from runlane.http.routes import returns

router = APIRouter(tags=["approvals"])
RunId = Annotated[str, Path(max_length=64)]


class Decision(BaseModel):
    """Why, for the record (shown with the run)."""

    model_config = ConfigDict(extra="forbid")

    note: str | None = Field(None, max_length=MAX_NOTE)


@router.get("/approvals", response_model=returns("approvals"))
def approvals(lane: Lane, who: Who,
              tenant: Annotated[str | None, Query(max_length=128)] = None,
              limit: Annotated[int, Query(ge=1, le=10_000)] = 500) -> Any:
    """Runs waiting for approval, oldest first."""
    return lane.approvals(tenant=tenant, limit=limit, principal=who)


@router.post("/runs/{run_id}/approve", response_model=returns("approve"),
             responses={409: {"description": "The run is not waiting for approval (it was "
                              "rejected, expired, or never held)."}})
def approve(run_id: RunId, lane: Lane, who: Who, body: Decision | None = None) -> Any:
    """Approve: the run is admitted again under the policy in force. Again: the same
    answer, `repeated` true, nothing written."""
    return lane.approve(run_id, note=None if body is None else body.note, principal=who)


@router.post("/runs/{run_id}/reject", response_model=returns("reject"),
             responses={409: {"description": "The run is not waiting for approval (it was "
                              "approved, expired, or never held)."}})
def reject(run_id: RunId, lane: Lane, who: Who, body: Decision | None = None) -> Any:
    """Reject: the run ends POLICY_DENIED (APPROVAL_REJECTED) and never starts."""
    return lane.reject(run_id, note=None if body is None else body.note, principal=who)
