"""The event stream of the HTTP API: ``run_events.tx_id``, its index, and on PostgreSQL
two triggers.

A reader of ``run_events`` that asks for ``event_id > last`` misses events on
PostgreSQL: an id is taken from the sequence when the row is inserted, not when its
transaction commits, so a transaction that took id 10 and commits after the one that
took id 11 makes 10 appear behind a reader that already passed 11. So each row records
its writer's top-level transaction id (``pg_current_xact_id()``, set by a BEFORE INSERT
trigger, whatever the statement), and a reader delivers rows in ``(tx_id, event_id)``
order, only those of transactions older than every transaction still running
(``pg_snapshot_xmin``): all of them have ended, so none can add a row before the
reader's position later (store/events.py).

A statement-level AFTER INSERT trigger sends ``NOTIFY runlane_events`` (delivered at
commit, one per transaction) so that a stream wakes at once instead of polling.

SQLite writes one transaction at a time, so event ids are already in commit order: the
column stays 0 there. Existing rows get 0 too (a constant default: no table rewrite),
which orders them before every new row, by event id, as they committed. The index is
built with ``CONCURRENTLY`` on a populated PostgreSQL table (online_index).

Revision ID: 0021
"""

import sqlalchemy as sa
from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

EVENTS_BY_TX = IndexSpec("ix_run_events_tx", "run_events", ("tx_id", "event_id"))

TRIGGERS = """
CREATE OR REPLACE FUNCTION runlane_event_tx() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.tx_id := pg_current_xact_id()::text::bigint;
    RETURN NEW;
END $$;
CREATE OR REPLACE FUNCTION runlane_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('runlane_events', '');
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS run_events_tx ON run_events;
CREATE TRIGGER run_events_tx BEFORE INSERT ON run_events
    FOR EACH ROW EXECUTE FUNCTION runlane_event_tx();
DROP TRIGGER IF EXISTS run_events_notify ON run_events;
CREATE TRIGGER run_events_notify AFTER INSERT ON run_events
    FOR EACH STATEMENT EXECUTE FUNCTION runlane_event_notify();
"""

DROP_TRIGGERS = """
DROP TRIGGER IF EXISTS run_events_notify ON run_events;
DROP TRIGGER IF EXISTS run_events_tx ON run_events;
DROP FUNCTION IF EXISTS runlane_event_notify();
DROP FUNCTION IF EXISTS runlane_event_tx();
"""


def upgrade() -> None:
    op.add_column("run_events", sa.Column("tx_id", sa.BigInteger, nullable=False,
                                          server_default="0"))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(TRIGGERS)
    ensure_index(op, EVENTS_BY_TX)


def downgrade() -> None:
    drop_index(op, EVENTS_BY_TX.name)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(DROP_TRIGGERS)
    with op.batch_alter_table("run_events") as batch:
        batch.drop_column("tx_id")
