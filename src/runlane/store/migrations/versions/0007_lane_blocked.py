"""A lane blocked by a full scope is parked until that scope gives a slot back.

A lane whose head run's repository, user or risk class is full gave every claim
nothing, and every claim walked its whole backlog to find that out. Such a lane
now leaves the pick index like a lane in backoff (``wake_at``), with the scope it
waits for (``blocked_scope``): the slot given back there wakes it.

Revision ID: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

BLOCKED_WHERE = "blocked_scope IS NOT NULL AND wake_at IS NOT NULL"


def upgrade() -> None:
    op.add_column("lanes", sa.Column("blocked_scope", sa.String(400)))
    op.create_index("ix_lanes_blocked", "lanes", ["blocked_scope"],
                    postgresql_where=sa.text(BLOCKED_WHERE),
                    sqlite_where=sa.text(BLOCKED_WHERE))


def downgrade() -> None:
    op.drop_index("ix_lanes_blocked", table_name="lanes")
    with op.batch_alter_table("lanes") as batch:
        batch.drop_column("blocked_scope")
