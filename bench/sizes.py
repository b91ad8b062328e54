"""Table and index sizes at 1,000,000 queued plus 1,000,000 finished runs (PostgreSQL).

One database (``runlane_bench_sizes_<pid>``, dropped at the end), migrated with
runlane's migrations. The rows are copies of what runlane itself writes: the real
``Store`` submits two tasks, claims one and completes it (``Store.claim`` +
``Store.complete``, the no-op path: QUEUED -> CLAIMED -> FINALIZING -> SUCCEEDED), and
those rows (task, run, attempt, the events it stores) are the templates that set-based
``INSERT ... SELECT ... FROM generate_series`` statements copy a million times each,
with new time-ordered ids (UUIDv7 layout), 1,000 tenants (one lane each), 10,000
repositories, an idempotency key per task, 16 workers and shifted timestamps. The
indexes stay in place during the inserts (maintained row by row, in creation order,
as a live system would; no drop-and-rebuild). Then ``VACUUM ANALYZE`` and the sizes.

Then retention: runlane's own ``prune_finished`` (the ``RETENTION_DAYS`` job, batches
of 500) deletes the finished runs (they ended 40 days ago, kept 30), ``VACUUM`` and the
sizes again (what the disk still holds: freed pages are reused, not returned), and
after ``VACUUM FULL`` (the live data alone). Progress goes to stderr, the Markdown
section to stdout and, with ``--write``, into that file (replacing its previous
section, or appended at the end)::

    .venv/bin/python bench/sizes.py --write docs/benchmarks.md
    .venv/bin/python bench/sizes.py --runs 10000        # a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

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
    postgres_facts,
    progress,
    runlane_source,
    table,
    v7_sql,
    with_database,
)
from runlane.domain.tasks import parse_task
from runlane.logs import configure_logging
from runlane.store import history
from runlane.store.migrate import upgrade
from runlane.store.retention import (
    FINISHED,
    PruneCursor,
    PruneResult,
    RetentionStatements,
    prune_finished,
)
from runlane.store.store import Store

DEFAULT_POSTGRES_URL = BENCH_POSTGRES_URL
START, END = "<!-- table-sizes:start -->", "<!-- table-sizes:end -->"
TITLE = "Table and index sizes at 1,000,000 queued + 1,000,000 finished runs: `bench/sizes.py`"
DAY = 86_400.0
TENANTS, REPOS, WORKERS = 1_000, 10_000, 16
FINISHED_AGE_DAYS, KEEP_DAYS, PRUNE_BATCH = 40, 30, 500
CHUNK = 100_000  # generated rows (g values) per transaction
PROMPT = "fix the flaky test in the login handler"
TEMPLATE_REPO = "https://git.example.com/acme/repo-00000.git"
TEMPLATE_WORKER = "worker-00"


# --- templates: what the real store writes for one run ------------------------------


@dataclass(frozen=True)
class Templates:
    finished_run: str
    queued_run: str
    # (from, to) per transition of the composed history (store/history.py), in order,
    # and how many of them are stored as run_events rows
    events_finished: list[tuple[str | None, str]]
    events_queued: list[tuple[str | None, str]]
    stored_finished: int = 0
    stored_queued: int = 0


def make_templates(url: str) -> Templates:
    """Submit two tasks with the real store; claim and complete one of them."""
    store = Store(url)
    try:
        specs = [parse_task({"tenant": "tenant-0000", "repo": TEMPLATE_REPO, "prompt": PROMPT,
                             "idempotency_key": f"template-{i}"}) for i in range(2)]
        submitted = store.submit(specs)
        leases = store.claim(TEMPLATE_WORKER, limit=1)
        store.complete(leases[0])
        finished = leases[0].run_id
        queued = next(s.run_id for s in submitted if s.run_id != finished)
        with store.engine.connect() as conn:
            def events(run_id: str) -> list[tuple[str | None, str]]:
                rows = conn.execute(text(history.RUN_HISTORY), {"run_id": run_id}).all()
                return [(r.from_status, r.to_status) for r in rows]

            def stored(run_id: str) -> int:
                return int(conn.execute(text(
                    "SELECT COUNT(*) FROM run_events WHERE run_id = :r"),
                    {"r": run_id}).scalar_one())
            return Templates(finished, queued, events(finished), events(queued),
                             stored(finished), stored(queued))
    finally:
        store.close()


def columns(conn: psycopg.Connection[Any], table_name: str) -> list[str]:
    rows = conn.execute("SELECT column_name FROM information_schema.columns "
                        "WHERE table_schema = 'public' AND table_name = %s "
                        "ORDER BY ordinal_position", (table_name,)).fetchall()
    return [str(r[0]) for r in rows]


def copy_statement(conn: psycopg.Connection[Any], table_name: str, alias: str,
                   overrides: dict[str, str], source: str) -> str:
    """INSERT INTO table (every column but the serial ones) SELECT, per column, the
    override, or a time column shifted by ``delta``, or the template's own value."""
    cols = [c for c in columns(conn, table_name) if c != "event_id" or c in overrides]
    exprs = []
    for c in cols:
        if c in overrides:
            exprs.append(overrides[c])
        elif c == "at" or c.endswith("_at"):
            exprs.append(f"{alias}.{c} + delta")
        else:
            exprs.append(f"{alias}.{c}")
    return (f"INSERT INTO {table_name} ({', '.join(cols)})\n"
            f"SELECT {', '.join(exprs)}\n{source}")


