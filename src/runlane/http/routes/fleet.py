"""The fleet: workers (and draining one remotely), queues, tenants, the policy in force
and its versions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from runlane.http.auth import Lane, Who
from runlane.http.routes import returns

router = APIRouter()


@router.get("/workers", tags=["workers"], response_model=returns("workers"))
def workers(lane: Lane, who: Who) -> Any:
    """Status, version, capabilities, heartbeat age and leases held."""
    return lane.workers(principal=who)


@router.post("/workers/{worker_id}/drain", tags=["workers"],
             response_model=returns("drain_worker"))
def drain_worker(worker_id: Annotated[str, Path(max_length=255)], lane: Lane, who: Who) -> Any:
    """The worker drains at its next heartbeat, as on SIGTERM (admin only)."""
    return lane.drain_worker(worker_id, principal=who)


@router.get("/queues", tags=["queues"], response_model=returns("queues"))
def queues(lane: Lane, who: Who) -> Any:
    """Queued, oldest ready age, active against each limit."""
    return lane.queues(principal=who)


@router.get("/tenants", tags=["queues"], response_model=returns("tenants"))
def tenants(lane: Lane, who: Who) -> Any:
    """Fair-share weight, active against limits, spend today against budget."""
    return lane.tenants(principal=who)


@router.get("/policy", tags=["policy"], response_model=returns("policy"))
def policy(lane: Lane, who: Who) -> Any:
    """The policy in force."""
    return lane.policy(principal=who)


@router.get("/policy/versions", tags=["policy"], response_model=returns("policy_versions"))
def policy_versions(lane: Lane, who: Who) -> Any:
    return lane.policy_versions(principal=who)


class PolicyText(BaseModel):
    """A policy to apply: its TOML text, as `runlane policy apply FILE` reads it."""

    model_config = ConfigDict(extra="forbid")

    policy: str = Field(max_length=1_000_000, description="The policy, in TOML.")
    source: str = Field("<api>", max_length=255,
                        description="A label stored with the version (a file name).")


@router.post("/policy", tags=["policy"], response_model=returns("apply_policy"))
def apply_policy(body: PolicyText, lane: Lane, who: Who) -> Any:
    """Validate the policy and store it as a new numbered version, none if unchanged
    (admin only; a bad policy is a 422 naming the field)."""
    return lane.apply_policy(body.policy, source=body.source, principal=who)
