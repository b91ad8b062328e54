"""Index migrations that never hold a long SHARE lock on a populated table (seed 003).

On PostgreSQL an index is built inline only while its table is empty; on a
populated table it is built ``CONCURRENTLY`` outside the migration's
transaction. An index that already exists under the name is accepted only if
its definition is exactly the expected one (a stale pre-created index is
refused, with the commands that fix it); a build that failed half-way (an
INVALID index) is dropped and rebuilt concurrently, unless another session is
building it right now (an operator's own ``CREATE INDEX CONCURRENTLY``, or a runlane
too old to take the migration lock): then the migration waits for that build and
keeps what it made. SQLite has no concurrent
build and no concurrent readers to starve: the index is simply created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog
from sqlalchemy import Connection, text

log = structlog.get_logger("runlane.migrations")


class IndexDefinitionMismatch(RuntimeError):
    pass


class Plan(StrEnum):
    CREATE_INLINE = "create_inline"
    CREATE_CONCURRENTLY = "create_concurrently"
    REBUILD_INVALID = "rebuild_invalid"
    KEEP = "keep"


@dataclass(frozen=True)
class IndexSpec:
    name: str
    table: str
    columns: tuple[str, ...]
    where: str | None = None
    unique: bool = False

    def create_sql(self, concurrently: bool = False, table: str | None = None) -> str:
        return (
            f"CREATE {'UNIQUE ' if self.unique else ''}INDEX "
            f"{'CONCURRENTLY ' if concurrently else ''}{self.name} "
            f"ON {table or self.table} ({', '.join(self.columns)})"
            + (f" WHERE {self.where}" if self.where else "")
        )


def _definition(conn: Connection, name: str) -> tuple[str, bool] | None:
    row = conn.execute(
        text(
            "SELECT pg_get_indexdef(i.indexrelid) AS indexdef, i.indisvalid AS valid "
            "FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name AND pg_table_is_visible(c.oid)"
        ),
        {"name": name},
    ).first()
    return None if row is None else (str(row.indexdef), bool(row.valid))


def _canonical(conn: Connection, spec: IndexSpec) -> str:
    """The definition PostgreSQL itself prints for ``spec``, from a scratch copy of the
    table, so the comparison is exact and independent of how the SQL was spelled."""
    probe = f"_runlane_probe_{spec.table}"
    conn.execute(text(f"CREATE TEMP TABLE {probe} (LIKE {spec.table})"))
    try:
        temp = IndexSpec(f"{spec.name}_probe", spec.table, spec.columns, spec.where, spec.unique)
        conn.execute(text(temp.create_sql(table=probe)))
        found = _definition(conn, temp.name)
        assert found is not None
        return _normalize(found[0], temp.name, probe)
    finally:
        conn.execute(text(f"DROP TABLE {probe}"))


def _normalize(definition: str, name: str, table: str) -> str:
    return (definition.replace(f"INDEX {name} ", "INDEX <name> ")
            .replace(f" ON pg_temp.{table} ", " ON <table> ")
            .replace(f" ON {table} ", " ON <table> ")
            .replace(f" ON public.{table} ", " ON <table> "))


def plan_index(conn: Connection, spec: IndexSpec) -> Plan:
    found = _definition(conn, spec.name)
    if found is not None:
        definition, valid = found
        expected = _canonical(conn, spec)
        actual = _normalize(definition, spec.name, spec.table)
        if actual != expected:
            raise IndexDefinitionMismatch(
                f"index {spec.name} exists with a different definition:\n"
                f"  found:    {definition}\n"
                f"  expected: {spec.create_sql()}\n"
                f"Replace it without blocking writes, then run `runlane db upgrade` again:\n"
                f"  DROP INDEX CONCURRENTLY {spec.name};\n"
                f"  {spec.create_sql(concurrently=True)};"
            )
        return Plan.KEEP if valid else Plan.REBUILD_INVALID
    populated = conn.execute(text(f"SELECT EXISTS (SELECT 1 FROM {spec.table})")).scalar()
    return Plan.CREATE_CONCURRENTLY if populated else Plan.CREATE_INLINE


def ensure_index(op: Any, spec: IndexSpec) -> Plan:
    conn: Connection = op.get_bind()
    if conn.dialect.name != "postgresql":
        return _ensure_sqlite_index(conn, spec)
    plan = plan_index(conn, spec)
    log.info("index_migration", index=spec.name, plan=plan.value)
    if plan is Plan.CREATE_INLINE:
        op.execute(spec.create_sql())
    elif plan in (Plan.CREATE_CONCURRENTLY, Plan.REBUILD_INVALID):
        with op.get_context().autocommit_block():
            if plan is Plan.REBUILD_INVALID:
                # Outside the migration's transaction: a concurrent build waits for
                # older transactions, so waiting for it inside one could wait forever.
                plan = _await_other_build(op.get_bind(), spec)
            if plan is Plan.REBUILD_INVALID:
                op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {spec.name}")
            if plan is not Plan.KEEP:
                op.execute(spec.create_sql(concurrently=True))
    return plan


# How often a migration looks again at another session's index build it waits for.
BUILD_POLL_SECONDS = 1.0


def _builder(conn: Connection, name: str) -> int | None:
    """The pid of another session building index ``name`` in this database now, if any.

    An INVALID index is also what a concurrent build in progress looks like; dropping
    it would make that build fail (or deadlock with it)."""
    pid = conn.execute(
        text("SELECT p.pid FROM pg_stat_progress_create_index p "
             "JOIN pg_class c ON c.oid = p.index_relid "
             "WHERE c.relname = :name AND pg_table_is_visible(c.oid) "
             "AND p.datid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
             "AND p.pid <> pg_backend_pid() LIMIT 1"),
        {"name": name},
    ).scalar()
    return None if pid is None else int(pid)


def _await_other_build(conn: Connection, spec: IndexSpec) -> Plan:
    """Wait while another session builds ``spec``'s INVALID index, then plan again: KEEP
    if its build succeeded, CREATE_CONCURRENTLY if it dropped it, REBUILD_INVALID if it
    failed (or if nobody was building it: an interrupted build)."""
    waited_since: float | None = None
    while (pid := _builder(conn, spec.name)) is not None:
        if waited_since is None or time.monotonic() - waited_since >= 60:
            log.warning("index_build_in_progress", index=spec.name, pid=pid,
                        message="another session is building this index; waiting for it")
            waited_since = time.monotonic()
        time.sleep(BUILD_POLL_SECONDS)
    if waited_since is None:
        return Plan.REBUILD_INVALID
    plan = plan_index(conn, spec)
    log.info("index_migration", index=spec.name, plan=plan.value, after_waiting=True)
    return plan if plan in (Plan.KEEP, Plan.REBUILD_INVALID) else Plan.CREATE_CONCURRENTLY


def _squash(sql: str) -> str:
    return " ".join(sql.replace("(", " ( ").replace(")", " ) ").replace(",", " , ")
                    .lower().split())


def _ensure_sqlite_index(conn: Connection, spec: IndexSpec) -> Plan:
    """SQLite: create the index, or keep one whose stored SQL is the expected one."""
    found = conn.execute(text("SELECT sql FROM sqlite_master WHERE type = 'index' "
                              "AND name = :name"), {"name": spec.name}).scalar()
    if found is None:
        conn.execute(text(spec.create_sql()))
        return Plan.CREATE_INLINE
    if _squash(str(found)) != _squash(spec.create_sql()):
        raise IndexDefinitionMismatch(
            f"index {spec.name} exists with a different definition:\n"
            f"  found:    {found}\n  expected: {spec.create_sql()}\n"
            f"Replace it, then run `runlane db upgrade` again:\n"
            f"  DROP INDEX {spec.name};\n  {spec.create_sql()};"
        )
    return Plan.KEEP


def drop_index(op: Any, name: str) -> None:
    """Drop an index without blocking writers: ``CONCURRENTLY`` on PostgreSQL."""
    conn: Connection = op.get_bind()
    if conn.dialect.name != "postgresql":
        conn.execute(text(f"DROP INDEX IF EXISTS {name}"))
        return
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
