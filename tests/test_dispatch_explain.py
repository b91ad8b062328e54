"""Query-plan evidence for the claim path on a million queued runs (PostgreSQL).

A claim is a few short statements (``claim_sql.py``): PICK_LANES, LANE_RUNS (every
chosen lane at once, with FULL_SCOPES as a CTE), ENSURE_COUNTER (for scopes new to
the process) / LOCK_SCOPES, CLAIM_WRITE_PG; submit adds LANE_VIRTUAL_TIME. Each must
use its index, sort nothing and read rows bounded by the batch (plus the unrunnable
rows planted ahead in the lane it walks), never in proportion to the queue, the
tenants or the repositories. EXPLAIN (ANALYZE, BUFFERS) runs in transactions that are
rolled back; ``Store.claim`` runs end to end inside a rolled-back transaction too.
LANE_RUNS does not filter on tasks: a run of a cancelled task is a candidate (flagged
by one key lookup per returned run), which the claim then prunes (the run ends
CANCELLED), so a claim may return fewer runs than its limit.

Tests marked ``xfail(strict=True)`` pin scans that DO grow with the data today (their
reasons say what); a fix turns them into XPASS, which fails until the mark goes.

The data set (one database, built once for the module, set-based):

* 1,000,000 QUEUED runs with tasks: 1,000 tenants (``tenant-0000``..), 10,000
  repositories (each a tenant's), 5,000 users, queues ``default``/``batch``,
  priorities 50/100/150, ~6,600 lanes built by GROUP BY, ``runs.lane_id`` set;
* 16,001 ``limit_counters`` (global, every tenant, repository and user), of which the
  50 tenants ``tenant-0900..0949`` and 20 repositories are full; the full tenants'
  lanes have ``tenant_at_limit = 1`` and the lowest pass;
* at the head of the fair order in (default, priority 50): tenant-0001's lane starts
  with runs of cancelled tasks, tenant-0002's with runs in backoff for an hour,
  tenant-0003's with runs of a full repository, tenant-0004's lane is all of a full
  repository; then the lanes of runs that require a GPU (stale: nobody served them);
* tenant-0998 has one big lane of 50,000 runs in (batch, priority 50).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import psycopg
import pytest
from psycopg.sql import Literal
from sqlalchemy import Connection, Engine, TextClause, create_engine, text
from sqlalchemy.engine import make_url

from runlane.domain.fairness import LaneState, flows_of, share_bounds
from runlane.domain.policy import policy_from_document
from runlane.domain.reasons import Reason
from runlane.domain.routing import canonical_requirements, parse_requirements
from runlane.store import claim_sql, dialect_sql, lanes_sql, migrate, policy_sql, slots_sql
from runlane.store.engine import PLANNER_OPTIONS, build_engine, normalize_url
from runlane.store.records import Lease
from runlane.store.schema import DISPATCH_INDEX_NAME
from runlane.store.store import Store

from .conftest import ADMIN_URL, RUN_TAG, create_pg_database

pytestmark = [pytest.mark.xdist_group("explain"), pytest.mark.slow]

N_RUNS = 1_000_000
N_TENANTS = 1_000
N_REPOS = 10_000
N_USERS = 5_000
BIG_LANE = 50_000  # the newest runs: tenant-0998's one lane in (batch, 50)
BEST = 50  # the best of the three priorities
CANCELLED_HEAD, BACKOFF_HEAD, FULL_REPO_HEAD = 20, 50, 40
FULL_TENANTS = [f"tenant-{i:04d}" for i in range(900, 950)]
FULL_REPOS = ["acme/repo-00003", "acme/repo-00004",
              *(f"acme/repo-{i:05d}" for i in range(5000, 5018))]
TENANT_MAX, REPO_MAX, USER_MAX, GLOBAL_MAX = 5, 2, 5, 100_000
GPU = {"gpu": "a100"}
GPU_ROUTE = canonical_requirements(parse_requirements(GPU))
ALL_ROUTES, PLAIN_ROUTES = sorted(["", GPU_ROUTE]), [""]
LANE_PAGE = 16  # scheduling.LANE_PAGE
PG = dialect_sql.Statements("postgresql")
BIG_TABLES = ("runs", "tasks", "lanes", "limit_counters")

# One row per g: run r<g> of task t<g>. ``:t`` is the database clock at population.
SOURCE = f"""
SELECT '10000000-0000-7000-8000-' || lpad(g::text, 12, '0') AS run_id,
       '00000000-0000-7000-8000-' || lpad(g::text, 12, '0') AS task_id,
       'tenant-' || lpad(tn::text, 4, '0') AS tenant,
       'acme/repo-' || lpad(rn::text, 5, '0') AS repo,
       'dev-' || (g % {N_USERS}) AS user_id,
       queue, priority, route_key,
       CASE WHEN tn % 5 = 0 THEN 2.0 WHEN tn % 7 = 3 THEN 0.5 ELSE 1.0 END AS weight,
       created_at,
       CASE WHEN backoff THEN :t + 3600 ELSE created_at END AS visible_at,
       CASE WHEN cancelled THEN :t - 60 END AS cancel_requested_at
FROM (
  SELECT g,
         CASE WHEN big THEN 998 ELSE g % {N_TENANTS} END AS tn,
         CASE WHEN big THEN 998 + 1000 * (g % 10)
              -- tenant-000N's (default, 50) lane is g % 6000 = N
              WHEN g % 6000 = 4 OR (g % 6000 = 3 AND g < 6000 * {FULL_REPO_HEAD}) THEN g % 6000
              ELSE g % {N_REPOS} END AS rn,
         CASE WHEN big OR (g / 1000) % 2 = 1 THEN 'batch' ELSE 'default' END AS queue,
         CASE WHEN big THEN {BEST} ELSE (ARRAY[50, 100, 150])[1 + (g / 2000) % 3] END
           AS priority,
         CASE WHEN NOT big AND g % 10 = 7 AND (g / 6000) % 4 = 0 THEN :gpu ELSE '' END
           AS route_key,
         g % 6000 = 1 AND g < 6000 * {CANCELLED_HEAD} AS cancelled,
         g % 6000 = 2 AND g < 6000 * {BACKOFF_HEAD} AS backoff,
         :t - 100000 + g * 0.05 AS created_at
  FROM (SELECT g, g > {N_RUNS - BIG_LANE} AS big FROM generate_series(1, {N_RUNS}) g) s0
) s
"""
INSERT_TASKS = f"""
INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts, context,
                   truncated_sections, payload_bytes, cancel_requested_at, created_at,
                   user_id, requires)
SELECT task_id, tenant, repo, 'fix the flaky test', queue, priority, 3,
       '{{"ticket": "APP-1"}}', '[]', 40, cancel_requested_at, created_at, user_id, route_key
FROM ({SOURCE}) s
"""
FULL_TENANT_SQL = "tenant BETWEEN 'tenant-0900' AND 'tenant-0949'"
INSERT_LANES = f"""
INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                   tenant_at_limit)
SELECT queue, route_key, priority, tenant, weight, COUNT(*),
       CASE WHEN {FULL_TENANT_SQL} THEN 0.0
            WHEN queue = 'default' AND priority = {BEST} AND route_key = ''
                 AND tenant BETWEEN 'tenant-0001' AND 'tenant-0004'
              THEN right(tenant, 1)::int / 10.0
            WHEN queue = 'default' AND priority = {BEST} AND route_key <> ''
              THEN 0.5 + right(tenant, 3)::int / 10000.0
            ELSE 1 + mod(abs(hashtext(queue || route_key || priority || tenant)), 1000) / 100.0
       END,
       CASE WHEN {FULL_TENANT_SQL} THEN 1 ELSE 0 END
FROM ({SOURCE}) s
GROUP BY queue, route_key, priority, tenant, weight
"""
INSERT_RUNS = f"""
INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, attempt_count,
                  max_attempts, fencing_token, visible_at, created_at, updated_at, cost_usd,
                  user_id, risk_class, route_key, lane_id, policy_version, limits)
