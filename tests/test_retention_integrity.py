"""Data integrity around what runlane keeps and deletes (retention, dependencies,
lineage, idempotency). Each test states what a user of a production scheduler expects;
each failed before its fix (a review, 2026-12-02)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event, text

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskInvalid
from runlane.services.retention import DAY
from runlane.store.retention import prune_finished
from runlane.store.store import Store

from .conftest import truncate_pg
from .support import run_row, spec, submit

S = RunStatus
KEEP_DAYS = 7.0
KEEP = KEEP_DAYS * DAY
TTL = 60.0


def count(store: Store, table: str, where: str = "1 = 1", **params: object) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT COUNT(*) FROM {table} WHERE {where}"),
                                params).scalar_one())


def succeed(store: Store, run_id: str) -> None:
    [lease] = store.claim("w1", run_id=run_id, lease_ttl=TTL)
    store.complete(lease)


def prune_all(store: Store) -> None:
    while prune_finished(store, keep_seconds=KEEP, limit=500).runs:
        pass


def tasks_without_run(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return [r.task_id for r in conn.execute(text(
            "SELECT t.task_id FROM tasks t WHERE NOT EXISTS "
            "(SELECT 1 FROM runs r WHERE r.task_id = t.task_id)"))]


# --- retention and dependencies -------------------------------------------------------


def test_a_finished_chain_of_three_dependent_tasks_is_pruned_whole(
        store: Store, clock: ManualClock) -> None:
    """a <- b <- c, all succeeded long ago: once every run is pruned, no task is left
    behind without its run (retention.py: "it goes with its last dependent")."""
    [a] = submit(store)
    [b] = store.submit([spec(depends_on=[a.task_id])])
    [c] = store.submit([spec(depends_on=[b.task_id])])
    for sub in (a, b, c):
        succeed(store, sub.run_id)
    clock.advance(KEEP + 60)
    prune_all(store)
    assert count(store, "runs") == 0
    assert tasks_without_run(store) == []  # fails: task a stays forever, with no run


def test_a_key_whose_task_retention_kept_without_its_run_can_be_submitted_again(
        store: Store, clock: ManualClock) -> None:
    """Retention keeps a finished task others depend on but deletes its run; a submit
    with that task's idempotency key must still answer (not crash)."""
    [a] = submit(store, idempotency_key="nightly-2027-01-15")
    succeed(store, a.run_id)
    store.submit([spec(depends_on=[a.task_id])])  # released, stays QUEUED
    clock.advance(KEEP + 60)
    prune_all(store)
    assert count(store, "tasks", "task_id = :t", t=a.task_id) == 1  # kept, run gone
    [again] = submit(store, idempotency_key="nightly-2027-01-15")  # fails: NoResultFound
    assert again.task_id == a.task_id and not again.created


def test_a_deferred_dependent_of_a_failed_task_is_cancelled_even_after_its_run_was_pruned(
        store: Store, clock: ManualClock) -> None:
    """d waits for capacity (its queue is paused) when its dependency a fails. Retention
    then prunes a's run (d keeps a's task). When d is admitted again it must end
    CANCELLED / DEPENDENCY_FAILED, as it would have before the prune, never run."""
    [a] = submit(store)
    store.apply_policy(parse_policy(
        "[[rules]]\nwhen = { queue = 'later' }\naction = 'defer'\n"
        "retry_after_seconds = 3600\n"), source="test")
    [d] = store.submit([spec(queue="later", depends_on=[a.task_id])])
    assert d.status == S.WAITING_CAPACITY.value
    [lease] = store.claim("w1", run_id=a.run_id, lease_ttl=TTL)
    store.fail(lease, Reason.TASK_CONTRACT_INVALID)  # not retryable: FAILED
    assert run_row(store, a.run_id).status == S.FAILED.value
    clock.advance(KEEP + 60)
    prune_all(store)  # a's run goes; its task stays (d depends on it)
    store.apply_policy(parse_policy("[defaults]\nqueue = 'default'\n"), source="test")
    store.schedule_pass(not_yet_due=True)
    row = run_row(store, d.run_id)
    # fails: QUEUED (reason None): a run whose dependency failed is about to be executed
    assert (row.status, row.reason_code) == (S.CANCELLED.value, Reason.DEPENDENCY_FAILED)