def population(conn: psycopg.Connection[Any], run_id: str, finished: bool
               ) -> list[tuple[str, str]]:
    """(table, statement) for one kind of run; run g copies the template run."""
    tenant = "'tenant-' || lpad(mod(g, %(tenants)s)::text, 4, '0')"
    repo = ("'https://git.example.com/acme/repo-' || lpad(mod(g, %(repos)s)::text, 5, '0')"
            " || '.git'")
    worker = "'worker-' || lpad(mod(g, %(workers)s)::text, 2, '0')"
    # Every copy joins the template run (t0) for the time shift.
    def source(table_name: str, alias: str, join: str, order: str = "g") -> str:
        return (f"FROM runs t0 JOIN {table_name} {alias} ON {join},\n"
                f"     generate_series(%(lo)s::bigint, %(hi)s::bigint) g,\n"
                f"     LATERAL (SELECT (%(base)s + g / 100.0) - t0.created_at AS delta) d\n"
                f"WHERE t0.run_id = '{run_id}'\nORDER BY {order}")
    statements = [
        ("tasks", copy_statement(conn, "tasks", "x", {
            "task_id": v7_sql("task"), "tenant": tenant, "repo": repo,
            "idempotency_key": "'key-' || g",
        }, source("tasks", "x", "x.task_id = t0.task_id"))),
        ("runs", copy_statement(conn, "runs", "x", {
            "run_id": v7_sql("run"), "task_id": v7_sql("task"), "tenant": tenant,
            "repo": repo,
            "lane_id": f"(SELECT l.lane_id FROM lanes l WHERE l.queue = x.queue "
                       f"AND l.route_key = x.route_key AND l.priority = x.priority "
                       f"AND l.tenant = {tenant})",
            **positions("created"),
        }, source("runs", "x", "x.run_id = t0.run_id"))),
    ]
    if finished:
        statements.append(("attempts", copy_statement(conn, "attempts", "x", {
            "run_id": v7_sql("run"), "worker_id": worker,
            **positions("claim"), **positions("end"),
        }, source("attempts", "x", "x.run_id = t0.run_id"))))
    statements.append(("run_events", copy_statement(conn, "run_events", "x", {
        "run_id": v7_sql("run"), "event_id": f"x.event_id + g * {SPAN}",
        "actor": f"CASE WHEN x.actor = '{TEMPLATE_WORKER}' THEN {worker} ELSE x.actor END",
    }, source("run_events", "x", "x.run_id = t0.run_id", "g, x.event_id"))))
    return statements


# A copy's positions in the event stream (store/history.py): the template's, moved by
# ``g * SPAN`` (the templates' are below it), so each copy's transitions keep their
# order (the audit checks it) and no two copies share one.
SPAN = 1_000


def positions(kind: str) -> dict[str, str]:
    """A copied row's place in the event stream, when the template has one: a
    transaction id and a position of its own, as each write takes."""
    return {f"{kind}_tx": f"x.{kind}_tx + g", f"{kind}_seq": f"x.{kind}_seq + g * {SPAN}"}


