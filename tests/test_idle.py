"""Idle workers cost almost nothing (worker/worker.py): with LISTEN working, an idle
worker's poll backs off and a worker holding no lease beats its row seldom, so ten idle
real worker processes make PostgreSQL see at most 0.2 statements a second each; and
one submit is claimed by one of them, not by all (empty claims per submit)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from runlane.clock import ManualClock
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.records import Look
from runlane.store.store import Store
from runlane.store.wakeup import libpq_url

from .support import bare_remote, run_row, spec, wait_until

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 10
# The bound is 0.2 statements a second per idle worker at the default intervals
# (a 20 s poll cap, 10 s heartbeats; bench/idle.py measures it there). The test runs the
# workers with both intervals a quarter as long, so that they reach their cap in seconds:
# every idle statement comes four times as often, and the bound is four times as high.
SCALE = 4.0
IDLE_POLL_MAX_SECONDS = 20.0 / SCALE
HEARTBEAT_SECONDS = 10.0 / SCALE
BOUND = 0.2 * SCALE
# Back-off from the 1 s poll to the 5 s cap: looks at about 0, 1 and 5 s, then every
# 3.75-5 s.
WARM_UP_SECONDS = 8.0
WINDOW_SECONDS = 12.0


def statements(url: str) -> int:
    """Statements the server ran on runlane's tables of this database, as its table
    counters see them: scans (sequential and index) and inserted rows. Each of an idle
    worker's statements (a look, a withdrawal look, a beat) is one scan of one table.
    Not the database's transaction counters: those count also the transactions an idle
    session runs for the server itself (LISTEN queue reads, cache catch-up after other
    databases' DDL), which a shared server's other tenants drive."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        return int(conn.execute(
            "SELECT COALESCE(SUM(seq_scan + COALESCE(idx_scan, 0) + n_tup_ins), 0) "
            "FROM pg_stat_user_tables").fetchone()[0])


def counted(directory: Path, metric: str) -> float:
    """A counter summed over the workers' multiprocess files."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return sum(sample.value for family in registry.collect() for sample in family.samples
               if sample.name == metric + "_total")


@pytest.fixture
def idle_fleet(pg_databases: Callable[[str], str], tmp_path: Path
               ) -> Iterator[tuple[str, Path]]:
    """A fresh database and WORKERS idle `runlane worker` processes at default settings
    but for the two intervals SCALE shortens (sandbox off: cheaper to start), counting
    in multiprocess metric files."""
    url = pg_databases(f"runlane_idle_{os.getpid()}")
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"RUNLANE_FORGE_DIR": str(tmp_path / "forge"),
                "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
                "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
                "RUNLANE_SANDBOX": "off", "RUNLANE_LOG_LEVEL": "WARNING",
                "RUNLANE_IDLE_POLL_MAX_SECONDS": str(IDLE_POLL_MAX_SECONDS),
                "RUNLANE_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS),
                "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    workers = [subprocess.Popen(
        [sys.executable, "-m", "runlane", "--database-url", url, "worker",
         "--agent-command", "true"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(WORKERS)]
    try:
        yield url, metrics_dir
    finally:
        for w in workers:
            w.kill()
        for w in workers:
            w.wait()


def test_idle_workers_cost_at_most_a_fifth_of_a_statement_a_second_each(
        idle_fleet: tuple[str, Path], tmp_path: Path) -> None:
    url, metrics_dir = idle_fleet
    store = Store(url)
    try:
        with store.reads.connect() as conn:
            from sqlalchemy import text

            wait_until(lambda: conn.execute(text("SELECT COUNT(*) FROM workers")).scalar()
                       == WORKERS, 60, "the workers to register")
        time.sleep(WARM_UP_SECONDS)  # their polls backed off to the cap
        before, started = statements(url), time.monotonic()
        time.sleep(WINDOW_SECONDS)
        seen = statements(url) - before
        rate = seen / (time.monotonic() - started) / WORKERS
        assert rate <= BOUND, f"{rate:.3f} statements/s per idle worker ({seen} in all)"

        # One submit at a time: one worker claims it; the others' look finds it gone.
        remote = bare_remote(tmp_path)
        measured = 12
        empty_before = counted(metrics_dir, "runlane_scheduler_claim_empty")
        for i in range(2 * measured):
            if i == measured:  # the first half taught each worker how many race it
                empty_before = counted(metrics_dir, "runlane_scheduler_claim_empty")
            [sub] = store.submit([spec(repo=str(remote))])
            wait_until(lambda s=sub: run_row(store, s.run_id).status != "QUEUED", 30,
                       "the run to be claimed")
            time.sleep(0.5)  # the other workers' looks are done
        empty = counted(metrics_dir, "runlane_scheduler_claim_empty") - empty_before
        assert empty / measured <= 2, f"{empty / measured:.2f} empty claims per submit"
    finally:
        store.close()


# --- the mechanisms, in process --------------------------------------------------------


def test_a_look_says_when_a_backoff_ends(store: Store, clock: ManualClock) -> None:
    """One statement answers both: whether a claim may find a run now, and else how
    soon the earliest run this worker may serve stops waiting out its backoff."""
    from runlane.domain.reasons import Reason

    assert store.look(["default"]) == Look(False, None)
    store.submit([spec()])
    assert store.look(["default"]).ready
    assert not store.look(["other"]).ready
    assert store.look(["default"], {"gpu": "a100"}).ready  # it needs nothing
    [lease] = store.claim("w", lease_ttl=60)
    store.fail(lease, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=30)
    # The first claim to find the lane's head waiting puts the lane to sleep until then.
    assert store.claim("w", lease_ttl=60) == []
    look = store.look(["default"])
    assert not look.ready and look.next_in is not None and 29 <= look.next_in <= 30
    clock.advance(31)
    assert store.look(["default"]).ready
    # A run needing what the worker lacks is not its to look for.
    store.submit([spec(requires={"gpu": "a100"})])
    store.claim("w", lease_ttl=60)  # the ready one
    assert not store.look(["default"]).ready
    assert store.look(["default"], {"gpu": "a100"}).ready


class _Listener:
    def __init__(self, healthy: bool) -> None:
        self.healthy = healthy


def test_the_idle_poll_backs_off_only_while_wake_ups_work() -> None:
    from runlane.worker.worker import Worker, WorkerConfig

    worker = Worker.__new__(Worker)
    worker.config = WorkerConfig(poll_seconds=1.0, idle_poll_max_seconds=20.0)
    worker._idle_wait, worker._next_in = 1.0, None
    import random

    worker._rng = random.Random(1)
    worker.listener = _Listener(True)  # type: ignore[assignment]
    waits = [worker._next_wait(0, False) for _ in range(6)]
    assert waits[:2] == [1.0, pytest.approx(waits[1])] and 3.0 <= waits[1] <= 4.0
    assert 12.0 <= waits[2] <= 16.0 and all(15.0 <= w <= 20.0 for w in waits[3:])
    assert worker._next_wait(1, False) == 0.0  # work: fast again
    assert worker._next_wait(0, False) == 1.0
    worker._next_in = 2.5  # a backoff the look saw ends before the poll would
    worker._next_wait(0, False)
    assert worker._next_wait(0, False) == 2.5
    worker._next_in = None
    worker.listener = _Listener(False)  # LISTEN down: the 1 s poll
    assert [worker._next_wait(0, False) for _ in range(4)][1:] == [1.0, 1.0, 1.0]
