"""The HTTP API's speed targets (issue 23), against a real ``runlane serve`` process.

1. **Runs list.** ``GET /v1/runs?tenant=T&status=S&limit=50`` at 1,000,000 runs on
   PostgreSQL (populated set-based: runs and tasks over ``--tenants`` tenants and four
   statuses, created over 30 days; the listing indexes built after the insert, then
   VACUUM ANALYZE): the first page and a deep page (reached by following ``next``
   cursors), for a common and a rarer status, with an admin token (``tenant=`` in the
   query) and with the tenant's ``read`` token. The app has no server-timing header, so
   the figure is the client's round trip on loopback (one keep-alive connection), an
   upper bound of the server's time; next to it, in the same run and interleaved, the
   same page through the facade in this process (``Runlane.runs_page``: the server's
   work without HTTP, authentication and JSON). The plan is EXPLAIN (ANALYZE, BUFFERS)
   of the statement the facade sends for that page, captured at the cursor (its text
   and parameters), as psycopg sends it (a custom plan) and as a prepared statement's
   generic plan (psycopg prepares a statement from its second execution).
2. **Batch submit.** ``POST /v1/tasks/batch`` with a tenant's ``submit`` token, batches
   of ``--batch`` tasks with idempotency keys (the JSON body encoded before timing),
   against ``Runlane.submit_batch`` and ``Store.submit`` in this process, in rotating
   order per round, on a fresh PostgreSQL database and on SQLite (for information).
3. **SSE.** ``--clients`` streams on ``GET /v1/events`` (half with an admin token, half
   with the tenant's ``read`` token) in a second process (asyncio, httpx); this process
   makes transitions through the facade (a submit, then the cancel of that task, ...)
   against the 1,000,000-run database and takes the commit time when the call returns;
   the latency of a delivery is the client's receive time minus that (CLOCK_MONOTONIC,
   one clock for both processes). Beside them a bare ``LISTEN runlane_events``
   connection in the client process gives the floor: commit to notification.

After the timed parts, py-spy (when installed in the venv: ``pip install py-spy``;
``--no-profile`` skips it) samples the server during untimed repeats of each part;
``RUNLANE_BENCH_PROFILES=DIR`` keeps the raw samples.

Progress goes to stderr, the Markdown section to stdout and, with ``--write``, into
that file (its section replaced, or appended)::

    .venv/bin/python bench/api.py --write docs/benchmarks.md   # ~4 min
    .venv/bin/python bench/api.py --runs 20000 --samples 20 --rounds 1 --clients 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import httpx
import psycopg
from psycopg.sql import Literal
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lifecycle
from lifecycle import (
    BENCH_POSTGRES_URL,
    display_command,
    drop_postgres,
    fresh_postgres,
    fresh_sqlite,
    libpq,
    load_average,
    memory_total,
    merge_section,
    percentile,
    postgres_facts,
    process_cpu,
    progress,
    runlane_source,
    table,
)
from runlane.api import Runlane
from runlane.domain.access import Principal
from runlane.domain.tasks import parse_task
from runlane.logs import configure_logging
from runlane.settings import Settings
from runlane.store import events as events_store
from scheduler import _nodes, _reads, _trim, lscpu

START, END = "<!-- api-speed:start -->", "<!-- api-speed:end -->"
LIST_TARGET_MS = 20.0
SUBMIT_TARGET = 5_000.0  # tasks/s
SSE_TARGET_MS = 100.0
PAGE = 50
LISTING_INDEX = "ix_runs_listing_tenant_status"
REPO = "https://git.example.com/acme/app.git"
TENANT = "tenant-03"  # the listing's tenant
SSE_TENANT = "tenant-00"
# Statuses of the populated runs, per 100: finished runs (a listing's usual content)
# and some queued ones (a lane each per tenant, as submit makes them).
STATUS_MIX = (("SUCCEEDED", 70), ("FAILED", 10), ("CANCELLED", 8), ("QUEUED", 12))
LIST_STATUSES = ("SUCCEEDED", "FAILED")  # a common and a rarer one
DEEP_PAGES = 200  # the deep page: after following this many `next` cursors


# --- population --------------------------------------------------------------------------


def _status_case() -> str:
    parts, upto = [], 0
    for status, share in STATUS_MIX:
        upto += share
        parts.append(f"WHEN g % 100 < {upto} THEN '{status}'")
    return "CASE " + " ".join(parts) + " END"


def source(runs: int, tenants: int) -> str:
    """One row per g: run g of task g, ids in runlane's time-ordered layout (UUIDv7 as
    text: the creation millisecond first), created over the last 30 days."""
    def v7(kind: str) -> str:
        return ("(overlay(overlay(overlay(md5('bench-" + kind + "-' || g) placing "
                "lpad(to_hex(((:t - 2592000 + g * (2592000.0 / " + str(runs) + ")) * 1000)"
                "::bigint), 12, '0') from 1 for 12) placing '7' from 13 for 1) "
                "placing '8' from 17 for 1))::uuid::text")
    return f"""
SELECT {v7('run')} AS run_id, {v7('task')} AS task_id,
       'tenant-' || lpad((g % {tenants})::text, 2, '0') AS tenant,
       ({_status_case()}) AS status,
       (ARRAY[50, 100, 100, 150])[1 + (g / 7) % 4] AS priority,
       :t - 2592000 + g * (2592000.0 / {runs}) AS created_at
