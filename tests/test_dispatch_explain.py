"""Query-plan evidence that a claim walks ix_runs_dispatch, on a million queued runs.

The claim (``sql.CLAIM_BATCH``) must cost about as much as the runs it takes,
however long the queue: PostgreSQL has to walk ``ix_runs_dispatch`` in
``(priority, visible_at, run_id)`` order for one queue and stop after ``:limit``
rows, with no Sort and no scan of the queue. EXPLAIN (ANALYZE, BUFFERS) of the full
claim statement, in a transaction that is rolled back, shows whether it does.

The data set (one dedicated database, built once for the module):

* 1,000,000 QUEUED runs with their tasks, in two queues (``default``, ``batch``) and
  three priorities (0 first), nearly all visible, 2% not yet visible;
* at the head of ``default`` (priority 0, the oldest): ``CANCELLED_AHEAD`` runs whose
  task was cancelled (still QUEUED: the race the claim re-checks the task for), then
  ``VISIBLE_P0`` claimable runs, then ``FUTURE_P0`` runs not visible for an hour, so a
  claim of 50 must step over both kinds before it reaches priority 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url

from runlane.store import migrate
from runlane.store.engine import normalize_url
from runlane.store.schema import DISPATCH_INDEX_NAME
from runlane.store.sql import CLAIM_BATCH, Statements

from .conftest import ADMIN_URL, RUN_TAG, create_pg_database

pytestmark = [pytest.mark.xdist_group("explain"), pytest.mark.slow]

WORKER = RUN_TAG
N_RUNS = 1_000_000
CANCELLED_AHEAD = 10  # g = 1..10
VISIBLE_P0 = 30  # g = 11..40
FUTURE_P0 = 200  # g = 41..240
HEAD = CANCELLED_AHEAD + VISIBLE_P0 + FUTURE_P0

# One row per g: the run r<g> of task t<g>. ``:t`` is the database clock at population.
SOURCE = f"""
SELECT '10000000-0000-4000-8000-' || lpad(g::text, 12, '0') AS run_id,
       '00000000-0000-4000-8000-' || lpad(g::text, 12, '0') AS task_id,
       'tenant-' || (g % 7) AS tenant,
       CASE WHEN g <= {HEAD} OR g % 2 = 0 THEN 'default' ELSE 'batch' END AS queue,
       CASE WHEN g <= {HEAD} THEN 0
            WHEN g % 2 = 0 THEN 1 + (g / 2) % 2          -- default: 1 and 2 (0 is the head)
            ELSE g % 3 END AS priority,                   -- batch: 0, 1 and 2
       CASE WHEN g <= {CANCELLED_AHEAD} THEN :t - 864000 + g
            WHEN g <= {CANCELLED_AHEAD + VISIBLE_P0} THEN :t - 432000 + g
            WHEN g <= {HEAD} OR g % 100 IN (50, 51) THEN :t + 3600 + g  -- not yet visible
            ELSE :t - 86400 + g * 0.05 END AS visible_at,
       CASE WHEN g <= {CANCELLED_AHEAD} THEN :t - 60 END AS cancel_requested_at,
       :t - 90000 + g * 0.05 AS created_at
FROM generate_series(1, {N_RUNS}) g
"""
INSERT_TASKS = f"""
INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts, context,
                   truncated_sections, payload_bytes, cancel_requested_at, created_at)
SELECT task_id, tenant, '/srv/git/app.git', 'fix the flaky test', queue, priority, 3,
       '{{"ticket": "APP-1"}}', '[]', 40, cancel_requested_at, created_at
FROM ({SOURCE}) s
"""
INSERT_RUNS = f"""
INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, attempt_count,
                  max_attempts, fencing_token, visible_at, created_at, updated_at, cost_usd)
SELECT run_id, task_id, tenant, '/srv/git/app.git', queue, priority, 'QUEUED', 0,
       3, 0, visible_at, created_at, created_at, 0
