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

from runlane.store import history

EVENTS_CHANNEL = "runlane_events"  # NOTIFY'd by a trigger at each commit that adds events
MAX_BIGINT = 2**63 - 1
_CURSOR = re.compile(r"(?:(\d{1,19})-)?(\d{1,19})")

Cursor = tuple[int, int]
START: Cursor = (0, 0)

# -- name: events_after --
# The next transitions after a cursor, in delivery order, with their run's task and
# tenant (the principal's scope). Locks nothing. A transition is an event, a run's
# creation, an attempt's claim or an attempt's end (store/history.py): four sources,
# each read from the cursor on its own index, up to LIMIT each, merged in Python (the
# first LIMIT of the merge are the first LIMIT of all: each source gave its own first
# LIMIT). PostgreSQL: (tx, position) from the cursor (a row comparison is an index
# range: ix_run_events_tx, ix_runs_created_feed, ix_attempts_claim_feed,
# ix_attempts_end_feed), only transactions below the horizon (events_horizon, the
# module docstring). SQLite: the position from the cursor. Both: one runs lookup per row.
_SOURCES = {
    "events": ("""e.tx_id, e.event_id, e.run_id, r.task_id, r.tenant, e.attempt_no, e.at,
               e.actor, e.from_status, e.to_status, e.reason_code, e.fencing_token,
               e.message""", "run_events e", "e.tx_id", "e.event_id"),
    "created": ("""r.created_tx AS tx_id, r.created_seq AS event_id, r.run_id, r.task_id,
               r.tenant, NULL AS attempt_no, r.created_at AS at, r.created_by AS actor,
               NULL AS from_status, 'QUEUED' AS to_status, NULL AS reason_code,
               NULL AS fencing_token,
               'admitted under policy v' || CAST(r.policy_version AS TEXT) AS message""",
                None, "r.created_tx", "r.created_seq"),
    "claimed": ("""a.claim_tx AS tx_id, a.claim_seq AS event_id, a.run_id, r.task_id,
               r.tenant, a.attempt_no, a.started_at AS at, a.worker_id AS actor,
               'QUEUED' AS from_status, 'CLAIMED' AS to_status, NULL AS reason_code,
               a.fencing_token, NULL AS message""", "attempts a", "a.claim_tx",
                "a.claim_seq"),
    "ended": ("""a.end_tx AS tx_id, a.end_seq AS event_id, a.run_id, r.task_id, r.tenant,
               a.attempt_no, a.ended_at AS at, COALESCE(a.end_actor, a.worker_id) AS actor,
               a.end_from_status AS from_status, a.end_to_status AS to_status,
               a.end_reason_code AS reason_code, a.fencing_token,
               a.end_message AS message""", "attempts a", "a.end_tx", "a.end_seq"),
}


def _source(dialect: str, columns: str, table: str | None, tx: str, seq: str) -> str:
    joined = (f"FROM {table} JOIN runs r ON r.run_id = {table.split()[1]}.run_id"
              if table else "FROM runs r")
    if dialect == "postgresql":
        where = (f"({tx}, {seq}) > (:tx, :id) AND {tx} < :horizon"
                 f" AND (CAST(:tenant AS varchar) IS NULL OR r.tenant = :tenant)")
        order = f"{tx}, {seq}"
    else:  # Why it differs: no transaction ids, and none needed (one writer at a time).
        where = f"{seq} > :id AND (:tenant IS NULL OR r.tenant = :tenant)"
        order = seq
    if table is None or "attempts" in table:  # a partial index: only rows with a place
        where = f"{seq} IS NOT NULL AND {where}"
    return f"SELECT {columns} {joined} WHERE {where} ORDER BY {order} LIMIT :limit"


EVENTS_AFTER = {dialect: {name: _source(dialect, *parts) for name, parts in _SOURCES.items()}
                for dialect in ("postgresql", "sqlite")}

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

# The cursor of "now": every row delivered later is after it, every row deliverable
# now is not. PostgreSQL: (the horizon, 0), see events_horizon. SQLite: the last
# position taken (history.LAST_POSITION: an event's id or a reservation's).


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
        found = [dict(r._mapping) for statement in EVENTS_AFTER[dialect].values()
                 for r in conn.execute(text(statement), params)]
        found.sort(key=lambda r: (int(r["tx_id"]), int(r["event_id"])))
        rows = found[:limit]
        end = (int(rows[-1]["tx_id"]), int(rows[-1]["event_id"])) if rows else after
        if len(found) < limit:  # every source gave all it had: past all of them
            seen = ((below, 0) if dialect == "postgresql"
                    else (0, history.last_position(conn)))
            end = max(end, seen)
        return rows, end


def events_tail(engine: Engine) -> Cursor:
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            return horizon(conn), 0
        return 0, history.last_position(conn)


def last_event_id(engine: Engine) -> int:
    """Whether anything was written since a poll (SQLite's wake-up): the last position."""
    with engine.connect() as conn:
        return history.last_position(conn)
