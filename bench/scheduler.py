"""Scheduler claim latency at 1,000,000 queued runs, against a plain FIFO claim.

The issue's target: with fairness, limits and routing on, at 1,000,000 queued runs
over 1,000 tenants and 10,000 repositories, ``Store.claim`` p50 within 1.5x of a
plain FIFO claim measured in the same run; and EXPLAIN evidence that no claim-path
statement scans in proportion to the queue, the tenants or the repositories.

Two readings of "a plain FIFO claim" are measured, both in the same run: a bare queue
table (one UPDATE ... SKIP LOCKED plus the attempt rows), and runlane's own claim with
the scheduling off (a second database of as many runs in one tenant, one repository,
one priority, no limits, no routing), which writes the same attempt, lease and event
rows as the scheduled claim: the ratio to it is the cost of fairness, limits and
routing themselves.

One database (``runlane_bench_sched_<pid>``, dropped at the end) holds both: runlane's
tables populated set-based (runs, tasks, lanes, counters for every tenant, repository
and user, a policy with weights and limits, GPU-routed runs) and a ``fifo_jobs`` table
of as many rows with a partial index on (queue, created_at, id); a second
(``..._plain``) the unscheduled runlane queue. The three claims are timed in rotating
order (A B C, B C A, C A B ...) in rounds, then profiled statement by statement, then
EXPLAINed. Progress goes to stderr, the Markdown section to stdout and, with
``--write``, into that file (replacing its previous section, or appended at the end)::

    .venv/bin/python bench/scheduler.py --write docs/benchmarks.md
    .venv/bin/python bench/scheduler.py --quick        # 100,000 runs, about a minute
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import psycopg
from psycopg.rows import namedtuple_row
from psycopg.sql import Literal
from sqlalchemy import Connection, Engine, TextClause, event, text

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lifecycle
from lifecycle import (
    BENCH_POSTGRES_URL,
    cpu_model,
    display_command,
    libpq,
    load_average,
    memory_total,
    merge_section,
    percentile,
    postgres_facts,
    progress,
    runlane_source,
    table,
    with_database,
)
from runlane.domain.admission import TenantUsage, admit
from runlane.domain.policy import policy_from_document
from runlane.domain.routing import canonical_requirements, parse_requirements
from runlane.logs import configure_logging
from runlane.store import (
    audit_sql,
    claim_sql,
    dialect_sql,
    lanes_sql,
    lease_sql,
    policy_sql,
    providers_sql,
    reads_sql,
    recount_sql,
    slots_sql,
    submit_sql,
)
from runlane.store.core import _NUMBERED_PG
from runlane.store.engine import PLANNER_OPTIONS, build_engine
from runlane.store.migrate import upgrade
from runlane.store.policy import same_terms
from runlane.store.records import Lease
from runlane.store.store import Store

DEFAULT_POSTGRES_URL = BENCH_POSTGRES_URL
START, END = "<!-- scheduler-claim:start -->", "<!-- scheduler-claim:end -->"
TARGET_RATIO = 1.5
LIMITS = (1, 10)
QUEUE = "default"
WORKER = "bench-worker"
GPU = {"gpu": "a100"}
GPU_ROUTE = canonical_requirements(parse_requirements(GPU))
IN_FLIGHT = 100  # runlane leases held at once; older ones are completed (untimed)
FULL_TENANTS = 20  # tenant-0900.. hold all their slots (counters full, lanes hidden)
FULL_REPOS = 20  # acme/repo-05000.. hold all theirs
LIMITS_POLICY = {"global_max_active": 1_000, "per_tenant_max_active": 5,
                 "per_repository_max_active": 2, "per_user_max_active": 5}
PG = dialect_sql.Statements("postgresql")
LANE_RUNS = claim_sql.LANE_RUNS["postgresql"]


@dataclass(frozen=True)
class Shape:
    runs: int
    tenants: int
    repos: int
    users: int
    rounds: int
    samples: int  # per round, system and claim limit
    warmup: int
    profile: int  # claims per system and limit with the statement timer on


FULL = Shape(1_000_000, 1_000, 10_000, 5_000, rounds=5, samples=200, warmup=50, profile=200)
QUICK = Shape(100_000, 1_000, 10_000, 5_000, rounds=2, samples=30, warmup=10, profile=30)


# --- population ------------------------------------------------------------------------


def source(shape: Shape) -> str:
    """One row per g: run r<g> of task t<g> (ids time-ordered like runlane's)."""
    return f"""
SELECT '10000000-0000-7000-8000-' || lpad(g::text, 12, '0') AS run_id,
       '00000000-0000-7000-8000-' || lpad(g::text, 12, '0') AS task_id,
       'tenant-' || lpad((g % {shape.tenants})::text, 4, '0') AS tenant,
       'acme/repo-' || lpad((g % {shape.repos})::text, 5, '0') AS repo,
       'dev-' || (g % {shape.users}) AS user_id,
       CASE WHEN (g / 1000) % 2 = 0 THEN 'default' ELSE 'batch' END AS queue,
       (ARRAY[50, 100, 150])[1 + (g / 2000) % 3] AS priority,
       CASE WHEN g % 10 = 7 AND (g / 6000) % 4 = 0 THEN :gpu ELSE '' END AS route_key,
       CASE WHEN g % {shape.tenants} % 5 = 0 THEN 2.0
            WHEN g % {shape.tenants} % 7 = 3 THEN 0.5 ELSE 1.0 END AS weight,
       :t - 100000 + g * (100000.0 / {shape.runs}) AS created_at,
       CASE WHEN (g / 7) % 50 = 3 THEN :t + 3600  -- 2% in backoff for an hour, spread
            ELSE :t - 100000 + g * (100000.0 / {shape.runs}) END AS visible_at
FROM generate_series(1, {shape.runs}) g
"""


# The admission record a submit writes (Decision.to_json of policy v1's ADMIT), built
# in SQL for a million rows; ``check_admissions`` compares a sample with ``admit``.
ADMISSION = f"""json_build_object(
    'decision', 'ADMIT', 'reason_code', NULL, 'message', NULL, 'retry_after', NULL,
    'queue', s.queue, 'priority', s.priority, 'max_attempts', 3, 'risk_class', 'low',
    'requires', s.route_key, 'limits', json_build_object(),
    'concurrency', json_build_object(
        'global', {LIMITS_POLICY["global_max_active"]},
        'tenant:' || s.tenant, {LIMITS_POLICY["per_tenant_max_active"]},
        'repo:' || s.repo, {LIMITS_POLICY["per_repository_max_active"]},
        'user:' || s.user_id, {LIMITS_POLICY["per_user_max_active"]}),
    'weight', s.weight, 'policy_version', 1)"""


def population(shape: Shape) -> list[str]:
    full_tenant = f"tenant BETWEEN 'tenant-0900' AND 'tenant-{899 + FULL_TENANTS:04d}'"
    s = source(shape)
    return [
        f"""INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,
                   context, truncated_sections, payload_bytes, created_at, user_id, requires)
            SELECT task_id, tenant, repo, 'fix the flaky test', queue, priority, 3,
                   '{{"ticket": "APP-1"}}', '[]', 40, created_at, user_id, route_key
            FROM ({s}) s""",
        f"""INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                   tenant_at_limit)
            SELECT queue, route_key, priority, tenant, weight, COUNT(*),
                   1 + mod(abs(hashtext(queue || route_key || priority || tenant)), 1000)
                       / 100.0,
                   CASE WHEN {full_tenant} THEN 1 ELSE 0 END
            FROM ({s}) s GROUP BY queue, route_key, priority, tenant, weight""",
        f"""INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                   attempt_count, max_attempts, fencing_token, visible_at, created_at,
                   updated_at, cost_usd, user_id, risk_class, route_key, lane_id,
                   policy_version, limits, admission)
            SELECT s.run_id, s.task_id, s.tenant, s.repo, s.queue, s.priority, 'QUEUED', 0,
                   3, 0, s.visible_at, s.created_at, s.created_at, 0, s.user_id, 'low',
                   s.route_key, l.lane_id, 1, '{{}}', {ADMISSION}
            FROM ({s}) s JOIN lanes l ON l.queue = s.queue AND l.route_key = s.route_key
                 AND l.priority = s.priority AND l.tenant = s.tenant""",
        f"""INSERT INTO limit_counters (scope, active, max_active)
            SELECT 'global', 0, {LIMITS_POLICY["global_max_active"]}
            UNION ALL
            SELECT 'tenant:tenant-' || lpad(i::text, 4, '0'),
                   CASE WHEN i BETWEEN 900 AND {899 + FULL_TENANTS} THEN 5 ELSE 0 END, 5
            FROM generate_series(0, {shape.tenants - 1}) i
            UNION ALL
            SELECT 'repo:acme/repo-' || lpad(i::text, 5, '0'),
                   CASE WHEN i BETWEEN 5000 AND {4999 + FULL_REPOS} THEN 2 ELSE 0 END, 2
            FROM generate_series(0, {shape.repos - 1}) i
            UNION ALL
            SELECT 'user:dev-' || i, 0, 5 FROM generate_series(0, {shape.users - 1}) i""",
        "INSERT INTO routes (route_key, created_at) VALUES (:gpu, :t)",
        # The baseline: a plain queue table with its dispatch index.
        """CREATE TABLE fifo_jobs (
               id VARCHAR(36) PRIMARY KEY, queue VARCHAR(128) NOT NULL,
               status VARCHAR(16) NOT NULL, created_at DOUBLE PRECISION NOT NULL,
               attempts INTEGER NOT NULL DEFAULT 0, worker_id VARCHAR(255),
               claimed_at DOUBLE PRECISION, payload JSON NOT NULL)""",
        f"""INSERT INTO fifo_jobs (id, queue, status, created_at, attempts, payload)
            SELECT '20000000-0000-7000-8000-' || lpad(g::text, 12, '0'),
                   CASE WHEN (g / 1000) % 2 = 0 THEN 'default' ELSE 'batch' END, 'queued',
                   :t - 100000 + g * (100000.0 / {shape.runs}), 0,
                   '{{"prompt": "fix the flaky test", "repo": "acme/repo-00001"}}'
            FROM generate_series(1, {shape.runs}) g""",
        """CREATE INDEX ix_fifo_dispatch ON fifo_jobs (queue, created_at, id)
           WHERE status = 'queued'""",
        """CREATE TABLE fifo_attempts (
               job_id VARCHAR(36) NOT NULL REFERENCES fifo_jobs (id),
               attempt_no INTEGER NOT NULL, worker_id VARCHAR(255) NOT NULL,
               started_at DOUBLE PRECISION NOT NULL,
               lease_expires_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, attempt_no))""",
    ]


# The unscheduled baseline: runlane's own queue as a plain FIFO (one tenant, one
# repository, one user, one priority, no limits, no routing), the same queues and
# timestamps as ``fifo_jobs``; admitted under an empty policy.
PLAIN_TENANT, PLAIN_REPO, PLAIN_USER = "tenant-0000", "acme/repo-00000", "dev-0"
PLAIN_PRIORITY = 100
PLAIN_ADMISSION = """json_build_object(
    'decision', 'ADMIT', 'reason_code', NULL, 'message', NULL, 'retry_after', NULL,
    'queue', s.queue, 'priority', s.priority, 'max_attempts', 3, 'risk_class', 'low',
    'requires', '', 'limits', json_build_object(), 'concurrency', json_build_object(),
    'weight', 1.0, 'policy_version', 1)"""


def plain_population(shape: Shape) -> list[str]:
    s = f"""
SELECT '10000000-0000-7000-8000-' || lpad(g::text, 12, '0') AS run_id,
       '00000000-0000-7000-8000-' || lpad(g::text, 12, '0') AS task_id,
       '{PLAIN_TENANT}' AS tenant, '{PLAIN_REPO}' AS repo, '{PLAIN_USER}' AS user_id,
       CASE WHEN (g / 1000) % 2 = 0 THEN 'default' ELSE 'batch' END AS queue,
       {PLAIN_PRIORITY} AS priority,
       :t - 100000 + g * (100000.0 / {shape.runs}) AS created_at
FROM generate_series(1, {shape.runs}) g
"""
    return [
        f"""INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,
                   context, truncated_sections, payload_bytes, created_at, user_id, requires)
            SELECT task_id, tenant, repo, 'fix the flaky test', queue, priority, 3,
                   '{{"ticket": "APP-1"}}', '[]', 40, created_at, user_id, ''
            FROM ({s}) s""",
        f"""INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                   tenant_at_limit)
            SELECT queue, '', priority, tenant, 1.0, COUNT(*), 0, 0
            FROM ({s}) s GROUP BY queue, priority, tenant""",
        f"""INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                   attempt_count, max_attempts, fencing_token, visible_at, created_at,
                   updated_at, cost_usd, user_id, risk_class, route_key, lane_id,
                   policy_version, limits, admission)
            SELECT s.run_id, s.task_id, s.tenant, s.repo, s.queue, s.priority, 'QUEUED', 0,
                   3, 0, s.created_at, s.created_at, s.created_at, 0, s.user_id, 'low',
                   '', l.lane_id, 1, '{{}}', {PLAIN_ADMISSION}
            FROM ({s}) s JOIN lanes l ON l.queue = s.queue AND l.route_key = ''
                 AND l.priority = s.priority AND l.tenant = s.tenant""",
    ]


SECONDARY_INDEXES = """
SELECT i.indexname, i.indexdef FROM pg_indexes i
WHERE i.tablename IN ('runs', 'tasks')
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
"""


def policy(shape: Shape) -> dict[str, Any]:
    weights = {f"tenant-{i:04d}": {"weight": 2.0 if i % 5 == 0 else 0.5}
               for i in range(shape.tenants) if i % 5 == 0 or i % 7 == 3}
    return {"concurrency": LIMITS_POLICY, "tenants": weights}


def populate(url: str, shape: Shape, *, plain: bool = False) -> dict[str, float]:
    """Migrate, fill the queues, apply the policy, VACUUM ANALYZE; seconds per step.
    ``plain``: the unscheduled runlane queue (``plain_population``, an empty policy)."""
    engine = build_engine(url)
    seconds: dict[str, float] = {}
    started = time.monotonic()
    try:
        upgrade(engine)
        with engine.begin() as conn:
            indexes = conn.execute(text(SECONDARY_INDEXES)).all()
            for index in indexes:  # rebuilt below: one sort each, not a million inserts
                conn.execute(text(f'DROP INDEX "{index.indexname}"'))
            conn.execute(text("SET LOCAL session_replication_role = replica"))  # no FK triggers
            conn.execute(text("SET LOCAL maintenance_work_mem = '256MB'"))
            params = {"t": conn.execute(text("SELECT EXTRACT(EPOCH FROM now())")).scalar(),
                      "gpu": GPU_ROUTE}
            for statement in plain_population(shape) if plain else population(shape):
                conn.execute(text(statement), params)
            seconds["insert"] = time.monotonic() - started
            for index in indexes:
                conn.execute(text(index.indexdef))
        seconds["index"] = time.monotonic() - started - seconds["insert"]
        store = Store(url, engine=engine)
        store.apply_policy(policy_from_document({} if plain else policy(shape)),
                           source="bench/scheduler.py")
        check_admissions(store)
    finally:
        engine.dispose()
    step = time.monotonic()
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    seconds["vacuum"] = time.monotonic() - step
    return seconds


def check_admissions(store: Store) -> None:
    """The synthetic admission records (ADMISSION) must be what admission decides, and
    the runs' own terms the decision's (as a submit writes them)."""
    version, in_force = store.current_policy()
    with store.engine.connect() as conn:
        sample = conn.execute(text(
            "SELECT run_id, tenant, repo, queue, priority, user_id, max_attempts, "
            "risk_class, route_key, limits, admission "
            "FROM runs TABLESAMPLE SYSTEM (1) LIMIT 200")).all()
    for row in sample:
        expected = admit(Store._request_of(row), in_force, version, TenantUsage(), 0.0)
        if expected.to_json() != row.admission or not same_terms(row, expected):
            raise SystemExit(f"run {row.run_id}: admission {row.admission} (terms "
                             f"{row.queue}, {row.priority}, {row.max_attempts}, "
                             f"{row.risk_class}, {row.route_key!r}, {row.limits}) is not "
                             f"policy v{version}'s {expected.to_json()}")


# --- the two claims ----------------------------------------------------------------------

FIFO_CLAIM = """
WITH picked AS (
    SELECT id FROM fifo_jobs
    WHERE queue = :queue AND status = 'queued'
    ORDER BY created_at, id
    LIMIT :limit
    FOR UPDATE SKIP LOCKED)
UPDATE fifo_jobs j
SET status = 'claimed', attempts = j.attempts + 1, worker_id = :worker,
    claimed_at = EXTRACT(EPOCH FROM clock_timestamp())
FROM picked WHERE j.id = picked.id
RETURNING j.id, j.attempts, j.claimed_at
"""
FIFO_ATTEMPT = """
INSERT INTO fifo_attempts (job_id, attempt_no, worker_id, started_at, lease_expires_at)
VALUES (:job_id, :attempt_no, :worker, :now, :expires)
"""


def numbered(statement: str) -> tuple[str, tuple[str, ...]]:
    """The text with $n placeholders, as runlane's hot statements are sent, and the
    parameter names in their order."""
    compiled = text(statement).compile(dialect=_NUMBERED_PG)
    return compiled.string, tuple(compiled.positiontup or ())


class Fifo:
    """The baseline: one UPDATE ... FROM (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING,
    then the attempt rows (executemany: one pipelined round trip), in one transaction;
    on an engine built like runlane's, and, like runlane's hot statements
    (``Store._driver_rows``), on psycopg's own cursor with ``$n`` placeholders."""

    def __init__(self, url: str) -> None:
        self.engine = build_engine(url)
        self.claim_sql, claim_names = numbered(FIFO_CLAIM)
        self.attempt_sql, attempt_names = numbered(FIFO_ATTEMPT)
        assert claim_names == ("queue", "limit", "worker")  # the order claim() passes
        assert attempt_names == ("job_id", "attempt_no", "worker", "now", "expires")

    def claim(self, limit: int) -> int:
        claim_sql, attempt_sql = self.claim_sql, self.attempt_sql
        with self.engine.begin() as conn:
            driver = conn.connection.driver_connection
            with psycopg.RawCursor(driver, row_factory=namedtuple_row) as cursor:
                for before in conn.dispatch.before_cursor_execute:  # the statement timer
                    before(conn, cursor, claim_sql, None, None, False)
                rows = cursor.execute(claim_sql, (QUEUE, limit, WORKER)).fetchall()
                for after in conn.dispatch.after_cursor_execute:
                    after(conn, cursor, claim_sql, None, None, False)
                if rows:
                    for before in conn.dispatch.before_cursor_execute:
                        before(conn, cursor, attempt_sql, None, None, True)
                    cursor.executemany(attempt_sql, [
                        (r.id, r.attempts, WORKER, r.claimed_at, r.claimed_at + 600.0)
                        for r in rows])
                    for after in conn.dispatch.after_cursor_execute:
                        after(conn, cursor, attempt_sql, None, None, True)
        return len(rows)


class Runlane:
    """``Store.claim`` with a GPU worker's capabilities (``capabilities=None``: a worker
    with none, for the unscheduled queue); holds ``IN_FLIGHT`` leases and completes the
    oldest beyond them (untimed), so slots are taken and given back."""

    def __init__(self, url: str, capabilities: dict[str, str] | None = GPU) -> None:
        self.store = Store(url)
        self.capabilities = capabilities
        self.held: deque[Lease] = deque()

    def claim(self, limit: int) -> int:
        leases = self.store.claim(WORKER, QUEUE, limit=limit, lease_ttl=600.0,
                                  capabilities=self.capabilities)
        self.held.extend(leases)
        return len(leases)

    def settle(self) -> None:
        while len(self.held) > IN_FLIGHT:
            self.store.complete(self.held.popleft())


# --- measurement ---------------------------------------------------------------------------


@dataclass
class Cell:
    system: str
    limit: int
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # client CPU per claim
    claimed: int = 0
    short: int = 0  # calls that returned fewer runs than asked
    by_round: list[float] = field(default_factory=list)  # p50 of each round

    def p(self, q: float) -> float:
        return percentile(self.seconds, q)

    @property
    def mean_cpu(self) -> float:
        return sum(self.cpu) / len(self.cpu)


def timed_claim(claim: Callable[[int], int], limit: int, cell: Cell) -> None:
    cpu, started = time.process_time(), time.perf_counter()
    got = claim(limit)
    cell.seconds.append(time.perf_counter() - started)
    cell.cpu.append(time.process_time() - cpu)
    cell.claimed += got
    cell.short += got < limit


SYSTEMS = ("fifo", "runlane", "plain")  # the bare queue, the scheduled claim, unscheduled
SYSTEM_NAMES = {"fifo": "FIFO (bare queue table)", "runlane": "runlane",
                "plain": "runlane, scheduling off"}


def measure(fifo: Fifo, runlane: Runlane, plain: Runlane,
            shape: Shape) -> dict[tuple[str, int], Cell]:
    cells = {(s, n): Cell(s, n) for s in SYSTEMS for n in LIMITS}
    claims: dict[str, Callable[[int], int]] = {
        "fifo": fifo.claim, "runlane": runlane.claim, "plain": plain.claim}
    settles: dict[str, Callable[[], None]] = {
        "fifo": lambda: None, "runlane": runlane.settle, "plain": plain.settle}
    for limit in LIMITS:  # warm-up: connections, prepared statements, caches
        for _ in range(shape.warmup):
            for system in SYSTEMS:
                claims[system](limit)
                settles[system]()
    for round_no in range(shape.rounds):
        start = {key: len(cell.seconds) for key, cell in cells.items()}
        for limit in LIMITS:
            for i in range(shape.samples):
                first = i % len(SYSTEMS)  # A B C, B C A, C A B, ...
                for system in SYSTEMS[first:] + SYSTEMS[:first]:
                    timed_claim(claims[system], limit, cells[(system, limit)])
                    settles[system]()
        for key, cell in cells.items():
            cell.by_round.append(percentile(cell.seconds[start[key]:], 50))
        progress(f"round {round_no + 1}/{shape.rounds}: " + ", ".join(
            f"{s} x{n} p50 {cells[(s, n)].by_round[-1] * 1000:.2f} ms"
            for s, n in cells))
    return cells


# --- per-statement profile ------------------------------------------------------------------


def _normal(statement: str) -> str:
    out = re.sub(r"%\(\w+\)s(?:::\w+)?", "?", statement)
    out = re.sub(r"(?<![:\w]):\w+", "?", out)
    out = re.sub(r"\$\d+", "?", out)  # psycopg's RawCursor (Store._driver_rows)
    out = re.sub(r"\s+", " ", out).strip()
    out = re.sub(r"IN \((?:\?, )*\?\)", "IN ?", out)
    return re.sub(r"IN \(SELECT CAST\(NULL AS [^)]*\) WHERE 1 ?!= ?1\)", "IN ?", out)


def statement_names() -> dict[str, str]:
    """Normalised text -> name, for every statement of the ``*_sql`` modules as rendered for
    PostgreSQL, plus the few the store builds itself."""
    names = {}
    modules = (audit_sql, claim_sql, lanes_sql, lease_sql, policy_sql, providers_sql,
               reads_sql, recount_sql, slots_sql, submit_sql)
    for name, value in ((n, v) for m in modules for n, v in vars(m).items()):
        if name.isupper() and isinstance(value, dict) and "postgresql" in value:
            value = value["postgresql"]  # a statement with per-dialect texts
        if name.isupper() and isinstance(value, str):
            try:
                names[_normal(PG.render(value).text)] = name
            except (KeyError, IndexError, ValueError):
                continue
    names[_normal(PG.render("SELECT {now} AS now").text)] = "_now (SELECT now)"
    return names


class StatementTimer:
    """Wall time of every statement an engine runs (before/after_cursor_execute),
    by name; ``record`` switches it on."""

    def __init__(self, engine: Engine) -> None:
        self.names = statement_names()
        self.record = False
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self._started: list[float] = []
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)

    def name(self, statement: str) -> str:
        normal = _normal(statement)
        if normal in self.names:
            return self.names[normal]
        if normal.replace("%%", "%") in self.names:  # a literal % as the driver gets it
            return self.names[normal.replace("%%", "%")]
        if "unnest(" in normal:
            return "INSERT run_events (unnest)"
        if "fifo_jobs" in normal:
            return "FIFO claim (SELECT ... SKIP LOCKED + UPDATE ... RETURNING)"
        if "fifo_attempts" in normal:
            return "FIFO attempt INSERT"
        return normal[:60]

    def _before(self, *_: Any) -> None:
        self._started.append(time.perf_counter())

    def _after(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        elapsed = time.perf_counter() - self._started.pop()
        if self.record:
            key = self.name(statement)
            self.calls[key] = self.calls.get(key, 0) + 1
            self.seconds[key] = self.seconds.get(key, 0.0) + elapsed


@dataclass
class Profile:
    system: str
    limit: int
    claims: int
    total: float  # seconds, all claims
    calls: dict[str, int]
    seconds: dict[str, float]


def profile(claim: Callable[[int], int], engine: Engine, system: str, limit: int, n: int,
            settle: Callable[[], None] | None = None) -> Profile:
    timer = StatementTimer(engine)
    total = 0.0
    try:
        for _ in range(n):
            timer.record = True
            started = time.perf_counter()
            claim(limit)
            total += time.perf_counter() - started
            timer.record = False
            if settle is not None:
                settle()
    finally:
        event.remove(engine, "before_cursor_execute", timer._before)
        event.remove(engine, "after_cursor_execute", timer._after)
    return Profile(system, limit, n, total, timer.calls, timer.seconds)


def python_profile(runlane: Runlane, limit: int, n: int) -> str:
    """cProfile of ``n`` runlane claims: the client-side functions by own time."""
    profiler = cProfile.Profile()
    for _ in range(n):
        profiler.enable()
        runlane.claim(limit)
        profiler.disable()
        runlane.settle()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    text_ = out.getvalue()
    root = str(Path(sys.prefix))
    lines = [line.replace(root + "/lib/python3.11/site-packages/", "")
             for line in text_.splitlines() if line.strip()]
    return "\n".join(line for line in lines
                     if not line.strip().startswith(("Ordered by", "List reduced")))


# --- EXPLAIN ------------------------------------------------------------------------------


@dataclass
class Explained:
    name: str
    note: str
    plan_text: str
    index: str  # the index it should walk
    table: str
    read: dict[str, int]  # rows read per table
    bound: int
    sorted_rows: int  # rows into the largest Sort node (0: none)
    sort_bound: int  # a Sort may merge this many rows (pages walked in order)
    bitmap: bool
    seq: list[str]
    ms: float
    ordered: bool  # ORDER BY / LIMIT / MIN: must walk its index in order

    @property
    def bounded(self) -> bool:
        in_order = not self.ordered or (self.sorted_rows <= self.sort_bound
                                         and not self.bitmap)
        return (in_order and not self.seq
                and all(n <= self.bound for t, n in self.read.items()
                        if t in (self.table, "tasks")))


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    stack = [plan["Plan"]]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.get("Plans", []))


