"""Schema migrations (Alembic), run on runlane's own engine."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from runlane.errors import SchemaTooNew

MIGRATIONS = Path(__file__).parent / "migrations"


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def refuse_newer(revision: str | None) -> None:
    """Raise SchemaTooNew when ``revision`` is none of this runlane's migrations (a
    newer runlane migrated the database: a rolling deploy's older binary)."""
    script = ScriptDirectory.from_config(_config())
    if revision is not None and revision not in {r.revision for r in script.walk_revisions()}:
        raise SchemaTooNew(
            f"database schema is at {revision}, newer than this runlane knows (its newest "
            f"is {head_revision()}): run a runlane at least as new as the one that "
            "migrated it")


def upgrade(engine: Engine, revision: str = "head") -> tuple[str | None, str | None]:
    """Migrate to ``revision``; safe to repeat. Returns (before, after)."""
    before = current_revision(engine)
    refuse_newer(before)
    with _migrating(engine) as config:
        command.upgrade(config, revision)
    return before, current_revision(engine)


def downgrade(engine: Engine, revision: str) -> tuple[str | None, str | None]:
    """Migrate back to ``revision`` (an operator's way out of a release). Returns
    (before, after)."""
    before = current_revision(engine)
    with _migrating(engine) as config:
        command.downgrade(config, revision)
    return before, current_revision(engine)


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
