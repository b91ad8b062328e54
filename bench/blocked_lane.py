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

With ``--lanes N`` the backlog is spread over N flooding tenants, each in its own
full repository, and the claims are timed for ``--seconds`` of wall time: a blocked
lane sleeps until a release of its repository (none comes here) or the recheck
interval, so this shows what the once-a-second recheck of many blocked lanes costs
(the p99, and claims per second).
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


def measure(url: str, backlog: int, claims: int, lanes: int = 1, seconds: float = 0.0,
            others: int = OTHERS) -> list[float]:
    """Claim latencies (ms, sorted) of limit-1 claims behind ``backlog`` blocked runs in
    ``lanes`` flooding tenants (one full repository each): ``claims`` of them, or as
    many as ``seconds`` of wall time allow. Each claimed run is completed (untimed)
    so its repository frees again."""
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    store = Store(url)
    try:
        store.apply_policy(parse_policy(POLICY), source="bench")
        floods = [spec(f"flood{i % lanes}", f"/srv/git/mono{i % lanes}.git")
                  for i in range(backlog)]
        for lo in range(0, backlog, 1000):
            store.submit(floods[lo:lo + 1000])
        if len(store.claim("holder", limit=lanes, lease_ttl=3600)) != lanes:
            raise SystemExit("not every flooded repository got its running run")
        store.submit([spec(f"t{i % 20}", f"/srv/git/r{i}.git") for i in range(others)])
        timings: list[float] = []
        ends = time.monotonic() + seconds

        def more() -> bool:
            return time.monotonic() < ends if seconds else len(timings) < claims

        while more():
            started = time.perf_counter()
            leases = store.claim("bench", limit=1, lease_ttl=600)
            timings.append((time.perf_counter() - started) * 1000)
            if len(leases) != 1 or leases[0].repo.startswith("/srv/git/mono"):
                raise SystemExit(f"expected one run of another repository, got {leases}")
            store.complete_many(leases)
        if store.audit():
            raise SystemExit(f"audit: {store.audit()}")
        return sorted(timings)
    finally:
        store.close()


def pct(ordered: list[float], q: float) -> float:
    return ordered[int(q * (len(ordered) - 1))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", default="postgresql://postgres@127.0.0.1:5432/test",
                        help="a server and any database on it (default %(default)s)")
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--lanes", type=int, default=0,
                        help="spread the backlog over this many flooding tenants and "
                             "time claims for --seconds (default: one lane, --claims)")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    if args.lanes:
        return many_lanes(args)
    rows = []
    name = "runlane_bench_blocked_lane"
    for backlog in BACKLOGS:
        with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
            admin.execute(f'CREATE DATABASE "{name}"'.encode())
        try:
            timings = measure(with_database(args.postgres_url, name), backlog, args.claims)
            p50, p90 = statistics.median(timings), pct(timings, 0.9)
        finally:
            with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
        rows.append(["postgresql", f"{backlog:,}", f"{p50:.2f}", f"{p90:.2f}"])
        progress(f"postgresql, {backlog:,} blocked: claim p50 {p50:.2f} ms")
        if not args.no_sqlite:
            with tempfile.TemporaryDirectory(prefix="runlane-blocked-") as tmp:
                timings = measure(f"sqlite:///{tmp}/bench.db", backlog, args.claims)
            p50, p90 = statistics.median(timings), pct(timings, 0.9)
            rows.append(["sqlite", f"{backlog:,}", f"{p50:.2f}", f"{p90:.2f}"])
            progress(f"sqlite, {backlog:,} blocked: claim p50 {p50:.2f} ms")
    print(table(["Backend", "Blocked runs ahead", "Claim p50 ms", "Claim p90 ms"], rows,
                "lrrr"))
    return 0


def many_lanes(args: argparse.Namespace) -> int:
    """``--lanes``: the backlog (20 runs a lane) over many blocked lanes, claims timed
    for ``--seconds``, on each backend."""
    backlog, others = 20 * args.lanes, 20_000
    rows = []
    name = "runlane_bench_blocked_lanes"
    backends = ["postgresql"] + ([] if args.no_sqlite else ["sqlite"])
    for backend in backends:
        if backend == "postgresql":
            with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
                admin.execute(f'CREATE DATABASE "{name}"'.encode())
            try:
                timings = measure(with_database(args.postgres_url, name), backlog, 0,
                                  args.lanes, args.seconds, others)
            finally:
                with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())
        else:
            with tempfile.TemporaryDirectory(prefix="runlane-blocked-") as tmp:
                timings = measure(f"sqlite:///{tmp}/bench.db", backlog, 0, args.lanes,
                                  args.seconds, others)
        rate = len(timings) / args.seconds
        rows.append([backend, f"{args.lanes:,}", f"{len(timings):,}", f"{rate:,.0f}",
                     f"{statistics.median(timings):.2f}", f"{pct(timings, 0.9):.2f}",
                     f"{pct(timings, 0.99):.2f}", f"{timings[-1]:.1f}"])
        progress(f"{backend}, {args.lanes:,} blocked lanes: {rate:,.0f} claims/s, "
                 f"p50 {statistics.median(timings):.2f} ms, p99 {pct(timings, 0.99):.2f} ms")
    print(table(["Backend", "Blocked lanes", "Claims", "Claims/s", "p50 ms", "p90 ms",
                 "p99 ms", "max ms"], rows, "lrrrrrrr"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
