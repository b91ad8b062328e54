"""`runlane top`'s reads at scale (issue 24): one refresh at 1,000,000 runs on PostgreSQL.

Times, over ``--refreshes`` calls each: the facade's ``claim_rates`` (claims per queue
in the last minute), ``failures`` (the latest 10; as the operator and as a tenant's
principal) and a whole refresh (``FacadeSource.fetch``: queues, tenants, workers and
both of those), client time; and the two statements' execution on the server (EXPLAIN
ANALYZE), with their plans.

Population: ``--runs`` runs of 1,000 tenants in 10 queues (one lane per tenant and
queue: 10,000 lanes); 80% SUCCEEDED, 8% FAILED, 12% QUEUED and 500 RUNNING (on 50
workers); an attempt per run that is not queued, started 0.06 s apart up to now (1,000
claims a minute); two events per such run (CLAIMED when its attempt started, and how
it ended) plus a FAILED_RETRYABLE and a QUEUED event for 5% of the successful ones.

``--index-cost``: instead, what ``ix_run_events_claims`` (the entry a claim now writes)
costs: the claim + complete drain of ``bench/lifecycle.py`` (one claimer, claims of one
run, ``--drain-runs`` no-op runs per round), ``--rounds`` rounds alternating with and
without it after an unrecorded warm-up cell; then 50,000 inserts of a claim event in
one PL/pgSQL loop on the server, six rounds alternating.

    .venv/bin/python bench/top_reads.py                     # 1,000,000 runs
    .venv/bin/python bench/top_reads.py --index-cost --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import (
    BENCH_POSTGRES_URL,
    TABLES,
    drop_postgres,
    fresh_postgres,
    libpq,
    load_average,
    percentile,
    pg_admin,
    run_cell,
)
from run_listing import server_ms
from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.access import Principal, Role
from runlane.logs import configure_logging
from runlane.store import activity_sql
from runlane.tui.snapshot import FacadeSource

TENANTS = 1000
QUEUES = 10
# Run g: tenant g mod 1000, queue (g / 7) mod 10; status by g mod 100 (500 running).
STATUS = """CASE WHEN mod(g, 20000) < 10 THEN 'RUNNING' WHEN mod(g, 100) < 80 THEN 'SUCCEEDED'
                 WHEN mod(g, 100) < 88 THEN 'FAILED' ELSE 'QUEUED' END"""
POPULATE = f"""
INSERT INTO lanes (lane_id, queue, route_key, priority, tenant, weight, queued_count, pass)
SELECT t * {QUEUES} + q + 1, 'q' || q, '', 100, 'tenant' || t, 1, 0, 0
FROM generate_series(0, {TENANTS - 1}) AS t, generate_series(0, {QUEUES - 1}) AS q;
INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, max_attempts,
                  attempt_count, fencing_token, visible_at, created_at, updated_at,
                  ended_at, reason_code, lane_id)
SELECT lpad(to_hex(g), 12, '0') || '-run', lpad(to_hex(g), 12, '0') || '-task',
       'tenant' || mod(g, {TENANTS}), 'https://github.com/acme/app' || mod(g, 97),
       'q' || mod(g / 7, {QUEUES}), 100, {STATUS}, 3,
       CASE WHEN {STATUS} = 'QUEUED' THEN 0 ELSE 1 END,
       CASE WHEN {STATUS} = 'QUEUED' THEN 0 ELSE 1 END,
       {{now}} - ({{runs}} - g) * 0.06, {{now}} - ({{runs}} - g) * 0.06 - 5,
       {{now}} - ({{runs}} - g) * 0.06 + 1,
       CASE WHEN {STATUS} IN ('SUCCEEDED', 'FAILED') THEN {{now}} - ({{runs}} - g) * 0.06 END,
       CASE WHEN {STATUS} = 'FAILED' THEN 'TIMEOUT' END,
       mod(g, {TENANTS}) * {QUEUES} + mod(g / 7, {QUEUES}) + 1
FROM generate_series(1, {{runs}}) AS g;
UPDATE lanes l SET queued_count = c.n
FROM (SELECT lane_id, COUNT(*) AS n FROM runs WHERE status = 'QUEUED' GROUP BY lane_id) c
WHERE c.lane_id = l.lane_id;
INSERT INTO workers (worker_id, version, queues, capabilities, status, started_at,
                     heartbeat_at)