def _reads(plan: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in _nodes(plan):
        if node["Node Type"] in ("Seq Scan", "Index Scan", "Index Only Scan", "Bitmap Heap Scan"):
            rows = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
                    + node.get("Rows Removed by Index Recheck", 0)) * node["Actual Loops"]
            out[node["Relation Name"]] = out.get(node["Relation Name"], 0) + int(rows)
    return out


def _trim(lines: Sequence[str], width: int = 150) -> str:
    """Long lines (the IN lists of a Filter) cut at ``width``."""
    return "\n".join(line if len(line) <= width else line[:width - 3] + "..."
                     for line in lines)


def _compiled(conn: Connection, statement: TextClause, params: dict[str, Any]
              ) -> tuple[str, list[Any]]:
    """The text psycopg would send (IN lists expanded), with $n placeholders."""
    compiled = statement.bindparams(**params).compile(
        dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    values: list[Any] = []

    def placeholder(match: re.Match[str]) -> str:
        values.append(compiled.params[match.group(1)])
        return f"${len(values)}"

    return re.sub(r"%\((\w+)\)s", placeholder, compiled.string), values


def bind(statement: str, params: dict[str, Any]) -> tuple[TextClause, dict[str, Any]]:
    """A named statement (``*_sql``) rendered as the store renders it (``IN :name`` lists
    expanding) with the parameters it takes out of ``params``."""
    names = set(re.findall(r"(?<![:\w]):(\w+)", PG.render(statement).text))
    expanding = re.findall(r"\bIN\s+:(\w+)", statement)
    return PG.render(statement, *expanding), {k: v for k, v in params.items() if k in names}


def explain(conn: Connection, name: str, statement: str, params: dict[str, Any], *,
            index: str, table: str, bound: int, note: str = "", generic: bool = False,
            ordered: bool = True, sort_bound: int = 0) -> Explained:
    """EXPLAIN (ANALYZE, BUFFERS) as text and as JSON, each in a rolled-back transaction;
    ``generic``: PREPAREd and run with plan_cache_mode = force_generic_plan."""
    body, values = _compiled(conn, *bind(statement, params))
    raw = cast(psycopg.Connection[Any], conn.connection.driver_connection)
    literals = ", ".join(Literal(v).as_string(raw) for v in values)
    out: dict[str, Any] = {}
    for kind in ("TEXT", "JSON"):
        with raw.cursor() as cursor:
            if generic:
                cursor.execute(b"SET plan_cache_mode = force_generic_plan")
                cursor.execute(f"PREPARE bench_probe AS {body}".encode())
                run = f"EXECUTE bench_probe({literals})"
            else:
                run = re.sub(r"\$(\d+)", lambda m: Literal(values[int(m.group(1)) - 1])
                             .as_string(raw), body)
            cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT {kind}) {run}".encode())
            out[kind] = cursor.fetchall()
        raw.rollback()
        if generic:
            with raw.cursor() as cursor:
                cursor.execute(b"DEALLOCATE bench_probe")
                cursor.execute(b"RESET plan_cache_mode")
    plan: dict[str, Any] = out["JSON"][0][0][0]
    lines = [str(r[0]) for r in out["TEXT"]]
    nodes = list(_nodes(plan))
    return Explained(
        name=name, note=note, plan_text=_trim(lines), index=index, table=table,
        read=_reads(plan), bound=bound,
        sorted_rows=max((sum(int(c["Actual Rows"] * c["Actual Loops"])
                             for c in n.get("Plans", []))
                         for n in nodes if "Sort" in n["Node Type"]), default=0),
        sort_bound=sort_bound,
        bitmap=any(n["Node Type"] == "Bitmap Heap Scan" for n in nodes),
        seq=sorted({n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"
                    and n["Relation Name"] in ("runs", "tasks", "lanes", "limit_counters",
                                               "fifo_jobs")}),
        ms=float(plan["Execution Time"]), ordered=ordered)


