"""Retention: delete finished runs older than a cutoff, in small batches.

One call of ``prune_finished`` is one short transaction over at most ``limit`` runs:
pick finished runs whose last change is older than the cutoff (the database clock,
or the store's pinned clock), delete their side effects, events and attempts, the
runs, then the tasks left without runs. Nothing unfinished is touched, nor a run
that still holds an ACTIVE lease (the reconciler revokes those first). On PostgreSQL
the pick uses ``SKIP LOCKED``, so prunes on several machines split the work and never
wait on a row a worker holds; on SQLite the transaction is ``BEGIN IMMEDIATE``.

A run is not picked while another task still names its task: depends on it
(``task_dependencies``, when that table exists) or follows it up (``parent_task_id``).
The run and its task stay together until the last such task is pruned, and go in a
later batch: a dependent's run reads how its dependency ended from the dependency's
run, and a follow-up shows its parent. (Earlier, the run went and the task stayed: a
dependent of a failed task was then queued as if the dependency had succeeded, the
task's idempotency key crashed a submit, and a chain of three left its first task
behind.) A task is deleted with its last run. An idempotency key is remembered for as
long as its task is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sqlalchemy import Connection, TextClause, bindparam, inspect, text

from runlane.domain.states import TERMINAL
from runlane.store.dialect_sql import LOCK_SKIP, NOW
from runlane.store.store import Store

FINISHED = sorted(s.value for s in TERMINAL)

# Finished runs of one status older than the cutoff, oldest first from where the walk
# got to (keyset: updated_at, then run_id): ``ix_runs_status_updated`` (status,
# updated_at) serves it as a range read. A terminal run's status never changes again,
# and its updated_at is at or after its ended_at, so "last change before the cutoff"
# keeps every run that ended or changed recently.
# One status per statement: ORDER BY updated_at over the four finished statuses made
# PostgreSQL read and sort all of ``runs`` for every batch (1 s per batch of 500 at 2M
# runs); no ORDER BY at all (a sequential scan stopping at its 500th match) reread the
# entries of every run deleted earlier in the pass, dead until vacuum, so each batch
# read more than the last (bench/retention.py). The keyset starts each batch past the
# last run picked.
# Nor the run of a task another task names (see above; ``ix_task_dependencies_depends_on``
# and ``ix_tasks_parent`` serve the checks). A submit that names a task share-locks its
# run until it commits (policy_sql.NAMED_TASKS): SKIP LOCKED passes over it. The run's task is
# locked here too, SKIP LOCKED: a prune never waits for a task row after it holds the
# run (a cancel locks the task, then its runs: the two deadlocked).
PICK_FINISHED = """
SELECT r.run_id, r.task_id, r.updated_at FROM runs r JOIN tasks t ON t.task_id = r.task_id
WHERE r.status = :status
  AND r.updated_at < {now} - :keep_seconds
  AND r.updated_at >= :after_at
  AND (r.updated_at > :after_at OR r.run_id > :after_id)
  AND NOT EXISTS (SELECT 1 FROM attempts a
                  WHERE a.run_id = r.run_id AND a.lease_status = 'ACTIVE')
  AND NOT EXISTS (SELECT 1 FROM tasks c WHERE c.parent_task_id = r.task_id)
  {not_depended_on}
ORDER BY r.updated_at, r.run_id
LIMIT :limit
{lock_rt_skip}
"""
RUN_NOT_DEPENDED_ON = """
  AND NOT EXISTS (SELECT 1 FROM task_dependencies d WHERE d.depends_on = r.task_id)
"""
DELETE_SIDE_EFFECTS = "DELETE FROM side_effects WHERE run_id IN :run_ids"
DELETE_RUN_EVENTS = "DELETE FROM run_events WHERE run_id IN :run_ids"
DELETE_APPROVALS = "DELETE FROM run_approvals WHERE run_id IN :run_ids"
DELETE_ATTEMPTS = "DELETE FROM attempts WHERE run_id IN :run_ids"
DELETE_RUNS = "DELETE FROM runs WHERE run_id IN :run_ids AND status IN :finished"
# Of these tasks, those with no run left that no task names (as parent, or, with
# dependencies, as a dependency).
ORPHAN_TASKS = """
SELECT t.task_id FROM tasks t
WHERE t.task_id IN :task_ids
  AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.task_id = t.task_id)
  AND NOT EXISTS (SELECT 1 FROM tasks c WHERE c.parent_task_id = t.task_id)
"""
NOT_DEPENDED_ON = """
  AND NOT EXISTS (SELECT 1 FROM task_dependencies d WHERE d.depends_on = t.task_id)