SELECT 'host' || w || '/w', '0.1', '["q0"]', '{{}}', 'READY', {{now}} - 3600, {{now}} - 2
FROM generate_series(0, 49) AS w;
INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status, reason_code,
                      lease_status, lease_expires_at, heartbeat_at, started_at, ended_at)
SELECT run_id, 1, 1, 'host' || mod(abs(hashtext(run_id)), 50) || '/w',
       CASE status WHEN 'RUNNING' THEN 'RUNNING' ELSE status END, reason_code,
       CASE status WHEN 'RUNNING' THEN 'ACTIVE' ELSE 'RELEASED' END,
       {{now}} + 600, visible_at, visible_at, ended_at
FROM runs WHERE status <> 'QUEUED';
INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status, reason_code)
SELECT run_id, 1, visible_at, 'w', 'QUEUED', 'CLAIMED', NULL FROM runs
WHERE status <> 'QUEUED'
UNION ALL
SELECT run_id, 1, ended_at, 'w', 'RUNNING', status, reason_code FROM runs
WHERE status IN ('SUCCEEDED', 'FAILED')
UNION ALL
SELECT run_id, 1, visible_at - 0.5, 'w', 'RUNNING', x.to_status, 'PROVIDER_RATE_LIMIT'
FROM runs, (VALUES ('FAILED_RETRYABLE'), ('QUEUED')) AS x(to_status)
WHERE status = 'SUCCEEDED' AND mod(hashtext(run_id), 20) = 0;
"""


INSERT_LOOP = """
DO $$ BEGIN FOR i IN 1..50000 LOOP
  INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                          fencing_token)
  VALUES ('r' || i, 1, extract(epoch from clock_timestamp()), 'w', 'QUEUED', 'CLAIMED', 1);
