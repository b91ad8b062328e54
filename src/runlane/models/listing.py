"""Runs as a listing returns them (``Runlane.runs_page``): what ``runlane runs list
--json`` prints, one element per run, and the HTTP API's ``GET /v1/runs`` serialises.
Points in time are UTC datetimes, written in JSON as ISO 8601 with milliseconds, as the
CLI always printed them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from runlane.errors import redact_credentials


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="milliseconds")


# A point in time: a datetime in Python, ISO 8601 UTC with milliseconds in JSON.
Timestamp = Annotated[datetime, PlainSerializer(_iso, return_type=str, when_used="json")]


def timestamp(epoch: float | None) -> datetime | None:
    """A stored time (epoch seconds) as a UTC datetime."""
    return None if epoch is None else datetime.fromtimestamp(float(epoch), UTC)


class RunSummary(BaseModel):
    """One run of a listing: the run object of the public contract (its attempts,
    events and task are in ``Runlane.run``)."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    task_id: str
    tenant: str
    repo: str = Field(description="The repository's canonical identity (no credentials).")
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
    reason_code: str | None = Field(description="Of the last failure, or null.")
    message: str | None
    outcome: str | None
    cost_usd: float
    estimated_cost_usd: float | None
    user_id: str | None
    risk_class: str
    route_key: str
    policy_version: int

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RunSummary:
        values = dict(row)
        for name in ("visible_at", "created_at", "updated_at", "ended_at"):
            values[name] = timestamp(values.get(name))
        if values.get("message"):
            values["message"] = redact_credentials(values["message"])
        return cls(**{name: values.get(name) for name in cls.model_fields})


class RunPage(BaseModel):
    """One page of a listing, and the cursor of the next (None: this is the last)."""

    model_config = ConfigDict(frozen=True)

    items: list[RunSummary]
    next: str | None = Field(description="Opaque: pass it as `cursor` for the next page; "
                             "null on the last page.")
