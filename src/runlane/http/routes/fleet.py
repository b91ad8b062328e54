"""The fleet: workers (and draining one remotely), queues, tenants, the policy in force
and its versions."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

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
