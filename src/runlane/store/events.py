"""Run transitions as a stream: the rows of ``run_events`` in commit order, each with a
cursor that only grows, for the HTTP API's ``GET /v1/events`` (Server-Sent Events).

Why not ``event_id > last``: on PostgreSQL an event id is taken when the row is
inserted, not when its transaction commits. A transaction that took id 10 and commits
after the one that took 11 makes 10 appear behind a reader that already passed 11,
which then never delivers it. So every row carries its writer's top-level transaction
id (``tx_id``, set by a trigger, migration 0021), and the reader delivers rows in
``(tx_id, event_id)`` order, and only rows whose transaction is older than the oldest
transaction still running in the cluster (``pg_snapshot_xmin`` of the statement's own
snapshot). Every such transaction has ended; had it committed, the snapshot sees its
rows; so no row can later appear before a position already delivered. A transaction
that runs long holds delivery back (never loses it) until it ends.

SQLite writes one transaction at a time, so event ids are taken in commit order and
``tx_id`` stays 0: the order is ``event_id``.

A cursor is ``(tx_id, event_id)``, written ``"{event_id}"`` when tx_id is 0 (SQLite,
and rows written before 0021) and ``"{tx_id}-{event_id}"`` otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Engine, text

EVENTS_CHANNEL = "runlane_events"  # NOTIFY'd by a trigger at each commit that adds events
MAX_BIGINT = 2**63 - 1
_CURSOR = re.compile(r"(?:(\d{1,19})-)?(\d{1,19})")

Cursor = tuple[int, int]
START: Cursor = (0, 0)

# -- name: events_after --
# The next rows after a cursor, in delivery order, with their run's task and tenant
# (the principal's scope). Locks nothing. PostgreSQL: ix_run_events_tx from the cursor
# (a row comparison is an index range), stopping at the first LIMIT rows that pass;
# only rows of transactions older than every running one (see the module docstring).
# SQLite: the primary key from the cursor's event id. Both: one runs lookup per row.
EVENTS_AFTER = {
    "postgresql": """
        SELECT e.tx_id, e.event_id, e.run_id, r.task_id, r.tenant, e.attempt_no, e.at,
               e.actor, e.from_status, e.to_status, e.reason_code, e.fencing_token,
               e.message
        FROM run_events e
        JOIN runs r ON r.run_id = e.run_id
        WHERE (e.tx_id, e.event_id) > (:tx, :id)
          AND e.tx_id < pg_snapshot_xmin(pg_current_snapshot())::text::bigint
          AND (CAST(:tenant AS varchar) IS NULL OR r.tenant = :tenant)
        ORDER BY e.tx_id, e.event_id
        LIMIT :limit
    """,
    # Why it differs: no transaction ids, and none needed (one writer at a time).
    "sqlite": """
        SELECT e.tx_id, e.event_id, e.run_id, r.task_id, r.tenant, e.attempt_no, e.at,
               e.actor, e.from_status, e.to_status, e.reason_code, e.fencing_token,
               e.message
        FROM run_events e
        JOIN runs r ON r.run_id = e.run_id
        WHERE e.event_id > :id
          AND (:tenant IS NULL OR r.tenant = :tenant)
        ORDER BY e.event_id
        LIMIT :limit
    """,
}

# -- name: events_tail --
# The cursor of "now": every row delivered later is after it, every row deliverable
# now is not. PostgreSQL: the oldest running transaction (rows of it and of newer
# ones come later), as (xmin, 0). SQLite: the last event id (primary key, one entry).
EVENTS_TAIL = {
    "postgresql": "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS tx, 0 AS id",
    "sqlite": "SELECT 0 AS tx, COALESCE(MAX(event_id), 0) AS id FROM run_events",
}

# -- name: last_event_id --
# Whether anything was written since a poll (SQLite's wake-up): the primary key's last
# entry.
LAST_EVENT_ID = "SELECT COALESCE(MAX(event_id), 0) FROM run_events"


def parse_cursor(value: str) -> Cursor | None:
    """``"17"`` or ``"812345-17"`` as (tx_id, event_id); None when it is not a cursor."""
    match = _CURSOR.fullmatch(value.strip())
    if match is None:
        return None
    tx, event_id = int(match.group(1) or 0), int(match.group(2))
    if tx > MAX_BIGINT or event_id > MAX_BIGINT:
        return None
    return tx, event_id


def format_cursor(cursor: Cursor) -> str:
    tx, event_id = cursor
    return f"{tx}-{event_id}" if tx else str(event_id)


def events_after(engine: Engine, after: Cursor, *, tenant: str | None,
                 limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` events after ``after`` in delivery order; of ``tenant``'s runs
    only, unless it is None (every tenant)."""
    statement = text(EVENTS_AFTER[engine.dialect.name])
    with engine.connect() as conn:
        rows = conn.execute(statement, {"tx": after[0], "id": after[1], "tenant": tenant,
                                        "limit": limit})
        return [dict(r._mapping) for r in rows]


def events_tail(engine: Engine) -> Cursor:
    with engine.connect() as conn:
        row = conn.execute(text(EVENTS_TAIL[engine.dialect.name])).one()
        return int(row.tx), int(row.id)


def last_event_id(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(LAST_EVENT_ID)).scalar() or 0)