SELECT s.run_id, s.task_id, s.tenant, s.repo, s.queue, s.priority, 'QUEUED', 0, 3, 0,
       s.visible_at, s.created_at, s.created_at, 0, s.user_id, 'low', s.route_key,
       l.lane_id, 1, '{{"max_cost_usd": 5.0}}'
FROM ({SOURCE}) s
JOIN lanes l ON l.queue = s.queue AND l.route_key = s.route_key
            AND l.priority = s.priority AND l.tenant = s.tenant
"""
INSERT_COUNTERS = f"""
INSERT INTO limit_counters (scope, active, max_active)
SELECT 'global', 0, {GLOBAL_MAX}
UNION ALL
SELECT 'tenant:tenant-' || lpad(i::text, 4, '0'),
       CASE WHEN i BETWEEN 900 AND 949 THEN {TENANT_MAX} ELSE i % 3 END, {TENANT_MAX}
FROM generate_series(0, {N_TENANTS - 1}) i
UNION ALL
SELECT 'repo:acme/repo-' || lpad(i::text, 5, '0'),
       CASE WHEN i IN (3, 4) OR i BETWEEN 5000 AND 5017 THEN {REPO_MAX} ELSE i % 2 END,
       {REPO_MAX}
FROM generate_series(0, {N_REPOS - 1}) i
UNION ALL
SELECT 'user:dev-' || i, i % 3, {USER_MAX} FROM generate_series(0, {N_USERS - 1}) i
"""
# Secondary indexes of runs and tasks are dropped while the rows go in and rebuilt
# after from their own definitions (a sort each, not a million inserts each).
SECONDARY_INDEXES = """
SELECT i.indexname, i.indexdef FROM pg_indexes i
WHERE i.tablename IN ('runs', 'tasks')
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
"""


def policy_doc() -> dict[str, Any]:
    weights = {f"tenant-{i:04d}": {"weight": 2.0 if i % 5 == 0 else 0.5}
               for i in range(N_TENANTS) if i % 5 == 0 or i % 7 == 3}
    return {"concurrency": {"global_max_active": GLOBAL_MAX,
                            "per_tenant_max_active": TENANT_MAX,
                            "per_repository_max_active": REPO_MAX,
                            "per_user_max_active": USER_MAX},
            "tenants": weights}


@dataclass(frozen=True)
class ExplainDb:
    url: str
    engine: Engine  # no prepared statements: every EXPLAIN is planned for its values
    lanes: dict[str, int]  # planted and sample lanes by name
    seconds: dict[str, float]


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _lane(conn: Connection, tenant: str, queue: str = "default", route: str = "") -> int:
    return int(conn.execute(text(
        "SELECT lane_id FROM lanes WHERE tenant = :t AND queue = :q AND priority = :p "
        "AND route_key = :r"), {"t": tenant, "q": queue, "p": BEST, "r": route}).scalar_one())


@pytest.fixture(scope="module")
def explain_db() -> Iterator[ExplainDb]:
    name = f"runlane_explain_{RUN_TAG}"
    url = create_pg_database(name)
    engine = create_engine(normalize_url(url), connect_args={"prepare_threshold": None,
                                                             "options": PLANNER_OPTIONS})
    seconds: dict[str, float] = {}
    try:
        started = time.monotonic()
        migrate.upgrade(engine)
        with engine.begin() as conn:
            indexes = conn.execute(text(SECONDARY_INDEXES)).all()
            for index in indexes:
                conn.execute(text(f'DROP INDEX "{index.indexname}"'))
            # Rows built consistent by construction: skip the per-row FK triggers.
            conn.execute(text("SET LOCAL session_replication_role = replica"))
            conn.execute(text("SET LOCAL maintenance_work_mem = '256MB'"))
            params = {"t": conn.execute(text(
                "SELECT EXTRACT(EPOCH FROM now())::double precision")).scalar(), "gpu": GPU_ROUTE}
            for statement in (INSERT_TASKS, INSERT_LANES, INSERT_RUNS):
                conn.execute(text(statement), params)
            conn.execute(text(INSERT_COUNTERS))
            conn.execute(text("INSERT INTO routes (route_key, created_at) VALUES (:gpu, :t)"),
                         params)
            seconds["insert"] = time.monotonic() - started
            for index in indexes:
                conn.execute(text(index.indexdef))
        seconds["index"] = time.monotonic() - started - seconds["insert"]
        # Policy v1 (the runs say so); also recomputes every lane's tenant_at_limit.
        Store(url, engine=engine).apply_policy(policy_from_document(policy_doc()),
                                               source="test_dispatch_explain")
        with psycopg.connect(_libpq(url), autocommit=True) as admin:
            admin.execute("VACUUM ANALYZE")
        seconds["total"] = time.monotonic() - started
        with engine.connect() as conn:
            lanes = {name: _lane(conn, tenant, queue) for name, tenant, queue in [
                ("cancelled", "tenant-0001", "default"), ("backoff", "tenant-0002", "default"),
                ("full_repo", "tenant-0003", "default"), ("blocked", "tenant-0004", "default"),
                ("plain", "tenant-0010", "default"), ("big", "tenant-0998", "batch")]}
        print(f"\npopulated {N_RUNS:,} runs: " + ", ".join(
            f"{k} {v:.1f}s" for k, v in seconds.items()))
        yield ExplainDb(url, engine, lanes, seconds)
    finally:
        engine.dispose()
        with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- plan helpers ------------------------------------------------------------------


def bind(statement: str, params: dict[str, Any]) -> tuple[TextClause, dict[str, Any]]:
    """A named statement (``*_sql``) rendered as the store renders it (its ``IN :name`` lists
    expanding) and the parameters it takes (the helpers below pass a superset)."""
    names = set(re.findall(r"(?<![:\w]):(\w+)", PG.render(statement).text))
    expanding = re.findall(r"\bIN\s+:(\w+)", statement)
    return PG.render(statement, *expanding), {k: v for k, v in params.items() if k in names}


def run(conn: Connection, statement: str, params: dict[str, Any]) -> list[Any]:
    clause, bound = bind(statement, params)
    return list(conn.execute(clause, bound))


def explain(conn: Connection, statement: str, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) one named statement (it really runs, so the
    caller rolls back)."""
    clause, bound = bind(statement, params)
    query = text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + clause.text)
    query = query.bindparams(*(p for p in clause._bindparams.values() if p.expanding))
    plan: dict[str, Any] = conn.execute(query, bound).scalar_one()[0]
    return plan


