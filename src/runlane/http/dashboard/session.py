"""The dashboard's session: a signed-in browser's principal, its CSRF token, and the
one dependency that both the dashboard and the JSON API's event stream use to know who
is asking (a bearer token, or the browser's session cookie).

What the cookie carries: the token itself. The cookie is HttpOnly (page scripts cannot
read it), SameSite=Strict (no other site's page sends it), Path=/ and Secure over https.
Every request authenticates it again through ``Runlane.authenticate``, so a revoked or
expired token signs the browser out at its next click, with no session table to keep,
nothing lost when the server restarts, and several server processes serving one
database alike. A server-side session id would hide the token from the browser's disk
but would need a table (and its expiry and revocation) for the same effect.

CSRF: each form carries ``csrf``, an HMAC of a fixed label keyed with the session's
token (so it is per session, unguessable without the token, and needs no storage); a
POST is refused unless that field matches and its Origin (or Referer) is this server.
The sign-in form has no session yet: its POST is checked by Origin alone.

The cookie counts only on GET and HEAD requests of the JSON API (the event stream's
EventSource cannot send a header): a write through the API always needs a bearer
token, so no cross-site form can write with a browser's cookie.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.responses import Response

from runlane.domain.access import Principal
from runlane.errors import Forbidden, Unauthenticated

COOKIE = "runlane_session"
CSRF_FIELD = "csrf"
_CSRF_LABEL = b"runlane dashboard csrf v1"
# Methods that change nothing: the only ones the session cookie authenticates on the
# JSON API.
SAFE_METHODS = frozenset({"GET", "HEAD"})
# A token longer than this is no runlane token: refused before it reaches the database.
MAX_TOKEN_CHARS = 512

# auto_error=False: a missing header is our own 401 problem, not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="A runlane token "
                    "(`runlane tokens create --tenant T --role read|submit|approve|admin`).")


def session_token(request: Request) -> str | None:
    """The token the session cookie carries, or None."""
    value = request.cookies.get(COOKIE)
    if not value or len(value) > MAX_TOKEN_CHARS:
        return None
    return value


def authenticate(request: Request, secret: str) -> Principal:
    """``Runlane.authenticate`` of the app's lane (raises Unauthenticated)."""
    lane = request.app.state.lane
    who: Principal = lane.authenticate(secret)
    return who


def session_principal(request: Request) -> Principal | None:
    """The signed-in browser's principal, or None (no cookie, or its token no longer
    authenticates: revoked, expired, unknown)."""
    token = session_token(request)
    if token is None:
        return None
    try:
        return authenticate(request, token)
    except Unauthenticated:
        return None


def request_principal(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None,
) -> Principal:
    """Who is asking the JSON API: ``Authorization: Bearer <token>``, else (on GET and
    HEAD only) the dashboard's session cookie. The dependency the event stream needs so
    that a signed-in browser's EventSource may read it. A plain function: FastAPI runs
    it in its threadpool (authenticate reads the database)."""
    if credentials is not None and credentials.credentials:
        if credentials.scheme.lower() != "bearer":
            raise Unauthenticated("a bearer token is required (Authorization: Bearer <token>)")
        return authenticate(request, credentials.credentials)
    token = session_token(request) if request.method in SAFE_METHODS else None
    if token is None:
        raise Unauthenticated("a bearer token is required (Authorization: Bearer <token>)")
    return authenticate(request, token)


def csrf_token(token: str) -> str:
    """The session's CSRF token: derived from its secret, never stored."""
    return hmac.new(token.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def _same_origin(request: Request, value: str) -> bool:
    parts = urlsplit(value)
    host = request.headers.get("host", "")
    return bool(parts.scheme in ("http", "https") and parts.netloc and host
                and parts.netloc.lower() == host.lower()
                and parts.scheme == request.url.scheme)


def check_origin(request: Request) -> None:
    """Refuse a POST that another site's page sent: its Origin (or, without one, its
    Referer) must be this server; a browser sends one of them with every form."""
    origin = request.headers.get("origin")
    if origin is not None and origin != "null":
        if not _same_origin(request, origin):
            raise Forbidden("this form was sent from another site")
        return
    referer = request.headers.get("referer")
    if referer is None or not _same_origin(request, referer):
        raise Forbidden("this form was sent without an Origin of this server")


def check_csrf(request: Request, submitted: str | None) -> None:
    """A signed-in form's POST: the same origin, and the session's CSRF token."""
    check_origin(request)
    token = session_token(request)
    if token is None or not submitted \
            or not hmac.compare_digest(csrf_token(token), submitted):
        raise Forbidden("the form's CSRF token does not match this session: reload the page")


def secure(request: Request) -> bool:
    """Whether the browser talks https to us. Behind a TLS proxy, uvicorn takes the
    scheme from X-Forwarded-Proto of the proxies it trusts (--forwarded-allow-ips)."""
    return request.url.scheme == "https"


def set_session(response: Response, request: Request, token: str) -> None:
    """Sign the browser in: a session cookie (no Max-Age: gone with the browser)."""
    response.set_cookie(COOKIE, token, path="/", httponly=True, samesite="strict",
                        secure=secure(request))


def clear_session(response: Response, request: Request) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict",
                           secure=secure(request))
