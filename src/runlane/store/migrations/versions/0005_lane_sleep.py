"""Lanes sleep while every run in them waits for its backoff.

A lane whose queued runs are all not yet visible (retries in backoff) would be
walked by every claim and found empty; it now leaves the pick index until its
earliest run is due (``wake_at``). ``lanes`` has one row per (queue, route,
priority, tenant), a few thousand rows, so its indexes are rebuilt in place.

Revision ID: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

OLD_PICK_WHERE = "queued_count > 0 AND tenant_at_limit = 0"
PICK_WHERE = "queued_count > 0 AND tenant_at_limit = 0 AND wake_at IS NULL"
PICK_COLUMNS = ["queue", "priority", "pass", "lane_id"]


def upgrade() -> None:
    op.add_column("lanes", sa.Column("wake_at", sa.Float))
    op.drop_index("ix_lanes_pick", table_name="lanes")
    op.create_index("ix_lanes_pick", "lanes", PICK_COLUMNS,
                    postgresql_where=sa.text(PICK_WHERE), sqlite_where=sa.text(PICK_WHERE))
    op.create_index("ix_lanes_wake", "lanes", ["wake_at"],
                    postgresql_where=sa.text("wake_at IS NOT NULL"),
                    sqlite_where=sa.text("wake_at IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_lanes_wake", table_name="lanes")
    op.drop_index("ix_lanes_pick", table_name="lanes")
    op.create_index("ix_lanes_pick", "lanes", PICK_COLUMNS,
                    postgresql_where=sa.text(OLD_PICK_WHERE),
                    sqlite_where=sa.text(OLD_PICK_WHERE))
    with op.batch_alter_table("lanes") as batch:
        batch.drop_column("wake_at")
