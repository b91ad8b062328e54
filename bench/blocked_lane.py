"""Claim latency behind a lane whose runs are all blocked by a full repository (issue 4).

A tenant floods one repository (``per_repository_max_active = 1``) with B runs; one of
them runs, so every other run of that lane is blocked. Other tenants' runs (600, in
their own repositories) stay claimable. The blocked lane never gets a turn, so its
stride pass never moves and it stays first in the fair order: every claim walks it
before it reaches a runnable lane. The walk filters runs by their repository's scope,
a column of the run row, so it reads the whole blocked backlog each time. This bench
shows that cost as claim latency against B.

    .venv/bin/python bench/blocked_lane.py            # PostgreSQL and SQLite
    .venv/bin/python bench/blocked_lane.py --postgres-url postgresql://...  --no-sqlite
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import libpq, progress, table, with_database
from runlane.domain.policy import parse_policy
from runlane.domain.tasks import TaskSpec, parse_task
from runlane.logs import configure_logging
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store

BACKLOGS = (100, 5_000, 20_000)
OTHERS = 600  # runnable runs of 20 other tenants, one repository each
POLICY = "[concurrency]\nper_repository_max_active = 1\n"


def spec(tenant: str, repo: str) -> TaskSpec:
    return parse_task({"tenant": tenant, "repo": repo, "prompt": "no-op"})


def measure(url: str, backlog: int, claims: int) -> tuple[float, float]:
    """Claim p50 and p90 (ms) of ``claims`` limit-1 claims behind ``backlog`` blocked runs;
    each claimed run is completed (untimed) so its repository frees again."""
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store(url)
    try:
        store.apply_policy(parse_policy(POLICY), source="bench")
        for lo in range(0, backlog, 1000):
            store.submit([spec("flood", "/srv/git/mono.git")
                          for _ in range(min(1000, backlog - lo))])
        if len(store.claim("holder", limit=1, lease_ttl=3600)) != 1:
            raise SystemExit("the flood's first run was not claimed")
        store.submit([spec(f"t{i % 20}", f"/srv/git/r{i}.git") for i in range(OTHERS)])
        seconds = []
        for _ in range(claims):
            started = time.perf_counter()
            leases = store.claim("bench", limit=1, lease_ttl=600)
            seconds.append(time.perf_counter() - started)
            if len(leases) != 1 or leases[0].repo == "/srv/git/mono.git":
                raise SystemExit(f"expected one run of another repository, got {leases}")
            store.complete_many(leases)
        ordered = sorted(seconds)
        return (statistics.median(ordered) * 1000,
                ordered[int(0.9 * (len(ordered) - 1))] * 1000)
    finally:
        store.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", default="postgresql://postgres@127.0.0.1:5432/test",
                        help="a server and any database on it (default %(default)s)")
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument("--claims", type=int, default=300)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    rows = []
    name = "runlane_bench_blocked_lane"
    for backlog in BACKLOGS:
        with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
            admin.execute(f'CREATE DATABASE "{name}"'.encode())
        try:
            p50, p90 = measure(with_database(args.postgres_url, name), backlog, args.claims)
        finally:
            with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
        rows.append(["postgresql", f"{backlog:,}", f"{p50:.2f}", f"{p90:.2f}"])
        progress(f"postgresql, {backlog:,} blocked: claim p50 {p50:.2f} ms")
        if not args.no_sqlite:
            with tempfile.TemporaryDirectory(prefix="runlane-blocked-") as tmp:
                p50, p90 = measure(f"sqlite:///{tmp}/bench.db", backlog, args.claims)
            rows.append(["sqlite", f"{backlog:,}", f"{p50:.2f}", f"{p90:.2f}"])
            progress(f"sqlite, {backlog:,} blocked: claim p50 {p50:.2f} ms")
    print(table(["Backend", "Blocked runs ahead", "Claim p50 ms", "Claim p90 ms"], rows,
                "lrrr"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