def explain_generic(conn: Connection, statement: str, params: dict[str, Any]
                    ) -> dict[str, Any]:
    """The same, as the generic plan a server-side prepared statement may settle on:
    the exact text psycopg sends (IN lists expanded), PREPAREd, EXECUTEd with
    ``plan_cache_mode = force_generic_plan``."""
    clause, bound = bind(statement, params)
    compiled = clause.bindparams(**bound).compile(
        dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    values: list[Any] = []

    def placeholder(match: re.Match[str]) -> str:
        values.append(compiled.params[match.group(1)])
        return f"${len(values)}"

    body = re.sub(r"%\((\w+)\)s", placeholder, compiled.string).replace("%%", "%")
    raw = cast(psycopg.Connection[Any], conn.connection.driver_connection)
    literals = ", ".join(Literal(v).as_string(raw) for v in values)
    conn.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
    with raw.cursor() as cursor:  # psycopg directly: no parameters, no % escaping
        cursor.execute(f"PREPARE claim_probe AS {body}".encode())
        try:
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim_probe"
                           f"({literals})".encode())
            row = cursor.fetchone()
        finally:
            cursor.execute(b"DEALLOCATE claim_probe")
    assert row is not None
    plan: dict[str, Any] = row[0][0]
    return plan


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node, sub-plans and init-plans included."""
    stack = [plan["Plan"]]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.get("Plans", []))


def describe(plan: dict[str, Any]) -> str:
    def line(node: dict[str, Any], depth: int) -> list[str]:
        keys = ("Relation Name", "Index Name", "Actual Rows", "Actual Loops",
                "Rows Removed by Filter", "Shared Hit Blocks", "Shared Read Blocks")
        extra = ", ".join(f"{k}={node[k]}" for k in keys if k in node)
        out = [f"{'  ' * depth}{node['Node Type']} ({extra})"]
        for child in node.get("Plans", []):
            out += line(child, depth + 1)
        return out

    return "\n".join(line(plan["Plan"], 0))


def rows_read(node: dict[str, Any]) -> int:
    """Rows (or index entries) a scan node produced, counting those a Filter or an
    index recheck then dropped; EXPLAIN reports them per loop."""
    per_loop = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
                + node.get("Rows Removed by Index Recheck", 0))
    return int(per_loop * node["Actual Loops"])


SCANS = ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan")


def reads(plan: dict[str, Any]) -> dict[str, int]:
    """Rows read per table, over every scan node of the plan."""
    out: dict[str, int] = {}
    for node in nodes(plan):
        if node["Node Type"] in SCANS:
            out[node["Relation Name"]] = out.get(node["Relation Name"], 0) + rows_read(node)
    return out


def assert_bounded(plan: dict[str, Any], *, index: str, table: str, bound: int,
                   ordered: bool = True, sorted_rows: int = 0) -> None:
    """The claim-path contract: ``table`` is read through ``index``, no large table is
    scanned in full, and at most ``bound`` rows are read from ``table`` (and from
    ``tasks``, re-read once per candidate). An ``ordered`` statement (ORDER BY, LIMIT,
    MIN) must walk the index in order: an Index (Only) Scan, no bitmap, and no Sort
    but of at most ``sorted_rows`` rows (merging walks that each came out in order)."""
    shown = describe(plan)
    kinds = ("Index Scan", "Index Only Scan") + (() if ordered else ("Bitmap Index Scan",))
    used = [n for n in nodes(plan) if n.get("Index Name") == index and n["Node Type"] in kinds]
    assert used, f"no {'ordered ' if ordered else ''}scan of {index}:\n{shown}"
    seq = [n["Relation Name"] for n in nodes(plan)
           if n["Node Type"] == "Seq Scan" and n["Relation Name"] in BIG_TABLES]
    assert not seq, f"sequential scan of {seq}:\n{shown}"
    if ordered:
        sorts = [(n["Node Type"], sum(rows_read(c) for c in n.get("Plans", [])))
                 for n in nodes(plan) if "Sort" in n["Node Type"]]
        assert all(rows <= sorted_rows for _, rows in sorts), \
            f"the plan sorts ({sorts}, at most {sorted_rows} rows) instead of walking " \
            f"{index}:\n{shown}"
        bitmap = [n["Relation Name"] for n in nodes(plan)
                  if n["Node Type"] == "Bitmap Heap Scan"]
        assert not bitmap, f"bitmap scan of {bitmap} (every match, unordered):\n{shown}"
    read = reads(plan)
    assert read.get(table, 0) <= bound, f"read {read} rows, bound {bound} on {table}:\n{shown}"
    assert read.get("tasks", 0) <= bound, f"read {read} rows, bound {bound} on tasks:\n{shown}"


def assert_counter_probes(plan: dict[str, Any], scopes: int, *, per_scope: int = 1) -> None:
    """The counters are read through the primary key only, ``per_scope`` times
    (CLAIM_WRITE_PG: locked, then updated): one probe per scope (LOCK_SCOPES' LATERAL)
    or one index scan of all the scopes (``scope = ANY(...)``), never more rows than
    the scopes asked for: however many counters there are, no scan of
    ``limit_counters``. A Sort is allowed only over the parameters (LOCK_SCOPES sorts
    the scopes it is given), never over a table's rows."""
    shown = describe(plan)
    scans = [n for n in nodes(plan)
             if n["Node Type"] in SCANS and n["Relation Name"] == "limit_counters"]
    assert scans, shown
    assert all((n["Node Type"], n.get("Index Name")) == ("Index Scan", "limit_counters_pkey")
               for n in scans), shown
    read = sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"]
               for n in scans)
    assert read <= per_scope * scopes, f"{read} counters read for {scopes} scopes:\n{shown}"
    assert reads(plan)["limit_counters"] <= per_scope * scopes, shown
    for sort in (n for n in nodes(plan) if "Sort" in n["Node Type"]):
        below = [n["Relation Name"] for n in nodes({"Plan": sort}) if n["Node Type"] in SCANS]
        assert not below, f"the plan sorts rows of {below}:\n{shown}"


def full_scopes(conn: Connection) -> dict[str, list[str]]:
    full = conn.execute(text(
        "SELECT scope FROM limit_counters WHERE active >= max_active")).scalars().all()
    return {kind: sorted(s.removeprefix(f"{kind}:") for s in full if s.startswith(f"{kind}:"))
            for kind in ("tenant", "repo", "user", "risk")}


def pick_params(conn: Connection, queue: str, routes: list[str], limit: int,
                after: tuple[int, float, int] = (-(2**31), float("-inf"), -1)
                ) -> dict[str, Any]:
    return {"queue": queue, "routes": routes, "full_tenants": full_scopes(conn)["tenant"],
            "limit": limit, "after_priority": after[0], "after_pass": after[1],
            "after_lane": after[2], "now": None}


def candidate_params(conn: Connection, lane_id: int, limit: int) -> dict[str, Any]:
    """LANE_RUNS of one lane (the full scopes are its CTE: nothing to pass)."""
    return {"lane_ids": [lane_id], "shares": [limit], "now": None,
            "after_created": [float("-inf")], "after_ids": [""]}


PICK_LANES = claim_sql.PICK_LANES["postgresql"]
ROUTE_PICK = "ix_lanes_route_pick"
LANE_RUNS = claim_sql.LANE_RUNS["postgresql"]
LOCK_SCOPES = slots_sql.LOCK_SCOPES["postgresql"]


LANE_ORDER = """
SELECT r.run_id,
       r.visible_at <= EXTRACT(EPOCH FROM clock_timestamp())
         AND (t.cancel_requested_at IS NULL OR :cancelled_ok)
         AND r.repo <> ALL(:full_repos)
         AND COALESCE(r.user_id, '') <> ALL(:full_users) AS runnable
FROM runs r JOIN tasks t ON t.task_id = r.task_id
WHERE r.lane_id = :lane AND (r.status = 'QUEUED' OR r.run_id = ANY(:also))
ORDER BY r.created_at, r.run_id
LIMIT :n
"""


def lane_order(conn: Connection, lane_id: int, n: int = 100_000, also: list[str] | None = None,
               full: dict[str, list[str]] | None = None, *, candidates: bool = False
               ) -> list[tuple[str, bool]]:
    """A lane's queued runs (and ``also``) in claim order, each with whether it could
    run with the scopes in ``full`` (default: full now): the oracle, written apart from
    the claim's own SQL (a join, no keyset, no locks). With ``candidates``, as
    LANE_RUNS sees the lane: it does not filter on tasks, so a run of a cancelled task
    counts (the claim then prunes it)."""
    full = full if full is not None else full_scopes(conn)
    return [(r.run_id, bool(r.runnable)) for r in conn.execute(text(LANE_ORDER), {
        "lane": lane_id, "n": n, "also": also or [], "full_repos": full["repo"],
        "full_users": full["user"], "cancelled_ok": candidates})]


def head_reads(order: list[tuple[str, bool]], limit: int) -> tuple[list[str], int]:
    """The first ``limit`` runnable runs, and how many rows an in-order walk reads to
    find them (all of the lane when it has fewer)."""
    taken: list[str] = []
    for position, (run_id, runnable) in enumerate(order, start=1):
        if runnable:
            taken.append(run_id)
            if len(taken) == limit:
                return taken, position
    return taken, len(order)


# --- FULL_SCOPES ---------------------------------------------------------------------


def test_full_scopes_reads_only_the_full_counters(explain_db: ExplainDb) -> None:
    with explain_db.engine.connect() as conn:
        plan = explain(conn, claim_sql.FULL_SCOPES, {})
        conn.rollback()
    full = len(FULL_TENANTS) + len(FULL_REPOS)
    assert plan["Plan"]["Actual Rows"] == full, describe(plan)
    # 16,001 counters, 70 full: the partial index holds exactly those.
    assert_bounded(plan, index="ix_limit_counters_full", table="limit_counters", bound=full,
                   ordered=False)


