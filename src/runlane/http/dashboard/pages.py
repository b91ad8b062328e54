"""The dashboard's routes: sign-in and sign-out, runs, a run (with cancel and retry),
workers (with drain), queues and tenants, the policy. Server-rendered; every read and
write goes through the facade with the session's principal, so a tenant's browser sees
and changes exactly what its token may through the API. Route functions are plain
``def``: FastAPI runs them in its threadpool, since the facade blocks."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

import structlog
from fastapi import APIRouter, Form, Query, Request
from starlette.responses import RedirectResponse, Response

from runlane.domain.access import Principal
from runlane.domain.states import TERMINAL, RunStatus
from runlane.errors import (
    Conflict,
    DatabaseUnavailable,
    Forbidden,
    NotFound,
    RunlaneError,
    Unauthenticated,
    redact_credentials,
)
from runlane.http.dashboard import session
from runlane.http.dashboard.render import harden, page, static_file

log = structlog.get_logger("runlane.dashboard")

router = APIRouter(include_in_schema=False)

# The end of an attempt's log a run's page shows.
LOG_TAIL_BYTES = 16 * 1024
LOG_NAMES = ("agent.log", "verify.log")
PAGE_SIZES = (25, 50, 100)
# What a redirect after a form may say: fixed texts by key, never text from the request.
NOTICES = {
    "cancel": "Cancellation requested.",
    "retry": "Retry submitted: a new run of the same task.",
    "approve": "Approved: the run was admitted again under the policy in force.",
    "reject": "Rejected: the run ended POLICY_DENIED (APPROVAL_REJECTED).",
    "drain": "Drain requested: the worker stops claiming at its next heartbeat.",
    "signed-out": "Signed out.",
    "expired": "Your session ended (the token was revoked or expired): sign in again.",
}
Filter = Annotated[str | None, Query(max_length=200)]


class _SignIn(Exception):
    """No valid session: the page redirects to the sign-in form."""


def _lane(request: Request) -> Any:
    return request.app.state.lane


def _who(request: Request) -> tuple[Principal, str]:
    """The session's principal and its token (for the CSRF field), or _SignIn."""
    token = session.session_token(request)
    if token is None:
        raise _SignIn("none")
    try:
        return session.authenticate(request, token), token
    except Unauthenticated:
        raise _SignIn("expired") from None


def _redirect(url: str) -> Response:
    return harden(RedirectResponse(url, status_code=303))


def _context(request: Request, who: Principal, token: str, **extra: Any) -> dict[str, Any]:
    notice = NOTICES.get(request.query_params.get("notice", ""))
    return {"who": who, "csrf": session.csrf_token(token), "csrf_field": session.CSRF_FIELD,
            "notice": notice, "path": request.url.path, **extra}


def _error_page(request: Request, exc: RunlaneError, who: Principal | None,
                token: str | None) -> Response:
    if isinstance(exc, NotFound):
        status = 404
    elif isinstance(exc, Forbidden):
        status = 403
    elif isinstance(exc, Conflict):
        status = 409
    elif isinstance(exc, DatabaseUnavailable) or getattr(exc, "exit_code", 0) == 4:
        status = 503
    else:
        status = 400 if getattr(exc, "exit_code", 0) == 2 else 409
    context: dict[str, Any] = {"who": who, "path": request.url.path,
                               "message": redact_credentials(str(exc)), "status": status}
    if who is not None and token is not None:
        context.update(csrf=session.csrf_token(token), csrf_field=session.CSRF_FIELD)
    return harden(page("error.html", status_code=status, **context))


def _internal_error(request: Request, who: Principal | None, token: str | None) -> Response:
    """Anything unexpected: logged with its traceback on the server, and a page that
    says only that it failed (the error could name SQL, paths or values)."""
    log.exception("dashboard_error", path=request.url.path)
    context: dict[str, Any] = {"who": who, "path": request.url.path, "status": 500,
                               "message": "Something went wrong on the server; its log "
                               "says what."}
    if who is not None and token is not None:
        context.update(csrf=session.csrf_token(token), csrf_field=session.CSRF_FIELD)
    return harden(page("error.html", status_code=500, **context))


def _view(request: Request, build: Callable[[Principal, str], Response]) -> Response:
    """Run a page's body with the session's principal; no session: to the sign-in page;
    a refusal of the facade: an error page saying it (never a traceback)."""
    try:
        who, token = _who(request)
    except _SignIn as why:
        response = _redirect("/login" + ("?notice=expired" if str(why) == "expired" else ""))
        if str(why) == "expired":
            session.clear_session(response, request)
        return response
    try:
        return harden(build(who, token))
    except RunlaneError as exc:
        return _error_page(request, exc, who, token)
    except Exception:
        return _internal_error(request, who, token)