END LOOP; END $$
"""
INDEX = "ix_run_events_claims"
CREATE_INDEX = (f"CREATE INDEX IF NOT EXISTS {INDEX} ON run_events (at) "
                "WHERE to_status = 'CLAIMED'")


def timed(call: Callable[[], Any], times: int) -> list[float]:
    took = []
    for _ in range(times):
        began = time.perf_counter()
        call()
        took.append((time.perf_counter() - began) * 1000.0)
    return took


def reads(args: argparse.Namespace) -> None:
    name = f"runlane_bench_top_{os.getpid()}"
    url = fresh_postgres(BENCH_POSTGRES_URL, name)
    try:
        started = time.perf_counter()
        now = time.time()
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            for statement in POPULATE.split(";\n"):
                if statement.strip():
                    conn.execute(statement.replace("{now}", repr(now))
                                 .replace("{runs}", str(args.runs)).encode())
            conn.execute(b"VACUUM ANALYZE")
            sizes = conn.execute(
                "SELECT (SELECT COUNT(*) FROM runs), (SELECT COUNT(*) FROM attempts), "
                "(SELECT COUNT(*) FROM run_events), (SELECT COUNT(*) FROM run_events WHERE "
                "to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED'))").fetchone()
        print(f"populated in {time.perf_counter() - started:.0f} s: runs, attempts, events, "
              f"failure events = {sizes}")
        tenant = Principal(role=Role.READ, tenant="tenant7", token_id="bench")
        # The facade's "now" is the population's (the population takes a minute or two,
        # and the claims of "the last minute" would be gone).
        with Runlane(url, clock=ManualClock(now)) as lane, \
                psycopg.connect(libpq(url), autocommit=True) as conn:
            source = FacadeSource(lane, failures=10, claim_window=60)
            source.fetch()  # the pool's connections, the schema check
            calls = {
                "queues()": lambda: lane.queues(),
                "tenants()": lambda: lane.tenants(),
                "workers()": lambda: lane.workers(),
                "claim_rates()": lambda: lane.claim_rates(),
                "failures(limit=10)": lambda: lane.failures(limit=10),
                "failures(limit=10), a tenant's principal":
                    lambda: lane.failures(principal=tenant, limit=10),
                "a whole refresh (FacadeSource.fetch)": source.fetch,
            }
            for label, call in calls.items():
                took = timed(call, args.refreshes)
                print(f"{label}: client p50 {percentile(took, 50):.2f} ms, "
                      f"p95 {percentile(took, 95):.2f} ms ({args.refreshes} calls)")
            print(f"claims in the last minute: {lane.claim_rates().queues[:3]} ...")
            statements = {
                "CLAIMS_SINCE": (activity_sql.CLAIMS_SINCE, {"since": now - 60, "cap": 5000}),
                "FAILURES": (activity_sql.FAILURES, {"scan": 10}),
                "TENANT_FAILURES": (activity_sql.TENANT_FAILURES,
                                    {"scan": 1000, "limit": 10, "tenant": "tenant7"}),
            }
            for label, (sql, params) in statements.items():
                took = [server_ms(conn, sql, params) for _ in range(args.refreshes)]
                times = [t for t, _ in took]
                print(f"{label}: server p50 {percentile(times, 50):.3f} ms, "
                      f"p95 {percentile(times, 95):.3f} ms")
                print(json.dumps(took[-1][1], indent=1))
    finally:
        if not args.keep:
            drop_postgres(BENCH_POSTGRES_URL, name)


def index_cost(args: argparse.Namespace) -> None:
    name = f"runlane_bench_top_index_{os.getpid()}"
    url = fresh_postgres(BENCH_POSTGRES_URL, name)
    rates: dict[bool, list[float]] = {True: [], False: []}
    server: dict[bool, list[float]] = {True: [], False: []}
    try:
        if args.rounds:  # the first cell of a fresh database is slow: not a round
            pg_admin(url, CREATE_INDEX)
            run_cell("postgresql", url, 1, 1, min(args.drain_runs, 1000))
        for round_no in range(args.rounds):
            for with_index in (True, False) if round_no % 2 == 0 else (False, True):
                pg_admin(url, f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE",
                         CREATE_INDEX if with_index else f"DROP INDEX IF EXISTS {INDEX}")
                cell = run_cell("postgresql", url, 1, 1, args.drain_runs)
                rates[with_index].append(cell.throughput)
                server_ms = (cell.db_cpu or 0.0) * 1000.0 / max(cell.done, 1)
                server[with_index].append(server_ms)
                print(f"round {round_no + 1}, {'with' if with_index else 'without'} "
                      f"{INDEX}: {cell.throughput:,.0f} runs/s, server CPU "
                      f"{server_ms:.3f} ms per run (load {load_average()})", flush=True)
        # The index's own cost on the server: 50,000 single-row inserts of a claim event
        # in one PL/pgSQL loop (no round trips, no commits), with and without it.
        inserts: dict[bool, list[float]] = {True: [], False: []}
        for round_no in range(6):
            for with_index in (True, False) if round_no % 2 == 0 else (False, True):
                pg_admin(url, "TRUNCATE run_events",
                         CREATE_INDEX if with_index else f"DROP INDEX IF EXISTS {INDEX}")
                began = time.perf_counter()
                pg_admin(url, INSERT_LOOP)
                inserts[with_index].append((time.perf_counter() - began) / 50_000 * 1e6)
    finally:
        drop_postgres(BENCH_POSTGRES_URL, name)
    for with_index, found in rates.items():
        if found:
            print(f"drain {'with' if with_index else 'without'}: median "
                  f"{percentile(found, 50):,.0f} runs/s, rounds "
                  + ", ".join(f"{r:,.0f}" for r in found)
                  + f"; server CPU per run median {percentile(server[with_index], 50):.3f}"
                  " ms, rounds " + ", ".join(f"{r:.3f}" for r in server[with_index]))
    for with_index, found in inserts.items():
        print(f"insert of a claim event in the server, {'with' if with_index else 'without'}: "
              f"median {percentile(found, 50):.1f} us, rounds "
              + ", ".join(f"{r:.1f}" for r in found))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--refreshes", type=int, default=200)
    parser.add_argument("--keep", action="store_true", help="Keep the database afterwards.")
    parser.add_argument("--index-cost", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drain-runs", type=int, default=5000)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    if args.index_cost:
        index_cost(args)
    else:
        reads(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
