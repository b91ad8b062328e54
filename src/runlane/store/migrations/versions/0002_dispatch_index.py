"""The dispatch index, built online on a populated PostgreSQL database.

Revision ID: 0002
"""

from alembic import op

from runlane.store.online_index import IndexSpec, ensure_index
from runlane.store.schema import DISPATCH_INDEX_COLUMNS, DISPATCH_INDEX_NAME, DISPATCH_INDEX_WHERE

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

DISPATCH = IndexSpec(DISPATCH_INDEX_NAME, "runs", DISPATCH_INDEX_COLUMNS, DISPATCH_INDEX_WHERE)


def upgrade() -> None:
    ensure_index(op, DISPATCH)


def downgrade() -> None:
    op.drop_index(DISPATCH_INDEX_NAME, table_name="runs")
