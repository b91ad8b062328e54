"""Tasks: submit one or a batch (idempotent by key), read one, cancel, retry."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from runlane.http.auth import Lane, Who
from runlane.http.routes import returns
from runlane.observability.tracing import Incoming

router = APIRouter(tags=["tasks"])

TaskId = Annotated[str, Path(max_length=64)]
MAX_BATCH = 10_000


class TaskRequest(BaseModel):
    """A task as `runlane submit` takes it. ``tenant`` defaults to the token's. The
    facade validates the values (the same messages as the CLI's)."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = None
    repo: str
    prompt: str
    queue: str | None = None
    priority: int | str | None = Field(None, description="An integer (lower runs first) or "
                                       "critical, high, normal, low, batch.")
    idempotency_key: str | None = None
    max_attempts: int | None = None
    context: dict[str, str] | None = None
    requires: dict[str, Any] | None = None
    depends_on: list[str] | None = None
    parent_task_id: str | None = None
    user: str | None = None
    estimated_cost_usd: float | None = None

    def fields(self, tenant: str | None) -> dict[str, Any]:
        return {**self.model_dump(exclude_none=True), "tenant": self.tenant or tenant}


@router.post("/tasks", status_code=201, response_model=returns("submit"),
             responses={200: {"description": "The same tenant and idempotency key was "
                              "submitted before: its task and run, nothing created."},
                        409: {"description": "The idempotency key was used with another "
                              "body; nothing was written."}})
def submit(body: TaskRequest, lane: Lane, who: Who, response: Response,
           request: Request) -> Any:
    fields = body.fields(who.tenant)
    # A caller's W3C traceparent header: the task's trace is a part of the caller's.
    with Incoming(request.headers.get("traceparent")):
        result = lane.submit(fields.pop("tenant"), fields.pop("repo"), fields.pop("prompt"),
                             principal=who, **fields)
    if not getattr(result, "created", True):
        response.status_code = 200
    return result


@router.post("/tasks/batch", status_code=201, response_model=returns("submit_batch"))
def submit_batch(lane: Lane, who: Who, request: Request,
                 body: Annotated[list[TaskRequest], Body(max_length=MAX_BATCH)]) -> Any:
    """All or nothing: every task is validated before anything is written."""
    with Incoming(request.headers.get("traceparent")):
        return lane.submit_batch([t.fields(who.tenant) for t in body], principal=who)


@router.get("/tasks/{task_id}", response_model=returns("task"))
def task(task_id: TaskId, lane: Lane, who: Who) -> Any:
    """The task with its runs, parent and children."""
    return lane.task(task_id, principal=who)


@router.post("/tasks/{task_id}/cancel", response_model=returns("cancel"))
def cancel(task_id: TaskId, lane: Lane, who: Who) -> Any:
    return lane.cancel(task_id, principal=who)


@router.post("/tasks/{task_id}/retry", status_code=201, response_model=returns("retry"))
def retry(task_id: TaskId, lane: Lane, who: Who) -> Any:
    """A new run of a finished task, linked to it."""
    return lane.retry(task_id, principal=who)
