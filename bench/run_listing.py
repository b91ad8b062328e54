"""The runs listing at scale (issue 23): a page of 50 of one tenant's runs in one
status, newest first, at 1,000,000 runs on PostgreSQL; first pages and pages after a
cursor. Times the facade's call (``Runlane.runs_page``: client time) and the
statement's execution on the server (EXPLAIN ANALYZE), and prints the plan.

Population: ``--runs`` runs of 1,000 tenants; statuses 80% SUCCEEDED, 8% FAILED,
7% QUEUED, 5% RUNNING; ten runs share each ``created_at`` (so page boundaries fall
among equal timestamps).

    .venv/bin/python bench/run_listing.py                  # 1,000,000 runs
    .venv/bin/python bench/run_listing.py --runs 100000 --pages 100
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import BENCH_POSTGRES_URL, drop_postgres, fresh_postgres, libpq, percentile
from runlane.api import Runlane
from runlane.api_views import decode_cursor
from runlane.logs import configure_logging
from runlane.store.views_sql import runs_page_sql

TENANTS = 1000
POPULATE = """
INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, max_attempts,
                  visible_at, created_at, updated_at)
SELECT lpad(to_hex(g), 12, '0') || '-run', lpad(to_hex(g), 12, '0') || '-task',
       'tenant' || (g % {tenants}), 'https://github.com/acme/app' || (g % 97), 'default', 100,
       CASE WHEN g % 100 < 80 THEN 'SUCCEEDED' WHEN g % 100 < 88 THEN 'FAILED'
            WHEN g % 100 < 95 THEN 'QUEUED' ELSE 'RUNNING' END,
       3, 1.7e9 + (g / 10), 1.7e9 + (g / 10), 1.7e9 + (g / 10) + 5
FROM generate_series(1, {runs}) AS g
"""


def server_ms(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]
              ) -> tuple[float, dict[str, Any]]:
    """Execution time on the server of one run of the statement, and its plan."""
    query = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.replace(":", "%(")
    for name in params:  # :name -> %(name)s
        query = query.replace(f"%({name}", f"%({name})s")
    [[plan]] = conn.execute(query.encode(), params).fetchall()
    return float(plan[0]["Execution Time"]), plan[0]["Plan"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--pages", type=int, default=300)
    parser.add_argument("--keep", action="store_true", help="Keep the database afterwards.")
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    name = f"runlane_bench_listing_{os.getpid()}"
    url = fresh_postgres(BENCH_POSTGRES_URL, name)
    try:
        started = time.perf_counter()
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(POPULATE.format(tenants=TENANTS, runs=args.runs).encode())
            conn.execute(b"VACUUM ANALYZE runs")
        print(f"populated {args.runs:,} runs in {time.perf_counter() - started:.0f} s")
        rng = random.Random(23)
        client: dict[str, list[float]] = {"first": [], "next": []}
        server: dict[str, list[float]] = {"first": [], "next": []}
        plans: dict[str, Any] = {}
        with Runlane(url) as lane, psycopg.connect(libpq(url), autocommit=True) as conn:
            for _ in range(args.pages):
                tenant = f"tenant{rng.randrange(TENANTS)}"
                status = rng.choice(["SUCCEEDED", "QUEUED", "FAILED"])
                cursor = None
                for kind in ("first", "next"):
                    began = time.perf_counter()
                    page = lane.runs_page(tenant=tenant, status=status, limit=50,
                                          cursor=cursor)
                    client[kind].append((time.perf_counter() - began) * 1000.0)
                    params: dict[str, Any] = {"tenant": tenant, "status": status,
                                              "limit": 51}
                    if cursor is not None:
                        created_at, run_id = decode_cursor(cursor, newest_first=True)
                        params |= {"cursor_created_at": created_at, "cursor_run_id": run_id}
                    sql = runs_page_sql(("tenant", "status"), newest_first=True,
                                        cursor=cursor is not None)
                    took, plans[kind] = server_ms(conn, sql, params)
                    server[kind].append(took)
                    cursor = page.next
                    if cursor is None:
                        break
        for kind in ("first", "next"):
            print(f"{kind} page: client p50 {percentile(client[kind], 50):.2f} ms "
                  f"p95 {percentile(client[kind], 95):.2f} ms; server p50 "
                  f"{percentile(server[kind], 50):.3f} ms p95 "
                  f"{percentile(server[kind], 95):.3f} ms ({len(client[kind])} pages)")
            print(json.dumps(plans[kind], indent=1))
    finally:
        if not args.keep:
            drop_postgres(BENCH_POSTGRES_URL, name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