FROM ({SOURCE}) s
"""

CLAIM = Statements("postgresql").render(CLAIM_BATCH).text
CASES = [("default", 1), ("default", 50), ("batch", 1), ("batch", 50)]


@dataclass(frozen=True)
class ExplainDb:
    url: str
    engine: Engine
    seconds: dict[str, float]


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def explain_db() -> Iterator[ExplainDb]:
    name = f"runlane_explain_{WORKER}"
    url = create_pg_database(name)
    # No prepared statements: every EXPLAIN below is planned for its own parameters.
    engine = create_engine(normalize_url(url), connect_args={"prepare_threshold": None})
    seconds: dict[str, float] = {}
    try:
        started = time.monotonic()
        # Populate at 0001, then let 0002 build the dispatch index (concurrently, as it
        # would on a production database): faster than maintaining it row by row.
        migrate.upgrade(engine, "0001")
        with engine.begin() as conn:
            t = conn.execute(text("SELECT EXTRACT(EPOCH FROM now())::double precision")).scalar()
            conn.execute(text(INSERT_TASKS), {"t": t})
            conn.execute(text(INSERT_RUNS), {"t": t})
        seconds["insert"] = time.monotonic() - started
        migrate.upgrade(engine)
        seconds["index"] = time.monotonic() - started - seconds["insert"]
        with psycopg.connect(_libpq(url), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        seconds["total"] = time.monotonic() - started
        print(f"\npopulated {N_RUNS:,} runs: " + ", ".join(
            f"{k} {v:.1f}s" for k, v in seconds.items()))
        yield ExplainDb(url, engine, seconds)
    finally:
        engine.dispose()
        with psycopg.connect(_libpq(ADMIN_URL), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- plan helpers ------------------------------------------------------------------


def explain(conn: Connection, queue: str, limit: int) -> dict[str, Any]:
    """EXPLAIN ANALYZE the full claim (it really runs, so the caller rolls back)."""
    result = conn.execute(text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + CLAIM),
                          {"queue": queue, "limit": limit, "now": None}).scalar_one()
    plan: dict[str, Any] = result[0]
    return plan


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
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
    """Index entries a scan node handed up, including those a Filter then dropped."""
    per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
    return int(per_loop * node["Actual Loops"])


def bound(queue: str, limit: int) -> int:
    """Rows the dispatch scan may read: a small multiple of the batch, plus the runs of
    cancelled tasks planted ahead of it (each passes the index condition and is then
    dropped by the task re-check). Not-yet-visible runs fail the index condition inside
    the btree and are not counted as rows (their pages show up as buffers)."""
    return limit * 4 + (CANCELLED_AHEAD if queue == "default" else 0)


def assert_walks_dispatch_index(plan: dict[str, Any], queue: str, limit: int) -> None:
    shown = describe(plan)
    scans = [n for n in nodes(plan) if n.get("Index Name") == DISPATCH_INDEX_NAME
             and n["Node Type"] in ("Index Scan", "Index Only Scan")]
    assert len(scans) == 1, f"no scan of {DISPATCH_INDEX_NAME}:\n{shown}"
    sorts = [n for n in nodes(plan) if "Sort" in n["Node Type"]]
    assert sorts == [], f"the plan sorts instead of walking the index in order:\n{shown}"
    seq_runs = [n for n in nodes(plan)
                if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "runs"]
    assert seq_runs == [], f"the plan scans the runs table:\n{shown}"
    read = rows_read(scans[0])
    assert limit <= read <= bound(queue, limit), (
        f"read {read} index entries for a claim of {limit} "
        f"(bound {bound(queue, limit)}):\n{shown}")
    assert plan["Plan"]["Actual Rows"] == limit, f"claimed the wrong number:\n{shown}"


# --- tests -------------------------------------------------------------------------


@pytest.mark.parametrize(("queue", "limit"), CASES)
def test_claim_walks_the_dispatch_index(explain_db: ExplainDb, queue: str, limit: int) -> None:
    with explain_db.engine.connect() as conn:
        plan = explain(conn, queue, limit)
        conn.rollback()
    assert_walks_dispatch_index(plan, queue, limit)
    if queue == "default":
        # The planted head was really stepped over: exactly the cancelled runs extra.
        [scan] = [n for n in nodes(plan) if n.get("Index Name") == DISPATCH_INDEX_NAME]
        assert rows_read(scan) == limit + CANCELLED_AHEAD, describe(plan)


@pytest.mark.parametrize("queue", ["default", "batch"])
def test_claim_takes_the_right_runs(explain_db: ExplainDb, queue: str) -> None:
    """The index plan's answer equals a seq scan + sort of the same predicate."""
    limit = 50
    with explain_db.engine.connect() as conn:
        claimed = {r.run_id for r in conn.execute(
            text(CLAIM), {"queue": queue, "limit": limit, "now": None})}
        conn.rollback()
        conn.execute(text("SET LOCAL enable_indexscan = off"))
        conn.execute(text("SET LOCAL enable_bitmapscan = off"))
        conn.execute(text("SET LOCAL enable_indexonlyscan = off"))
        expected = [r.run_id for r in conn.execute(text(
            "SELECT r.run_id FROM runs r JOIN tasks t ON t.task_id = r.task_id "
            "WHERE r.queue = :q AND r.status = 'QUEUED' AND t.cancel_requested_at IS NULL "
            "AND r.visible_at <= EXTRACT(EPOCH FROM now()) "
            "ORDER BY r.priority, r.visible_at, r.run_id LIMIT :n"), {"q": queue, "n": limit})]
        conn.rollback()
    assert claimed == set(expected)
    if queue == "default":  # the 30 visible priority-0 runs, then priority 1
        head = {f"10000000-0000-4000-8000-{g:012d}"
                for g in range(CANCELLED_AHEAD + 1, CANCELLED_AHEAD + VISIBLE_P0 + 1)}
        assert head <= claimed


