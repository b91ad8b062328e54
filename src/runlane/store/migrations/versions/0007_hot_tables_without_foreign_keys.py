"""The hot tables lose their foreign keys: runs -> tasks, attempts and run_events -> runs.

Every claim inserts an attempt and an event per run, every completion an event per
hop, every submit a run per task: a foreign key re-checked each of those rows in a
trigger query (``SELECT 1 ... FOR KEY SHARE`` on the parent), 9% of PostgreSQL's time
in the peer drain, and the drain ran 20% faster without them (docs/benchmarks.md).
The store writes a child only in the statement or transaction that writes or
CAS-updates its parent, and retention deletes children first; ``runlane audit``
reports any orphan. The cold references (``side_effects``, ``task_dependencies``)
keep theirs.

SQLite cannot drop a constraint: the three tables are rebuilt (Alembic's batch mode,
with foreign key enforcement off for the migration, see ``migrate.upgrade``). Their
constraints are unnamed there, hence the naming convention that names them for the
drop.

Revision ID: 0007
"""

from alembic import op
from sqlalchemy import inspect

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# (child table, column, parent table): the parent's key column has the same name.
DROPPED = [("run_events", "run_id", "runs"), ("attempts", "run_id", "runs"),
           ("runs", "task_id", "tasks")]
# Names SQLite's unnamed foreign keys for batch mode (Alembic's documented recipe).
NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for table, column, parent in DROPPED:
            with op.batch_alter_table(table, recreate="always", naming_convention=NAMING) as b:
                b.drop_constraint(f"fk_{table}_{column}_{parent}", type_="foreignkey")
        # The rebuilt tables still satisfy the references that remain (side_effects).
        broken = bind.exec_driver_sql("PRAGMA foreign_key_check").all()
        if broken:
            raise RuntimeError(f"foreign keys broken by the table rebuilds: {broken[:5]}")
        return
    inspector = inspect(bind)
    for table, column, parent in DROPPED:
        for fk in inspector.get_foreign_keys(table):
            name = fk["name"]
            if name and fk["constrained_columns"] == [column] and fk["referred_table"] == parent:
                op.drop_constraint(name, table, type_="foreignkey")


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for table, column, parent in reversed(DROPPED):
        name = f"{table}_{column}_fkey"
        if sqlite:
            with op.batch_alter_table(table, recreate="always") as b:
                b.create_foreign_key(name, parent, [column], [column])
        else:
            op.create_foreign_key(name, table, parent, [column], [column])
