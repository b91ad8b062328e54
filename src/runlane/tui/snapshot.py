"""One frame of ``runlane top``: ``TopSnapshot`` (runlane.models.top), made by
``assemble`` from the facade's views whichever way they were read. Two sources:
``FacadeSource`` calls the facade on the database (SQLite or PostgreSQL), ``HttpSource``
reads the same views from the HTTP API's /v1 endpoints with a token (so a tenant's
token sees only its tenant's figures: the API scopes them). Both end in ``assemble``:
one code path from views to frame."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import TypeAdapter, ValidationError

from runlane.errors import Forbidden, NotFound, RunlaneError, Unauthenticated
from runlane.extras import require
from runlane.models.fleet import QueueView, TenantView, WorkerView
from runlane.models.top import (
    ClaimRates,
    FailureView,
    TopQueue,
    TopSnapshot,
    TopTenant,
    TopWorker,
)

if TYPE_CHECKING:
    import httpx

    from runlane.api import Runlane

T = TypeVar("T")


class SourceUnavailable(RunlaneError):
    """The HTTP API did not answer, or answered that it cannot (a 5xx: its database is
    down): as DatabaseUnavailable for the database."""

    exit_code = 4


class Source(Protocol):
    """Where a frame's figures come from."""

    name: str

    def fetch(self) -> TopSnapshot: ...

    def close(self) -> None: ...


def assemble(source: str, *, queues: list[QueueView], tenants: list[TenantView],
             workers: list[WorkerView], claims: ClaimRates, failures: list[FailureView],
             taken_at: datetime | None = None, awaiting_approval: int = 0) -> TopSnapshot:
    """The frame made of the views. A queue that only claims show (its runs all ended
    since) is listed too, with its claim rate and nothing queued."""
    rates = {c.queue: c.per_minute for c in claims.queues}
    rows = [TopQueue(
        queue=q.queue, queued=q.queued, oldest_ready_age_seconds=q.oldest_ready_age_seconds,
        active=q.active, max_active=next((lim.max_active for lim in q.limits
                                          if lim.scope == f"queue:{q.queue}"), None),
        claims_per_minute=rates.pop(q.queue, 0.0)) for q in queues]
    rows += [TopQueue(queue=name, queued=0, oldest_ready_age_seconds=None, active=0,
                      max_active=None, claims_per_minute=rate)
             for name, rate in rates.items()]
    return TopSnapshot(
        source=source, taken_at=taken_at or datetime.now(UTC),
        claim_span_seconds=claims.span_seconds,
        queues=sorted(rows, key=lambda q: q.queue),
        tenants=[TopTenant(
            tenant=t.tenant, queued=t.queued, active=t.active, max_active=t.max_active,
            weight=t.weight, fair_share=t.fair_share, spent_today_usd=t.spent_today_usd,
            daily_budget_usd=t.daily_budget_usd) for t in tenants],
        workers=[TopWorker(
            worker_id=w.worker_id, status=w.status,
            heartbeat_age_seconds=w.heartbeat_age_seconds, leases_held=w.leases_held,
            draining=w.status == "DRAINING" or (w.drain_requested_at is not None
                                                and w.status not in ("STOPPED", "DEAD")))
            for w in workers],
        failures=failures, awaiting_approval=awaiting_approval)


class FacadeSource:
    """The facade on the database: what ``runlane queues list``, ``tenants list`` and
    ``workers list`` read, and the recent activity (api_activity.py)."""

    def __init__(self, lane: Runlane, *, failures: int, claim_window: float) -> None:
        from runlane.api import shown_url

        self.lane = lane
        self.failures = failures
        self.claim_window = claim_window
        self.name = shown_url(lane.store.engine.url)

    def fetch(self) -> TopSnapshot:
        lane = self.lane
        return assemble(
            self.name, queues=lane.queues(), tenants=lane.tenants(), workers=lane.workers(),
            claims=lane.claim_rates(window_seconds=self.claim_window),
            failures=lane.failures(limit=self.failures),
            awaiting_approval=len(lane.approvals(limit=APPROVALS_COUNTED)))

    def close(self) -> None:
        """The lane is its caller's."""


