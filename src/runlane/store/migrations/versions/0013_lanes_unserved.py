"""Lanes remember whether a live worker serves their route: ``lanes.unserved``.

The virtual time of a (queue, priority), where a lane joins, wakes or is shown again,
is the lowest pass of the lanes that compete in it. A lane of a route no live worker
serves is never claimed, so its pass never moves; it held that virtual time down, and
a tenant arriving later joined far behind the lanes being served and took the next
claims one after another. The reconciler marks such lanes (and clears the mark, with
a catch-up of the pass, once a worker serves the route); the virtual time leaves them
out (lanes_sql._virtual_time). A column with a constant default: no table rewrite.

Revision ID: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("lanes", sa.Column("unserved", sa.Integer, nullable=False,
                                     server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("lanes") as batch:
        batch.drop_column("unserved")
