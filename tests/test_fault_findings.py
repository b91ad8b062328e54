"""What the fault harness found (docs/reliability.md, "What the harness found"), each
fixed and pinned here: the reaper's lock order, its wake-up, PostgreSQL sessions left
idle inside a transaction by a frozen process, tracebacks in the logs, and heartbeats
that took an attempt's own end for a lost lease."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import structlog
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from structlog.testing import capture_logs

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.retry import RetryPolicy
from runlane.domain.states import RunStatus
from runlane.logs import configure_logging
from runlane.settings import Settings
from runlane.store.core import WAKEUP_CHANNEL
from runlane.store.engine import build_engine
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.store.wakeup import Listener, libpq_url
from runlane.worker.attempt import AttemptState
from runlane.worker.worker import Worker, WorkerConfig

from .conftest import T0, truncate_pg
from .support import run_row, spec

FAST_RETRY = RetryPolicy(base_seconds=0.05, max_seconds=0.05)


@pytest.fixture
def pg(pg_url: str) -> str:
    truncate_pg(pg_url)
    return pg_url


@pytest.fixture
def pg_store(pg: str) -> Iterator[Store]:
    store = Store(pg, retry_policy=FAST_RETRY)
    yield store
    store.close()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - started


def lane_of(store: Store, run_id: str) -> int:
    return int(run_row(store, run_id).lane_id)


def waiting_on_a_lock(url: str) -> bool:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                           "current_database() AND application_name = 'runlane' "
                           "AND wait_event_type = 'Lock'").fetchone()
        return bool(row and row[0])


# --- 1. the reaper keeps the lock order: one expired attempt per transaction ---------------


def test_the_reaper_ends_each_expired_lease_in_its_own_transaction(pg: str) -> None:
    """Two expired runs in two lanes; another session (a claim) holds the second lane
    and then wants the first. Reaping both in one transaction held the first lane
    while waiting for the second: a deadlock. Now the first run is requeued and
    committed before the reaper waits, and nobody deadlocks."""
    clock = ManualClock(T0)
    store = Store(pg, clock=clock, retry_policy=FAST_RETRY)
    try:
        first, second = (store.submit([spec(tenant=t)])[0] for t in ("t1", "t2"))
        store.claim("w1", lease_ttl=10, run_id=first.run_id)
        store.claim("w1", lease_ttl=20, run_id=second.run_id)  # expires after the first
        lane_1, lane_2 = lane_of(store, first.run_id), lane_of(store, second.run_id)
        assert lane_1 != lane_2
        clock.advance(60)
        with psycopg.connect(libpq_url(pg)) as claim:
            claim.execute("SET lock_timeout = '5s'")
            claim.execute("SELECT 1 FROM lanes WHERE lane_id = %s FOR UPDATE", (lane_2,))
            reaped: list[int] = []
            errors: list[BaseException] = []

            def reap() -> None:
                try:
                    reaped.append(store.reap_expired_leases())
                except BaseException as exc:  # a deadlock victim
                    errors.append(exc)

            reaper = threading.Thread(target=reap)
            reaper.start()
            wait_until(lambda: waiting_on_a_lock(pg), 10, "the reaper to wait for lane 2")
            # The first run is back in its queue already: its transaction has committed.
            assert run_row(store, first.run_id).status == "QUEUED"
            # The claim now takes the first lane: no deadlock (this raised
            # DeadlockDetected, or the reaper did, after deadlock_timeout).
            claim.execute("UPDATE lanes SET queued_count = queued_count WHERE lane_id = %s",
                          (lane_1,))
            claim.commit()
            reaper.join(10)
        assert errors == [] and reaped == [2]
        assert run_row(store, second.run_id).status == "QUEUED"
        assert store.audit() == []
    finally:
        store.close()


def test_the_reaper_leaves_a_run_another_transaction_holds_to_its_next_pass(
        pg: str) -> None:
    clock = ManualClock(T0)
    store = Store(pg, clock=clock, retry_policy=FAST_RETRY)
    try:
        held, free = store.submit([spec(), spec()])
        for sub in (held, free):
            store.claim("w1", lease_ttl=10, run_id=sub.run_id)
        clock.advance(60)
        with psycopg.connect(libpq_url(pg)) as other:
            other.execute("SELECT 1 FROM runs WHERE run_id = %s FOR UPDATE", (held.run_id,))
            assert store.reap_expired_leases() == 1  # without waiting for the held one
            assert run_row(store, held.run_id).status == "CLAIMED"
        assert store.reap_expired_leases() == 1
        assert run_row(store, held.run_id).status == "QUEUED"
    finally:
        store.close()


# --- 2. a requeue wakes an idle worker ------------------------------------------------------


def test_a_run_the_reaper_requeues_wakes_the_workers_of_its_queue(pg: str) -> None:
    clock = ManualClock(T0)
    store = Store(pg, clock=clock, retry_policy=FAST_RETRY)
    try:
        [sub] = store.submit([spec(queue="java")])
        store.claim("w1", queue="java", lease_ttl=10)
        clock.advance(60)
        with Listener(pg, channels=(WAKEUP_CHANNEL,)) as listener:
            assert listener.wait_connected()
            assert store.reap_expired_leases() == 1
            woken = listener.wait(5)
        assert [(w.channel, w.payload) for w in woken] == [(WAKEUP_CHANNEL, "java")]
        assert run_row(store, sub.run_id).status == "QUEUED"
    finally:
        store.close()


class HoldingDriver:
    """Takes the lease and returns at once (the lease stays with the database)."""

    def __init__(self) -> None:
        self.claimed: list[tuple[float, Lease]] = []

    def run(self, state: AttemptState) -> str:
        self.claimed.append((time.monotonic(), state.lease))
        return "held"


def start_worker(store: Store, **config: Any) -> tuple[Worker, threading.Thread, HoldingDriver]:
    driver = HoldingDriver()
    worker = Worker(store, driver, WorkerConfig(**config))  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread, driver


def test_an_idle_worker_claims_a_requeued_run_at_once_not_at_its_next_poll(
        pg_store: Store) -> None:
    """The reaper's NOTIFY wakes the worker; the requeue's backoff (50-63 ms here) has
    not passed when it arrives, so the worker looks again 0.1 s later, not after its
    poll (30 s here)."""
    [sub] = pg_store.submit([spec()])
    [dead] = pg_store.claim("dead-worker", lease_ttl=0.5)
    worker, thread, driver = start_worker(pg_store, poll_seconds=30.0, lease_ttl_seconds=10.0,
                                          heartbeat_seconds=1.0, drain_grace_seconds=0.0)
    try:
        assert worker.listener.wait_connected()
        wait_until(lambda: pg_store.reap_expired_leases() == 1, 10, "the lease to expire")
        requeued = time.monotonic()
        wait_until(lambda: bool(driver.claimed), 5, "the idle worker to claim the run")
        [(claimed_at, lease)] = driver.claimed
        assert (lease.run_id, lease.fencing_token) == (sub.run_id, dead.fencing_token + 1)
        assert claimed_at - requeued < 1.0
    finally:
        worker.request_drain()
        thread.join(10)


# --- 3. a session idle inside a transaction is ended by PostgreSQL --------------------------


def setting(store: Store, name: str) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(text(f"SHOW {name}")).scalar_one())


def test_sessions_end_when_idle_in_a_transaction_by_default_and_by_setting(pg: str) -> None:
    store = Store(pg)
    try:
        assert setting(store, "idle_in_transaction_session_timeout") == "5s"
    finally:
        store.close()
    settings = Settings(database_url=pg, idle_in_transaction_timeout_seconds=0.25)
    with Runlane(settings=settings) as lane:
        assert setting(lane.store, "idle_in_transaction_session_timeout") == "250ms"
    with Runlane(settings=Settings(database_url=pg,
                                   idle_in_transaction_timeout_seconds=0)) as lane:
        assert setting(lane.store, "idle_in_transaction_session_timeout") == "0"


def test_a_frozen_transaction_loses_its_locks_and_its_connection_is_discarded(
        pg: str) -> None:
    """A process frozen inside a claim transaction (SIGSTOP, a VM pause) held its
    lane's row lock until it woke up: every claim and submit on that lane waited."""
    frozen = Store(pg, engine=build_engine(pg, pool_size=1, idle_in_transaction_timeout=0.3))
    other = Store(pg)
    try:
        [first] = frozen.submit([spec()])
        lane = lane_of(frozen, first.run_id)
        failed: list[DBAPIError] = []
        with frozen.engine.connect() as conn:
            conn.begin()
            conn.execute(text("SELECT 1 FROM lanes WHERE lane_id = :l FOR UPDATE"), {"l": lane})
            started = time.monotonic()
            other.submit([spec()])  # enters the same lane: waits for the lock
            waited = time.monotonic() - started
            try:  # the frozen process wakes up: its session is gone
                conn.execute(text("SELECT 1"))
            except DBAPIError as exc:
                failed.append(exc)
        assert 0.2 < waited < 3.0
        [error] = failed
        assert error.connection_invalidated
        assert "idle-in-transaction timeout" in str(error.orig)
        # The pool discarded the dead connection: the next call works.
        assert len(frozen.claim("w1", limit=2)) == 2
    finally:
        frozen.close()
        other.close()


