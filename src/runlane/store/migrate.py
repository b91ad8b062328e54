"""Schema migrations (Alembic), run on runlane's own engine.

Every command checks the schema's version before its first statement; that check reads
the revisions from the migration files and the version from ``alembic_version`` without
importing Alembic (which took 0.05 s of every command's start). Alembic itself
is imported to migrate.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from sqlalchemy import Connection, Engine, inspect, text

from runlane.errors import SchemaTooNew

MIGRATIONS = Path(__file__).parent / "migrations"
# The key of the PostgreSQL advisory lock every `runlane db upgrade` (and downgrade)
# holds while it migrates: "runlane" in ASCII. Never change it: runlanes of different
# versions in one rolling deploy must exclude each other.
MIGRATION_LOCK_KEY = 0x72756E6C616E65
LOCK_POLL_SECONDS = 0.5

if TYPE_CHECKING:
    from alembic.config import Config

log = structlog.get_logger("runlane.migrations")

_REVISION = re.compile(r"""^revision\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""", re.MULTILINE)
_DOWN = re.compile(r"""^down_revision\s*(?::[^=]*)?=\s*(?:["']([^"']+)["']|None)""",
                   re.MULTILINE)


def _config() -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


@functools.cache
def _revisions() -> dict[str, str | None]:
    """Each migration's revision and the one it follows, read from its file."""
    found: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        if path.name.startswith("_"):
            continue
        source = path.read_text()
        revision, down = _REVISION.search(source), _DOWN.search(source)
        if revision is None or down is None:
            raise RuntimeError(f"{path}: no revision or down_revision")
        found[revision.group(1)] = down.group(1)
    return found


def head_revision() -> str:
    """The newest migration: the one no other follows (the chain is linear)."""
    revisions = _revisions()
    heads = set(revisions) - {down for down in revisions.values() if down}
    if len(heads) != 1:
        raise RuntimeError(f"migrations have {len(heads)} heads: {sorted(heads)}")
    return heads.pop()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def refuse_newer(revision: str | None) -> None:
    """Raise SchemaTooNew when ``revision`` is none of this runlane's migrations (a
    newer runlane migrated the database: a rolling deploy's older binary)."""
    if revision is not None and revision not in _revisions():
        raise SchemaTooNew(
            f"database schema is at {revision}, newer than this runlane knows (its newest "
            f"is {head_revision()}): run a runlane at least as new as the one that "
            "migrated it")


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Migrate to ``revision``; safe to repeat, also from several hosts at once (a
    deploy's pods): they take turns, and each reads the version only once it is its
    turn. Returns (before, after)."""
    with migration_lock(engine):
        before = current_revision(engine)
        refuse_newer(before)
        from alembic import command

        with _migrating(engine) as config:
            command.upgrade(config, revision)
        return before, current_revision(engine)


def downgrade(engine: Engine, revision: str) -> tuple[str | None, str | None]:
    """Migrate back to ``revision`` (an operator's way out of a release). Returns
    (before, after)."""
    with migration_lock(engine):
        before = current_revision(engine)
        from alembic import command

        with _migrating(engine) as config:
            command.downgrade(config, revision)
        return before, current_revision(engine)


@contextmanager
def migration_lock(engine: Engine) -> Iterator[None]:
    """On PostgreSQL, hold runlane's migration lock until the block ends; waits while
    another migration holds it. Two upgrades at once otherwise both create the same
    tables and columns, and one drops the index the other is building online.

    A session-level advisory lock on a connection of its own, not a transaction lock:
    an online index build commits part-way through a migration (online_index), which
    would release a transaction-level lock in the middle. The connection sits outside
    any transaction while it holds the lock, so idle_in_transaction_session_timeout
    never ends it; if the process dies the server drops the lock with its session.
    It is polled for, not waited on with pg_advisory_lock: a statement waiting holds
    a snapshot, and the holder's ``CREATE INDEX CONCURRENTLY`` waits for every older
    snapshot to go, so each would wait for the other forever, unseen by the
    deadlock detector. SQLite needs none: a migration is one write transaction on the file."""
    if engine.dialect.name != "postgresql":
        yield
        return
    key = {"key": MIGRATION_LOCK_KEY}
    conn = engine.connect()
    try:
        waiting = False
        while not conn.execute(text("SELECT pg_try_advisory_lock(:key)"), key).scalar():
            conn.commit()
            if not waiting:
                log.warning("migration_waiting",
                            message="another runlane is migrating this database; waiting")
                waiting = True
            time.sleep(LOCK_POLL_SECONDS)
        conn.commit()
        yield
        conn.execute(text("SELECT pg_advisory_unlock(:key)"), key)
        conn.commit()
    except BaseException:
        # The lock may still be held (an error after taking it, an interrupted wait):
        # never hand such a session back to the pool.
        conn.invalidate()
        raise
    finally:
        conn.close()


@contextmanager
def _migrating(engine: Engine) -> Iterator[Config]:
    """Alembic's config on one connection of ``engine``, committed if the migration
    returns; on SQLite with foreign key enforcement off meanwhile (see below)."""
    config = _config()
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:
            _sqlite_foreign_keys(conn, on=False)
        try:
            config.attributes["connection"] = conn
            yield config
            conn.commit()
        finally:
            if sqlite:
                conn.rollback()
                _sqlite_foreign_keys(conn, on=True)


def _sqlite_foreign_keys(conn: Connection, *, on: bool) -> None:
    """SQLite rebuilds a table to change its constraints (Alembic's batch mode): with
    enforcement on, dropping the old table would delete or refuse its children. The
    pragma is a no-op inside a transaction, so it is set on the driver's connection,
    between transactions; migrations that rebuild check ``PRAGMA foreign_key_check``
    themselves before they commit (SQLite's documented procedure)."""
    driver = conn.connection.driver_connection
    assert driver is not None
    driver.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")
