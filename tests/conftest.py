"""Real-database fixtures: every lifecycle test runs on SQLite and on PostgreSQL.

PostgreSQL: one database per xdist worker (``runlane_test_<worker>``), migrated
once, truncated before each test. The lifecycle and worker suites run a third time
through PgBouncer in transaction pooling mode (``postgresql-pgbouncer``: that database
through the tests' own PgBouncer, tests/pgbouncer.py). When no server answers, PostgreSQL tests skip
with a loud reason, unless RUNLANE_REQUIRE_POSTGRES=1 (CI), where they fail.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import settings as hypothesis_settings
from sqlalchemy.engine import make_url

from runlane.clock import ManualClock
from runlane.domain.retry import RetryPolicy
from runlane.logs import configure_logging
from runlane.store import schema
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store

from . import pgbouncer as pgbouncer_support

hypothesis_settings.register_profile("ci", max_examples=100, deadline=None)
hypothesis_settings.register_profile("dev", max_examples=60, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

ADMIN_URL = os.environ.get("RUNLANE_TEST_POSTGRES_URL",
                           "postgresql://postgres@127.0.0.1:5432/test")
REQUIRE_POSTGRES = os.environ.get("RUNLANE_REQUIRE_POSTGRES") == "1"
# Every table of the schema, children before parents (DELETE order): from the schema
# itself, so that a table a migration adds is emptied too (lane_blocks once was not,
# and a test saw the blocks an earlier test left).
TABLES = ", ".join(t.name for t in reversed(schema.metadata.sorted_tables))
T0 = 1_800_000_000.0  # a pinned "now" for tests on the manual clock


def _libpq(url: str) -> str:
    """libpq's form of a test URL (runlane's ``?pooler=`` is not libpq's)."""
    return make_url(url).set(drivername="postgresql").difference_update_query(
        ["pooler"]).render_as_string(hide_password=False)


def create_pg_database(name: str) -> str:
    """Create (or recreate) an empty database next to the admin one; return its URL."""
    try:
        with psycopg.connect(_libpq(ADMIN_URL), autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        reason = (f"PostgreSQL not reachable at {ADMIN_URL}: {str(exc).strip().splitlines()[0]}")
        if REQUIRE_POSTGRES:
            pytest.fail(f"RUNLANE_REQUIRE_POSTGRES=1 but {reason}")
        warnings.warn(f"SKIPPING PostgreSQL tests: {reason}", stacklevel=1)
        pytest.skip(f"SKIPPING PostgreSQL tests: {reason}")
    return make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)


# One name per test process (each xdist worker is a process): two test sessions on
# one server, e.g. a developer's and a helper's, never drop each other's databases.
RUN_TAG = f"{os.getpid()}"


def drop_pg_database(name: str) -> None:
    with psycopg.connect(_libpq(ADMIN_URL), autocommit=True, connect_timeout=3) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# The three claim paths: SQLite, PostgreSQL's one-statement claim and PostgreSQL's
# transaction claim (the one statement switched off).
CLAIM_PATHS = ["sqlite", "postgresql", "postgresql-transaction"]


def claim_path_database(request: pytest.FixtureRequest, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty database for one of CLAIM_PATHS (``request.param``)."""
    if request.param == "postgresql-transaction":
        monkeypatch.setattr(Store, "_claim_in_one_trip", lambda *args, **kwargs: None)
    return empty_database(request, request.param.removesuffix("-transaction"), tmp_path)


@pytest.fixture
def pg_databases() -> Iterator[Callable[[str], str]]:
    """A factory of empty PostgreSQL databases for one test: a name in, its URL out;
    all dropped after the test (FORCE: also closes the test's pooled connections)."""
    names: list[str] = []

    def make(name: str) -> str:
        names.append(name)
        return create_pg_database(name)

    yield make
    for name in names:
        drop_pg_database(name)


def migrated_pg_database(name: str) -> Iterator[str]:
    """A fresh, migrated database for the whole session, dropped afterwards."""
    url = create_pg_database(name)
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    drop_pg_database(name)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    yield from migrated_pg_database(f"runlane_test_{RUN_TAG}")


def truncate_pg(url: str) -> None:
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[pgbouncer_support.PgBouncer]:
    """The tests' PgBouncer (transaction pooling) before the test server, once per
    test process."""
    if pgbouncer_support.binary() is None:
        reason = "pgbouncer is not installed (apt-get install pgbouncer; make test does)"
        if REQUIRE_POSTGRES:
            pytest.fail(f"RUNLANE_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(f"SKIPPING PgBouncer tests: {reason}")
    yield from pgbouncer_support.session(ADMIN_URL)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database of each kind."""
    return empty_database(request, request.param, tmp_path)


# The kinds of the lifecycle and worker suites: each kind of database, and PostgreSQL
# through PgBouncer in transaction pooling mode (those modules' own ``db_url``).
WITH_PGBOUNCER = ["sqlite", "postgresql", "postgresql-pgbouncer"]


def db_url_with_pgbouncer(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """``db_url`` over WITH_PGBOUNCER (``request.param``)."""
    return empty_database(request, request.param, tmp_path)


def migrated_sqlite(path: Path) -> str:
    """A new SQLite file at ``path``, migrated to head: its URL."""
    url = f"sqlite:///{path}"
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One SQLite file migrated to head per test process, copied for each test: the
    migrations take about 0.2 s a file, and a thousand tests start from an empty one."""
    path = tmp_path_factory.mktemp("sqlite_template") / "template.db"
    migrated_sqlite(path)
    assert not Path(f"{path}-wal").exists()  # checkpointed: the file alone is the database
    return path


def empty_database(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> str:
    """A migrated, empty database: ``kind`` is "sqlite", "postgresql" or
    "postgresql-pgbouncer" (the PostgreSQL one through the tests' PgBouncer)."""
    if kind == "sqlite":
        path = tmp_path / "runlane.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url = str(request.getfixturevalue("pg_url"))
    truncate_pg(url)
    if kind == "postgresql-pgbouncer":
        return request.getfixturevalue("pgbouncer").url_for(url)  # type: ignore[no-any-return]
    return url


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


POLICY = RetryPolicy(base_seconds=10.0, max_seconds=100.0, max_attempts=3)


@pytest.fixture
def store(db_url: str, clock: ManualClock) -> Iterator[Store]:
    s = Store(db_url, clock=clock, retry_policy=POLICY, rng=random.Random(1))
    yield s
    s.close()


@pytest.fixture(autouse=True)
def info_logging() -> None:
    """The tests read runlane's INFO lines (structlog's capture_logs sees what the level
    lets through): each test starts configured as an application would, whatever an
    earlier test in the process left (a library import alone is quiet: WARNING)."""
    configure_logging("INFO", json=False)
