"""Tasks, runs, attempts with their leases, run events and workers.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

ID = sa.String(36)
TS = sa.Float()


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("task_id", ID, primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("repo", sa.Text, nullable=False),
        sa.Column("prompt", sa.Text, nullable=False),
        sa.Column("queue", sa.String(128), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("context", sa.JSON, nullable=False),
        sa.Column("truncated_sections", sa.JSON, nullable=False),
        sa.Column("payload_bytes", sa.Integer, nullable=False),
        sa.Column("cancel_requested_at", TS),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_tasks_tenant_idempotency_key"),
    )
    op.create_table(
        "runs",
        sa.Column("run_id", ID, primary_key=True),
        sa.Column("task_id", ID, sa.ForeignKey("tasks.task_id"), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("repo", sa.Text, nullable=False),
        sa.Column("queue", sa.String(128), nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("fencing_token", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("visible_at", TS, nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.Column("ended_at", TS),
        sa.Column("reason_code", sa.String(64)),
        sa.Column("message", sa.Text),
        sa.Column("outcome", sa.String(64)),
        sa.Column("cost_usd", sa.Float, nullable=False, server_default="0"),
    )
    op.create_index("ix_runs_task_id", "runs", ["task_id"])
    op.create_index("ix_runs_tenant_created", "runs", ["tenant", "created_at"])
    op.create_index("ix_runs_status_updated", "runs", ["status", "updated_at"])
    op.create_table(
        "attempts",
        sa.Column("run_id", ID, sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("attempt_no", sa.Integer, primary_key=True),
        sa.Column("fencing_token", sa.BigInteger, nullable=False),
        sa.Column("worker_id", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("reason_code", sa.String(64)),
        sa.Column("message", sa.Text),
        sa.Column("retry_after_seconds", sa.Float),
        sa.Column("lease_status", sa.String(16), nullable=False),
        sa.Column("lease_expires_at", TS, nullable=False),
        sa.Column("lease_ended_at", TS),
        sa.Column("heartbeat_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("ended_at", TS),
        sa.Column("cost_usd", sa.Float, nullable=False, server_default="0"),
        sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.UniqueConstraint("run_id", "fencing_token", name="uq_attempts_run_fencing_token"),
    )
    active = sa.text("lease_status = 'ACTIVE'")
    op.create_index("uq_attempts_one_active_lease", "attempts", ["run_id"], unique=True,
                    postgresql_where=active, sqlite_where=active)
    op.create_index("ix_attempts_active_lease_expiry", "attempts", ["lease_expires_at"],
                    postgresql_where=active, sqlite_where=active)
    op.create_index("ix_attempts_active_lease_worker", "attempts", ["worker_id"],
                    postgresql_where=active, sqlite_where=active)
    op.create_table(
        "run_events",
        sa.Column("event_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                  primary_key=True, autoincrement=True),
        sa.Column("run_id", ID, sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("attempt_no", sa.Integer),
        sa.Column("at", TS, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("from_status", sa.String(32)),
        sa.Column("to_status", sa.String(32), nullable=False),
        sa.Column("reason_code", sa.String(64)),
        sa.Column("fencing_token", sa.BigInteger),
        sa.Column("message", sa.Text),
    )
    op.create_index("ix_run_events_run", "run_events", ["run_id", "event_id"])
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.String(255), primary_key=True),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("queues", sa.JSON, nullable=False),
        sa.Column("capabilities", sa.JSON, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=False),
    )


def downgrade() -> None:
    for table in ("workers", "run_events", "attempts", "runs", "tasks"):
        op.drop_table(table)
