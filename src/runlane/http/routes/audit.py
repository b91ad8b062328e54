"""``GET /v1/audit``: the invariants checked on the live database (admin only), as
`runlane audit --json` lists them."""

from __future__ import annotations

from fastapi import APIRouter

from runlane.http.auth import Lane, Who
from runlane.store.records import Violation

router = APIRouter(tags=["audit"])


@router.get("/audit")
def audit(lane: Lane, who: Who) -> list[Violation]:
    """Every violation found; an empty list when all hold."""
    return lane.audit(principal=who)
