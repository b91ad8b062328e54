"""The run lifecycle on both engines: submit, claim, heartbeat, fenced writes, reaper,
retry, cancellation, reconciler and audit. Time moves only on the manual clock."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.exc import IntegrityError

from runlane.clock import ManualClock
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskInvalid
from runlane.errors import CancelRequested, Conflict, LeaseLost, NotFound
from runlane.store.store import Store

from .conftest import T0, WITH_PGBOUNCER, db_url_with_pgbouncer
from .support import attempts_of, events_of, execute, run_row, spec, submit

# This suite runs through PgBouncer (transaction pooling) too.
db_url = pytest.fixture(params=WITH_PGBOUNCER)(db_url_with_pgbouncer)

S = RunStatus
TTL = 30.0


# --- submit -----------------------------------------------------------------------------


def test_submit_creates_task_run_and_delivery(store: Store) -> None:
    [sub] = submit(store)
    run = run_row(store, sub.run_id)
    assert (run.status, run.attempt_count, run.fencing_token) == ("QUEUED", 0, 0)
    assert run.visible_at == T0
    assert events_of(store, sub.run_id) == [(None, "QUEUED")]


def test_duplicate_submit_returns_the_same_ids_and_creates_nothing(store: Store) -> None:
    [first] = submit(store, idempotency_key="ticket-1")
    [again] = submit(store, idempotency_key="ticket-1")
    assert (again.task_id, again.run_id, again.created) == (first.task_id, first.run_id, False)
    assert len(store.list_runs()) == 1
    # The same key for another request is a conflict (issue 23), and writes nothing.
    with pytest.raises(Conflict, match="ticket-1"):
        submit(store, idempotency_key="ticket-1", prompt="a different prompt")
    assert len(store.list_runs()) == 1
    # Another tenant may use the same key.
    [other] = submit(store, idempotency_key="ticket-1", tenant="globex")
    assert other.created and other.run_id != first.run_id


def test_duplicates_inside_one_batch_collapse(store: Store) -> None:
    subs = store.submit([spec(idempotency_key="k"), spec(idempotency_key="k"), spec()])
    assert subs[0].run_id == subs[1].run_id
    assert [s.created for s in subs] == [True, False, True]
    assert len({s.run_id for s in subs}) == 2
    assert len(store.list_runs()) == 2


def test_concurrent_duplicate_submits_create_one_run(db_url: str, clock: ManualClock) -> None:
    stores = [Store(db_url, clock=clock) for _ in range(4)]
    results: list[str] = []
    barrier = threading.Barrier(len(stores))

    def go(s: Store) -> None:
        barrier.wait()
        results.append(s.submit([spec(idempotency_key="same")])[0].run_id)

    threads = [threading.Thread(target=go, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    assert len(stores[0].list_runs()) == 1
    for s in stores:
        s.close()


def test_batch_is_all_or_nothing(store: Store) -> None:
    with pytest.raises(TaskInvalid):
        store.submit([spec(), spec(tenant="")])
    assert store.list_runs() == []


def test_payload_over_cap_is_refused_without_writing(db_url: str, clock: ManualClock) -> None:
    small = Store(db_url, clock=clock, payload_cap_bytes=1000)
    with pytest.raises(TaskInvalid, match="PAYLOAD_TOO_LARGE"):
        small.submit([spec(), spec(prompt="p" * 2000)])
    [sub] = small.submit([spec(context={"diff": "d" * 5000})])
    assert sub.truncated_sections == ("diff",)
    assert small.get_run(sub.run_id)["task"]["truncated_sections"] == ["diff"]
    assert len(small.list_runs()) == 1
    small.close()


# --- claim --------------------------------------------------------------------------------


def test_claim_is_batched_and_ordered_by_priority_then_age(store: Store, clock: ManualClock
                                                           ) -> None:
    low = submit(store, priority="low")[0]
    clock.advance(1)
    critical = submit(store, priority="critical")[0]
    clock.advance(1)
    normal = submit(store, 2)
    leases = store.claim("w1", limit=10, lease_ttl=TTL)
    order = [lease.run_id for lease in leases]
    assert order[0] == critical.run_id and order[3] == low.run_id
    assert set(order[1:3]) == {n.run_id for n in normal}
    assert all(lease.fencing_token == 1 and lease.attempt_no == 1 for lease in leases)
    assert store.claim("w2") == []


def test_claim_takes_only_its_queue_and_only_visible_runs(store: Store, clock: ManualClock
                                                          ) -> None:
    submit(store, queue="java")
    [lease] = store.claim("w1", queue="java")
    store.fail(lease, Reason.WORKER_LOST)  # retryable: back to the queue after backoff
    assert store.claim("w1", queue="default") == []
    assert store.claim("w1", queue="java") == []  # not visible yet
    clock.advance(13)  # base 10 s + up to 25 % jitter
    assert [x.attempt_no for x in store.claim("w1", queue="java")] == [2]


def test_two_claimers_race_for_one_run_and_exactly_one_wins(db_url: str, clock: ManualClock
                                                            ) -> None:
    """Drill 2: a duplicated delivery is claimed once, round after round."""
    stores = [Store(db_url, clock=clock) for _ in range(4)]
    subs = stores[0].submit([spec() for _ in range(40)])
    errors: list[Exception] = []
    for sub in subs:
        won: list[int] = []
        barrier = threading.Barrier(len(stores))

        def go(i: int, s: Store, run_id: str = sub.run_id, won: list[int] = won,
               barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            try:
                won.extend([i] * len(s.claim(f"w{i}", run_id=run_id)))
            except Exception as exc:  # a lost race must be an empty claim, not an error
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(i, s)) for i, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert len(won) == 1
        assert len(attempts_of(stores[0], sub.run_id)) == 1
    for s in stores:
        s.close()


def test_claim_revalidates_the_task(store: Store) -> None:
    """Invariant 1: a QUEUED row whose task was cancelled is not executed: the claim
    re-reads the task and prunes the run (and so does the reconciler)."""
    first, second = submit(store, 2)
    for sub in (first, second):
        execute(store, "UPDATE tasks SET cancel_requested_at = 1 WHERE task_id = :t",
                t=sub.task_id)
    assert store.claim("w1", run_id=first.run_id) == []
    assert store.claim("w1") == []
    for sub in (first, second):
        row = run_row(store, sub.run_id)
        assert (row.status, row.attempt_count) == ("CANCELLED", 0)
    [third] = submit(store)
    execute(store, "UPDATE tasks SET cancel_requested_at = 1 WHERE task_id = :t",
            t=third.task_id)
    assert store.reconcile()["cancelled_task_runs_cancelled"] == 1
    assert run_row(store, third.run_id).status == "CANCELLED"


def test_the_database_allows_one_active_lease_per_run(store: Store) -> None:
    """Invariant 2: enforced by the partial unique index, not by the store's logic."""
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    with pytest.raises(IntegrityError):
        execute(store, "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, "
                "status, lease_status, lease_expires_at, heartbeat_at, started_at) VALUES "
                "(:r, 2, 2, 'w2', 'RUNNING', 'ACTIVE', 0, 0, 0)", r=sub.run_id)
    assert lease.fencing_token == 1