FROM generate_series(1, {runs}) g
"""


def population(runs: int, tenants: int) -> list[str]:
    s = source(runs, tenants)
    ended = "CASE WHEN s.status = 'QUEUED' THEN NULL ELSE s.created_at + 300 END"
    return [
        f"""INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,
                   context, truncated_sections, payload_bytes, created_at, requires)
            SELECT task_id, tenant, '{REPO}', 'fix the flaky test', 'default', priority, 3,
                   '{{}}', '[]', 40, created_at, ''
            FROM ({s}) s""",
        "INSERT INTO routes (route_key, created_at) VALUES ('', :t) "
        "ON CONFLICT (route_key) DO NOTHING",
        f"""INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                   tenant_at_limit)
            SELECT 'default', '', priority, tenant, 1.0, COUNT(*), 0, 0
            FROM ({s}) s WHERE status = 'QUEUED' GROUP BY priority, tenant""",
        f"""INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                   attempt_count, max_attempts, fencing_token, visible_at, created_at,
                   updated_at, ended_at, reason_code, outcome, cost_usd, risk_class,
                   route_key, lane_id, policy_version, limits)
            SELECT s.run_id, s.task_id, s.tenant, '{REPO}', 'default', s.priority, s.status,
                   CASE WHEN s.status = 'QUEUED' THEN 0 ELSE 1 END, 3,
                   CASE WHEN s.status = 'QUEUED' THEN 0 ELSE 1 END, s.created_at,
                   s.created_at, COALESCE({ended}, s.created_at), {ended},
                   CASE s.status WHEN 'FAILED' THEN 'AGENT_FAILED'
                                 WHEN 'CANCELLED' THEN 'CANCELLED' END,
                   CASE WHEN s.status = 'SUCCEEDED' THEN 'success' END,
                   CASE WHEN s.status = 'QUEUED' THEN 0 ELSE 0.12 END, 'low', '',
                   l.lane_id, 0, '{{}}'
            FROM ({s}) s LEFT JOIN lanes l ON s.status = 'QUEUED' AND l.queue = 'default'
                 AND l.route_key = '' AND l.priority = s.priority AND l.tenant = s.tenant""",
    ]


SECONDARY_INDEXES = """
SELECT i.indexname, i.indexdef FROM pg_indexes i
WHERE i.tablename IN ('runs', 'tasks')
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
"""


def populate(url: str, runs: int, tenants: int) -> dict[str, float]:
    """Fill a migrated database; seconds per step (insert, index, vacuum)."""
    seconds: dict[str, float] = {}
    started = time.monotonic()
    with psycopg.connect(libpq(url)) as conn:
        indexes = conn.execute(SECONDARY_INDEXES).fetchall()
        for name, _ in indexes:  # rebuilt after: one sort each, not a million inserts
            conn.execute(f'DROP INDEX "{name}"'.encode())
        conn.execute("SET LOCAL maintenance_work_mem = '256MB'")
        now = float(cast(tuple[Any], conn.execute(
            "SELECT EXTRACT(EPOCH FROM now())::float8").fetchone())[0])
        for statement in population(runs, tenants):
            # The time as a literal: no parameters, so "%" stays the modulo operator.
            conn.execute(re.sub(r"(?<!:):t\b", repr(now), statement).encode())
        seconds["insert"] = time.monotonic() - started
        for _, definition in indexes:
            conn.execute(definition.encode())
        conn.commit()
    seconds["index"] = time.monotonic() - started - seconds["insert"]
    step = time.monotonic()
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    seconds["vacuum"] = time.monotonic() - step
    return seconds


def status_counts(url: str, tenant: str) -> dict[str, int]:
    with psycopg.connect(libpq(url)) as conn:
        return {str(s): int(n) for s, n in conn.execute(
            "SELECT status, COUNT(*) FROM runs WHERE tenant = %s GROUP BY status", (tenant,))}


# --- the server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``python -m runlane serve`` on a free port over ``url``, as a user starts it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "RUNLANE_DATABASE_URL": url}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runlane", "serve", "--port", str(self.port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"runlane serve exited: {self.process.stderr.read()}"
                                 if self.process.stderr else "runlane serve exited")
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise SystemExit("runlane serve did not become ready within 60 s")

    def cpu(self) -> float:
        return process_cpu(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextmanager
def serving(url: str) -> Iterator[Server]:
    server = Server(url)
    try:
        yield server
    finally:
        server.stop()


def lane_for(url: str) -> Runlane:
    return Runlane(settings=Settings(database_url=url))


def token(lane: Runlane, role: str, tenant: str | None = None) -> tuple[str, Principal]:
    created = lane.create_token(role=role, tenant=tenant, name=f"bench-{role}")
    return created.token, lane.authenticate(created.token)


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


# --- profiles ------------------------------------------------------------------------


PY_SPY = Path(sys.executable).with_name("py-spy")
PACKAGES = (  # a sample's own frame, by where its code lives
    ("pydantic", "pydantic (validation, models)"), ("json/", "json (stdlib)"),
    ("psycopg", "psycopg (with the wait for PostgreSQL)"), ("sqlalchemy", "SQLAlchemy"),
    ("runlane/domain", "runlane.domain"), ("runlane/store", "runlane.store"),
    ("runlane/", "runlane (facade, http)"), ("fastapi", "FastAPI, Starlette, anyio"),
    ("starlette", "FastAPI, Starlette, anyio"), ("anyio", "FastAPI, Starlette, anyio"),
    ("uvicorn", "uvicorn, h11"), ("h11", "uvicorn, h11"),
    ("asyncio", "event loop, threads"), ("selectors", "event loop, threads"),
    ("threading", "event loop, threads"), ("concurrent", "event loop, threads"),
)


@dataclass
class Profile:
    """py-spy's samples of the server process: its threads while not idle (py-spy's
    own test, and neither the event loop's select nor a threadpool thread waiting for
    work); a thread waiting for a lock or a pooled connection counts."""

    what: str
    samples: int
    stages: list[tuple[str, int]]  # label -> samples with that function on the stack
    packages: list[tuple[str, int]]  # where the sampled frame's code lives

    def render(self) -> list[str]:
        if not self.samples:
            return [f"Profile of {self.what}: no samples (py-spy unavailable?).", ""]
        def pct(n: int) -> str:
            return f"{100 * n / self.samples:.0f}%"

        return [f"Where the server's time goes {self.what} (py-spy, {self.samples:,} samples of "
                "its threads while not idle, a thread waiting for a lock or a pooled "
                "connection included; a stage counts the samples with it on the stack, "
                "so nested stages overlap):", "",
                table(["Stage", "Share"], [[label, pct(n)] for label, n in self.stages],
                      "lr"), "",
                "By the code the sample was in: " + "; ".join(
                    f"{name} {pct(n)}" for name, n in self.packages if n) + ".", ""]


@contextmanager
def spied(server: Server, what: str, stages: Sequence[tuple[str, str]],
          enabled: bool) -> Iterator[list[Profile]]:
    """py-spy record of the server while the block runs; the summary lands in the list."""
    found: list[Profile] = []
    if not enabled or not PY_SPY.exists():
        yield found
        return
    with tempfile.TemporaryDirectory(prefix="runlane-bench-spy-") as scratch:
        out = Path(scratch) / "raw.txt"
        spy = subprocess.Popen([str(PY_SPY), "record", "-p", str(server.process.pid),
                                "--rate", "250", "--nonblocking", "--format", "raw",
                                "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
        try:
            yield found
        finally:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=30)
        found.append(summarize(out, what, stages) if out.exists()
                     else Profile(what, 0, [], []))
        if out.exists() and os.environ.get("RUNLANE_BENCH_PROFILES"):
            keep = Path(os.environ["RUNLANE_BENCH_PROFILES"])
            keep.mkdir(parents=True, exist_ok=True)
            (keep / (re.sub(r"\W+", "-", what).strip("-")[:60] + ".txt")).write_text(
                out.read_text())


def summarize(path: Path, what: str, stages: Sequence[tuple[str, str]]) -> Profile:
    total = 0
    by_stage = dict.fromkeys((label for label, _ in stages), 0)
    by_package: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        names = {f.partition(" (")[0] for f in frames}
        if frames[-1].startswith("EpollSelector.select") or (
                "WorkerThread.run" in names and any(f.startswith("Queue.get (queue.py")
                                                    for f in frames)):
            continue  # idle: the event loop, or a threadpool thread, waiting for work
        total += n
        for label, name in stages:
            if name in names:
                by_stage[label] += n
        where = frames[-1].partition(" (")[2]
        group = next((g for key, g in PACKAGES if key in where), "other")
        by_package[group] = by_package.get(group, 0) + n
    return Profile(what, total, list(by_stage.items()),
                   sorted(by_package.items(), key=lambda kv: -kv[1]))


# --- 1. the runs list ---------------------------------------------------------------------


@dataclass
class Cell:
    times: list[float] = field(default_factory=list)

    def p(self, q: float) -> float:
        return percentile(self.times, q)


@dataclass
class Plan:
    label: str
    text: str
    index_scan: bool  # an Index (Only) Scan of LISTING_INDEX
    sort: bool
    seq: bool
    bitmap: bool
    rows_read: int  # runs rows read (returned + removed by filter), all loops
    buffers: int  # shared hit + read of the whole plan
    ms: float

    @property
    def bounded(self) -> bool:
        return self.index_scan and not (self.sort or self.seq or self.bitmap) \
            and self.rows_read <= PAGE + 1


@dataclass
class Listing:
    counts: dict[str, int]
    depth: dict[str, int]  # status -> runs before the deep page
    walk: dict[str, Cell]  # status -> the walk's requests (pages 2..)
    cells: dict[tuple[str, str, str], Cell]  # (status, page, via) -> times
    plans: list[Plan]
    server_cpu_ms: float  # per HTTP request, measured loop only
    samples: int
    profiles: list[Profile]


VIAS = ("http-admin", "http-read", "facade")


def page_url(base: str, status: str, cursor: str | None) -> str:
    url = f"{base}/v1/runs?tenant={TENANT}&status={status}&limit={PAGE}"
    return url if cursor is None else f"{url}&cursor={cursor}"


def check_page(body: dict[str, Any], status: str) -> None:
    items = body["items"]
    if len(items) != PAGE or any(i["tenant"] != TENANT or i["status"] != status
                                 for i in items):
        raise SystemExit(f"a page of {TENANT}/{status} is not {PAGE} of its runs: {body}")
    keys = [(i["created_at"], i["run_id"]) for i in items]
    if keys != sorted(keys, reverse=True):
        raise SystemExit("a page is not newest first")


LIST_STAGES = (
    ("the token check (`Runlane.authenticate`: a read and a conditional update)",
     "Runlane.authenticate"),
    ("`Runlane.runs_page` (the route's call)", "ViewsMixin.runs_page"),
    ("of which the statement (`store.views.runs_page`)", "runs_page"),
    ("of which the `RunSummary` models", "RunSummary.from_row"),
    ("the response: validation against `RunPage` and JSON", "serialize_response"),
    ("the ROLLBACK that ends each read (a round trip)", "DefaultDialect.do_rollback"),
    ("waiting for one of the pool's connections", "QueuePool._do_get"),
)


def bench_listing(server: Server, lane: Runlane, samples: int, warmup: int,
                  profile: bool) -> Listing:
    admin_secret, _ = token(lane, "admin")
    read_secret, reader = token(lane, "read", TENANT)
    counts = status_counts(server.url, TENANT)
    headers = {"http-admin": auth(admin_secret), "http-read": auth(read_secret)}
    client = httpx.Client(timeout=30)
    cursors: dict[tuple[str, str], str | None] = {}
    walk: dict[str, Cell] = {}
    depth: dict[str, int] = {}
    for status in LIST_STATUSES:
        cursors[(status, "first")] = None
        cursor: str | None = None
        walk[status] = Cell()
        pages = min(DEEP_PAGES, max(1, counts.get(status, 0) // PAGE - 1))
        for n in range(pages):
            started = time.perf_counter()
            response = client.get(page_url(server.base, status, cursor),
                                  headers=headers["http-admin"])
            elapsed = time.perf_counter() - started
            response.raise_for_status()
            body = response.json()
            check_page(body, status)
            if n:
                walk[status].times.append(elapsed)
            cursor = body["next"]
        cursors[(status, "deep")] = cursor
        depth[status] = pages * PAGE
        progress(f"listing {status}: walked {pages} pages")
    # Every cell once per round, in rotating order.
    keys = [(s, p, v) for s in LIST_STATUSES for p in ("first", "deep") for v in VIAS]
    cells = {k: Cell() for k in keys}

    def one(key: tuple[str, str, str]) -> float:
        status, page, via = key
        cursor = cursors[(status, page)]
        if via == "facade":
            started = time.perf_counter()
            found = lane.runs_page(principal=reader, tenant=TENANT, status=status,
                                   cursor=cursor, limit=PAGE)
            elapsed = time.perf_counter() - started
            if len(found.items) != PAGE:
                raise SystemExit("the facade's page is short")
            return elapsed
        started = time.perf_counter()
        response = client.get(page_url(server.base, status, cursor), headers=headers[via])
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            raise SystemExit(f"GET /v1/runs: {response.status_code} {response.text[:200]}")
        return elapsed

    for key in keys * warmup:
        one(key)
    cpu_before, http_calls = server.cpu(), 0
    for i in range(samples):
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            cells[key].times.append(one(key))
            http_calls += key[2] != "facade"
        if (i + 1) % 50 == 0:
            progress(f"listing: {i + 1} of {samples} rounds")
    server_cpu = (server.cpu() - cpu_before) / max(http_calls, 1) * 1000
    # One checked body per cell: what the timed requests returned.
    for status in LIST_STATUSES:
        for page in ("first", "deep"):
            for via in ("http-admin", "http-read"):
                check_page(client.get(page_url(server.base, status, cursors[(status, page)]),
                                      headers=headers[via]).json(), status)
    with spied(server, f"on {samples} first pages ({LIST_STATUSES[0]}, read token)",
               LIST_STAGES, profile) as profiles:
        for _ in range(samples):
            client.get(page_url(server.base, LIST_STATUSES[0], None), headers=headers["http-read"])
    client.close()
    plans = [plan for status in LIST_STATUSES for page in ("first", "deep")
             for plan in explain_page(lane, reader, status, cursors[(status, page)],
                                      f"{status}, {page} page")]
    return Listing(counts, depth, walk, cells, plans, server_cpu, samples, profiles)


def captured_statement(lane: Runlane, reader: Principal, status: str, cursor: str | None
                       ) -> tuple[str, dict[str, Any]]:
    """The runs page statement and parameters the facade sends for this page, as they
    reach the psycopg cursor."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def hook(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "FROM runs" in statement and "ORDER BY created_at" in statement:
            seen.append((statement, dict(parameters)))

    event.listen(lane.store.engine, "before_cursor_execute", hook)
    try:
        lane.runs_page(principal=reader, tenant=TENANT, status=status, cursor=cursor,
                       limit=PAGE)
    finally:
        event.remove(lane.store.engine, "before_cursor_execute", hook)
    if len(seen) != 1:
        raise SystemExit(f"expected one runs page statement, saw {len(seen)}")
    return seen[0]


