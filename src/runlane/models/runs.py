"""Runs and tasks as the facade returns them (``Runlane.run``, ``Runlane.task``,
``Runlane.submit``): what ``runlane runs show --json`` and ``tasks show --json`` print
and the HTTP API serialises. Points in time are UTC datetimes, written in JSON as
ISO 8601 with milliseconds (``2026-12-03T02:34:39.123+00:00``), as the CLI always
printed them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainSerializer

from runlane.errors import redact_credentials


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="milliseconds")


# A point in time: a datetime in Python, ISO 8601 UTC with milliseconds in JSON.
Timestamp = Annotated[datetime, PlainSerializer(_iso, return_type=str, when_used="json")]


class Indexable(BaseModel):
    """A model whose fields also read as ``model["field"]``: ``Runlane.run`` returned
    a dict before these models, and scripts index it (deprecated; use attributes)."""

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)


def timestamp(epoch: float | None) -> datetime | None:
    """A stored time (epoch seconds) as a UTC datetime."""
    return None if epoch is None else datetime.fromtimestamp(float(epoch), UTC)


class Submission(BaseModel):
    """What a submit (or a retry) answers: the task and its run, and whether this call
    created them (False: the idempotency key was used before by the same request)."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    run_id: str
    status: str
    created: bool
    reason_code: str | None = None  # why a run was denied or deferred at admission
    truncated_sections: tuple[str, ...] = ()
    payload_bytes: int = 0
    retry_of_run_id: str | None = None  # a retry's: the finished run it follows


class Stage(Indexable):
    """A status an attempt's run entered, and when."""

    status: str
    at: Timestamp
    reason_code: str | None = None


class Attempt(Indexable):
    """One try of a run: its worker and lease (with the fencing token that fenced its
    writes), the stages it went through, how it ended, and what it cost."""

    attempt_no: int
    status: str
    reason_code: str | None
    message: str | None
    worker_id: str
    fencing_token: int
    lease_status: str
    lease_expires_at: Timestamp | None
    started_at: Timestamp | None
    ended_at: Timestamp | None
    retry_after_seconds: float | None
    cost_usd: float
    estimated_cost_usd: float | None
    input_tokens: int
    output_tokens: int
    late_cost_usd: float  # reported after the lease was lost: spent, not in cost_usd
    # Added by issue 23.
    lease_ended_at: Timestamp | None = None
    heartbeat_at: Timestamp | None = None
    stages: list[Stage] = []
    # Added by issue 29: when this attempt's cost crossed its run's max_cost_usd.
    cost_exceeded_at: Timestamp | None = None


class Event(Indexable):
    """One status change of a run (one per hop), in commit order."""

    event_id: int
    attempt_no: int | None
    at: Timestamp
    actor: str
    from_status: str | None
    to_status: str
    reason_code: str | None
    fencing_token: int | None
    message: str | None


class SideEffectView(Indexable):
    """One external effect in the run's ledger (push, pull request, close), by its
    deterministic key; INTENT before the call, DONE with its result after."""

    effect_key: str
    status: str
    attempt_no: int
    fencing_token: int
    result: dict[str, Any] | None
    created_at: Timestamp | None
    completed_at: Timestamp | None


class PullRequest(Indexable):
    """The pull request a run opened (or adopted after a crash)."""

    number: int | None
    url: str | None
    branch: str | None
    adopted: bool = False


class ApprovalDecisionView(Indexable):
    """A run's approval decision: who (``token:<id>``, ``cli:<login>``, the scheduler
    for an expiry), when, with what note, under which policy version."""

    decision: str
    actor: str
    note: str | None
    policy_version: int
    decided_at: Timestamp


class RunDetail(Indexable):
    """One run with its task's request, attempts, events, ledger, cost and links."""

    run_id: str
    task_id: str
    tenant: str
    repo: str
    queue: str
    status: str
    priority: int
    attempt_count: int
    max_attempts: int
    fencing_token: int
    visible_at: Timestamp | None
    created_at: Timestamp
    updated_at: Timestamp
    ended_at: Timestamp | None
    reason_code: str | None
    message: str | None
    outcome: str | None
    cost_usd: float
    estimated_cost_usd: float | None
    user_id: str | None
    risk_class: str | None
    route_key: str | None
    policy_version: int | None
    prompt: str
    idempotency_key: str | None
    truncated_sections: list[str]
    parent_task_id: str | None
    depends_on: list[str]
    admission: dict[str, Any] | None
    limits: dict[str, Any] | None
    attempts: list[Attempt]
    late_cost_usd: float
    events: list[Event]
    # Added by issue 23.
    retry_of_run_id: str | None = None  # the finished run this one retries
    retried_by_run_id: str | None = None  # the run that retries this one
    input_tokens: int = 0
    output_tokens: int = 0
    side_effects: list[SideEffectView] = []
    pull_request: PullRequest | None = None
    # Added by issue 29: when the run's cost crossed its max_cost_usd; its approval
    # decision (a run an approval gate held: APPROVED, REJECTED or EXPIRED).
    cost_exceeded_at: Timestamp | None = None
    approval: ApprovalDecisionView | None = None
    # The model provider the run uses (submit --provider or its queue's in the policy).
    provider: str | None = None