"""
DEPENDED_ON_BY = "SELECT DISTINCT depends_on FROM task_dependencies WHERE task_id IN :task_ids"
PARENTS_OF = """
SELECT DISTINCT parent_task_id FROM tasks
WHERE task_id IN :task_ids AND parent_task_id IS NOT NULL
"""
DELETE_DEPENDENCIES = "DELETE FROM task_dependencies WHERE task_id IN :task_ids"
DELETE_TASKS = "DELETE FROM tasks WHERE task_id IN :task_ids"


@dataclass
class PruneCursor:
    """How far one pass has walked each finished status: (updated_at, run_id) of the
    last run picked. Runs passed over (a locked one, a task still named) lie behind it:
    the next pass, with a new cursor, starts from the oldest again and tries them."""

    after: dict[str, tuple[float, str]] = field(default_factory=dict)
    exhausted: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class PruneResult:
    runs: int = 0
    tasks: int = 0
    attempts: int = 0
    run_events: int = 0
    side_effects: int = 0

    def __add__(self, other: PruneResult) -> PruneResult:
        return PruneResult(*(getattr(self, f.name) + getattr(other, f.name)
                             for f in fields(self)))


class RetentionStatements:
    """The statements above, rendered once for one store's dialect."""

    def __init__(self, store: Store) -> None:
        dialect = store.dialect
        found = inspect(store.engine)
        self.has_dependencies = found.has_table("task_dependencies")
        self.has_approvals = found.has_table("run_approvals")  # 0025

        def render(statement: str, *expanding: str) -> TextClause:
            clause = text(statement.format(
                now=NOW[dialect], lock_rt_skip=LOCK_SKIP[dialect].format(alias="r, t"),
                not_depended_on=RUN_NOT_DEPENDED_ON if self.has_dependencies else ""))
            return clause.bindparams(*(bindparam(n, expanding=True) for n in expanding))

        self.pick = render(PICK_FINISHED)
        self.side_effects = render(DELETE_SIDE_EFFECTS, "run_ids")
        self.run_events = render(DELETE_RUN_EVENTS, "run_ids")
        self.approvals = render(DELETE_APPROVALS, "run_ids") if self.has_approvals else None
        self.attempts = render(DELETE_ATTEMPTS, "run_ids")
        self.runs = render(DELETE_RUNS, "run_ids", "finished")
        orphans = ORPHAN_TASKS + (NOT_DEPENDED_ON if self.has_dependencies else "")
        self.orphan_tasks = render(orphans, "task_ids")
        self.depended_on = render(DEPENDED_ON_BY, "task_ids")
        self.parents = render(PARENTS_OF, "task_ids")
        self.dependencies = render(DELETE_DEPENDENCIES, "task_ids")
        self.tasks = render(DELETE_TASKS, "task_ids")


def prune_finished(store: Store, *, keep_seconds: float, limit: int = 500,
                   statements: RetentionStatements | None = None,
                   cursor: PruneCursor | None = None) -> PruneResult:
    """Delete up to ``limit`` finished runs whose last change is older than
    ``keep_seconds``, with everything that belongs only to them, in one transaction.
    With a ``cursor`` (one per pass) each batch starts where the last one stopped."""
    if keep_seconds < 0 or limit < 1:
        raise ValueError("keep_seconds must be >= 0 and limit >= 1")
    st = statements or RetentionStatements(store)
    walk = cursor if cursor is not None else PruneCursor()

    def work(conn: Connection) -> tuple[PruneResult, PruneCursor]:
        # The walk moves on only once the batch has committed (a retried transaction
        # starts from the same place).
        moved = PruneCursor(dict(walk.after), set(walk.exhausted))
        picked: list[Any] = []
        now = store.clock.now()
        for status in FINISHED:
            if len(picked) >= limit or status in moved.exhausted:
                continue
            after_at, after_id = moved.after.get(status, (float("-inf"), ""))
            wanted = limit - len(picked)
            rows = conn.execute(st.pick, {"status": status, "now": now,
                                          "keep_seconds": keep_seconds, "limit": wanted,
                                          "after_at": after_at, "after_id": after_id}).all()
            picked += rows
            if rows:
                moved.after[status] = (float(rows[-1].updated_at), rows[-1].run_id)
            if len(rows) < wanted:
                moved.exhausted.add(status)
        if not picked:
            return PruneResult(), moved
        run_ids = [r.run_id for r in picked]
        by_run: dict[str, Any] = {"run_ids": run_ids}
        side_effects = conn.execute(st.side_effects, by_run).rowcount
        run_events = conn.execute(st.run_events, by_run).rowcount
        if st.approvals is not None:
            conn.execute(st.approvals, by_run)
        attempts = conn.execute(st.attempts, by_run).rowcount
        deleted_runs = conn.execute(st.runs, {**by_run, "finished": FINISHED}).rowcount
        tasks = _prune_tasks(conn, st, sorted({r.task_id for r in picked}))
        return PruneResult(deleted_runs, tasks, attempts, run_events, side_effects), moved

    result, moved = store._transaction(work)
    walk.after, walk.exhausted = moved.after, moved.exhausted
    return result


def _prune_tasks(conn: Connection, st: RetentionStatements, candidates: list[str]) -> int:
    """Delete the candidate tasks that have no run left; then, up the chain, the tasks
    those depended on that have no run left either and that nothing else needs (only
    an earlier retention left such tasks: the runs of the others wait for a later
    batch)."""
    deleted = 0
    while candidates:
        orphans = [r.task_id for r in conn.execute(st.orphan_tasks, {"task_ids": candidates})]
        if not orphans:
            break
        upstream = [r.parent_task_id for r in conn.execute(st.parents, {"task_ids": orphans})]
        if st.has_dependencies:
            upstream += [r.depends_on for r in conn.execute(st.depended_on,
                                                            {"task_ids": orphans})]
            conn.execute(st.dependencies, {"task_ids": orphans})
        deleted += conn.execute(st.tasks, {"task_ids": orphans}).rowcount
        candidates = sorted(set(upstream) - set(orphans))
    return deleted
