"""The tests' PgBouncer, in transaction pooling mode, before the test server (the
fault harness's, runlane.chaos.pgbouncer): started once per test process by the
``pgbouncer`` session fixture (tests/conftest.py). A test database's URL through it is
that database's URL on its port with ``?pooler=transaction``; ``direct`` turns it back.

Debian's ``pgbouncer`` package (the Makefile's TEST_TOOLS installs it): without it, the
PgBouncer variants skip, unless RUNLANE_REQUIRE_POSTGRES=1 (CI), where they fail.
"""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy.engine import make_url

from runlane.chaos.pgbouncer import PgBouncer, binary, start

__all__ = ["PgBouncer", "binary", "direct", "listen_env", "listen_url", "session"]

# The server behind each PgBouncer started here, by its port.
_SERVERS: dict[int, tuple[str, int]] = {}


def session(server_url: str) -> Iterator[PgBouncer]:
    bouncer = start(server_url)
    _SERVERS[bouncer.port] = bouncer.server
    try:
        yield bouncer
    finally:
        bouncer.stop()


def direct(url: str) -> str:
    """A URL through one of these PgBouncers as the server's own (any other URL as
    it is): what LISTEN_DATABASE_URL names."""
    parsed = make_url(url)
    if parsed.query.get("pooler") is None or parsed.port not in _SERVERS:
        return url
    host, port = _SERVERS[parsed.port]
    return parsed.set(host=host, port=port).difference_update_query(["pooler"]) \
        .render_as_string(hide_password=False)


def listen_url(url: str) -> str | None:
    """LISTEN_DATABASE_URL of a runlane process on ``url``: through PgBouncer, the
    server itself (as a deployment's would); None otherwise."""
    server = direct(url)
    return None if server == url else server


def listen_env(url: str) -> dict[str, str]:
    """listen_url as a runlane process's environment."""
    server = listen_url(url)
    return {} if server is None else {"RUNLANE_LISTEN_DATABASE_URL": server}