def explain_page(lane: Runlane, reader: Principal, status: str, cursor: str | None,
                 label: str) -> list[Plan]:
    statement, params = captured_statement(lane, reader, status, cursor)
    order: list[str] = []

    def numbered(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    body = re.sub(r"%\((\w+)\)s", numbered, statement)
    plans = []
    with psycopg.connect(libpq(lane.settings.database_url)) as raw:
        raw.execute("SET jit = off")  # as the store's engine (PLANNER_OPTIONS)
        raw.execute("SET random_page_cost = 1.1")
        literals = ", ".join(Literal(params[name]).as_string(raw) for name in order)
        custom = re.sub(r"\$(\d+)", lambda m: Literal(params[order[int(m.group(1)) - 1]])
                        .as_string(raw), body)
        raw.execute(f"PREPARE bench_page AS {body}".encode())
        for kind, run, setting in (("custom plan", custom, "auto"),
                                   ("generic plan", f"EXECUTE bench_page({literals})",
                                    "force_generic_plan")):
            raw.execute(f"SET plan_cache_mode = {setting}".encode())
            out = {}
            for fmt in ("TEXT", "JSON"):
                out[fmt] = raw.execute(
                    f"EXPLAIN (ANALYZE, BUFFERS, FORMAT {fmt}) {run}".encode()).fetchall()
            plan = out["JSON"][0][0][0]
            nodes = list(_nodes(plan))
            scans = [n for n in nodes if n["Node Type"] in ("Index Scan", "Index Only Scan")]
            plans.append(Plan(
                label=f"{label}, {kind}",
                text=_trim([str(r[0]) for r in out["TEXT"]]),
                index_scan=any(n.get("Index Name") == LISTING_INDEX for n in scans),
                sort=any("Sort" in n["Node Type"] for n in nodes),
                seq=any(n["Node Type"] == "Seq Scan" for n in nodes),
                bitmap=any(n["Node Type"].startswith("Bitmap") for n in nodes),
                rows_read=_reads(plan).get("runs", 0),
                buffers=int(plan["Plan"].get("Shared Hit Blocks", 0)
                            + plan["Plan"].get("Shared Read Blocks", 0)),
                ms=float(plan["Execution Time"])))
        raw.rollback()
    return plans


# --- 2. batch submit ----------------------------------------------------------------------


@dataclass
class Submit:
    engine: str
    rates: dict[str, list[float]]  # system -> tasks/s per round
    server_cpu_ms: float  # per 1,000 tasks through the API
    batch: int
    batches: int
    rounds: int
    profiles: list[Profile]

    def median(self, system: str) -> float:
        values = sorted(self.rates[system])
        return values[len(values) // 2]


SUBMITTERS = ("http", "facade", "store")
SUBMIT_STAGES = (
    ("the request body: JSON and the `TaskRequest` models (on the event loop)",
     "request_body_to_args"),
    ("the token check (`Runlane.authenticate`)", "Runlane.authenticate"),
    ("`Runlane.submit_batch` (the route's call)", "Runlane.submit_batch"),
    ("of which `parse_task` (the facade's validation)", "parse_task"),
    ("of which `Store.submit`", "Store.submit"),
    ("of which `task_digest` (the idempotency key's digest: a JSON dump per task)",
     "task_digest"),
    ("of which the transaction (`Store._transaction`: statements and commit)",
     "Store._transaction"),
    ("of which `_submission` (the result models)", "_submission"),
    ("the response: validation against `list[Submission]` and JSON", "serialize_response"),
)
SUBMIT_TENANT = "tenant-01"


def rows_of(tag: str, n: int) -> list[dict[str, Any]]:
    return [{"tenant": SUBMIT_TENANT, "repo": REPO, "prompt": "fix the flaky test",
             "priority": (50, 100, 100, 150)[i % 4], "idempotency_key": f"{tag}-{i}"}
            for i in range(n)]


def bench_submit(url: str, engine: str, batch: int, batches: int, rounds: int,
                 profile: bool) -> Submit:
    lane = lane_for(url)
    rates: dict[str, list[float]] = {s: [] for s in SUBMITTERS}
    cpu_http, tasks_http = 0.0, 0
    try:
        with serving(url) as server:
            secret, submitter = token(lane, "submit", SUBMIT_TENANT)
            client = httpx.Client(timeout=120, headers={**auth(secret),
                                                       "Content-Type": "application/json"})
            # Warm-up: the server's imports and statements, the facade's, the store's.
            client.post(f"{server.base}/v1/tasks/batch",
                        content=json.dumps(rows_of("warm-http", 100))).raise_for_status()
            lane.submit_batch(rows_of("warm-facade", 100), principal=submitter)
            lane.store.submit([parse_task(r) for r in rows_of("warm-store", 100)])
            for r in range(rounds):
                shift = r % len(SUBMITTERS)
                for system in SUBMITTERS[shift:] + SUBMITTERS[:shift]:
                    chunks = [rows_of(f"{system}-{r}-{b}", batch) for b in range(batches)]
                    if system == "http":
                        bodies = [json.dumps(c).encode() for c in chunks]
                        before = server.cpu()
                        started = time.perf_counter()
                        for body in bodies:
                            response = client.post(f"{server.base}/v1/tasks/batch",
                                                   content=body)
                            if response.status_code != 201:
                                raise SystemExit(f"POST /v1/tasks/batch: "
                                                 f"{response.status_code} {response.text[:300]}")
                        elapsed = time.perf_counter() - started
                        cpu_http += server.cpu() - before
                        tasks_http += batch * batches
                    elif system == "facade":
                        started = time.perf_counter()
                        for chunk in chunks:
                            lane.submit_batch(chunk, principal=submitter)
                        elapsed = time.perf_counter() - started
                    else:
                        specs = [[parse_task(row) for row in c] for c in chunks]
                        started = time.perf_counter()
                        for spec in specs:
                            lane.store.submit(spec)
                        elapsed = time.perf_counter() - started
                    rates[system].append(batch * batches / elapsed)
                progress(f"submit {engine} round {r + 1}: " + ", ".join(
                    f"{s} {rates[s][-1]:,.0f}/s" for s in SUBMITTERS))
            bodies = [json.dumps(rows_of(f"spied-{b}", batch)).encode()
                      for b in range(batches)]
            with spied(server, f"on {batches} batches of {batch:,} ({engine}, untimed)",
                       SUBMIT_STAGES, profile) as profiles:
                for body in bodies:
                    client.post(f"{server.base}/v1/tasks/batch", content=body)
            client.close()
    finally:
        lane.close()
    return Submit(engine, rates, cpu_http / max(tasks_http, 1) * 1_000_000, batch, batches,
                  rounds, profiles)


# --- 3. SSE -------------------------------------------------------------------------------


def sse_clients(base: str, secrets: list[str], listen_url: str, pipe: Any) -> None:
    """The client process: ``len(secrets)`` event streams and one bare LISTEN. Sends
    ("ready",) once every stream is open, ("got", key) when every stream received the
    event ``key`` = (run_id, to_status); on ("stop",) sends ("done", deliveries,
    notifies) and exits."""
    deliveries: list[tuple[int, str, str, str, float]] = []
    notifies: list[float] = []
    got: dict[tuple[str, str], int] = {}
    stop = threading.Event()

    def listen() -> None:
        with psycopg.connect(listen_url, autocommit=True) as conn:
            conn.execute("LISTEN runlane_events")
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.2):
                    notifies.append(time.monotonic())

    async def stream(client: httpx.AsyncClient, n: int, secret: str,
                     opened: asyncio.Event, count: list[int]) -> None:
        async with client.stream("GET", f"{base}/v1/events", headers=auth(secret)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith(": connected"):
                    count[0] += 1
                    if count[0] == len(secrets):
                        opened.set()
                elif line.startswith("data: "):
                    now = time.monotonic()
                    data = json.loads(line[6:])
                    key = (data["run_id"], data["to_status"])
                    deliveries.append((n, *key, data["cursor"], now))
                    got[key] = got.get(key, 0) + 1
                    if got[key] == len(secrets):
                        pipe.send(("got", key))

    async def main() -> None:
        limits = httpx.Limits(max_connections=len(secrets) + 10,
                              max_keepalive_connections=len(secrets) + 10)
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None),
                                     limits=limits) as client:
            opened, count = asyncio.Event(), [0]
            tasks = [asyncio.create_task(stream(client, n, s, opened, count))
                     for n, s in enumerate(secrets)]
            await asyncio.wait_for(opened.wait(), 120)
            pipe.send(("ready",))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, pipe.recv)  # ("stop",)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    asyncio.run(main())
    stop.set()
    listener.join(timeout=5)
    pipe.send(("done", deliveries, notifies))