def explain_all(url: str) -> list[Explained]:
    engine = build_engine(url)
    out: list[Explained] = []
    try:
        with engine.connect() as conn:
            full = conn.execute(text(
                "SELECT scope FROM limit_counters WHERE active >= max_active")).scalars().all()

            def names(kind: str) -> list[str]:
                return sorted(s.removeprefix(f"{kind}:") for s in full
                              if s.startswith(f"{kind}:"))

            routes = sorted(["", GPU_ROUTE])
            pick = {"queue": QUEUE, "routes": routes, "full_tenants": names("tenant"),
                    "limit": 16, "after_priority": -(2**31), "after_pass": float("-inf"),
                    "after_lane": -1, "now": None}
            lanes = conn.execute(*bind(claim_sql.PICK_LANES["postgresql"], pick)).all()
            conn.rollback()

            def candidates(lane_ids: list[int], limit: int) -> dict[str, Any]:
                return {"lane_ids": lane_ids, "shares": [limit] * len(lane_ids),
                        "now": None, "after_created": [float("-inf")] * len(lane_ids),
                        "after_ids": [""] * len(lane_ids)}

            found = (conn.execute(*bind(LANE_RUNS, candidates([r.lane_id], 1))).first()
                     for r in lanes)
            firsts = [c for c in found if c is not None][:10]
            conn.rollback()
            lane = next(r for r in lanes if r.lane_id == firsts[0].lane_id)
            lane_size = int(conn.execute(text(
                "SELECT COUNT(*) FROM runs WHERE lane_id = :l AND status = 'QUEUED'"),
                {"l": lane.lane_id}).scalar_one())
            scopes_one = sorted({"global", f"tenant:{firsts[0].tenant}",
                                 f"repo:{firsts[0].repo}", f"user:{firsts[0].user_id}"})
            scopes_ten = sorted({"global"} | {s for c in firsts for s in (
                f"tenant:{c.tenant}", f"repo:{c.repo}", f"user:{c.user_id}")})
            n_full = len(full)
            out.append(explain(conn, "FULL_SCOPES", claim_sql.FULL_SCOPES, {},
                               index="ix_limit_counters_full", table="limit_counters",
                               bound=n_full, note=f"{n_full} full counters", ordered=False))
            out.append(explain(conn, "PICK_LANES", claim_sql.PICK_LANES["postgresql"], pick,
                               index="ix_lanes_route_pick", table="lanes", bound=33,
                               sort_bound=32,
                               note="a GPU worker's first page of 16 lanes: a page per "
                                    "served route (2), merged (+1: the MIN(wake_at) probe)"))
            plain = {**pick, "routes": [""]}
            out.append(explain(conn, "PICK_LANES (no GPU)", claim_sql.PICK_LANES["postgresql"],
                               plain, index="ix_lanes_route_pick", table="lanes", bound=17,
                               sort_bound=16,
                               note="a worker without a GPU: the GPU lanes nobody serves "
                                    "sort first and are not read"))
            for wanted in (1, 10):
                out.append(explain(
                    conn, f"PICK_AND_WALK_PG (limit {wanted})", claim_sql.PICK_AND_WALK_PG,
                    {**pick, "wanted": wanted}, index="ix_runs_lane_dispatch", table="runs",
                    bound=4 * wanted, sort_bound=32,
                    note=f"PostgreSQL's pick of 16 lanes and the walk of the lanes a claim "
                         f"of {wanted} can share out to, one statement"))
            version = int(conn.execute(text(
                "SELECT COALESCE(MAX(version), 0) FROM policy_versions")).scalar_one())
            for wanted in (1, 10):
                out.append(explain(
                    conn, f"CLAIM_ONE_TRIP_PG (limit {wanted})", claim_sql.CLAIM_ONE_TRIP_PG,
                    {**pick, "wanted": wanted, "version": version, "worker_id": WORKER,
                     "ttl": 600.0},
                    index="ix_runs_lane_dispatch", table="runs", bound=4 * wanted,
                    ordered=False,  # the full tenants' lanes: a bitmap scan by tenant
                    note=f"the whole claim of {wanted} in one statement: the page of 16 "
                         "lanes, the shares, the walk and the writes"))
            out.append(explain(conn, "LANE_RUNS", LANE_RUNS,
                               candidates([lane.lane_id], 1), index="ix_runs_lane_dispatch",
                               table="runs", bound=4,
                               note=f"the first lane with a runnable run ({lane_size:,} "
                                    "queued runs), limit 1"))
            out.append(explain(conn, "LANE_RUNS (generic plan)", LANE_RUNS,
                               candidates([lane.lane_id], 1), index="ix_runs_lane_dispatch",
                               table="runs", bound=4, generic=True,
                               note="the plan a prepared statement may settle on"))
            out.append(explain(conn, "LANE_RUNS (10 lanes)", LANE_RUNS,
                               candidates([r.lane_id for r in lanes[:10]], 1),
                               index="ix_runs_lane_dispatch", table="runs", bound=40,
                               note="a claim of 10 shared over 10 lanes, one statement"))
            out.append(explain(conn, "ENSURE_COUNTER", slots_sql.ENSURE_COUNTER,
                               {"scope": scopes_one[-1], "active": 0, "max_active": 5,
                                "version": 1},
                               index="limit_counters_pkey", table="limit_counters", bound=1,
                               note="one scope (executemany: one per scope)", ordered=False))
            out.append(explain(conn, "LOCK_SCOPES", slots_sql.LOCK_SCOPES["postgresql"],
                               {"scopes": scopes_ten}, index="limit_counters_pkey",
                               table="limit_counters", bound=len(scopes_ten),
                               # It sorts the claim's own scopes (the lock order), not
                               # rows of the table.
                               sort_bound=len(scopes_ten),
                               note=f"the {len(scopes_ten)} scopes of a claim of 10"))
            claimed_lanes = sorted({c.lane_id for c in firsts})
            maxima = conn.execute(text(
                "SELECT max_active FROM limit_counters WHERE scope = ANY(:s) ORDER BY scope"),
                {"s": scopes_ten}).scalars().all()
            out.append(explain(conn, "CLAIM_WRITE_PG", claim_sql.CLAIM_WRITE_PG, {
                "now": None, "slot_scopes": scopes_ten, "slot_counts": [0] * len(scopes_ten),
                "slot_max": maxima,
                "run_ids": sorted(c.run_id for c in firsts), "estimated": [None] * len(firsts),
                "scopes": [None] * len(firsts), "worker_id": WORKER, "ttl": 600.0,
                "lane_ids": claimed_lanes, "lane_counts": [1] * len(claimed_lanes),
                "lane_gone": [0] * len(claimed_lanes), "also_full": [], "ahead": 1e-6},
                index="runs_pkey", table="runs", bound=len(firsts),
                note=f"the writes of a claim of {len(firsts)} runs in one statement (slots, "
                     "compare-and-set, attempts, events, lanes)", ordered=False))
            out.append(explain(conn, "LANE_VIRTUAL_TIME", lanes_sql.LANE_VIRTUAL_TIME,
                               {"queue": QUEUE, "priority": 50}, index="ix_lanes_pick",
                               table="lanes", bound=1, note="submit path"))
            out.append(explain(conn, "FIFO claim", FIFO_CLAIM,
                               {"queue": QUEUE, "limit": 10, "worker": WORKER},
                               index="ix_fifo_dispatch", table="fifo_jobs", bound=40,
                               note="the baseline, limit 10"))
    finally:
        engine.dispose()
    return out


