"""``runlane serve``: the HTTP API and dashboard (its own module: cli.py is near its
size limit, and the web stack loads only when this command runs)."""

from __future__ import annotations

import click

from runlane.cli_common import _lane, out
from runlane.errors import RunlaneError

HOST = "127.0.0.1"
PORT = 8080


class ServeFailed(RunlaneError):
    """The server could not start (its cause is logged just before)."""


def host_port_options(fn: click.decorators.FC) -> click.decorators.FC:
    fn = click.option("--port", type=click.IntRange(0, 65535), default=PORT,
                      show_default=True, help="TCP port of the HTTP API.")(fn)
    return click.option("--host", default=HOST, show_default=True,
                        help="Address to listen on (0.0.0.0: every interface).")(fn)


def metrics_port_option(fn: click.decorators.FC) -> click.decorators.FC:
    return click.option("--metrics-port", type=click.IntRange(0, 65535), default=0,
                        show_default=True, help="Serve Prometheus metrics on this port "
                        "(on METRICS_HOST, unauthenticated; docs/metrics.md); 0: off.")(fn)


@click.command("serve")
@host_port_options
@click.option("--keepalive-seconds", type=click.FloatRange(min=0.01, max=3600), default=15.0,
              show_default=True, help="How often an idle event stream sends a comment line.")
def serve_command(host: str, port: int, keepalive_seconds: float) -> None:
    """The HTTP API (/v1, /openapi.json, /docs) and the dashboard, over the same
    settings and database as every other command; SIGTERM or Ctrl-C stops it."""
    from runlane.http.serve import server

    with _lane() as lane:
        srv = server(lane, host, port, keepalive_seconds=keepalive_seconds)
        out.print(f"runlane serve: http://{host}:{port} (API /v1, docs /docs); Ctrl-C to "
                  "stop", soft_wrap=True, highlight=False)
        try:
            srv.run()
        except SystemExit as exc:  # uvicorn's startup failure (a port in use): logged
            if exc.code:
                raise ServeFailed(f"cannot serve on {host}:{port} (see above)") from None
            raise
