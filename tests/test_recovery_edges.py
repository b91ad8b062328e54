"""Lease recovery, maintenance services and `runlane audit` at their edges: stale
heartbeats, half-ended attempts, waiting runs with live leases, reapers and
reconcilers racing each other, the scheduler's single-flight trigger, and the audit
checks for broken states (found by the maintenance and migration reviews of
2026-12-02). Time moves only on the manual clock; both engines unless a test says
otherwise."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.services.maintenance import Reaper, ReaperConfig
from runlane.store.store import Store

from .conftest import POLICY, T0
from .support import attempts_of, execute, run_row, submit

S = RunStatus
TTL = 30.0


class AfterListing(Store):
    """A store whose next maintenance pass runs ``between`` once its candidates are
    listed (the pass's first transaction) and before it repairs any: what another
    process may do in that window."""

    between: Any = None

    def _transaction(self, work: Any, **kwargs: Any) -> Any:
        result = super()._transaction(work, **kwargs)
        hook, self.between = self.between, None
        if hook is not None:
            hook()
        return result


# --- fencing: heartbeats ---------------------------------------------------------------


def test_a_heartbeat_with_a_stale_token_extends_nothing_even_for_the_same_worker(
        store: Store, clock: ManualClock) -> None:
    """Invariant 3: a stale token changes nothing. A beat sent with the old lease of a
    run the same worker has claimed again must not extend the new lease."""
    [sub] = submit(store)
    [old] = store.claim("w1", lease_ttl=TTL)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    clock.advance(100)
    [new] = store.claim("w1", lease_ttl=TTL)
    assert new.fencing_token == old.fencing_token + 1
    clock.advance(20)
    beat = store.heartbeat("w1", [old], lease_ttl=TTL)
    assert beat.lost == {sub.run_id}
    current = attempts_of(store, sub.run_id)[-1]
    assert current.lease_expires_at == new.expires_at, "the stale beat extended the new lease"


# --- live leases of runs that moved on ---------------------------------------------------


def test_reaper_on_an_ended_attempt_whose_lease_is_still_active(
        store: Store, clock: ManualClock) -> None:
    """An attempt row ended (ended_at set) but whose lease was left ACTIVE: the reaper
    ends that lease too, and reports the recovery once (it used to requeue the run
    with the lease still ACTIVE and report a reap at every pass)."""
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    execute(store, "UPDATE attempts SET ended_at = :t WHERE run_id = :r", r=sub.run_id, t=T0)
    clock.advance(TTL + 1)
    first = store.reap_expired_leases()
    second = store.reap_expired_leases()
    [attempt] = attempts_of(store, sub.run_id)
    row = run_row(store, sub.run_id)
    assert (first, second) == (1, 0), (first, second, row.status, attempt.lease_status)
    assert attempt.lease_status == "EXPIRED"
    assert store.audit() == []


def test_a_waiting_run_with_a_live_lease_is_repaired_not_left_to_poison_claims(
        store: Store, clock: ManualClock) -> None:
    """A waiting run that still holds an ACTIVE lease stays claimable, and its claim
    fails on the one-ACTIVE-lease index, the whole claim batch with it. The audit
    reports it and the reconciler revokes the lease, so the queue moves again."""
    bad, good = submit(store, 2)
    store.claim("w1", run_id=bad.run_id, lease_ttl=TTL)
    # a requeue that did not end the lease
    execute(store, "UPDATE runs SET status = 'QUEUED' WHERE run_id = :r", r=bad.run_id)
    assert [v.check for v in store.audit()] == ["waiting_run_with_live_lease",
                                                "lane_count_drift"]
    store.reconcile()
    assert store.audit() == [], store.audit()
    leases = store.claim("w2", limit=2, lease_ttl=TTL)
    assert {lease.run_id for lease in leases} >= {good.run_id}


# --- the scheduler service's single-flight trigger -------------------------------------


def test_a_trigger_that_arrives_as_the_running_pass_ends_is_not_dropped() -> None:
    """Demand arriving while a pass runs folds into exactly one follow-up pass, never
    dropped: also a request made the moment the runner, its pass done, has last held
    the lock (it used to find no demand there, free the lock, and only then clear
    ``_running``: a request in between found a pass "running", returned False, and was
    never run)."""
    from runlane.services.scheduler import PassTrigger

    passes: list[int] = []
    trigger = PassTrigger(lambda: passes.append(len(passes)) or {})
    inner = trigger._lock
    fired: list[bool] = []
    answers: list[bool] = []

    def other_caller() -> None:
        trigger.request()
        answers.append(trigger.run_pending())

    class HookLock:
        def __enter__(self) -> None:
            inner.acquire()

        def __exit__(self, *exc: object) -> None:
            inner.release()
            # the runner's first release of the lock after its pass
            if passes and not fired:
                fired.append(True)
                t = threading.Thread(target=other_caller)
                t.start()
                t.join(5)

    trigger._lock = HookLock()  # type: ignore[assignment]
    trigger.request()
    assert trigger.run_pending() is True
    # the second caller's demand is run, by the first caller or by itself
    assert fired
    assert (len(passes), trigger._pending) == (2, False)


# --- the services: several at once, their counts, their settings -----------------------


def test_a_reaper_pass_does_not_stop_early_when_another_reaper_took_its_batch(
        db_url: str, clock: ManualClock) -> None:
    """Two reapers list the same oldest expired leases; the one that finds its whole
    batch already taken by the other (reaped 0) goes on while its listing was full:
    more expired leases wait."""
    a = AfterListing(db_url, clock=clock, retry_policy=POLICY)
    b = Store(db_url, clock=clock, retry_policy=POLICY)
    submit(b, 7)
    b.claim("w1", limit=7, lease_ttl=TTL)
    clock.advance(TTL + 1)
    a.between = lambda: b.reap_expired_leases(limit=3)  # the other reaper, same batch
    Reaper(a, ReaperConfig(batch_size=3, max_batches_per_pass=10)).run_once()
    with b.engine.connect() as conn:
        left = conn.execute(text("SELECT COUNT(*) FROM attempts "
                                 "WHERE lease_status = 'ACTIVE'")).scalar()
    assert left == 0, f"{left} expired leases left for the next pass"
    a.close()
    b.close()


def test_reconcile_counts_an_overlong_attempt_that_ended_meanwhile_as_timed_out(
        db_url: str, clock: ManualClock) -> None:
    """An overlong attempt the worker completes between the listing and the repair is
    left alone, and the pass does not count it as timed out."""
    worker = Store(db_url, clock=clock, retry_policy=POLICY)
    rec = AfterListing(db_url, clock=clock, retry_policy=POLICY)
    [sub] = submit(worker)
    [lease] = worker.claim("w1", lease_ttl=TTL)
    for _ in range(5):
        clock.advance(25)
        worker.heartbeat("w1", [lease], lease_ttl=TTL)
    rec.between = lambda: worker.complete(lease)
    counts = rec.reconcile(max_attempt_seconds=100)
    assert run_row(worker, sub.run_id).status == "SUCCEEDED"
    assert attempts_of(worker, sub.run_id)[0].reason_code is None
    assert counts["overlong_attempts_timed_out"] == 0
    worker.close()
    rec.close()


def test_reconcile_counts_a_lease_another_reconciler_revoked_as_revoked_again(
        db_url: str, clock: ManualClock) -> None:
    """Two reconcilers list the same terminal run with a live lease; only the one that
    revokes it counts a revocation."""
    one = Store(db_url, clock=clock, retry_policy=POLICY)
    two = AfterListing(db_url, clock=clock, retry_policy=POLICY)
    [sub] = submit(one)
    one.claim("w1", lease_ttl=TTL)
    execute(one, "UPDATE runs SET status = 'FAILED' WHERE run_id = :r", r=sub.run_id)
    revoked: list[int] = []
    two.between = lambda: revoked.append(one.reconcile()["terminal_leases_revoked"])
    revoked.append(two.reconcile()["terminal_leases_revoked"])
    assert attempts_of(one, sub.run_id)[0].lease_status == "REVOKED"
    assert sorted(revoked) == [0, 1]
    one.close()
    two.close()


def test_the_reconciler_never_marks_a_worker_dead_between_two_of_its_heartbeats(
        db_url: str, clock: ManualClock) -> None:
    """Settings allow HEARTBEAT_SECONDS up to a third of LEASE_TTL_SECONDS (here 300 s
    of 1200 s): the reconciler's worker grace follows them, so a healthy worker is not
    marked DEAD between two beats (it was a fixed 180 s)."""
    from runlane.api import Runlane
    from runlane.settings import load_settings

    settings = load_settings(database_url=db_url, lease_ttl_seconds=1200,
                             heartbeat_seconds=300)
    lane = Runlane(settings=settings, clock=clock)
    lane.store.register_worker("w1", version="x", queues=["default"])
    clock.advance(200)  # the next beat is 100 s away
    counts = lane.reconciler().run_once()
    with lane.store.engine.connect() as conn:
        status = conn.execute(text("SELECT status FROM workers")).scalar()
    lane.close()
    assert (counts["workers_marked_dead"], status) == (0, "READY")


# --- `runlane audit`: broken states it must report ---------------------------------------


def test_audit_reports_a_leased_run_without_a_live_lease(store: Store, clock: ManualClock
                                                         ) -> None:
    """A run RUNNING whose attempt holds no ACTIVE lease is stuck: no reaper will ever
    see it, only the reconciler's repair 4 moves it. The audit reports it."""
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    execute(store, "UPDATE attempts SET lease_status = 'RELEASED', lease_ended_at = :t "
            "WHERE run_id = :r", r=sub.run_id, t=T0)
    clock.advance(61)
    assert {(v.check, v.run_id) for v in store.audit()} == {
        ("leased_run_without_live_lease", sub.run_id)}
    assert store.reconcile()["active_without_lease_recovered"] == 1
    assert store.audit() == []


def test_a_run_left_in_a_recovery_marker_state_is_reported_and_recovered(
        store: Store, clock: ManualClock) -> None:
    """FAILED_RETRYABLE and STALE_LEASE are markers a run only passes through (one
    UPDATE moves it on). A run left in one (a half-applied write, a manual fix) waited
    forever: no reaper lists it (no ACTIVE lease), no claim takes it. The audit reports
    it and the reconciler's repair 4 takes it on from where it stands."""
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.fail(lease, Reason.AGENT_FAILED)  # ends the attempt: the run is FAILED
    execute(store, "UPDATE runs SET status = 'FAILED_RETRYABLE', ended_at = NULL "
            "WHERE run_id = :r", r=sub.run_id)
    clock.advance(10_000)
    assert "run_in_recovery_marker_state" in {v.check for v in store.audit()}
    counts = store.reconcile()
    assert counts["active_without_lease_recovered"] == 1
    assert run_row(store, sub.run_id).status == "QUEUED"  # retried: attempts remain
    assert {v.check for v in store.audit()} <= {"event_chain_broken"}  # the planted write


@pytest.mark.parametrize("marker", ["STALE_LEASE", "FAILED_RETRYABLE"])
def test_a_run_left_in_a_marker_state_with_its_budget_spent_fails(
        store: Store, clock: ManualClock, marker: str) -> None:
    [sub] = submit(store, max_attempts=1)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    execute(store, "UPDATE attempts SET lease_status = 'EXPIRED', lease_ended_at = :t "
            "WHERE run_id = :r", r=sub.run_id, t=T0)
    execute(store, "UPDATE runs SET status = :s WHERE run_id = :r", r=sub.run_id, s=marker)
    clock.advance(61)
    assert store.reconcile()["active_without_lease_recovered"] == 1
    assert run_row(store, sub.run_id).status == "FAILED"
    assert store.reconcile()["active_without_lease_recovered"] == 0


def test_audit_reports_a_write_made_with_a_stale_fencing_token(
        store: Store, clock: ManualClock) -> None:
    """Invariant 3 (every worker write fenced): a write carrying an old token after a
    newer lease began (``stale_token_write``, once only in the fault harness's checks)
    is reported by ``runlane audit``."""
    [sub] = submit(store)
    store.claim("w1", lease_ttl=TTL)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    clock.advance(100)
    store.claim("w2", lease_ttl=TTL)
    assert store.audit() == []
    # the old worker's write, after the new lease began, with its old token
    execute(store, "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, "
            "to_status, fencing_token) VALUES (:r, 1, :at, 'w1', 'CLAIMED', 'RUNNING', 1)",
            r=sub.run_id, at=clock.now() + 1)
    assert "stale_token_write" in {v.check for v in store.audit()}
    from runlane.store.invariants import check_database
    assert [v.check for v in check_database(store)].count("stale_token_write") == 1


def test_audit_reports_a_run_claimed_again_after_its_cancel(store: Store) -> None:
    """Invariant 5 (cancellation monotonic): a CLAIMED event after CANCELLED."""
    [sub] = submit(store)
    store.cancel(sub.task_id)
    execute(store, "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, "
            "to_status, fencing_token) VALUES (:r, 1, :at, 'w1', 'QUEUED', 'CLAIMED', 1)",
            r=sub.run_id, at=T0 + 5)
    assert {"claimed_after_cancel", "event_chain_broken"} <= {v.check for v in store.audit()}


# Legitimate histories the new checks must stay quiet on, then corruptions of them.


def legit_population(store: Store, clock: ManualClock) -> dict[str, str]:
    """A success through every stage, a retried failure, a recovered (reaped) run, a
    cancel while running, a cancelled dependency chain, a pruned run, a drained
    (released) run claimed again by the same worker, queued runs and a live one."""
    from runlane.store.retention import prune_finished

    ids: dict[str, str] = {}
    [old] = submit(store, prompt="pruned")
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.FINALIZING)
    store.complete(lease)
    clock.advance(10 * 86400)
    prune_finished(store, keep_seconds=86400)
    ids["pruned"] = old.run_id

    [ok] = submit(store, prompt="ok")
    [lease] = store.claim("w1", lease_ttl=TTL)
    for stage in (S.PREPARING_SANDBOX, S.RUNNING, S.VERIFYING, S.JUDGING, S.FINALIZING):
        store.advance(lease, stage)
    store.complete(lease)
    ids["ok"] = ok.run_id

    [retried] = submit(store, prompt="retried")
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    store.fail(lease, Reason.PROVIDER_RATE_LIMIT)
    clock.advance(200)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.FINALIZING)
    store.complete(lease)
    ids["retried"] = retried.run_id

    [lost] = submit(store, prompt="recovered")
    [lease] = store.claim("w-dead", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    clock.advance(TTL + 1)
    assert store.reap_expired_leases() == 1
    clock.advance(200)
    [lease] = store.claim("w2", lease_ttl=TTL)
    store.advance(lease, S.FINALIZING)
    store.complete(lease)
    ids["recovered"] = lost.run_id

    submit(store, prompt="drained")
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.release(lease)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.complete(lease)

    [cancelled] = submit(store, prompt="cancel while running")
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    store.cancel(cancelled.task_id)
    store.acknowledge_cancel(lease)
    store.finish_cancel(lease)
    ids["cancelled"] = cancelled.run_id

    [parent] = submit(store, prompt="parent")
    [child] = submit(store, prompt="child", depends_on=[parent.task_id])
    submit(store, prompt="grandchild", depends_on=[child.task_id])
    store.cancel(parent.task_id)
    store.schedule_pass()

    submit(store, prompt="queued 1")
    submit(store, prompt="queued 2")
    assert store.claim("w3", lease_ttl=TTL)
    store.reconcile()
    return ids


def test_the_audit_is_quiet_on_legitimate_histories(store: Store, clock: ManualClock) -> None:
    legit_population(store, clock)
    assert store.audit() == []
    from runlane.store.invariants import check_database
    assert {v.check for v in check_database(store)} <= {"run_not_terminal"}


def _resurrect(store: Store, ids: dict[str, str]) -> None:
    """A SUCCEEDED run claimed again: its status overwritten without an event (a
    non-CAS write), then a claim's consistent writes (attempt 2, token 2, event)."""
    r, now = ids["ok"], T0 + 20 * 86400
    execute(store, "UPDATE runs SET status = 'CLAIMED', attempt_count = 2, fencing_token = 2,"
            " ended_at = NULL WHERE run_id = :r", r=r)
    execute(store, "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,"
            " lease_status, lease_expires_at, heartbeat_at, started_at, cost_usd,"
            " input_tokens, output_tokens) VALUES (:r, 2, 2, 'w9', 'RUNNING', 'ACTIVE',"
            " :exp, :now, :now, 0, 0, 0)", r=r, now=now, exp=now + 10**6)
    execute(store, "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, "
            "to_status, fencing_token) VALUES (:r, 2, :now, 'w9', 'QUEUED', 'CLAIMED', 2)",
            r=r, now=now)


def _stale_write(store: Store, ids: dict[str, str]) -> None:
    """The dead worker (token 1) wrote about the recovered run after the newer lease
    (token 2) began."""
    [_, second] = attempts_of(store, ids["recovered"])
    execute(store, "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, "
            "to_status, fencing_token) VALUES (:r, 1, :at, 'w-dead', 'RUNNING', "
            "'VERIFYING', 1)", r=ids["recovered"], at=second.started_at + 1)


def _delete_lane(store: Store, ids: dict[str, str]) -> None:
    """The lane of the queued runs is gone: they keep a lane_id no lane has."""
    execute(store, "DELETE FROM lanes WHERE lane_id IN (SELECT lane_id FROM runs"
            " WHERE status = 'QUEUED')")


def _second_run(store: Store, ids: dict[str, str]) -> None:
    """A second QUEUED run for the task of a queued run (the lane counts it): the task
    would execute twice."""
    with store.engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM runs WHERE status = 'QUEUED' LIMIT 1")
                           ).mappings().one()
    cols = ", ".join(c for c in row if c != "run_id")
    execute(store, f"INSERT INTO runs (run_id, {cols}) SELECT 'dup-run', {cols} FROM runs "
            "WHERE run_id = :r", r=row["run_id"])
    execute(store, "UPDATE lanes SET queued_count = queued_count + 1 WHERE lane_id = :l",
            l=row["lane_id"])


