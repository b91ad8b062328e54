"""Approval gates and cost limits (issue 29): ``run_approvals`` records who approved,
rejected or let expire a run held in AWAITING_APPROVAL, when, with what note and under
which policy version (one row per run: its primary key makes a second approval of the
same run a no-op); ``runs.cost_exceeded_at`` and ``attempts.cost_exceeded_at`` record
when a run's cost limit was crossed. A new table and nullable columns: nothing is
rewritten on either engine.

Revision ID: 0025
"""

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

ID = sa.String(36)


def upgrade() -> None:
    op.create_table(
        "run_approvals",
        sa.Column("run_id", ID, primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("note", sa.Text),
        sa.Column("policy_version", sa.Integer, nullable=False),
        sa.Column("decided_at", sa.Float, nullable=False),
    )
    op.add_column("runs", sa.Column("cost_exceeded_at", sa.Float))
    op.add_column("attempts", sa.Column("cost_exceeded_at", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("cost_exceeded_at")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("cost_exceeded_at")
    op.drop_table("run_approvals")