# --- environment and report -------------------------------------------------------------


def lscpu() -> str:
    """Model, CPUs, cores and hypervisor, as lscpu prints them."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return f"{cpu_model()}, {os.cpu_count()} CPUs"
    facts = {k.strip(): v.strip() for k, _, v in
             (line.partition(":") for line in out.splitlines() if ":" in line)}
    text_ = (f"{facts.get('Model name', cpu_model())}, {facts.get('CPU(s)', '?')} CPUs "
             f"({facts.get('Core(s) per socket', '?')} cores per socket, "
             f"{facts.get('Thread(s) per core', '?')} thread(s) per core)")
    if facts.get("Hypervisor vendor"):
        text_ += f", {facts['Hypervisor vendor']} virtual machine"
    return text_


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


@dataclass
class Report:
    command: str
    started: datetime
    shape: Shape
    environment: list[tuple[str, str]]
    populate: dict[str, float]
    populate_plain: dict[str, float]
    cells: dict[tuple[str, int], Cell]
    profiles: list[Profile]
    cprofile: str
    plans: list[Explained]
    busy_cores: float
    client_cores: float
    wall: float = 0.0

    def ratio(self, limit: int, baseline: str = "fifo") -> float:
        return self.cells[("runlane", limit)].p(50) / self.cells[(baseline, limit)].p(50)

    def render(self) -> str:
        n = self.shape.runs
        out = [START, f"## Scheduler claim at {n:,} queued runs: `bench/scheduler.py`", ""]
        out.append(
            f"Produced by `{self.command}` on {self.started:%Y-%m-%d %H:%M} UTC; the whole "
            f"run took {self.wall / 60:.1f} min. Every figure below comes from that run.")
        out += ["", table(["", ""], self.environment, "ll"), ""]
        unbounded = [p for p in self.plans if not p.bounded and not p.name.startswith("FIFO")]
        baselines = {"fifo": "a bare FIFO queue table's claim + attempt rows",
                     "plain": "runlane's own claim with the scheduling off (one tenant, "
                              "no limits, no routing)"}
        out += ["### Targets", "", table(["What", "Target", "Measured", ""], [
            *[(f"runlane `Store.claim(limit={k})` p50 / {baselines[b]} p50 (same run, "
               "interleaved)", f"<= {TARGET_RATIO}",
               f"{ms(self.cells[('runlane', k)].p(50))} / {ms(self.cells[(b, k)].p(50))} "
               f"ms = **{self.ratio(k, b):.2f}x**",
               "met" if self.ratio(k, b) <= TARGET_RATIO else
               f"**missed** by {self.ratio(k, b) / TARGET_RATIO:.2f}x")
              for b in baselines for k in LIMITS],
            ("claim-path statements reading rows in proportion to the data (EXPLAIN below)",
             "none", ", ".join(p.name for p in unbounded) or "none",
             "met" if not unbounded else "**missed**"),
        ], "llrl"), ""]
        out += self.render_reading()
        out += self.render_latency()
        if lifecycle.DETAILS:
            out += self.render_profile()
        out += self.render_plans()
        out += self.render_method()
        out += [END, ""]
        return "\n".join(out)

    def render_reading(self) -> list[str]:
        """Why the target is missed, from this run's figures, and what would close it."""
        if all(self.ratio(k) <= TARGET_RATIO for k in LIMITS) and all(
                p.bounded for p in self.plans):
            return []
        prof = {(p.system, p.limit): p for p in self.profiles}
        lines = ["### Why the target is missed against the bare queue", ""]
        for k in LIMITS:
            r, f = prof[("runlane", k)], prof[("FIFO", k)]
            u = prof[(SYSTEM_NAMES["plain"], k)]
            statements = sum(r.calls.values()) / r.claims
            one_trip = r.calls.get("CLAIM_ONE_TRIP_PG", 0) / r.claims
            top = sorted(r.seconds, key=lambda name: -r.seconds[name])[:3]
            lines.append(
                f"- **Limit {k}**: {ms(self.cells[('runlane', k)].p(50))} against "
                f"{ms(self.cells[('fifo', k)].p(50))} ms. A runlane claim sends "
                f"{statements:.2f} statements ({one_trip:.2f} of them the one-statement "
                "claim, autocommit: no BEGIN, no COMMIT), each its own round trip; FIFO "
                f"{sum(f.calls.values()) / f.claims:.0f} between BEGIN and COMMIT; "
                f"{sum(r.seconds.values()) / r.claims * 1000:.1f} ms per claim inside them "
                f"(FIFO {sum(f.seconds.values()) / f.claims * 1000:.1f}). Costliest: "
                + ", ".join(f"{name} {r.seconds[name] / r.claims * 1000:.1f} ms "
                            f"({r.calls[name] / r.claims:.0f}x)" for name in top)
                + f". Client CPU {ms(self.cells[('runlane', k)].mean_cpu)} ms per claim "
                f"(FIFO {ms(self.cells[('fifo', k)].mean_cpu)}). With the scheduling off, "
                f"runlane's claim takes {ms(self.cells[('plain', k)].p(50))} ms "
                f"({sum(u.calls.values()) / u.claims:.2f} statements, "
                f"{sum(u.seconds.values()) / u.claims * 1000:.1f} ms inside them, client CPU "
                f"{ms(self.cells[('plain', k)].mean_cpu)} ms): the rows every claim writes "
                "(the run, its attempt and lease, its event) cost that much before any "
                "scheduling.")
        unbounded = [p.name for p in self.plans if not p.bounded]
        if unbounded:
            lines.append(f"- Scans that grow with the data: {', '.join(unbounded)} "
                         "(plans below).")
        lines += [
            "", "Done: the claim is one autocommit statement when nothing needs Python "
            "(CLAIM_ONE_TRIP_PG, 2026-12-01: the page of lanes, the shares dealt in SQL, "
            "each lane walked for its share, the slots, the compare-and-set, the attempts, "
            "the events and the lanes; the decision recorded at admission stands for the "
            "check at claim while its policy version is in force); otherwise a transaction "
            "of two statements (PICK_AND_WALK_PG, CLAIM_WRITE_PG). What is left, by the "
            "profile: the statement's server time (a counter per scope, the run, an "
            "attempt, an event and a lane written per run, and the commit, against FIFO's "
            "one row and one attempt) and Python per claim.", ""]
        return lines

    def render_latency(self) -> list[str]:
        s = self.shape
        rows = []
        for limit in LIMITS:
            for system in SYSTEMS:
                c = self.cells[(system, limit)]
                rows.append((SYSTEM_NAMES[system], str(limit), f"{len(c.seconds):,}",
                             f"{c.short:,}",
                             ms(c.p(50)), ms(c.p(95)), ms(c.p(99)),
                             " / ".join(ms(x) for x in c.by_round),
                             ms(c.mean_cpu)))
        return ["### Claim latency", "",
                f"{s.rounds} rounds; in each, for each claim limit, {s.samples} triples of "
                "claims in rotating order (A B C, B C A, C A B, ...), after "
                f"{s.warmup} untimed warm-up claims each. runlane: `Store.claim(worker, "
                f"'{QUEUE}', limit=L, capabilities={json.dumps(GPU)})` on the store's own "
                "engine; it holds "
                f"{IN_FLIGHT} leases and completes the oldest beyond them, untimed. FIFO: "
                "`UPDATE fifo_jobs ... FROM (SELECT ... ORDER BY created_at, id LIMIT L FOR "
                "UPDATE SKIP LOCKED) ... RETURNING` + the attempt rows (executemany), one "
                "transaction, on an engine built by `build_engine` like the store's "
                f"(psycopg 3, prepare_threshold 2, `{PLANNER_OPTIONS}`). runlane, scheduling "
                f"off: `Store.claim(worker, '{QUEUE}', limit=L)` (no capabilities) on its own "
                f"database of {s.runs:,} runs in one tenant, one repository and one priority, "
                "under an empty policy (no limits, no weights, no routes), holding leases "
                "like runlane's: the same attempt, lease and event rows, without the "
                "scheduling. Latency is the wall "
                "time of the "
                "call, commit included; client CPU is this process's CPU per call.", "",
                table(["System", "Limit", "Samples", "Short", "p50 ms", "p95 ms", "p99 ms",
                       "p50 by round ms", "Client CPU ms"], rows, "lr"), "",
                "Short: calls that returned fewer runs than asked (the queue never runs "
                "dry here; for runlane, a candidate that lost its slot to another run of the "
                "same claim).", ""]

    def render_profile(self) -> list[str]:
        out = ["### Where the claim spends its time", "",
               f"{self.shape.profile} more claims per system and limit with a statement timer "
               "(SQLAlchemy before/after_cursor_execute on the engine: wall time of each "
               "statement's execute, round trip included; psycopg sends BEGIN inside the "
               "first statement's execute). \"Outside statements\" is the rest of the "
               "call: COMMIT, pool checkout/checkin and Python.", ""]
        for p in self.profiles:
            per_claim = p.total / p.claims
            inside = sum(p.seconds.values())
            rows = [(name, f"{p.calls[name] / p.claims:.1f}",
                     f"{p.seconds[name] / p.claims * 1000:.3f}",
                     f"{p.seconds[name] / p.total * 100:.0f}%",
                     f"{p.seconds[name] / p.calls[name] * 1000:.3f}")
                    for name in sorted(p.seconds, key=lambda k: -p.seconds[k])]
            rows.append(("outside statements", "", f"{(p.total - inside) / p.claims * 1000:.3f}",
                         f"{(p.total - inside) / p.total * 100:.0f}%", ""))
            rows.append(("**total (mean per claim)**", f"{sum(p.calls.values()) / p.claims:.1f}",
                         f"**{per_claim * 1000:.3f}**", "100%", ""))
            out += [f"**{p.system}, limit {p.limit}** ({p.claims} claims):", "",
                    table(["Statement", "Calls / claim", "ms / claim", "Share", "ms / call"],
                          rows, "lrrrr"), ""]
        out += [f"Client side of runlane's claim (limit 10): cProfile of {self.shape.profile} "
                "claims, the functions with the most own time (profiling inflates the "
                "total; waiting for the server shows as psycopg's `wait`):", "",
                "```text", self.cprofile, "```", ""]
        return out

    def render_plans(self) -> list[str]:
        rows = [(p.name, p.note, p.index,
                 ", ".join(f"{t} {n:,}" for t, n in sorted(p.read.items())) or "-",
                 f"{p.bound:,}", f"{p.ms:.3f}",
                 "bounded" if p.bounded else "**NOT bounded**: " + "; ".join(
                     x for x in [
                         f"sorts {p.sorted_rows:,} rows" if p.ordered
                         and p.sorted_rows > p.sort_bound else "",
                         "bitmap scan" if p.bitmap and p.ordered else "",
                         f"seq scan of {', '.join(p.seq)}" if p.seq else "",
                         *(f"reads {n:,} rows of {t} (bound {p.bound:,})"
                           for t, n in p.read.items()
                           if t in (p.table, "tasks") and n > p.bound)] if x))
                for p in self.plans]
        out = ["### Query plans of the claim path", "",
               "EXPLAIN (ANALYZE, BUFFERS) on this database after the measurement, each in a "
               "transaction that is rolled back, with the parameters a claim of the GPU "
               "worker would use. Rows read: rows produced by scan nodes plus those their "
               "filters dropped, per table (tasks: the per-candidate re-check). Bounded: no "
               "sequential scan of a large table, rows read within the bound, and for a "
               "statement with ORDER BY/LIMIT/MIN an ordered index walk (no Sort, no bitmap "
               "scan). `tests/test_dispatch_explain.py` checks the "
               "same on 1,000,000 runs with planted unrunnable rows and pins each unbounded "
               "case with a strict xfail.", "",
               table(["Statement", "Case", "Index it should use", "Rows read", "Bound",
                      "Exec ms", "Verdict"], rows, "lllrrrl"), ""]
        if not lifecycle.DETAILS:
            out += ["`--details` prints each plan, and where each claim spends its time "
                    "(per statement, and a profile of the client).", ""]
        for p in self.plans if lifecycle.DETAILS else []:
            out += [f"`{p.name}` ({p.note}):", "", "```text", p.plan_text, "```", ""]
        return out

    def render_method(self) -> list[str]:
        s = self.shape
        return ["### Data and method", "",
                f"- Data: {s.runs:,} QUEUED runs with their tasks over {s.tenants:,} tenants, "
                f"{s.repos:,} repositories (each one tenant's) and {s.users:,} users; queues "
                "`default`/`batch`, priorities 50/100/150; 2% of runs in backoff for an hour; "
                "a quarter of the runs of the tenants ending in 7 require `gpu=a100` (their "
                "own lanes); one lane per (queue, route, priority, tenant), built with INSERT "
                "... SELECT ... GROUP BY, `runs.lane_id` set, passes spread by hash. Counters "
                "for the global scope and every tenant, repository and user "
                f"({1 + s.tenants + s.repos + s.users:,}); {FULL_TENANTS} tenants and "
                f"{FULL_REPOS} repositories are full. Policy v1: "
                + ", ".join(f"{k} = {v}" for k, v in LIMITS_POLICY.items())
                + "; weight 2 for tenants divisible by 5, 0.5 for those = 3 mod 7. "
                f"`fifo_jobs`: {s.runs:,} rows, the same queues and timestamps.",
                "- Populate: " + ", ".join(f"{k} {v:.0f} s" for k, v in self.populate.items())
                + "; the unscheduled database: " + ", ".join(
                    f"{k} {v:.0f} s" for k, v in self.populate_plain.items())
                + " (secondary indexes of runs and tasks rebuilt after the inserts; then "
                "VACUUM ANALYZE).",
                f"- Machine load while measuring: {self.busy_cores:.2f} of "
                f"{os.cpu_count()} cores busy on average (all processes), of which this "
                f"benchmark's client {self.client_cores:.2f}; the rest is PostgreSQL (both "
                "systems' backends) and whatever else ran. Figures from a busy machine "
                "measure contention too; the interleaving spreads it over the three systems.",
                "- The systems share the server, the depth and the client; FIFO never "
                "completes its jobs, so the FIFO index keeps its dead head entries as runlane's "
                "does (no VACUUM during the measurement; autovacuum may run).", ""]


