"""Migrations: repeatable, in step with ``schema.metadata``, and the online-index guard.

The guard (``runlane.store.online_index``, seed 003) decides how migration 0002
builds ``ix_runs_dispatch`` on PostgreSQL:

* empty ``runs`` table: inline ``CREATE INDEX`` (cheap, nothing to block);
* populated table: ``CREATE INDEX CONCURRENTLY`` outside the migration transaction,
  so writers are never held behind a SHARE lock for the whole build;
* an index already present under the name: kept only if its definition is exactly
  the expected one (however it was spelled), refused with the commands that fix it
  otherwise, and dropped and rebuilt concurrently if a build left it INVALID.

Each PostgreSQL case runs on its own fresh database, so the cases are independent
of each other and of the shared per-worker test database.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, event, inspect, text
from sqlalchemy.exc import IntegrityError
from structlog.testing import capture_logs

from runlane.store import migrate, schema
from runlane.store.engine import build_engine
from runlane.store.online_index import IndexDefinitionMismatch, Plan
from runlane.store.store import Store

from .conftest import RUN_TAG, _libpq

WORKER = RUN_TAG
HEAD = migrate.head_revision()
# The guard tests below exercise the online-index guard through migration 0002, whose
# index (ix_runs_dispatch) 0004 later replaced; they migrate up to 0002 only.
GUARDED = "0002"
INDEX = "ix_runs_dispatch"
GUARDED_COLUMNS = ("queue", "priority", "visible_at", "run_id")
GUARDED_WHERE = "status = 'QUEUED'"

# A plain (blocking) build of the dispatch index: CREATE [UNIQUE] INDEX [IF NOT EXISTS]
# ix_runs_dispatch, without CONCURRENTLY. ``\b`` keeps the guard's own scratch index
# (ix_runs_dispatch_probe, built on a temp table) out of the match.
INLINE_BUILD = re.compile(
    rf"^\s*CREATE\s+(UNIQUE\s+)?INDEX\s+(IF\s+NOT\s+EXISTS\s+)?{INDEX}\b", re.I)
CONCURRENT_BUILD = re.compile(rf"^\s*CREATE\s+(UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+{INDEX}\b", re.I)
WRITES = re.compile(r"^\s*(CREATE|ALTER|DROP|INSERT|UPDATE|DELETE|TRUNCATE)\b", re.I)

# The dispatch index as PostgreSQL prints it (pg_get_indexdef) when it is right.
EXPECTED_DEF = (f"CREATE INDEX {INDEX} ON public.runs USING btree "
                "(queue, priority, visible_at, run_id) WHERE ((status)::text = 'QUEUED'::text)")
# What production had pre-created from the earlier revision of the index (seed 003).
STALE_THREE_COLUMN = f"CREATE INDEX {INDEX} ON runs (queue, priority, visible_at)"


# --- helpers -----------------------------------------------------------------------



class Recorder:
    """Every SQL statement an engine sends, in order (``before_cursor_execute``)."""

    def __init__(self, engine: Engine) -> None:
        self.statements: list[str] = []
        event.listen(engine, "before_cursor_execute", self._record)

    def _record(self, _conn: Connection, _cursor: Any, statement: str, _parameters: Any,
                _context: Any, _executemany: bool) -> None:
        self.statements.append(statement)

    def clear(self) -> None:
        self.statements.clear()

    def matching(self, pattern: re.Pattern[str]) -> list[str]:
        return [s for s in self.statements if pattern.search(s)]


Migrated = tuple[tuple[str | None, str | None], list[str]]


def upgrade_logging_plans(engine: Engine, revision: str = "head") -> Migrated:
    """``migrate.upgrade`` plus the plans the guard logged (``index_migration`` events)."""
    with capture_logs() as logs:
        result = migrate.upgrade(engine, revision)
    return result, [str(e["plan"]) for e in logs if e.get("event") == "index_migration"]


def index_state(engine: Engine, name: str = INDEX) -> tuple[int, str, bool] | None:
    """(oid, pg_get_indexdef, indisvalid) of a PostgreSQL index, or None."""
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT i.indexrelid::bigint AS oid, pg_get_indexdef(i.indexrelid) AS indexdef, "
            "i.indisvalid AS valid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name"), {"name": name}).first()
    return None if row is None else (int(row.oid), str(row.indexdef), bool(row.valid))


def populate_pg(engine: Engine, n: int = 2000) -> None:
    """``n`` tasks and one QUEUED run each, set-based (two queues, three priorities)."""
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
            " context, truncated_sections, payload_bytes, created_at) "
            "SELECT 't' || g, 'acme', '/srv/git/app.git', 'p', "
            " CASE WHEN g % 2 = 0 THEN 'default' ELSE 'batch' END, g % 3, 3,"
            " '{}', '[]', 2, 1700000000 + g FROM generate_series(1, :n) g"), {"n": n})
        conn.execute(text(
            "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,"
            " max_attempts, visible_at, created_at, updated_at) "
            "SELECT 'r' || g, 't' || g, 'acme', '/srv/git/app.git',"
            " CASE WHEN g % 2 = 0 THEN 'default' ELSE 'batch' END, g % 3, 'QUEUED', 3,"
            " 1700000000 + g, 1700000000 + g, 1700000000 + g FROM generate_series(1, :n) g"),
            {"n": n})


def run_autocommit(url: str, *statements: str) -> None:
    """Run statements the way an operator would in psql: one by one, autocommit."""
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def reflect_schema(engine: Engine) -> dict[str, Any]:
    """Everything the inspector sees, normalized for comparing two databases."""
    insp = inspect(engine)
    result: dict[str, Any] = {}
    for table in sorted(insp.get_table_names()):
        if table == "alembic_version":
            continue
        result[table] = {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                for c in insp.get_columns(table)
            ],
            "pk": insp.get_pk_constraint(table)["constrained_columns"],
            "fks": sorted(
                (tuple(fk["constrained_columns"]), fk["referred_table"],
                 tuple(fk["referred_columns"]))
                for fk in insp.get_foreign_keys(table)
            ),
            "uniques": sorted(
                (u["name"], tuple(u["column_names"])) for u in insp.get_unique_constraints(table)
            ),
            "indexes": sorted(
                (ix["name"], bool(ix["unique"]), tuple(ix["column_names"]),
                 " ".join(str(ix.get("dialect_options", {}).get(
                     f"{engine.dialect.name}_where", "")).split()))
                for ix in insp.get_indexes(table)
            ),
        }
    return result


# --- fixtures ----------------------------------------------------------------------


@pytest.fixture
def make_engine() -> Iterator[Callable[[str], Engine]]:
    made: list[Engine] = []

    def make(url: str) -> Engine:
        engine = build_engine(url)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.dispose()


@pytest.fixture
def fresh_pg(make_engine: Callable[[str], Engine],
             pg_databases: Callable[[str], str]) -> Callable[[str], str]:
    """A factory of empty PostgreSQL databases, runlane_mig_<case>_<worker>, dropped
    after the test (FORCE closes the test's pooled connections first)."""
    return lambda case: pg_databases(f"runlane_mig_{case}_{WORKER}")


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path,
              fresh_pg: Callable[[str], str]) -> str:
    """An empty, never-migrated database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    return fresh_pg(request.node.originalname.removeprefix("test_")[:30])


# --- both engines ------------------------------------------------------------------


def test_upgrade_is_repeatable(fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(fresh_url)
    assert migrate.current_revision(engine) is None
    assert migrate.upgrade(engine) == (None, HEAD)
    before = reflect_schema(engine)

    recorder = Recorder(engine)
    assert migrate.upgrade(engine) == (HEAD, HEAD)
    assert recorder.statements, "the recorder saw nothing: the check below would be vacuous"
    assert recorder.matching(WRITES) == []
    assert migrate.current_revision(engine) == HEAD
    assert reflect_schema(engine) == before


def _insert_one_of_each(engine: Engine) -> None:
    """A task, its run, an attempt, an event and a side effect, all of run-1."""
    with engine.begin() as conn:
        _insert_task_and_run(conn, 1)
        _insert_attempt(conn, 1, 1, "ACTIVE")
        conn.execute(text("INSERT INTO run_events (run_id, at, actor, to_status) "
                          "VALUES ('run-1', 1, 'w1', 'RUNNING')"))
        conn.execute(text(
            "INSERT INTO side_effects (run_id, effect_key, status, attempt_no, fencing_token,"
            " created_at) VALUES ('run-1', 'branch', 'INTENT', 1, 1, 1)"))


def test_0007_drops_the_hot_foreign_keys_and_keeps_every_row(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """SQLite rebuilds runs, attempts and run_events to drop their foreign keys: every
    row survives, the cold reference (side_effects -> runs) stays enforced, and on
    SQLite enforcement is back on for the pooled connection after the migration."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, "0006")
    hot = {"runs": "tasks", "attempts": "runs", "run_events": "runs"}
    assert {t for t in hot if inspect(engine).get_foreign_keys(t)} == set(hot)
    _insert_one_of_each(engine)
    assert migrate.upgrade(engine) == ("0006", HEAD)
    insp = inspect(engine)
    assert {t: insp.get_foreign_keys(t) for t in hot} == {t: [] for t in hot}
    with engine.connect() as conn:
        counts = {t: conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar_one()
                  for t in ["tasks", *hot, "side_effects"]}
    assert counts == {"tasks": 1, "runs": 1, "attempts": 1, "run_events": 1,
                      "side_effects": 1}
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO side_effects (run_id, effect_key, status, attempt_no, fencing_token,"
            " created_at) VALUES ('no-such-run', 'branch', 'INTENT', 1, 1, 1)"))


