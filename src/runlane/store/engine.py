"""Engines for the two supported databases, tuned for a job queue.

SQLite: WAL, a long busy timeout, and every transaction that may write opened with
``BEGIN IMMEDIATE`` so that writers queue on the file lock up front instead of
failing with "database is locked" when a read transaction tries to upgrade; reads
(``Store.reads``) begin DEFERRED and never wait for a writer.
PostgreSQL: psycopg 3, a pool sized to the machine (no pre-ping: see build_engine), and
``idle_in_transaction_session_timeout``: runlane's transactions are a few short
statements, so a session idle inside one for seconds belongs to a frozen process (a
SIGSTOP, a VM pause); the server ends it and its row locks go with it, instead of
every claim, heartbeat and reaper pass waiting until the process wakes up. The
process sees the error on its next statement, SQLAlchemy discards the connection,
and its loops retry (an attempt whose write it was is abandoned to the reaper).

Through a pooler in transaction mode (PgBouncer's ``pool_mode = transaction``, named by
the URL's ``pooler=transaction``) each transaction may run on another server session:
nothing may rest on a session's state. psycopg's server-side prepared statements are
off (a prepared ``_pg3_0`` of one client is another client's "already exists"), and
the session settings above are not sent (PgBouncer refuses the ``options`` startup
parameter): set them on the role instead (docs/running.md). LISTEN needs a session of
its own: it goes to ``LISTEN_DATABASE_URL`` (store/wakeup.py).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url

from runlane.errors import RunlaneError
from runlane.extras import require

if TYPE_CHECKING:
    from psycopg.abc import Buffer

SQLITE_BUSY_TIMEOUT_SECONDS = 60.0
# PostgreSQL's idle_in_transaction_session_timeout for runlane's sessions (0: none).
IDLE_IN_TRANSACTION_TIMEOUT_SECONDS = 5.0
# The planner settings of runlane's PostgreSQL sessions (what tests that check plans
# must use too).
# - jit off: the claim's cost estimate grows with its batch size; past jit_above_cost
#   PostgreSQL would JIT-compile every claim (7-110 ms at 1M queued runs,
#   docs/benchmarks.md) for a sub-millisecond query.
# - random_page_cost 1.1 (default 4.0, a spinning disk's ratio): runlane's hot tables
#   sit in shared buffers or on SSD, where PostgreSQL's docs advise lowering it. At
#   4.0 the ~150 primary-key probes of a claim of 50 were priced above a scan of
#   16,000 limit counters, so CLAIM_WRITE_PG read every counter (one per tenant,
#   repository and user) on such claims; now a scan wins only where the table is
#   small next to the batch (tests/test_dispatch_explain.py).
PLANNER_OPTIONS = "-c jit=off -c random_page_cost=1.1"


# The URL query parameter that says a pooler stands between runlane and PostgreSQL,
# and its mode; runlane reads it and never passes it on to libpq.
POOLER_PARAMETER = "pooler"
POOLER_MODES = ("transaction",)


class DatabaseUrlInvalid(RunlaneError):
    exit_code = 2


def pooler_of(url: str) -> str | None:
    """The pooler mode a PostgreSQL URL names (``?pooler=transaction``), or None."""
    try:
        parsed = make_url(url)
    except Exception:  # normalize_url says why
        return None
    mode = parsed.query.get(POOLER_PARAMETER)
    if mode is None:
        return None
    if isinstance(mode, tuple) or mode not in POOLER_MODES:
        raise DatabaseUrlInvalid(
            f"DATABASE_URL: {POOLER_PARAMETER}={mode!r} is not a pooler mode runlane knows "
            f"(one of: {', '.join(POOLER_MODES)})")
    if parsed.get_backend_name() != "postgresql":
        raise DatabaseUrlInvalid(f"DATABASE_URL: {POOLER_PARAMETER}= is for PostgreSQL URLs")
    return str(mode)


def normalize_url(url: str) -> str:
    """Map ``postgresql://`` to the psycopg 3 driver; leave other URLs alone."""
    try:
        parsed = make_url(url)
    except Exception as exc:  # sqlalchemy raises ArgumentError with a long message
        raise DatabaseUrlInvalid(f"DATABASE_URL {url!r} is not a database URL") from exc
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg").difference_update_query(
            [POOLER_PARAMETER]).render_as_string(hide_password=False)
    if backend == "sqlite":
        return url
    raise DatabaseUrlInvalid(
        f"DATABASE_URL {url!r}: only sqlite:/// and postgresql:// databases are supported"
    )


def dialect_of(url: str) -> str:
    return make_url(normalize_url(url)).get_backend_name()