# --- main -----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.runs:,} runs and fewer samples: a smoke run")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL,
                        help="a server and any database on it (default %(default)s)")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved samples")
    parser.add_argument("--samples", type=int, help="pairs per round and claim limit")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="also put the Markdown section into PATH (e.g. docs/benchmarks.md)")
    lifecycle.add_details_flag(parser)
    args = parser.parse_args(argv)
    lifecycle.DETAILS = args.details
    configure_logging("WARNING")
    shape = QUICK if args.quick else FULL
    if args.rounds or args.samples:
        shape = replace(shape, rounds=args.rounds or shape.rounds,
                        samples=args.samples or shape.samples)
    started = datetime.now(UTC)
    wall = time.monotonic()
    name = f"runlane_bench_sched_{os.getpid()}"
    names = (name, f"{name}_plain")
    with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
        for database in names:
            admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
            admin.execute(f'CREATE DATABASE "{database}"'.encode())
    url, plain_url = (with_database(args.postgres_url, database) for database in names)
    load_before = load_average()
    try:
        progress(f"populating {name}: {shape.runs:,} runs + {shape.runs:,} FIFO jobs")
        seconds = populate(url, shape)
        progress("populated: " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()))
        progress(f"populating {names[1]}: {shape.runs:,} runs, scheduling off")
        plain_seconds = populate(plain_url, shape, plain=True)
        progress("populated: " + ", ".join(f"{k} {v:.1f}s" for k, v in plain_seconds.items()))
        fifo, runlane, plain = Fifo(url), Runlane(url), Runlane(plain_url, capabilities=None)
        busy0, total0, cpu0, t0 = *cpu_busy(), time.process_time(), time.monotonic()
        cells = measure(fifo, runlane, plain, shape)
        busy1, total1 = cpu_busy()
        elapsed = time.monotonic() - t0
        ncpu = os.cpu_count() or 1
        busy_cores = (busy1 - busy0) / (total1 - total0) * ncpu if total1 > total0 else 0.0
        client_cores = (time.process_time() - cpu0) / elapsed
        progress("profiling statements")
        profiles = []
        for limit in LIMITS:
            profiles.append(profile(fifo.claim, fifo.engine, "FIFO", limit, shape.profile))
            profiles.append(profile(runlane.claim, runlane.store.engine, "runlane", limit,
                                    shape.profile, runlane.settle))
            profiles.append(profile(plain.claim, plain.store.engine,
                                    SYSTEM_NAMES["plain"], limit, shape.profile,
                                    plain.settle))
        cprofile = python_profile(runlane, 10, shape.profile)
        runlane.store.close()
        plain.store.close()
        fifo.engine.dispose()
        progress("EXPLAIN")
        plans = explain_all(url)
        facts = postgres_facts(url)
        environment = [
            ("Date (UTC)", f"{started:%Y-%m-%d %H:%M:%S}"),
            ("Machine", f"{lscpu()}; {memory_total()} RAM"),
            ("OS", f"Linux {platform.release()}"),
            ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
            ("PostgreSQL", f"{facts['server_version']} on the same machine; shared_buffers "
                           f"{facts['shared_buffers']}, work_mem {facts['work_mem']}, "
                           f"synchronous_commit {facts['synchronous_commit']}, fsync "
                           f"{facts['fsync']}"),
            ("runlane", runlane_source()),
            ("Load average (1/5/15 min)", f"{load_before} at start, {load_average()} at end"),
        ]
        report = Report(display_command([sys.argv[0], *(argv or sys.argv[1:])]), started,
                        shape, environment, seconds, plain_seconds, cells, profiles,
                        cprofile, plans, busy_cores, client_cores)
        report.wall = time.monotonic() - wall
        section = report.render()
    finally:
        with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
            for database in names:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
    sys.stdout.write(section)
    if args.write is not None:
        merge_section(args.write, section, START, END)
        progress(f"wrote {args.write}")
    for limit in LIMITS:
        progress(f"limit {limit}: runlane p50 / FIFO p50 = {report.ratio(limit):.2f}, "
                 f"/ runlane with scheduling off = {report.ratio(limit, 'plain'):.2f} "
                 f"(target <= {TARGET_RATIO})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
