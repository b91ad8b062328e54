"""The page of lanes walks each served route on its own.

Lanes of routes no worker serves (a GPU with no GPU worker) never advance their
pass, so they sort first; a claim's ordered scan of (queue, priority, pass) read
every one of them before a lane it could serve. PostgreSQL now walks
(queue, route_key, priority, pass) once per route the worker serves. ``lanes`` has
one row per (queue, route, priority, tenant), a few thousand rows.

Revision ID: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

PICK_WHERE = "queued_count > 0 AND tenant_at_limit = 0 AND wake_at IS NULL"


def upgrade() -> None:
    op.create_index("ix_lanes_route_pick", "lanes",
                    ["queue", "route_key", "priority", "pass", "lane_id"],
                    postgresql_where=sa.text(PICK_WHERE), sqlite_where=sa.text(PICK_WHERE))


def downgrade() -> None:
    op.drop_index("ix_lanes_route_pick", table_name="lanes")