# --- PICK_LANES ----------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "routes", "limit"), [
    ("default", ALL_ROUTES, 1), ("default", ALL_ROUTES, LANE_PAGE), ("default", ALL_ROUTES, 50),
    ("batch", ALL_ROUTES, LANE_PAGE),
    # A worker without a GPU: nobody serves the GPU lanes, so their pass never advances
    # and they sort first (95 of them in (default, 50), a number that grows with the
    # tenants that have such lanes). It reads none of them.
    ("default", PLAIN_ROUTES, LANE_PAGE),
], ids=["default-all-1", "default-all-16", "default-all-50", "batch-all-16", "default-plain-16"])
def test_pick_lanes_reads_one_page(explain_db: ExplainDb, queue: str, routes: list[str],
                                   limit: int) -> None:
    """At most one page per served route, merged by a sort of that many rows."""
    with explain_db.engine.connect() as conn:
        plan = explain(conn, PICK_LANES, pick_params(conn, queue, routes, limit))
        conn.rollback()
    assert plan["Plan"]["Actual Rows"] == limit, describe(plan)
    # Full tenants' lanes (the lowest pass of all) are not even in the partial index.
    assert_bounded(plan, index=ROUTE_PICK, table="lanes", bound=limit * len(routes) + 1,
                   sorted_rows=limit * len(routes))


def test_pick_lanes_serves_the_best_priority_in_fair_order(explain_db: ExplainDb) -> None:
    with explain_db.engine.connect() as conn:
        picked = run(conn, PICK_LANES, pick_params(conn, "default", ALL_ROUTES, 50))
        expected = conn.execute(text(
            "SELECT lane_id FROM lanes WHERE queue = 'default' AND queued_count > 0 "
            f"AND NOT ({FULL_TENANT_SQL}) ORDER BY priority, pass, lane_id LIMIT 50")).scalars()
        assert [r.lane_id for r in picked] == list(expected)
    assert {r.priority for r in picked} == {BEST}
    assert [r.lane_id for r in picked[:4]] == [explain_db.lanes[k] for k in (
        "cancelled", "backoff", "full_repo", "blocked")]
    assert not {r.tenant for r in picked} & set(FULL_TENANTS)


def test_pick_lanes_second_page_starts_at_its_cursor(explain_db: ExplainDb) -> None:
    with explain_db.engine.connect() as conn:
        first = run(conn, PICK_LANES, pick_params(conn, "default", ALL_ROUTES, LANE_PAGE))
        after = (first[-1].priority, first[-1].pass_, first[-1].lane_id)
        plan = explain(conn, PICK_LANES,
                       pick_params(conn, "default", ALL_ROUTES, LANE_PAGE, after))
        conn.rollback()
    assert plan["Plan"]["Actual Rows"] == LANE_PAGE
    assert_bounded(plan, index=ROUTE_PICK, table="lanes", bound=2 * LANE_PAGE + 1,
                   sorted_rows=2 * LANE_PAGE)


# --- PICK_AND_WALK_PG ----------------------------------------------------------------


# The lanes of a full page's flows beyond its last lane (claim_sql.PAGE_COMPANIONS), written
# apart from the claim's SQL: the served lanes of the page's tenants at its last lane's
# priority, after that lane.
COMPANIONS = """
SELECT lane_id, tenant, priority, weight, pass AS pass_, queued_count FROM lanes
WHERE queue = :queue AND route_key = ANY(:routes) AND queued_count > 0
  AND tenant_at_limit = 0 AND wake_at IS NULL
  AND tenant = ANY(:tenants) AND priority = :priority AND (pass, lane_id) > (:pass, :lane)
"""


@pytest.mark.parametrize("plan_kind", ["custom", "generic"])
@pytest.mark.parametrize("wanted", [1, LANE_PAGE, 50])
def test_pick_and_walk_reads_one_page_and_walks_only_lanes_with_a_share(
        explain_db: ExplainDb, wanted: int, plan_kind: str) -> None:
    """The fused pick reads one page of lanes, and the lanes of its flows beyond its
    end (one probe of ``ix_lanes_flow`` per flow at the end's priority), and walks only
    the lanes of the page's first ``wanted`` flows (no later flow can get a share), none
    past ``wanted`` runnable runs: the rows read are bounded by the batch and the page,
    not by the lanes' sizes. In (default, 50) the page is 4 planted lanes and GPU lanes,
    whose tenants' plain lanes (their flows' other lanes) lie far beyond it."""
    page = max(wanted, LANE_PAGE)
    with explain_db.engine.connect() as conn:
        params = pick_params(conn, "default", ALL_ROUTES, page)
        picked = run(conn, PICK_LANES, params)
        end = picked[-1]
        assert len(picked) == page
        probed = sorted({r.tenant for r in picked if r.priority == end.priority})
        companions = list(conn.execute(text(COMPANIONS), {
            "queue": "default", "routes": ALL_ROUTES, "tenants": probed,
            "priority": end.priority, "pass": end.pass_, "lane": end.lane_id}))
        assert companions  # the data set has flows on two pages
        flows, members = flows_of([LaneState(r.lane_id, r.priority, r.weight, r.pass_,
                                             r.queued_count, r.tenant)
                                   for r in [*picked, *companions]])
        bounds = {lane: most for flow, most in share_bounds(flows, wanted).items()
                  for lane in members[flow]}
        heads = {lane: head_reads(lane_order(conn, lane, candidates=True), most)
                 for lane, most in bounds.items()}
        walk = sum(read for _, read in heads.values())
        flow_lanes = sum(flow_size(conn, _lane(conn, tenant)) for tenant in probed)
        probe = explain if plan_kind == "custom" else explain_generic  # what it settles on
        plan = probe(conn, claim_sql.PICK_AND_WALK_PG, {**params, "wanted": wanted})
        got = run(conn, claim_sql.PICK_AND_WALK_PG, {**params, "wanted": wanted})
        conn.rollback()
    assert sorted({r.page_lane_id for r in got if not r.companion}) == sorted(
        r.lane_id for r in picked)
    assert sorted({r.page_lane_id for r in got if r.companion}) == sorted(
        r.lane_id for r in companions)
    walked: dict[int, list[str]] = {}
    for r in got:
        if r.run_id is not None:
            walked.setdefault(r.lane_id, []).append(r.run_id)
    # Each lane of a flow with a share walked exactly as far as the flow's bound, the
    # others not at all.
    assert {lane: sorted(runs) for lane, runs in walked.items()} == {
        lane: sorted(taken) for lane, (taken, _) in heads.items() if taken}
    # A page per served route, one extra lanes row (the MIN(wake_at) probe of the
    # sleeping-lane index) and each probed flow's lanes, with a row of slack per probe
    # (EXPLAIN's per-loop averages, rounded).
    assert reads(plan).get("lanes", 0) <= (page * len(ALL_ROUTES) + 1 + flow_lanes
                                           + len(probed)), describe(plan)
    assert [n for n in nodes(plan) if n.get("Index Name") == "ix_lanes_flow"], describe(plan)
    # EXPLAIN gives a lateral scan's rows as per-loop averages, rounded: one row per
    # loop (lane walked) of slack.
    assert_bounded(plan, index=DISPATCH_INDEX_NAME, table="runs",
                   bound=walk + len(picked) + len(companions),
                   sorted_rows=page * len(ALL_ROUTES))


# --- LANE_RUNS -----------------------------------------------------------------------