def _form(request: Request, csrf: str | None,
          act: Callable[[Principal], str]) -> Response:
    """A signed-in form's POST: the session, its CSRF token and origin checked before
    anything is done; then ``act`` (which returns where to go)."""
    try:
        who, token = _who(request)
    except _SignIn:
        return _redirect("/login?notice=expired")
    try:
        session.check_csrf(request, csrf)
        return _redirect(act(who))
    except RunlaneError as exc:
        return _error_page(request, exc, who, token)
    except Exception:
        return _internal_error(request, who, token)


# --- static files, sign-in ------------------------------------------------------------

@router.get("/static/{name}")
def static(name: str) -> Response:
    found = static_file(name)
    if found is None:
        return harden(Response("not found", status_code=404, media_type="text/plain"))
    body, kind = found
    response = Response(body, media_type=kind)
    response.headers["Cache-Control"] = "public, max-age=300"
    return harden(response, cache=True)


@router.get("/")
def home(request: Request) -> Response:
    return _redirect("/runs")


@router.get("/login")
def login_form(request: Request) -> Response:
    notice = NOTICES.get(request.query_params.get("notice", ""))
    return harden(page("login.html", who=None, notice=notice, error=None))


@router.post("/login")
def login(request: Request, token: Annotated[str, Form()] = "") -> Response:
    """Check the token (``Runlane.authenticate``); on success the session cookie holds
    it (session.py says why). A failure says only that it failed."""
    try:
        session.check_origin(request)
    except Forbidden as exc:
        return harden(page("login.html", status_code=403, who=None, notice=None,
                           error=str(exc)))
    secret = token.strip()
    try:
        if not secret or len(secret) > session.MAX_TOKEN_CHARS:
            raise Unauthenticated("no token")
        session.authenticate(request, secret)
    except Unauthenticated:
        return harden(page("login.html", status_code=401, who=None, notice=None,
                           error="That token is not valid (unknown, revoked or expired)."))
    except RunlaneError as exc:
        return _error_page(request, exc, None, None)
    except Exception:
        return _internal_error(request, None, None)
    response = _redirect("/runs")
    session.set_session(response, request, secret)
    return response


@router.post("/logout")
def logout(request: Request, csrf: Annotated[str | None, Form(max_length=200)] = None,
           ) -> Response:
    try:
        session.check_csrf(request, csrf)
    except Forbidden as exc:
        return _error_page(request, exc, None, None)
    response = _redirect("/login?notice=signed-out")
    session.clear_session(response, request)
    return response


# --- runs -------------------------------------------------------------------------------

def _filters(status: str | None, tenant: str | None, queue: str | None,
             repo: str | None) -> dict[str, str]:
    given = {"status": (status or "").strip().upper(), "tenant": (tenant or "").strip(),
             "queue": (queue or "").strip(), "repo": (repo or "").strip()}
    return {k: v for k, v in given.items() if v}


def _events_start(lane: Any) -> str | None:
    """The event stream's cursor of "now", taken before a page reads the database, so
    that the page's live updates miss no change made while it was rendered."""
    tail = getattr(lane, "events_tail", None)
    if tail is None:
        return None
    try:
        start: str = tail()
    except RunlaneError:
        return None
    return start


@router.get("/runs")
def runs(request: Request, status: Filter = None, tenant: Filter = None,
         queue: Filter = None, repo: Filter = None,
         cursor: Annotated[str | None, Query(max_length=500)] = None,
         limit: Annotated[int, Query(ge=1, le=100)] = 50) -> Response:
    def build(who: Principal, token: str) -> Response:
        lane = _lane(request)
        chosen = _filters(status, tenant, queue, repo)
        if who.tenant is not None:
            chosen.pop("tenant", None)
        start = _events_start(lane)
        listing = lane.runs_page(principal=who, cursor=cursor or None, limit=limit,
                                 **chosen)
        next_url = None
        if listing.next:
            next_url = "/runs?" + urlencode({**chosen, "cursor": listing.next,
                                             "limit": limit})
        first_url = "/runs" + ("?" + urlencode(chosen) if chosen else "")
        return page("runs.html", **_context(
            request, who, token, runs=listing.items, filters=chosen, next_url=next_url,
            first_url=first_url if cursor else None, first_page=not cursor, limit=limit,
            statuses=list(RunStatus), events_start=start))
    return _view(request, build)


@router.get("/runs/{run_id}/row")
def run_row(request: Request, run_id: str) -> Response:
    """One row of the runs table, for the live page to insert a new run (the error
    page's 404 when the session may not see it)."""
    def build(who: Principal, token: str) -> Response:
        detail = _lane(request).run(run_id, principal=who)
        return page("row.html", run=detail)
    return _view(request, build)


