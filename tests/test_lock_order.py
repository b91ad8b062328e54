"""The lock order on PostgreSQL (docs/architecture.md, "Locks"): run rows, attempt
rows, counters in scope order, lanes in lane_id order. Each test here is a wait cycle
a review reproduced (2026-12-01): a holder, standing for a writer that keeps the
order, holds lock A; the writer under test, in a thread, takes lock B and then waits
for A; the holder then asks for B. A writer that keeps the order waits for A before
it takes B, and the holder gets B; one that does not deadlocks (DeadlockDetected)."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.store.store import Store

from .support import submit, wait_for_a_lock_wait

TTL = 30.0


def apply(store: Store, text_: str) -> int:
    return store.apply_policy(parse_policy(text_), source="test").version


def race(store: Store, first: str, second: str, params: dict[str, Any],
         writer: Callable[[], Any]) -> list[str]:
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


def lane_of(store: Store, run_id: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT lane_id FROM runs WHERE run_id = :r"),
                                {"r": run_id}).scalar_one())


LOCK_LANE = "SELECT lane_id FROM lanes WHERE lane_id = :low FOR UPDATE"
TAKE_LANE = "UPDATE lanes SET queued_count = queued_count WHERE lane_id = :high"


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
