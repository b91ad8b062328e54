"""A run's history composed from three tables (migration 0028): ``run_events`` keeps the
transitions no other row records; the run row records its creation when it was created
QUEUED (who, when, its place in the stream); the attempt row records its claim
(QUEUED -> CLAIMED, at ``started_at`` by ``worker_id``) and the hop that ended it
(``end_from_status -> end_to_status`` at ``ended_at``). A normal run thus writes one
event per stage hop and none for its creation, claim and end.

Every reader of a run's transitions (``runs show``, the audit, the event stream, the
latest failures) reads ``history()``: rows shaped as events, each with a position
(``event_id``) from one count shared by the three tables, so their order is the order of
the writes. Rows older than 0028 carry no position and have their events instead: each
transition appears once.

Positions: PostgreSQL takes them from ``run_events``' own sequence and records the
writer's top-level transaction id, as the event trigger does (store/events.py says why);
SQLite writes one transaction at a time and reserves them from ``sqlite_sequence``,
which ``run_events`` (AUTOINCREMENT) never takes again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, text

from runlane.domain.states import LEASED, RunStatus

# The writer's transaction id and a new position, in a PostgreSQL statement.
PG_TX = "CAST(CAST(pg_current_xact_id() AS text) AS bigint)"
PG_SEQ = "nextval('run_events_event_id_seq')"

# -- name: reserve_positions --
# SQLite: ``:n`` positions past every id run_events or a reservation took: the last one
# is returned. The row of sqlite_sequence exists from 0028 on (a database made by
# create_all gets it at its first reservation, RESERVE_ROW).
RESERVE = """
UPDATE sqlite_sequence
SET seq = MAX(seq, (SELECT COALESCE(MAX(event_id), 0) FROM run_events)) + :n
WHERE name = 'run_events'
RETURNING seq
"""
RESERVE_ROW = """
INSERT INTO sqlite_sequence (name, seq)
SELECT 'run_events', 0
WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'run_events')
"""
# -- name: last_position --
# SQLite: the last position taken (an event's id or a reservation), for the stream's
# tail and wake-up.
LAST_POSITION = """
SELECT MAX(COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'run_events'), 0),
           COALESCE((SELECT MAX(event_id) FROM run_events), 0))
"""

# -- name: last_written --
# Either dialect: the newest position written anywhere (the chaos harness's "has
# anything moved"); reads every attempt, for small databases only.
LAST_WRITTEN = """
SELECT COALESCE(MAX(m), 0) FROM (
    SELECT MAX(event_id) AS m FROM run_events
    UNION ALL SELECT MAX(created_seq) FROM runs
    UNION ALL SELECT MAX(claim_seq) FROM attempts
    UNION ALL SELECT MAX(end_seq) FROM attempts) x
"""

# -- name: end_attempt_hop --
# The hop that ended an attempt, on its row (the attempt's own write ended it already,
# or ends it in the same transaction): with its place in the stream.
END_HOP = {
    "postgresql": f"""
        UPDATE attempts
        SET end_tx = {PG_TX}, end_seq = {PG_SEQ}, end_from_status = :from_status,
            end_to_status = :to_status, end_actor = NULLIF(:actor, worker_id),
            end_reason_code = :reason_code,
            end_message = :message
        WHERE run_id = :run_id AND fencing_token = :token AND end_seq IS NULL
    """,
    "sqlite": """
        UPDATE attempts
        SET end_tx = 0, end_seq = :seq, end_from_status = :from_status,
            end_to_status = :to_status, end_actor = NULLIF(:actor, worker_id),
            end_reason_code = :reason_code,
            end_message = :message
        WHERE run_id = :run_id AND fencing_token = :token AND end_seq IS NULL
    """,
}

COLUMNS = ("event_id, tx_id, run_id, attempt_no, at, actor, from_status, to_status, "
           "reason_code, fencing_token, message")
_EVENTS = f"SELECT {COLUMNS} FROM run_events e WHERE {{events}}"
_CREATED = """
SELECT r.created_seq, r.created_tx, r.run_id, NULL, r.created_at, r.created_by, NULL,
       'QUEUED', NULL, NULL, 'admitted under policy v' || CAST(r.policy_version AS TEXT)
