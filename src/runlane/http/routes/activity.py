"""Recent activity, what `runlane top --url` reads beside the fleet: claims per queue in
a recent window, and the latest failures with their reason codes."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from runlane.api_activity import CLAIM_WINDOW_SECONDS, MAX_CLAIM_WINDOW_SECONDS, MAX_FAILURES
from runlane.http.auth import Lane, Who
from runlane.http.routes import returns

router = APIRouter()


@router.get("/claim-rates", tags=["queues"], response_model=returns("claim_rates"))
def claim_rates(lane: Lane, who: Who, window_seconds: Annotated[float, Query(
        gt=0, le=MAX_CLAIM_WINDOW_SECONDS)] = CLAIM_WINDOW_SECONDS) -> Any:
    """Claims per queue over the last `window_seconds` (a tenant token: its runs')."""
    return lane.claim_rates(principal=who, window_seconds=window_seconds)


@router.get("/failures", tags=["runs"], response_model=returns("failures"))
def failures(lane: Lane, who: Who,
             limit: Annotated[int, Query(ge=1, le=MAX_FAILURES)] = 10) -> Any:
    """The latest failures, newest first: failed attempts and denied runs, each with its
    reason code (a tenant token: its own)."""
    return lane.failures(principal=who, limit=limit)