class RunRef(Indexable):
    """A run of a task, in short."""

    run_id: str
    status: str
    attempt_count: int
    max_attempts: int
    reason_code: str | None
    outcome: str | None
    cost_usd: float
    created_at: Timestamp
    ended_at: Timestamp | None
    retry_of_run_id: str | None


class TaskRef(Indexable):
    """Another task, in short (a parent or a child)."""

    task_id: str
    created_at: Timestamp
    prompt: str
    latest_run_id: str | None
    latest_status: str | None


class TaskDetail(Indexable):
    """One task: what was asked, its runs oldest first (a retry adds one), the task it
    follows up (parent) and those that follow it up (children)."""

    task_id: str
    tenant: str
    repo: str  # as written (credentials masked)
    prompt: str
    queue: str
    priority: int
    max_attempts: int
    idempotency_key: str | None
    user_id: str | None
    requires: str
    estimated_cost_usd: float | None
    truncated_sections: list[str]
    payload_bytes: int
    created_at: Timestamp
    cancel_requested_at: Timestamp | None
    depends_on: list[str]
    runs: list[RunRef]
    parent: TaskRef | None
    children: list[TaskRef]


# --- built from the store's rows (store/details.py) ---------------------------------

# Fields of a stored JSON document holding a point in time that are not named *_at.
_TIME_KEYS = frozenset({"at", "retry_after"})


def _decoded(value: Any) -> Any:
    """A JSON column as read by a textual query: SQLite gives its text."""
    return json.loads(value) if isinstance(value, str) else value


def _times_in(document: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored document (an admission record) with its points in time as ISO text,
    as the CLI has always printed them."""
    if document is None:
        return None
    return {k: (_iso(datetime.fromtimestamp(v, UTC))
                if isinstance(v, float) and (k.endswith("_at") or k in _TIME_KEYS) else v)
            for k, v in document.items()}


def _masked(value: Any) -> Any:
    """Every URL credential in a ledger result masked (a push names its remote)."""
    if isinstance(value, str):
        return redact_credentials(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v) for v in value]
    return value


def run_detail(run: dict[str, Any]) -> RunDetail:
    """The model of a run as store/details.py:run_detail reads it."""
    task = run["task"]
    events = [Event.model_validate({**e, "at": timestamp(e["at"])}) for e in run["events"]]
    attempts = []
    for a in run["attempts"]:
        stages = [Stage(status=e.to_status, at=e.at, reason_code=e.reason_code)
                  for e in events if e.attempt_no == a["attempt_no"]]
        attempts.append(Attempt.model_validate(
            {**a, **{k: timestamp(a.get(k)) for k in (
                "lease_expires_at", "started_at", "ended_at", "lease_ended_at",
                "heartbeat_at", "cost_exceeded_at")}, "stages": stages}))
    effects = [SideEffectView.model_validate(
        {**e, "result": _masked(e["result"]), "created_at": timestamp(e["created_at"]),
         "completed_at": timestamp(e["completed_at"])}) for e in run["side_effects"]]
    pull_request = next((PullRequest(
        number=(e.result or {}).get("number"), url=(e.result or {}).get("url"),
        branch=(e.result or {}).get("head_branch"),
        adopted=bool((e.result or {}).get("adopted")))
        for e in effects if e.effect_key == "pull_request" and e.status == "DONE"), None)
    return RunDetail.model_validate({
        **{k: run.get(k) for k in RunDetail.model_fields if k in run},
        **{k: timestamp(run.get(k)) for k in ("visible_at", "created_at", "updated_at",
                                              "ended_at", "cost_exceeded_at")},
        "approval": None if run.get("approval") is None else {
            **run["approval"], "decided_at": timestamp(run["approval"]["decided_at"])},
        "prompt": task.get("prompt", ""),
        "idempotency_key": task.get("idempotency_key"),
        "truncated_sections": _decoded(task.get("truncated_sections")) or [],
        "parent_task_id": task.get("parent_task_id"),
        "depends_on": run["depends_on"],
        "admission": _times_in(_decoded(run.get("admission"))),
        "limits": _decoded(run.get("limits")),
        "attempts": attempts,
        "late_cost_usd": sum((a.late_cost_usd for a in attempts), 0.0),
        "events": events,
        "input_tokens": sum(a.input_tokens for a in attempts),
        "output_tokens": sum(a.output_tokens for a in attempts),
        "side_effects": effects,
        "pull_request": pull_request,
    })


def task_detail(task: dict[str, Any]) -> TaskDetail:
    """The model of a task as store/details.py:task_detail reads it."""
    def ref(row: dict[str, Any] | None) -> TaskRef | None:
        return None if row is None else TaskRef.model_validate(
            {**row, "created_at": timestamp(row["created_at"])})

    return TaskDetail.model_validate({
        **{k: task.get(k) for k in TaskDetail.model_fields if k in task},
        "repo": redact_credentials(task["repo"]),
        "requires": task.get("requires") or "",
        "truncated_sections": _decoded(task.get("truncated_sections")) or [],
        "created_at": timestamp(task["created_at"]),
        "cancel_requested_at": timestamp(task.get("cancel_requested_at")),
        "runs": [RunRef.model_validate({**r, "created_at": timestamp(r["created_at"]),
                                        "ended_at": timestamp(r["ended_at"])})
                 for r in task["runs"]],
        "parent": ref(task["parent"]),
        "children": [ref(c) for c in task["children"]],
    })
