"""Retention at scale (PostgreSQL): runlane's retention pass prunes 1,000,000 finished
runs while a claimer claims and completes queued runs beside it.

One database (``runlane_bench_retention_<pid>``, dropped at the end), filled as
``bench/sizes.py`` fills it: the real ``Store`` writes a finished and a queued run,
and set-based inserts copy them ``--runs`` times each (1,000 tenants, 10,000
repositories; the finished runs ended 40 days ago), then ``VACUUM ANALYZE``.

Then a claimer process (its own ``Store``) claims one run and completes it, over and
over, timing each claim: ``--baseline`` seconds alone, then while the retention
service's pass (``Pruner.run_once`` with its defaults: ``RETENTION_DAYS`` 30, batches
of 500, 0.05 s between batches) deletes the finished runs with their attempts, events
and tasks. Reported: the pass's time and rate, its batches' times, and the claims'
latency alone and beside the pass (a lock the pass held that a claim waited for shows
there as a slow claim).

::

    .venv/bin/python bench/retention.py --write docs/benchmarks.md
    .venv/bin/python bench/retention.py --runs 50000 --baseline 3      # a smoke run
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import (
    BENCH_POSTGRES_URL,
    cpu_model,
    display_command,
    drop_postgres,
    fresh_postgres,
    libpq,
    load_average,
    memory_total,
    merge_section,
    percentile,
    postgres_facts,
    progress,
    runlane_source,
    table,
)
from runlane.logs import configure_logging
from runlane.services.retention import Pruner, RetentionConfig
from runlane.store.store import Store
from sizes import make_templates, populate

START, END = "<!-- retention:start -->", "<!-- retention:end -->"
TITLE = "Retention of 1,000,000 finished runs beside a claimer: `bench/retention.py`"


def claimer(url: str, ready: Any, stop: Any, results: Any) -> None:
    """Claim one run and complete it until told to stop; (wall time, claim seconds)."""
    configure_logging(level="warning", json=False)
    store = Store(url)
    samples: list[tuple[float, float]] = []
    try:
        for lease in store.claim("bench-claimer/1/w", limit=1, lease_ttl=600.0):  # warm
            store.complete(lease)
        with store.engine.connect() as conn:  # the pool's one connection: its session
            results.put(int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one()))
        ready.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            leases = store.claim("bench-claimer/1/w", limit=1, lease_ttl=600.0)
            samples.append((time.time(), time.perf_counter() - t0))
            for lease in leases:
                store.complete(lease)
    finally:
        store.close()
        results.put(samples)


@dataclass
class Outcome:
    runs: int
    fill_seconds: float
    pruned: dict[str, int]
    prune_seconds: float
    batches: list[float]
    alone: list[float]
    beside: list[float]
    waits: dict[str, int]  # the claimer's wait events sampled beside the pass


class WaitSampler:
    """What the claimer's session waits on, sampled every 20 ms from pg_stat_activity
    while the pass runs: a lock the pass holds and a claim needs shows as ``Lock``."""

    def __init__(self, admin_url: str, database: str, pid: int) -> None:
        self.admin_url, self.database, self.pid = admin_url, database, pid
        self.counts: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(libpq(self.admin_url), autocommit=True) as conn:
            while not self.done.is_set():
                for kind, name in conn.execute(
                        "SELECT wait_event_type, wait_event FROM pg_stat_activity "
                        "WHERE datname = %s AND state = 'active' AND pid = %s",
                        (self.database, self.pid)):
                    key = f"{kind}:{name}" if kind else "running"
                    self.counts[key] = self.counts.get(key, 0) + 1
                time.sleep(0.02)

    def __enter__(self) -> WaitSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def measure(admin_url: str, runs: int, baseline: float) -> Outcome:
    database = f"runlane_bench_retention_{os.getpid()}"
    url = fresh_postgres(admin_url, database)
    try:
        started = time.monotonic()
        populate(url, make_templates(url), runs)
        fill_seconds = time.monotonic() - started
        ctx = mp.get_context("spawn")
        ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
        proc = ctx.Process(target=claimer, args=(url, ready, stop, results))
        proc.start()
        if not ready.wait(60):
            raise SystemExit("the claimer did not start")
        claimer_pid = results.get(timeout=10)
        progress(f"claimer alone for {baseline:g}s")
        time.sleep(baseline)
        store = Store(url)
        pruner = Pruner(store, RetentionConfig())
        batches: list[float] = []
        batch = pruner.prune_batch

        def timed_batch(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return batch(*args, **kwargs)
            finally:
                batches.append(time.perf_counter() - t0)

        pruner.prune_batch = timed_batch  # type: ignore[method-assign]
        progress("retention pass")
        pass_started_wall = time.time()
        t0 = time.perf_counter()
        with WaitSampler(admin_url, database, claimer_pid) as sampler:
            counts = pruner.run_once()
        prune_seconds = time.perf_counter() - t0
        pass_ended_wall = time.time()
        store.close()
        stop.set()
        samples = results.get(timeout=60)
        proc.join(30)
        progress(f"pruned {counts['runs_pruned']:,} runs in {prune_seconds:.1f}s")
        alone = [s for at, s in samples if at < pass_started_wall]
        beside = [s for at, s in samples if pass_started_wall <= at <= pass_ended_wall]
        return Outcome(runs, fill_seconds, counts, prune_seconds, batches, alone, beside,
                       sampler.counts)
    finally:
        drop_postgres(admin_url, database)


def render(o: Outcome, argv: Sequence[str], admin_url: str) -> str:
    facts = postgres_facts(admin_url)

    def ms(v: float) -> str:
        return f"{1e3 * v:.1f} ms"

    def claims(label: str, values: list[float]) -> list[str]:
        return [label, f"{len(values):,}", ms(percentile(values, 50)),
                ms(percentile(values, 99)), ms(max(values)),
                f"{sum(v > 0.1 for v in values)}"]

    p = o.pruned
    lines = [
        START,
        f"## {TITLE}",
        "",
        f"The retention service's pass (`Pruner.run_once`, its defaults: batches of 500, "
        f"0.05 s apart) over {o.runs:,} finished runs (ended 40 days ago, kept 30) beside "
        f"{o.runs:,} queued runs that a claimer process claims and completes one at a time "
        f"(filled in {o.fill_seconds:.0f} s).",
        "",
        table(["pass", "runs", "tasks", "attempts", "events", "batches", "time", "runs/s",
               "batch p50 / p99 / max"],
              [[ "retention", f"{p['runs_pruned']:,}", f"{p['tasks_pruned']:,}",
                 f"{p['attempts_pruned']:,}", f"{p['run_events_pruned']:,}",
                 f"{p['prune_batches']:,}", f"{o.prune_seconds:.1f} s",
                 f"{p['runs_pruned'] / o.prune_seconds:,.0f}",
                 f"{ms(percentile(o.batches, 50))} / {ms(percentile(o.batches, 99))} / "
                 f"{ms(max(o.batches))}"]], align="lrrrrrrrr"),
        "",
        table(["claims", "count", "p50", "p99", "max", "over 100 ms"],
              [claims("alone", o.alone), claims("beside the pass", o.beside)],
              align="lrrrrr"),
        "",
        f"Claim p99 beside the pass: {percentile(o.beside, 99) / percentile(o.alone, 99):.2f}x "
        f"alone; max {max(o.beside) / max(o.alone):.2f}x. What the claimer's session "
        f"waited on, sampled every 20 ms during the pass ({sum(o.waits.values()):,} samples "
        "while it was in a statement; `Lock` would be a lock the pass held): "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(o.waits.items(), key=lambda kv: -kv[1]))
        + ".",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, {memory_total()}, "
        f"{platform.system()} {platform.release()}; load {load_average()}. PostgreSQL "
        f"{facts['server_version']} (shared_buffers {facts['shared_buffers']}, "
        f"synchronous_commit {facts['synchronous_commit']}). runlane: {runlane_source()}. "
        f"Measured {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        "```sh",
        display_command(argv),
        "```",
        END,
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000,
                        help="finished runs to prune (as many queued beside them)")
    parser.add_argument("--baseline", type=float, default=15.0,
                        help="seconds the claimer runs alone first")
    parser.add_argument("--database-url", default=BENCH_POSTGRES_URL)
    parser.add_argument("--write", type=Path, help="merge the section into this file")
    args = parser.parse_args(argv)
    if args.runs < 1000:
        parser.error("--runs: at least 1000")
    configure_logging(level="warning", json=False)
    outcome = measure(args.database_url, args.runs, args.baseline)
    section = render(outcome, sys.argv if argv is None else ["bench/retention.py", *argv],
                     args.database_url)
    print(section)
    if args.write:
        merge_section(args.write, section, START, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
