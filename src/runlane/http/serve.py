"""Serving the API with uvicorn: ``runlane serve`` (in the foreground) and
``runlane up --serve`` (on a thread beside maintenance and workers)."""

from __future__ import annotations

import threading

from runlane.extras import require

# The web stack is the `server` extra: without it, `runlane serve` and `up --serve` are
# refused with the install hint (runlane.extras), not an ImportError.
for _module in ("fastapi", "uvicorn", "jinja2"):
    require(_module, "runlane serve (the HTTP API and the dashboard)", "server")

import uvicorn  # noqa: E402

from runlane.api import Runlane  # noqa: E402
from runlane.http.app import create_app  # noqa: E402

# Seconds an open connection (an event stream never ends by itself) may keep a
# stopping server waiting.
GRACEFUL_SECONDS = 3


def server(lane: Runlane, host: str, port: int, *,
           keepalive_seconds: float | None = None) -> uvicorn.Server:
    kwargs = {} if keepalive_seconds is None else {"keepalive_seconds": keepalive_seconds}
    app = create_app(lane, **kwargs)
    return uvicorn.Server(uvicorn.Config(
        # log_config=None: uvicorn's records go to the root logger, where the CLI
        # renders them as its own lines (runlane.logs), not through uvicorn's handlers.
        app, host=host, port=port, log_level="warning", access_log=False, log_config=None,
        timeout_graceful_shutdown=GRACEFUL_SECONDS, lifespan="on"))


class ServerThread:
    """uvicorn on a thread (no signal handlers there: the caller owns them)."""

    def __init__(self, lane: Runlane, host: str, port: int) -> None:
        self.server = server(lane, host, port)
        self.thread = threading.Thread(target=self.server.run, name="runlane-serve",
                                       daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        """Start, and wait until it listens (or failed to)."""
        self.thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self.server.started and self.thread.is_alive() and waited < timeout:
            deadline.wait(0.05)
            waited += 0.05
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start (is the port in use?)")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=GRACEFUL_SECONDS + 5)