def forget_runs_as_an_earlier_retention_did(store: Store, *task_ids: str) -> None:
    """The state an earlier retention left: a finished task kept (another depended on
    it) without its run."""
    with store.engine.begin() as conn:
        for task_id in task_ids:
            run_ids = list(conn.execute(text("SELECT run_id FROM runs WHERE task_id = :t"),
                                        {"t": task_id}).scalars())
            for table in ("run_events", "attempts", "runs"):
                conn.execute(text(f"DELETE FROM {table} WHERE run_id = :r"),
                             [{"r": r} for r in run_ids])


def test_tasks_an_earlier_retention_kept_without_runs_go_with_their_last_dependent(
        store: Store, clock: ManualClock) -> None:
    """a <- b <- c: an earlier retention kept a and b without their runs. When c goes,
    b and then a have nothing left that needs them: they go in the same batch."""
    [a] = submit(store)
    [b] = store.submit([spec(depends_on=[a.task_id])])
    [c] = store.submit([spec(depends_on=[b.task_id])])
    for sub in (a, b, c):
        succeed(store, sub.run_id)
    forget_runs_as_an_earlier_retention_did(store, a.task_id, b.task_id)
    clock.advance(KEEP + 60)
    prune_all(store)
    assert count(store, "tasks") == count(store, "task_dependencies") == 0


def test_the_key_of_a_task_kept_without_its_run_is_refused_with_a_reason(
        store: Store, clock: ManualClock) -> None:
    """Submitting again the idempotency key of a task an earlier retention kept
    without its run: a clear refusal naming the key, not NoResultFound."""
    [a] = submit(store, idempotency_key="nightly-2027-01-16")
    succeed(store, a.run_id)
    store.submit([spec(depends_on=[a.task_id])])
    forget_runs_as_an_earlier_retention_did(store, a.task_id)
    with pytest.raises(TaskInvalid, match=r"nightly-2027-01-16.*retention"):
        submit(store, idempotency_key="nightly-2027-01-16")


# --- retention and lineage ------------------------------------------------------------


def test_a_task_named_as_parent_by_a_live_task_is_kept(
        store: Store, clock: ManualClock) -> None:
    """Lineage: pruning a finished parent must not leave a live follow-up task naming
    a task that no longer exists (as it keeps a task others depend on)."""
    [parent] = submit(store)
    succeed(store, parent.run_id)
    clock.advance(KEEP + 60)
    [child] = store.submit([spec(parent_task_id=parent.task_id)])  # queued, live
    prune_all(store)
    assert run_row(store, child.run_id).status == S.QUEUED.value
    parent_id = store.get_run(child.run_id)["task"]["parent_task_id"]
    assert count(store, "tasks", "task_id = :t", t=parent_id) == 1  # failed: 0
    assert count(store, "runs", "task_id = :t", t=parent_id) == 1  # shown with its run


def test_a_dependency_on_a_succeeded_task_that_retention_kept_is_accepted(
        store: Store, clock: ManualClock) -> None:
    """Retention keeps task a (another task depends on it) and deletes its run. a still
    exists (``get_task`` returns it), so a new task depending on it must be accepted
    (a succeeded: released at once), not refused with "no task a"."""
    [a] = submit(store)
    succeed(store, a.run_id)
    store.submit([spec(depends_on=[a.task_id])])  # released, stays QUEUED
    clock.advance(KEEP + 60)
    prune_all(store)
    assert store.get_task(a.task_id)["task_id"] == a.task_id
    # fails: TaskInvalid: depends_on: no task '<a>'
    [d] = store.submit([spec(depends_on=[a.task_id])])
    assert d.status == S.QUEUED.value


