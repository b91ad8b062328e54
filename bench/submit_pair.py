"""Batch submit only: runlane Store.submit against PgQueuer's Queries.enqueue, each on
a fresh database, rounds interleaved (runlane, pgqueuer, runlane, ...), same workload as
bench/peers.py (20,000 jobs, batches of 1,000, 8 tenants, no idempotency key).

    PYTHONPATH=src .venv/bin/python bench/submit_pair.py --rounds 5 [--peers-python P]

Prints per round the rates, the CPU per batch of the client process and of its
PostgreSQL backend (/proc; the server must run on this machine), and the ratio
runlane / PgQueuer of that round, then medians. ``--runlane-src T`` adds another tree.
Modes --one runlane|pgqueuer --dsn D run one side (the orchestrator spawns them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    """User + system CPU seconds of one PostgreSQL backend (same machine)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK
BASE = os.environ.get("RUNLANE_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def run_runlane(dsn: str, jobs: int, batch: int, profile: str | None) -> dict:
    from sqlalchemy import text

    from runlane.domain.tasks import parse_task
    from runlane.logs import configure_logging
    from runlane.store.engine import build_engine
    from runlane.store.migrate import upgrade
    from runlane.store.store import Store
    configure_logging("WARNING")
    engine = build_engine(dsn)
    upgrade(engine)
    engine.dispose()
    store = Store(dsn)
    REPO = "https://git.example.com/acme/app.git"
    def mk(n: int, tag: str) -> list:
        return [parse_task({"tenant": f"tenant-{i % 8}", "repo": REPO,
                            "prompt": f"no-op {tag}"}) for i in range(n)]
    store.submit(mk(10, "warm-up"))
    with store.engine.begin() as conn:
        for table in ("run_events", "runs", "tasks", "lanes"):
            conn.execute(text(f"DELETE FROM {table}"))
    todo = mk(jobs, "drain")
    with store.engine.connect() as conn:  # the pooled session every submit below uses
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
    server0 = backend_cpu(pid)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
    times = []
    cpu0 = time.process_time()
    for lo in range(0, jobs, batch):
        t = time.perf_counter()
        if prof:
            prof.enable()
        store.submit(todo[lo:lo + batch])
        if prof:
            prof.disable()
        times.append(time.perf_counter() - t)
    cpu = time.process_time() - cpu0
    server = backend_cpu(pid) - server0
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar() == pid
    if prof:
        prof.dump_stats(profile)
    with store.engine.connect() as conn:
        counts = {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar()
                  for t in ("tasks", "runs", "run_events")}
    store.close()
    return {"rate": jobs / sum(times), "p50_ms": statistics.median(times) * 1000,
            "client_cpu_ms_per_batch": cpu * 1000 / len(times),
            "server_cpu_ms_per_batch": server * 1000 / len(times), "counts": counts}


def run_pgqueuer(dsn: str, jobs: int, batch: int) -> dict:
    import asyncio

    import asyncpg
    from pgqueuer.queries import Queries

    async def go() -> dict:
        conn = await asyncpg.connect(dsn)
        q = Queries.from_asyncpg_connection(conn)
        await q.install()
        await q.enqueue(["noop"] * 10, [None] * 10, [0] * 10)
        await q.clear_queue()
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        server0 = backend_cpu(pid)
        times = []
        cpu0 = time.process_time()
        for lo in range(0, jobs, batch):
            n = min(batch, jobs - lo)
            t = time.perf_counter()
            await q.enqueue(["noop"] * n, [None] * n, [0] * n)
            times.append(time.perf_counter() - t)
        cpu = time.process_time() - cpu0
        server = backend_cpu(pid) - server0
        await conn.close()
        return {"rate": jobs / sum(times), "p50_ms": statistics.median(times) * 1000,
                "client_cpu_ms_per_batch": cpu * 1000 / len(times),
                "server_cpu_ms_per_batch": server * 1000 / len(times)}
    return asyncio.run(go())


def admin(sql: str) -> None:
    subprocess.run(["psql", BASE, "-qAtc", sql], check=True, stdout=subprocess.DEVNULL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--one")
    p.add_argument("--dsn")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=1_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile")
    p.add_argument("--peers-python", default=str(HERE / ".venv-peers/bin/python"))
    p.add_argument("--runlane-src", action="append", default=[],
                   help="extra runlane trees (PYTHONPATH) to measure, labelled by path")
    a = p.parse_args()
    if a.one == "runlane":
        print(json.dumps(run_runlane(a.dsn, a.jobs, a.batch, a.profile)))
        return 0
    if a.one == "pgqueuer":
        print(json.dumps(run_pgqueuer(a.dsn, a.jobs, a.batch)))
        return 0
    trees = [os.environ.get("PYTHONPATH", ""), *a.runlane_src]
    rows: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(a.rounds):
        results = {}
        for label, cmd_py, env_path, mode in (
                [(f"runlane[{t}]", sys.executable, t, "runlane") for t in trees]
                + [("pgqueuer", a.peers_python, "", "pgqueuer")]):
            db = f"bench_submit_{os.getpid()}_{r}_{len(results)}"
            admin(f"DROP DATABASE IF EXISTS {db}")
            admin(f"CREATE DATABASE {db}")
            dsn = BASE.rsplit("/", 1)[0] + "/" + db
            env = dict(os.environ, PYTHONPATH=env_path)
            out = subprocess.run([cmd_py, __file__, "--one", mode, "--dsn", dsn,
                                  "--jobs", str(a.jobs), "--batch", str(a.batch)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            admin(f"DROP DATABASE {db}")
            res = json.loads(out.strip().splitlines()[-1])
            results[label] = res
            rows.setdefault(label, []).append(res["rate"])
        pg = results["pgqueuer"]["rate"]
        line = [f"round {r}:"]
        for label, res in results.items():
            ratio = res["rate"] / pg
            if label != "pgqueuer":
                ratios.setdefault(label, []).append(ratio)
            line.append(f"{label} {res['rate']:,.0f}/s p50 {res['p50_ms']:.1f} ms "
                        f"CPU/batch client {res['client_cpu_ms_per_batch']:.1f} + server "
                        f"{res['server_cpu_ms_per_batch']:.1f} ms ({ratio:.2f}x)")
        print("  ".join(line), flush=True)
    for label, vals in rows.items():
        extra = f" ratio median {statistics.median(ratios[label]):.2f}x " \
                f"(by round {' / '.join(f'{x:.2f}' for x in ratios[label])})" \
            if label in ratios else ""
        print(f"{label}: median {statistics.median(vals):,.0f}/s{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
