"""Lanes blocked by a full scope sleep until a release gives that scope room.

A lane whose visible runs are all blocked by full scopes (a repository, user or risk
class at its limit) never gets a turn, so its stride pass never moves and it stays
first in the fair order: every claim walked its whole backlog to find nothing (13 ms
per claim behind 20,000 such runs, bench/blocked_lane.py). It now sleeps, with one
``lane_blocks`` row per blocking scope, and the release that gives one of them room
wakes it. An empty table: nothing to move.

Revision ID: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lane_blocks",
        sa.Column("scope", sa.String(400), primary_key=True),
        sa.Column("lane_id", sa.Integer, primary_key=True),
    )


def downgrade() -> None:
    op.drop_table("lane_blocks")
