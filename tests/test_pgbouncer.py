"""Bounded connections and PostgreSQL through PgBouncer in transaction pooling mode:
what a worker process and `runlane up` hold on the server while running real runs,
LISTEN on LISTEN_DATABASE_URL and the polling fallback without it, and the settings
and schema upgrade through a pooler. (The lifecycle and worker suites run through the
tests' PgBouncer too: their ``postgresql-pgbouncer`` parameter.)"""

# ruff: noqa: F811  (fixtures of test_worker, imported, are parameters here)
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from structlog.testing import capture_logs

from runlane.api import InvalidArgument, Runlane
from runlane.settings import Settings, SettingsInvalid, load_settings
from runlane.store import wakeup
from runlane.store.core import WAKEUP_CHANNEL
from runlane.store.engine import DatabaseUrlInvalid, build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store
from runlane.store.wakeup import LISTEN_APPLICATION, Listener

from . import pgbouncer as pgbouncer_support
from .conftest import RUN_TAG, _libpq, empty_database
from .support import spec
from .test_worker import (  # noqa: F401 - fixtures
    ROOT,
    WorkerProcess,
    forge_dir,
    pull_requests,
    remote,
    run_worker,
    status_of,
    wait_until,
)

# The agent of the connection tests: long enough that a worker's attempts overlap.
SLOW_AGENT = "sleep 1.5; echo change-$RUNLANE_ATTEMPT > change.txt"


