"""After a policy change: the claims of a backlog admitted under the older version,
the scheduler pass that admits it again, and the claims after it.

The one-statement claim (``CLAIM_ONE_TRIP_PG``) takes only runs admitted under the
policy version in force; after a change, the queued backlog falls back to the
transaction until the scheduler's pass (``SchedulingMixin._admit_queued_backlog``)
has admitted it again. On ``bench/scheduler.py``'s population (1,000 tenants, 10,000
repositories, limits on), this applies a second version that decides every run alike,
then times: claims of 10 before the pass, the pass itself (runs per second, and how
many of its row updates were HOT), a VACUUM ANALYZE of runs (autovacuum's work after
the pass's updates), and claims of 10 after it.

    .venv/bin/python bench/policy_backlog.py                   # 100,000 queued runs
    .venv/bin/python bench/policy_backlog.py --runs 1000000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from claim_forms import CountingStore
from lifecycle import BENCH_POSTGRES_URL, libpq, percentile, progress, table, with_database
from runlane.domain.policy import policy_from_document
from runlane.logs import configure_logging
from runlane.store.records import Lease
from scheduler import (
    FULL_REPOS,
    FULL_TENANTS,
    GPU,
    IN_FLIGHT,
    QUEUE,
    QUICK,
    WORKER,
    policy,
    populate,
)

# Matches no repository of the population: version 2 decides every run as version 1.
UNUSED_RULE = {"when": {"repo": "legacy/*"}, "action": "deny"}


def claims(store: CountingStore, n: int, limit: int, held: list[Lease]) -> dict[str, Any]:
    """``n`` timed claims of ``limit`` runs; leases beyond IN_FLIGHT completed untimed."""
    store.ends = Counter()
    seconds = []
    for _ in range(n):
        started = time.perf_counter()
        held.extend(store.claim(WORKER, QUEUE, limit=limit, lease_ttl=600.0,
                                capabilities=GPU))
        seconds.append(time.perf_counter() - started)
        if len(held) > IN_FLIGHT:
            store.complete_many(held[:-IN_FLIGHT])
            del held[:-IN_FLIGHT]
    return {"p50": percentile(seconds, 50), "p90": percentile(seconds, 90),
            "ends": dict(store.ends)}


def run_updates(url: str) -> tuple[int, int]:
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        row = conn.execute("SELECT pg_stat_get_tuples_updated(oid), "
                           "pg_stat_get_tuples_hot_updated(oid) FROM pg_class "
                           "WHERE relname = 'runs'").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", default=BENCH_POSTGRES_URL)
    parser.add_argument("--runs", type=int, default=100_000, help="queued runs")
    parser.add_argument("--claims", type=int, default=300, help="timed claims per phase")
    parser.add_argument("--limit", type=int, default=10, help="runs per claim")
    args = parser.parse_args(argv)
    if args.runs < 10_000 or args.claims < 10 or args.limit < 1:
        parser.error("--runs at least 10,000, --claims at least 10, --limit at least 1")
    configure_logging("WARNING")
    shape = replace(QUICK, runs=args.runs)
    database = f"runlane_bench_backlog_{os.getpid()}"
    with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"'.encode())
    url = with_database(args.postgres_url, database)
    try:
        progress(f"populating {args.runs:,} queued runs")
        populate(url, shape)
        store = CountingStore(url)
        held: list[Lease] = []
        claims(store, 30, args.limit, held)  # warm: connections, plans, the policy read
        changed = {**policy(shape), "rules": [UNUSED_RULE]}
        version = store.apply_policy(policy_from_document(changed),
                                     source="bench/policy_backlog.py").version
        progress(f"policy v{version} applied; claims before the pass")
        before = claims(store, args.claims, args.limit, held)
        updates0 = run_updates(url)
        started = time.perf_counter()
        counts = store.schedule_pass(queued_under_older=True)
        pass_seconds = time.perf_counter() - started
        updates1 = run_updates(url)
        # What autovacuum does within a minute of the pass's updates (this bench's
        # server may run without it): the dead versions the pass left are cleaned.
        started = time.perf_counter()
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE runs")
        vacuum_seconds = time.perf_counter() - started
        # A pass with nothing left to admit again (a scheduler's first pass does one):
        # the cost of reading the queue.
        started = time.perf_counter()
        again = store.schedule_pass(queued_under_older=True)["queued_readmitted"]
        scan_seconds = time.perf_counter() - started
        progress(f"pass: {counts} in {pass_seconds:.1f} s; claims after it")
        store.ends = Counter()
        claims(store, 30, args.limit, held)  # the skip after fallbacks runs out
        after = claims(store, args.claims, args.limit, held)
        problems = store.audit()
        store.close()
    finally:
        with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
    updated = updates1[0] - updates0[0]
    hot = updates1[1] - updates0[1]
    print(f"\n{args.runs:,} queued runs (bench/scheduler.py's population, limits on); "
          f"claims of {args.limit}, {args.claims} timed per phase\n")
    print(table(["Phase", "Claim p50 ms", "Claim p90 ms", "Claims ended"], [
        [name, f"{phase['p50'] * 1e3:.2f}", f"{phase['p90'] * 1e3:.2f}",
         ", ".join(f"{k} {v}" for k, v in sorted(phase["ends"].items()))]
        for name, phase in (("before the pass", before), ("after the pass", after))],
        align="lrrl"))
    print(f"\nThe pass: {counts['queued_readmitted']:,} runs admitted again in "
          f"{pass_seconds:.1f} s ({counts['queued_readmitted'] / pass_seconds:,.0f} runs/s); "
          f"{updated:,} run updates, {hot:,} of them HOT ({hot / max(updated, 1):.0%}; "
          f"statistics counters, flushed lazily: approximate); "
          f"then VACUUM ANALYZE runs, {vacuum_seconds:.1f} s. A pass with nothing left "
          f"to admit again ({again} admitted): {scan_seconds:.1f} s.")
    # The population holds its full scopes' slots without attempts (bench/scheduler.py):
    # the audit reports each of those counters, and nothing else should be reported.
    checks = Counter(p.check for p in problems)
    print(f"Audit: {len(problems)} problems "
          f"({', '.join(f'{k} {v}' for k, v in sorted(checks.items())) or 'none'}); "
          f"the population's deliberately full scopes are {FULL_TENANTS + FULL_REPOS}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
