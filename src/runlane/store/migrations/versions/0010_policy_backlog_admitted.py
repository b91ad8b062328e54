"""Each policy version records when the queued backlog was admitted again under it.

After a policy change the scheduler's pass admits every run queued under an older
version again (``SchedulingMixin._admit_queued_backlog``); a scheduler's first pass
did so too, in case a change came while no scheduler ran: a read of the whole queue
(7.5 s at 1,000,000 queued runs) at every start and every ``runlane maintain --once``.
A pass that reached every run now stamps the version (``backlog_admitted_at``), and a
first pass skips a version so stamped.

Revision ID: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("policy_versions", sa.Column("backlog_admitted_at", sa.Float()))


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("policy_versions", recreate="always") as batch:
            batch.drop_column("backlog_admitted_at")
    else:
        op.drop_column("policy_versions", "backlog_admitted_at")
