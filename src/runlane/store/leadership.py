"""The maintenance lock: which of several ``up`` / ``maintain`` nodes on one database
runs the maintenance passes (services/leader.py).

PostgreSQL: a session-level advisory lock held on a dedicated connection of its own,
in autocommit. The lock lives as long as that session: when the node dies (its socket
closes) or the server restarts, PostgreSQL releases it and another node's next try
gets it. A session lock does not survive a transaction pooler (PgBouncer hands the
session to another client after each transaction), so this connection must reach the
server directly: ``maintenance_lock_url`` says which URL (the one LISTEN uses).

SQLite: ``flock`` on ``<database>-maintain.lock`` beside the file (as the claim gate's
``<database>-claim.lock``): every node on one SQLite file shares the machine, and the
kernel drops the lock with the process that held it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Any, Protocol

import structlog

from runlane.extras import require
from runlane.store.engine import dialect_of, sqlite_file
from runlane.store.wakeup import listen_url

log = structlog.get_logger("runlane.leadership")

# The lock file of a SQLite database: its file's name with this suffix.
MAINTENANCE_LOCK_SUFFIX = "-maintain.lock"
# The advisory lock's key ("runlane" in ASCII; advisory locks are per database, so two
# runlane databases on one server do not share it).
MAINTENANCE_LOCK_KEY = 0x72756E6C616E65
TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
# A statement on the lock's session: it fails when the session is gone (a restart,
# pg_terminate_backend), and with it the lock.
SESSION_ALIVE = "SELECT 1"


def maintenance_lock_url(database_url: str, listen_database_url: str | None = None
                         ) -> str | None:
    """The URL the maintenance lock connects to: the server directly, as LISTEN does
    (``LISTEN_DATABASE_URL``, else ``DATABASE_URL`` unless it goes through a
    transaction pooler). None: nowhere to hold a session."""
    return listen_url(database_url, listen_database_url)


class MaintenanceLock(Protocol):
    """Held by at most one node of a database at a time."""

    def try_acquire(self) -> bool:
        """Take the lock if it is free; whether this node now holds it."""

    def still_held(self) -> bool:
        """Whether the lock taken is still this node's (False: lost; released)."""

    def release(self) -> None:
        """Let it go (idempotent)."""


class AdvisoryLock:
    """PostgreSQL: ``pg_try_advisory_lock`` on a connection of its own."""

    def __init__(self, url: str, *, check_seconds: float = 1.0) -> None:
        from runlane.store.wakeup import libpq_url

        require("psycopg", "A PostgreSQL DATABASE_URL")
        self.dsn = libpq_url(url)
        # A node that vanished without closing its socket (a machine lost) is noticed
        # by TCP keepalives on both sides within a few checks, not the system's hours.
        self.keepalive = max(1, round(check_seconds))
        self._conn: Any = None

    def _connect(self) -> Any:
        import psycopg

        k = self.keepalive
        conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(2, 2 * k),
                               keepalives=1, keepalives_idle=k, keepalives_interval=k,
                               keepalives_count=3, application_name="runlane-maintenance")
        for name, value in (("tcp_keepalives_idle", k), ("tcp_keepalives_interval", k),
                            ("tcp_keepalives_count", 3)):
            conn.execute(f"SET {name} = {int(value)}")
        return conn

    def try_acquire(self) -> bool:
        import psycopg

        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            row = self._conn.execute(TRY_LOCK, (MAINTENANCE_LOCK_KEY,)).fetchone()
        except psycopg.Error as exc:
            log.warning("maintenance_lock_unreachable",
                        error=(str(exc).strip().splitlines() or [""])[0])
            self.release()
            return False
        return bool(row and row[0])

    def still_held(self) -> bool:
        import psycopg

        if self._conn is None:
            return False
        try:
            self._conn.execute(SESSION_ALIVE).fetchone()
            return True
        except psycopg.Error:
            self.release()
            return False

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # The session ends: its advisory locks go with it (a dead connection's
            # were already released by the server).
            with contextlib.suppress(Exception):
                conn.close()


class FileLock:
    """SQLite: ``flock`` on the lock file beside the database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def still_held(self) -> bool:
        return self._fd is not None  # a file lock is lost only with the process

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


class NoLock:
    """No election: a database in memory (one process, so one node), or a server
    reached only through a transaction pooler."""

    def try_acquire(self) -> bool:
        return True

    def still_held(self) -> bool:
        return True

    def release(self) -> None:
        pass


def maintenance_lock(database_url: str, *, listen_database_url: str | None = None,
                     check_seconds: float = 1.0) -> MaintenanceLock:
    """The lock that elects this database's maintenance leader. Behind a transaction
    pooler without ``LISTEN_DATABASE_URL`` there is none: every node runs the passes
    (they are safe side by side, only wasteful), with a warning."""
    if dialect_of(database_url) == "postgresql":
        direct = maintenance_lock_url(database_url, listen_database_url)
        if direct is None:
            log.warning("maintenance_lock_unavailable",
                        message="DATABASE_URL goes through a transaction pooler and "
                                "LISTEN_DATABASE_URL is not set: no maintenance leader "
                                "election; every node runs the maintenance passes")
            return NoLock()
        return AdvisoryLock(direct, check_seconds=check_seconds)
    database = sqlite_file(database_url)
    if database is None:
        return NoLock()
    return FileLock(Path(str(database.expanduser().absolute()) + MAINTENANCE_LOCK_SUFFIX))
