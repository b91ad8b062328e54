"""Health: ``/healthz`` (the process answers; no database) and ``/readyz`` (the database
answers and its schema is the one this runlane needs). Neither needs a token: a load
balancer or an orchestrator probes them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from runlane.errors import RunlaneError
from runlane.http.auth import Lane
from runlane.http.problems import PROBLEM_JSON, Problem, for_error
from runlane.version import __version__

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str
    version: str


@router.get("/healthz")
async def healthz() -> Health:
    return Health(status="ok", version=__version__)


@router.get("/readyz", response_model=Health, responses={
    503: {"model": Problem, "content": {PROBLEM_JSON: {}},
          "description": "Database down or schema outdated."}})
def readyz(lane: Lane) -> Any:
    try:
        lane.check_schema()
    except RunlaneError as exc:
        return for_error(exc)
    return Health(status="ready", version=__version__)
