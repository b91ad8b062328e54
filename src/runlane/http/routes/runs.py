"""Runs: a filtered, keyset-paginated list (newest first by default), and one run with
its attempts, leases, fencing tokens, events, side effects, cost and pull request."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from runlane.http.auth import Lane, Who
from runlane.http.routes import returns

router = APIRouter(tags=["runs"])

Name = Annotated[str | None, Query(max_length=128)]


@router.get("/runs", response_model=returns("runs_page"))
def runs(lane: Lane, who: Who, status: Name = None, tenant: Name = None, queue: Name = None,
         repo: Annotated[str | None, Query(max_length=4096)] = None,
         created_after: datetime | None = None, created_before: datetime | None = None,
         cursor: Annotated[str | None, Query(max_length=512,
                                             description="`next` of the page before.")] = None,
         limit: Annotated[int, Query(ge=1, le=500)] = 50,
         newest_first: bool = True) -> Any:
    return lane.runs_page(
        principal=who, status=status, tenant=tenant, queue=queue, repo=repo,
        created_after=created_after, created_before=created_before, cursor=cursor,
        limit=limit, newest_first=newest_first)


@router.get("/runs/{run_id}", response_model=returns("run"))
def run(run_id: Annotated[str, Path(max_length=64)], lane: Lane, who: Who) -> Any:
    return lane.run(run_id, principal=who)