CORRUPTIONS = {
    "left_terminal_state": (_resurrect, "event_chain_broken"),
    "stale_token_write": (_stale_write, "stale_token_write"),
    "dangling_lane": (_delete_lane, "queued_run_without_lane"),
    "second_run_for_a_task": (_second_run, "task_with_two_runs"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_audit_reports_corruption(store: Store, clock: ManualClock, kind: str) -> None:
    ids = legit_population(store, clock)
    assert store.audit() == []
    corrupt, expected = CORRUPTIONS[kind]
    corrupt(store, ids)
    assert expected in {v.check for v in store.audit()}


@pytest.mark.parametrize("corruption, check", [
    # The tenant is marked full though no limit exists: its lanes leave ix_lanes_pick.
    ("UPDATE lanes SET tenant_at_limit = 1", "lane_hidden_below_tenant_limit"),
    # The lane sleeps until year 287,000 though its runs are due now.
    ("UPDATE lanes SET wake_at = 9e12", "lane_asleep_past_its_runs"),
])
def test_a_runnable_lane_hidden_from_claims_is_reported(
        store: Store, corruption: str, check: str) -> None:
    """Derived lane state that hides runnable runs from every claim, forever: the audit
    reports it, about the lane (``lane_id``, not ``run_id``), and every reconciler pass
    repairs it (the tenant flags were re-derived only after a recount; wake_at never)."""
    submit(store, 3)
    execute(store, corruption)
    [found] = store.audit()
    assert (found.check, found.run_id, found.subject) == (check, None, f"lane {found.lane_id}")
    counts = store.reconcile()
    repair = {"lane_hidden_below_tenant_limit": "tenant_flags_repaired",
              "lane_asleep_past_its_runs": "overslept_lanes_woken"}[check]
    assert {k: v for k, v in counts.items() if v} == {repair: 1}
    assert store.audit() == []
    assert len(store.claim("w1", limit=2, lease_ttl=TTL)) == 2


def test_a_lane_asleep_for_a_backoff_is_neither_reported_nor_woken(
        store: Store, clock: ManualClock) -> None:
    """A lane whose runs all wait out a long backoff sleeps until the first is due,
    however far past the recheck that is: legitimate."""
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.fail(lease, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=5000)
    assert store.claim("w1", lease_ttl=TTL) == []  # the lane goes to sleep
    with store.engine.connect() as conn:
        wake_at = conn.execute(text("SELECT wake_at FROM lanes")).scalar()
    assert wake_at == run_row(store, sub.run_id).visible_at > clock.now() + 1000
    for _ in range(3):
        assert store.audit() == []
        assert store.reconcile()["overslept_lanes_woken"] == 0
        clock.advance(1000)


def test_audit_json_names_a_lane_or_a_scope_in_its_own_field(db_url: str, tmp_path: Any
                                                             ) -> None:
    """`runlane audit --json`: a row about a lane or a limit scope carries ``lane_id``
    or ``scope``, and ``run_id`` null (it held "lane 1" / "scope x")."""
    from runlane.domain.policy import parse_policy

    from .test_cli import CLI

    store = Store(db_url)
    store.apply_policy(parse_policy("[concurrency]\nper_tenant_max_active = 2\n"),
                       source="test")
    submit(store, 2)
    store.claim("w1", lease_ttl=TTL)
    execute(store, "UPDATE lanes SET queued_count = queued_count + 3")
    execute(store, "UPDATE limit_counters SET active = active + 1")
    store.close()
    report = CLI(db_url, tmp_path).json("audit", code=1)
    rows = {v["check"]: v for v in report["violations"]}
    assert set(rows) == {"lane_count_drift", "slot_count_drift"}
    lane, slot = rows["lane_count_drift"], rows["slot_count_drift"]
    assert lane["run_id"] is None and isinstance(lane["lane_id"], int)
    assert (slot["run_id"], slot["scope"]) == (None, "tenant:acme")
    text_out = CLI(db_url, tmp_path)("audit", code=1).stdout
    assert f"lane {lane['lane_id']}:" in text_out and "scope tenant:acme:" in text_out
