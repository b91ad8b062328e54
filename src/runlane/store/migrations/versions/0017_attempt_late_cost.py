"""Attempts keep the cost reported after their lease was lost: ``attempts.late_cost_usd``.

An agent runs on for a moment after its worker lost the lease (until the worker
stops it), and may report cost meanwhile. That report was refused and the money
dropped, so a tenant's daily spend, which admission checks against its budget,
undercounted what was really spent. Such cost is now added to the tenant's day and
recorded on the attempt here, apart from ``cost_usd`` (what the attempt reported while
it held its lease); the run's ``cost_usd`` is left alone. A column with a constant default: no
table rewrite; existing attempts have none.

Revision ID: 0017
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("late_cost_usd", sa.Float, nullable=False,
                                        server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("late_cost_usd")