def test_0007_downgrades_and_upgrades_again_with_rows(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """An operator's way back: the keys return (named as the upgrade looks for them on
    SQLite, where it failed to find them again), every row survives both ways, and a
    downgrade over an orphan refuses instead of restoring a key the rows break."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine)
    _insert_one_of_each(engine)
    assert migrate.downgrade(engine, "0006") == (HEAD, "0006")
    hot = ("runs", "attempts", "run_events")
    assert all(inspect(engine).get_foreign_keys(t) for t in hot)
    assert migrate.upgrade(engine) == ("0006", HEAD)
    assert not any(inspect(engine).get_foreign_keys(t) for t in hot)
    with engine.connect() as conn:
        assert [conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar_one()
                for t in ("tasks", *hot, "side_effects")] == [1, 1, 1, 1, 1]
    with engine.begin() as conn:  # an attempt whose run is gone: no key can come back
        _insert_attempt(conn, 2, 1, "EXPIRED")
    migrate.downgrade(engine, "0007")  # each revision is a transaction of its own
    with pytest.raises(Exception, match=r"foreign key|violates|FOREIGN KEY"):
        migrate.downgrade(engine, "0006")
    assert migrate.current_revision(engine) == "0007"



def test_0009_lets_a_policy_document_come_back_and_downgrades_while_none_did(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """Reverting to an earlier policy document makes a new version with an earlier
    version's digest: refused by 0004's unique digest (a UniqueViolation to the
    caller), allowed from 0009 on. Its downgrade restores the constraint while no
    document came back, and refuses once one did."""
    from runlane.domain.policy import parse_policy

    engine = make_engine(fresh_url)
    migrate.upgrade(engine)
    store = Store(fresh_url, engine=engine)
    first, second = (parse_policy(f"[concurrency]\nglobal_max_active = {n}\n")
                     for n in (5, 6))
    assert [store.apply_policy(p, source="t").version for p in (first, second)] == [1, 2]
    assert migrate.downgrade(engine, "0008") == (HEAD, "0008")
    with pytest.raises(IntegrityError):  # the revert, under 0004's unique digest
        store.apply_policy(first, source="revert")
    assert migrate.upgrade(engine) == ("0008", HEAD)
    assert store.apply_policy(first, source="revert").version == 3
    assert store.current_policy()[1] == first
    with pytest.raises(Exception, match="applied more than once"):
        migrate.downgrade(engine, "0008")
    assert migrate.current_revision(engine) == "0009"  # each revision its own transaction

def test_0010_stamps_policy_versions_and_downgrades_with_their_rows(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """0010 adds ``policy_versions.backlog_admitted_at`` (a scheduler's first pass skips
    a version whose backlog was admitted again); its downgrade keeps every version."""
    from runlane.domain.policy import parse_policy

    engine = make_engine(fresh_url)
    migrate.upgrade(engine)
    store = Store(fresh_url, engine=engine)
    store.apply_policy(parse_policy("[concurrency]\nglobal_max_active = 5\n"), source="t")
    store.schedule_pass(queued_under_older=True)  # an empty queue: admitted at once
    assert store.backlog_admitted(1)
    assert migrate.downgrade(engine, "0009") == (HEAD, "0009")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version FROM policy_versions")).scalars().all() == [1]
    assert migrate.upgrade(engine) == ("0009", HEAD)
    assert not store.backlog_admitted(1)  # not known: the next first pass reads the queue
    assert store.current_policy()[0] == 1


def test_0014_live_attempts_record_every_scope_of_their_run(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """An attempt claimed by an older runlane lists only the scopes limited at its
    claim; after the upgrade a live one lists every scope of its run (a limit applied
    later counts it), the scopes it listed kept; an ended one is left as it was."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, "0013")
    with engine.begin() as conn:
        for n in (1, 2):
            _insert_task_and_run(conn, n)
        _insert_attempt(conn, 1, 1, "ACTIVE")
        _insert_attempt(conn, 2, 1, "RELEASED")
        conn.execute(text("UPDATE attempts SET limit_scopes = :s"),
                     {"s": '["tenant:acme"]'})
    assert migrate.upgrade(engine) == ("0013", HEAD)
    with engine.connect() as conn:
        listed = {r.run_id: r.limit_scopes if isinstance(r.limit_scopes, list)
                  else json.loads(r.limit_scopes) for r in conn.execute(text(
                      "SELECT run_id, limit_scopes FROM attempts"))}
    assert listed == {
        "run-1": ["global", "queue:default", "repo:/srv/git/app.git", "risk:",
                  "tenant:acme"],
        "run-2": ["tenant:acme"]}


def _insert_keyed_task(conn: Connection, n: int, key: str | None) -> None:
    conn.execute(text(
        "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
        " context, truncated_sections, payload_bytes, created_at, idempotency_key) "
        "VALUES (:t, 'acme', '/srv/git/app.git', 'p', 'default', 2, 9, '{}', '[]', 2, 1,"
        " :k)"), {"t": f"keyed-{n}", "k": key})


def _idempotency_indexes(engine: Engine) -> dict[str, tuple[bool, str]]:
    """The unique indexes of ``tasks`` on (tenant, idempotency_key), constraints' too:
    name -> (unique, predicate as the engine prints it, '' when none)."""
    found = {}
    for ix in inspect(engine).get_indexes("tasks"):
        if ix["column_names"] == ["tenant", "idempotency_key"]:
            where = ix.get("dialect_options", {}).get(f"{engine.dialect.name}_where")
            found[str(ix["name"])] = (bool(ix["unique"]),
                                      "" if where is None else " ".join(str(where).split()))
    for uq in inspect(engine).get_unique_constraints("tasks"):
        if uq["column_names"] == ["tenant", "idempotency_key"]:
            found[str(uq["name"])] = (True, "")
    return found


def _has_worker_index(engine: Engine) -> bool:
    return any(ix["name"] == "ix_attempts_active_lease_worker"
               for ix in inspect(engine).get_indexes("attempts"))


def test_0015_the_idempotency_index_leaves_out_unkeyed_tasks_and_downgrades(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """The full unique constraint becomes a partial unique index (no entry for a task
    without a key), with every row kept; a key is unique before, after and on the way
    back, where the constraint returns under its name; tasks without a key never
    conflict. The index of a worker's leases goes, and comes back on the way back."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, "0014")
    with engine.begin() as conn:
        for n, key in enumerate(["k1", "k2", None, None]):
            _insert_keyed_task(conn, n, key)
    assert _idempotency_indexes(engine) == {"uq_tasks_tenant_idempotency_key": (True, "")}
    assert _has_worker_index(engine)
    assert migrate.upgrade(engine) == ("0014", HEAD)
    assert not _has_worker_index(engine)
    [(name, (unique, where))] = _idempotency_indexes(engine).items()
    assert (name, unique) == (schema.IDEMPOTENCY_INDEX_NAME, True)
    assert "idempotency_key IS NOT NULL" in where
    with engine.begin() as conn:
        _insert_keyed_task(conn, 4, None)  # another task without a key
    with pytest.raises(IntegrityError), engine.begin() as conn:
        _insert_keyed_task(conn, 5, "k1")
    assert migrate.downgrade(engine, "0014") == (HEAD, "0014")
    assert _idempotency_indexes(engine) == {"uq_tasks_tenant_idempotency_key": (True, "")}
    assert _has_worker_index(engine)
    with pytest.raises(IntegrityError), engine.begin() as conn:
        _insert_keyed_task(conn, 5, "k2")
    assert migrate.upgrade(engine) == ("0014", HEAD)
    assert list(_idempotency_indexes(engine)) == [schema.IDEMPOTENCY_INDEX_NAME]
    with engine.connect() as conn:
        keys = sorted(str(k) for k in conn.execute(text(
            "SELECT idempotency_key FROM tasks")).scalars())
    assert keys == ["None", "None", "None", "k1", "k2"]


def test_0015_submit_dedups_keyed_tasks_through_the_partial_index(
        db_url: str) -> None:
    """The submit's ON CONFLICT names the index's predicate (it matches no index
    otherwise, on either engine): a key taken returns the first run, within a batch and
    across batches; tasks without a key are all inserted."""
    store = Store(db_url)
    try:
        def spec(**extra: Any) -> Any:
            from runlane.domain.tasks import parse_task
            return parse_task({"tenant": "acme", "repo": "/srv/git/app.git",
                               "prompt": "p", **extra})
        first = store.submit([spec(idempotency_key="k"), spec(), spec()])
        again = store.submit([spec(idempotency_key="k"), spec(idempotency_key="k"),
                              spec()])
        assert [s.created for s in first] == [True, True, True]
        assert [s.created for s in again] == [False, False, True]
        assert again[0].run_id == again[1].run_id == first[0].run_id
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM tasks")).scalar_one() == 4
    finally:
        store.close()


# One repository, as an older runlane stored it: four spellings, one with credentials.
SPELLINGS = ("git@github.com:acme/app.git", "https://github.com/acme/app.git",
             "github.com/acme/app/", "https://x-access-token:ghp_SECRET@github.com/acme/app")
CANONICAL = "https://github.com/acme/app"


def _insert_spelled_run(conn: Connection, n: int, repo: str, status: str,
                        admission: dict[str, Any] | None = None) -> None:
    conn.execute(text(
        "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
        " context, truncated_sections, payload_bytes, created_at) "
        "VALUES (:t, 'acme', :repo, 'p', 'default', 2, 9, '{}', '[]', 2, 1)"),
        {"t": f"task-{n}", "repo": repo})
    conn.execute(text(
        "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,"
        " max_attempts, visible_at, created_at, updated_at, admission) "
        "VALUES (:r, :t, 'acme', :repo, 'default', 2, :status, 9, 1, 1, 1, :admission)"),
        {"r": f"run-{n}", "t": f"task-{n}", "repo": repo, "status": status,
         "admission": json.dumps(admission) if admission is not None else None})


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def test_0016_brings_runs_live_scopes_counters_and_blocks_to_the_canonical_form(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """Rows an older runlane wrote under four spellings of one repository: after the
    upgrade the runs name it once (the tasks keep what was written), the live attempts
    hold one scope, the two counters are one at the slots they hold, a lane asleep on a
    spelling's scope sleeps on the canonical one, and a new policy version makes the
    waiting runs' decisions be made again. A claim then sees the repository full."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, "0015")
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO policy_versions (version, digest, document, source, created_at) "
            "VALUES (1, 'd', :doc, 'policy.toml', 1)"),
            {"doc": json.dumps({"concurrency": {"per_repository_max_active": 1}})})
        for n, (repo, status) in enumerate(zip(SPELLINGS, ("RUNNING", "RUNNING", "QUEUED",
                                                           "SUCCEEDED"), strict=True), 1):
            _insert_spelled_run(conn, n, repo, status,
                                {"decision": "ADMIT", "concurrency": {f"repo:{repo}": 1,
                                                                      "global": 5}})
        for n in (1, 2):
            _insert_attempt(conn, n, 1, "ACTIVE")
            conn.execute(text("UPDATE attempts SET limit_scopes = :s WHERE run_id = :r"),
                         {"s": json.dumps(sorted(["global", f"repo:{SPELLINGS[n - 1]}",
                                                  "tenant:acme"])), "r": f"run-{n}"})
            conn.execute(text("INSERT INTO limit_counters (scope, active, max_active) "
                              "VALUES (:s, 1, 1)"), {"s": f"repo:{SPELLINGS[n - 1]}"})
        for repo in SPELLINGS[2:]:
            conn.execute(text("INSERT INTO lane_blocks (scope, lane_id) VALUES (:s, 7)"),
                         {"s": f"repo:{repo}"})
    assert migrate.upgrade(engine) == ("0015", HEAD)

    with engine.connect() as conn:
        repos = conn.execute(text(
            "SELECT r.run_id, r.repo, t.repo AS written, r.admission FROM runs r "
            "JOIN tasks t ON t.task_id = r.task_id ORDER BY r.run_id")).all()
        scopes = conn.execute(text(
            "SELECT limit_scopes FROM attempts ORDER BY run_id")).scalars().all()
        counters = conn.execute(text(
            "SELECT scope, active, max_active FROM limit_counters")).all()
        blocks = conn.execute(text("SELECT scope, lane_id FROM lane_blocks")).all()
        versions = conn.execute(text(
            "SELECT version, source, document FROM policy_versions ORDER BY version")).all()
    assert [r.repo for r in repos] == [CANONICAL] * 4
    assert [r.written for r in repos] == list(SPELLINGS)  # cloned as written
    assert [_json(r.admission)["concurrency"] for r in repos] == [
        {f"repo:{CANONICAL}": 1, "global": 5}] * 4
    assert [_json(s) for s in scopes] == [["global", f"repo:{CANONICAL}", "tenant:acme"]] * 2
    assert [tuple(c) for c in counters] == [(f"repo:{CANONICAL}", 2, 1)]
    assert [tuple(b) for b in blocks] == [(f"repo:{CANONICAL}", 7)]
    assert [v.version for v in versions] == [1, 2] and "0016" in versions[1].source
    assert _json(versions[1].document)["concurrency"]["per_repository_max_active"] == 1

    store = Store(fresh_url, engine=engine)
    assert [v for v in store.audit() if v.check == "slot_count_drift"] == []
    from runlane.domain.tasks import parse_task
    [sub] = store.submit([parse_task({"tenant": "acme", "repo": "acme/app", "prompt": "p"})])
    assert store.claim("w9") == []  # 2 live of 1 allowed: the fifth spelling waits
    with engine.connect() as conn:
        assert conn.execute(text("SELECT repo, status FROM runs WHERE run_id = :r"),
                            {"r": sub.run_id}).one() == (CANONICAL, "QUEUED")


