"""Run transitions as a stream: the rows of ``run_events`` in commit order, each with a
cursor that only grows, for the HTTP API's ``GET /v1/events`` (Server-Sent Events).

Why not ``event_id > last``: on PostgreSQL an event id is taken when the row is
inserted, not when its transaction commits. A transaction that took id 10 and commits
after the one that took 11 makes 10 appear behind a reader that already passed 11,
which then never delivers it. So every row carries its writer's top-level transaction
id (``tx_id``, set by a trigger, migration 0021), and the reader delivers rows in
``(tx_id, event_id)`` order, and only rows whose transaction is older than a horizon
that every transaction able to add a row later is at or above. Every transaction below
it has ended before the read's snapshot; had it committed, the read sees its rows; so
no row can later appear before a position already delivered. A transaction that runs
long holds delivery back (never loses it) until it ends.

The horizon (``events_horizon``, a statement of its own, before the read): the lowest
transaction id still running *in this database* (``pg_stat_activity.backend_xid``,
widened to 64 bits), else the snapshot's ``xmax``, which every transaction that takes
an id afterwards is above. A transaction running then is listed; one that ended before
the read's own (later) snapshot is visible to it. Only this database's: a long
transaction in another database of the same server (``pg_snapshot_xmin`` is the
whole server's) would otherwise hold the stream back. When this role may not see
another role's sessions in this database (their ``backend_xid`` reads as NULL), the
server-wide ``pg_snapshot_xmin`` is the horizon: later, never wrong.

SQLite writes one transaction at a time, so event ids are taken in commit order and
``tx_id`` stays 0: the order is ``event_id``.

A cursor is ``(tx_id, event_id)``, written ``"{event_id}"`` when tx_id is 0 (SQLite,
and rows written before 0021) and ``"{tx_id}-{event_id}"`` otherwise.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Connection, Engine, text

EVENTS_CHANNEL = "runlane_events"  # NOTIFY'd by a trigger at each commit that adds events
MAX_BIGINT = 2**63 - 1
_CURSOR = re.compile(r"(?:(\d{1,19})-)?(\d{1,19})")

Cursor = tuple[int, int]
START: Cursor = (0, 0)

# -- name: events_after --
# The next rows after a cursor, in delivery order, with their run's task and tenant
# (the principal's scope). Locks nothing. PostgreSQL: ix_run_events_tx from the cursor
# (a row comparison is an index range), stopping at the first LIMIT rows that pass;
# only rows of transactions below the horizon (events_horizon, the module docstring).
# SQLite: the primary key from the cursor's event id. Both: one runs lookup per row.
EVENTS_AFTER = {
    "postgresql": """
        SELECT e.tx_id, e.event_id, e.run_id, r.task_id, r.tenant, e.attempt_no, e.at,
               e.actor, e.from_status, e.to_status, e.reason_code, e.fencing_token,
               e.message
        FROM run_events e
        JOIN runs r ON r.run_id = e.run_id
        WHERE (e.tx_id, e.event_id) > (:tx, :id)
          AND e.tx_id < :horizon
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

# -- name: events_horizon --
# PostgreSQL only (the module docstring says why and why it is safe). Reads the
# server's activity view (shared memory, no table, no lock) for this database's
# sessions: the 32-bit ids of their running transactions, and whether any is hidden
# from this role; with the snapshot's xmax and the server-wide xmin (64 bits).
EVENTS_HORIZON = """
    SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax,
           pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS server_xmin,
           ARRAY(SELECT a.backend_xid::text::bigint FROM pg_stat_activity a
                 WHERE a.datname = current_database() AND a.backend_xid IS NOT NULL)
               AS running,
           EXISTS (SELECT 1 FROM pg_stat_activity a
                   WHERE a.datname = current_database()
                     AND a.query = '<insufficient privilege>') AS hidden
"""

# -- name: events_tail --
# The cursor of "now": every row delivered later is after it, every row deliverable
# now is not. PostgreSQL: (the horizon, 0), see events_horizon. SQLite: the last event
# id (primary key, one entry).
EVENTS_TAIL = {
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


def widen(xid: int, near: int) -> int:
    """The 64-bit transaction id whose low 32 bits are ``xid``, nearest to ``near`` (a
    running transaction is within 2**31 of the server's next id)."""
    base = (near & ~0xFFFFFFFF) | xid
    return min((base - 2**32, base, base + 2**32), key=lambda c: abs(c - near))


def horizon(conn: Connection) -> int:
    """Rows of transactions below this id may be delivered (EVENTS_HORIZON)."""
    row = conn.execute(text(EVENTS_HORIZON)).one()
    if row.hidden:
        return int(row.server_xmin)
    xmax = int(row.xmax)
    return min([xmax, *(widen(int(x), xmax) for x in row.running)])


def events_after(engine: Engine, after: Cursor, *, tenant: str | None,
                 limit: int) -> tuple[list[dict[str, Any]], Cursor]:
    """At most ``limit`` events after ``after`` in delivery order, of ``tenant``'s runs
    only unless it is None (every tenant); and the cursor to read on from. On a short
    page that cursor is past every row the read could see, delivered or not (another
    tenant's): a tenant's stream does not scan the same others' rows again at each
    look. On PostgreSQL two statements, the horizon first: the read's snapshot must be
    the later one (READ COMMITTED: one per statement); on SQLite the read and its
    last id are one transaction's snapshot."""
    dialect = engine.dialect.name
    params: dict[str, Any] = {"tx": after[0], "id": after[1], "tenant": tenant,
                              "limit": limit}
    with engine.connect() as conn:
        below = horizon(conn) if dialect == "postgresql" else 0
        params["horizon"] = below
        rows = [dict(r._mapping) for r in conn.execute(text(EVENTS_AFTER[dialect]), params)]
        end = (int(rows[-1]["tx_id"]), int(rows[-1]["event_id"])) if rows else after
        if len(rows) < limit:
            seen = ((below, 0) if dialect == "postgresql"
                    else (0, int(conn.execute(text(LAST_EVENT_ID)).scalar() or 0)))
            end = max(end, seen)
        return rows, end


def events_tail(engine: Engine) -> Cursor:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            return horizon(conn), 0
        row = conn.execute(text(EVENTS_TAIL["sqlite"])).one()
        return int(row.tx), int(row.id)


def last_event_id(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(LAST_EVENT_ID)).scalar() or 0)
