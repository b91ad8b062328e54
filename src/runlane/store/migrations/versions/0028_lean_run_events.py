"""Leaner rows per run: the run row records its creation, the attempt row its claim and
its end; none of them writes a ``run_events`` row any more (store/history.py).

A finished run wrote four events (created, claimed, a stage, ended: 2.5 per run over
queued and finished runs, 573 B per run of ``run_events`` at 2,000,000 runs). Now
``runs`` gets ``created_by``, ``created_tx`` and ``created_seq``; ``attempts`` gets the
claim's and the end's place in the event stream (``claim_tx``, ``claim_seq``,
``end_tx``, ``end_seq``) and the end's hop (``end_from_status``, ``end_to_status``,
``end_actor``, ``end_reason_code``, ``end_message``). All nullable, no default: on
PostgreSQL adding them rewrites nothing. Rows older than this migration keep their
events and NULL positions, so the composed history shows each claim and end once (from
the event), and no batch job is needed.

The stream's positions are ids of ``run_events``' own count, so every cursor already
handed out keeps its meaning: on PostgreSQL the column's sequence, on SQLite the table
becomes ``AUTOINCREMENT`` (rebuilt here: SQLite cannot alter a primary key) so that a
position taken through ``sqlite_sequence`` is never taken again by an event.

On PostgreSQL the stream's wake-up (``NOTIFY runlane_events``) is also sent by a claim
(an insert into ``attempts``), an end (an update that sets ``end_seq``) and a creation
(an insert into ``runs``); the indexes are built ``CONCURRENTLY`` on a populated table.

Revision ID: 0028
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

FAILED_ENDS_WHERE = "end_to_status IN ('FAILED_RETRYABLE', 'FAILED')"
INDEXES = (
    IndexSpec("ix_runs_created_feed", "runs", ("created_tx", "created_seq"),
              "created_seq IS NOT NULL"),
    IndexSpec("ix_attempts_claim_feed", "attempts", ("claim_tx", "claim_seq"),
              "claim_seq IS NOT NULL"),
    IndexSpec("ix_attempts_end_feed", "attempts", ("end_tx", "end_seq"),
              "end_seq IS NOT NULL"),
    IndexSpec("ix_attempts_failed_ends", "attempts", ("ended_at", "end_seq"),
              FAILED_ENDS_WHERE),
)
RUN_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("created_by", sa.String(255)), ("created_tx", sa.BigInteger),
    ("created_seq", sa.BigInteger))
ATTEMPT_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("claim_tx", sa.BigInteger), ("claim_seq", sa.BigInteger), ("end_tx", sa.BigInteger),
    ("end_seq", sa.BigInteger), ("end_from_status", sa.String(32)),
    ("end_to_status", sa.String(32)), ("end_actor", sa.String(255)),
    ("end_reason_code", sa.String(64)), ("end_message", sa.Text))

TRIGGERS = """
CREATE TRIGGER runs_created_notify AFTER INSERT ON runs
    FOR EACH STATEMENT EXECUTE FUNCTION runlane_event_notify();
CREATE TRIGGER attempts_claimed_notify AFTER INSERT ON attempts
    FOR EACH STATEMENT EXECUTE FUNCTION runlane_event_notify();
CREATE TRIGGER attempts_ended_notify AFTER UPDATE OF end_seq ON attempts
    FOR EACH STATEMENT EXECUTE FUNCTION runlane_event_notify();
"""
DROP_TRIGGERS = """
DROP TRIGGER IF EXISTS runs_created_notify ON runs;
DROP TRIGGER IF EXISTS attempts_claimed_notify ON attempts;
DROP TRIGGER IF EXISTS attempts_ended_notify ON attempts;
"""

# run_events as 0021 left it, for SQLite's rebuild (with or without AUTOINCREMENT).
EVENT_INDEXES = (
    "CREATE INDEX ix_run_events_run ON run_events (run_id, event_id)",
    "CREATE INDEX ix_run_events_tx ON run_events (tx_id, event_id)",
    "CREATE INDEX ix_run_events_claims ON run_events (at) WHERE to_status = 'CLAIMED'",
    "CREATE INDEX ix_run_events_failures ON run_events (at, event_id) "
    "WHERE to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED')",
)
EVENT_COLUMNS = ("event_id, run_id, attempt_no, at, actor, from_status, to_status, "
                 "reason_code, fencing_token, message, tx_id")


def _events_table(autoincrement: bool) -> sa.Table:
    return sa.Table(
        "_run_events_0028", sa.MetaData(),
        sa.Column("event_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(36), nullable=False),
        sa.Column("attempt_no", sa.Integer),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("from_status", sa.String(32)),
        sa.Column("to_status", sa.String(32), nullable=False),
        sa.Column("reason_code", sa.String(64)),
        sa.Column("fencing_token", sa.BigInteger),
        sa.Column("message", sa.Text),
        sa.Column("tx_id", sa.BigInteger, nullable=False, server_default="0"),
        sqlite_autoincrement=autoincrement,
    )


def _rebuild_sqlite_events(autoincrement: bool) -> None:
    """SQLite: run_events again with (or without) AUTOINCREMENT, rows and ids kept."""
    bind = op.get_bind()
    table = _events_table(autoincrement)
    table.create(bind)
    op.execute(f"INSERT INTO _run_events_0028 ({EVENT_COLUMNS}) "
               f"SELECT {EVENT_COLUMNS} FROM run_events")
    op.execute("DROP TABLE run_events")
    op.execute("ALTER TABLE _run_events_0028 RENAME TO run_events")
    for statement in EVENT_INDEXES:
        op.execute(statement)
    if autoincrement:  # the count starts past every id taken so far
        op.execute("INSERT INTO sqlite_sequence (name, seq) "
                   "SELECT 'run_events', COALESCE(MAX(event_id), 0) FROM run_events")


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name, type_ in RUN_COLUMNS:
        op.add_column("runs", sa.Column(name, type_))
    for name, type_ in ATTEMPT_COLUMNS:
        op.add_column("attempts", sa.Column(name, type_))
    for spec in INDEXES:
        ensure_index(op, spec)
    if sqlite:
        _rebuild_sqlite_events(autoincrement=True)
    else:
        op.execute(TRIGGERS)


def downgrade() -> None:
    """Back to 0027. Claims, ends and creations written since keep no event: the
    positions and hops are dropped with their columns."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        _rebuild_sqlite_events(autoincrement=False)
    else:
        op.execute(DROP_TRIGGERS)
    for spec in INDEXES:
        drop_index(op, spec.name)
    with op.batch_alter_table("attempts") as batch:
        for name, _ in reversed(ATTEMPT_COLUMNS):
            batch.drop_column(name)
    with op.batch_alter_table("runs") as batch:
        for name, _ in reversed(RUN_COLUMNS):
            batch.drop_column(name)
