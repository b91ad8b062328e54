"""The lock order on PostgreSQL (docs/architecture.md, "Locks"): run rows, attempt
rows, counters in scope order, lanes in lane_id order. Each test here is a wait cycle
a review reproduced (2026-12-01): a holder, standing for a writer that keeps the
order, holds lock A; the writer under test, in a thread, takes lock B and then waits
for A; the holder then asks for B. A writer that keeps the order waits for A before
it takes B, and the holder gets B; one that does not deadlocks (DeadlockDetected)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.store.records import Submission
from runlane.store.retention import prune_finished
from runlane.store.store import Store
from runlane.store.wakeup import libpq_url

from .support import submit, wait_for_a_lock_wait

TTL = 30.0


def apply(store: Store, text_: str) -> int:
    return store.apply_policy(parse_policy(text_), source="test").version


def race(store: Store, first: str, second: str, params: dict[str, Any],
         writer: Callable[[], Any], *, may_skip: bool = False) -> list[str]:
    """The holder takes ``first``; the writer runs in a thread until it waits for a
    lock (or, ``may_skip``, until it ends without waiting: it skips held rows); the
    holder takes ``second`` and commits. The errors either side met."""
    errors: list[str] = []

    def run() -> None:
        try:
            writer()
        except BaseException as exc:
            errors.append(f"writer: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    with store.engine.connect() as holder:
        holder.execute(text(first), params)
        thread = threading.Thread(target=run)
        thread.start()
        if may_skip:
            wait_for_a_lock_wait_or_the_end(store.url, thread)
        else:
            wait_for_a_lock_wait(store.url, "", "the writer's wait")
        holder.execute(text("SET LOCAL lock_timeout = '5s'"))
        try:
            holder.execute(text(second), params)
            holder.commit()
        except BaseException as exc:
            errors.append(f"holder: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            holder.rollback()
    thread.join(timeout=30)
    return errors


def wait_for_a_lock_wait_or_the_end(url: str, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 30.0
    with psycopg.connect(libpq_url(url), autocommit=True) as watch:
        while time.monotonic() < deadline and thread.is_alive():
            waiting = watch.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'").fetchone()
            if waiting and waiting[0] >= 1:
                return
            time.sleep(0.01)
    if thread.is_alive():
        raise AssertionError("the writer neither waited for a lock nor finished")


def lane_of(store: Store, run_id: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT lane_id FROM runs WHERE run_id = :r"),
                                {"r": run_id}).scalar_one())


LOCK_LANE = "SELECT lane_id FROM lanes WHERE lane_id = :low FOR UPDATE"
TAKE_LANE = "UPDATE lanes SET queued_count = queued_count WHERE lane_id = :high"
LOCK_RUN = "SELECT run_id FROM runs WHERE run_id = :d FOR UPDATE"
LOCK_TENANT_COUNTER = ("SELECT scope FROM limit_counters WHERE scope = 'tenant:acme' "
                       "FOR UPDATE")


def pg_only(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks")


def test_a_completion_releases_dependents_of_two_lanes_in_lane_id_order(
        store: Store, db_url: str) -> None:
    pg_only(db_url)
    [x] = submit(store)
    [lease] = store.claim("w", limit=1, lease_ttl=TTL)
    submit(store, priority="low")      # the low-priority lane first: the lower lane_id
    submit(store, priority="high")     # the high-priority lane: a higher lane_id
    [d_high] = submit(store, priority="high", depends_on=[x.task_id])  # meets L3 first
    [d_low] = submit(store, priority="low", depends_on=[x.task_id])
    low, high = lane_of(store, d_low.run_id), lane_of(store, d_high.run_id)
    assert low < high, (low, high)
    errors = race(store, LOCK_LANE, TAKE_LANE, {"low": low, "high": high},
                  lambda: store.complete(lease))
    assert errors == []


def test_a_release_shows_the_lanes_of_two_tenants_in_lane_id_order(
        store: Store, db_url: str) -> None:
    pg_only(db_url)
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, tenant="b")   # tenant b: the lower lane
    submit(store, tenant="a")   # tenant a: the higher lane
    leases = store.claim("w", limit=2, lease_ttl=TTL)
    leases += store.claim("w", limit=2, lease_ttl=TTL)
    assert len(leases) == 2
    with store.engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT tenant, lane_id FROM lanes")).all())
        flags = set(conn.execute(text("SELECT tenant_at_limit FROM lanes")).scalars())
    assert flags == {1}, flags
    low, high = rows["b"], rows["a"]
    assert low < high
    errors = race(store, LOCK_LANE, TAKE_LANE, {"low": low, "high": high},
                  lambda: store.complete_many(leases))
    assert errors == []


def test_a_policy_change_recomputes_tenant_flags_in_lane_id_order(
        store: Store, db_url: str) -> None:
    """Both tenants are at their limit; a policy that raises it shows their lanes
    again, locked in lane_id order (an UPDATE of every lane took them in scan order:
    the lower lane, written last, came after the higher one)."""
    pg_only(db_url)
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, tenant="x")  # the lower lane
    submit(store, tenant="y")  # the higher lane
    assert len(store.claim("w", limit=2, lease_ttl=TTL)) == 2  # both tenants full
    with store.engine.connect() as conn:
        rows = dict(conn.execute(text("SELECT tenant, lane_id FROM lanes")).all())
        assert set(conn.execute(text("SELECT tenant_at_limit FROM lanes")).scalars()) == {1}
        # the lower lane's row written again: its new version comes after the higher's
        conn.execute(text("UPDATE lanes SET pass = pass + 1 WHERE lane_id = :l"),
                     {"l": rows["x"]})
        conn.commit()
    low, high = rows["x"], rows["y"]
    errors = race(store, LOCK_LANE, TAKE_LANE, {"low": low, "high": high},
                  lambda: apply(store, "[concurrency]\nper_tenant_max_active = 3\n"))
    assert errors == []
    with store.engine.connect() as conn:
        assert set(conn.execute(text("SELECT tenant_at_limit FROM lanes")).scalars()) == {0}


def test_a_reconcile_never_locks_a_counter_after_a_lane(
        store: Store, db_url: str, clock: ManualClock) -> None:
    pg_only(db_url)
    apply(store, "[concurrency]\nper_repository_max_active = 5\n")
    [r1] = submit(store, repo="/srv/git/a.git")
    assert store.claim("w", limit=1, lease_ttl=10_000)
    clock.advance(100)  # r1's attempt is overlong (> 50 s); r2's, claimed now, is not
    [r2] = submit(store, repo="/srv/git/b.git")  # same tenant: the same lane
    other = store.claim("w2", limit=1, lease_ttl=10_000)  # counter repo:b exists
    assert other
    lane = lane_of(store, r1.run_id)
    assert lane == lane_of(store, r2.run_id)
    # holder: a claim of a repo-b run of the lane: counter repo:b, then the lane
    errors = race(
        store, "SELECT scope FROM limit_counters WHERE scope = 'repo:/srv/git/b.git' FOR UPDATE",
        TAKE_LANE, {"high": lane},
        lambda: store.reconcile(max_attempt_seconds=50))
    assert errors == []


def test_a_cancel_locks_its_dependents_before_the_lane_its_run_leaves(
        store: Store, db_url: str) -> None:
    """Cancelling a queued run's task cancels the runs waiting for it. The holder
    stands for a completion of another of their dependencies: it locked a dependent's
    row and writes a lane last. A cancel that wrote its run's lane at once, then
    locked the dependents, deadlocked with it."""
    pg_only(db_url)
    [x] = submit(store)
    [y] = submit(store)
    [d] = submit(store, depends_on=[x.task_id, y.task_id])
    lane = lane_of(store, x.run_id)
    errors = race(store, "SELECT run_id FROM runs WHERE run_id = :d FOR UPDATE", TAKE_LANE,
                  {"d": d.run_id, "high": lane}, lambda: store.cancel(x.task_id))
    assert errors == []
    with store.engine.connect() as conn:
        statuses = dict(conn.execute(text(
            "SELECT run_id, status FROM runs WHERE run_id IN (:x, :d)"),
            {"x": x.run_id, "d": d.run_id}).all())
    assert statuses == {x.run_id: "CANCELLED", d.run_id: "CANCELLED"}


# --- a second review (2026-12-02): releases, retention, batch refusals ---------------


def _tenant_full_with_a_dependent(store: Store, **fields: object
                                  ) -> tuple[Submission, Submission, Any, int]:
    """Tenant acme limited to 1: x claimed (its lanes hidden), d waits for x in x's
    lane (flagged tenant_at_limit)."""
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    [x] = submit(store, **fields)
    [lease] = store.claim("w", limit=1, lease_ttl=TTL)
    [d] = submit(store, depends_on=[x.task_id])
    lane = lane_of(store, d.run_id)
    assert lane == lane_of(store, x.run_id)
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT tenant_at_limit FROM lanes WHERE lane_id = :l"),
                            {"l": lane}).scalar_one() == 1
    return x, d, lease, lane


def test_a_completion_that_shows_its_tenants_lanes_locks_no_dependent_after_them(
        store: Store, db_url: str) -> None:
    """complete(x) gives back x's tenant slot: the tenant drops below its limit and
    MARK_TENANT_LANES (in _give_back_slots_many) locks the tenant's lanes; then
    _resolve_dependents locks d's run row (DEPENDENT_RUNS ... FOR UPDATE): a run row
    after a lane. The holder stands for a transaction that holds d's row and writes
    d's lane last (another dependency's completion that releases a second dependent
    of that lane, or a scheduler page). Before its fix the writer waited in DEPENDENT_RUNS
    and one side got DeadlockDetected."""
    pg_only(db_url)
    _, d, lease, lane = _tenant_full_with_a_dependent(store)
    errors = race(store, LOCK_RUN, TAKE_LANE, {"d": d.run_id, "high": lane},
                  lambda: store.complete(lease))
    assert errors == []


def test_a_failed_attempt_that_shows_its_tenants_lanes_locks_no_dependent_after_them(
        store: Store, db_url: str) -> None:
    """The same order in _end_attempt (a worker's fail, the reaper, the reconciler):
    _give_back_slots (MARK_TENANT_LANES) before _set_status -> FAILED ->
    _resolve_dependents, which locks d's run row after the tenant's lanes (the writer
    waits in DEPENDENT_RUNS; DeadlockDetected)."""
    pg_only(db_url)
    _, d, lease, lane = _tenant_full_with_a_dependent(store, max_attempts=1)
    errors = race(store, LOCK_RUN, TAKE_LANE, {"d": d.run_id, "high": lane},
                  lambda: store.fail(lease, Reason.WORKER_LOST))
    assert errors == []


def test_retention_never_waits_for_a_task_after_locking_its_run(
        store: Store, db_url: str, clock: ManualClock) -> None:
    """prune_finished locks the finished runs it picks (FOR UPDATE SKIP LOCKED), then
    deletes their tasks, waiting for each task row. A cancel of that (finished) task
    takes the task row first (MARK_TASK_CANCELLED) and then the task's runs
    (RUNS_OF_TASK ... FOR UPDATE). The holder stands for that cancel: it holds the task
    row; the prune locks the run and waits in DELETE FROM tasks; the holder then asks
    for the run (DeadlockDetected). A prune that skips runs whose task is held (or
    never waits for a task row) passes."""
    pg_only(db_url)
    [x] = submit(store)
    [lease] = store.claim("w", limit=1, lease_ttl=TTL)
    store.complete(lease)
    clock.advance(10)
    errors = race(
        store, "UPDATE tasks SET cancel_requested_at = 1 WHERE task_id = :t",
        "SELECT run_id FROM runs WHERE task_id = :t FOR UPDATE", {"t": x.task_id},
        lambda: prune_finished(store, keep_seconds=0), may_skip=True)
    assert errors == []


def test_a_batch_completion_locks_a_refused_leases_run_before_its_counters(
        store: Store, db_url: str) -> None:
    """complete_many([a, b]) where b's task was cancelled meanwhile: the batch's write
    completes a, gives its slot back (locks the counter tenant:acme), and only then
    explains b's refusal: _refusal -> _live_snapshot -> RUN_WITH_ATTEMPT ... FOR UPDATE,
    b's run row after a counter. The holder stands for a writer that ends b's attempt
    in the order (run row, attempt, counters): the worker's finish_cancel, the reaper,
    the reconciler. The writer waited in RUN_WITH_ATTEMPT (DeadlockDetected); now it
    reads why b lost without a lock, and never waits."""
    pg_only(db_url)
    apply(store, "[concurrency]\nper_tenant_max_active = 5\n")
    [a] = submit(store)
    [b] = submit(store)
    leases = {lease.run_id: lease for lease in store.claim("w", limit=2, lease_ttl=TTL)}
    assert set(leases) == {a.run_id, b.run_id}
    store.cancel(b.task_id)  # b: CANCEL_REQUESTED, its lease still live
    errors = race(store, LOCK_RUN, LOCK_TENANT_COUNTER, {"d": b.run_id},
                  lambda: store.complete_many([leases[a.run_id], leases[b.run_id]]),
                  may_skip=True)
    assert errors == []


def test_a_release_locks_the_lanes_it_moves_and_shows_in_one_lane_id_order(
        store: Store, db_url: str) -> None:
    """complete(x) takes tenant acme below its limit (its lanes show again, the low
    lane among them) and releases d into the high lane. Both sets of lanes are locked
    at once, in lane_id order (LOCK_LANES_TO_WRITE); written in two passes, each in
    order, the high lane (d's move) came before the low one (the tenant's mark)."""
    pg_only(db_url)
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, priority="low")  # the low lane: the lower lane_id
    [x] = submit(store, priority="high")  # the high lane
    [lease] = store.claim("w", limit=1, lease_ttl=TTL)
    assert lease.run_id == x.run_id  # acme is full: its lanes are hidden
    [d] = submit(store, priority="high", depends_on=[x.task_id])
    with store.engine.connect() as conn:
        lanes = dict(conn.execute(text("SELECT priority, lane_id FROM lanes")).all())
    low, high = min(lanes.values()), max(lanes.values())
    assert lane_of(store, d.run_id) == high
    errors = race(store, LOCK_LANE, TAKE_LANE, {"low": low, "high": high},
                  lambda: store.complete(lease))
    assert errors == []
