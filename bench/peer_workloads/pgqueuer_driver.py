"""PgQueuer under the peer workload (run in the peer venv, bench/.venv-peers).

Enqueue: ``Queries.enqueue`` with lists (one statement per batch). Drain: in each
worker process a ``QueueManager`` with a no-op entrypoint, ``run(mode=drain,
batch_size=B)``: it exits once the queue is empty and its jobs are logged.
Latency: a ``QueueManager`` in continuous mode, woken by PgQueuer's own NOTIFY.
``--driver asyncpg`` (default) or ``psycopg`` (async, autocommit).
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from pgqueuer.models import Job
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries

ENTRYPOINT = "noop"


async def connect(dsn: str, driver: str) -> tuple[Queries, Any]:
    if driver == "asyncpg":
        import asyncpg  # type: ignore[import-untyped]

        conn = await asyncpg.connect(dsn)
        return Queries.from_asyncpg_connection(conn), conn
    import psycopg

    aconn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    return Queries.from_psycopg_connection(aconn), aconn


class Counted:
    """Counts the statements a driver sends (each call is one round trip)."""

    def __init__(self, queries: Queries) -> None:
        self.calls = 0
        inner = queries.driver
        fetch, execute = inner.fetch, inner.execute

        async def counted_fetch(query: str, *args: object) -> Any:
            self.calls += 1
            return await fetch(query, *args)

        async def counted_execute(query: str, *args: object) -> Any:
            self.calls += 1
            return await execute(query, *args)

        inner.fetch = counted_fetch  # type: ignore[method-assign]
        inner.execute = counted_execute  # type: ignore[method-assign]


async def drain_async(dsn: str, driver: str, batch: int, gate: common.Gate) -> None:
    queries, conn = await connect(dsn, driver)
    counted = Counted(queries)
    qm = QueueManager(queries)
    done = 0

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        nonlocal done
        done += 1

    gate.wait()
    await qm.run(batch_size=batch, mode=common_mode(), dequeue_timeout=timedelta(seconds=5),
                 log_aggregation_interval=timedelta(0))
    ended = time.monotonic()
    gate.report(done, ended=ended, statements=counted.calls)
    await conn.close()


def common_mode() -> Any:
    from pgqueuer.types import QueueExecutionMode

    return QueueExecutionMode.drain


def drain_worker(dsn: str, driver: str, batch: int, gate: common.Gate) -> None:
    try:
        asyncio.run(drain_async(dsn, driver, batch, gate))
    except BaseException as exc:
        gate.crash(exc)
        raise


async def latency_async(dsn: str, driver: str, ready: Any, stop: Any, results: Any) -> None:
    queries, conn = await connect(dsn, driver)
    qm = QueueManager(queries)

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        common.claimed(results, job.id)

    async def watch() -> None:
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        qm.shutdown.set()

    watcher = asyncio.create_task(watch())
    await qm.run(batch_size=1, dequeue_timeout=timedelta(seconds=1),
                 log_aggregation_interval=timedelta(0))
    await watcher
    common.latency_done(results)
    await conn.close()


def latency_worker(dsn: str, driver: str, ready: Any, stop: Any, results: Any,
                   samples: int) -> None:
    asyncio.run(latency_async(dsn, driver, ready, stop, results))


async def setup_and_enqueue(args: Any) -> dict[str, Any]:
    queries, conn = await connect(args.dsn, args.driver)
    await queries.install()
    none: list[bytes | None] = [None] * 10
    await queries.enqueue([ENTRYPOINT] * 10, none, [0] * 10)  # warm-up
    await queries.clear_queue()
    times = []
    for lo in range(0, args.jobs, args.submit_batch):
        n = min(args.submit_batch, args.jobs - lo)
        payloads: list[bytes | None] = [None] * n
        names, priorities = [ENTRYPOINT] * n, [0] * n
        started = time.perf_counter()
        await queries.enqueue(names, payloads, priorities)
        times.append(time.perf_counter() - started)
    await conn.close()
    total = sum(times)
    return {"jobs": args.jobs, "batch": args.submit_batch, "seconds": total,
            "rate": args.jobs / total, "batch_p50_ms": common.percentile(times, 50) * 1000,
            "batch_p99_ms": common.percentile(times, 99) * 1000}


async def submit_latency(args: Any, probe: common.LatencyProbe) -> None:
    queries, conn = await connect(args.dsn, args.driver)
    for _ in range(args.latency_samples):
        started = time.monotonic()
        (job_id,) = await queries.enqueue(ENTRYPOINT, None)
        probe.mark(job_id, started, time.monotonic())
        await asyncio.sleep(args.latency_interval)
    await conn.close()


def main() -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else "pgqueuer")
    p.add_argument("--driver", choices=("asyncpg", "psycopg"), default="asyncpg")
    args = p.parse_args()
    enqueue = asyncio.run(setup_and_enqueue(args))
    analyzed = common.prepare_statistics(args.dsn, args.stats)
    result = common.drain(drain_worker, (args.dsn, args.driver, args.claim_batch),
                          args.concurrency, common.database_name(args.dsn), args.jobs)
    figures: dict[str, Any] = {
        "system": f"PgQueuer ({args.driver})", "version": version("pgqueuer"),
        "driver": f"{args.driver} {version(args.driver)}", "enqueue": enqueue,
        "drain": result.as_dict(), "analyzed": analyzed,
    }
    if args.latency_samples:
        probe = common.LatencyProbe(latency_worker, (args.dsn, args.driver),
                                    args.latency_samples).start()
        asyncio.run(submit_latency(args, probe))
        figures["latency"] = probe.finish()
    common.emit(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
