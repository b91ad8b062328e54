"""Provider capacity (issue 29): ``runs.provider``, the model provider a run uses (its
attempts hold a slot in the scope ``provider:NAME``). A nullable column added: nothing
is rewritten on either engine.

Revision ID: 0026
"""

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("provider", sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("provider")