def test_0016_a_run_queued_under_a_spelling_is_admitted_again_under_the_canonical_form(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """A run an older runlane admitted because the deny rule named its repository in
    another spelling is denied at its first claim after the upgrade: the upgrade stores
    the policy again (its patterns in the canonical form), so no claim trusts the
    decision recorded under the spelling (PostgreSQL's one-statement claim would)."""
    from runlane.domain.tasks import parse_task

    engine = make_engine(fresh_url)
    migrate.upgrade(engine, "0015")
    written = "https://github.com/acme/secret.git"
    # Today's store writes columns that came after 0015 (0019's request digest, 0022's
    # traceparent): give it them for the submit, then take them away, leaving the rows
    # 0015 knows.
    # And 0026's runs.provider, 0028's creation columns (and on SQLite its count of
    # positions, sqlite_sequence: made by any AUTOINCREMENT table).
    later = (("tasks", "request_digest"), ("tasks", "traceparent"), ("runs", "provider"),
             ("runs", "created_by"), ("runs", "created_tx"), ("runs", "created_seq"))
    with engine.begin() as conn:
        for table, column in later:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} VARCHAR(64)"))
        if engine.dialect.name == "sqlite":
            conn.execute(text("CREATE TABLE _count (id INTEGER PRIMARY KEY AUTOINCREMENT)"))
            conn.execute(text("DROP TABLE _count"))
    Store(fresh_url, engine=engine).submit(
        [parse_task({"tenant": "acme", "repo": written, "prompt": "p"})])
    with engine.begin() as conn:
        for table, column in later:
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
    rule = {"when": {"repo": ["git@github.com:acme/secret.git"]}, "action": "deny"}
    with engine.begin() as conn:  # as an older runlane left it: admitted under v1
        conn.execute(text(
            "INSERT INTO policy_versions (version, digest, document, source, created_at) "
            "VALUES (1, 'd', :doc, 'policy.toml', 1)"), {"doc": json.dumps({"rules": [rule]})})
        conn.execute(text("UPDATE runs SET repo = :w, policy_version = 1"), {"w": written})
    assert migrate.upgrade(engine) == ("0015", HEAD)
    store = Store(fresh_url, engine=engine)
    assert store.current_policy()[0] == 2
    assert store.claim("w1") == []
    [run] = store.list_runs()
    assert (run["repo"], run["status"]) == ("https://github.com/acme/secret", "POLICY_DENIED")
    assert "policy v2" in run["message"]