def populate(url: str, templates: Templates, runs: int) -> dict[str, float]:
    """Lanes for every tenant, then ``runs`` finished and ``runs`` queued runs copied
    from the templates, chunk by chunk; then the templates go, VACUUM ANALYZE."""
    seconds: dict[str, float] = {}
    now = time.time()
    params: dict[str, Any] = {"tenants": TENANTS, "repos": REPOS, "workers": WORKERS}
    with psycopg.connect(libpq(url)) as conn:
        conn.execute("SET session_replication_role = replica")  # rows consistent by design
        conn.execute(
            "INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, "
            "pass, tenant_at_limit) SELECT l.queue, l.route_key, l.priority, "
            "'tenant-' || lpad(i::text, 4, '0'), l.weight, 0, 0, 0 FROM lanes l, "
            "generate_series(1, %(n)s - 1) i WHERE l.tenant = 'tenant-0000'", {"n": TENANTS})
        conn.commit()
        steps = [("finished", templates.finished_run, True, 0,
                  now - FINISHED_AGE_DAYS * DAY - runs / 100.0),
                 ("queued", templates.queued_run, False, runs, now - runs / 100.0 - 60)]
        for kind, run_id, finished, first, base in steps:
            for table_name, statement in population(conn, run_id, finished):
                step = time.monotonic()
                rows = 0
                for lo in range(first + 1, first + runs + 1, CHUNK):
                    hi = min(lo + CHUNK - 1, first + runs)
                    cur = conn.execute(statement.encode(),
                                       {**params, "lo": lo, "hi": hi, "base": base})
                    rows += cur.rowcount
                    conn.commit()
                took = time.monotonic() - step
                seconds[f"{kind} {table_name}"] = took
                progress(f"{kind}: {rows:,} {table_name} rows in {took:.1f}s")
        step = time.monotonic()
        # The templates go; the lanes get the counts and passes the store would keep.
        for run_id in (templates.finished_run, templates.queued_run):
            task_id = conn.execute("SELECT task_id FROM runs WHERE run_id = %s",
                                   (run_id,)).fetchone()
            for table_name in ("run_events", "attempts", "runs"):
                conn.execute(f"DELETE FROM {table_name} WHERE run_id = %s".encode(),
                             (run_id,))
            conn.execute("DELETE FROM tasks WHERE task_id = %s", (task_id[0] if task_id else "",))
        conn.execute("UPDATE lanes SET queued_count = 0, pass = 0")
        conn.execute(
            "UPDATE lanes l SET queued_count = c.queued, pass = c.claimed FROM ("
            "SELECT lane_id, COUNT(*) FILTER (WHERE status = 'QUEUED') AS queued, "
            "COUNT(*) FILTER (WHERE status <> 'QUEUED') AS claimed FROM runs "
            "GROUP BY lane_id) c WHERE c.lane_id = l.lane_id")
        # Positions taken from now on come after every copy's.
        conn.execute("SELECT setval('run_events_event_id_seq', %s)",
                     ((2 * runs + 1) * SPAN,))
        conn.commit()
        seconds["templates out, lanes"] = time.monotonic() - step
    step = time.monotonic()
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    seconds["VACUUM ANALYZE"] = time.monotonic() - step
    progress(f"VACUUM ANALYZE in {seconds['VACUUM ANALYZE']:.1f}s")
    return seconds


# --- sizes -----------------------------------------------------------------------------

TABLE_SIZES = """
SELECT c.relname, c.oid,
       pg_relation_size(c.oid) AS heap,
       COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0) AS toast,
       pg_indexes_size(c.oid) AS indexes,
       pg_total_relation_size(c.oid) AS total
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' AND c.relkind = 'r'
ORDER BY pg_total_relation_size(c.oid) DESC, c.relname
"""
INDEX_SIZES = """
SELECT i.indrelid, x.relname, pg_relation_size(x.oid) AS size
FROM pg_index i JOIN pg_class x ON x.oid = i.indexrelid
JOIN pg_namespace n ON n.oid = x.relnamespace
WHERE n.nspname = 'public'
ORDER BY pg_relation_size(x.oid) DESC, x.relname
"""


@dataclass
class TableSize:
    name: str
    rows: int
    heap: int
    toast: int
    indexes: int
    total: int
    index_sizes: list[tuple[str, int]]


