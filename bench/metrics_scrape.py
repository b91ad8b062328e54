"""One metrics scrape's database statement (store/gauges_sql.py:GAUGES) at 1,000,000
queued runs over 1,000 tenants (issue 24: target ≤ 5 ms), on PostgreSQL and SQLite.

Population, set-based SQL into a fresh database: ``--runs`` QUEUED runs over
``--tenants`` tenants, ``--queues`` queues and ``--priorities`` priorities (one lane per
tenant, queue and priority, its ``queued_count`` as submit keeps it; 1% of the runs in
a retry's backoff); beside them what a long-lived database holds: ``--attempts`` ended
attempts and 500 active leases, 5,000 stopped workers and 200 live ones, 30 days of
spend for every tenant, a policy giving 100 tenants a daily budget. ``ANALYZE``d.

Timed, ``--samples`` times each: the statement's execution on the server (PostgreSQL:
``EXPLAIN ANALYZE``), and the whole reading as a scrape makes it
(``DatabaseGauges.reading()`` without its cache: pool checkout, round trip, rows to
figures), in five rounds alternating the two. Prints the plan.

    .venv/bin/python bench/metrics_scrape.py                      # both engines
    .venv/bin/python bench/metrics_scrape.py --engine postgresql --queues 4 --priorities 5
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import BENCH_POSTGRES_URL, drop_postgres, fresh_postgres, migrate, percentile
from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.logs import configure_logging
from runlane.observability.gauges import DatabaseGauges
from runlane.store import gauges_sql
from runlane.store.gauges import gauge_parameters
from runlane.store.store import Store

NOW = 1_800_000_000.0  # the pinned "now" of every statement (runs created before it)


def series(dialect: str, count: int) -> str:
    """A relation ``g(g)`` of 1..count."""
    if dialect == "postgresql":
        return f"generate_series(1, {count}) AS g(g)"
    return (f"(WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s "
            f"WHERE g < {count}) SELECT g FROM s) AS g")


def populate(store: Store, args: argparse.Namespace) -> None:
    d = store.dialect
    t, q, p = args.tenants, args.queues, args.priorities
    lanes = t * q * p
    budgets = "\n".join(f"[tenants.tenant{i}]\ndaily_model_budget_usd = 50.0"
                        for i in range(0, t, max(1, t // 100)))
    store.apply_policy(parse_policy(budgets), source="bench")
    # Run g: tenant g % t, queue (g / t) % q, priority (g / t / q) % p; its lane is the
    # lane of that triple (lanes numbered in the same order).
    tenant, queue, prio = "(g % {t})", "((g / {t}) % {q})", "((g / ({t} * {q})) % {p})"
    tenant, queue, prio = (x.format(t=t, q=q, p=p) for x in (tenant, queue, prio))
    lane = f"({tenant} * {q * p} + {queue} * {p} + {prio} + 1)"
    cat = "||"
    statements = [
        f"""INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                max_attempts, visible_at, created_at, updated_at, lane_id)
            SELECT 'run-' {cat} g, 'task-' {cat} g, 'tenant' {cat} {tenant},
                   'https://git.example.com/acme/app' {cat} (g % 97), 'q' {cat} {queue},
                   {prio} * 50, 'QUEUED', 3,
                   CASE WHEN g % 100 = 0 THEN {NOW} + 600 ELSE {NOW} - 86400 + g / 100.0 END,
                   {NOW} - 86400 + g / 100.0, {NOW} - 86400 + g / 100.0, {lane}
            FROM {series(d, args.runs)}""",
        """INSERT INTO lanes (lane_id, queue, route_key, priority, tenant, weight,
                queued_count, pass, tenant_at_limit)
            SELECT lane_id, MIN(queue), '', MIN(priority), MIN(tenant), 1, COUNT(*), 0, 0
            FROM runs GROUP BY lane_id""",
        f"""INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,
                reason_code, lease_status, lease_expires_at, lease_ended_at, heartbeat_at,
                started_at, ended_at)
            SELECT 'done-' {cat} g, 1, 1, 'w', 'SUCCEEDED', NULL, 'RELEASED', {NOW} - 1000,
                   {NOW} - 1000, {NOW} - 1000, {NOW} - 2000, {NOW} - 1000
            FROM {series(d, args.attempts)}""",
        f"""INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,
                lease_status, lease_expires_at, heartbeat_at, started_at)
            SELECT 'active-' {cat} g, 1, 1, 'live-' {cat} (g % 200), 'RUNNING', 'ACTIVE',
                   {NOW} + 60, {NOW} - 5, {NOW} - 100
            FROM {series(d, 500)}""",
        f"""INSERT INTO workers (worker_id, version, queues, capabilities, status,
                started_at, heartbeat_at)
            SELECT CASE WHEN g <= 200 THEN 'live-' {cat} (g - 1) ELSE 'gone-' {cat} g END,
                   'bench', '["q0"]', '{{}}',
                   CASE WHEN g <= 200 THEN 'READY' WHEN g % 2 = 0 THEN 'STOPPED'
                        ELSE 'DEAD' END, {NOW} - 90000, {NOW} - (g % 7)
            FROM {series(d, 5200)}""",
        f"""INSERT INTO tenant_spend (tenant, day, usd)
            SELECT 'tenant' {cat} (g % {t}), '2027-01-' {cat} (10 + g / {t}), 1.5
            FROM {series(d, t * 30)} WHERE g / {t} < 30""",
    ]
    with store.engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))
    with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE" if d == "postgresql" else "ANALYZE"))
    print(f"  {args.runs:,} queued runs in {lanes:,} lanes, {args.attempts:,} ended "
          "attempts, 500 leases, 5,200 workers (200 live)", file=sys.stderr)


def timed(fn: Callable[[], Any], samples: int) -> list[float]:
    fn()  # a warm-up: the pool's connection, the plan
    took = []
    for _ in range(samples):
        started = time.perf_counter()
        fn()
        took.append((time.perf_counter() - started) * 1000.0)
    return took


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    store = Store(url, clock=ManualClock(NOW))  # the population's "now"
    try:
        started = time.perf_counter()
        populate(store, args)
        seeded = time.perf_counter() - started
        reader = DatabaseGauges(store, cache_seconds=0.0)
        reading = reader.reading()
        params = gauge_parameters(store, tenants=sorted(reader.budgets()), day="2027-01-15")
        statement = gauges_sql.GAUGES[store.dialect]
        client: list[float] = []
        server: list[float] = []
        with store.engine.connect() as conn:
            explain = store._sql.render("EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) " + statement)

            def on_the_server() -> None:
                [plan] = conn.execute(explain, params).scalar_one()
                server.append(float(plan["Execution Time"]))

            # Rounds alternating the two, so that the machine's other load falls on both.
            for _ in range(5):
                client += timed(reader.reading, args.samples // 5)
                if store.is_postgres:
                    for _ in range(args.samples // 5):
                        on_the_server()
            if store.is_postgres:
                text_plan = store._sql.render(
                    "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + statement)
                plan = "\n".join(conn.execute(text_plan, params).scalars())
                plan = re.sub(r"'\{tenant0,[^}]*\}'", "'{tenant0,tenant10,...}'", plan)
            else:
                explain = store._sql.render("EXPLAIN QUERY PLAN " + statement)
                plan = "\n".join(f"{r[0]:>3} {r[1]:>3} {r[3]}"
                                  for r in conn.execute(explain, params))
        result: dict[str, Any] = {"seeded_s": seeded, "client": client, "reading": reading,
                                  "plan": plan, "load": os.getloadavg()[0]}
        if server:
            result["server"] = server
        return result
    finally:
        store.close()


def report(engine: str, result: dict[str, Any]) -> None:
    client = result["client"]
    line = (f"{engine}: reading p50 {percentile(client, 50):.2f} ms, "
            f"p95 {percentile(client, 95):.2f} ms")
    if "server" in result:
        server = result["server"]
        line += (f"; statement on the server p50 {percentile(server, 50):.2f} ms, "
                 f"p95 {percentile(server, 95):.2f} ms")
    r = result["reading"]
    print(line + f" ({len(client)} samples; seeded in {result['seeded_s']:.0f} s; load "
                 f"average {result['load']:.1f})")
    print(f"  {len(r.queue_depth)} queues, depth {sum(r.queue_depth.values()):,}, "
          f"{r.active_leases} leases, {len(r.heartbeat_lag)} live workers, "
          f"{len(r.spend_today)} budgets' spend")
    print(result["plan"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["postgresql", "sqlite", "both"], default="both")
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--queues", type=int, default=1)
    parser.add_argument("--priorities", type=int, default=1)
    parser.add_argument("--attempts", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=50)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    print(f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.engine in ("postgresql", "both"):
        name = f"runlane_bench_metrics_{os.getpid()}"
        url = fresh_postgres(BENCH_POSTGRES_URL, name)
        try:
            report("PostgreSQL", bench(url, args))
        finally:
            drop_postgres(BENCH_POSTGRES_URL, name)
    if args.engine in ("sqlite", "both"):
        with tempfile.TemporaryDirectory(prefix="runlane-bench-metrics-") as directory:
            url = f"sqlite:///{directory}/runlane.db"
            migrate(url)
            report("SQLite", bench(url, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
