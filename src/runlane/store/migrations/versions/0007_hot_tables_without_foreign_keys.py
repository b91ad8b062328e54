"""The hot tables lose their foreign keys: runs -> tasks, attempts and run_events -> runs.

Every claim inserts an attempt and an event per run, every completion an event per
hop, every submit a run per task: a foreign key re-checked each of those rows in a
trigger query (``SELECT 1 ... FOR KEY SHARE`` on the parent), 9% of PostgreSQL's time
in the peer drain; without them the drain ran 8% faster and the batch submit 20%
(docs/benchmarks.md).
The store writes a child only in the statement or transaction that writes or
CAS-updates its parent, and retention deletes children first; ``runlane audit``
reports any orphan. The cold references (``side_effects``, ``task_dependencies``)
keep theirs.

SQLite cannot drop a constraint: the three tables are rebuilt (Alembic's batch mode,
with foreign key enforcement off for the migration, see ``migrate._migrating``). Their
constraints are unnamed there, hence the naming convention that names them for the
drop; the downgrade gives them those names, so that an upgrade after it finds them.

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


def _sqlite_name(table: str, column: str, parent: str) -> str:
    return NAMING["fk"] % {"table_name": table, "column_0_name": column,
                           "referred_table_name": parent}


def _check_sqlite_keys() -> None:
    """SQLite's procedure for a table rebuild: before committing, every foreign key
    left must hold (enforcement is off while the tables are rebuilt)."""
    broken = op.get_bind().exec_driver_sql("PRAGMA foreign_key_check").all()
    if broken:
        raise RuntimeError("rows break a foreign key (before this migration, or by its "
                           f"table rebuilds): {broken[:5]} (table, rowid, parent, key)")


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        for table, column, parent in DROPPED:
            with op.batch_alter_table(table, recreate="always", naming_convention=NAMING) as b:
                b.drop_constraint(_sqlite_name(table, column, parent), type_="foreignkey")
        _check_sqlite_keys()
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
        if sqlite:
            with op.batch_alter_table(table, recreate="always") as b:
                b.create_foreign_key(_sqlite_name(table, column, parent), parent,
                                     [column], [column])
        else:
            op.create_foreign_key(f"{table}_{column}_fkey", table, parent, [column], [column])
    if sqlite:
        _check_sqlite_keys()
