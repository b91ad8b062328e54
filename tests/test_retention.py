"""Retention on both engines: only finished runs older than the cutoff go, with their
attempts, events, side effects and tasks; batches are bounded."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.domain.reasons import Reason
from runlane.services.retention import DAY, Pruner, RetentionConfig
from runlane.store.retention import PruneCursor, RetentionStatements, prune_finished
from runlane.store.store import Store

from .support import execute, submit

KEEP_DAYS = 7.0


def count(store: Store, table: str, where: str = "1 = 1", **params: object) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {table} WHERE {where}"),
                                params).scalar_one())


def finish(store: Store, n: int, *, effects: bool = False) -> list[str]:
    """n runs that succeeded now (by the manual clock); their run ids."""
    subs = submit(store, n)
    leases = store.claim("w1", limit=n, lease_ttl=60.0)
    assert len(leases) == n
    for lease in leases:
        if effects:
            store.effect_intent(lease, "push")
            store.effect_done(lease, "push", {"sha": "abc"})
        store.complete(lease)
    return [s.run_id for s in subs]


def test_prunes_only_old_finished_runs_and_what_belongs_to_them(
        store: Store, clock: ManualClock) -> None:
    old_done = finish(store, 3, effects=True)
    [old_failed] = submit(store)
    [lease] = store.claim("w1", lease_ttl=60.0)
    assert lease.run_id == old_failed.run_id
    store.fail(lease, Reason.TASK_CONTRACT_INVALID)  # not retryable: FAILED
    [old_cancelled] = submit(store)
    store.cancel(old_cancelled.task_id)
    [old_running] = submit(store)
    [running] = store.claim("w2", lease_ttl=1e9)  # leased for a week: kept
    assert running.run_id == old_running.run_id
    [old_queued] = submit(store)  # waiting for a week: unfinished, kept

    clock.advance(KEEP_DAYS * DAY + 60)
    recent = finish(store, 2)  # finished just now: kept
    recent_queued = submit(store)[0].run_id

    result = prune_finished(store, keep_seconds=KEEP_DAYS * DAY, limit=100)

    gone = [*old_done, old_failed.run_id, old_cancelled.run_id]
    assert result.runs == len(gone)
    assert result.tasks == len(gone)
    assert result.side_effects == 3
    assert result.attempts == 4  # three successes and the failure; the cancel had none
    kept = {r["run_id"] for r in store.list_runs()}
    assert kept == {old_queued.run_id, old_running.run_id, *recent, recent_queued}
    for table in ("runs", "attempts", "run_events", "side_effects"):
        assert _none_left(store, table, gone), table
    assert count(store, "tasks") == len(kept)
    assert store.audit() == []
    # The leased run is untouched and still completes.
    store.complete(running)
    # A second pass has nothing left to do.
    assert prune_finished(store, keep_seconds=KEEP_DAYS * DAY, limit=100).runs == 0


def _none_left(store: Store, table: str, run_ids: list[str]) -> bool:
    return all(count(store, table, "run_id = :r", r=run_id) == 0 for run_id in run_ids)


def test_a_finished_run_that_still_holds_an_active_lease_is_kept(
        store: Store, clock: ManualClock) -> None:
    [run_id] = finish(store, 1)
    execute(store, "UPDATE attempts SET lease_status = 'ACTIVE' WHERE run_id = :r", r=run_id)
    clock.advance(KEEP_DAYS * DAY + 60)
    assert prune_finished(store, keep_seconds=KEEP_DAYS * DAY).runs == 0
    assert count(store, "runs", "run_id = :r", r=run_id) == 1


def test_the_cutoff_is_the_last_change_not_the_submission(
        store: Store, clock: ManualClock) -> None:
    [sub] = submit(store)
    clock.advance(KEEP_DAYS * DAY + 60)  # queued for longer than the retention ...
    [lease] = store.claim("w1", lease_ttl=60.0)
    store.complete(lease)  # ... but finished just now
    assert prune_finished(store, keep_seconds=KEEP_DAYS * DAY).runs == 0
    clock.advance(KEEP_DAYS * DAY - 60)
    assert prune_finished(store, keep_seconds=KEEP_DAYS * DAY).runs == 0
    clock.advance(120)
    assert prune_finished(store, keep_seconds=KEEP_DAYS * DAY).runs == 1
    assert count(store, "tasks", "task_id = :t", t=sub.task_id) == 0


def test_batches_are_bounded_and_a_pass_stops_after_its_batches(
        store: Store, clock: ManualClock) -> None:
    finish(store, 25)
    clock.advance(KEEP_DAYS * DAY + 60)
    assert prune_finished(store, keep_seconds=KEEP_DAYS * DAY, limit=10).runs == 10
    assert count(store, "runs") == 15

    pruner = Pruner(store, RetentionConfig(keep_days=KEEP_DAYS, batch_size=4,
                                           max_batches_per_pass=2, pause_seconds=0.0))
    first = pruner.run_once()
    assert (first["runs_pruned"], first["prune_batches"]) == (8, 2)
    assert count(store, "runs") == 7
    second = Pruner(store, RetentionConfig(keep_days=KEEP_DAYS, batch_size=5,
                                           pause_seconds=0.0)).run_once()
    assert second["runs_pruned"] == 7
    assert second["tasks_pruned"] == 7
    assert second["prune_batches"] == 2  # 5, then 2 (< batch size): done
    assert count(store, "runs") == count(store, "attempts") == count(store, "tasks") == 0
    assert Pruner(store, RetentionConfig(keep_days=KEEP_DAYS)).run_once()["runs_pruned"] == 0


def test_a_task_others_depend_on_keeps_its_run_until_its_last_dependent_goes(
        store: Store, clock: ManualClock) -> None:
    """The run stays with its task: a dependent reads how its dependency ended from
    the dependency's run (tests/test_retention_integrity.py: without it, a dependent of
    a failed task was queued)."""
    if not RetentionStatements(store).has_dependencies:
        pytest.skip("no task_dependencies table in this schema")
    [upstream] = finish(store, 1)
    upstream_task = store.get_run(upstream)["task_id"]
    [downstream] = submit(store)
    execute(store, "INSERT INTO task_dependencies (task_id, depends_on) VALUES (:t, :d)",
            t=downstream.task_id, d=upstream_task)
    clock.advance(KEEP_DAYS * DAY + 60)
    first = prune_finished(store, keep_seconds=KEEP_DAYS * DAY)
    assert (first.runs, first.tasks) == (0, 0)  # still needed: the run and its task stay
    assert count(store, "runs", "run_id = :r", r=upstream) == 1

    [lease] = store.claim("w1", lease_ttl=60.0)
    store.complete(lease)
    clock.advance(KEEP_DAYS * DAY + 60)
    second = prune_finished(store, keep_seconds=KEEP_DAYS * DAY)
    assert (second.runs, second.tasks) == (1, 1)  # the dependent; then, free, the upstream
    third = prune_finished(store, keep_seconds=KEEP_DAYS * DAY)
    assert (third.runs, third.tasks) == (1, 1)
    assert count(store, "tasks") == count(store, "task_dependencies") == 0


def test_a_pass_walks_on_from_its_last_batch_and_the_next_pass_starts_over(
        store: Store, clock: ManualClock) -> None:
    """Each batch of a pass starts past the last run picked (its keyset), so it never
    rereads what the pass deleted or passed over: a run passed over (still named by a
    dependent) and freed meanwhile waits for the next pass, which starts from the
    oldest again."""
    if not RetentionStatements(store).has_dependencies:
        pytest.skip("no task_dependencies table in this schema")
    ids = []
    for _ in range(4):  # four finished runs, one second apart: oldest first
        ids += finish(store, 1)
        clock.advance(1.0)
    b = ids[1]
    [dependent] = submit(store)
    execute(store, "INSERT INTO task_dependencies (task_id, depends_on) VALUES (:t, :d)",
            t=dependent.task_id, d=store.get_run(b)["task_id"])
    clock.advance(KEEP_DAYS * DAY + 60)

    cursor = PruneCursor()
    keep = KEEP_DAYS * DAY
    assert prune_finished(store, keep_seconds=keep, limit=2, cursor=cursor).runs == 2
    assert [count(store, "runs", "run_id = :r", r=r) for r in ids] == [0, 1, 0, 1]
    execute(store, "DELETE FROM task_dependencies WHERE task_id = :t", t=dependent.task_id)
    # b is free now, but behind the walk: this pass goes on with d.
    assert prune_finished(store, keep_seconds=keep, limit=2, cursor=cursor).runs == 1
    assert [count(store, "runs", "run_id = :r", r=r) for r in ids] == [0, 1, 0, 0]
    assert prune_finished(store, keep_seconds=keep, limit=2, cursor=cursor).runs == 0
    # A new pass walks from the oldest again.
    assert prune_finished(store, keep_seconds=keep, limit=2, cursor=PruneCursor()).runs == 1
    assert count(store, "runs", "run_id = :r", r=b) == 0
