"""The scheduler: policy versions, admission records, lanes, limit counters, routes,
dependencies, budgets; the lane dispatch index replaces ``ix_runs_dispatch``.

On a populated PostgreSQL database the two indexes are built ``CONCURRENTLY``
(online_index), which commits what this revision did so far while alembic_version
still says 0003. Every step therefore skips what is already there, so a run of it
that was interrupted (a killed deploy, a build that failed) is finished by running
`runlane db upgrade` again.

Revision ID: 0004
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# Frozen here, as every migration's definitions are (schema.py may move on).
DISPATCH_INDEX_NAME = "ix_runs_lane_dispatch"
LANE_DISPATCH = IndexSpec(DISPATCH_INDEX_NAME, "runs", ("lane_id", "created_at", "run_id"),
                          "status = 'QUEUED'")
WAITING_WHERE = "status IN ('ADMITTED', 'WAITING_CAPACITY')"
WAITING = IndexSpec("ix_runs_waiting", "runs", ("status", "created_at", "run_id"),
                    WAITING_WHERE)
PICK_WHERE = "queued_count > 0 AND tenant_at_limit = 0"


def _has_column(table: str, column: str) -> bool:
    return any(c["name"] == column for c in sa.inspect(op.get_bind()).get_columns(table))


def _has_table(table: str) -> bool:
    return sa.inspect(op.get_bind()).has_table(table)


def _has_index(table: str, name: str) -> bool:
    return any(i["name"] == name for i in sa.inspect(op.get_bind()).get_indexes(table))


def _add_column(table: str, column: sa.Column) -> None:  # type: ignore[type-arg]
    if not _has_column(table, column.name):
        op.add_column(table, column)


def _create_table(name: str, *columns: Any) -> None:
    if not _has_table(name):
        op.create_table(name, *columns)


def _create_index(name: str, table: str, columns: list[str], where: str | None = None) -> None:
    if _has_index(table, name):
        return
    extra: dict[str, Any] = {} if where is None else {"postgresql_where": sa.text(where),
                                      "sqlite_where": sa.text(where)}
    op.create_index(name, table, columns, **extra)


def upgrade() -> None:
    for column in (
        sa.Column("user_id", sa.String(128)),
        sa.Column("requires", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("parent_task_id", sa.String(36)),
        sa.Column("estimated_cost_usd", sa.Float),
    ):
        _add_column("tasks", column)
    for column in (
        sa.Column("user_id", sa.String(128)),
        sa.Column("risk_class", sa.String(64), nullable=False, server_default=sa.text("''")),
        sa.Column("route_key", sa.Text, nullable=False, server_default=sa.text("''")),
        sa.Column("lane_id", sa.Integer),
        sa.Column("policy_version", sa.Integer, nullable=False, server_default="0"),
        sa.Column("admission", sa.JSON),
        sa.Column("limits", sa.JSON),
        sa.Column("estimated_cost_usd", sa.Float),
    ):
        _add_column("runs", column)
    _add_column("attempts", sa.Column("estimated_cost_usd", sa.Float))
    _add_column("attempts", sa.Column("limit_scopes", sa.JSON))
    ensure_index(op, WAITING)
    _create_table(
        "task_dependencies",
        sa.Column("task_id", sa.String(36), sa.ForeignKey("tasks.task_id"), primary_key=True),
        sa.Column("depends_on", sa.String(36), sa.ForeignKey("tasks.task_id"),
                  primary_key=True),
    )
    _create_index("ix_task_dependencies_depends_on", "task_dependencies", ["depends_on"])
    _create_table(
        "lanes",
        sa.Column("lane_id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("queue", sa.String(128), nullable=False),
        sa.Column("route_key", sa.Text, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("weight", sa.Float, nullable=False, server_default="1"),
        sa.Column("queued_count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("pass", sa.Float, nullable=False, server_default="0"),
        sa.Column("tenant_at_limit", sa.Integer, nullable=False, server_default="0"),
        sa.UniqueConstraint("queue", "route_key", "priority", "tenant", name="uq_lanes_key"),
    )
    _create_index("ix_lanes_tenant", "lanes", ["tenant"])
    _create_index("ix_lanes_pick", "lanes", ["queue", "priority", "pass", "lane_id"],
                  PICK_WHERE)
    _create_table(
        "limit_counters",
        sa.Column("scope", sa.String(400), primary_key=True),
        sa.Column("active", sa.Integer, nullable=False, server_default="0"),
        sa.Column("max_active", sa.Integer, nullable=False),
    )
    _create_index("ix_limit_counters_full", "limit_counters", ["scope"],
                  "active >= max_active")
    _create_table(
        "routes",
        sa.Column("route_key", sa.Text, primary_key=True),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    _create_table(
        "policy_versions",
        sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("document", sa.JSON, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    _create_table(
        "tenant_spend",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("usd", sa.Float, nullable=False, server_default="0"),
    )
    # Existing runs: one lane per (queue, priority, tenant), no requirements. Only
    # the runs without a lane yet, and only lanes not there yet: the backfill commits
    # with the tables (when the next index build starts), all or nothing, but a run
    # again must not count a queued run twice.
    op.execute("INSERT INTO routes (route_key, created_at) SELECT '', 0 "
               "WHERE NOT EXISTS (SELECT 1 FROM routes WHERE route_key = '')")
    op.execute(
        "INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass, "
        "tenant_at_limit) SELECT queue, '', priority, tenant, 1, "
        "SUM(CASE WHEN status = 'QUEUED' THEN 1 ELSE 0 END), 0, 0 "
        "FROM runs WHERE lane_id IS NULL AND NOT EXISTS (SELECT 1 FROM lanes l "
        "WHERE l.queue = runs.queue AND l.route_key = '' AND l.priority = runs.priority "
        "AND l.tenant = runs.tenant) GROUP BY queue, priority, tenant"
    )
    op.execute(
        "UPDATE runs SET lane_id = (SELECT l.lane_id FROM lanes l WHERE l.queue = runs.queue "
        "AND l.route_key = '' AND l.priority = runs.priority AND l.tenant = runs.tenant) "
        "WHERE lane_id IS NULL"
    )
    ensure_index(op, LANE_DISPATCH)
    drop_index(op, "ix_runs_dispatch")


def downgrade() -> None:
    op.create_index("ix_runs_dispatch", "runs", ["queue", "priority", "visible_at", "run_id"],
                    postgresql_where=sa.text("status = 'QUEUED'"),
                    sqlite_where=sa.text("status = 'QUEUED'"))
    op.drop_index(DISPATCH_INDEX_NAME, table_name="runs")
    for table in ("tenant_spend", "policy_versions", "routes", "limit_counters", "lanes",
                  "task_dependencies"):
        op.drop_table(table)
    op.drop_index("ix_runs_waiting", table_name="runs")
    op.drop_column("attempts", "estimated_cost_usd")
    op.drop_column("attempts", "limit_scopes")
    for column in ("user_id", "risk_class", "route_key", "lane_id", "policy_version",
                   "admission", "limits", "estimated_cost_usd"):
        op.drop_column("runs", column)
    for column in ("user_id", "requires", "parent_task_id", "estimated_cost_usd"):
        op.drop_column("tasks", column)
