"""API tokens, idempotency digests and retry links (issue 23).

1. ``api_tokens``: bearer tokens of the HTTP API, by tenant and role; only the
   SHA-256 of each secret is stored.
2. ``tasks.request_digest``: the SHA-256 of a keyed task as asked; a submit with the
   same tenant and key and another digest is refused (409). Tasks written before this
   revision have none and are taken as matching (what they were asked with is not
   known; refusing every replay of them would break scripts that worked).
3. ``runs.retry_of_run_id``: the finished run a ``runlane retry`` run follows, with
   the partial unique index ``uq_runs_retry_of`` (at most one retry per run; no entry
   for first runs), built ``CONCURRENTLY`` on a populated PostgreSQL table.

Nullable columns without a default: no table rewrite on either engine.

Revision ID: 0019
"""

import sqlalchemy as sa
from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

RETRY_OF = IndexSpec("uq_runs_retry_of", "runs", ("retry_of_run_id",),
                     "retry_of_run_id IS NOT NULL", unique=True)


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("token_id", sa.String(32), primary_key=True),
        sa.Column("tenant", sa.String(128)),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("name", sa.String(255)),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("expires_at", sa.Float),
        sa.Column("revoked_at", sa.Float),
        sa.Column("last_used_at", sa.Float),
    )
    op.add_column("tasks", sa.Column("request_digest", sa.String(64)))
    op.add_column("runs", sa.Column("retry_of_run_id", sa.String(36)))
    ensure_index(op, RETRY_OF)


def downgrade() -> None:
    drop_index(op, RETRY_OF.name)
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("retry_of_run_id")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("request_digest")
    op.drop_table("api_tokens")
