"""A throw-away PgBouncer in transaction pooling mode before a PostgreSQL server: how
many production servers are reached. The fault harness puts its workers and
maintenance behind one (``--pgbouncer``); the test suite starts one per test process.

Debian's ``pgbouncer``; any database and user are passed through to the server
(``auth_type = any``, connecting as the server URL's user), on a free port of
127.0.0.1 with no Unix socket. As root it runs as ``nobody`` (it refuses root).
``server_login_retry`` 1 s (PgBouncer's default, 15 s, refuses every client for that
long after one failed server login, as during a PostgreSQL restart)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from runlane.errors import RunlaneError
from runlane.extras import require
from runlane.store.engine import build_engine

CONFIG = """\
[databases]
* = host={host} port={port} user={user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = any
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 1000
server_check_delay = 1
server_login_retry = 1
logfile =
{run_as}
"""


class PgBouncerError(RunlaneError):
    exit_code = 4


def binary() -> str | None:
    """The pgbouncer executable (Debian's is in /usr/sbin, often not on PATH)."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgBouncer:
    """A running PgBouncer; ``server`` is (host, port) of the PostgreSQL behind it."""

    port: int
    server: tuple[str, int]
    process: subprocess.Popen[bytes]
    directory: Path

    def url_for(self, server_url: str) -> str:
        """``server_url``'s database through this PgBouncer, as runlane's DATABASE_URL
        (``?pooler=transaction``)."""
        url = make_url(server_url).set(host="127.0.0.1", port=self.port)
        return url.update_query_dict({"pooler": "transaction"}).render_as_string(
            hide_password=False)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "pgbouncer.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def start(server_url: str, *, pool_size: int = 20) -> PgBouncer:
    """A PgBouncer before ``server_url``'s server, accepting connections; at most
    ``pool_size`` server sessions per database and user."""
    psycopg = require("psycopg", "PgBouncer")
    exe = binary()
    if exe is None:
        raise PgBouncerError("pgbouncer is not installed (apt-get install pgbouncer)")
    server = make_url(server_url)
    host, port = server.host or "127.0.0.1", server.port or 5432
    directory = Path(tempfile.mkdtemp(prefix="runlane-pgbouncer-"))
    directory.chmod(0o755)  # readable by nobody
    config = directory / "pgbouncer.ini"
    bouncer: PgBouncer | None = None
    for _ in range(3):  # a free port taken between the probe and the bind: another
        listen_port = _free_port()
        config.write_text(CONFIG.format(
            host=host, port=port, user=server.username or "postgres", pool_size=pool_size,
            listen_port=listen_port, run_as="user = nobody" if os.geteuid() == 0 else ""))
        config.chmod(0o644)
        with (directory / "pgbouncer.log").open("wb") as log:
            process = subprocess.Popen([exe, str(config)], stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        bouncer = PgBouncer(listen_port, (host, port), process, directory)
        probe = server.set(drivername="postgresql", host="127.0.0.1", port=listen_port) \
            .difference_update_query(["pooler"]).render_as_string(hide_password=False)
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            try:
                with psycopg.connect(probe, connect_timeout=2, prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                return bouncer
            except psycopg.OperationalError:
                time.sleep(0.05)
        if process.poll() is None:
            process.kill()
            process.wait()
    tail = bouncer.log_tail() if bouncer is not None else ""
    shutil.rmtree(directory, ignore_errors=True)
    raise PgBouncerError(f"pgbouncer did not start: {tail.strip().splitlines()[-1:] or '?'}")


def database_settings(server_url: str, *, idle_in_transaction_seconds: float) -> None:
    """Through a transaction pooler runlane sends no session settings: the database
    carries them (every new server session), as docs/running.md tells a deployment."""
    timeout = f"{idle_in_transaction_seconds * 1000:.0f}ms"
    engine = build_engine(server_url)
    try:
        with engine.begin() as conn:
            name = conn.exec_driver_sql("SELECT current_database()").scalar()
            for setting, value in (("jit", "off"), ("random_page_cost", "1.1"),
                                   ("idle_in_transaction_session_timeout", timeout)):
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" SET {setting} = \'{value}\'')
    finally:
        engine.dispose()