@dataclass
class Snapshot:
    label: str
    tables: list[TableSize]
    database: int

    def table(self, name: str) -> TableSize | None:
        return next((t for t in self.tables if t.name == name), None)


def snapshot(url: str, label: str) -> Snapshot:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        by_table: dict[int, list[tuple[str, int]]] = {}
        for relid, name, size in conn.execute(INDEX_SIZES).fetchall():
            by_table.setdefault(int(relid), []).append((str(name), int(size)))
        tables = []
        for name, oid, heap, toast, indexes, total in conn.execute(TABLE_SIZES).fetchall():
            count = conn.execute(f'SELECT COUNT(*) FROM "{name}"'.encode()).fetchone()
            tables.append(TableSize(str(name), int(count[0]) if count else 0, int(heap),
                                    int(toast), int(indexes), int(total),
                                    by_table.get(int(oid), [])))
        database = conn.execute("SELECT pg_database_size(current_database())").fetchone()
    progress(f"sizes {label}: database {mb(int(database[0]) if database else 0)}")
    return Snapshot(label, tables, int(database[0]) if database else 0)


@dataclass
class Retention:
    sample: PruneResult  # what runlane's own job deleted, batch by batch
    batch_seconds: list[float]
    plan: list[str]  # EXPLAIN (ANALYZE, BUFFERS) of the job's pick, at full size
    rest: dict[str, int]  # rows the set-based remainder deleted, per table
    rest_seconds: float


def _full_sort(plan: list[str]) -> bool:
    """Whether the pick's plan sorts its input whole (an incremental sort of the
    index's order only breaks ties)."""
    return any("Sort  (" in line and "Incremental Sort" not in line for line in plan)


def explain_pick(store: Store, statements: RetentionStatements) -> list[str]:
    """The plan of the retention job's pick as it runs (rolled back: it locks rows)."""
    explain = text("EXPLAIN (ANALYZE, BUFFERS) " + statements.pick.text)
    with store.engine.connect() as conn:
        rows = conn.execute(explain, {"status": "SUCCEEDED", "now": None,
                                      "keep_seconds": KEEP_DAYS * DAY,
                                      "limit": PRUNE_BATCH, "after_at": float("-inf"),
                                      "after_id": ""}).all()
        conn.rollback()
    return [str(r[0]) for r in rows]


def prune(url: str, batches: int) -> Retention:
    """runlane's retention job (``prune_finished``, batches of PRUNE_BATCH) for the first
    ``batches`` batches, timed one by one; then the rest of the finished runs older than
    KEEP_DAYS go with the same deletes, set-based in one transaction (the job itself
    would take too long here: see the pick's plan)."""
    store = Store(url)
    total, timings = PruneResult(), []
    try:
        statements = RetentionStatements(store)
        plan = explain_pick(store, statements)
        cursor = PruneCursor()  # one pass: each batch walks on from the last
        for _ in range(batches):
            started = time.monotonic()
            pruned = prune_finished(store, keep_seconds=KEEP_DAYS * DAY, limit=PRUNE_BATCH,
                                    statements=statements, cursor=cursor)
            timings.append(time.monotonic() - started)
            total += pruned
            if pruned.runs < PRUNE_BATCH:
                break
    finally:
        store.close()
    progress(f"retention job: {total.runs:,} runs in {len(timings)} batches, "
             f"{sum(timings):.1f}s; the rest set-based")
    started = time.monotonic()
    rest: dict[str, int] = {}
    finished = ", ".join(f"'{status}'" for status in FINISHED)
    with psycopg.connect(libpq(url)) as conn:
        conn.execute(
            "CREATE TEMP TABLE doomed AS SELECT r.run_id, r.task_id FROM runs r "
            f"WHERE r.status IN ({finished}) AND r.updated_at < "
            "EXTRACT(EPOCH FROM clock_timestamp()) - %(keep)s AND NOT EXISTS ("
            "SELECT 1 FROM attempts a WHERE a.run_id = r.run_id "
            "AND a.lease_status = 'ACTIVE')".encode(), {"keep": KEEP_DAYS * DAY})
        for table_name in ("side_effects", "run_events", "attempts", "runs"):
            cur = conn.execute(f"DELETE FROM {table_name} t USING doomed d "
                               f"WHERE t.run_id = d.run_id".encode())
            rest[table_name] = cur.rowcount
        cur = conn.execute("DELETE FROM tasks t USING doomed d WHERE t.task_id = d.task_id "
                           "AND NOT EXISTS (SELECT 1 FROM runs r WHERE r.task_id = t.task_id)")
        rest["tasks"] = cur.rowcount
        conn.commit()
    seconds = time.monotonic() - started
    progress(f"retention rest: {rest.get('runs', 0):,} runs in {seconds:.1f}s")
    return Retention(total, timings, plan, rest, seconds)