FROM runs r WHERE r.created_seq IS NOT NULL AND {runs}"""
_CLAIMED = """
SELECT a.claim_seq, a.claim_tx, a.run_id, a.attempt_no, a.started_at, a.worker_id,
       'QUEUED', 'CLAIMED', NULL, a.fencing_token, NULL
FROM attempts a WHERE a.claim_seq IS NOT NULL AND {attempts}"""
_ENDED = """
SELECT a.end_seq, a.end_tx, a.run_id, a.attempt_no, a.ended_at,
       COALESCE(a.end_actor, a.worker_id), a.end_from_status, a.end_to_status,
       a.end_reason_code, a.fencing_token, a.end_message
FROM attempts a WHERE a.end_seq IS NOT NULL AND {attempts}"""


def history(where: str = "1 = 1") -> str:
    """Every transition as an event row (``COLUMNS``), as a parenthesized subquery.
    ``where`` filters each part on its table's ``run_id`` column (``{run_id}``), so a
    run's history reads each table by its index on the run."""
    def on(alias: str) -> str:
        return where.replace("{run_id}", f"{alias}.run_id")
    return "(" + "\nUNION ALL\n".join([
        _EVENTS.format(events=on("e")), _CREATED.format(runs=on("r")),
        _CLAIMED.format(attempts=on("a")), _ENDED.format(attempts=on("a"))]) + ")"


# -- name: run_history --
# One run's transitions in the order they were written (``runs show``): each part by
# its table's index on the run (ix_run_events_run, the primary keys of runs and
# attempts).
RUN_HISTORY = (f"SELECT event_id, attempt_no, at, actor, from_status, to_status, "
               f"reason_code, fencing_token, message "
               f"FROM {history('{run_id} = :run_id')} h ORDER BY event_id")

# Everything, for the audit's checks (they read every row anyway).
ALL = history()


def reserve(conn: Connection, n: int) -> int:
    """SQLite: reserve ``n`` positions; the first one."""
    last = conn.execute(text(RESERVE), {"n": n}).scalar()
    if last is None:
        conn.execute(text(RESERVE_ROW))
        last = conn.execute(text(RESERVE), {"n": n}).scalar_one()
    return int(last) - n + 1


def last_position(conn: Connection) -> int:
    """SQLite: the last position taken."""
    return int(conn.execute(text(LAST_POSITION)).scalar() or 0)


def end_index(source: RunStatus, path: Sequence[RunStatus]) -> int:
    """Which hop of an attempt's last move ends it, on its row: the first one into a
    status that is not a stage (LEASED). The hops before it (stages) and after it (a
    requeue, say) stay events."""
    for i, status in enumerate(path):
        if status not in LEASED:
            return i
    raise ValueError(f"{source} -> {path} does not end an attempt")


def record_end(store: Any, conn: Connection, hops: list[dict[str, Any]], end: int) -> None:
    """Record a move's hops (event rows, ``Store._hop_events``) that ends an attempt:
    the ``end``-th hop on the attempt's row (END_HOP), the others as events, in order.
    An attempt whose end is already recorded (cannot happen: its run moved on with it)
    gets the hop as an event: a transition is never dropped."""
    store._record(conn, hops[:end])
    hop = hops[end]
    params = {"run_id": hop["run_id"], "token": hop["fencing_token"],
              "from_status": hop["from_status"], "to_status": hop["to_status"],
              "actor": hop["actor"], "reason_code": hop["reason_code"],
              "message": hop["message"]}
    dialect = conn.dialect.name
    if dialect != "postgresql":
        params["seq"] = reserve(conn, 1)
    if conn.execute(text(END_HOP[dialect]), params).rowcount != 1:
        store._record(conn, [hop])
    store._record(conn, hops[end + 1:])


def created_in_row(run: dict[str, Any]) -> bool:
    """Whether a new run records its creation on its row (sql.CREATED_IN_ROW): admitted
    QUEUED, its event would say only that."""
    return (run["status"] == "QUEUED" and run["reason_code"] is None
            and run["event_message"] == f"admitted under policy v{run['policy_version']}")