@pytest.fixture
def pg(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty migrated PostgreSQL database, reached directly."""
    return empty_database(request, "postgresql", tmp_path)


@pytest.fixture
def own_pg(pg_databases: Callable[[str], str]) -> str:
    """A migrated PostgreSQL database of this test's own: the session-wide one also
    holds the idle pooled connections of the tests before it, which a count of the
    database's sessions would see."""
    url = pg_databases(f"runlane_connections_{RUN_TAG}")
    engine = build_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    return url


@pytest.fixture
def pooled(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same database through the tests' PgBouncer (transaction pooling)."""
    return empty_database(request, "postgresql-pgbouncer", tmp_path)


class ConnectionWatch:
    """Samples, on a thread, runlane's sessions on a database (pg_stat_activity by
    application_name) and its runs being worked on; keeps the largest of each."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.most_connections = 0
        self.most_running = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with psycopg.connect(_libpq(self.url), autocommit=True,
                             application_name="runlane-test-watch") as conn:
            while not self._stop.is_set():
                row = conn.execute(
                    "SELECT (SELECT count(*) FROM pg_stat_activity WHERE datname = "
                    "current_database() AND application_name IN ('runlane', %s, "
                    "'runlane-maintenance')), "
                    "(SELECT count(*) FROM runs WHERE status = 'RUNNING')",
                    (LISTEN_APPLICATION,)).fetchone()
                assert row is not None
                self.most_connections = max(self.most_connections, int(row[0]))
                self.most_running = max(self.most_running, int(row[1]))
                self._stop.wait(0.02)


def _submit(url: str, remote: Path, n: int) -> list[str]:
    """Submit ``n`` runs and close the store: its connections are not the worker's."""
    store = Store(url)
    try:
        return [s.run_id for s in store.submit([spec(repo=str(remote)) for _ in range(n)])]
    finally:
        store.close()


def test_a_worker_process_holds_two_connections_whatever_its_concurrency(
        own_pg: str, remote: Path, forge_dir: Path, tmp_path: Path) -> None:
    run_ids = _submit(own_pg, remote, 8)
    with ConnectionWatch(own_pg) as watch:
        worker = WorkerProcess(own_pg, tmp_path, forge_dir, SLOW_AGENT, "--concurrency", "4",
                               "--exit-when-idle")
        try:
            assert worker.wait(timeout=90) == 0
        finally:
            worker.stop()
    store = Store(own_pg)
    try:
        assert [status_of(store, r) for r in run_ids] == ["SUCCEEDED"] * 8
    finally:
        store.close()
    assert watch.most_running == 4  # its four attempts did run at once
    # One pooled connection for every thread of the process, one LISTEN.
    assert 1 <= watch.most_connections <= 2, watch.most_connections


def test_up_holds_two_per_worker_process_and_four_for_its_maintenance(
        own_pg: str, remote: Path, forge_dir: Path, tmp_path: Path) -> None:
    run_ids = _submit(own_pg, remote, 8)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"RUNLANE_FORGE_DIR": str(forge_dir),
                "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
                "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
                "RUNLANE_HEARTBEAT_SECONDS": "0.3",
                "RUNLANE_REAPER_INTERVAL_SECONDS": "0.2"})
    with ConnectionWatch(own_pg) as watch:
        up = subprocess.Popen([sys.executable, "-m", "runlane", "--database-url", own_pg, "up",
                               "--workers", "2", "--concurrency", "2", "--exit-when-idle",
                               "--agent-command", SLOW_AGENT],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            assert up.wait(timeout=90) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    store = Store(own_pg)
    try:
        assert [status_of(store, r) for r in run_ids] == ["SUCCEEDED"] * 8
    finally:
        store.close()
    assert watch.most_running == 4
    # 2 per worker process; maintenance: 2 pooled, the scheduler's LISTEN, the lock.
    assert watch.most_connections <= 2 * 2 + 4, watch.most_connections


def test_through_a_transaction_pooler_listen_goes_to_listen_database_url(
        pooled: str) -> None:
    direct = pgbouncer_support.direct(pooled)
    store = Store(pooled, listen_url=direct)
    try:
        with Listener(pooled, listen_database_url=store.listen_url) as listener:
            assert listener.enabled and listener.url == direct
            assert listener.wait_connected()
            store.submit([spec()])
            woken = listener.wait(10)
        assert WAKEUP_CHANNEL in {w.channel for w in woken}
    finally:
        store.close()


def test_without_listen_database_url_a_worker_polls_and_warns_once(
        pooled: str, remote: Path, forge_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wakeup, "_warned_unavailable", False)
    settings = Settings(database_url=pooled, workspace_dir=tmp_path / "workspaces",
                        artifacts_dir=tmp_path / "artifacts", heartbeat_seconds=0.2,
                        agent_term_grace_seconds=0.5)
    with Runlane(settings=settings) as lane, capture_logs() as logs:
        run_id = lane.submit("acme", str(remote), "improve the code").run_id
        Listener(pooled)  # a second listener of the process: no second warning
        run_worker(lane, forge_dir, "echo change > change.txt")
        assert lane.run(run_id)["status"] == "SUCCEEDED"
    warnings = [e for e in logs if e["event"] == "listen_unavailable"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert len(pull_requests(forge_dir, remote)) == 1


def test_a_schema_upgrade_through_a_pooler_runs_on_the_direct_url(pooled: str) -> None:
    with Runlane(settings=Settings(database_url=pooled)) as lane, \
            pytest.raises(InvalidArgument, match="LISTEN_DATABASE_URL"):
        lane.upgrade_schema()
    direct = pgbouncer_support.direct(pooled)
    with Runlane(settings=Settings(database_url=pooled, listen_database_url=direct)) as lane:
        before, after = lane.upgrade_schema()
        assert before == after  # migrated already: nothing to do, and no error


def test_bad_pooler_and_listen_urls_are_refused_naming_the_setting(pg: str) -> None:
    with pytest.raises(DatabaseUrlInvalid, match="pooler='session'"):
        build_engine(pg + "?pooler=session")
    with pytest.raises(SettingsInvalid, match=r"LISTEN_DATABASE_URL.*postgresql://"):
        load_settings(database_url=pg, listen_database_url="sqlite:///x.db")
    with pytest.raises(SettingsInvalid, match=r"LISTEN_DATABASE_URL.*directly"):
        load_settings(database_url=pg, listen_database_url=pg + "?pooler=transaction")


def test_through_a_pooler_no_statement_is_prepared_on_the_server(pooled: str) -> None:
    """psycopg would prepare a statement run twice (``_pg3_0``) on whichever server
    session ran it; through PgBouncer the next transaction's session may not have it,
    or have another client's under that name."""
    store = Store(pooled)
    try:
        for _ in range(5):
            store.submit([spec()])
        with store.engine.connect() as conn:
            prepared = conn.exec_driver_sql("SELECT count(*) FROM pg_prepared_statements")
            assert prepared.scalar() == 0
    finally:
        store.close()