# LANE_RUNS does not filter on tasks: each returned run's task is read by primary key
# (in the select list) and runs of cancelled tasks are pruned by the claim. Its keyset
# is a row comparison, an Index Cond.
@pytest.mark.parametrize(("lane", "limit"), [
    pytest.param(lane, limit, id=f"{lane}-{limit}")
    for lane in ("plain", "cancelled", "backoff", "full_repo", "blocked", "big")
    for limit in (1, 50)
])
def test_lane_candidates_walk_the_lane_head(explain_db: ExplainDb, lane: str,
                                            limit: int) -> None:
    """The big lane (50,000 runs) must be walked in order, reading the batch plus the
    unrunnable rows planted ahead of it. A small lane (~150 runs) may instead be read
    whole through the dispatch index (a bitmap scan and a sort, which PostgreSQL
    rightly prefers for a claim of 50 there): that cost is bounded by the lane's own
    size, never by the queue, the tenants or the repositories."""
    lane_id = explain_db.lanes[lane]
    with explain_db.engine.connect() as conn:
        order = lane_order(conn, lane_id, candidates=True)
        expected, walk = head_reads(order, limit)
        plan = explain(conn, LANE_RUNS, candidate_params(conn, lane_id, limit))
        conn.rollback()
    assert plan["Plan"]["Actual Rows"] == len(expected), describe(plan)
    # One task lookup per returned run, never a walk of tasks.
    assert reads(plan).get("tasks", 0) <= len(expected), describe(plan)
    try:
        # Bound: the batch plus the unrunnable rows planted ahead of it in this lane.
        assert_bounded(plan, index=DISPATCH_INDEX_NAME, table="runs", bound=walk)
    except AssertionError:
        if lane == "big":
            raise
        assert len(order) < 1_000  # a small lane: only its own rows, through the index
        assert_bounded(plan, index=DISPATCH_INDEX_NAME, table="runs", bound=len(order),
                       ordered=False)


@pytest.mark.parametrize("lane", ["plain", "cancelled", "backoff", "full_repo", "blocked"])
def test_lane_candidates_are_the_oldest_runnable_runs(explain_db: ExplainDb,
                                                      lane: str) -> None:
    """Oldest runnable as LANE_RUNS sees it: runs of cancelled tasks are
    candidates (pruned by the claim, not skipped here); backoff and full scopes are
    skipped."""
    lane_id = explain_db.lanes[lane]
    with explain_db.engine.connect() as conn:
        order = lane_order(conn, lane_id)
        expected, _ = head_reads(lane_order(conn, lane_id, candidates=True), 50)
        got_rows = run(conn, LANE_RUNS, candidate_params(conn, lane_id, 50))
        got = [r.run_id for r in got_rows]
        conn.rollback()
    assert got == expected
    planted = {"plain": 0, "cancelled": CANCELLED_HEAD, "backoff": BACKOFF_HEAD,
               "full_repo": FULL_REPO_HEAD, "blocked": len(order)}[lane]
    assert not any(runnable for _, runnable in order[:planted])
    if lane == "cancelled":  # the cancelled head comes first, for the claim to prune
        assert got[:planted] == [run_id for run_id, _ in order[:planted]]
    # The flag the claim prunes by: exactly the runs of cancelled tasks.
    assert sum(r.task_cancelled for r in got_rows) == (planted if lane == "cancelled" else 0)
    assert len(got) == (0 if lane == "blocked" else 50)


@pytest.mark.parametrize(("statement", "lane"), [
    pytest.param("PICK_LANES", None, id="pick_lanes"),
    pytest.param("LANE_RUNS", "big", id="lane_runs-big"),
    pytest.param("LANE_RUNS", "plain", id="lane_runs-plain"),
])
def test_generic_plans_stay_on_the_index(explain_db: ExplainDb, statement: str,
                                         lane: str | None) -> None:
    """The store's engine prepares statements (psycopg ``prepare_threshold``), and
    PostgreSQL may then keep a generic plan: it must be as good."""
    with explain_db.engine.connect() as conn:
        if lane is None:
            plan = explain_generic(conn, PICK_LANES,
                                   pick_params(conn, "default", ALL_ROUTES, LANE_PAGE))
            bound, index, table = 2 * LANE_PAGE + 1, ROUTE_PICK, "lanes"
            sorted_rows = 2 * LANE_PAGE  # a page per served route, merged
        else:
            sorted_rows = 0
            _, bound = head_reads(lane_order(conn, explain_db.lanes[lane], candidates=True), 1)
            plan = explain_generic(conn, LANE_RUNS,
                                   candidate_params(conn, explain_db.lanes[lane], 1))
            index, table = DISPATCH_INDEX_NAME, "runs"
        conn.rollback()
    assert_bounded(plan, index=index, table=table, bound=bound, sorted_rows=sorted_rows)


# --- slots, the compare-and-set, lane bookkeeping ------------------------------------


def claim_sample(conn: Connection, n: int) -> tuple[list[str], list[str]]:
    """The oldest ``n`` runs of the plain lane and every scope a claim of them locks."""
    rows = conn.execute(text(
        "SELECT run_id, tenant, repo, user_id FROM runs WHERE lane_id = :l "
        "AND status = 'QUEUED' ORDER BY created_at, run_id LIMIT :n"),
        {"l": _lane(conn, "tenant-0010"), "n": n}).all()
    scopes = {"global"} | {s for r in rows for s in (
        f"tenant:{r.tenant}", f"repo:{r.repo}", f"user:{r.user_id}")}
    return [r.run_id for r in rows], sorted(scopes)


def sample_of_many_lanes(conn: Connection, n: int) -> list[str]:
    """Every scope a claim of ``n`` runs from ``n`` different lanes locks."""
    rows = conn.execute(text(
        "SELECT r.tenant, r.repo, r.user_id FROM (SELECT lane_id FROM lanes "
        "  WHERE queue = 'default' AND priority = :p AND route_key = '' "
        "  AND tenant_at_limit = 0 ORDER BY pass, lane_id LIMIT :n) l "
        "CROSS JOIN LATERAL (SELECT tenant, repo, user_id FROM runs "
        "  WHERE lane_id = l.lane_id AND status = 'QUEUED' "
        "  ORDER BY created_at, run_id LIMIT 1) r"), {"p": BEST, "n": n}).all()
    assert len(rows) == n
    return sorted({"global"} | {s for r in rows for s in (
        f"tenant:{r.tenant}", f"repo:{r.repo}", f"user:{r.user_id}")})


def flow_size(conn: Connection, lane_id: int) -> int:
    """The lanes of a lane's flow (its tenant's lanes of its queue and priority)."""
    return int(conn.execute(text(
        "SELECT COUNT(*) FROM lanes f JOIN lanes l ON l.lane_id = :lane "
        "AND f.tenant = l.tenant AND f.queue = l.queue AND f.priority = l.priority"),
        {"lane": lane_id}).scalar_one())


def test_claim_write_touches_only_its_rows(explain_db: ExplainDb) -> None:
    """The writes of a claim of 50 (slots, compare-and-set, attempts, events, lanes) in
    one statement: each table by its primary key, as many rows as the claim has."""
    with explain_db.engine.connect() as conn:
        run_ids, scopes = claim_sample(conn, 50)
        lane = _lane(conn, "tenant-0010")
        maxima = conn.execute(text(
            "SELECT max_active FROM limit_counters WHERE scope = ANY(:s) ORDER BY scope"),
            {"s": scopes}).scalars().all()
        plan = explain(conn, claim_sql.CLAIM_WRITE_PG, {
            "now": None, "slot_scopes": scopes, "slot_counts": [0] * len(scopes),
            "slot_max": maxima, "run_ids": run_ids, "estimated": [None] * 50, "scopes": [None] * 50,
            "worker_id": "explain-worker", "ttl": 60.0, "lane_ids": [lane],
            "lane_counts": [50], "lane_gone": [0], "ahead": 1e-6, "also_full": []})
        conn.rollback()
    assert plan["Plan"]["Actual Rows"] == 50, describe(plan)
    assert_bounded(plan, index="runs_pkey", table="runs", bound=50, ordered=False)
    read = reads(plan)
    # Counters are read twice each: locked (in key order), then updated. The lane is
    # read for its flow, then each lane of the flow (one per route of the tenant, at
    # its queue and priority: ix_lanes_flow) is read a few times: locked, updated, and
    # for the flow's pass (the highest of its lanes): at most four reads a lane.
    assert read.get("limit_counters", 0) <= 2 * len(scopes), describe(plan)
    with explain_db.engine.connect() as conn:
        flow = flow_size(conn, lane)
    assert read.get("lanes", 0) <= 1 + 4 * flow, (flow, describe(plan))


