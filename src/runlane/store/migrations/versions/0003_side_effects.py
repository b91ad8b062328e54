"""The side-effect ledger: an intent before every external effect, its result after.

Revision ID: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "side_effects",
        sa.Column("run_id", sa.String(36), sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("effect_key", sa.String(255), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempt_no", sa.Integer, nullable=False),
        sa.Column("fencing_token", sa.BigInteger, nullable=False),
        sa.Column("result", sa.JSON),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("completed_at", sa.Float),
    )


def downgrade() -> None:
    op.drop_table("side_effects")