# --- heartbeat and fencing ------------------------------------------------------------------


def test_heartbeat_extends_and_reports_lost_leases(store: Store, clock: ManualClock) -> None:
    submit(store, 2)
    a, b = store.claim("w1", limit=2, lease_ttl=TTL)
    clock.advance(20)
    beat = store.heartbeat("w1", [a, b], lease_ttl=TTL)
    assert beat.extended == {a.run_id: T0 + 20 + TTL, b.run_id: T0 + 20 + TTL}
    assert beat.lost == frozenset()
    clock.advance(TTL + 1)  # both expire; only the database clock decides
    beat = store.heartbeat("w1", [a, b], lease_ttl=TTL)
    assert beat.lost == {a.run_id, b.run_id} and beat.extended == {}


def test_heartbeat_of_another_worker_or_stale_token_extends_nothing(store: Store) -> None:
    submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    assert store.heartbeat("w2", [lease]).lost == {lease.run_id}
    lease.fencing_token = 0
    assert store.heartbeat("w1", [lease]).lost == {lease.run_id}


def test_stale_token_writes_change_nothing(store: Store, clock: ManualClock) -> None:
    """Invariant 3: a worker that lost its lease cannot write about the run."""
    [sub] = submit(store)
    [old] = store.claim("w1", lease_ttl=TTL)
    store.advance(old, S.RUNNING)
    clock.advance(TTL + 1)
    assert store.reap_expired_leases() == 1
    clock.advance(100)
    [new] = store.claim("w2", lease_ttl=TTL)
    assert new.fencing_token == old.fencing_token + 1
    before = run_row(store, sub.run_id)
    for write in (lambda: store.advance(old, S.VERIFYING),
                  lambda: store.complete(old),
                  lambda: store.fail(old, Reason.AGENT_FAILED),
                  lambda: store.report_cost(old, 1.0),
                  lambda: store.release(old)):
        with pytest.raises(LeaseLost):
            write()
    assert store.heartbeat("w1", [old]).lost == {sub.run_id}
    after = run_row(store, sub.run_id)
    assert (after.status, after.fencing_token, after.cost_usd, after.attempt_count) == (
        before.status, before.fencing_token, before.cost_usd, before.attempt_count)
    store.complete(new)
    assert run_row(store, sub.run_id).status == "SUCCEEDED"
    assert store.audit() == []