@dataclass
class Sse:
    clients: int
    transitions: int
    latencies: list[float]  # every (transition, client) delivery, seconds
    last: list[float]  # per transition: until the last client had it
    notify: list[float]  # per transition: commit to the bare LISTEN's notification
    missing: int  # deliveries that never came
    held: int  # transitions committed while an older transaction of the database ran
    clear: list[float]  # the deliveries of the other transitions
    server_cpu_ms: float  # per transition, server process
    idle_cpu_ms: float  # per second with the streams open and nothing happening
    profiles: list[Profile]


SSE_STAGES = (
    ("`Runlane.events_page` (each stream reads its page after each wake-up)",
     "Runlane.events_page"),
    ("of which `store.events.events_after` (its statements)", "events_after"),
    ("of which the horizon (`events_horizon`, a statement of its own)", "horizon"),
    ("of which the `EventView` models", "EventView.from_row"),
    ("of which waiting for one of the pool's connections (SQLAlchemy, 4 + 4 overflow "
     "per engine on 2 CPUs)", "QueuePool._do_get"),
    ("`event_stream` on the event loop (writing, waiting on the hub)", "event_stream"),
    ("the ROLLBACK that ends each read (a round trip)", "DefaultDialect.do_rollback"),
    ("the hub's thread (LISTEN, the 0.5 s look)", "EventHub._run"),
    ("uvicorn writing the streams' chunks", "RequestResponseCycle.send"),
)