def test_lanes_wake_reads_only_sleeping_lanes(explain_db: ExplainDb) -> None:
    """Every claim that took nothing (and every PostgreSQL claim, in its write) wakes the
    lanes whose backoff is over: through the partial index of sleeping lanes, never a
    scan of all lanes."""
    with explain_db.engine.connect() as conn:
        conn.execute(text("UPDATE lanes SET wake_at = 0 WHERE lane_id = :l"),
                     {"l": explain_db.lanes["backoff"]})
        plan = explain(conn, lanes_sql.LANES_WAKE, {"now": None, "ahead": 1e-6})
        conn.rollback()
        flow = flow_size(conn, explain_db.lanes["backoff"])
    # As before flows (3), and the lanes of its flow, read for their pass (ix_lanes_flow).
    assert_bounded(plan, index="ix_lanes_wake", table="lanes", bound=3 + flow, ordered=False)


@pytest.mark.parametrize("plan_of", [explain, explain_generic])
def test_marking_a_tenants_lanes_reads_only_that_tenants_lanes(
        explain_db: ExplainDb, plan_of: Any) -> None:
    """A release that takes a tenant below its limit (or a claim on SQLite that fills
    it) locks that tenant's lanes in lane_id order: through the index by tenant, a sort
    of its few lanes, never a scan of every lane; a lane shown again reads one more,
    the lowest pass of its (queue, priority) it rejoins behind (one ix_lanes_pick probe)."""
    with explain_db.engine.connect() as conn:
        params = {"tenants": ["tenant-0900"], "at_limit": 0, "ahead": 1e-6}
        mine = conn.execute(text("SELECT COUNT(*) FROM lanes WHERE tenant = 'tenant-0900' "
                                 "AND tenant_at_limit <> :at_limit"), params).scalar_one()
        plan = plan_of(conn, lanes_sql.MARK_TENANT_LANES, params)
        conn.rollback()
    assert mine > 0
    assert_bounded(plan, index="ix_lanes_flow", table="lanes", bound=3 * mine,
                   ordered=False)


@pytest.mark.parametrize("start", ["head", "middle"])
def test_a_page_of_the_queued_backlog_reads_one_page(explain_db: ExplainDb,
                                                     start: str) -> None:
    """The scheduler pass that admits the backlog again after a policy change reads it
    a page at a time through the dispatch index, in its order, from its cursor."""
    with explain_db.engine.connect() as conn:
        after = (-(2**31), float("-inf"), "")
        if start == "middle":
            row = conn.execute(text(
                "SELECT lane_id, created_at, run_id FROM runs WHERE status = 'QUEUED' "
                "AND lane_id = :l ORDER BY created_at, run_id LIMIT 1"),
                {"l": explain_db.lanes["plain"]}).one()
            after = (row.lane_id, row.created_at, row.run_id)
        params = {"after_lane": after[0], "after_created": after[1], "after_id": after[2],
                  "scan": 1000}
        plan = explain(conn, policy_sql.QUEUED_PAGE, params)
        page = run(conn, policy_sql.QUEUED_PAGE, params)
    assert len(page) == 1000
    assert (page[0].lane_id, page[0].created_at, page[0].run_id) > after
    assert_bounded(plan, index=DISPATCH_INDEX_NAME, table="runs", bound=1000)


@pytest.mark.parametrize(("queue", "priority"), [("default", BEST), ("batch", 100)])
def test_lane_virtual_time_reads_one_lane(explain_db: ExplainDb, queue: str,
                                          priority: int) -> None:
    with explain_db.engine.connect() as conn:
        plan = explain(conn, lanes_sql.LANE_VIRTUAL_TIME, {"queue": queue, "priority": priority})
        expected = conn.execute(text(
            "SELECT MIN(pass) FROM lanes WHERE queue = :q AND priority = :p "
            f"AND queued_count > 0 AND NOT ({FULL_TENANT_SQL})"),
            {"q": queue, "p": priority}).scalar_one()
        [(got,)] = run(conn, lanes_sql.LANE_VIRTUAL_TIME, {"queue": queue, "priority": priority})
        conn.rollback()
    assert got == expected
    assert_bounded(plan, index="ix_lanes_pick", table="lanes", bound=1)


def test_slots_of_one_run_use_the_primary_key(explain_db: ExplainDb) -> None:
    with explain_db.engine.connect() as conn:
        _, scopes = claim_sample(conn, 1)
        plan = explain(conn, LOCK_SCOPES, {"scopes": scopes})
        conn.rollback()
    assert len(scopes) == 4 and plan["Plan"]["Actual Rows"] == 4, describe(plan)
    assert_counter_probes(plan, 4)


# n = 50: ~150 scopes (global, tenants, repositories, users). The old form, ``scope =
# ANY(:scopes) ORDER BY scope FOR UPDATE``, was planned as a Seq Scan of all 16,001
# counters and a Sort (113 pages priced below ~150 primary-key probes).
@pytest.mark.parametrize("plan_kind", ["custom", "generic"])
@pytest.mark.parametrize("n", [10, 50])
def test_lock_scopes_of_a_batch_use_the_primary_key(explain_db: ExplainDb, n: int,
                                                    plan_kind: str) -> None:
    """LOCK_SCOPES probes each scope's counter, in scope order (deadlock avoidance:
    ``test_counter_locks.py`` checks the order itself), as the planner plans it for
    these values and as a prepared statement's generic plan."""
    probe = explain if plan_kind == "custom" else explain_generic
    with explain_db.engine.connect() as conn:
        scopes = sample_of_many_lanes(conn, n)
        plan = probe(conn, LOCK_SCOPES, {"scopes": scopes})
        conn.rollback()
    assert plan["Plan"]["Actual Rows"] == len(scopes) > 2 * n, describe(plan)
    assert_counter_probes(plan, len(scopes))


def claim_write_params(conn: Connection, n_lanes: int) -> dict[str, Any]:
    """CLAIM_WRITE_PG for the 50 oldest runs of the plain lane, taking no slot in the
    scopes of the heads of ``n_lanes`` lanes (so that every counter has room and the
    write goes through: the slots are updated, by +0)."""
    run_ids, _ = claim_sample(conn, 50)
    scopes = sample_of_many_lanes(conn, n_lanes)
    maxima = conn.execute(text(
        "SELECT max_active FROM limit_counters WHERE scope = ANY(:s) ORDER BY scope"),
        {"s": scopes}).scalars().all()
    assert len(maxima) == len(scopes)
    return {"now": None, "slot_scopes": scopes, "slot_counts": [0] * len(scopes),
            "slot_max": maxima, "run_ids": run_ids, "estimated": [None] * 50,
            "scopes": [None] * 50, "worker_id": "explain-worker", "ttl": 60.0,
            "lane_ids": [_lane(conn, "tenant-0010")], "lane_counts": [50], "lane_gone": [0],
            "ahead": 1e-6, "also_full": []}


@pytest.mark.parametrize("plan_kind", ["custom", "generic"])
def test_claim_write_probes_the_counters_of_a_batch(explain_db: ExplainDb,
                                                   plan_kind: str) -> None:
    """The common path of a claim of 50 from 50 lanes: CLAIM_WRITE_PG locks its ~150
    counters (``counter_locks``) and updates them (``slots``) through the primary key.
    Both were Seq Scans of every counter (``scope = ANY(...)``, 32,002 rows read) until
    runlane's sessions priced a random page at 1.1 (engine.PLANNER_OPTIONS)."""
    probe = explain if plan_kind == "custom" else explain_generic
    with explain_db.engine.connect() as conn:
        params = claim_write_params(conn, 50)
        plan = probe(conn, claim_sql.CLAIM_WRITE_PG, params)
        conn.rollback()
    assert plan["Plan"]["Actual Rows"] == 50, describe(plan)  # room was found: it wrote
    scopes = len(params["slot_scopes"])
    assert scopes > 100, scopes
    assert_counter_probes(plan, scopes, per_scope=2)