def test_an_expired_lease_cannot_write_even_before_the_reaper_runs(store: Store,
                                                                    clock: ManualClock) -> None:
    submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    clock.advance(TTL)
    with pytest.raises(LeaseLost):
        store.advance(lease, S.RUNNING)
    with pytest.raises(LeaseLost):
        store.complete(lease)


def test_stages_move_forward_only(store: Store) -> None:
    submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.VERIFYING)
    from runlane.domain.states import IllegalTransition
    with pytest.raises(IllegalTransition):
        store.advance(lease, S.RUNNING)


def test_cost_is_recorded_on_the_attempt_and_the_run(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.report_cost(lease, 0.25, input_tokens=100, output_tokens=20)
    store.report_cost(lease, 0.5)
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.cost_usd, attempt.input_tokens, attempt.output_tokens) == (0.75, 100, 20)
    assert run_row(store, sub.run_id).cost_usd == 0.75


def test_complete_releases_the_lease(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    store.complete(lease, outcome="no_changes")
    run = run_row(store, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "no_changes")
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.status, attempt.lease_status) == ("SUCCEEDED", "RELEASED")
    assert events_of(store, sub.run_id) == [
        (None, "QUEUED"), ("QUEUED", "CLAIMED"), ("CLAIMED", "RUNNING"),
        ("RUNNING", "FINALIZING"), ("FINALIZING", "SUCCEEDED")]


# --- reaper and retry --------------------------------------------------------------------------


def test_drill_1_dead_worker_is_recovered_with_backoff(store: Store, clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    clock.advance(TTL - 1)
    assert store.reap_expired_leases() == 0  # not expired yet
    clock.advance(2)
    assert store.reap_expired_leases() == 1
    run = run_row(store, sub.run_id)
    assert (run.status, run.reason_code) == ("QUEUED", "WORKER_LOST")
    assert T0 + TTL + 1 + 10 <= run.visible_at <= T0 + TTL + 1 + 12.5
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.status, attempt.reason_code, attempt.lease_status) == (
        "FAILED", "WORKER_LOST", "EXPIRED")
    assert events_of(store, sub.run_id)[-3:] == [
        ("RUNNING", "STALE_LEASE"), ("STALE_LEASE", "FAILED_RETRYABLE"),
        ("FAILED_RETRYABLE", "QUEUED")]
    assert store.claim("w2") == []
    clock.advance(13)
    [again] = store.claim("w2", lease_ttl=TTL)
    assert (again.attempt_no, again.fencing_token) == (2, 2)
    assert store.audit() == []