# The revision 0017 follows after 0016.
BEFORE_0017 = "0016"


def test_0017_attempts_keep_late_cost_and_downgrade_with_their_rows(
        fresh_url: str, make_engine: Callable[[str], Engine],
        tmp_path: Path, fresh_pg: Callable[[str], str]) -> None:
    """0017 adds ``attempts.late_cost_usd`` (0 for the attempts already there); its
    downgrade drops it, every row kept, and leaves the schema exactly as the revision
    before made it: on SQLite the table is rebuilt, and the partial indexes of ACTIVE
    leases (invariant 2, the reaper's scan) must come back with their predicates."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, BEFORE_0017)
    with engine.begin() as conn:
        _insert_task_and_run(conn, 1)
        _insert_attempt(conn, 1, 1, "ACTIVE")
    assert migrate.upgrade(engine) == (BEFORE_0017, HEAD)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT late_cost_usd FROM attempts")).scalar_one() == 0
        conn.execute(text("UPDATE attempts SET late_cost_usd = 1.5"))
    if engine.dialect.name == "sqlite":
        reference = make_engine(f"sqlite:///{tmp_path / 'before.db'}")
    else:
        reference = make_engine(fresh_pg("before_0017"))
    migrate.upgrade(reference, BEFORE_0017)
    assert migrate.downgrade(engine, BEFORE_0017) == (HEAD, BEFORE_0017)
    assert reflect_schema(engine) == reflect_schema(reference)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT run_id, lease_status FROM attempts")).one() == (
            "run-1", "ACTIVE")
    assert migrate.upgrade(engine) == (BEFORE_0017, HEAD)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT late_cost_usd FROM attempts")).scalar_one() == 0


BEFORE_0019 = "0018"


def test_0019_adds_tokens_digests_and_retry_links_and_downgrades_with_the_rows(
        fresh_url: str, make_engine: Callable[[str], Engine],
        tmp_path: Path, fresh_pg: Callable[[str], str]) -> None:
    """0019 adds ``api_tokens``, ``tasks.request_digest`` (NULL for the tasks already
    there: taken as matching) and ``runs.retry_of_run_id`` with its partial unique
    index; the downgrade leaves the schema exactly as 0018 made it, every row kept."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, BEFORE_0019)
    with engine.begin() as conn:
        _insert_task_and_run(conn, 1)
    assert migrate.upgrade(engine) == (BEFORE_0019, HEAD)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT t.request_digest, r.retry_of_run_id FROM tasks t "
                                 "JOIN runs r ON r.task_id = t.task_id")).one() == (None, None)
        assert conn.execute(text("SELECT COUNT(*) FROM api_tokens")).scalar_one() == 0
    if engine.dialect.name == "sqlite":
        reference = make_engine(f"sqlite:///{tmp_path / 'before.db'}")
    else:
        reference = make_engine(fresh_pg("before_0019"))
    migrate.upgrade(reference, BEFORE_0019)
    assert migrate.downgrade(engine, BEFORE_0019) == (HEAD, BEFORE_0019)
    assert reflect_schema(engine) == reflect_schema(reference)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM runs")).scalar_one() == 1
    assert migrate.upgrade(engine) == (BEFORE_0019, HEAD)


