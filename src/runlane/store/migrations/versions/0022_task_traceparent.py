"""The trace a task belongs to: ``tasks.traceparent`` (issue 24, traces).

The submit that creates a task starts its trace (observability/tracing.py) and keeps
the submit span's W3C ``traceparent`` here; each attempt, whichever machine claims it
and however much later, reads it with the task and starts its span as that span's
child, so every attempt of the task lands in one trace. NULL when the submit traced
nothing (tracing off, or a task older than this revision): its attempts start traces
of their own.

A nullable column without a default: no table rewrite on either engine.

Revision ID: 0022
"""

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("traceparent", sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("traceparent")
