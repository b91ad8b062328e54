"""``runlane retry TASK_ID``: a new run of a finished task, linked to the run it follows.

A task executes through one run at a time: a retry is refused while the task's newest
run is on its way (``RetryRefused``, a ``Conflict``), and two retries racing on the
same run cannot both write: the task row is locked first (PostgreSQL ``FOR UPDATE``;
SQLite's transaction holds the write lock from BEGIN IMMEDIATE), and
``uq_runs_retry_of`` admits one run per ``retry_of_run_id`` whatever happens. The new
run is admitted under the policy in force, as a submit is (queued, denied or deferred
with its reason), enters its lane as a submit's run does, and its first status is
checked against the transition table. It waits for the task's dependencies again, as
the first run did. A cancelled task's cancel mark is cleared: the retry is the newer
request.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from runlane.domain.admission import AdmissionRequest, TenantUsage, admit
from runlane.domain.reasons import Reason
from runlane.domain.routing import requirements_from_canonical
from runlane.domain.states import TERMINAL, RunStatus
from runlane.domain.tasks import PayloadReport, TaskSpec
from runlane.errors import NotFound, RetryRefused
from runlane.models.runs import Submission
from runlane.store import lanes_sql, submit_sql
from runlane.store.core import WAKEUP_CHANNEL
from runlane.store.lanes import JOIN_AHEAD
from runlane.store.policy import policy_needs_usage
from runlane.store.schema import runs
from runlane.store.submit import _RUN_COLUMNS, _SubmitBatch

if TYPE_CHECKING:
    from runlane.store.store import Store

log = structlog.get_logger("runlane.store")
S = RunStatus

# The task, locked against a concurrent retry or cancel (which locks it first too).
TASK_FOR_RETRY = "SELECT * FROM tasks WHERE task_id = :task_id {lock_for_update}"
# The task's newest run: the one no run retries (uq_runs_retry_of serves the check).
LATEST_RUN = """
SELECT r.run_id, r.status, r.repo, r.tenant, r.provider FROM runs r
WHERE r.task_id = :task_id
  AND NOT EXISTS (SELECT 1 FROM runs n WHERE n.retry_of_run_id = r.run_id)
