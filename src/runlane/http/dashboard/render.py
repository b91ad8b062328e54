"""Rendering the dashboard's pages: the Jinja2 environment (autoescaped), its filters,
and the security headers every dashboard response carries."""

from __future__ import annotations

from datetime import UTC, datetime
from importlib import resources
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.responses import HTMLResponse, Response

from runlane.errors import redact_credentials

# No inline script or style anywhere: scripts and styles come from /static only, so an
# injected <script> or on*= attribute does nothing.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "X-Content-Type-Options": "nosniff",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def harden(response: Response, *, cache: bool = False) -> Response:
    """The security headers; pages hold a tenant's data, so no cache keeps them."""
    response.headers.update(SECURITY_HEADERS)
    if not cache:
        response.headers["Cache-Control"] = "no-store"
    return response


def _when(value: Any) -> datetime | None:
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), UTC)
    try:
        parsed = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def ts(value: Any) -> str:
    """A point in time as UTC to the second, e.g. ``2026-12-03 02:45:18Z``."""
    when = _when(value)
    return "" if when is None else when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def duration(seconds: Any) -> str:
    """Seconds as ``2h 05m``, ``3m 20s`` or ``4.2s``."""
    if seconds is None or seconds == "":
        return ""
    try:
        s = float(seconds)
    except (TypeError, ValueError):
        return ""
    if s < 0:
        s = 0.0
    if s < 10:
        return f"{s:.1f}s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s" if whole >= 60 else f"{whole}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def age(value: Any) -> str:
    """How long ago a point in time was."""
    when = _when(value)
    if when is None:
        return ""
    return duration((datetime.now(UTC) - when).total_seconds())


def usd(value: Any) -> str:
    if value is None or value == "":
        return ""
    try:
        return f"${float(value):,.4f}".rstrip("0").rstrip(".") if float(value) else "$0"
    except (TypeError, ValueError):
        return ""


def mask(value: Any) -> str:
    """Credentials of any URL in ``value`` masked (a repository's user:token@)."""
    return "" if value is None else redact_credentials(str(value))


def status_class(value: Any) -> str:
    """The CSS class of a run status: its group, for the colour of its badge."""
    status = str(value or "").upper()
    if status == "SUCCEEDED":
        return "ok"
    if status in ("FAILED", "POLICY_DENIED", "STALE_LEASE"):
        return "bad"
    if status in ("CANCELLED", "CANCEL_REQUESTED", "CANCELLING"):
        return "off"
    if status in ("QUEUED", "ADMITTED", "AWAITING_APPROVAL", "WAITING_CAPACITY",
                  "FAILED_RETRYABLE"):
        return "wait"
    return "run"


def _environment() -> Environment:
    env = Environment(loader=PackageLoader("runlane.http.dashboard", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ts=ts, age=age, duration=duration, usd=usd, mask=mask,
                       status_class=status_class)
    return env


ENV = _environment()


def page(template: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    html = ENV.get_template(template).render(**context)
    return HTMLResponse(html, status_code=status_code)


STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".svg": "image/svg+xml"}


def static_file(name: str) -> tuple[bytes, str] | None:
    """A file of the package's static directory (by a bare name only), with its type."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    kind = next((t for ext, t in STATIC_TYPES.items() if name.endswith(ext)), None)
    if kind is None:
        return None
    path = resources.files("runlane.http.dashboard").joinpath("static", name)
    if not path.is_file():
        return None
    return path.read_bytes(), kind


def cell(value: Any, name: str) -> str:
    """A field's value as the page shows it, by the field's name: times with their
    age, durations, dollars, lists and mappings in short; credentials masked."""
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name.endswith("_at"):
        return f"{ts(value)} ({age(value)} ago)"
    if name.endswith("_seconds"):
        return duration(value)
    if name.endswith("_usd"):
        return usd(value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={cell(v, str(k))}" for k, v in value.items()) or "—"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        if items and all(isinstance(v, dict) for v in items):
            return f"{len(items)}: " + "; ".join(cell(v, "") for v in items)
        return ", ".join(cell(v, "") for v in items) or "—"
    if isinstance(value, float):
        return f"{value:g}"
    return mask(value)


ENV.filters.update(cell=cell)
