"""PostgreSQL's two claim forms side by side: one statement against a transaction.

A claim is first tried as one autocommit statement (``CLAIM_ONE_TRIP_PG``), and runs
as a transaction of two statements (``PICK_AND_WALK_PG``, ``CLAIM_WRITE_PG``) between
BEGIN and COMMIT when it cannot (see ``SchedulingMixin._claim_in_one_trip``). This
bench drains the same queue both ways in one process, ``claim(limit=B)`` then
``complete_many``, on a fresh database per round, the forms alternating (A B, B A,
...), and reports per run: the PostgreSQL backends' CPU (read from /proc, so the
server must run on this machine), this process's CPU and the runs drained per
second; and how many claims each form ended as.

    .venv/bin/python bench/claim_forms.py                 # 6,000 runs, 8 tenants, B 10
    .venv/bin/python bench/claim_forms.py --runs 20000 --limit 1 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import BENCH_POSTGRES_URL, libpq, progress, table, with_database
from runlane.domain.policy import parse_policy
from runlane.domain.tasks import parse_task
from runlane.logs import configure_logging
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store

FORMS = ("one statement", "transaction")
POLICY = "[concurrency]\nglobal_max_active = 100000\nper_tenant_max_active = 1000\n"


def backend_cpu_seconds(url: str, database: str) -> float:
    """User + system CPU of every backend connected to ``database`` (but this probe's)."""
    with psycopg.connect(libpq(url), autocommit=True) as probe:
        pids = [r[0] for r in probe.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,))]
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class CountingStore(Store):
    """A store that counts how its claims ended: in one statement, or as a transaction
    (the one-statement form wrote nothing, or was not tried)."""

    forced_transaction = False
    ends: Counter[str]

    def _claim_in_one_trip(self, *args: Any, **kwargs: Any) -> list[Any] | None:
        if self.forced_transaction:
            return None
        rows = super()._claim_in_one_trip(*args, **kwargs)
        self.ends["one statement" if rows else "empty" if rows == [] else "fell back"] += 1
        return rows


def drain(url: str, database: str, form: str, runs: int, tenants: int, limit: int,
          limits: bool) -> dict[str, Any]:
    """Submit ``runs`` runs over ``tenants`` tenants, then claim and complete them all
    (``limits``: under POLICY's concurrency limits, so every run takes and gives back
    slots)."""

    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    store = CountingStore(url)
    store.ends = Counter()
    store.forced_transaction = form == "transaction"
    if limits:
        store.apply_policy(parse_policy(POLICY), source="bench/claim_forms.py")
    for start in range(0, runs, 1000):
        store.submit([parse_task({"tenant": f"t{i % tenants}", "repo": f"/srv/r{i % 50}",
                                  "prompt": "no-op"})
                      for i in range(start, min(runs, start + 1000))])
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        conn.execute("ANALYZE")  # what autovacuum does within a minute of a bulk submit
    store.complete_many(store.claim("w", limit=limit))  # connect, read the policy
    drained, server0 = 0, backend_cpu_seconds(url, database)
    client0, wall0 = time.process_time(), time.perf_counter()
    while leases := store.claim("w", limit=limit):
        store.complete_many(leases)
        drained += len(leases)
    wall = time.perf_counter() - wall0
    client = time.process_time() - client0
    server = backend_cpu_seconds(url, database) - server0
    problems = store.audit()
    store.close()
    return {"form": form, "runs": drained, "server_ms": server / drained * 1e3,
            "client_ms": client / drained * 1e3, "per_s": drained / wall,
            "ends": dict(store.ends), "audit": len(problems)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", default=BENCH_POSTGRES_URL)
    parser.add_argument("--runs", type=int, default=6_000)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--limit", type=int, default=10, help="claim batch B")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each form once")
    parser.add_argument("--limits", action="store_true",
                        help="apply concurrency limits (global, per tenant): every run "
                             "takes its slots and gives them back")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tenants < 1 or args.limit < 1 or args.rounds < 1:
        parser.error("--runs, --tenants, --limit and --rounds must be at least 1")
    configure_logging("WARNING")
    results: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        order = FORMS if round_no % 2 == 0 else tuple(reversed(FORMS))
        for form in order:
            database = f"runlane_bench_forms_{os.getpid()}"
            with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
                admin.execute(f'CREATE DATABASE "{database}"'.encode())
            try:
                result = drain(with_database(args.postgres_url, database), database, form,
                               args.runs, args.tenants, args.limit, args.limits)
            finally:
                with psycopg.connect(libpq(args.postgres_url), autocommit=True) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'.encode())
            results.append(result)
            progress(f"round {round_no + 1} {form}: {result['per_s']:,.0f} runs/s, server "
                     f"{result['server_ms']:.3f} + client {result['client_ms']:.3f} ms/run")
    rows = []
    for form in FORMS:
        mine = [r for r in results if r["form"] == form]
        ends: Counter[str] = Counter()
        for r in mine:
            ends.update(r["ends"])
        rows.append([
            form, f"{statistics.median(r['per_s'] for r in mine):,.0f}",
            " / ".join(f"{r['per_s']:,.0f}" for r in mine),
            f"{statistics.median(r['server_ms'] for r in mine):.3f}",
            f"{statistics.median(r['client_ms'] for r in mine):.3f}",
            ", ".join(f"{k} {v:,}" for k, v in sorted(ends.items())) or "-",
            str(sum(r["audit"] for r in mine))])
    policy = "concurrency limits: " + POLICY.replace("\n", " ").strip() if args.limits \
        else "no policy"
    print(f"\n{args.runs:,} runs over {args.tenants} tenants, claim(limit={args.limit}) + "
          f"complete_many, {args.rounds} rounds (medians), {policy}\n")
    print(table(["Claim form", "Runs/s", "Runs/s by round", "Server CPU ms/run",
                 "Client CPU ms/run", "One-statement claims ended", "Audit problems"],
                rows, align="lrrrrll"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