def test_retries_stop_when_attempts_are_spent(store: Store, clock: ManualClock) -> None:
    [sub] = submit(store, max_attempts=2)
    for _ in range(2):
        clock.advance(1000)
        [lease] = store.claim("w1", lease_ttl=TTL)
        clock.advance(TTL + 1)
        store.reap_expired_leases()
    run = run_row(store, sub.run_id)
    assert (run.status, run.attempt_count, run.reason_code) == ("FAILED", 2, "WORKER_LOST")
    assert [a.reason_code for a in attempts_of(store, sub.run_id)] == ["WORKER_LOST"] * 2
    assert run.ended_at is not None
    clock.advance(1000)
    assert store.claim("w1") == []
    assert lease.attempt_no == 2


def test_non_retryable_failure_fails_the_run_and_keeps_evidence(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    assert store.fail(lease, Reason.VERIFIER_FAILED, message="3 tests failed") == S.FAILED
    run = run_row(store, sub.run_id)
    assert (run.status, run.reason_code, run.message) == ("FAILED", "VERIFIER_FAILED",
                                                          "3 tests failed")
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.status, attempt.reason_code) == ("FAILED", "VERIFIER_FAILED")


def test_drill_5_rate_limit_waits_for_retry_after(store: Store, clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    assert store.fail(lease, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=120) == S.QUEUED
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.reason_code, attempt.retry_after_seconds) == ("PROVIDER_RATE_LIMIT", 120)
    assert run_row(store, sub.run_id).visible_at >= T0 + 120
    for _ in range(5):  # no busy loop: polling before retry-after claims nothing
        clock.advance(20)
        assert store.claim("w1") == []
    clock.advance(21)
    assert [x.attempt_no for x in store.claim("w1")] == [2]


