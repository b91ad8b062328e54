"""The indexes migration 0015 changed, by their readers' plans and their entries.

``uq_tasks_tenant_idempotency_key_partial`` holds an entry per task with a key and none
for a task without one. Its readers must still find it: the submit's ``ON CONFLICT``
names it as its arbiter (the predicate is in the statement), and the lookup of a key
already taken (``submit_sql.EXISTING_RUN``) reads it, with a custom plan and with the generic
plan a prepared statement ends up with (``t.idempotency_key = $2`` implies the
predicate, whatever ``$2`` is). 20,000 tasks, one in ten with a key.

``ix_attempts_active_lease_worker`` is gone: the heartbeat, its one reader, names the
runs of the leases it extends and finds them by ``uq_attempts_one_active_lease``
(custom and generic plans), never by a scan of ``attempts``. 20,000 runs with an
ended attempt each, 2,000 of them with an ACTIVE one too, over 20 workers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, event, text

from runlane.store import submit_sql
from runlane.store.engine import build_engine
from runlane.store.records import Lease
from runlane.store.schema import IDEMPOTENCY_INDEX_NAME
from runlane.store.store import Store

N_TASKS = 20_000
KEYED_EVERY = 10

# The submit's conflict clause, as SUBMIT_WRITE_PG spells it.
ON_CONFLICT = re.search(r"ON CONFLICT \(tenant, idempotency_key\)[^\n]*DO NOTHING",
                        submit_sql.SUBMIT_WRITE_PG)


def _populate(conn: Connection) -> None:
    conn.execute(text(
        "WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM g WHERE n < :n) "
        "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
        " context, truncated_sections, payload_bytes, created_at, idempotency_key) "
        "SELECT 't' || n, 'tenant-' || (n % 50), '/srv/git/app.git', 'p', 'default', 100,"
        " 3, '{}', '[]', 2, n, CASE WHEN n % :every = 0 THEN 'key-' || n END FROM g"),
        {"n": N_TASKS, "every": KEYED_EVERY})
    conn.execute(text(
        "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,"
        " max_attempts, visible_at, created_at, updated_at) "
        "SELECT 'r' || substr(task_id, 2), task_id, tenant, repo, queue, priority,"
        " 'RUNNING', 3, created_at, created_at, created_at FROM tasks"))
    # Every run has an ended attempt (token 1); one in ten a live lease (token 2) of
    # worker w-(n % 20).
    conn.execute(text(
        "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,"
        " lease_status, lease_expires_at, heartbeat_at, started_at) "
        "SELECT run_id, 1, 1, 'w-' || (CAST(created_at AS INTEGER) % 20), 'FAILED',"
        " 'EXPIRED', 1, 1, 1"
        " FROM runs"))
    conn.execute(text(
        "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,"
        " lease_status, lease_expires_at, heartbeat_at, started_at) "
        "SELECT run_id, 2, 2, 'w-' || (CAST(created_at AS INTEGER) % 20), 'RUNNING',"
        " 'ACTIVE', 9e9, 1, 1"
        " FROM runs WHERE CAST(created_at AS INTEGER) % :every = 0"), {"every": KEYED_EVERY})
    conn.execute(text("UPDATE runs SET fencing_token = 2, attempt_count = 2"
                      " WHERE CAST(created_at AS INTEGER) % :every = 0"), {"every": KEYED_EVERY})


@pytest.fixture
def populated(db_url: str) -> Iterator[Engine]:
    engine = build_engine(db_url)
    with engine.begin() as conn:
        _populate(conn)
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()
    yield engine
    engine.dispose()


def _plan(engine: Engine, statement: str, params: dict[str, str],
          generic: bool = False) -> str:
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.execute(text("EXPLAIN QUERY PLAN " + statement), params).all()
            return "\n".join(str(r[-1]) for r in rows)
        with conn.begin():
            if generic:
                conn.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
                conn.exec_driver_sql(
                    "PREPARE probe(text, text) AS "
                    + statement.replace(":tenant", "$1").replace(":key", "$2"))
                try:
                    rows = conn.exec_driver_sql(
                        "EXPLAIN (COSTS OFF) EXECUTE probe('tenant-10', 'key-10')").all()
                finally:
                    conn.exec_driver_sql("DEALLOCATE probe")
            else:
                rows = conn.execute(text("EXPLAIN (COSTS OFF) " + statement), params).all()
        return "\n".join(str(r[0]) for r in rows)


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_a_key_taken_is_looked_up_through_the_partial_index(populated: Engine,
                                                            generic: bool) -> None:
    if generic and populated.dialect.name == "sqlite":
        pytest.skip("SQLite plans every statement for its values")
    plan = _plan(populated, submit_sql.EXISTING_RUN, {"tenant": "tenant-10", "key": "key-10"},
                 generic)
    assert IDEMPOTENCY_INDEX_NAME in plan, plan
    assert not re.search(r"Seq Scan on tasks|SCAN t\b", plan), plan


def test_the_submits_conflict_clause_picks_the_partial_index(populated: Engine) -> None:
    assert ON_CONFLICT is not None, "SUBMIT_WRITE_PG has no conflict clause on the key"
    if populated.dialect.name == "sqlite":
        pytest.skip("SQLite prints no arbiter; test_migrations' submit test covers it")
    with populated.connect() as conn, conn.begin():
        rows = conn.execute(text(
            "EXPLAIN (COSTS OFF) INSERT INTO tasks (task_id, tenant, repo, prompt, queue,"
            " priority, max_attempts, context, truncated_sections, payload_bytes,"
            " created_at, idempotency_key) VALUES ('x', 'tenant-10', 'r', 'p', 'default',"
            " 100, 3, '{}', '[]', 2, 1, 'key-10') " + ON_CONFLICT.group(0))).all()
    plan = "\n".join(str(r[0]) for r in rows)
    assert f"Conflict Arbiter Indexes: {IDEMPOTENCY_INDEX_NAME}" in plan, plan


def test_tasks_without_a_key_have_no_entry_in_the_index(populated: Engine) -> None:
    """The point of 0015: the index holds the keyed tasks only (PostgreSQL, counted by
    pgstattuple, which reads every entry of the index)."""
    if populated.dialect.name == "sqlite":
        pytest.skip("SQLite has no entry count; test_migrations checks the predicate")
    with populated.connect() as conn:
        available = conn.execute(text(
            "SELECT 1 FROM pg_available_extensions WHERE name = 'pgstattuple'")).first()
        if available is None:
            pytest.skip("pgstattuple is not installed on this server")
        conn.execute(text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))  # rolled back
        count = conn.execute(text(
            f"SELECT tuple_count FROM pgstattuple('{IDEMPOTENCY_INDEX_NAME}')")).scalar_one()
        conn.rollback()
    assert count == N_TASKS // KEYED_EVERY


def _heartbeat_statement(engine: Engine) -> tuple[str, Any]:
    """The SQL and parameters ``Store.heartbeat`` sends for 10 leases of worker w-0."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "UPDATE attempts" in statement:
            sent.append((statement, parameters))

    store = Store(str(engine.url.render_as_string(hide_password=False)))
    event.listen(store.engine, "before_cursor_execute", record)
    try:
        runs = [f"r{n}" for n in range(20 * KEYED_EVERY, 220 * KEYED_EVERY, 20 * KEYED_EVERY)]
        leases = [Lease(run_id=r, task_id="t" + r[1:], attempt_no=2, fencing_token=2,
                        worker_id="w-0", expires_at=9e9, tenant="tenant-0",
                        repo="/srv/git/app.git", queue="default", priority=100,
                        max_attempts=3) for r in runs]
        result = store.heartbeat("w-0", leases)
        assert set(result.extended) == set(runs)  # the statement is the real one
    finally:
        store.close()
    [(statement, parameters)] = sent
    return statement, parameters


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_a_heartbeat_finds_its_leases_by_their_runs(populated: Engine,
                                                    generic: bool) -> None:
    if generic and populated.dialect.name == "sqlite":
        pytest.skip("SQLite plans every statement for its values")
    statement, parameters = _heartbeat_statement(populated)
    with populated.connect() as conn:
        if populated.dialect.name == "sqlite":
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement,
                                        tuple(parameters)).all()
            plan = "\n".join(str(r[-1]) for r in rows)
            assert "SEARCH attempts USING INDEX uq_attempts_one_active_lease" in plan, plan
        else:
            with conn.begin():
                if generic:
                    names = re.findall(r"%\((\w+)\)s", statement)
                    numbered = statement
                    for k, name in enumerate(dict.fromkeys(names), 1):
                        numbered = numbered.replace(f"%({name})s", f"${k}")
                    conn.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
                    conn.exec_driver_sql("PREPARE beat AS " + numbered)
                    values = ", ".join(_literal(parameters[n]) for n in dict.fromkeys(names))
                    rows = conn.exec_driver_sql(
                        f"EXPLAIN (COSTS OFF) EXECUTE beat({values})").all()
                    conn.exec_driver_sql("DEALLOCATE beat")
                else:
                    rows = conn.exec_driver_sql("EXPLAIN (COSTS OFF) " + statement,
                                                parameters).all()
                conn.rollback()
            plan = "\n".join(str(r[0]) for r in rows)
            assert re.search(r"Index Scan using uq_attempts_one_active_lease on attempts",
                             plan), plan
        assert not re.search(r"Seq Scan on attempts|SCAN attempts\b", plan), plan
