"""Heartbeats at scale (PostgreSQL): active leases held by many workers, each beating
every ``--interval`` seconds through ``Store.heartbeat``, as the worker does.

Each cell is a fresh database (``runlane_bench_heartbeat_<pid>``, migrated with
runlane's migrations, dropped at the end) set to one schema variant, then filled the
way workers fill it: ``Store.submit`` the tasks, ``Store.claim`` them 40 at a time by
``leases / 40`` worker ids. Then the beats, paced: every worker extends its 40 leases
once per interval, the workers spread evenly over it, for ``--seconds``. Measured:

- server CPU: the user + system time of the cell database's backends (from /proc, so
  other databases' work on the same server is not counted), per second of the window
  and per lease beat;
- the heartbeat statement's latency as the client sees it (p50, p99);
- WAL per lease beat: sampled beats are replayed as ``EXPLAIN (ANALYZE, WAL)`` of the
  very statement and parameters the store sent (captured from SQLAlchemy's cursor
  event), in a transaction rolled back; WAL is cluster-wide, so reading
  ``pg_current_wal_lsn()`` would count other databases' writes;
- the share of the beats' updates of ``attempts`` that were HOT (no index entry written:
  ``pg_stat_user_tables.n_tup_hot_upd / n_tup_upd`` over the window);
- the reaper's pass with no lease expired (``Store.reap_expired_batch``), p50 of 20.

Variants, each measured in the same run:

- ``expiry-index``: the schema before migration 0027: a partial index on
  ``attempts (lease_expires_at) WHERE lease_status = 'ACTIVE'`` (the reaper's scan), so
  every beat changes an indexed column and none can be HOT;
- ``no-index``: that index dropped (the reaper reads the active leases through
  ``uq_attempts_one_active_lease``, same predicate, and sorts them): runlane's schema
  since migration 0027;
- ``no-index-ff``: and ``attempts`` with ``fillfactor = 80`` (free room on each page for
  the beat's new row version, the condition of a HOT update). Measured, not adopted:
  every attempt row, finished ones too, would take a quarter more pages for the whole
  retention, for a few percent of a core at 10,000 leases.

::

    .venv/bin/python bench/heartbeat.py --write docs/benchmarks.md
    .venv/bin/python bench/heartbeat.py --leases 1000 --seconds 10   # a smoke run
"""

from __future__ import annotations

