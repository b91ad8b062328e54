"""Reads behind ``runlane runs show`` and ``tasks show``: a run with everything about
it, a task with its runs and lineage, and the tenant of a row (for the principal's
check before a write). Each read is one short read transaction; rows come back as
dicts of stored values (epoch seconds), the facade builds the models."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from runlane.errors import NotFound
from runlane.store import history

if TYPE_CHECKING:
    from runlane.store.store import Store

TASK_TENANT = "SELECT tenant FROM tasks WHERE task_id = :task_id"
RUN_TENANT = "SELECT tenant FROM runs WHERE run_id = :run_id"
RUN = "SELECT * FROM runs WHERE run_id = :run_id"
TASK = "SELECT * FROM tasks WHERE task_id = :task_id"
DEPENDS_ON = ("SELECT depends_on FROM task_dependencies WHERE task_id = :task_id "
              "ORDER BY depends_on")
ATTEMPTS = "SELECT * FROM attempts WHERE run_id = :run_id ORDER BY attempt_no"
# The run's transitions: its events, its creation and its attempts' claims and ends
# (store/history.py), in the order they were written.
EVENTS = history.RUN_HISTORY
SIDE_EFFECTS = """
SELECT effect_key, status, attempt_no, fencing_token, result, created_at, completed_at
FROM side_effects WHERE run_id = :run_id ORDER BY created_at, effect_key
"""
# The run that retries this one (uq_runs_retry_of: at most one).
RETRIED_BY = "SELECT run_id FROM runs WHERE retry_of_run_id = :run_id"
APPROVAL_OF = ("SELECT decision, actor, note, policy_version, decided_at "
               "FROM run_approvals WHERE run_id = :run_id")
RUNS_OF_TASK = """
SELECT run_id, status, attempt_count, max_attempts, reason_code, outcome, cost_usd,
       created_at, ended_at, retry_of_run_id
FROM runs WHERE task_id = :task_id ORDER BY created_at, run_id
"""
# A task in short, with its newest run (the one no run retries).
TASK_REFS = """
SELECT t.task_id, t.created_at, t.prompt, r.run_id AS latest_run_id,
       r.status AS latest_status
FROM tasks t
LEFT JOIN runs r ON r.task_id = t.task_id
  AND NOT EXISTS (SELECT 1 FROM runs n WHERE n.retry_of_run_id = r.run_id)
WHERE {where}
ORDER BY t.created_at, t.task_id
"""
PARENT = TASK_REFS.format(where="t.task_id = :task_id")
# ix_tasks_parent serves it.
CHILDREN = TASK_REFS.format(where="t.parent_task_id = :task_id")


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# What an id names, for the CLI's commands that take a task's or a run's id (and the
# message of a wrong kind): one primary-key look-up each.
IDENTIFY = """
SELECT 'task' AS kind, task_id, NULL AS run_id, tenant FROM tasks WHERE task_id = :id
UNION ALL
SELECT 'run', task_id, run_id, tenant FROM runs WHERE run_id = :id
UNION ALL
SELECT 'token', NULL, NULL, tenant FROM api_tokens WHERE token_id = :id
UNION ALL
SELECT 'worker', NULL, NULL, NULL FROM workers WHERE worker_id = :id
"""
# A task's newest run: the one its retries lead to (no run retries it).
NEWEST_RUN = """
SELECT run_id FROM runs WHERE task_id = :task_id ORDER BY created_at DESC, run_id DESC
LIMIT 1
"""


def identify(store: Store, some_id: str) -> dict[str, Any] | None:
    """What ``some_id`` names (kind, its task, its run, its tenant), or None."""
    with store.reads.connect() as conn:
        row = conn.execute(store._q(IDENTIFY), {"id": some_id}).first()
        if row is None:
            return None
        found = dict(row._mapping)
        if found["kind"] == "task":
            found["run_id"] = conn.execute(store._q(NEWEST_RUN),
                                           {"task_id": some_id}).scalar()
        return found


def task_tenant(store: Store, task_id: str) -> str | None:
    with store.reads.connect() as conn:
        return conn.execute(store._q(TASK_TENANT), {"task_id": task_id}).scalar()


def run_tenant(store: Store, run_id: str) -> str | None:
    with store.reads.connect() as conn:
        return conn.execute(store._q(RUN_TENANT), {"run_id": run_id}).scalar()


def _rows(conn: Connection, store: Store, statement: str, **params: Any
          ) -> list[dict[str, Any]]:
    return [dict(r._mapping) for r in conn.execute(store._q(statement), params)]


def run_detail(store: Store, run_id: str, tenant: str | None) -> dict[str, Any]:
    """The run, its task, attempts, events, ledger and retry links. ``tenant``: the
    only one the caller may see (None: any); another's run is absent, with the
    message of a run that does not exist."""
    with store.reads.connect() as conn:
        row = conn.execute(store._q(RUN), {"run_id": run_id}).first()
        if row is None or (tenant is not None and row.tenant != tenant):
            raise NotFound(f"no run {run_id!r}")
        run = dict(row._mapping)
        task = conn.execute(store._q(TASK), {"task_id": run["task_id"]}).first()
        run["task"] = dict(task._mapping) if task is not None else {}
        run["depends_on"] = [r["depends_on"] for r in _rows(conn, store, DEPENDS_ON,
                                                            task_id=run["task_id"])]
        run["attempts"] = _rows(conn, store, ATTEMPTS, run_id=run_id)
        run["events"] = _rows(conn, store, EVENTS, run_id=run_id)
        run["side_effects"] = _rows(conn, store, SIDE_EFFECTS, run_id=run_id)
        for effect in run["side_effects"]:
            effect["result"] = _json(effect["result"])
        run["retried_by_run_id"] = conn.execute(store._q(RETRIED_BY),
                                                {"run_id": run_id}).scalar()
        approval = conn.execute(store._q(APPROVAL_OF), {"run_id": run_id}).first()
        run["approval"] = dict(approval._mapping) if approval is not None else None
        return run


def task_detail(store: Store, task_id: str, tenant: str | None) -> dict[str, Any]:
    """The task, its runs, its parent and its children (a child is of the task's own
    tenant: a submit refuses a parent of another)."""
    with store.reads.connect() as conn:
        row = conn.execute(store._q(TASK), {"task_id": task_id}).first()
        if row is None or (tenant is not None and row.tenant != tenant):
            raise NotFound(f"no task {task_id!r}")
        task = dict(row._mapping)
        task["depends_on"] = [r["depends_on"] for r in _rows(conn, store, DEPENDS_ON,
                                                             task_id=task_id)]
        task["runs"] = _rows(conn, store, RUNS_OF_TASK, task_id=task_id)
        parent = _rows(conn, store, PARENT, task_id=task["parent_task_id"]) \
            if task["parent_task_id"] else []
        task["parent"] = parent[0] if parent else None
        task["children"] = _rows(conn, store, CHILDREN, task_id=task_id)
        return task
