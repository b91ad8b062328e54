"""What server-side prepared statements are worth, and what PgBouncer costs: submit and
claim of one run at a time (the idle worker's case), with psycopg preparing statements
(``prepare_threshold`` 2, runlane's direct default), with them off (what a
``?pooler=transaction`` URL turns off), and through a PgBouncer in transaction pooling
mode (started here; needs Debian's pgbouncer). Rounds interleave the three modes (A B C,
B C A, ...) on one database, emptied before each cell; one pooled connection each.

    PYTHONPATH=src .venv/bin/python bench/pooler.py [--runs 400] [--rounds 3]

Prints one line per cell and the medians over rounds of each mode's p50 and mean (ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psycopg
from sqlalchemy import event
from sqlalchemy.engine import make_url

from runlane.chaos.pgbouncer import start as start_pgbouncer
from runlane.domain.tasks import parse_task
from runlane.logs import configure_logging
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store

BASE = os.environ.get("RUNLANE_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
DATABASE = "runlane_bench_pooler"
TABLES = ("run_events", "attempts", "runs", "tasks", "lanes", "workers")


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def fresh_database() -> str:
    with psycopg.connect(_libpq(BASE), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    url = make_url(BASE).set(database=DATABASE).render_as_string(hide_password=False)
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


def empty(direct: str) -> None:
    with psycopg.connect(_libpq(direct), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE")


def cell(url: str, *, prepare: bool, runs: int) -> dict[str, list[float]]:
    """Submit ``runs`` runs one by one, then claim them one by one: each call's time."""
    engine = build_engine(url, pool_size=1, bounded=True)
    if not prepare:
        event.listen(engine, "connect",
                     lambda conn, _record: setattr(conn, "prepare_threshold", None))
    store = Store(url, engine=engine)
    store.register_worker("bench", version="bench", queues=["default"])
    repo = "https://git.example.com/acme/app.git"
    specs = [parse_task({"tenant": f"tenant-{i % 8}", "repo": repo, "prompt": f"no-op {i}"})
             for i in range(runs + 20)]
    for spec in specs[:20]:  # warm up: connect, prepare, caches
        store.submit([spec])
    for _ in range(20):
        store.claim("bench")
    times: dict[str, list[float]] = {"submit": [], "claim": []}
    for spec in specs[20:]:
        t = time.perf_counter()
        store.submit([spec])
        times["submit"].append(time.perf_counter() - t)
    for _ in range(runs):
        t = time.perf_counter()
        leases = store.claim("bench")
        times["claim"].append(time.perf_counter() - t)
        assert len(leases) == 1
    store.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    configure_logging("WARNING")
    direct = fresh_database()
    bouncer = start_pgbouncer(direct)
    modes: dict[str, tuple[str, bool]] = {
        "direct, prepared (threshold 2)": (direct, True),
        "direct, not prepared": (direct, False),
        "PgBouncer transaction pooling": (bouncer.url_for(direct), False),
    }
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for round_ in range(args.rounds):
            names = list(modes)
            for name in names[round_ % 3:] + names[:round_ % 3]:  # A B C, B C A, ...
                url, prepare = modes[name]
                empty(direct)
                times = cell(url, prepare=prepare, runs=args.runs)
                for op, values in times.items():
                    p50 = statistics.median(values) * 1000
                    mean = statistics.fmean(values) * 1000
                    results.setdefault((name, op), []).append((p50, mean))
                    print(f"round {round_ + 1} {name:32} {op:6} p50 {p50:.3f} ms "
                          f"mean {mean:.3f} ms", file=sys.stderr)
    finally:
        bouncer.stop()
        with psycopg.connect(_libpq(BASE), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
    print(f"| mode | operation | p50 ms | mean ms |  (medians of {args.rounds} rounds, "
          f"{args.runs} calls each)")
    print("| --- | --- | --- | --- |")
    for (name, op), values in results.items():
        print(f"| {name} | {op} | {statistics.median(v[0] for v in values):.3f} | "
              f"{statistics.median(v[1] for v in values):.3f} |")


if __name__ == "__main__":
    main()

