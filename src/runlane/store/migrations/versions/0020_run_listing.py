"""The runs listing and remote drain: two indexes on ``runs``, ``workers.drain_requested_at``.

1. ``ix_runs_listing_tenant_status`` (tenant, status, created_at, run_id): a page of one
   tenant's runs in one status, newest (or oldest) first, is a walk of this index from
   the cursor: no sort, and rows read bounded by the page whatever the size of ``runs``
   (store/listing.py; the plan is in docs/benchmarks.md).
2. ``ix_runs_listing_tenant`` (tenant, created_at, run_id) replaces ``ix_runs_tenant_created``
   (tenant, created_at): the same entries with the cursor's tie-breaker, so a tenant's page
   in every status needs no sort either. No index is added for this one (the old is dropped
   once the new is built), so no write pays for it.
3. ``ix_runs_listing`` (created_at, run_id): the operator's page over every tenant.
4. ``workers.drain_requested_at``: an operator asked this worker to drain
   (``runlane workers drain``); the worker reads it at its next heartbeat and drains as on
   SIGTERM.

Indexes are built ``CONCURRENTLY`` on a populated PostgreSQL table (online_index); the
column is nullable without a default: no table rewrite on either engine.

Revision ID: 0020
"""

import sqlalchemy as sa
from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

TENANT_STATUS = IndexSpec("ix_runs_listing_tenant_status", "runs",
                          ("tenant", "status", "created_at", "run_id"))
TENANT = IndexSpec("ix_runs_listing_tenant", "runs", ("tenant", "created_at", "run_id"))
EVERY_TENANT = IndexSpec("ix_runs_listing", "runs", ("created_at", "run_id"))
OLD_TENANT = IndexSpec("ix_runs_tenant_created", "runs", ("tenant", "created_at"))


def upgrade() -> None:
    op.add_column("workers", sa.Column("drain_requested_at", sa.Float))
    for spec in (TENANT_STATUS, TENANT, EVERY_TENANT):
        ensure_index(op, spec)
    drop_index(op, OLD_TENANT.name)


def downgrade() -> None:
    ensure_index(op, OLD_TENANT)
    for spec in (EVERY_TENANT, TENANT, TENANT_STATUS):
        drop_index(op, spec.name)
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("drain_requested_at")