def test_release_requeues_at_once(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    assert store.release(lease) == S.QUEUED
    assert run_row(store, sub.run_id).visible_at == T0
    assert [x.attempt_no for x in store.claim("w2")] == [2]


def test_a_drained_lease_does_not_use_up_the_last_attempt(store: Store) -> None:
    [sub] = submit(store, max_attempts=1)
    [lease] = store.claim("w1", lease_ttl=TTL)
    assert store.release(lease) == S.QUEUED
    [again] = store.claim("w2", lease_ttl=TTL)
    assert store.fail(again, Reason.WORKER_LOST) == S.FAILED  # the one real attempt
    assert run_row(store, sub.run_id).attempt_count == 2
    assert store.audit() == []


def test_ended_at_on_the_database_clock(db_url: str) -> None:
    store = Store(db_url)
    [sub] = store.submit([spec()])
    [lease] = store.claim("w1")
    store.complete(lease)
    run = run_row(store, sub.run_id)
    assert run.ended_at is not None and run.ended_at >= run.created_at
    store.close()


def test_several_reapers_recover_each_lease_once(db_url: str, clock: ManualClock) -> None:
    reapers = [Store(db_url, clock=clock) for _ in range(4)]
    subs = reapers[0].submit([spec() for _ in range(30)])
    reapers[0].claim("w1", limit=30, lease_ttl=TTL)
    clock.advance(TTL + 1)
    counts: list[int] = []
    barrier = threading.Barrier(len(reapers))

    def go(s: Store) -> None:
        barrier.wait()
        counts.append(s.reap_expired_leases(limit=7))
        counts.append(s.reap_expired_leases(limit=100))

    threads = [threading.Thread(target=go, args=(s,)) for s in reapers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sub in subs:
        assert events_of(reapers[0], sub.run_id).count(("RUNNING", "STALE_LEASE")) == 0
        assert events_of(reapers[0], sub.run_id).count(("CLAIMED", "STALE_LEASE")) == 1
        assert run_row(reapers[0], sub.run_id).status == "QUEUED"
    assert reapers[0].audit() == []
    for s in reapers:
        s.close()


# --- cancellation -----------------------------------------------------------------------------


def test_cancel_while_queued_is_immediate(store: Store) -> None:
    [sub] = submit(store)
    result = store.cancel(sub.task_id)
    assert result.runs == {sub.run_id: "CANCELLED"}
    assert store.claim("w1") == []
    assert run_row(store, sub.run_id).reason_code == "CANCELLED_BY_USER"


def test_cancel_while_running_goes_through_the_worker(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    assert store.cancel(sub.task_id).runs == {sub.run_id: "CANCEL_REQUESTED"}
    beat = store.heartbeat("w1", [lease], lease_ttl=TTL)
    assert beat.cancel_requested == {sub.run_id}
    with pytest.raises(CancelRequested):
        store.advance(lease, S.VERIFYING)  # no next stage, no next side effect
    store.acknowledge_cancel(lease)
    store.finish_cancel(lease)
    run = run_row(store, sub.run_id)
    assert run.status == "CANCELLED"
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.status, attempt.lease_status, attempt.reason_code) == (
        "CANCELLED", "RELEASED", "CANCELLED_BY_USER")
    assert events_of(store, sub.run_id)[-3:] == [
        ("RUNNING", "CANCEL_REQUESTED"), ("CANCEL_REQUESTED", "CANCELLING"),
        ("CANCELLING", "CANCELLED")]
    assert store.audit() == []


def test_cancel_is_never_reversed(store: Store, clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.cancel(sub.task_id)
    # The worker fails instead of honouring the cancel: the run still ends CANCELLED.
    assert store.fail(lease, Reason.PROVIDER_RATE_LIMIT) == S.CANCELLED
    assert store.cancel(sub.task_id).runs == {sub.run_id: "CANCELLED"}
    clock.advance(10_000)
    assert store.claim("w1") == []
    assert store.reconcile() == {k: 0 for k in store.reconcile()}
    assert run_row(store, sub.run_id).status == "CANCELLED"


def test_cancel_of_a_dead_workers_run_is_finished_by_the_reaper(store: Store,
                                                                clock: ManualClock) -> None:
    [sub] = submit(store)
    store.claim("w1", lease_ttl=TTL)
    store.cancel(sub.task_id)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    run = run_row(store, sub.run_id)
    assert (run.status, run.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.status, attempt.reason_code, attempt.lease_status) == (
        "CANCELLED", "WORKER_LOST", "EXPIRED")


def test_cancel_unknown_task(store: Store) -> None:
    with pytest.raises(NotFound):
        store.cancel("no-such-task")


# --- reconciler --------------------------------------------------------------------------------


def test_reconciler_queues_admitted_runs_that_were_never_queued(store: Store,
                                                                clock: ManualClock) -> None:
    [sub] = submit(store)
    execute(store, "UPDATE runs SET status = 'ADMITTED' WHERE run_id = :r", r=sub.run_id)
    assert store.reconcile(admitted_grace=60)["admitted_requeued"] == 0  # too fresh
    clock.advance(61)
    assert store.reconcile(admitted_grace=60)["admitted_requeued"] == 1
    assert run_row(store, sub.run_id).status == "QUEUED"
    assert store.get_run(sub.run_id)["events"][-1]["reason_code"] == (
        "RECONCILED_ADMITTED_NOT_QUEUED")


def test_reconciler_revokes_a_terminal_runs_live_lease(store: Store) -> None:
    [sub] = submit(store)
    store.claim("w1", lease_ttl=TTL)
    execute(store, "UPDATE runs SET status = 'FAILED' WHERE run_id = :r", r=sub.run_id)
    assert [v.check for v in store.audit()] == ["terminal_run_with_live_lease"]
    assert store.reconcile()["terminal_leases_revoked"] == 1
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.lease_status, attempt.reason_code) == ("REVOKED", "RECONCILED_TERMINAL_LEASE")
    assert store.audit() == []


def test_reconciler_recovers_an_active_run_without_a_lease(store: Store,
                                                           clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    execute(store, "UPDATE attempts SET lease_status = 'RELEASED' WHERE run_id = :r",
            r=sub.run_id)
    clock.advance(61)
    assert store.reconcile(active_grace=60)["active_without_lease_recovered"] == 1
    run = run_row(store, sub.run_id)
    assert (run.status, run.reason_code) == ("QUEUED", "WORKER_LOST")
    assert store.get_run(sub.run_id)["events"][-1]["message"] == "RECONCILED_ACTIVE_WITHOUT_LEASE"
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.status, attempt.reason_code, attempt.lease_status) == (
        "FAILED", "WORKER_LOST", "RELEASED")


def test_reconciler_marks_silent_workers_dead(store: Store, clock: ManualClock) -> None:
    store.register_worker("host/1/a", version="0.1.0", queues=["default"])
    store.register_worker("host/2/b", version="0.1.0", queues=["default"])
    clock.advance(100)
    store.set_worker_status("host/2/b", "READY")  # b heartbeats
    clock.advance(100)
    assert store.reconcile(worker_grace=180)["workers_marked_dead"] == 1


def test_reconciler_times_out_overlong_attempts(store: Store, clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    for _ in range(5):
        clock.advance(25)
        store.heartbeat("w1", [lease], lease_ttl=TTL)
    assert store.reconcile(max_attempt_seconds=100)["overlong_attempts_timed_out"] == 1
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.reason_code, attempt.lease_status) == ("TIMEOUT", "REVOKED")
    assert run_row(store, sub.run_id).status == "QUEUED"  # TIMEOUT is retryable
    assert store.heartbeat("w1", [lease]).lost == {sub.run_id}


# --- audit ---------------------------------------------------------------------------------------


def test_audit_finds_planted_violations(store: Store) -> None:
    submit(store, 2)
    [la, lb] = store.claim("w1", limit=2, lease_ttl=TTL)
    store.complete(la)
    # An attempt leased while the previous lease was still live, with a lower token.
    execute(store, "UPDATE attempts SET lease_status = 'EXPIRED', lease_ended_at = :t "
            "WHERE run_id = :r", r=lb.run_id, t=T0 + TTL)
    execute(store, "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,"
            " lease_status, lease_expires_at, heartbeat_at, started_at) VALUES "
            "(:r, 2, 0, 'w2', 'RUNNING', 'ACTIVE', :e, :s, :s)",
            r=lb.run_id, s=T0 + 5, e=T0 + 60)
    execute(store, "INSERT INTO run_events (run_id, at, actor, from_status, to_status) "
            "VALUES (:r, 0, 'x', 'SUCCEEDED', 'RUNNING')", r=la.run_id)
    found = {(v.check, v.run_id) for v in store.audit()}
    assert {("overlapping_leases", lb.run_id), ("fencing_token_not_increasing", lb.run_id),
            ("attempts_not_contiguous", lb.run_id), ("illegal_transition", la.run_id)} <= found


def test_audit_finds_orphans_of_the_hot_tables(store: Store) -> None:
    """runs, attempts and run_events carry no foreign keys (migration 0007): a child
    written without its parent must show in the audit, and a clean database shows none."""
    [sub] = submit(store)
    store.complete(store.claim("w1", lease_ttl=TTL)[0])
    assert store.audit() == []
    execute(store, "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,"
            " max_attempts, visible_at, created_at, updated_at, lane_id) VALUES "
            "('run-x', 'no-such-task', 'acme', 'r', 'default', 2, 'CANCELLED', 3, 0, 0, 0, NULL)")
    execute(store, "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,"
            " reason_code, lease_status, lease_expires_at, heartbeat_at, started_at, ended_at)"
            " VALUES ('run-y', 1, 1, 'w1', 'FAILED', 'TIMEOUT', 'EXPIRED', 0, 0, 0, 0)")
    execute(store, "INSERT INTO run_events (run_id, at, actor, from_status, to_status) "
            "VALUES ('run-z', 0, 'x', NULL, 'QUEUED')")
    found = {(v.check, v.run_id) for v in store.audit()}
    assert found == {("run_without_task", "run-x"), ("attempt_without_run", "run-y"),
                     ("event_without_run", "run-z")}
    # The parent of a real run deleted: its attempt and events are orphans at once.
    execute(store, "DELETE FROM runs WHERE run_id = :r", r=sub.run_id)
    found = {(v.check, v.run_id) for v in store.audit()}
    assert {("attempt_without_run", sub.run_id), ("event_without_run", sub.run_id)} <= found