def test_a_worker_whose_claim_session_is_ended_claims_again(
        pg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim loop logs the error and retries: it does not crash."""
    store = Store(pg, retry_policy=FAST_RETRY,
                  engine=build_engine(pg, idle_in_transaction_timeout=0.2))
    [sub] = store.submit([spec()])
    candidates = store._claim_candidates
    frozen = threading.Event()

    def freeze_once(*args: Any, **kwargs: Any) -> Any:
        found = candidates(*args, **kwargs)
        if found and not frozen.is_set():
            frozen.set()
            time.sleep(0.6)  # inside the claim transaction, holding the run's row lock
        return found

    monkeypatch.setattr(store, "_claim_candidates", freeze_once)
    # The transaction's claim (the one-statement claim holds no session across Python).
    monkeypatch.setattr(store, "_claim_in_one_trip", lambda *args, **kwargs: None)
    with capture_logs() as logs:
        worker, thread, driver = start_worker(store, poll_seconds=0.1,
                                              lease_ttl_seconds=10.0, heartbeat_seconds=1.0,
                                              drain_grace_seconds=0.0)
        try:
            wait_until(lambda: bool(driver.claimed), 10, "the claim after the error")
        finally:
            worker.request_drain()
            thread.join(10)
            store.close()
    assert thread.is_alive() is False
    [(_, lease)] = driver.claimed
    assert (lease.run_id, lease.fencing_token) == (sub.run_id, 1)
    errors = [e for e in logs if e["event"] == "claim_loop_error"]
    assert len(errors) == 1 and "IdleInTransactionSessionTimeout" in errors[0]["error"]


# --- 4. logged exceptions carry their traceback -----------------------------------------------


def test_a_logged_exception_carries_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO")
    try:
        try:
            1 / 0  # noqa: B018
        except ZeroDivisionError:
            structlog.get_logger("runlane.test").exception("attempt_crashed", run_id="r1")
        [line] = capsys.readouterr().err.strip().splitlines()
    finally:
        structlog.reset_defaults()
    entry = json.loads(line)
    assert entry["event"] == "attempt_crashed" and entry["run_id"] == "r1"
    assert "exc_info" not in entry
    assert "Traceback" in entry["exception"] and "ZeroDivisionError" in entry["exception"]


# --- 5. no lease_lost for a lease the attempt itself has ended ---------------------------------


@pytest.fixture
def dbstore(db_url: str) -> Iterator[Store]:
    """A store on the database clock, on each database."""
    s = Store(db_url, retry_policy=FAST_RETRY)
    yield s
    s.close()


def beat_once(worker: Worker) -> None:
    """One pass of the heartbeat loop."""
    worker._beat_now.set()
    thread = threading.Thread(target=worker._heartbeat_loop)
    thread.start()
    time.sleep(0.3)
    worker._stopped.set()
    worker._beat_now.set()
    thread.join(5)


def worker_with(store: Store, *leases: Lease) -> tuple[Worker, list[AttemptState]]:
    worker = Worker(store, None, WorkerConfig(heartbeat_seconds=5.0),  # type: ignore[arg-type]
                    worker_id="w1")
    states = [AttemptState(lease, store) for lease in leases]
    for state in states:
        worker._active[state.lease.run_id, state.lease.fencing_token] = (
            threading.current_thread(), state)
    return worker, states


def test_no_lease_lost_warning_for_an_attempt_that_has_just_ended(dbstore: Store) -> None:
    """Its thread has not gone yet: the attempt is still in the worker's table."""
    store = dbstore
    store.submit([spec(), spec()])
    done, running = store.claim("w1", limit=2, lease_ttl=30)
    store.complete(done, outcome="no_changes")
    worker, (done_state, running_state) = worker_with(store, done, running)
    with capture_logs() as logs:
        beat_once(worker)
    assert [e for e in logs if e["event"] == "lease_lost"] == []
    assert not done_state.lost.is_set() and not running_state.lost.is_set()


def test_no_lease_lost_warning_when_the_attempt_ends_during_the_beat(
        dbstore: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    store = dbstore
    [sub] = store.submit([spec()])
    [lease] = store.claim("w1", lease_ttl=30)
    beat = store.heartbeat

    def complete_then_beat(*args: Any, **kwargs: Any) -> Any:
        if lease.stage is not RunStatus.SUCCEEDED:  # committed before the beat lands
            store.complete(lease, outcome="no_changes")
        return beat(*args, **kwargs)

    monkeypatch.setattr(store, "heartbeat", complete_then_beat)
    worker, [state] = worker_with(store, lease)
    with capture_logs() as logs:
        beat_once(worker)
    assert run_row(store, sub.run_id).status == RunStatus.SUCCEEDED.value
    assert [e for e in logs if e["event"] == "lease_lost"] == []
    assert not state.lost.is_set()


def test_a_lease_really_lost_is_still_reported(dbstore: Store) -> None:
    store = dbstore
    [sub] = store.submit([spec()])
    [lease] = store.claim("w1", lease_ttl=1.0)
    store.advance(lease, RunStatus.RUNNING)
    wait_until(lambda: store.reap_expired_leases() == 1, 10, "the lease to expire")
    worker, [state] = worker_with(store, lease)
    with capture_logs() as logs:
        beat_once(worker)
    assert [e["run_ids"] for e in logs if e["event"] == "lease_lost"] == [[sub.run_id]]
    assert state.lost.is_set()


# --- a database error while ending a cancelled or failed attempt ------------------------


class _DatabaseGoneStore(Store):
    """A real store whose database goes away just as the attempt ends."""

    def _gone(self, *_: Any, **__: Any) -> Any:
        raise DBAPIError("UPDATE runs ...", {}, psycopg.OperationalError("server closed"))

    finish_cancel = acknowledge_cancel = fail = _gone


@pytest.mark.parametrize("ending", ["cancel", "fail"])
def test_a_database_error_while_ending_an_attempt_abandons_it(
        db_url: str, tmp_path: Any, ending: str) -> None:
    """Seen once in a fault run: the end of a cancelled attempt runs inside the
    ``except CancelRequested`` handler, so a database error there escaped the
    attempt's thread. It abandons the attempt (the reaper recovers the run)."""
    from runlane.worker.attempt import AttemptDriver, AttemptSettings

    store = _DatabaseGoneStore(db_url)
    try:
        store.submit([spec()])
        [lease] = store.claim("w1", lease_ttl=30.0)
        driver = AttemptDriver(store, None,  # type: ignore[arg-type]
                               AttemptSettings(tmp_path / "ws", tmp_path / "art"),
                               code_host_for=lambda _: None)  # type: ignore[arg-type,return-value]
        state = AttemptState(lease, store)
        ended = (driver._finish_cancel(state) if ending == "cancel"
                 else driver._fail(state, "AGENT_FAILED", "boom"))
        assert ended == "abandoned"
        assert run_row(store, lease.run_id).status == "CLAIMED"  # nothing written
    finally:
        store.close()