import argparse
import json
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
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import (
    BENCH_POSTGRES_URL,
    cpu_model,
    display_command,
    drop_postgres,
    fresh_postgres,
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
from runlane.domain.tasks import parse_task
from runlane.logs import configure_logging
from runlane.store.engine import build_engine
from runlane.store.records import Lease
from runlane.store.store import Store

START, END = "<!-- heartbeat:start -->", "<!-- heartbeat:end -->"
TITLE = "Heartbeats at 1,000 and 10,000 active leases: `bench/heartbeat.py`"
PER_WORKER = 40
LEASE_TTL = 3600.0  # the bench's leases never expire while it runs
VARIANTS = ("expiry-index", "no-index", "no-index-ff")
EXPIRY_INDEX = ("CREATE INDEX IF NOT EXISTS ix_attempts_active_lease_expiry "
                "ON attempts (lease_expires_at) WHERE lease_status = 'ACTIVE'")


@dataclass
class Cell:
    variant: str
    leases: int
    workers: int
    beats: int  # heartbeat calls in the window
    lease_beats: int
    seconds: float
    behind: float  # the most the driver fell behind its schedule, seconds
    cpu: float  # backend CPU seconds in the window
    latencies: list[float]
    wal_bytes: list[float]  # per lease beat, sampled
    wal_records: list[float]
    hot: float  # HOT share of the window's updates of attempts
    reaper: float  # p50 seconds of an empty reaper pass


def set_variant(url: str, variant: str) -> None:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        if variant == "expiry-index":
            conn.execute(EXPIRY_INDEX.encode())
        else:
            conn.execute(b"DROP INDEX IF EXISTS ix_attempts_active_lease_expiry")
        fillfactor = 80 if variant == "no-index-ff" else 100
        conn.execute(f"ALTER TABLE attempts SET (fillfactor = {fillfactor})".encode())


def fill(store: Store, leases: int) -> dict[str, list[Lease]]:
    """``leases`` runs submitted and claimed, PER_WORKER to a worker id."""
    specs = [parse_task({"tenant": f"tenant-{i % 8}", "repo": "/srv/bench/repo.git",
                         "prompt": "no-op", "idempotency_key": f"hb-{i}"})
             for i in range(leases)]
    for i in range(0, len(specs), 1000):
        store.submit(specs[i:i + 1000])
    held: dict[str, list[Lease]] = {}
    for w in range(leases // PER_WORKER):
        worker = f"bench-host-{w:03d}/{10_000 + w}/w"
        held[worker] = store.claim(worker, limit=PER_WORKER, lease_ttl=LEASE_TTL)
    got = sum(len(v) for v in held.values())
    if got != leases:
        raise SystemExit(f"claimed {got} of {leases} runs")
    return held


def backend_pids(url: str, database: str) -> list[int]:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s "
                            "AND pid <> pg_backend_pid()", (database,)).fetchall()
    return [int(r[0]) for r in rows]


def update_counts(url: str) -> tuple[int, int]:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                           "WHERE relname = 'attempts'").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def run_cell(admin_url: str, variant: str, leases: int, interval: float,
             seconds: float, samples: int) -> Cell:
    database = f"runlane_bench_heartbeat_{os.getpid()}"
    url = fresh_postgres(admin_url, database)
    set_variant(url, variant)
    engine = build_engine(url)
    try:
        store = Store(url, engine=engine)
        progress(f"{variant} at {leases:,} leases: filling")
        held = fill(store, leases)
        workers = list(held)
        # Warm up: one round of beats (plans cached, pages read), not measured.
        for worker in workers:
            store.heartbeat(worker, held[worker], lease_ttl=LEASE_TTL)
        time.sleep(1.2)  # the backends report their table counters when idle 1 s
        upd0, hot0 = update_counts(url)
        pids = backend_pids(url, database)
        cpu0 = sum(process_cpu(p) for p in pids)
        progress(f"{variant} at {leases:,} leases: beating for {seconds:g}s")
        latencies: list[float] = []
        behind = 0.0
        gap = interval / len(workers)
        started = time.monotonic()
        beat = 0
        while True:
            due = started + beat * gap
            if due - started >= seconds:
                break
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            else:
                behind = max(behind, now - due)
            worker = workers[beat % len(workers)]
            t0 = time.perf_counter()
            result = store.heartbeat(worker, held[worker], lease_ttl=LEASE_TTL)
            latencies.append(time.perf_counter() - t0)
            if result.lost:
                raise SystemExit(f"{worker} lost leases: {result.lost}")
            beat += 1
        window = time.monotonic() - started
        pids = sorted(set(pids) | set(backend_pids(url, database)))
        cpu = sum(process_cpu(p) for p in pids) - cpu0
        time.sleep(1.2)
        upd1, hot1 = update_counts(url)
        updates = upd1 - upd0
        wal_bytes, wal_records = sample_wal(engine, store, held, samples)
        reaper = []
        for _ in range(20):
            t0 = time.perf_counter()
            store.reap_expired_batch()
            reaper.append(time.perf_counter() - t0)
        return Cell(variant=variant, leases=leases, workers=len(workers), beats=beat,
                    lease_beats=beat * PER_WORKER, seconds=window, behind=behind, cpu=cpu,
                    latencies=latencies, wal_bytes=wal_bytes, wal_records=wal_records,
                    hot=(hot1 - hot0) / updates if updates else 0.0,
                    reaper=percentile(reaper, 50))
    finally:
        engine.dispose()
        drop_postgres(admin_url, database)