Commit = tuple[tuple[str, str], float, int]  # (run_id, to_status), when, horizon


def transitions(lane: Runlane, pipe: Any, n: int, probe: bool = False
                ) -> tuple[list[Commit], list[float], int]:
    """``n`` transitions, one at a time (a submit, the cancel of that task, ...): the key
    and commit time of each, with (``probe``) the stream's delivery horizon read right
    after it (store/events.py: rows of transactions below it may be delivered); the
    time until every stream had it; and how many no stream set had within 10 s."""
    commits: list[Commit] = []
    last: list[float] = []
    missing, task_id = 0, None
    for i in range(n):
        if task_id is None:
            done = lane.submit(SSE_TENANT, REPO, f"sse {i}")
            committed = time.monotonic()
            key, task_id = (done.run_id, done.status), done.task_id
        else:
            cancelled = lane.cancel(task_id)
            committed = time.monotonic()
            (run_id, status), = cancelled.runs.items()
            key, task_id = (run_id, status), None
        below = -1
        if probe:
            with lane.store.reads.connect() as conn:
                below = events_store.horizon(conn)
        commits.append((key, committed, below))
        if pipe.poll(10):
            message = pipe.recv()
            if message != ("got", key):
                raise SystemExit(f"unexpected delivery {message}, waited for {key}")
            last.append(time.monotonic() - committed)
        else:
            missing += 1
        time.sleep(0.05 + 0.1 * ((i * 7919) % 13) / 13)  # off the poll period's beat
    if task_id is not None:
        lane.cancel(task_id)
        if pipe.poll(10):
            pipe.recv()
    return commits, last, missing


