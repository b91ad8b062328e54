"""The dispatch index, built online on a populated PostgreSQL database.

Revision ID: 0002
"""

from alembic import op

from runlane.store.online_index import IndexSpec, ensure_index

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Frozen as it shipped: 0004 replaced it with ix_runs_lane_dispatch (schema.py).
DISPATCH_INDEX_NAME = "ix_runs_dispatch"
DISPATCH = IndexSpec(DISPATCH_INDEX_NAME, "runs", ("queue", "priority", "visible_at", "run_id"),
                     "status = 'QUEUED'")


def upgrade() -> None:
    ensure_index(op, DISPATCH)


def downgrade() -> None:
    op.drop_index(DISPATCH_INDEX_NAME, table_name="runs")