def test_without_the_index_the_same_check_fails(explain_db: ExplainDb) -> None:
    """Pins that the check above is sensitive to the index: drop it (inside a
    transaction that is rolled back, so the index comes back untouched) and the plan
    falls back to a scan plus a sort, which ``assert_walks_dispatch_index`` rejects."""
    with explain_db.engine.connect() as conn:
        conn.execute(text(f"DROP INDEX {DISPATCH_INDEX_NAME}"))
        plan = explain(conn, "default", 50)
        conn.rollback()
    kinds = {n["Node Type"] for n in nodes(plan)}
    assert kinds & {"Sort", "Incremental Sort", "Seq Scan"}, describe(plan)
    with pytest.raises(AssertionError):
        assert_walks_dispatch_index(plan, "default", 50)
    with explain_db.engine.connect() as conn:  # and the index is back
        assert conn.execute(text("SELECT to_regclass(:n) IS NOT NULL"),
                            {"n": DISPATCH_INDEX_NAME}).scalar_one()


@pytest.mark.parametrize("limit", [1, 50])
def test_claim_reads_no_table_in_full(explain_db: ExplainDb, limit: int) -> None:
    """The whole claim, not only its runs side, must be bounded by the batch: no
    sequential scan of any table, and a buffer count far below one table's size."""
    with explain_db.engine.connect() as conn:
        plan = explain(conn, "default", limit)
        conn.rollback()
    shown = describe(plan)
    seq = [n.get("Relation Name") for n in nodes(plan) if n["Node Type"] == "Seq Scan"]
    assert seq == [], f"sequential scan of {seq}:\n{shown}"
    top = plan["Plan"]
    buffers = top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
    # Per claimed run: a few index pages, the heap row, the new row version and its
    # entries in the four other runs indexes; 40 blocks per run is generous.
    assert buffers <= 40 * (limit + CANCELLED_AHEAD), f"{buffers} buffers:\n{shown}"
