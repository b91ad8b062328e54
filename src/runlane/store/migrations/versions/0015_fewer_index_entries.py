"""Fewer index entries per run: an idempotency index without unkeyed tasks, and no
index of a worker's leases.

1. ``uq_tasks_tenant_idempotency_key`` (a unique constraint since 0001) held an entry
   for every task, keyed or not, though NULL keys never conflict: each unkeyed task
   wrote an entry nothing reads. It is replaced by the partial unique index
   ``uq_tasks_tenant_idempotency_key_partial (tenant, idempotency_key) WHERE
   idempotency_key IS NOT NULL``: one task per (tenant, key) as before, no entry for a
   task without one. The submit's ``ON CONFLICT`` names the predicate (both engines);
   the lookup of a key already taken (``t.idempotency_key = :key``) implies it, so it
   still reads the index.
2. ``ix_attempts_active_lease_worker (worker_id) WHERE lease_status = 'ACTIVE'`` had one
   reader, the heartbeat, which also names the runs of the leases it extends: it finds
   them by ``uq_attempts_one_active_lease`` (run_id, same predicate). A heartbeat
   updates ``lease_expires_at``, an indexed column, so each beat of each lease wrote an
   entry into every index whose predicate an ACTIVE lease meets, this one included; so
   did each claim's attempt.

PostgreSQL: the new unique index is built first (``CONCURRENTLY`` on a populated
table, online_index), so a key is unique at every moment; then the constraint is
dropped (a catalog change: a brief ACCESS EXCLUSIVE lock on ``tasks``, no scan), and
the worker index with ``DROP INDEX CONCURRENTLY``. A runlane older than this revision
cannot submit afterwards: its ``ON CONFLICT (tenant, idempotency_key)`` names no
predicate, and no unique index without one is left to match it. SQLite cannot drop a
constraint: ``tasks`` is rebuilt (batch mode, foreign key enforcement off for the
migration, as in 0007).

Revision ID: 0015
"""

from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

CONSTRAINT = "uq_tasks_tenant_idempotency_key"
KEYED = IndexSpec("uq_tasks_tenant_idempotency_key_partial", "tasks",
                  ("tenant", "idempotency_key"), "idempotency_key IS NOT NULL", unique=True)
FULL = IndexSpec(CONSTRAINT, "tasks", ("tenant", "idempotency_key"), unique=True)
WORKER = IndexSpec("ix_attempts_active_lease_worker", "attempts", ("worker_id",),
                   "lease_status = 'ACTIVE'")


def _check_sqlite_keys() -> None:
    broken = op.get_bind().exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        raise RuntimeError("rows break a foreign key (before this migration, or by its "
                           f"table rebuild): {broken[:5]} (table, rowid, parent, key)")


def upgrade() -> None:
    ensure_index(op, KEYED)
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("tasks", recreate="always") as batch:
            batch.drop_constraint(CONSTRAINT, type_="unique")
        _check_sqlite_keys()
    else:
        op.execute(f"ALTER TABLE tasks DROP CONSTRAINT IF EXISTS {CONSTRAINT}")
    drop_index(op, WORKER.name)


def downgrade() -> None:
    ensure_index(op, WORKER)
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("tasks", recreate="always") as batch:
            batch.create_unique_constraint(CONSTRAINT, ["tenant", "idempotency_key"])
        _check_sqlite_keys()
    else:
        # The index first (online), then the constraint takes it over (no second build).
        ensure_index(op, FULL)
        op.execute(f"ALTER TABLE tasks ADD CONSTRAINT {CONSTRAINT} UNIQUE USING INDEX "
                   f"{CONSTRAINT}")
    drop_index(op, KEYED.name)
