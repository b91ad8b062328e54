"""A PgBouncer of the tests' own, in transaction pooling mode, in front of the test
server: how many production PostgreSQL servers are reached. Started once per test
process (the ``pgbouncer`` session fixture) on a free port; any database and any user
are passed through to the server (``auth_type = any``), so the URL of a test database
through it is that database's URL with the port changed and ``?pooler=transaction``.

Debian's ``pgbouncer`` package (the Makefile's TEST_TOOLS installs it): without it, the
PgBouncer variants skip, unless RUNLANE_REQUIRE_POSTGRES=1 (CI), where they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

CONFIG = """\
[databases]
* = host={host} port={port} user={server_user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = 20
max_client_conn = 500
ignore_startup_parameters = extra_float_digits
server_check_delay = 1
logfile =
{user}
"""


# The server behind each PgBouncer started here, by its port.
_SERVERS: dict[int, tuple[str, int]] = {}


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


@dataclass
class PgBouncer:
    port: int
    process: subprocess.Popen[bytes]
    directory: Path

    def url_for(self, direct_url: str) -> str:
        """``direct_url``'s database through this PgBouncer."""
        url = make_url(direct_url).set(host="127.0.0.1", port=self.port)
        return url.update_query_dict({"pooler": "transaction"}).render_as_string(
            hide_password=False)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def binary() -> str | None:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(server_url: str) -> PgBouncer:
    """A PgBouncer before ``server_url``'s server, accepting connections."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError("pgbouncer is not installed (apt-get install pgbouncer)")
    server = make_url(server_url)
    directory = Path(tempfile.mkdtemp(prefix="runlane-pgbouncer-"))
    # PgBouncer refuses to run as root; as root it is told to switch to nobody.
    user = "user = nobody" if os.geteuid() == 0 else ""
    directory.chmod(0o755)
    config = directory / "pgbouncer.ini"
    for attempt in range(5):
        port = free_port()
        config.write_text(CONFIG.format(host=server.host or "127.0.0.1",
                                        port=server.port or 5432, listen_port=port, user=user,
                                        server_user=server.username or "postgres"))
        config.chmod(0o644)
        log = (directory / "pgbouncer.log").open("wb")
        process = subprocess.Popen([exe, str(config)], stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
        log.close()
        bouncer = PgBouncer(port, process, directory)
        probe = make_url(server_url).set(host="127.0.0.1", port=port,
                                         drivername="postgresql")
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            try:
                with psycopg.connect(probe.render_as_string(hide_password=False),
                                     connect_timeout=2, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                _SERVERS[port] = (server.host or "127.0.0.1", server.port or 5432)
                return bouncer
            except psycopg.OperationalError:
                time.sleep(0.05)
        if process.poll() is None:
            process.kill()
            process.wait()
        if attempt == 4:
            output = (directory / "pgbouncer.log").read_text(errors="replace")
            shutil.rmtree(directory, ignore_errors=True)
            raise RuntimeError(f"pgbouncer did not start: {output[-2000:]}")
    raise AssertionError("unreachable")


def session(server_url: str) -> Iterator[PgBouncer]:
    bouncer = start(server_url)
    try:
        yield bouncer
    finally:
        bouncer.stop()