def test_ensure_counter_is_a_primary_key_upsert(explain_db: ExplainDb) -> None:
    with explain_db.engine.connect() as conn:
        plan = explain(conn, slots_sql.ENSURE_COUNTER,
                       {"scope": "repo:acme/repo-00010", "active": 0, "max_active": REPO_MAX,
                        "version": 1})
        conn.rollback()
    top = plan["Plan"]
    assert top.get("Conflict Arbiter Indexes") == ["limit_counters_pkey"], describe(plan)
    # The version guard reads policy_versions (a row per applied policy; one page here,
    # its primary key's last entry once it is larger); no other table is scanned.
    assert not [n for n in nodes(plan) if n["Node Type"] in SCANS
                and n.get("Relation Name") != "policy_versions"], describe(plan)


# --- the check is sensitive to the index ---------------------------------------------


@pytest.mark.parametrize("index", [ROUTE_PICK, DISPATCH_INDEX_NAME,
                                   "ix_limit_counters_full"])
def test_without_the_index_the_same_check_fails(explain_db: ExplainDb, index: str) -> None:
    """Drop the index inside a transaction that is rolled back (it comes back
    untouched): the plan falls back to a scan or a sort, which the check rejects."""
    with explain_db.engine.connect() as conn:
        conn.execute(text(f'DROP INDEX "{index}"'))
        sorted_rows = 0
        if index == ROUTE_PICK:  # each route walked in pass order, GPU lanes and all
            plan = explain(conn, PICK_LANES,
                           pick_params(conn, "default", PLAIN_ROUTES, LANE_PAGE))
            table, bound, ordered, sorted_rows = "lanes", LANE_PAGE + 1, True, LANE_PAGE
        elif index == DISPATCH_INDEX_NAME:
            plan = explain(conn, LANE_RUNS, candidate_params(conn, explain_db.lanes["big"], 1))
            table, bound, ordered = "runs", 1, True
        else:
            plan = explain(conn, claim_sql.FULL_SCOPES, {})
            table, bound = "limit_counters", len(FULL_TENANTS) + len(FULL_REPOS)
            ordered = False
        conn.rollback()
    assert {n["Node Type"] for n in nodes(plan)} & {"Seq Scan", "Sort", "Bitmap Heap Scan"}, \
        describe(plan)
    with pytest.raises(AssertionError):
        assert_bounded(plan, index=index, table=table, bound=bound, ordered=ordered,
                       sorted_rows=sorted_rows)
    with explain_db.engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass(:n) IS NOT NULL"),
                            {"n": index}).scalar_one()


# --- Store.claim end to end ----------------------------------------------------------


class _Savepoints:
    """An engine stand-in for ``Store``: each of its transactions is a savepoint of one
    outer transaction, which the test rolls back."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        with self.conn.begin_nested():
            yield self.conn

    def connect(self) -> AbstractContextManager[Connection]:
        return nullcontext(self.conn)

    def dispose(self) -> None:
        pass


@contextmanager
def rolled_back_store(url: str) -> Iterator[tuple[Store, Connection]]:
    """A Store on the production engine settings (prepared statements, jit off) whose
    every write is rolled back at the end."""
    engine = build_engine(url)
    try:
        with engine.connect() as conn:
            outer = conn.begin()
            try:
                yield Store(url, engine=cast(Engine, _Savepoints(conn))), conn
            finally:
                outer.rollback()
    finally:
        engine.dispose()


LANES_OF_QUEUE = """
SELECT lane_id, tenant, route_key, priority, weight, pass AS pass_, queued_count,
       tenant_at_limit
FROM lanes WHERE queue = :q
"""


PRUNED = "SELECT run_id FROM runs WHERE status = 'CANCELLED' AND queue = :q ORDER BY run_id"


def pruned_runs(conn: Connection, queue: str) -> list[str]:
    """The runs of ``queue`` a claim pruned (every run was QUEUED before: the data set
    has no other status, and each claim runs in a rolled-back transaction)."""
    return list(conn.execute(text(PRUNED), {"q": queue}).scalars())


def check_claim(conn: Connection, leases: list[Lease], pruned: list[str],
                lanes: dict[int, Any], routes: list[str], full: dict[str, list[str]]) -> None:
    """What a claim returned (and the runs it pruned: candidates of cancelled tasks)
    obeys the rules, checked against the data as it was before the claim (``lanes``,
    the ``full`` scopes), not against the claim's SQL."""
    ids = [lease.run_id for lease in leases]
    rows = {r.run_id: r for r in conn.execute(text(
        "SELECT r.run_id, r.lane_id, r.priority, r.tenant, r.repo, r.route_key, r.status, "
        "r.reason_code, r.visible_at <= EXTRACT(EPOCH FROM clock_timestamp()) AS visible, "
        "t.cancel_requested_at FROM runs r JOIN tasks t ON t.task_id = r.task_id "
        "WHERE r.run_id = ANY(:ids)"), {"ids": ids + pruned})}
    assert len(rows) == len(ids) + len(pruned) == len(set(ids) | set(pruned))
    eligible = {lane_id: lane for lane_id, lane in lanes.items()
                if lane.queued_count > 0 and not lane.tenant_at_limit
                and lane.route_key in routes}
    best = min(lane.priority for lane in eligible.values())
    for r in rows.values():
        if r.run_id in pruned:  # invariant 1: a cancelled task's run is never claimed
            assert r.status == "CANCELLED" and r.cancel_requested_at is not None, r
            assert r.reason_code == Reason.CANCELLED_BY_USER.value, r
        else:
            assert r.status == "CLAIMED" and r.cancel_requested_at is None, r
        assert r.priority == best and r.visible, r
        assert r.repo not in FULL_REPOS and r.tenant not in FULL_TENANTS, r
        assert r.route_key in routes, r
    over = conn.execute(text(
        "SELECT scope, active, max_active FROM limit_counters WHERE active > max_active")).all()
    assert not over, f"limits exceeded (invariant 9): {over}"
    # A lane's share is spent on its candidates, the pruned ones included.
    taken: dict[int, list[str]] = {}
    for run_id in ids + pruned:
        taken.setdefault(rows[run_id].lane_id, []).append(run_id)
    # Oldest candidates first inside each lane (a cancelled task's run is one).
    for lane_id, run_ids in taken.items():
        expected, _ = head_reads(lane_order(conn, lane_id, 2_000, run_ids, full,
                                            candidates=True), len(run_ids))
        assert sorted(run_ids) == sorted(expected), f"lane {lane_id}"

    # Stride fair share among flows (a tenant's lanes of one priority, one per route):
    # the k-th run of a flow is due at its pass + (k - 1) / weight; no flow was given a
    # run due later than the next run of a flow left with work.
    flows: dict[tuple[int, str], list[int]] = {}
    for lane_id, lane in sorted(eligible.items()):
        flows.setdefault((lane.priority, lane.tenant), []).append(lane_id)

    def due(flow: tuple[int, str], k: int) -> tuple[float, int]:
        members = [eligible[lane_id] for lane_id in flows[flow]]
        return (min(lane.pass_ for lane in members) + (k - 1) / members[0].weight,
                min(flows[flow]))

    given = {flow: sum(len(taken.get(lane_id, [])) for lane_id in members)
             for flow, members in flows.items()}
    latest = max(due(flow, n) for flow, n in given.items() if n)
    for flow, members in flows.items():
        n = given[flow]
        if flow[0] == best and due(flow, n + 1) < latest:
            for lane_id in members:
                mine = len(taken.get(lane_id, []))
                more, _ = head_reads(lane_order(conn, lane_id, 2_000, taken.get(lane_id), full,
                                                candidates=True), mine + 1)
                assert len(more) <= mine, (f"flow {flow} had its run {n + 1} due at "
                                           f"{due(flow, n + 1)}, before {latest}")