WIDTHS = """
SELECT tablename, attname, avg_width FROM pg_stats
WHERE schemaname = 'public' AND tablename IN ('runs', 'tasks', 'run_events')
ORDER BY tablename, avg_width DESC, attname
"""


def column_widths(url: str) -> dict[str, list[tuple[str, int]]]:
    """Average stored width of each column (``pg_stats.avg_width``, after ANALYZE)."""
    widths: dict[str, list[tuple[str, int]]] = {}
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        for table_name, column, width in conn.execute(WIDTHS).fetchall():
            widths.setdefault(str(table_name), []).append((str(column), int(width)))
    return widths


def run_audit(url: str) -> str:
    """runlane's own invariant checks over the copied rows: they must hold as for
    rows the store wrote itself."""
    store = Store(url)
    started = time.monotonic()
    try:
        found = store.audit()
    finally:
        store.close()
    took = time.monotonic() - started
    if not found:
        return f"clean ({took:.0f} s)"
    return f"{len(found)} VIOLATIONS ({took:.0f} s), first: {found[0].check}: {found[0].detail}"


def maintenance(url: str, statement: str) -> float:
    started = time.monotonic()
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute(statement.encode())
    return time.monotonic() - started


# --- report ----------------------------------------------------------------------------


def mb(size: int) -> str:
    return f"{size / 1024 / 1024:,.1f} MB"


def per_run(size: int, runs: int) -> str:
    return f"{size / runs:,.0f}" if runs else "n/a"