def bench_sse(server: Server, lane: Runlane, clients: int, n: int, profile: bool) -> Sse:
    admin_secret, _ = token(lane, "admin")
    read_secret, _ = token(lane, "read", SSE_TENANT)
    secrets = [admin_secret if i % 2 == 0 else read_secret for i in range(clients)]
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=sse_clients, args=(
        server.base, secrets, libpq(server.url), theirs), daemon=True)
    process.start()
    if not mine.poll(180):
        raise SystemExit("the SSE clients did not connect within 180 s")
    assert mine.recv() == ("ready",)
    progress(f"sse: {clients} streams open")
    idle_cpu = server.cpu()
    idle_started = time.monotonic()
    time.sleep(3.0)  # the streams' idle cost: nothing happens
    idle_cpu_ms = (server.cpu() - idle_cpu) / (time.monotonic() - idle_started) * 1000
    transitions(lane, mine, 2)  # unmeasured
    cpu_before = server.cpu()
    commits, last, _ = transitions(lane, mine, n, probe=True)
    server_cpu_ms = (server.cpu() - cpu_before) / n * 1000
    progress(f"sse: {n} transitions")
    with spied(server, f"on {n // 2} transitions to {clients} streams (untimed)",
               SSE_STAGES, profile) as profiles:
        transitions(lane, mine, n // 2)
    mine.send(("stop",))
    if not mine.poll(60):
        raise SystemExit("the SSE clients did not report")
    _, deliveries, notifies = mine.recv()
    process.join(timeout=10)
    at = {key: committed for key, committed, _ in commits}
    latencies = [t - at[(run, status)] for _, run, status, _, t in deliveries
                 if (run, status) in at]
    # A transition is held back when the delivery horizon right after its commit was
    # not above its transaction: an older transaction of this database still ran, and
    # the stream's read delivers only rows below the horizon (store/events.py).
    tx = {(run, status): int(cursor.partition("-")[0]) if "-" in cursor else 0
          for _, run, status, cursor, _ in deliveries}
    held = {key for key, _, below in commits if key in tx and 0 <= below <= tx[key]}
    clear = [t - at[(run, status)] for _, run, status, _, t in deliveries
             if (run, status) in at and (run, status) not in held]
    # The bare LISTEN's notification of each measured commit: the first one after it.
    notify: list[float] = []
    for _, committed, _ in commits:
        after = [t for t in notifies if t >= committed - 0.05]
        if after:
            notify.append(after[0] - committed)
    return Sse(clients, n, latencies, last, notify, clients * n - len(latencies), len(held),
               clear, server_cpu_ms, idle_cpu_ms, profiles)


# --- report -------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


VIA_NAMES = {"http-admin": "HTTP, admin token (`tenant=` in the query)",
             "http-read": "HTTP, the tenant's `read` token",
             "facade": "`Runlane.runs_page` in this process (no HTTP)"}


def render(command: str, started: datetime, wall: float, env: list[tuple[str, str]],
           populated: dict[str, float], runs: int, tenants: int, listing: Listing,
           submits: list[Submit], sses: list[Sse]) -> str:
    first = listing.cells[(LIST_STATUSES[0], "first", "http-read")]
    worst = max((listing.cells[(s, p, v)].p(50), s, p, v) for s in LIST_STATUSES
                for p in ("first", "deep") for v in ("http-admin", "http-read"))
    plans_ok = all(p.bounded for p in listing.plans)
    pg = next((s for s in submits if s.engine == "PostgreSQL"), None)
    lines = [START, "## The HTTP API: `bench/api.py`", "",
             f"Produced by `{command}` on {started:%Y-%m-%d %H:%M} UTC ({wall / 60:.1f} min). "
             "Every request goes to a real `runlane serve` process (uvicorn, one process, "
             "as a user starts it) on loopback; `bench/api.py` says how.", "",
             "|  |  |", "| :--- | :--- |"]
    lines += [f"| **{name}** | {value} |" for name, value in env]
    lines += ["", "### Targets", "",
              table(["What", "Target", "Measured", ""], [
                  [f"runs list, page of {PAGE} by tenant and status, {runs:,} runs, "
                   "PostgreSQL: p50 round trip (an upper bound of server time), the "
                   "slowest of the HTTP cells below", f"<= {LIST_TARGET_MS:g} ms",
                   f"{ms(worst[0])} ms ({worst[1]}, {worst[2]} page, {worst[3]})",
                   verdict(worst[0] * 1000 <= LIST_TARGET_MS)],
                  ["its plan: an index scan of `" + LISTING_INDEX + "`, no sort, rows read "
                   f"<= {PAGE + 1} (the page and the probe of a next one)", "every page",
                   f"{sum(p.bounded for p in listing.plans)} of {len(listing.plans)} plans",
                   verdict(plans_ok)],
                  *([["batch submit through the API, PostgreSQL, batches of "
                      f"{pg.batch:,}", f">= {SUBMIT_TARGET:,.0f} tasks/s",
                      f"{pg.median('http'):,.0f} tasks/s (median of {pg.rounds} rounds)",
                      verdict(pg.median("http") >= SUBMIT_TARGET)]] if pg else []),
                  *([[f"SSE: a transition delivered to {sses[0].clients} connected "
                      "clients, p50 after commit", f"<= {SSE_TARGET_MS:g} ms",
                      f"{ms(percentile(sses[0].latencies, 50))} ms",
                      verdict(percentile(sses[0].latencies, 50) * 1000 <= SSE_TARGET_MS)]]
                    if sses and sses[0].latencies else []),
              ], "llrl"), ""]
    # Listing
    lines += ["### Runs list at " + f"{runs:,} runs (PostgreSQL)", "",
              f"{runs:,} runs (and their tasks) over {tenants} tenants, created over 30 "
              "days, statuses " + ", ".join(f"{s} {p}%" for s, p in STATUS_MIX)
              + f"; populated set-based in {populated['insert']:.0f} s, indexes built in "
              f"{populated['index']:.0f} s, VACUUM ANALYZE {populated['vacuum']:.0f} s. "
              f"Tenant `{TENANT}` holds " + ", ".join(
                  f"{listing.counts.get(s, 0):,} {s}" for s in LIST_STATUSES)
              + " runs. The deep page is the one after following `next` "
              + " and ".join(f"{listing.depth[s] // PAGE} times ({listing.depth[s]:,} runs "
                             f"in, {s})" for s in LIST_STATUSES)
              + f". {listing.samples} rounds; in each, every cell once, in rotating order, "
              "after warm-up rounds. Round trip: `httpx.Client.get` on one keep-alive "
              "connection, from sending to the whole body read (not parsed). The app "
              "sends no server-timing header, so this is an upper bound of the server's "
              "time; the facade row is the server's work without HTTP, the token check "
              "and JSON.", "",
              table(["Status", "Page", "Via", "p50 ms", "p90 ms", "p99 ms"], [
                  [s, p, VIA_NAMES[v], ms(c.p(50)), ms(c.p(90)), ms(c.p(99))]
                  for (s, p, v), c in listing.cells.items()], "lllrrr"), "",
              "Following `next` from the first page to the deep one (admin token): "
              + "; ".join(f"{s}: p50 {ms(listing.walk[s].p(50))} ms, p99 "
                          f"{ms(listing.walk[s].p(99))} ms over {len(listing.walk[s].times)} "
                          "pages" for s in LIST_STATUSES if listing.walk[s].times)
              + f". Server process CPU per HTTP request: {listing.server_cpu_ms:.1f} ms "
              "(user + sys, measured rounds).", "",
              f"HTTP over the facade: p50 {ms(first.p(50))} / "
              f"{ms(listing.cells[(LIST_STATUSES[0], 'first', 'facade')].p(50))} ms = "
              f"{first.p(50) / listing.cells[(LIST_STATUSES[0], 'first', 'facade')].p(50):.1f}x "
              f"({LIST_STATUSES[0]}, first page, read token): what the server adds to the "
              "page's own work (the token's check, two statements; routing, validation, "
              "JSON).", ""]
    lines += ["#### Plans", "",
              "EXPLAIN (ANALYZE, BUFFERS) of the statement the facade sent for each page "
              "(captured at the psycopg cursor with its parameters): as sent (a custom "
              "plan with the values) and as a prepared statement's generic plan (psycopg "
              "prepares it from its second execution, and PostgreSQL may then keep a "
              "generic plan).", "",
              table(["Page", f"Index scan of `{LISTING_INDEX}`", "Sort", "Rows of runs read",
                     "Buffers", "Execution ms", "Bounded"], [
                  [p.label, "yes" if p.index_scan else "**no**",
                   "**yes**" if p.sort else "none", f"{p.rows_read:,}", f"{p.buffers:,}",
                   f"{p.ms:.2f}", "yes" if p.bounded else "**no**"]
                  for p in listing.plans], "lllrrrl"), ""]
    for profile in listing.profiles:
        lines += profile.render()
    shown = {listing.plans[0].label, listing.plans[-1].label}
    for p in listing.plans:
        if (p.label in shown and lifecycle.DETAILS) or not p.bounded:
            lines += [f"{p.label}:", "", "```", p.text, "```", ""]
    # Submit
    if submits:
        lines += ["### Batch submit", "",
                  f"Per round and system: {submits[0].batches} batches of "
                  f"{submits[0].batch:,} tasks (tenant `{SUBMIT_TENANT}`, an idempotency key "
                  "each, four priorities), one after the other from one client; systems in "
                  "rotating order per round, median of the rounds. `http`: `POST "
                  "/v1/tasks/batch` with the tenant's `submit` token, bodies JSON-encoded "
                  "before the clock starts, each 201 with every submission read; `facade`: "
                  "`Runlane.submit_batch(rows, principal=...)` in this process (the same "
                  "validation and store call the route makes); `store`: `Store.submit` of "
                  "parsed `TaskSpec`s. Fresh database per engine.", "",
                  table(["Engine", "HTTP tasks/s", "facade tasks/s", "Store.submit tasks/s",
                         "HTTP / Store.submit", "Server CPU per 1,000 via HTTP",
                         "HTTP by round"], [
                      [s.engine, f"{s.median('http'):,.0f}", f"{s.median('facade'):,.0f}",
                       f"{s.median('store'):,.0f}",
                       f"{s.median('http') / s.median('store'):.2f}x",
                       f"{s.server_cpu_ms:.0f} ms",
                       " / ".join(f"{v:,.0f}" for v in s.rates["http"])]
                      for s in submits], "lrrrrrr"), ""]
        for s in submits:
            for profile in s.profiles:
                lines += profile.render()
    if sses:
        sse = sses[0]

        def rows(x: Sse) -> list[list[str]]:
            def row(label: str, values: list[float]) -> list[str]:
                return [label, ms(percentile(values, 50)), ms(percentile(values, 90)),
                        ms(percentile(values, 99)), ms(max(values)), f"{len(values):,}"]
            out = []
            if x.latencies:
                out.append(row(f"{x.clients} streams: each delivery (transition x stream)",
                               x.latencies))
            if x.held and x.clear:
                out.append(row(f"{x.clients} streams: each delivery of the "
                               f"{x.transitions - x.held} transitions nothing held back",
                               x.clear))
            if x.last:
                out.append(row(f"{x.clients} streams: until the last stream had it", x.last))
            if x.notify:
                out.append(row(f"{x.clients} streams: floor, a bare LISTEN (commit to "
                               "notification)", x.notify))
            return out

        lines += ["### Live events (SSE)", "",
                  f"{' and then '.join(str(x.clients) for x in sses)} streams on `GET "
                  f"/v1/events` (half an admin token, half `{SSE_TENANT}`'s `read` token) in "
                  "a second process (asyncio, httpx, one connection each), against the "
                  f"{runs:,}-run database, the same server. {sse.transitions} transitions "
                  "each (after two unmeasured), one at a time: a submit through "
                  "`Runlane.submit`, then the cancel of that task through `Runlane.cancel`, "
                  "and so on; the next once every stream had the last, after a pause of "
                  "50-150 ms. Latency: the stream's receive time of the event's `data:` line "
                  "minus the time the facade call returned here (CLOCK_MONOTONIC, shared by "
                  "both processes); the client process's own handling of the streams is in "
                  "it. Floor: a bare `LISTEN runlane_events` connection in the client "
                  "process (commit to notification). Held back: on PostgreSQL a stream "
                  "delivers only rows of transactions below its horizon, the oldest "
                  "transaction still running in the database (store/events.py), so a "
                  "transition committed while an older one runs waits for it to end and "
                  "then for the stream's next look (a notification, or every 0.5 s); this "
                  "process reads the horizon (`store.events.horizon`) right after each "
                  "commit to tell them apart.", "",
                  table(["", "p50 ms", "p90 ms", "p99 ms", "max ms", "samples"],
                        [r for x in sses for r in rows(x)], "lrrrrr"), ""]
        for x in sses:
            lines += [f"{x.clients} streams: transitions held back {x.held} of {x.transitions} "
                      "(a transaction older than the transition's was still running in the "
                      "database right after its commit); "
                      f"deliveries missing {x.missing}; server process "
                      f"CPU per transition {x.server_cpu_ms:.0f} ms; with the streams open "
                      f"and nothing happening, {x.idle_cpu_ms:.0f} ms per second.", ""]
        if len(sses) > 1 and sses[1].latencies and sse.latencies:
            lines += [f"p50 of a delivery, {sse.clients} streams over {sses[1].clients}: "
                      f"{ms(percentile(sse.latencies, 50))} / "
                      f"{ms(percentile(sses[1].latencies, 50))} ms = "
                      f"{percentile(sse.latencies, 50) / percentile(sses[1].latencies, 50):.1f}x.",
                      ""]
        for profile in sse.profiles:
            lines += profile.render()
    lines += [END, ""]
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--samples", type=int, default=200, help="listing rounds")
    parser.add_argument("--warmup", type=int, default=5, help="listing warm-up rounds")
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--batches", type=int, default=20, help="per round and system")
    parser.add_argument("--rounds", type=int, default=3, help="submit rounds")
    parser.add_argument("--clients", type=int, default=100, help="SSE streams")
    parser.add_argument("--transitions", type=int, default=60)
    parser.add_argument("--skip", action="append", default=[],
                        choices=("list", "submit", "sqlite", "sse"))
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="no py-spy profiles of the server (after the timed parts)")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="also put the Markdown section into PATH")
    lifecycle.add_details_flag(parser)
    args = parser.parse_args(argv)
    lifecycle.DETAILS = args.details
    configure_logging("WARNING")
    started = datetime.now(UTC)
    wall = time.monotonic()
    load_before = load_average()
    name = f"runlane_bench_api_{os.getpid()}"
    url = fresh_postgres(BENCH_POSTGRES_URL, name)
    submit_name = f"{name}_submit"
    listing: Listing | None = None
    sses: list[Sse] = []
    submits: list[Submit] = []
    populated: dict[str, float] = {}
    try:
        progress(f"populating {args.runs:,} runs in {name}")
        populated = populate(url, args.runs, args.tenants)
        progress(f"populated: {populated}")
        lane = lane_for(url)
        try:
            with serving(url) as server:
                if "list" not in args.skip:
                    listing = bench_listing(server, lane, args.samples, args.warmup,
                                            args.profile)
                if "sse" not in args.skip:
                    sses.append(bench_sse(server, lane, args.clients, args.transitions,
                                          args.profile))
                    if args.clients >= 20:  # the same with a tenth of the streams
                        sses.append(bench_sse(server, lane, args.clients // 10,
                                              args.transitions, False))
        finally:
            lane.close()
        if "submit" not in args.skip:
            submit_url = fresh_postgres(BENCH_POSTGRES_URL, submit_name)
            submits.append(bench_submit(submit_url, "PostgreSQL", args.batch, args.batches,
                                        args.rounds, args.profile))
            drop_postgres(BENCH_POSTGRES_URL, submit_name)
            if "sqlite" not in args.skip:
                with tempfile.TemporaryDirectory(prefix="runlane-bench-api-") as scratch:
                    submits.append(bench_submit(fresh_sqlite(Path(scratch), "api"), "SQLite",
                                                args.batch, args.batches, args.rounds, False))
    finally:
        drop_postgres(BENCH_POSTGRES_URL, name)
        drop_postgres(BENCH_POSTGRES_URL, submit_name)
    facts = postgres_facts(BENCH_POSTGRES_URL)
    import fastapi
    import uvicorn
    env = [
        ("Machine", f"{lscpu()}; {memory_total()} RAM; Linux {platform.release()}"),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}; "
                   f"FastAPI {fastapi.__version__}, uvicorn {uvicorn.__version__}, "
                   f"httpx {httpx.__version__}"),
        ("PostgreSQL", f"{facts['server_version']} on the same machine; shared_buffers "
                       f"{facts['shared_buffers']}, synchronous_commit "
                       f"{facts['synchronous_commit']}, fsync {facts['fsync']}"),
        ("runlane", runlane_source()),
        ("Load average (1/5/15 min)", f"{load_before} at start, {load_average()} at end"),
    ]
    if listing is None:
        raise SystemExit("nothing to report without the listing (--skip list)")
    section = render(display_command([sys.argv[0], *(argv or sys.argv[1:])]), started,
                     time.monotonic() - wall, env, populated, args.runs, args.tenants,
                     listing, submits, sses)
    sys.stdout.write(section)
    if args.write is not None:
        merge_section(args.write, section, START, END)
        progress(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