# --- retention racing a submit (PostgreSQL: SQLite's submit holds the write lock) ------


@pytest.fixture
def pg_store(pg_url: str, clock: ManualClock) -> Iterator[Store]:
    truncate_pg(pg_url)
    s = Store(pg_url, clock=clock)
    yield s
    s.close()


@pytest.fixture
def prune_while_writing_dependencies(pg_store: Store, clock: ManualClock
                                     ) -> Iterator[Callable[[], None]]:
    """Arms a prune (another session) to run just before the submit writes its
    dependency rows: after the submit checked its dependencies, before it wrote them."""
    pruner = Store(pg_store.url, clock=clock)
    fired: list[bool] = []

    def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "INSERT INTO task_dependencies" in statement and not fired:
            fired.append(True)
            prune_finished(pruner, keep_seconds=KEEP)

    def arm() -> None:
        event.listen(pg_store.engine, "before_cursor_execute", before)

    yield arm
    if event.contains(pg_store.engine, "before_cursor_execute", before):
        event.remove(pg_store.engine, "before_cursor_execute", before)
    pruner.close()


def test_a_submit_racing_retention_never_queues_the_dependent_of_a_failed_task(
        pg_store: Store, clock: ManualClock,
        prune_while_writing_dependencies: Callable[[], None]) -> None:
    """a failed long ago; x (recent) depends on it, so retention keeps a's task but
    deletes a's run. d, submitted as the prune runs, depends on a: it must end
    CANCELLED / DEPENDENCY_FAILED (or be refused), never QUEUED to run."""
    [a] = submit(pg_store)
    [lease] = pg_store.claim("w1", run_id=a.run_id, lease_ttl=TTL)
    pg_store.fail(lease, Reason.TASK_CONTRACT_INVALID)
    clock.advance(KEEP + 60)
    [x] = pg_store.submit([spec(depends_on=[a.task_id])])
    assert x.status == S.CANCELLED.value  # a failed: x is cancelled at once
    prune_while_writing_dependencies()
    [d] = pg_store.submit([spec(depends_on=[a.task_id])])
    row = run_row(pg_store, d.run_id)
    # fails: ('QUEUED', None): a run whose dependency failed is queued to run
    assert (row.status, row.reason_code) == (S.CANCELLED.value, Reason.DEPENDENCY_FAILED)


def test_a_submit_racing_retention_gets_an_answer_not_a_foreign_key_error(
        pg_store: Store, clock: ManualClock,
        prune_while_writing_dependencies: Callable[[], None]) -> None:
    """a succeeded long ago and nothing depends on it: retention deletes its run and
    task while d, which depends on a, is being submitted. d must be accepted or refused
    with TaskInvalid; not fail with the database's IntegrityError."""
    [a] = submit(pg_store)
    succeed(pg_store, a.run_id)
    clock.advance(KEEP + 60)
    prune_while_writing_dependencies()
    # fails: sqlalchemy.exc.IntegrityError: ... violates foreign key constraint
    # "task_dependencies_depends_on_fkey" (refused cleanly with TaskInvalid is fine)
    with contextlib.suppress(TaskInvalid):
        pg_store.submit([spec(depends_on=[a.task_id])])


# --- tenants --------------------------------------------------------------------------


def test_a_tenant_cannot_depend_on_or_follow_up_another_tenants_task(store: Store) -> None:
    """Tenant isolation: globex naming acme's task (depends_on, parent) must be refused
    like an unknown task. Today it is accepted, and acme's cancel then cancels globex's
    run (DEPENDENCY_FAILED): one tenant controls another's work and learns whether its
    task ids exist and how they ended."""
    [theirs] = submit(store, tenant="acme")
    with pytest.raises(TaskInvalid, match="depends_on"):  # fails: DID NOT RAISE
        store.submit([spec(tenant="globex", depends_on=[theirs.task_id])])
    with pytest.raises(TaskInvalid, match="parent_task_id"):
        store.submit([spec(tenant="globex", parent_task_id=theirs.task_id)])