def _log_tail(artifacts_dir: Path, run_id: str, attempt_no: int) -> list[dict[str, str]]:
    """The end of each log an attempt left under the artifacts directory (readable
    ones only), credentials masked."""
    root = artifacts_dir.expanduser().absolute()
    folder = (root / run_id / str(attempt_no))
    try:
        if root not in folder.resolve().parents:
            return []
    except OSError:
        return []
    tails = []
    for name in LOG_NAMES:
        path = folder / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - LOG_TAIL_BYTES))
                data = f.read(LOG_TAIL_BYTES)
        except OSError:
            continue
        text = data.decode("utf-8", errors="replace")
        if size > LOG_TAIL_BYTES:
            text = text.split("\n", 1)[-1]
        tails.append({"name": name, "text": redact_credentials(text),
                      "cut": "yes" if size > LOG_TAIL_BYTES else ""})
    return tails


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: str) -> Response:
    def build(who: Principal, token: str) -> Response:
        lane = _lane(request)
        start = _events_start(lane)
        detail = lane.run(run_id, principal=who)
        artifacts = Path(lane.settings.artifacts_dir)
        logs = {a.attempt_no: _log_tail(artifacts, detail.run_id, a.attempt_no)
                for a in detail.attempts}
        terminal = detail.status in {s.value for s in TERMINAL}
        return page("run.html", **_context(
            request, who, token, run=detail, logs=logs, events_start=start,
            can_cancel=who.can_submit and not terminal,
            can_retry=who.can_submit and terminal,
            can_decide=who.can_approve and detail.status == "AWAITING_APPROVAL"))
    return _view(request, build)


@router.post("/runs/{run_id}/cancel")
def cancel(request: Request, run_id: str,
           csrf: Annotated[str | None, Form(max_length=200)] = None) -> Response:
    def act(who: Principal) -> str:
        lane = _lane(request)
        detail = lane.run(run_id, principal=who)
        lane.cancel(detail.task_id, principal=who)
        return f"/runs/{detail.run_id}?notice=cancel"
    return _form(request, csrf, act)


@router.post("/runs/{run_id}/retry")
def retry(request: Request, run_id: str,
          csrf: Annotated[str | None, Form(max_length=200)] = None) -> Response:
    def act(who: Principal) -> str:
        lane = _lane(request)
        detail = lane.run(run_id, principal=who)
        submission = lane.retry(detail.task_id, principal=who)
        return f"/runs/{submission.run_id}?notice=retry"
    return _form(request, csrf, act)


@router.post("/runs/{run_id}/approve")
def approve(request: Request, run_id: str,
            csrf: Annotated[str | None, Form(max_length=200)] = None,
            note: Annotated[str | None, Form(max_length=2000)] = None) -> Response:
    def act(who: Principal) -> str:
        done = _lane(request).approve(run_id, note=note or None, principal=who)
        return f"/runs/{done.run_id}?notice=approve"
    return _form(request, csrf, act)


@router.post("/runs/{run_id}/reject")
def reject(request: Request, run_id: str,
           csrf: Annotated[str | None, Form(max_length=200)] = None,
           note: Annotated[str | None, Form(max_length=2000)] = None) -> Response:
    def act(who: Principal) -> str:
        done = _lane(request).reject(run_id, note=note or None, principal=who)
        return f"/runs/{done.run_id}?notice=reject"
    return _form(request, csrf, act)


# --- fleet --------------------------------------------------------------------------------

@router.get("/workers")
def workers(request: Request) -> Response:
    def build(who: Principal, token: str) -> Response:
        found = _lane(request).workers(principal=who)
        return page("workers.html", **_context(request, who, token, workers=found))
    return _view(request, build)


@router.post("/workers/{worker_id}/drain")
def drain(request: Request, worker_id: str,
          csrf: Annotated[str | None, Form(max_length=200)] = None) -> Response:
    def act(who: Principal) -> str:
        _lane(request).drain_worker(worker_id, principal=who)
        return "/workers?notice=drain"
    return _form(request, csrf, act)


@router.get("/queues")
def queues(request: Request) -> Response:
    def build(who: Principal, token: str) -> Response:
        lane = _lane(request)
        return page("queues.html", **_context(
            request, who, token, queues=lane.queues(principal=who),
            tenants=lane.tenants(principal=who)))
    return _view(request, build)


@router.get("/policy")
def policy(request: Request) -> Response:
    def build(who: Principal, token: str) -> Response:
        lane = _lane(request)
        in_force = lane.policy(principal=who)
        try:
            versions = lane.policy_versions(principal=who)
        except Forbidden:  # the history may be the operator's alone
            versions = None
        return page("policy.html", **_context(
            request, who, token, policy=in_force, versions=versions))
    return _view(request, build)
