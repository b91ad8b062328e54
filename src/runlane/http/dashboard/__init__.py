"""The web dashboard at ``/``: server-rendered pages (Jinja2) over the facade, signed in
with a runlane token, live over the API's event stream (``/v1/events``) with a little
plain JavaScript. ``router`` is what ``create_app`` includes; ``session`` holds the
session cookie, CSRF and the principal dependency the event stream shares."""

from runlane.http.dashboard import campaigns as _campaigns  # noqa: F401 - its routes
from runlane.http.dashboard.pages import router

__all__ = ["router"]