def sample_wal(engine: Any, store: Store, held: dict[str, list[Lease]],
               samples: int) -> tuple[list[float], list[float]]:
    """WAL bytes and records per lease beat: the heartbeat statement the store sends,
    captured, replayed under EXPLAIN (ANALYZE, WAL) and rolled back."""
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any,
                context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("UPDATE ATTEMPTS"):
            captured.append((statement, parameters))

    workers = list(held)
    per_beat_bytes: list[float] = []
    per_beat_records: list[float] = []
    for i in range(samples):
        worker = workers[(i * 7) % len(workers)]
        captured.clear()
        event.listen(engine, "before_cursor_execute", capture)
        try:
            store.heartbeat(worker, held[worker], lease_ttl=LEASE_TTL)
        finally:
            event.remove(engine, "before_cursor_execute", capture)
        if len(captured) != 1:
            raise SystemExit(f"expected one heartbeat statement, saw {len(captured)}")
        statement, parameters = captured[0]
        with engine.connect() as conn:
            cursor = conn.connection.driver_connection.cursor()
            cursor.execute("EXPLAIN (ANALYZE, WAL, FORMAT JSON) " + statement, parameters)
            plan = cursor.fetchone()[0]
            conn.rollback()
        top = (plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"]
        per_beat_bytes.append(float(top.get("WAL Bytes", 0)) / PER_WORKER)
        per_beat_records.append(float(top.get("WAL Records", 0)) / PER_WORKER)
    return per_beat_bytes, per_beat_records


def render(cells: Sequence[Cell], argv: Sequence[str], admin_url: str,
           interval: float) -> str:
    facts = postgres_facts(admin_url)
    rows = []
    for c in cells:
        rows.append([
            f"{c.leases:,}", f"{c.workers}", c.variant,
            f"{c.lease_beats / c.seconds:,.0f}",
            f"{100 * c.cpu / c.seconds:.1f}%",
            f"{1e6 * c.cpu / c.lease_beats:.0f} µs" if c.lease_beats else "-",
            f"{1e3 * percentile(c.latencies, 50):.2f} / {1e3 * percentile(c.latencies, 99):.2f}",
            f"{percentile(c.wal_bytes, 50):,.0f} B / {percentile(c.wal_records, 50):.1f}",
            f"{100 * c.hot:.0f}%",
            f"{1e3 * c.reaper:.2f} ms",
            f"{c.behind:.2f}s",
        ])
    base = {c.leases: c for c in cells if c.variant == "expiry-index"}
    ratios = []
    for c in cells:
        b = base.get(c.leases)
        if b is None or c is b or not b.cpu or not percentile(b.wal_bytes, 50):
            continue
        ratios.append(f"{c.variant} at {c.leases:,} leases: server CPU "
                      f"{(c.cpu / c.seconds) / (b.cpu / b.seconds):.2f}x, WAL per lease beat "
                      f"{percentile(c.wal_bytes, 50) / percentile(b.wal_bytes, 50):.2f}x "
                      "of expiry-index")
    header = ["leases", "workers", "schema", "lease beats/s", "server CPU (of a core)",
              "CPU per lease beat", "beat p50 / p99 (ms)", "WAL per lease beat (bytes / records)",
              "HOT updates", "empty reaper pass", "driver behind (max)"]
    lines = [
        START,
        f"## {TITLE}",
        "",
        f"Each worker beats its {PER_WORKER} leases every {interval:g} s (`Store.heartbeat`, "
        "one statement per worker). Server CPU: the backends of the bench database only. "
        "WAL: sampled beats replayed under `EXPLAIN (ANALYZE, WAL)`. Schemas: "
        "`expiry-index` is runlane's before migration 0027 (a partial index on "
        "`attempts.lease_expires_at`); `no-index` without it (runlane's schema now); "
        "`no-index-ff` also `fillfactor = 80` on `attempts` (not adopted: a quarter more "
        "pages for every attempt row).",
        "",
        table(header, rows, align="rrlrrrrrrrr"),
        "",
        *[f"- {r}" for r in ratios],
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, {memory_total()}, "
        f"{platform.system()} {platform.release()}; load {load_average()}. PostgreSQL "
        f"{facts['server_version']} (shared_buffers {facts['shared_buffers']}, "
        f"synchronous_commit {facts['synchronous_commit']}). runlane: {runlane_source()}. "
        f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        "```sh",
        display_command(argv),
        "```",
        END,
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", default="1000,10000",
                        help="active lease counts, comma-separated (multiples of 40)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--interval", type=float, default=10.0,
                        help="seconds between two beats of one worker (default 10)")
    parser.add_argument("--seconds", type=float, default=30.0, help="window per cell")
    parser.add_argument("--samples", type=int, default=20, help="beats replayed for WAL")
    parser.add_argument("--database-url", default=BENCH_POSTGRES_URL)
    parser.add_argument("--write", type=Path, help="merge the section into this file")
    args = parser.parse_args(argv)
    configure_logging(level="warning", json=False)
    counts = [int(v) for v in args.leases.split(",")]
    if any(n % PER_WORKER or n <= 0 for n in counts):
        parser.error(f"--leases: each count must be a positive multiple of {PER_WORKER}")
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    cells = [run_cell(args.database_url, variant, n, args.interval, args.seconds, args.samples)
             for n in counts for variant in variants]
    section = render(cells, sys.argv if argv is None else ["bench/heartbeat.py", *argv],
                     args.database_url, args.interval)
    print(section)
    if args.write:
        merge_section(args.write, section, START, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
