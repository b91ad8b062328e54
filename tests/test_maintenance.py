"""Maintenance that one bad row cannot stop, cost reported after a lease was lost,
and the cap on uncharged releases (issue 22, items 9-11). Real databases, both
engines; time moves only on the manual clock.

A *poisoned* row is made for real: a run whose status this runlane does not know (as
a newer runlane, or a hand edit, could leave it). Reading it raises in the store
(``RunStatus('...')``), as any row that keeps raising would."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from structlog.testing import capture_logs

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.domain.retry import RetryPolicy
from runlane.domain.states import RunStatus
from runlane.errors import LeaseLost
from runlane.services.maintenance import Reaper, ReaperConfig, Reconciler, ReconcilerConfig
from runlane.settings import SettingsInvalid, load_settings
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.worker.attempt import AttemptState

from .conftest import ADMIN_URL, POLICY, RUN_TAG, T0
from .support import attempts_of, bare_remote, cli_env, execute, run_row, spec, submit
from .test_recovery_edges import AfterListing
from .test_worker import WorkerProcess, wait_until

S = RunStatus
TTL = 30.0
UNKNOWN_STATUS = "FROM_A_NEWER_RUNLANE"


def poison(store: Store, run_id: str) -> None:
    execute(store, "UPDATE runs SET status = :s WHERE run_id = :r", s=UNKNOWN_STATUS, r=run_id)


def cure(store: Store, run_id: str) -> None:
    execute(store, "UPDATE runs SET status = 'RUNNING' WHERE run_id = :r", r=run_id)


def active_leases(store: Store) -> set[str]:
    with store.engine.connect() as conn:
        return {r.run_id for r in conn.execute(text(
            "SELECT run_id FROM attempts WHERE lease_status = 'ACTIVE'"))}


def failures(logs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["service"], e["run_id"]) for e in logs
            if e["event"] == "maintenance_row_failed"]


def claim_one_by_one(store: Store, clock: ManualClock, n: int) -> list[Lease]:
    """``n`` leases, each expiring a second after the one before (the reaper's order)."""
    submit(store, n)
    leases = []
    for _ in range(n):
        leases += store.claim("w1", lease_ttl=TTL)
        clock.advance(1)
    return leases


# --- item 9: the reaper ---------------------------------------------------------------------


def test_a_lease_that_cannot_be_reaped_does_not_stop_the_others_in_its_pass(
        store: Store, clock: ManualClock) -> None:
    """The oldest expired lease raises at every try: it is logged with its run,
    counted, and passed over; every lease behind it is reaped in the same pass, one
    batch at a time (a pass that re-read a fixed head would list it again and again)."""
    bad, *good = claim_one_by_one(store, clock, 5)
    store.advance(bad, S.RUNNING)
    poison(store, bad.run_id)
    clock.advance(TTL + 1)
    with capture_logs() as logs:
        counts = Reaper(store, ReaperConfig(batch_size=1)).run_once()
    assert counts == {"expired_leases": 4, "rows_failed": 1}
    assert failures(logs) == [("reaper", bad.run_id)]
    assert active_leases(store) == {bad.run_id}
    for lease in good:
        assert run_row(store, lease.run_id).status == S.QUEUED.value
    [attempt] = attempts_of(store, bad.run_id)  # its transaction was rolled back
    assert (attempt.lease_status, attempt.ended_at) == ("ACTIVE", None)


def test_a_lease_that_cannot_be_reaped_blocks_no_later_pass_and_is_tried_again(
        store: Store, clock: ManualClock) -> None:
    """Later passes start from the oldest again: the poisoned lease is tried again at
    each (it may have been fixed) and leases that expire after it are still reaped;
    once its row is fixed, the next pass reaps it."""
    [bad] = claim_one_by_one(store, clock, 1)
    poison(store, bad.run_id)
    reaper = Reaper(store, ReaperConfig(batch_size=1))
    clock.advance(TTL + 1)
    assert reaper.run_once() == {"expired_leases": 0, "rows_failed": 1}
    for _ in range(2):  # two later passes, each with new expired leases behind it
        later = claim_one_by_one(store, clock, 2)
        clock.advance(TTL + 1)
        assert reaper.run_once() == {"expired_leases": 2, "rows_failed": 1}
        assert active_leases(store) == {bad.run_id}
        assert {run_row(store, x.run_id).status for x in later} == {S.QUEUED.value}
    cure(store, bad.run_id)
    assert reaper.run_once() == {"expired_leases": 1, "rows_failed": 0}
    assert active_leases(store) == set()
    assert run_row(store, bad.run_id).status == S.QUEUED.value


def test_a_lease_whose_statement_fails_on_its_row_is_passed_over(
        store: Store, clock: ManualClock) -> None:
    """A row the statement itself cannot process: an attempt whose slot list is not a
    JSON array, which ending the attempt reads (SQLite: "malformed JSON", an
    OperationalError like a locked file's; PostgreSQL: a data error). The database
    still answers, so it is the row's failure: passed over, the others reaped."""
    store.apply_policy(parse_policy("[concurrency]\nglobal_max_active = 100\n"),
                       source="test")
    bad, *_ = claim_one_by_one(store, clock, 3)
    execute(store, "UPDATE attempts SET limit_scopes = :s WHERE run_id = :r",
            s="not json" if store.dialect == "sqlite" else '{"not": "a list"}',
            r=bad.run_id)
    clock.advance(TTL + 1)
    with capture_logs() as logs:
        counts = Reaper(store, ReaperConfig(batch_size=1)).run_once()
    assert counts == {"expired_leases": 2, "rows_failed": 1}
    assert failures(logs) == [("reaper", bad.run_id)]
    assert active_leases(store) == {bad.run_id}


def test_the_reaper_pass_walks_leases_expired_at_the_same_moment(
        store: Store, clock: ManualClock) -> None:
    """Leases with one expiry (claimed together) are told apart by run id: a walk one
    at a time reaps every one of them, each once."""
    submit(store, 4)
    leases = store.claim("w1", limit=4, lease_ttl=TTL)
    assert len({x.expires_at for x in leases}) == 1
    poison(store, min(x.run_id for x in leases))
    clock.advance(TTL + 1)
    counts = Reaper(store, ReaperConfig(batch_size=1)).run_once()
    assert counts == {"expired_leases": 3, "rows_failed": 1}


# --- item 9: the reconciler -------------------------------------------------------------------


def test_a_run_the_reconciler_cannot_repair_does_not_stop_the_others(
        store: Store, clock: ManualClock) -> None:
    """Repair 6 (overlong attempts) on three heartbeating leases, one of whose runs
    raises when read: the other two are timed out in the same pass, one page at a
    time, and the failure is logged with the run and counted."""
    submit(store, 3)
    leases = store.claim("w1", limit=3, lease_ttl=3600)
    bad = min(leases, key=lambda x: x.run_id)  # the first of every page walk
    poison(store, bad.run_id)
    clock.advance(3000)
    store.heartbeat("w1", leases, lease_ttl=3600)
    with capture_logs() as logs:
        counts = store.reconcile(max_attempt_seconds=2000, limit=1)
    assert (counts["overlong_attempts_timed_out"], counts["rows_failed"]) == (2, 1)
    assert failures(logs) == [("reconciler:overlong", bad.run_id)]
    assert active_leases(store) == {bad.run_id}
    for lease in leases:
        if lease is not bad:
            assert attempts_of(store, lease.run_id)[0].reason_code == Reason.TIMEOUT
    # The next pass tries it again, and repairs it once its row is fixed.
    assert store.reconcile(max_attempt_seconds=2000, limit=1)["rows_failed"] == 1
    cure(store, bad.run_id)
    counts = store.reconcile(max_attempt_seconds=2000, limit=1)
    assert (counts["overlong_attempts_timed_out"], counts["rows_failed"]) == (1, 0)


def test_the_reconciler_walks_every_page_of_a_repair_in_one_pass(
        store: Store, clock: ManualClock) -> None:
    """Five terminal runs with live leases, a page of two: all five revoked in one
    pass (pages past the first are listed after the last key seen)."""
    subs = submit(store, 5)
    store.claim("w1", limit=5, lease_ttl=TTL)
    execute(store, "UPDATE runs SET status = 'FAILED'")
    counts = Reconciler(store, ReconcilerConfig(batch_size=2)).run_once()
    assert counts["terminal_leases_revoked"] == 5
    assert all(attempts_of(store, s.run_id)[0].lease_status == "REVOKED" for s in subs)


# --- item 9: repair 6 and the run's own wall-clock limit -----------------------------------------


WALL_CLOCK_POLICY = """
[[repositories]]
match = "*/long*"
limits = { max_wall_clock_minutes = 180 }

[[repositories]]
match = "*/short*"
limits = { max_wall_clock_minutes = 60 }
"""


def test_overlong_repair_uses_the_runs_own_wall_clock_limit(
        store: Store, clock: ManualClock) -> None:
    """MAX_ATTEMPT_SECONDS (7,200 s) bounds only a run without a wall-clock limit. A
    heartbeating lease of a run allowed 180 minutes survives past 7,200 s and is
    timed out only past 180 min + the margin (1,800 s); one allowed 60 minutes is timed
    out past 60 min + the margin, before 7,200 s."""
    store.apply_policy(parse_policy(WALL_CLOCK_POLICY), source="test")
    plain = submit(store, repo="/srv/git/app.git")[0]
    long = submit(store, repo="/srv/git/long.git")[0]
    short = submit(store, repo="/srv/git/short.git")[0]
    limits = run_row(store, long.run_id).limits
    assert (json.loads(limits) if isinstance(limits, str) else limits)[
        "max_wall_clock_minutes"] == 180
    leases = store.claim("w1", limit=3, lease_ttl=3600)
    assert len(leases) == 3
    reconciler = Reconciler(store, ReconcilerConfig(max_attempt_seconds=7200))
    assert reconciler.config.wall_clock_margin_seconds == 1800

    def at(seconds: float) -> dict[str, int]:
        clock.set(T0 + seconds)
        live = [x for x in leases if x.run_id in active_leases(store)]
        assert store.heartbeat("w1", live, lease_ttl=3600).lost == frozenset()
        return reconciler.run_once()

    def timed_out() -> set[str]:
        return {s.run_id for s in (plain, long, short)
                if attempts_of(store, s.run_id)[0].reason_code == Reason.TIMEOUT}

    assert at(3000)["overlong_attempts_timed_out"] == 0
    assert at(5300)["overlong_attempts_timed_out"] == 0  # short's bound: 5,400 s
    assert at(5500)["overlong_attempts_timed_out"] == 1
    assert timed_out() == {short.run_id}
    assert at(7300)["overlong_attempts_timed_out"] == 1
    assert timed_out() == {short.run_id, plain.run_id}
    for seconds in (9000, 11000, 12500):  # long keeps heartbeating, past 7,200 s
        assert at(seconds)["overlong_attempts_timed_out"] == 0
    assert long.run_id in active_leases(store)
    assert at(12700)["overlong_attempts_timed_out"] == 1  # 180 min + 1,800 s = 12,600 s
    assert timed_out() == {short.run_id, plain.run_id, long.run_id}
    messages = {s.run_id: attempts_of(store, s.run_id)[0].message for s in (plain, long)}
    assert "max_wall_clock_minutes 180" in messages[long.run_id]
    assert "MAX_ATTEMPT_SECONDS" in messages[plain.run_id]


def test_an_odd_limits_snapshot_falls_back_to_the_global_bound(
        store: Store, clock: ManualClock) -> None:
    """A snapshot whose wall-clock limit is not a number (a hand edit), or that is not
    JSON at all (SQLite stores text), must not fail the listing of every run: that
    run is bounded by MAX_ATTEMPT_SECONDS."""
    subs = submit(store, 2)
    leases = store.claim("w1", limit=2, lease_ttl=3600)
    execute(store, "UPDATE runs SET limits = :l WHERE run_id = :r",
            l='{"max_wall_clock_minutes": "lots"}', r=subs[0].run_id)
    if store.dialect == "sqlite":
        execute(store, "UPDATE runs SET limits = 'not json' WHERE run_id = :r",
                r=subs[1].run_id)
    clock.advance(3000)
    store.heartbeat("w1", leases, lease_ttl=3600)
    counts = store.reconcile(max_attempt_seconds=2000)
    assert (counts["overlong_attempts_timed_out"], counts["rows_failed"]) == (2, 0)


# --- item 10: cost reported after the lease is lost ---------------------------------------------


BUDGET_POLICY = "[tenants.acme]\ndaily_model_budget_usd = 1.0\n"


def spend(store: Store, tenant: str = "acme") -> float:
    with store.engine.connect() as conn:
        return float(conn.execute(text("SELECT COALESCE(SUM(usd), 0) FROM tenant_spend "
                                       "WHERE tenant = :t"), {"t": tenant}).scalar_one())


def runlane_cli(store: Store, tmp_path: Path, *args: str) -> Any:
    """``runlane ARGS`` on the store's database, in a process of its own: its JSON."""
    done = subprocess.run([sys.executable, "-m", "runlane", "--database-url", store.url,
                           *args], env=cli_env(tmp_path), cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_cost_reported_after_the_lease_is_reaped_counts_against_the_tenants_budget(
        store: Store, clock: ManualClock, tmp_path: Path) -> None:
    """The reaper takes the lease back, then the agent's cost line arrives: refused as
    the attempt's cost (LeaseLost), recorded as its late cost and in the tenant's
    spend, the run untouched; the next admission sees the spend and defers."""
    store.apply_policy(parse_policy(BUDGET_POLICY), source="test")
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.report_cost(lease, 0.25)
    clock.advance(TTL + 1)
    assert store.reap_expired_leases() == 1
    before = run_row(store, sub.run_id)
    events = len(store.get_run(sub.run_id)["events"])
    with pytest.raises(LeaseLost, match="late cost"):
        store.report_cost(lease, 1.0, input_tokens=10, output_tokens=5)
    assert store.report_late_cost(lease, 0.5)
    assert spend(store) == pytest.approx(1.75)
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.cost_usd, attempt.late_cost_usd) == (pytest.approx(0.25),
                                                         pytest.approx(1.5))
    assert tuple(run_row(store, sub.run_id)) == tuple(before)  # cost_usd 0.25 included
    assert len(store.get_run(sub.run_id)["events"]) == events
    assert store.audit() == []
    shown = runlane_cli(store, tmp_path, "runs", "show", sub.run_id, "--json")
    assert (shown["late_cost_usd"], shown["attempts"][0]["late_cost_usd"]) == (1.5, 1.5)
    [deferred] = submit(store)
    assert (deferred.status, deferred.reason_code) == (
        S.WAITING_CAPACITY.value, Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED)
    assert "spent 1.75 USD" in run_row(store, deferred.run_id).message


def test_late_cost_is_pinned_to_the_attempt_of_the_lease_that_reported_it(
        store: Store, clock: ManualClock) -> None:
    """A worker whose old lease was reaped reports cost while a newer attempt of the
    same run runs: the old attempt gets the late cost; the newer attempt's cost, its
    lease and the run are untouched."""
    [sub] = submit(store)
    [old] = store.claim("w1", lease_ttl=TTL)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    clock.advance(100)
    [new] = store.claim("w2", lease_ttl=TTL)
    store.report_cost(new, 0.5)
    with pytest.raises(LeaseLost):
        store.report_cost(old, 2.0)
    first, second = attempts_of(store, sub.run_id)
    assert (first.late_cost_usd, second.cost_usd, second.late_cost_usd) == (
        pytest.approx(2.0), pytest.approx(0.5), 0)
    assert run_row(store, sub.run_id).cost_usd == pytest.approx(0.5)
    assert spend(store) == pytest.approx(2.5)
    store.complete(new)


class CountingWrites:
    """The writes a store sends (UPDATE/INSERT statements), for a cost check."""

    def __init__(self, store: Store) -> None:
        from sqlalchemy import event
        self.writes: list[str] = []
        event.listen(store.engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        head = statement.lstrip().split(None, 1)[0].upper()
        if head in ("UPDATE", "INSERT"):
            self.writes.append(statement)


def test_a_worker_writes_each_cost_line_after_its_lease_is_lost_once(
        store: Store, clock: ManualClock) -> None:
    """The worker side: the line that finds the lease lost sets ``lost`` (its cost is
    recorded late by the store); every line after it is written straight as late
    cost: one statement on the attempt and the tenant's upsert, no live attempt."""
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    state = AttemptState(lease=lease, store=store)
    state.report_cost(0.25, 100, 10)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    state.report_cost(0.5, 100, 10)
    assert state.lost.is_set()
    counter = CountingWrites(store)
    for _ in range(3):
        state.report_cost(0.25, 100, 10)
    assert len(counter.writes) == 6
    assert sum("late_cost_usd" in w for w in counter.writes) == 3
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.cost_usd, attempt.late_cost_usd) == (pytest.approx(0.25),
                                                         pytest.approx(1.25))
    assert spend(store) == pytest.approx(1.5)


# --- item 11: uncharged releases are capped ---------------------------------------------------


def release_cycle(store: Store, clock: ManualClock) -> RunStatus:
    """Claim the run (once its backoff has passed) and give its lease back."""
    clock.advance(POLICY.max_seconds * 2)
    [lease] = store.claim("w1", lease_ttl=TTL)
    return store.release(lease, message="drained")


def test_releases_past_the_cap_are_charged_until_the_run_fails(
        db_url: str, clock: ManualClock) -> None:
    """With a cap of 2: two releases are free (requeued at once, not charged); the
    third and every one after it is charged (LEASE_RELEASED_OVER_CAP, retried with
    backoff while attempts remain), so the run ends FAILED within its attempts
    instead of being claimed and given back forever. The audit stays clean."""
    store = Store(db_url, clock=clock, retry_policy=POLICY, max_uncharged_releases=2)
    try:
        [sub] = submit(store, max_attempts=2)
        reasons, statuses = [], []
        for _ in range(4):
            status = release_cycle(store, clock)
            reasons.append(attempts_of(store, sub.run_id)[-1].reason_code)
            statuses.append(status)
            assert store.audit() == []
        assert reasons == ["LEASE_RELEASED", "LEASE_RELEASED", "LEASE_RELEASED_OVER_CAP",
                           "LEASE_RELEASED_OVER_CAP"]
        assert statuses == [S.QUEUED, S.QUEUED, S.QUEUED, S.FAILED]
        row = run_row(store, sub.run_id)
        assert (row.status, row.reason_code, row.attempt_count) == (
            "FAILED", Reason.LEASE_RELEASED_OVER_CAP, 4)
        third = attempts_of(store, sub.run_id)[2]
        assert "already released 2 time(s) without charge" in third.message
        assert "MAX_UNCHARGED_RELEASES 2" in third.message
    finally:
        store.close()


def test_an_uncharged_release_is_requeued_at_once_and_a_charged_one_backs_off(
        db_url: str, clock: ManualClock) -> None:
    store = Store(db_url, clock=clock, retry_policy=POLICY, max_uncharged_releases=1)
    try:
        [sub] = submit(store, max_attempts=5)
        release_cycle(store, clock)
        assert run_row(store, sub.run_id).visible_at == pytest.approx(clock.now())
        release_cycle(store, clock)
        delay = run_row(store, sub.run_id).visible_at - clock.now()
        assert POLICY.base_seconds <= delay <= POLICY.base_seconds * 1.25 + 1e-6
    finally:
        store.close()


def test_a_cap_of_zero_charges_every_release(db_url: str, clock: ManualClock) -> None:
    store = Store(db_url, clock=clock, retry_policy=POLICY, max_uncharged_releases=0)
    try:
        [sub] = submit(store, max_attempts=1)
        assert release_cycle(store, clock) is S.FAILED
        assert attempts_of(store, sub.run_id)[0].reason_code == "LEASE_RELEASED_OVER_CAP"
    finally:
        store.close()


def test_audit_reports_a_run_over_the_cap(db_url: str, clock: ManualClock) -> None:
    """Three uncharged releases (an older runlane, or a higher cap then) are over a
    cap of 2: ``runlane audit`` names the run; under the cap it is clean."""
    loose = Store(db_url, clock=clock, retry_policy=POLICY, max_uncharged_releases=5)
    strict = Store(db_url, clock=clock, retry_policy=POLICY, max_uncharged_releases=2)
    try:
        [sub] = submit(loose)
        for _ in range(3):
            release_cycle(loose, clock)
        assert loose.audit() == []
        [violation] = strict.audit()
        assert (violation.check, violation.run_id) == ("uncharged_releases_over_cap",
                                                      sub.run_id)
        assert violation.detail == "3 releases without charge, over the cap of 2"
    finally:
        loose.close()
        strict.close()


def test_the_cap_must_not_be_negative(db_url: str) -> None:
    with pytest.raises(ValueError, match="max_uncharged_releases"):
        Store(db_url, max_uncharged_releases=-1)


# --- with real worker processes ---------------------------------------------------------------


@pytest.fixture
def dbstore(db_url: str) -> Iterator[Store]:
    """A store on the database clock, as the worker processes use."""
    store = Store(db_url, retry_policy=RetryPolicy(base_seconds=0.1, max_seconds=0.2))
    yield store
    store.close()


@pytest.fixture
def worker_processes(db_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(agent: str, env: dict[str, str] | None = None) -> WorkerProcess:
        process = WorkerProcess(db_url, tmp_path, tmp_path / "forge", agent, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def wait_on(worker: WorkerProcess, check: Callable[[], bool], timeout: float,
            what: str) -> None:
    """``wait_until``, with the worker's log in the failure."""
    try:
        wait_until(check, timeout, what)
    except AssertionError as exc:
        worker.stop()
        assert worker.process.stderr is not None
        raise AssertionError(f"{exc}; worker log:\n"
                             f"{worker.process.stderr.read().decode()[-4000:]}") from None


# Prints a cost line, then works until stopped; stopped (SIGTERM, its lease lost), it
# reports what the work cost meanwhile: a cost line after the lease is gone.
SPENDING_AGENT = (
    "trap 'echo \"{\\\"runlane\\\": \\\"cost\\\", \\\"usd\\\": 2.5}\"; exit 1' TERM; "
    "echo '{\"runlane\": \"cost\", \"usd\": 0.25}'; "
    "touch \"$RUNLANE_ARTIFACTS_DIR/started\"; "
    "while :; do sleep 0.05; done")


def test_a_cost_line_after_the_lease_is_lost_counts_in_the_tenants_spend(
        dbstore: Store, tmp_path: Path,
        worker_processes: Callable[..., WorkerProcess]) -> None:
    """End to end: a worker's agent runs; the reconciler takes its lease (the attempt
    ran over MAX_ATTEMPT_SECONDS, set tiny here); the worker stops the agent, whose
    last cost line arrives after the lease is gone. That money is in the tenant's
    spend and on the attempt as late cost, and the tenant's next task is deferred by
    its daily budget."""
    remote = bare_remote(tmp_path)
    dbstore.apply_policy(parse_policy("[tenants.acme]\ndaily_model_budget_usd = 2.0\n"),
                         source="test")
    [sub] = dbstore.submit([spec(repo=str(remote), max_attempts=1)])
    assert sub.status == S.QUEUED.value
    worker = worker_processes(SPENDING_AGENT)
    started = tmp_path / "artifacts" / sub.run_id / "1" / "started"
    wait_on(worker, started.exists, 30, "the agent to start")
    # Its first cost line is read by the worker's reader thread: counted soon after.
    wait_on(worker, lambda: spend(dbstore) >= 0.25, 30, "the first cost line")
    assert spend(dbstore) == pytest.approx(0.25)
    assert dbstore.reconcile(max_attempt_seconds=0.001)["overlong_attempts_timed_out"] == 1
    wait_on(worker, lambda: spend(dbstore) >= 2.75, 30, "the late cost line to be counted")
    [attempt] = attempts_of(dbstore, sub.run_id)
    assert (attempt.reason_code, attempt.lease_status) == ("TIMEOUT", "REVOKED")
    assert (attempt.cost_usd, attempt.late_cost_usd) == (pytest.approx(0.25),
                                                         pytest.approx(2.5))
    assert run_row(dbstore, sub.run_id).cost_usd == pytest.approx(0.25)
    [deferred] = dbstore.submit([spec(repo=str(remote))])
    assert (deferred.status, deferred.reason_code) == (
        S.WAITING_CAPACITY.value, Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED)
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0


def test_a_worker_drained_again_and_again_is_charged_past_the_cap(
        dbstore: Store, tmp_path: Path,
        worker_processes: Callable[..., WorkerProcess]) -> None:
    """MAX_UNCHARGED_RELEASES reaches real workers: with 1, the run's first drain gives
    its lease back free, the second is charged (its only attempt: the run fails)."""
    remote = bare_remote(tmp_path)
    [sub] = dbstore.submit([spec(repo=str(remote), max_attempts=1)])
    env = {"RUNLANE_DRAIN_GRACE_SECONDS": "0.3", "RUNLANE_MAX_UNCHARGED_RELEASES": "1"}
    for n, expected in ((1, "QUEUED"), (2, "FAILED")):
        worker = worker_processes("sleep 60", env=env)
        wait_on(worker, lambda n=n: len(attempts_of(
            dbstore, sub.run_id)) == n and run_row(dbstore, sub.run_id).status == "RUNNING",
            30, f"attempt {n} to run")
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        assert run_row(dbstore, sub.run_id).status == expected
    assert [a.reason_code for a in attempts_of(dbstore, sub.run_id)] == [
        "LEASE_RELEASED", "LEASE_RELEASED_OVER_CAP"]
    assert dbstore.audit() == []


def test_the_setting_is_validated_and_defaults_to_five(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no runlane.toml
    assert load_settings().max_uncharged_releases == 5
    monkeypatch.setenv("RUNLANE_MAX_UNCHARGED_RELEASES", "0")
    assert load_settings().max_uncharged_releases == 0
    for bad in ("-1", "1001", "two"):
        monkeypatch.setenv("RUNLANE_MAX_UNCHARGED_RELEASES", bad)
        with pytest.raises(SettingsInvalid, match="setting MAX_UNCHARGED_RELEASES"):
            load_settings()


def test_a_database_gone_mid_pass_ends_the_pass_instead_of_failing_every_row(
        pg_databases: Callable[[str], str], clock: ManualClock) -> None:
    """When a row fails because the database itself went away (here it stops taking
    connections right after the reaper listed its batch), the ping fails too: the
    pass ends with the error, as before, rather than log and count every row of the
    batch as the row's failure."""
    url = pg_databases(f"runlane_maint_gone_{RUN_TAG}")
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    store = AfterListing(url, clock=clock, retry_policy=POLICY)
    name = make_url(url).database

    def database_gone() -> None:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s", [name])

    try:
        submit(store, 3)
        store.claim("w1", limit=3, lease_ttl=TTL)
        clock.advance(TTL + 1)
        store.between = database_gone
        with capture_logs() as logs, pytest.raises(OperationalError):
            Reaper(store).run_once()
        assert failures(logs) == []
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        store.close()


class SessionEndsMidRow(Store):
    """A store whose maintenance row number ``end_at_row`` (1-based, counted over the
    store's life) loses its database session mid-transaction: its first statement runs,
    then an administrator terminates that very backend (``pg_terminate_backend``, as a
    PostgreSQL restart would), and the row's own statements run on the dead session."""

    end_at_row: int | None = None
    rows = 0

    def _isolated(self, service: str, row: Any, work: Callable[[Any], bool]) -> bool | None:
        self.rows += 1
        if self.rows != self.end_at_row:
            return super()._isolated(service, row, work)

        def on_a_dying_session(conn: Any) -> bool:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [pid])
                wait_until(lambda: admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone() == (0,), 10, "the terminated backend to exit")
            return work(conn)

        return super()._isolated(service, row, on_a_dying_session)


def test_a_session_terminated_mid_pass_ends_the_pass_and_the_next_pass_finishes(
        request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock) -> None:
    """The reaper's session is terminated while it works on the second of three expired
    leases (the database itself is back at once, so a ping succeeds). That is no fault
    of the row: nothing is logged or counted as a row failure; the pass ends with a
    warning (``maintenance_pass_interrupted``, not ``maintenance_failed``), the row's
    transaction is rolled back, and the next pass reaps what is left."""
    from .conftest import empty_database

    url = empty_database(request, "postgresql", tmp_path)
    store = SessionEndsMidRow(url, clock=clock, retry_policy=POLICY)
    try:
        leases = claim_one_by_one(store, clock, 3)
        clock.advance(TTL + 1)
        store.end_at_row = 2
        reaper = Reaper(store, ReaperConfig(batch_size=10))
        with capture_logs() as logs:
            reaper.run_logged()
        assert failures(logs) == []
        events = [e["event"] for e in logs]
        assert "maintenance_failed" not in events
        [interrupted] = [e for e in logs if e["event"] == "maintenance_pass_interrupted"]
        assert interrupted["service"] == "reaper" and interrupted["log_level"] == "warning"
        assert active_leases(store) == {x.run_id for x in leases[1:]}  # row 2 rolled back
        assert reaper.run_once() == {"expired_leases": 2, "rows_failed": 0}
        assert active_leases(store) == set()
        for lease in leases:
            assert run_row(store, lease.run_id).status == S.QUEUED.value
    finally:
        store.close()
