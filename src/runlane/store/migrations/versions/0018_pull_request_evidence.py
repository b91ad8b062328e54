"""Pull-request evidence is never lost: ``runs.finalize_only_after`` and
``runs.close_due_at``.

1. ``finalize_only_after`` (NULL until granted): a run whose last attempt ended after
   its push or pull request was begun, and that would otherwise end FAILED, is given
   finalize-only attempts outside its attempt budget; every attempt numbered above
   this one only finds (or opens) the run's pull request and records it, never runs
   the agent. ``runlane audit``'s attempt budget leaves those attempts out.
2. ``close_due_at`` (NULL unless due): a run that ended FAILED, CANCELLED or
   POLICY_DENIED with a push or a pull request in its ledger has its pull request
   closed (with a comment naming why) and what it found recorded, by a worker, from
   this time on. The partial index ``ix_runs_close_due`` holds only those runs, so a
   worker's look for one is a read of a few entries whatever the size of ``runs``.

Two nullable columns without a default: no table rewrite on either engine. The index
is built with ``CONCURRENTLY`` on a populated PostgreSQL table (online_index); it
holds no entry until a run is due.

Revision ID: 0018
"""

import sqlalchemy as sa
from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

CLOSE_DUE = IndexSpec("ix_runs_close_due", "runs", ("close_due_at",),
                      "close_due_at IS NOT NULL")


def upgrade() -> None:
    op.add_column("runs", sa.Column("finalize_only_after", sa.Integer))
    op.add_column("runs", sa.Column("close_due_at", sa.Float))
    ensure_index(op, CLOSE_DUE)


def downgrade() -> None:
    drop_index(op, CLOSE_DUE.name)
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("close_due_at")
        batch.drop_column("finalize_only_after")
