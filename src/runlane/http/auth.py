"""Who is asking: ``Authorization: Bearer <token>`` (or, on GET, the dashboard's
session cookie) → ``Runlane.authenticate`` → a Principal, a dependency of every /v1
route. A missing, unknown, revoked or expired
token is a 401 problem with ``WWW-Authenticate: Bearer``; the facade compares in
constant time and logs failures without the token."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials

from runlane.api import Runlane
from runlane.domain.access import Principal
from runlane.http.dashboard.session import bearer, request_principal


def lane_of(request: Request) -> Runlane:
    lane: Runlane = request.app.state.lane
    return lane


def principal(request: Request,
              credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
              ) -> Principal:
    """The request's principal: the bearer token, or on GET and HEAD the dashboard's
    session cookie, so that a signed-in browser's EventSource reads /v1/events (a
    write always needs the header: no other site's form can write with the cookie).
    One function with the dashboard's: ``runlane.http.dashboard.session``."""
    return request_principal(request, credentials)


Lane = Annotated[Runlane, Depends(lane_of)]
Who = Annotated[Principal, Depends(principal)]