ORDER BY r.created_at DESC, r.run_id DESC
LIMIT 1
"""
# The lane upsert of a submit (lanes_sql.LANE_UPSERT, SQLite's path) with typed parameters:
# PostgreSQL cannot deduce one type for a parameter used as a column value and in a
# comparison. The same text on SQLite (its CASTs are no-ops there).
_TYPES = {"queue": "text", "route_key": "text", "tenant": "text", "tenant_scope": "text",
          "priority": "integer", "queued": "integer", "weight": "double precision",
          "vtime": "double precision"}


def _typed(statement: str) -> str:
    return re.sub(r":(" + "|".join(sorted(_TYPES, key=len, reverse=True)) + r")\b",
                  lambda m: f"CAST(:{m.group(1)} AS {_TYPES[m.group(1)]})", statement)


LANE_UPSERT = _typed(lanes_sql.LANE_UPSERT)
LANE_VIRTUAL_TIME = _typed(lanes_sql.LANE_VIRTUAL_TIME)
CLEAR_CANCEL = "UPDATE tasks SET cancel_requested_at = NULL WHERE task_id = :task_id"
DEPENDENCIES = "SELECT depends_on FROM task_dependencies WHERE task_id = :task_id"


def retry_task(store: Store, task_id: str, *, tenant: str | None,
               default_max_attempts: int, actor: str = "user") -> Submission:
    """A new run of ``task_id`` (of ``tenant`` only, unless None), whose newest run
    has ended. Raises NotFound (no such task, or another tenant's) or Conflict."""

    def work(conn: Connection) -> Submission:
        task = conn.execute(store._q(TASK_FOR_RETRY), {"task_id": task_id}).first()
        if task is None or (tenant is not None and task.tenant != tenant):
            raise NotFound(f"no task {task_id!r}")
        latest = conn.execute(store._q(LATEST_RUN), {"task_id": task_id}).first()
        if latest is None:
            raise RetryRefused(f"task {task_id} has no run left to retry (retention "
                               "deleted it); submit it again", "NO_RUN_TO_RETRY")
        if S(latest.status) not in TERMINAL:
            raise RetryRefused(f"task {task_id} is not finished: its run {latest.run_id} "
                               f"is {latest.status}; retry it once that run has ended (or "
                               "cancel it first)", "TASK_NOT_FINISHED")
        return _write_retry(store, conn, task, latest, default_max_attempts, actor)

    try:
        result = store._transaction(work)
    except IntegrityError as exc:  # uq_runs_retry_of: another retry won the race
        if "uq_runs_retry_of" not in str(exc.orig) and "retry_of_run_id" not in str(exc.orig):
            raise
        raise RetryRefused(f"task {task_id} was retried by another request at the same "
                           "time", "RETRY_RACE") from None
    log.info("retried", task_id=task_id, run_id=result.run_id,
             retry_of_run_id=result.retry_of_run_id, status=result.status)
    return result


def _write_retry(store: Store, conn: Connection, task: Any, latest: Any,
                 default_max_attempts: int, actor: str) -> Submission:
    context = conn.execute(store._q(submit_sql.SUBMIT_CONTEXT), {"now": store.clock.now()}).one()
    now, version = float(context.now), int(context.version or 0)
    policy = store._policy_version(conn, version)
    usage = store._tenant_usage(conn, {task.tenant}, now) \
        if policy_needs_usage(policy) else {}
    # The task's terms as its first admission resolved them; its repository as its
    # runs name it (canonical: no file system read inside the transaction).
    decision = admit(
        AdmissionRequest(tenant=task.tenant, repo=latest.repo, queue=task.queue,
                         priority=task.priority, user=task.user_id,
                         max_attempts=task.max_attempts,
                         requires=requirements_from_canonical(task.requires or ""),
                         estimated_cost_usd=task.estimated_cost_usd,
                         provider=latest.provider),
        policy, version, usage.get(task.tenant, TenantUsage()), now,
        default_max_attempts=default_max_attempts)
    batch = _SubmitBatch(now=now, actor=actor, policy_version=version)
    number = batch.add_decision(decision)
    depends_on = sorted(r.depends_on for r in conn.execute(
        store._q(DEPENDENCIES), {"task_id": task.task_id}))
    spec = TaskSpec.model_construct(
        tenant=task.tenant, repo=task.repo, prompt=task.prompt, idempotency_key=None,
        context={}, user=task.user_id, parent_task_id=None,
        estimated_cost_usd=task.estimated_cost_usd, depends_on=depends_on)
    batch.add(spec, PayloadReport(int(task.payload_bytes or 0), ()), number, latest.repo)
    batch.items[-1]["task_id"] = task.task_id  # a new run of this task, not a new task
    [run] = batch.run_rows({task.task_id})
    status = batch.run_statuses[-1]
    conn.execute(store._q(submit_sql.ROUTE_INSERT), {"route_key": run["route_key"], "now": now})
    head = conn.execute(store._q(LANE_VIRTUAL_TIME),
                        {"queue": run["queue"], "priority": run["priority"]}).scalar()
    lane_id = int(conn.execute(store._q(LANE_UPSERT), {
        "queue": run["queue"], "route_key": run["route_key"], "priority": run["priority"],
        "tenant": run["tenant"], "weight": run["weight"], "queued": int(status is S.QUEUED),
        "vtime": 0.0 if head is None else float(head) - JOIN_AHEAD,
        "tenant_scope": f"tenant:{run['tenant']}"}).one().lane_id)
    store._bulk_insert(conn, runs, [
        {column: run[column] for column in _RUN_COLUMNS}
        | {"attempt_count": 0, "fencing_token": 0, "cost_usd": 0.0, "created_at": now,
           "updated_at": now, "lane_id": lane_id, "retry_of_run_id": latest.run_id}])
    store._record(conn, [{
        "run_id": run["run_id"], "attempt_no": None, "at": now, "actor": actor,
        "from_status": None, "to_status": run["status"], "reason_code": run["reason_code"],
        "fencing_token": None,
        "message": f"retry of run {latest.run_id}: {run['event_message']}"}])
    conn.execute(store._q(CLEAR_CANCEL), {"task_id": task.task_id})
    if status is S.ADMITTED:  # its dependencies may all have ended already
        with store._lane_moves_in_order(conn):
            outcome = store._dependency_outcome(conn, task.task_id)
            if outcome is not S.ADMITTED:
                store._set_status(
                    conn, run_id=run["run_id"], source=S.ADMITTED, path=[outcome],
                    run_token=0, actor=actor, now=now,
                    reason_code=Reason.DEPENDENCY_FAILED if outcome is S.CANCELLED else None,
                    message=("a dependency ended without success" if outcome is S.CANCELLED
                             else "dependencies succeeded"))
                status = outcome
    if status is S.QUEUED:
        store._notify(conn, WAKEUP_CHANNEL, run["queue"])
    return Submission(task_id=task.task_id, run_id=run["run_id"], status=status.value,
                      created=True, reason_code=decision.reason_code,
                      payload_bytes=int(task.payload_bytes or 0),
                      retry_of_run_id=latest.run_id)
