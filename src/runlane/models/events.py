"""Run transitions as the event stream delivers them (``GET /v1/events``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runlane.errors import redact_credentials
from runlane.models.runs import Timestamp


class EventView(BaseModel):
    """One transition of one run. ``cursor`` only grows in delivery order (commit
    order): it is the stream's SSE id, and ``events(after=cursor)`` resumes after it."""

    model_config = ConfigDict(frozen=True)

    cursor: str = Field(description="Opaque position in the stream; resume after it.")
    event_id: int = Field(description="The event's row id (unique; not delivery order "
                          "on PostgreSQL, use cursor to resume).")
    run_id: str
    task_id: str
    tenant: str
    attempt_no: int | None = None
    at: Timestamp
    actor: str
    from_status: str | None = None
    to_status: str
    reason_code: str | None = None
    fencing_token: int | None = None
    message: str | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any], cursor: str) -> EventView:
        message = row.get("message")
        return cls(
            cursor=cursor, event_id=row["event_id"], run_id=row["run_id"],
            task_id=row["task_id"], tenant=row["tenant"], attempt_no=row.get("attempt_no"),
            at=datetime.fromtimestamp(row["at"], UTC), actor=row["actor"],
            from_status=row.get("from_status"), to_status=row["to_status"],
            reason_code=row.get("reason_code"), fencing_token=row.get("fencing_token"),
            message=redact_credentials(message) if message else message)


class EventPage(BaseModel):
    """A page of the stream: ``next`` is the cursor to pass as ``after`` for the next
    one (past what this read could see, so it may be past the last item)."""

    items: list[EventView]
    next: str
