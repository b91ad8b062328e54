"""``create_app(lane)``: the FastAPI application of ``runlane serve``.

The versioned JSON API under ``/v1`` (every route needs a bearer token), its OpenAPI
document at ``/openapi.json`` and browsable docs at ``/docs``, health probes at
``/healthz`` and ``/readyz``, errors as ``application/problem+json``, and the dashboard
at ``/`` when it is installed. Endpoints that touch the database are plain functions,
which FastAPI runs in its threadpool: the facade blocks."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import APIRouter, Depends, FastAPI

from runlane.api import Runlane
from runlane.http import problems
from runlane.http.auth import principal
from runlane.http.routes import (
    activity,
    approvals,
    audit,
    campaigns,
    events,
    fleet,
    health,
    metrics,
    runs,
    tasks,
    tokens,
)
from runlane.http.stream import EventHub
from runlane.version import __version__

log = structlog.get_logger("runlane.http")

KEEPALIVE_SECONDS = 15.0


def create_app(lane: Runlane, *, events_poll_seconds: float | None = None,
               keepalive_seconds: float = KEEPALIVE_SECONDS) -> FastAPI:
    """The API over ``lane`` (which the app does not close: its owner does).
    ``events_poll_seconds``: how often the event stream looks at the table without a
    wake-up (default: the EVENTS_POLL_SECONDS setting); ``keepalive_seconds``: the
    comment line an idle stream writes."""
    hub = EventHub(lane, poll_seconds=events_poll_seconds or lane.settings.events_poll_seconds)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        hub.start()
        try:
            yield
        finally:
            hub.close()

    app = FastAPI(
        title="runlane", version=__version__, lifespan=lifespan,
        description="The HTTP API of runlane, a run scheduler for background AI coding "
        "agents. Every /v1 route needs `Authorization: Bearer <token>`; errors are "
        "`application/problem+json` with the CLI's reason and exit codes.",
        openapi_url="/openapi.json", docs_url="/docs", redoc_url=None)
    app.state.lane = lane
    app.state.events_hub = hub
    app.state.keepalive_seconds = keepalive_seconds
    problems.install(app)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(principal)],
                   responses=problems.COMMON)  # type: ignore[arg-type]
    for module in (tasks, runs, fleet, activity, audit, events, tokens, campaigns,
                   approvals):
        v1.include_router(module.router)
    app.include_router(v1)
    app.include_router(health.router)
    app.include_router(metrics.router)
    _include_dashboard(app)
    return app


def _include_dashboard(app: FastAPI) -> None:
    """The dashboard (runlane.http.dashboard), mounted at ``/`` when present."""
    try:
        module = importlib.import_module("runlane.http.dashboard")
    except ModuleNotFoundError as exc:
        if exc.name != "runlane.http.dashboard":
            raise
        log.debug("dashboard_absent")
        return
    app.include_router(module.router)