_QUEUES = TypeAdapter(list[QueueView])
_TENANTS = TypeAdapter(list[TenantView])
_WORKERS = TypeAdapter(list[WorkerView])
_CLAIMS = TypeAdapter(ClaimRates)
_FAILURES = TypeAdapter(list[FailureView])
_APPROVALS = TypeAdapter(list[dict[str, Any]])
# Runs awaiting approval that top counts at most (a listing of them, bounded).
APPROVALS_COUNTED = 10_000


class HttpSource:
    """The HTTP API (``runlane serve``): ``GET /v1/queues``, ``/v1/tenants``,
    ``/v1/workers``, ``/v1/claim-rates``, ``/v1/failures`` and ``/v1/approvals`` with a
    bearer token."""

    def __init__(self, url: str, token: str, *, failures: int, claim_window: float,
                 timeout: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.name = url.rstrip("/")
        self.failures = failures
        self.claim_window = claim_window
        # httpx: the `remote` extra (runlane.extras), needed only to read an HTTP API.
        self._httpx: Any = require("httpx", "runlane top --url", "remote")
        self.client = self._httpx.Client(
            base_url=self.name, timeout=timeout, transport=transport,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})

    def fetch(self) -> TopSnapshot:
        return assemble(
            self.name, queues=self._get("/v1/queues", _QUEUES),
            tenants=self._get("/v1/tenants", _TENANTS),
            workers=self._get("/v1/workers", _WORKERS),
            claims=self._get("/v1/claim-rates", _CLAIMS,
                             window_seconds=self.claim_window),
            failures=self._get("/v1/failures", _FAILURES, limit=self.failures),
            awaiting_approval=len(self._get("/v1/approvals", _APPROVALS,
                                            limit=APPROVALS_COUNTED)))

    def _get(self, path: str, model: TypeAdapter[T], **params: Any) -> T:
        where = f"{self.name}{path}"
        try:
            answer = self.client.get(path, params=params)
        except self._httpx.TimeoutException:
            raise SourceUnavailable(f"API {where}: no answer in "
                                    f"{self.client.timeout.read}s") from None
        except self._httpx.HTTPError as exc:
            raise SourceUnavailable(f"API {where}: {_reason(exc)}") from None
        if answer.status_code != 200:
            raise _refusal(answer, where)
        try:
            return model.validate_json(answer.content)
        except ValidationError:
            raise SourceUnavailable(f"API {where}: the answer is not runlane's "
                                    "(is this the URL of `runlane serve`?)") from None

    def close(self) -> None:
        self.client.close()


def _reason(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


_REFUSALS: dict[int, Callable[[str], RunlaneError]] = {
    401: Unauthenticated, 403: Forbidden, 404: NotFound}


def _refusal(answer: httpx.Response, where: str) -> RunlaneError:
    """A non-200 answer as runlane's error: 401/403 as the CLI's (the token), 5xx as
    the API being unavailable (its problem's detail says why), others as they say."""
    detail = ""
    try:
        problem = answer.json()
        if isinstance(problem, dict):
            detail = str(problem.get("detail") or problem.get("title") or "")
    except ValueError:
        pass
    message = f"API {where}: {answer.status_code} {answer.reason_phrase}" + (
        f": {detail}" if detail else "")
    if answer.status_code == 404:  # none of top's paths names a row: a wrong URL
        message += " (is this the URL of `runlane serve`, of this runlane's version?)"
    make = _REFUSALS.get(answer.status_code)
    if make is not None:
        return make(message)
    if answer.status_code >= 500:
        return SourceUnavailable(message)
    return RunlaneError(message)
