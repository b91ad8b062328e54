"""An index on a lane's flow: (tenant, queue, priority).

A tenant's lanes of one queue and priority (one per route) are one flow: they share
one pass, so a claim advances every lane of the flows it claimed from, and a lane
that joins a flow takes its pass (lanes_sql.FLOW_CLAIMED, lanes_sql._FLOW_PASS). The index
replaces ``ix_lanes_tenant`` (its first column is the tenant, so the lookups of a
tenant's lanes use it as they used that one). Built ``CONCURRENTLY`` on a populated
table (online_index).

Revision ID: 0012
"""

from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

LANES_FLOW = IndexSpec("ix_lanes_flow", "lanes", ("tenant", "queue", "priority"))
LANES_TENANT = IndexSpec("ix_lanes_tenant", "lanes", ("tenant",))


def upgrade() -> None:
    ensure_index(op, LANES_FLOW)
    drop_index(op, LANES_TENANT.name)


def downgrade() -> None:
    ensure_index(op, LANES_TENANT)
    drop_index(op, LANES_FLOW.name)
