"""Who is asking: ``Authorization: Bearer <token>`` → ``Runlane.authenticate`` → a
Principal, a dependency of every /v1 route. A missing, unknown, revoked or expired
token is a 401 problem with ``WWW-Authenticate: Bearer``; the facade compares in
constant time and logs failures without the token."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from runlane.api import Runlane
from runlane.domain.access import Principal
from runlane.errors import Forbidden, Unauthenticated

# auto_error=False: a missing header is our own 401 problem, not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="A runlane token "
                    "(`runlane tokens create --tenant T --role read|submit|admin`).")


def lane_of(request: Request) -> Runlane:
    lane: Runlane = request.app.state.lane
    return lane


def principal(request: Request,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
              ) -> Principal:
    """The request's principal (a plain function: FastAPI runs it in the threadpool,
    since authenticate reads the database)."""
    if credentials is None or credentials.scheme.lower() != "bearer" \
            or not credentials.credentials:
        raise Unauthenticated("a bearer token is required (Authorization: Bearer <token>)")
    who: Principal = lane_of(request).authenticate(  # type: ignore[attr-defined]
        credentials.credentials)
    return who


def admin(who: Annotated[Principal, Depends(principal)]) -> Principal:
    """The principal of an operator-only route (audit): an admin token."""
    if not who.is_admin:
        raise Forbidden("this needs an admin token")
    return who


Lane = Annotated[Runlane, Depends(lane_of)]
Who = Annotated[Principal, Depends(principal)]
Admin = Annotated[Principal, Depends(admin)]
