"""Campaigns (issue 25): ``campaigns``, ``campaign_targets``, ``campaign_outcomes`` and
the notification outbox ``campaign_notifications`` (store/schema.py says what each
holds). New tables only: nothing is rewritten on either engine.

Revision ID: 0024
"""

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

ID = sa.String(36)


def upgrade() -> None:
    op.create_table(
        "campaigns",
        sa.Column("campaign_id", ID, primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(255)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("document", sa.JSON, nullable=False),
        sa.Column("batches", sa.JSON, nullable=False),
        sa.Column("released_batch", sa.Integer, nullable=False, server_default="0"),
        sa.Column("released_at", sa.JSON, nullable=False),
        sa.Column("active", sa.Integer, nullable=False, server_default="0"),
        sa.Column("finishes", sa.Integer, nullable=False, server_default="0"),
        sa.Column("recent", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("stop_window", sa.Integer, nullable=False),
        sa.Column("stop_reason", sa.Text),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float),
        sa.UniqueConstraint("tenant", "name", name="uq_campaigns_tenant_name"),
    )
    op.create_table(
        "campaign_targets",
        sa.Column("campaign_id", ID, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("target_key", sa.String(32), nullable=False),
        sa.Column("repo", sa.Text, nullable=False),
        sa.Column("vars", sa.JSON, nullable=False),
        sa.Column("owner", sa.String(255)),
        sa.Column("batch", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("generation", sa.Integer, nullable=False, server_default="0"),
        sa.Column("task_id", ID),
        sa.Column("run_id", ID),
        sa.Column("dispatched_at", sa.Float),
        sa.Column("ended_at", sa.Float),
        sa.Column("run_status", sa.String(32)),
        sa.Column("reason_code", sa.String(64)),
        sa.Column("outcome", sa.String(64)),
        sa.UniqueConstraint("campaign_id", "target_key", name="uq_campaign_targets_key"),
    )
    op.create_index("ix_campaign_targets_state", "campaign_targets",
                    ["campaign_id", "state", "batch", "position"])
    op.create_index("ix_campaign_targets_run", "campaign_targets", ["run_id"],
                    postgresql_where=sa.text("run_id IS NOT NULL"),
                    sqlite_where=sa.text("run_id IS NOT NULL"))
    op.create_table(
        "campaign_outcomes",
        sa.Column("campaign_id", ID, primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("run_id", ID, nullable=False),
        sa.Column("batch", sa.Integer, nullable=False),
        sa.Column("failed", sa.Integer, nullable=False),
        sa.Column("reason_code", sa.String(64)),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.create_table(
        "campaign_notifications",
        sa.Column("notification_id", ID, primary_key=True),
        sa.Column("campaign_id", ID, nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("recipient", sa.String(255)),
        sa.Column("payload", sa.JSON, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_at", sa.Float, nullable=False),
        sa.Column("delivered_at", sa.Float),
        sa.Column("last_error", sa.Text),
    )
    op.create_index("ix_campaign_notifications_due", "campaign_notifications", ["next_at"],
                    postgresql_where=sa.text("delivered_at IS NULL"),
                    sqlite_where=sa.text("delivered_at IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_campaign_notifications_due", "campaign_notifications")
    op.drop_table("campaign_notifications")
    op.drop_table("campaign_outcomes")
    op.drop_index("ix_campaign_targets_run", "campaign_targets")
    op.drop_index("ix_campaign_targets_state", "campaign_targets")
    op.drop_table("campaign_targets")
    op.drop_table("campaigns")