def build_engine(url: str, pool_size: int | None = None, *,
                 idle_in_transaction_timeout: float = IDLE_IN_TRANSACTION_TIMEOUT_SECONDS,
                 bounded: bool = False) -> Engine:
    """An engine for ``url``. ``bounded``: the pool never opens more than ``pool_size``
    connections (a worker process: one, whatever its concurrency; its threads take
    turns, each transaction a few milliseconds); otherwise as many again in overflow."""
    pooler = pooler_of(url)
    url = normalize_url(url)
    if dialect_of(url) == "sqlite":
        return _sqlite_engine(url)
    # psycopg is the `postgres` extra: without it, a one-line refusal with the install
    # hint (runlane.extras), not SQLAlchemy's ImportError from inside create_engine.
    require("psycopg", "A PostgreSQL DATABASE_URL")
    size = pool_size or max(4, (os.cpu_count() or 2) * 2)
    session: dict[str, Any] = {"prepare_threshold": 2, "options": (
        f"{PLANNER_OPTIONS} -c idle_in_transaction_session_timeout="
        f"{_milliseconds(idle_in_transaction_timeout)}")}
    if pooler == "transaction":
        session = {"prepare_threshold": None}
    engine = create_engine(
        url,
        pool_size=size,
        max_overflow=0 if bounded else size,
        # No pre-ping: it cost a round trip per transaction (one in five of a batched
        # completion). A pooled session that died meanwhile fails on its transaction's
        # first statement and Store._transaction runs the transaction again on a fresh
        # connection (SQLAlchemy invalidates the pool's older connections too); TCP
        # keepalives and tcp_user_timeout surface a silent partition within seconds.
        # pool_recycle bounds a session's age (server-side state, memory).
        pool_recycle=1800,
        # psycopg 3 prepares statements after this many executions of the same text
        # (session: never through a transaction pooler, module docstring).
        # TCP keepalives and a user timeout: a silent network partition surfaces as an
        # error within seconds instead of a call that never returns.
        connect_args={"application_name": "runlane",
                      "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 5,
                      "keepalives_interval": 2, "keepalives_count": 3,
                      "tcp_user_timeout": 15000, **session},
    )
    event.listen(engine, "connect", _fast_arrays)
    return engine


@functools.cache
def array_literal_dumper() -> type[Any]:
    """The ``ArrayLiteralDumper`` class, defined on first use: it subclasses psycopg's
    dumper, and psycopg is imported only for a PostgreSQL database."""
    from psycopg.types.array import ListDumper

    class ArrayLiteralDumper(ListDumper):
        """psycopg's text dumper of a list (an array parameter), with a fast path for the
        arrays runlane sends (run ids, statuses, scopes, counts): every element quoted and
        escaped in one join, where psycopg runs a regular expression per element (30 us for
        ten run ids; a batched completion sends eight arrays). The same values reach the
        server; any other list (floats, nested, a NUL byte) goes psycopg's way."""

        def dump(self, obj: list[Any]) -> Buffer | None:
            parts = []
            for item in obj:
                kind = type(item)
                if kind is str:
                    parts.append('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"')
                elif kind is int:
                    parts.append(str(item))
                elif item is None:
                    parts.append("NULL")
                else:
                    return super().dump(obj)
            literal = "{" + ",".join(parts) + "}"
            if "\x00" in literal or self._tx.encoding != "utf-8":
                return super().dump(obj)
            return literal.encode()

    return ArrayLiteralDumper


def _fast_arrays(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.adapters.register_dumper(list, array_literal_dumper())


def _milliseconds(seconds: float) -> int:
    """A PostgreSQL timeout setting: whole milliseconds, at least 1 unless off (0)."""
    return max(1, round(seconds * 1000)) if seconds > 0 else 0


# The size the WAL file is cut back to once a checkpoint has copied it all.
SQLITE_WAL_SIZE_LIMIT_BYTES = 64 * 1024 * 1024


def _sqlite_engine(url: str) -> Engine:
    engine = create_engine(
        url,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS, "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite so that BEGIN IMMEDIATE is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
        # A long reader (a backup, an sqlite3 shell) lets the WAL grow past its usual
        # few MB; without a limit it kept its largest size on disk for good.
        cursor.execute(f"PRAGMA journal_size_limit={SQLITE_WAL_SIZE_LIMIT_BYTES}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # Reads (Store.reads: execution option sqlite_begin="DEFERRED") take no lock
        # up front: in WAL they never wait for a writer. Everything else is IMMEDIATE
        # (a `runs list` waited out a long write, and past the busy timeout failed
        # with "database is locked").
        mode = connection.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        connection.exec_driver_sql("BEGIN DEFERRED" if mode == "DEFERRED" else "BEGIN IMMEDIATE")

    return engine


def sqlite_file(url: URL | str) -> Path | None:
    """The file of a SQLite URL, or None for an in-memory database. A URI filename
    (``sqlite:///file:/srv/runlane.db?mode=ro&uri=true``, SQLAlchemy's documented way to
    open the file read-only) names its file in the URI's path."""
    if isinstance(url, str):
        url = make_url(url)
    database = url.database
    if url.query.get("uri") in ("true", "1") and database and database.startswith("file:"):
        parts = urlsplit(database)
        if parse_qs(parts.query).get("mode") == ["memory"] \
                or url.query.get("mode") == "memory":
            return None
        database = unquote(parts.path)
    if database in (None, "", ":memory:"):
        return None
    return Path(database)