# default-50-gpu: a lane comes up short (tenant-0004's, all of a full repository) and
# its share must not be re-dealt inside the page alone: tenant-0001's second run is
# due at pass 1.1, GPU lanes of the next page at ~0.55 (it failed so before the page
# boundary, ``share_slots(until=...)``).
@pytest.mark.parametrize(("queue", "limit", "caps"), [
    ("default", 1, None), ("default", 1, GPU), ("default", 50, None), ("batch", 50, GPU),
    ("default", 50, GPU),
], ids=["default-1", "default-1-gpu", "default-50", "batch-50-gpu", "default-50-gpu"])
def test_claim_takes_the_right_runs(explain_db: ExplainDb, queue: str, limit: int,
                                    caps: dict[str, str] | None) -> None:
    with rolled_back_store(explain_db.url) as (store, conn):
        lanes = {r.lane_id: r for r in conn.execute(text(LANES_OF_QUEUE), {"q": queue})}
        full = full_scopes(conn)
        leases = store.claim("explain-worker", queue, limit=limit, capabilities=caps)
        pruned = pruned_runs(conn, queue)
        # Runs of cancelled tasks fill candidates' places, then are pruned: fewer leases.
        assert len(leases) + len(pruned) == limit
        assert bool(pruned) == (queue == "default")  # tenant-0001's lane comes first
        check_claim(conn, leases, pruned, lanes, ALL_ROUTES if caps else PLAIN_ROUTES, full)
        if queue == "default" and limit == 1:
            # The lowest pass: tenant-0001's lane, whose head is a cancelled task's run:
            # it is pruned, and this claim returns nothing.
            assert leases == []
            expected, _ = head_reads(lane_order(conn, explain_db.lanes["cancelled"], 100,
                                                pruned, full, candidates=True), 1)
            assert pruned == expected


# For a table: its sequential scans and the rows they read; for an index: its scans
# and the entries they returned. PostgreSQL counts them for the current transaction.
XACT_ACTIVITY = """
SELECT c.relname, pg_stat_get_xact_numscans(c.oid) AS scans,
       pg_stat_get_xact_tuples_returned(c.oid) AS returned
FROM pg_class c WHERE c.relnamespace = CAST('public' AS regnamespace) AND c.relkind IN ('r', 'i')
"""


def activity(conn: Connection) -> dict[str, tuple[int, int]]:
    return {r.relname: (int(r.scans), int(r.returned))
            for r in conn.execute(text(XACT_ACTIVITY))}


def claims_activity(url: str, queue: str, limit: int, times: int,
                    capabilities: dict[str, Any] | None = None
                    ) -> list[dict[str, tuple[int, int]]]:
    """Per claim (``times`` in a row, so psycopg prepares and PostgreSQL may switch to
    generic plans), what it scanned. Each claim's leases plus the runs it pruned (runs
    of cancelled tasks) make its ``limit``."""
    out = []
    with rolled_back_store(url) as (store, conn):
        pruned = 0
        for _ in range(times):
            before = activity(conn)
            leases = store.claim("explain-worker", queue, limit=limit,
                                 capabilities=GPU if capabilities is None else capabilities)
            after = activity(conn)
            now_pruned = len(pruned_runs(conn, queue))  # outside the measured window
            assert len(leases) + now_pruned - pruned == limit
            pruned = now_pruned
            out.append({k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                        for k, v in after.items()})
    return out


def test_lanes_sleep_reads_each_lane_from_its_head(explain_db: ExplainDb) -> None:
    """LANES_SLEEP, asked about lanes with visible runs (all of a full repository; the
    50,000-run lane; runs in backoff ahead of runnable ones), walks each from its head
    to its first visible run and leaves it awake: it never reads a lane whole (the
    MIN) for a lane that has a visible run."""
    keys = ("blocked", "big", "backoff")
    with explain_db.engine.connect() as conn:
        heads = {k: head_reads(lane_order(conn, explain_db.lanes[k], candidates=True), 1)[1]
                 for k in keys}
        invisible_first = conn.execute(text(
            "SELECT COUNT(*) FROM runs WHERE lane_id = :l AND status = 'QUEUED' "
            "AND visible_at > EXTRACT(EPOCH FROM clock_timestamp())"),
            {"l": explain_db.lanes["backoff"]}).scalar_one()
        plan = explain(conn, lanes_sql.LANES_SLEEP["postgresql"],
                       {"lane_ids": sorted(explain_db.lanes[k] for k in keys), "now": None})
        asleep = conn.execute(text("SELECT lane_id FROM lanes WHERE wake_at IS NOT NULL"
                                   " AND lane_id = ANY(:l)"),
                              {"l": [explain_db.lanes[k] for k in keys]}).all()
        conn.rollback()
    assert asleep == []
    # One head walk per lane (the backoff lane's runs in backoff, then its first
    # visible), with a row of slack per lane.
    bound = invisible_first + 2 * len(keys)
    assert_bounded(plan, index=DISPATCH_INDEX_NAME, table="runs", bound=bound,
                   ordered=False)
    assert heads["blocked"] > bound, heads  # read whole, it would show


def lane_reads(delta: dict[str, tuple[int, int]]) -> int:
    """Entries a claim read from the lane indexes it may page through."""
    return sum(delta.get(index, (0, 0))[1] for index in (ROUTE_PICK, "ix_lanes_pick"))


def test_a_worker_without_a_gpu_reads_no_gpu_lane(explain_db: ExplainDb) -> None:
    """The GPU lanes nobody serves sort first in (default, 50) (95 of them, one per
    tenant with GPU runs); a worker without a GPU pages through its own route only."""
    for delta in claims_activity(explain_db.url, "default", 1, 3, capabilities={}):
        # Two pages at most, and the one-statement form's first page before them when it
        # could not finish the claim (the planted heads: test_real_claims_read_rows...).
        assert lane_reads(delta) <= LANE_PAGE * 3, delta


@pytest.mark.parametrize("limit", [1, 50])
def test_real_claims_never_scan_a_large_table(explain_db: ExplainDb, limit: int) -> None:
    """A claim of 50 locks ~150 counters: it read all 16,001 (limit_counters scanned
    twice) until LOCK_SCOPES and CLAIM_WRITE_PG probed them one by one."""
    for delta in claims_activity(explain_db.url, "default", limit, 6 if limit == 1 else 2):
        seq = {t: delta[t] for t in ("runs", "tasks", "lanes", "limit_counters", "attempts",
                                     "run_events") if delta[t][0]}
        assert not seq, f"sequential scans (count, rows) {seq}"


@pytest.mark.parametrize(("queue", "limit"), [
    pytest.param("batch", 1, id="batch-1"),
    # tenant-0004's lane (all of a full repository) gives nothing: the claim walks it,
    # reads its blocking scopes (lanes_sql.LANE_BLOCKING_SCOPES) and puts it to sleep on
    # them (test_scheduler: later claims do not walk it).
    pytest.param("default", 50, id="default-50"),
])
def test_real_claims_read_rows_bounded_by_the_batch(explain_db: ExplainDb, queue: str,
                                                    limit: int) -> None:
    """Per claim, from PostgreSQL's own counters: index entries of the dispatch index
    and of tasks within a few per claimed run plus the planted heads the claim walks
    (the blocked lane's whole backlog, twice for the claim that puts it to sleep), and
    no sequential scan of a large table."""
    planted = blocked = 0
    if queue == "default":
        with explain_db.engine.connect() as conn:
            heads = {k: head_reads(lane_order(conn, explain_db.lanes[k], candidates=True),
                                   1)[1] for k in ("cancelled", "backoff", "full_repo", "blocked")}
        planted, blocked = sum(heads.values()), heads["blocked"]
    claims = claims_activity(explain_db.url, queue, limit, 6 if limit == 1 else 2)
    # Plus, when the one-statement form could not finish the claim (a planted head
    # among its runs), what its own walk read before the transaction walked again.
    bound = 4 * limit + planted + blocked + (limit + planted)
    for n, delta in enumerate(claims):
        seq = {t: delta[t] for t in BIG_TABLES if delta[t][0]}
        assert not seq, f"sequential scans (count, rows) {seq}"
        for index in (DISPATCH_INDEX_NAME, "tasks_pkey"):
            assert delta[index][1] <= bound, \
                f"claim {n}, {index}: {delta[index][1]} entries, bound {bound}"
        # Pages of lanes per served route: up to two as a transaction (a lane coming up
        # short sends the claim to the next page), and the one-statement form's first
        # page before it when that form could not finish the claim (a planted cancelled
        # task, a full repository); each index scan also reads the entries it filters.
        assert lane_reads(delta) <= max(limit, LANE_PAGE) * len(ALL_ROUTES) * 4, delta