BEFORE_0022 = "0021"


def test_0022_keeps_a_tasks_trace_and_downgrades_with_the_rows(
        fresh_url: str, make_engine: Callable[[str], Engine],
        tmp_path: Path, fresh_pg: Callable[[str], str]) -> None:
    """0022 adds ``tasks.traceparent`` (NULL for the tasks already there: their attempts
    start traces of their own); the downgrade leaves the schema exactly as 0021 made
    it, every row kept."""
    engine = make_engine(fresh_url)
    migrate.upgrade(engine, BEFORE_0022)
    with engine.begin() as conn:
        _insert_task_and_run(conn, 1)
    assert migrate.upgrade(engine) == (BEFORE_0022, HEAD)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT traceparent FROM tasks")).scalar_one() is None
        conn.execute(text("UPDATE tasks SET traceparent = :t"),
                     {"t": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    if engine.dialect.name == "sqlite":
        reference = make_engine(f"sqlite:///{tmp_path / 'before.db'}")
    else:
        reference = make_engine(fresh_pg("before_0022"))
    migrate.upgrade(reference, BEFORE_0022)
    assert migrate.downgrade(engine, BEFORE_0022) == (HEAD, BEFORE_0022)
    assert reflect_schema(engine) == reflect_schema(reference)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM tasks")).scalar_one() == 1
    assert migrate.upgrade(engine) == (BEFORE_0022, HEAD)


def test_metadata_matches_migrations(fresh_url: str,
                                     make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(fresh_url)
    migrate.upgrade(engine)

    def include_name(name: str | None, type_: str, _parent: Any) -> bool:
        # Alembic's own bookkeeping table is not part of runlane's schema.
        return not (type_ == "table" and name == "alembic_version")

    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={
            "compare_type": True,
            "compare_server_default": True,
            "include_name": include_name,
        })
        diff = compare_metadata(context, schema.metadata)
    # No false positives needed filtering on either engine (JSON, Float/double
    # precision, the BigInteger/Integer variant and the server defaults all compare
    # equal), so the expectation is simply "no difference at all".
    assert diff == []


def test_migrated_schema_equals_create_all(fresh_url: str, tmp_path: Path,
                                           fresh_pg: Callable[[str], str],
                                           make_engine: Callable[[str], Engine]) -> None:
    """compare_metadata is blind to partial-index predicates (alembic does not compare
    ``postgresql_where`` / ``sqlite_where``: changing ix_runs_dispatch's WHERE in the
    metadata, or dropping it, still yields no diff). The partial indexes carry invariant 2
    and the dispatch scan, so compare the reflected catalog of a migrated database with
    that of a database made by ``metadata.create_all``: predicates included, as each
    engine itself prints them."""
    migrated = make_engine(fresh_url)
    migrate.upgrade(migrated)
    if migrated.dialect.name == "sqlite":
        reference = make_engine(f"sqlite:///{tmp_path / 'create_all.db'}")
    else:
        reference = make_engine(fresh_pg("create_all"))
    schema.metadata.create_all(reference)

    expected = reflect_schema(reference)
    assert reflect_schema(migrated) == expected
    # The comparison really covers the predicates (guards against a reflection that
    # silently stops reporting them, which would make the equality above vacuous).
    where = {ix[0]: ix[3] for ix in expected["runs"]["indexes"] + expected["attempts"]["indexes"]}
    assert "QUEUED" in where[schema.DISPATCH_INDEX_NAME]
    assert "ACTIVE" in where["uq_attempts_one_active_lease"]


def _insert_task_and_run(conn: Connection, n: int) -> None:
    conn.execute(text(
        "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
        " context, truncated_sections, payload_bytes, created_at) "
        "VALUES (:t, 'acme', '/srv/git/app.git', 'p', 'default', 2, 9, '{}', '[]', 2, 1)"),
        {"t": f"task-{n}"})
    conn.execute(text(
        "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,"
        " max_attempts, visible_at, created_at, updated_at) "
        "VALUES (:r, :t, 'acme', '/srv/git/app.git', 'default', 2, 'RUNNING', 9, 1, 1, 1)"),
        {"r": f"run-{n}", "t": f"task-{n}"})


def _insert_attempt(conn: Connection, run: int, attempt_no: int, lease_status: str) -> None:
    conn.execute(text(
        "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,"
        " lease_status, lease_expires_at, heartbeat_at, started_at) "
        "VALUES (:r, :a, :a, 'w1', 'RUNNING', :ls, 100, 1, 1)"),
        {"r": f"run-{run}", "a": attempt_no, "ls": lease_status})


def test_one_active_lease_per_run_is_enforced_by_the_database(db_url: str) -> None:
    engine = build_engine(db_url)
    try:
        index = {ix["name"]: ix for ix in inspect(engine).get_indexes("attempts")}[
            "uq_attempts_one_active_lease"]
        assert index["unique"] and index["column_names"] == ["run_id"]
        where = index["dialect_options"][f"{engine.dialect.name}_where"]
        assert "lease_status" in str(where) and "ACTIVE" in str(where)

        with engine.begin() as conn:
            _insert_task_and_run(conn, 1)
            _insert_task_and_run(conn, 2)
            # Many ended leases for one run are history, not a conflict.
            for attempt_no, status in enumerate(
                    ["EXPIRED", "RELEASED", "REVOKED", "EXPIRED", "RELEASED"], start=1):
                _insert_attempt(conn, 1, attempt_no, status)
            _insert_attempt(conn, 1, 6, "ACTIVE")
            _insert_attempt(conn, 2, 1, "ACTIVE")  # another run's active lease is fine
        with pytest.raises(IntegrityError, match=r"uq_attempts_one_active_lease|UNIQUE"), \
                engine.begin() as conn:
            _insert_attempt(conn, 1, 7, "ACTIVE")
        with engine.connect() as conn:
            active = conn.execute(text(
                "SELECT COUNT(*) FROM attempts WHERE run_id = 'run-1' AND lease_status = 'ACTIVE'"
            )).scalar_one()
            total = conn.execute(text(
                "SELECT COUNT(*) FROM attempts WHERE run_id = 'run-1'")).scalar_one()
        assert (active, total) == (1, 6)
    finally:
        engine.dispose()


# --- SQLite ------------------------------------------------------------------------


def test_sqlite_upgrade_creates_the_dispatch_index(
        tmp_path: Path, make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'runlane.db'}")
    _result, plans = upgrade_logging_plans(engine, GUARDED)
    assert plans == []  # the PostgreSQL guard is not involved on SQLite
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT tbl_name, sql FROM sqlite_master WHERE type = 'index' AND name = :n"),
            {"n": INDEX}).one()
        columns = [r.name for r in conn.execute(text(f"PRAGMA index_info({INDEX})"))]
        partial = {r.name: r.partial for r in conn.execute(text("PRAGMA index_list(runs)"))}
    assert row.tbl_name == "runs"
    assert columns == list(GUARDED_COLUMNS)
    assert partial[INDEX] == 1
    assert " ".join(row.sql.split()).endswith(f"WHERE {GUARDED_WHERE}")


def test_sqlite_stale_precreated_index_is_refused(
        tmp_path: Path, make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'runlane.db'}")
    migrate.upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE INDEX {INDEX} ON runs (queue, priority, visible_at)"))
    with pytest.raises(IndexDefinitionMismatch, match=f"DROP INDEX {INDEX}"):
        migrate.upgrade(engine, GUARDED)
    assert migrate.current_revision(engine) == "0001"
    with engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {INDEX}"))
        conn.execute(text(f"create index {INDEX} on runs(queue,priority, visible_at, run_id)"
                          f" where {GUARDED_WHERE}"))
    assert migrate.upgrade(engine, GUARDED)[1] == GUARDED  # same index, other spelling


# --- PostgreSQL: the online index guard ----------------------------------------------


def test_pg_empty_database_builds_the_index_inline(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(fresh_pg("empty"))
    recorder = Recorder(engine)
    result, plans = upgrade_logging_plans(engine, GUARDED)

    assert result == (None, GUARDED)
    assert plans == [Plan.CREATE_INLINE.value]
    assert len(recorder.matching(INLINE_BUILD)) == 1
    assert recorder.matching(re.compile("CONCURRENTLY", re.I)) == []
    state = index_state(engine)
    assert state is not None and state[2], f"{INDEX} missing or invalid: {state}"
    assert state[1] == EXPECTED_DEF


def test_pg_populated_database_builds_the_index_concurrently(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(fresh_pg("populated"))
    assert migrate.upgrade(engine, "0001") == (None, "0001")
    populate_pg(engine)

    recorder = Recorder(engine)
    result, plans = upgrade_logging_plans(engine, GUARDED)

    assert result == ("0001", GUARDED)
    assert plans == [Plan.CREATE_CONCURRENTLY.value]
    # Built concurrently (which PostgreSQL refuses inside a transaction block, so it
    # also ran outside the migration's transaction), and never inline.
    assert len(recorder.matching(CONCURRENT_BUILD)) == 1, recorder.statements
    assert recorder.matching(INLINE_BUILD) == [], recorder.statements
    state = index_state(engine)
    assert state is not None
    assert state[2], f"{INDEX} is INVALID after the concurrent build"
    assert state[1] == EXPECTED_DEF

    # Repeatable: the second run finds the index in place and writes nothing.
    recorder.clear()
    result, plans = upgrade_logging_plans(engine, GUARDED)
    assert result == (GUARDED, GUARDED) and plans == []
    assert recorder.matching(WRITES) == []


def test_pg_stale_precreated_index_is_refused_with_the_commands_that_fix_it(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    url = fresh_pg("stale")
    engine = make_engine(url)
    migrate.upgrade(engine, "0001")
    populate_pg(engine)
    with engine.begin() as conn:
        conn.execute(text(STALE_THREE_COLUMN))
    stale = index_state(engine)
    assert stale is not None

    with pytest.raises(IndexDefinitionMismatch) as refused:
        migrate.upgrade(engine, GUARDED)
    message = str(refused.value)
    assert f"DROP INDEX CONCURRENTLY {INDEX}" in message
    assert f"CREATE INDEX CONCURRENTLY {INDEX}" in message
    assert migrate.current_revision(engine) == "0001"
    assert index_state(engine) == stale, "the refused index must be left untouched"

    # Run exactly what the message says, as an operator would, then upgrade again.
    commands = [line.strip() for line in message.splitlines()
                if line.strip().startswith(("DROP INDEX CONCURRENTLY",
                                            "CREATE INDEX CONCURRENTLY"))]
    assert len(commands) == 2 and commands[0].startswith("DROP"), message
    run_autocommit(url, *commands)
    fixed = index_state(engine)
    assert fixed is not None and fixed[2] and fixed[1] == EXPECTED_DEF

    recorder = Recorder(engine)
    result, plans = upgrade_logging_plans(engine, GUARDED)
    assert result == ("0001", GUARDED)
    assert plans == [Plan.KEEP.value]
    assert recorder.matching(re.compile(rf"INDEX\s+(CONCURRENTLY\s+)?{INDEX}\b", re.I)) == []
    assert index_state(engine) == fixed


MISMATCHED = {
    "no_where": f"CREATE INDEX {INDEX} ON runs (queue, priority, visible_at, run_id)",
    "other_where": (f"CREATE INDEX {INDEX} ON runs (queue, priority, visible_at, run_id) "
                    "WHERE status = 'CLAIMED'"),
    "unique": (f"CREATE UNIQUE INDEX {INDEX} ON runs (queue, priority, visible_at, run_id) "
               "WHERE status = 'QUEUED'"),
    "column_order": (f"CREATE INDEX {INDEX} ON runs (queue, visible_at, priority, run_id) "
                     "WHERE status = 'QUEUED'"),
    "descending": (f"CREATE INDEX {INDEX} ON runs (queue, priority DESC, visible_at, run_id) "
                   "WHERE status = 'QUEUED'"),
    "other_table": f"CREATE INDEX {INDEX} ON tasks (queue, priority, created_at, task_id)",
    "hash": f"CREATE INDEX {INDEX} ON runs USING hash (queue) WHERE status = 'QUEUED'",
}


def test_pg_every_other_mismatched_definition_is_refused(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    engine = make_engine(fresh_pg("mismatch"))
    migrate.upgrade(engine, "0001")
    for case, ddl in MISMATCHED.items():
        with engine.begin() as conn:
            conn.execute(text(ddl))
        found = index_state(engine)
        with pytest.raises(IndexDefinitionMismatch, match=f"DROP INDEX CONCURRENTLY {INDEX}"):
            migrate.upgrade(engine, GUARDED)
        assert migrate.current_revision(engine) == "0001", case
        assert index_state(engine) == found, case
        with engine.begin() as conn:
            conn.execute(text(f"DROP INDEX {INDEX}"))


def test_pg_matching_precreated_index_is_kept(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    """Pre-created by hand (concurrently, on a populated table), spelled differently:
    upper case, schema-qualified, explicit btree, quoted column, no spaces, parentheses."""
    url = fresh_pg("keep")
    engine = make_engine(url)
    migrate.upgrade(engine, "0001")
    populate_pg(engine)
    run_autocommit(url, 'create index concurrently IX_RUNS_DISPATCH on public.runs using btree'
                        '  ("queue",priority,   visible_at,run_id)  where (status=\'QUEUED\')')
    kept = index_state(engine)
    assert kept is not None and kept[2] and kept[1] == EXPECTED_DEF

    recorder = Recorder(engine)
    result, plans = upgrade_logging_plans(engine, GUARDED)
    assert result == ("0001", GUARDED)
    assert plans == [Plan.KEEP.value]
    assert recorder.matching(re.compile(rf"INDEX\s+(CONCURRENTLY\s+)?{INDEX}\b", re.I)) == []
    assert index_state(engine) == kept  # same oid: neither dropped nor rebuilt


def test_pg_invalid_index_from_an_interrupted_build_is_rebuilt(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    """A concurrent build that fails half-way leaves an INVALID index behind. Make a real
    one: a writer's open transaction makes CREATE INDEX CONCURRENTLY wait for it, and
    lock_timeout cancels that wait after the catalog entry was committed."""
    url = fresh_pg("invalid")
    engine = make_engine(url)
    migrate.upgrade(engine, "0001")
    populate_pg(engine)
    with engine.connect() as writer:
        writer.execute(text("UPDATE runs SET updated_at = updated_at + 1 WHERE run_id = 'r1'"))
        with pytest.raises(psycopg.errors.LockNotAvailable):
            run_autocommit(url, "SET lock_timeout = '300ms'",
                           f"CREATE INDEX CONCURRENTLY {INDEX} ON runs "
                           "(queue, priority, visible_at, run_id) WHERE status = 'QUEUED'")
        writer.rollback()
    invalid = index_state(engine)
    assert invalid is not None and not invalid[2], "setup: expected an INVALID index"

    recorder = Recorder(engine)
    result, plans = upgrade_logging_plans(engine, GUARDED)
    assert result == ("0001", GUARDED)
    assert plans == [Plan.REBUILD_INVALID.value]
    rebuilt = index_state(engine)
    assert rebuilt is not None
    assert rebuilt[2], "still INVALID after the rebuild"
    assert rebuilt[0] != invalid[0], "the invalid index was kept instead of rebuilt"
    assert rebuilt[1] == invalid[1] == EXPECTED_DEF
    ddl = recorder.matching(re.compile(rf"INDEX\s+(CONCURRENTLY\s+)?(IF\s+EXISTS\s+)?{INDEX}\b",
                                       re.I))
    assert [" ".join(s.split()[:3]) for s in ddl] == [
        "DROP INDEX CONCURRENTLY", "CREATE INDEX CONCURRENTLY"], ddl


# --- 0004: the lane dispatch index replaces ix_runs_dispatch on a live queue ---------


def test_pg_0004_moves_a_populated_queue_into_lanes_online(
        fresh_pg: Callable[[str], str], make_engine: Callable[[str], Engine]) -> None:
    url = fresh_pg("lanes")
    engine = make_engine(url)
    migrate.upgrade(engine, "0003")
    populate_pg(engine, 600)
    recorder = Recorder(engine)
    result, plans = upgrade_logging_plans(engine)

    assert result == ("0003", HEAD)
    lane_index = schema.DISPATCH_INDEX_NAME
    assert recorder.matching(re.compile(
        rf"^\s*CREATE\s+INDEX\s+CONCURRENTLY\s+{lane_index}\b", re.I)), plans
    assert recorder.matching(re.compile(r"DROP\s+INDEX\s+CONCURRENTLY\s+IF\s+EXISTS\s+"
                                        r"ix_runs_dispatch\b", re.I))
    assert index_state(engine, "ix_runs_dispatch") is None
    state = index_state(engine, lane_index)
    assert state is not None and state[2]
    with engine.connect() as conn:
        lanes = conn.execute(text("SELECT queue, priority, queued_count FROM lanes "
                                  "ORDER BY queue, priority")).all()
        orphans = conn.execute(text("SELECT COUNT(*) FROM runs WHERE lane_id IS NULL")).scalar()
    # populate_pg: two queues x three priorities, one tenant, every run QUEUED.
    assert len(lanes) == 6 and sum(lane.queued_count for lane in lanes) == 600
    assert orphans == 0
    store = Store(url, engine=engine)
    leases = store.claim("w1", "default", limit=5, lease_ttl=30)
    assert [lease.priority for lease in leases] == [0] * 5  # the lanes serve at once
    assert store.audit() == []


def test_the_revisions_read_without_alembic_are_alembics() -> None:
    """The schema check reads the migration files itself (no Alembic import at each
    command's start): what it reads must be what Alembic walks."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate._config())
    assert migrate._revisions() == {r.revision: r.down_revision
                                    for r in script.walk_revisions()}
    assert migrate.head_revision() == script.get_current_head()


def test_the_version_read_without_alembic_is_alembics(fresh_url: str,
                                                      make_engine: Callable[[str], Engine]
                                                      ) -> None:
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(fresh_url)
    assert migrate.current_revision(engine) is None  # no alembic_version table yet
    migrate.upgrade(engine, "0005")
    with engine.connect() as conn:
        assert migrate.current_revision(engine) == \
            MigrationContext.configure(conn).get_current_revision() == "0005"


def test_a_heartbeat_changes_no_indexed_column(fresh_url: str,
                                               make_engine: Callable[[str], Engine]) -> None:
    """What lets a beat be a HOT update on PostgreSQL (no index entry per lease per beat,
    bench/heartbeat.py): no index of ``attempts`` has a column the heartbeat writes, in
    its keys or in its predicate. The columns are read off the statement itself."""
    from runlane.store import lease_sql

    assignments = re.search(r"\bSET\b(.*?)\bWHERE\b", lease_sql.HEARTBEAT, re.S)
    assert assignments is not None
    written = set(re.findall(r"(\w+)\s*=", assignments.group(1)))
    assert written == {"lease_expires_at", "heartbeat_at"}
    engine = make_engine(fresh_url)
    migrate.upgrade(engine)
    indexes = inspect(engine).get_indexes("attempts")
    assert indexes, "attempts has its partial unique index at least"
    for index in indexes:
        predicate = " ".join(str(v) for k, v in index.get("dialect_options", {}).items()
                             if k.endswith("_where"))
        touched = written & (set(index["column_names"]) | set(re.findall(r"\w+", predicate)))
        assert not touched, f"{index['name']} indexes {sorted(touched)}, which a beat writes"


def test_0028_keeps_old_events_and_positions_after_them(
        fresh_url: str, make_engine: Callable[[str], Engine]) -> None:
    """A database populated before 0028 (a run and its claim event, as the old code
    wrote them): after the upgrade its history shows each transition once, positions
    taken from then on come after every old event id (a cursor handed out before still
    means "after that event"), and a stream read from such a cursor gives only what
    came after."""
    from runlane.domain.tasks import parse_task
    from runlane.store import history
    from runlane.store.events import events_after, parse_cursor

    engine = make_engine(fresh_url)
    migrate.upgrade(engine, "0027")
    with engine.begin() as conn:
        _insert_task_and_run(conn, 1)
        _insert_attempt(conn, 1, 1, "ACTIVE")
        for to_status, from_status in (("QUEUED", None), ("CLAIMED", "QUEUED"),
                                       ("RUNNING", "CLAIMED")):
            conn.execute(text(
                "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, "
                "to_status) VALUES ('run-1', 1, 1, 'w1', :f, :t)"),
                {"f": from_status, "t": to_status})
        old_last = conn.execute(text("SELECT MAX(event_id) FROM run_events")).scalar_one()
    assert migrate.upgrade(engine) == ("0027", HEAD)
    with engine.connect() as conn:
        shown = [(r.from_status, r.to_status) for r in conn.execute(
            text(history.RUN_HISTORY), {"run_id": "run-1"})]
    assert shown == [(None, "QUEUED"), ("QUEUED", "CLAIMED"), ("CLAIMED", "RUNNING")]
    store = Store(fresh_url, engine=engine)
    [sub] = store.submit([parse_task({"tenant": "acme", "repo": "/srv/git/app.git",
                                      "prompt": "p"})])
    cursor = parse_cursor(str(old_last))
    assert cursor is not None
    rows, _ = events_after(engine, cursor, tenant=None, limit=10)
    if engine.dialect.name == "sqlite":  # PostgreSQL's old cursor is "tx-id": not this
        assert [(r["run_id"], r["to_status"]) for r in rows] == [(sub.run_id, "QUEUED")]
        assert rows[0]["event_id"] > old_last
    with engine.connect() as conn:
        created = conn.execute(text("SELECT created_seq FROM runs WHERE run_id = :r"),
                               {"r": sub.run_id}).scalar_one()
    assert created > old_last
