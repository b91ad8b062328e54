"""Provider capacity (issue 29): ``runs.provider``, the model provider a run uses (its
attempts hold a slot in the scope ``provider:NAME``), and ``provider_pauses``, one row
per provider paused by its rate limit. A nullable column and a new table: nothing is
rewritten on either engine.

Revision ID: 0026
"""

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("provider", sa.String(128)))
    op.create_table(
        "provider_pauses",
        sa.Column("provider", sa.String(128), primary_key=True),
        sa.Column("paused_until", sa.Float, nullable=False),
        sa.Column("run_id", sa.String(36)),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("window_start", sa.Float),
        sa.Column("window_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("provider_pauses")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("provider")