@dataclass
class Report:
    command: str
    started: datetime
    runs: int
    environment: list[tuple[str, str]]
    templates: Templates
    seconds: dict[str, float]
    full: Snapshot
    pruned: Snapshot
    compacted: Snapshot
    widths: dict[str, list[tuple[str, int]]]
    retention: Retention
    vacuum_seconds: float
    vacuum_full_seconds: float
    wall: float = 0.0

    def sizes_table(self, snap: Snapshot, runs: int) -> str:
        rows = []
        for t in snap.tables:
            if t.total < 64 * 1024 and t.rows < 1_000:
                continue
            rows.append([f"`{t.name}`", f"{t.rows:,}", mb(t.heap), mb(t.indexes), mb(t.toast),
                         mb(t.total), per_run(t.total, runs)])
        small = [t for t in snap.tables if t.total < 64 * 1024 and t.rows < 1_000]
        rows.append([f"{len(small)} small tables", f"{sum(t.rows for t in small):,}",
                     mb(sum(t.heap for t in small)), mb(sum(t.indexes for t in small)),
                     mb(sum(t.toast for t in small)), mb(sum(t.total for t in small)),
                     per_run(sum(t.total for t in small), runs)])
        tables_total = sum(t.total for t in snap.tables)
        rows.append(["**all tables**", "", mb(sum(t.heap for t in snap.tables)),
                     mb(sum(t.indexes for t in snap.tables)),
                     mb(sum(t.toast for t in snap.tables)), f"**{mb(tables_total)}**",
                     per_run(tables_total, runs)])
        rows.append(["database (`pg_database_size`)", "", "", "", "", mb(snap.database),
                     per_run(snap.database, runs)])
        return table(["Table", "Rows", "Heap", "Indexes", "TOAST", "Total", "Bytes/run"],
                     rows, "lrrrrrr")

    def index_table(self) -> str:
        rows = []
        for name in ("runs", "run_events", "tasks", "attempts"):
            full, pruned, compacted = (s.table(name) for s in
                                       (self.full, self.pruned, self.compacted))
            if full is None:
                continue
            after = {n: v for n, v in pruned.index_sizes} if pruned else {}
            packed = {n: v for n, v in compacted.index_sizes} if compacted else {}
            for index, size in full.index_sizes:
                rows.append([f"`{name}`", f"`{index}`", mb(size),
                             f"{size / full.total:.0%}" if full.total else "",
                             per_run(size, 2 * self.runs), mb(after.get(index, 0)),
                             mb(packed.get(index, 0))])
        return table(["Table", "Index", f"{2 * self.runs:,} runs", "of table total",
                      "Bytes/run", "After retention + VACUUM", "After VACUUM FULL"], rows,
                     "llrrrrr")

    def render(self) -> str:
        n = self.runs
        full_runs = self.full.table("runs")
        events = self.full.table("run_events")
        top = sorted(((size, f"{t.name}.{idx}") for t in self.full.tables
                      for idx, size in t.index_sizes), reverse=True)
        all_indexes = sum(t.indexes for t in self.full.tables)
        all_heap = sum(t.heap for t in self.full.tables)
        populate_total = sum(self.seconds.values())
        fin = " -> ".join([str(self.templates.events_finished[0][0] or "(new)")]
                          + [b for _, b in self.templates.events_finished])
        que = " -> ".join([str(self.templates.events_queued[0][0] or "(new)")]
                          + [b for _, b in self.templates.events_queued])
        lines = [
            START,
            f"## {TITLE}",
            "",
            f"Produced by `{self.command}` on {self.started:%Y-%m-%d %H:%M} UTC; the whole "
            f"run took {self.wall / 60:.1f} min of wall time, populating {n:,} + {n:,} runs "
            f"{populate_total:.0f} s. Each run's rows are copies of what runlane's own "
            "`Store` wrote for one run just before (templates made with `Store.submit`, "
            "`Store.claim`, `Store.complete` on the same database), multiplied set-based "
            "with `INSERT ... SELECT ... FROM generate_series` with the indexes in place, "
            "then `VACUUM ANALYZE`:",
            "",
            f"* a **finished** run: its task, the run (SUCCEEDED, `ended_at`, `lane_id`, "
            f"the admission record), one attempt (SUCCEEDED, lease RELEASED) and "
            f"{len(self.templates.events_finished)} transitions ({fin}), of which "
            f"{self.templates.stored_finished} stored as `run_events` rows (the run row "
            f"records its creation, the attempt row its claim and its end);",
            f"* a **queued** run: its task, the run (QUEUED in its lane) and "
            f"{len(self.templates.events_queued)} transition ({que}), "
            f"{self.templates.stored_queued} stored as `run_events` rows.",
            "",
            f"{TENANTS:,} tenants (one lane each), {REPOS:,} repositories, an idempotency key "
            f"on every task, a one-line prompt (`{PROMPT}`), no context, {WORKERS} workers; "
            f"ids in runlane's time-ordered layout (UUIDv7 as text). The finished runs ended "
            f"{FINISHED_AGE_DAYS} days ago, the queued ones were submitted in the last "
            f"{n / 100 / 3600:.1f} hours.",
            "",
            table(["", ""], self.environment, "ll"),
            "",
            f"### Sizes at {n:,} queued + {n:,} finished runs",
            "",
            f"Bytes/run divides by all {2 * n:,} runs. Heap is `pg_relation_size` (main "
            "fork), Indexes `pg_indexes_size`, TOAST the toast table with its index, Total "
            "`pg_total_relation_size` (also counts the free space and visibility maps).",
            "",
            self.sizes_table(self.full, 2 * n),
            "",
            "Every index (largest first within each table):",
            "",
            self.index_table(),
            "",
        ]
        if full_runs and events:
            biggest = top[0] if top else (0, "")
            lines += [
                "What stands out:",
                "",
                f"* Indexes are {all_indexes / max(all_heap, 1):.2f}x the heap "
                f"({mb(all_indexes)} against {mb(all_heap)}). The largest index is "
                f"`{biggest[1]}` ({mb(biggest[0])}); the five largest: "
                + ", ".join(f"`{name}` {mb(size)}" for size, name in top[:5]) + ".",
                f"* `run_events` holds {events.rows:,} rows "
                f"({events.rows / (2 * n):.1f} per run) and {mb(events.total)}, "
                f"{events.total / max(sum(t.total for t in self.full.tables), 1):.0%} of all "
                f"tables; `runs` {mb(full_runs.total)} "
                f"({full_runs.total / max(sum(t.total for t in self.full.tables), 1):.0%}).",
                f"* No TOAST is used: every row is well under the 2 kB threshold "
                f"(`runs` heap {full_runs.heap / max(full_runs.rows, 1):,.0f} B per row "
                f"including page overhead, `run_events` "
                f"{events.heap / max(events.rows, 1):,.0f} B)."
                if sum(t.toast for t in self.full.tables) < 1024 * 1024 else
                "* TOAST is used (see the table).",
                "* Widest columns (`pg_stats.avg_width`, bytes): "
                + "; ".join(f"`{name}` " + ", ".join(f"{c} {w}" for c, w in cols[:4])
                            for name, cols in sorted(self.widths.items())) + ".",
                "* Every id is `VARCHAR(36)` text (37 B stored): an index on one id "
                "(`runs_pkey`, `tasks_pkey`, `ix_runs_task_id`) costs "
                f"{per_run(dict(full_runs.index_sizes).get('runs_pkey', 0), full_runs.rows)} "
                "B per row; a native `uuid` (16 B) would be roughly half that (an estimate "
                "from the tuple sizes, not measured), for every id index and for the ids "
                "in the heaps.",
                "",
            ]
        ret = self.retention
        pr = ret.sample
        timings = sorted(ret.batch_seconds)
        p50 = timings[len(timings) // 2] if timings else 0.0
        rest_runs = ret.rest.get("runs", 0)
        job_rate = pr.runs / max(sum(timings), 1e-9)
        lines += [
            "### After retention",
            "",
            f"runlane's retention job (`prune_finished`, as `runlane maintain` runs it with "
            f"`RETENTION_DAYS={KEEP_DAYS}`, batches of {PRUNE_BATCH}, no pause) was timed for "
            f"its first {len(timings)} batches: {pr.runs:,} runs, {pr.tasks:,} tasks, "
            f"{pr.attempts:,} attempts, {pr.run_events:,} events and {pr.side_effects:,} "
            f"side effects in {sum(timings):.1f} s, a batch p50 {p50:.2f} s, max "
            f"{timings[-1] if timings else 0.0:.2f} s ({job_rate:,.0f} runs/s). At that "
            f"rate the {pr.runs + rest_runs:,} finished runs would take "
            f"{(pr.runs + rest_runs) / max(job_rate, 1e-9) / 60:.0f} min. The rest "
            f"({rest_runs:,} runs, "
            + ", ".join(f"{v:,} {k}" for k, v in ret.rest.items() if k != "runs")
            + f") went with the same deletes set-based, in one transaction "
            f"({ret.rest_seconds:.0f} s). Where a batch's time goes, the job's pick at "
            f"{n:,} finished runs (`EXPLAIN (ANALYZE, BUFFERS)`, before the first batch):",
            "",
            *(["```text", *ret.plan, "```", ""] if lifecycle.DETAILS
              else ["(`--details` prints the plan.)", ""]),
            *([("The pick reads every row of `runs` and sorts the finished ones to return "
                "the oldest " + f"{PRUNE_BATCH}" + ": a batch costs in proportion to the "
                "table, not to the batch, and the job is quadratic in the backlog."), ""]
              if _full_sort(ret.plan) else []),
            *([("The pick reads `ix_runs_status_updated` one finished status at a time, "
                "oldest first from where the pass's last batch stopped (a keyset: it never "
                "rereads the entries of the runs deleted earlier in the pass, dead until "
                "vacuum); `bench/retention.py` times a whole pass of 1,000,000."), ""]
              if not _full_sort(ret.plan) else []),
            f"Then a plain `VACUUM ANALYZE` ({self.vacuum_seconds:.0f} s): the freed pages "
            "stay in the files for reuse by new rows, so this is what the disk holds "
            f"until the tables regrow into them (Bytes/run divides by the {n:,} runs left):",
            "",
            self.sizes_table(self.pruned, n),
            "",
            f"After `VACUUM FULL` ({self.vacuum_full_seconds:.0f} s; rewrites every table and "
            "index under an exclusive lock, which a live system would not do: the live data "
            "of the queued runs alone):",
            "",
            self.sizes_table(self.compacted, n),
            "",
            "### Caveats",
            "",
            "* These are freshly written rows: each finished run was inserted once in its "
            "final state. A live system inserts the run QUEUED and updates it three times "
            "(CLAIMED, FINALIZING, SUCCEEDED; more stages for a real agent run); `status` "
            "and `updated_at` are indexed, so none of those updates is HOT and each leaves "
            "dead tuples and index entries for (auto)vacuum. The figures here are the "
            "floor a live table converges to only with vacuum keeping up; expect more.",
            "* Times (population, retention) depend on the load shown above (the machine "
            "was shared); the sizes do not: two runs gave the same database size.",
            "* A real agent run walks PREPARING_SANDBOX, RUNNING, VERIFYING and JUDGING "
            "too: each hop adds one `run_events` row (about "
            + (f"{events.total / max(events.rows, 1):,.0f} B with its indexes"
               if events else "?")
            + "), and a run that opens a pull request adds `side_effects` rows; prompts "
            "and context larger than one line grow `tasks` (TOAST past about 2 kB).",
            "",
            END,
            "",
        ]
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=1_000_000,
                        help="queued runs, and as many finished runs (default %(default)s)")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL,
                        help="a server and any database on it (default %(default)s)")
    parser.add_argument("--prune-batches", type=int, default=20,
                        help="batches of runlane's retention job to time (default "
                             "%(default)s); the rest of the finished runs go set-based")
    parser.add_argument("--no-audit", action="store_true",
                        help="skip Store.audit() over the populated database")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="also put the Markdown section into PATH (e.g. docs/benchmarks.md)")
    lifecycle.add_details_flag(parser)
    args = parser.parse_args(argv)
    lifecycle.DETAILS = args.details
    configure_logging("WARNING")
    started = datetime.now(UTC)
    wall = time.monotonic()
    name = f"runlane_bench_sizes_{os.getpid()}"
    with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
        admin.execute(f'CREATE DATABASE "{name}"'.encode())
    url = with_database(args.postgres_url, name)
    load_before = load_average()
    try:
        progress(f"migrating {name}")
        store = Store(url)
        try:
            upgrade(store.engine)
        finally:
            store.close()
        progress("templates: submit 2, claim + complete 1 with the real store")
        templates = make_templates(url)
        progress(f"populating {args.runs:,} finished + {args.runs:,} queued runs")
        seconds = populate(url, templates, args.runs)
        full = snapshot(url, "populated")
        widths = column_widths(url)
        audit = ""
        if not args.no_audit:
            progress("Store.audit() over the populated database")
            audit = run_audit(url)
            progress(f"audit: {audit}")
        progress(f"retention: pruning finished runs older than {KEEP_DAYS} days")
        retention = prune(url, args.prune_batches)
        vacuum_seconds = maintenance(url, "VACUUM ANALYZE")
        pruned = snapshot(url, "after retention + VACUUM")
        vacuum_full_seconds = maintenance(url, "VACUUM FULL ANALYZE")
        compacted = snapshot(url, "after VACUUM FULL")
        facts = postgres_facts(url)
        environment = [
            ("Date (UTC)", f"{started:%Y-%m-%d %H:%M:%S}"),
            ("Machine", f"{os.cpu_count()} CPUs, {cpu_model()}, {memory_total()} RAM"),
            ("OS", f"Linux {platform.release()}"),
            ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
            ("PostgreSQL", f"{facts['server_version']} on the same machine; shared_buffers "
                           f"{facts['shared_buffers']}, work_mem {facts['work_mem']}, "
                           f"synchronous_commit {facts['synchronous_commit']}, fsync "
                           f"{facts['fsync']}; 8 kB pages, btree fillfactor 90 (defaults)"),
            ("runlane", runlane_source()),
            ("Population", ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
             + f"; {sum(seconds.values()):.0f} s in all"),
            *([("Store.audit() after population", audit)] if audit else []),
            ("Load average (1/5/15 min)", f"{load_before} at start, {load_average()} at end"),
        ]
        report = Report(display_command([sys.argv[0], *(argv or sys.argv[1:])]), started,
                        args.runs, environment, templates, seconds, full, pruned, compacted,
                        widths, retention, vacuum_seconds,
                        vacuum_full_seconds)
        report.wall = time.monotonic() - wall
        section = report.render()
    finally:
        with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
    sys.stdout.write(section)
    if args.write is not None:
        merge_section(args.write, section, START, END)
        progress(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
