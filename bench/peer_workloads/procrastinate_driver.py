"""Procrastinate under the peer workload (run in the peer venv, bench/.venv-peers).

Enqueue: ``Task.batch_defer_async`` (one call per batch). Drain: in each worker process
``App.run_worker_async(wait=False, concurrency=B)``: it fetches one job per call
(Procrastinate has no batch fetch) with up to B jobs in flight, and returns once the
queue is empty. Jobs are kept (``delete_jobs="never"``, the default), as runlane
keeps its runs. Latency: a waiting worker with ``listen_notify=True``.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import procrastinate


def make_app(dsn: str, on_job: Any = None) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop", pass_context=True)
    async def noop(context: procrastinate.JobContext) -> None:
        if on_job is not None:
            on_job(context.job.id)

    return app


async def drain_async(dsn: str, concurrency: int, gate: common.Gate) -> None:
    done = 0

    def count(_job_id: int) -> None:
        nonlocal done
        done += 1

    app = make_app(dsn, count)
    async with app.open_async():
        await app.check_connection_async()
        gate.wait()
        await app.run_worker_async(queues=["default"], concurrency=concurrency, wait=False,
                                   install_signal_handlers=False, listen_notify=False)
        gate.report(done, ended=time.monotonic())


def drain_worker(dsn: str, concurrency: int, gate: common.Gate) -> None:
    try:
        asyncio.run(drain_async(dsn, concurrency, gate))
    except BaseException as exc:
        gate.crash(exc)
        raise


async def latency_async(dsn: str, ready: Any, stop: Any, results: Any) -> None:
    app = make_app(dsn, lambda job_id: common.claimed(results, job_id))
    async with app.open_async():
        worker = asyncio.create_task(app.run_worker_async(
            queues=["default"], concurrency=1, wait=True, install_signal_handlers=False,
            listen_notify=True, fetch_job_polling_interval=1.0))
        await asyncio.sleep(0.5)  # its LISTEN
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await worker
    common.latency_done(results)


def latency_worker(dsn: str, ready: Any, stop: Any, results: Any, samples: int) -> None:
    asyncio.run(latency_async(dsn, ready, stop, results))


async def setup_and_enqueue(args: Any) -> dict[str, Any]:
    app = make_app(args.dsn)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        noop = app.tasks["noop"]
        await noop.batch_defer_async(*({} for _ in range(10)))  # warm-up
        await app.connector.execute_query_async("DELETE FROM procrastinate_jobs")
        times = []
        for lo in range(0, args.jobs, args.submit_batch):
            n = min(args.submit_batch, args.jobs - lo)
            kwargs: list[dict[str, Any]] = [{} for _ in range(n)]
            started = time.perf_counter()
            await noop.batch_defer_async(*kwargs)
            times.append(time.perf_counter() - started)
    total = sum(times)
    return {"jobs": args.jobs, "batch": args.submit_batch, "seconds": total,
            "rate": args.jobs / total, "batch_p50_ms": common.percentile(times, 50) * 1000,
            "batch_p99_ms": common.percentile(times, 99) * 1000}


async def submit_latency(args: Any, probe: common.LatencyProbe) -> None:
    app = make_app(args.dsn)
    async with app.open_async():
        noop = app.tasks["noop"]
        for _ in range(args.latency_samples):
            started = time.monotonic()
            job_id = await noop.defer_async()
            probe.mark(job_id, started, time.monotonic())
            await asyncio.sleep(args.latency_interval)


def main() -> int:
    p = common.parser(__doc__.splitlines()[0] if __doc__ else "procrastinate")
    p.add_argument("--worker-concurrency", type=int,
                   help="jobs in flight per worker process (default: the claim batch)")
    args = p.parse_args()
    in_flight = args.worker_concurrency or args.claim_batch
    enqueue = asyncio.run(setup_and_enqueue(args))
    analyzed = common.prepare_statistics(args.dsn, args.stats)
    result = common.drain(drain_worker, (args.dsn, in_flight), args.concurrency,
                          common.database_name(args.dsn), args.jobs)
    figures: dict[str, Any] = {
        "system": "Procrastinate", "version": version("procrastinate"),
        "driver": f"psycopg {version('psycopg')}", "enqueue": enqueue,
        "drain": result.as_dict(), "analyzed": analyzed, "in_flight": in_flight,
    }
    if args.latency_samples:
        probe = common.LatencyProbe(latency_worker, (args.dsn,), args.latency_samples).start()
        asyncio.run(submit_latency(args, probe))
        figures["latency"] = probe.finish()
    common.emit(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
