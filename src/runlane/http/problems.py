"""Errors as ``application/problem+json`` (RFC 9457), with the CLI's reason codes and
exit codes: a client reads the same refusal the command line prints.

Every RunlaneError maps here by its class (and, for one the table does not name, by its
exit code), request validation errors become 422 problems, and anything unexpected a
500 problem with no detail (the traceback goes to the server's log, never to the
client: it could name SQL, paths or values)."""

from __future__ import annotations

import re
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

from runlane.api import InvalidArgument
from runlane.domain.policy import PolicyInvalid
from runlane.domain.tasks import TaskInvalid
from runlane.errors import (
    Conflict,
    DatabaseUnavailable,
    Forbidden,
    NotFound,
    RunlaneError,
    SchemaOutdated,
    SchemaTooNew,
    Unauthenticated,
)

log = structlog.get_logger("runlane.http")

PROBLEM_JSON = "application/problem+json"


class Problem(BaseModel):
    """What went wrong, as the CLI would say it: ``reason_code`` and ``exit_code`` are
    the command line's."""

    type: str = Field(description="A URI naming the kind of problem.")
    title: str
    status: int
    detail: str
    reason_code: str
    exit_code: int


# Class → (HTTP status, reason code). The first class in the exception's MRO that is
# listed wins (an exception of a subclass maps as its closest listed ancestor).
STATUS: dict[type[Exception], tuple[int, str]] = {
    NotFound: (404, "NOT_FOUND"),
    Unauthenticated: (401, "UNAUTHENTICATED"),
    Forbidden: (403, "FORBIDDEN"),
    Conflict: (409, "IDEMPOTENCY_CONFLICT"),
    InvalidArgument: (422, "INVALID_ARGUMENT"),
    TaskInvalid: (422, "TASK_CONTRACT_INVALID"),
    PolicyInvalid: (422, "POLICY_INVALID"),
    DatabaseUnavailable: (503, "DATABASE_UNAVAILABLE"),
    SchemaOutdated: (503, "SCHEMA_OUTDATED"),
    SchemaTooNew: (503, "SCHEMA_TOO_NEW"),
}
# A RunlaneError not listed above, by its exit code: bad input, not found, database;
# anything else is an operation refused in the state things are in.
BY_EXIT_CODE = {2: 422, 3: 404, 4: 503}
TITLES = {400: "Bad request", 401: "Unauthenticated", 403: "Forbidden", 404: "Not found",
          405: "Method not allowed", 409: "Conflict", 422: "Invalid input",
          500: "Internal error", 503: "Service unavailable"}
EXIT_CODES = {401: 2, 403: 2, 404: 3, 405: 2, 409: 2, 422: 2, 500: 70, 503: 4}
# The problem responses every /v1 route may answer, for its OpenAPI entry.
COMMON = {code: {"model": Problem, "content": {PROBLEM_JSON: {}}}
          for code in (401, 403, 404, 422, 503)}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def problem(status: int, detail: str, reason_code: str, exit_code: int | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    body = Problem(type=f"urn:runlane:problem:{reason_code.lower()}",
                   title=TITLES.get(status, "Error"), status=status, detail=detail,
                   reason_code=reason_code,
                   exit_code=EXIT_CODES.get(status, 1) if exit_code is None else exit_code)
    return JSONResponse(body.model_dump(), status_code=status, media_type=PROBLEM_JSON,
                        headers=headers)


def for_error(exc: Exception) -> JSONResponse:
    """The problem of a refusal the facade raised."""
    status, reason = 409, getattr(exc, "reason_code", None) or _snake(type(exc).__name__)
    for cls in type(exc).__mro__:
        if cls in STATUS:
            status, reason = STATUS[cls]
            break
    else:
        status = BY_EXIT_CODE.get(getattr(exc, "exit_code", 1), 409)
    # A class's own reason (Conflict's, a TaskInvalid's) is more precise than the table's.
    own = getattr(exc, "reason_code", None) or getattr(exc, "reason", None)
    if isinstance(own, str) and own:
        reason = own
    exit_code = getattr(exc, "exit_code", 2 if isinstance(exc, ValueError) else 1)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return problem(status, str(exc) or TITLES.get(status, "Error"), reason, exit_code,
                   headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "request"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into a problem."""

    @app.exception_handler(RunlaneError)
    async def runlane_error(_request: Request, exc: RunlaneError) -> JSONResponse:
        return for_error(exc)

    @app.exception_handler(TaskInvalid)
    async def task_invalid(_request: Request, exc: TaskInvalid) -> JSONResponse:
        return for_error(exc)

    @app.exception_handler(PolicyInvalid)
    async def policy_invalid(_request: Request, exc: PolicyInvalid) -> JSONResponse:
        return for_error(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return problem(422, _validation_detail(exc), "INVALID_ARGUMENT", 2)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED", 401: "UNAUTHENTICATED",
                  403: "FORBIDDEN"}.get(exc.status_code, "HTTP_ERROR")
        headers: dict[str, Any] = dict(exc.headers or {})
        if exc.status_code == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        return problem(exc.status_code, str(exc.detail), reason, headers=headers or None)

    @app.exception_handler(DBAPIError)
    async def database_error(_request: Request, exc: DBAPIError) -> JSONResponse:
        # The facade reports an unreachable database itself; what reaches here is a
        # value the database refused: say so without its SQL.
        first = (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0]
        if isinstance(exc, DataError):
            return problem(422, f"a value the database refuses: {first}", "INVALID_ARGUMENT", 2)
        if isinstance(exc, IntegrityError):
            return problem(409, f"the database refused the write: {first}", "CONFLICT", 1)
        log.warning("database_error", error=first)
        return problem(503, f"database: {first}", "DATABASE_UNAVAILABLE", 4)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error("internal_error", path=request.url.path, exc_info=exc)
        return problem(500, "internal error (the server's log has the details)",
                       "INTERNAL_ERROR", 70)
