"""Plumbing shared by the peer drivers (standard library only: both venvs import it).

A driver measures one system in three phases and prints one JSON line:

1. enqueue: N no-op jobs in batches, one process, timed per batch;
2. drain: C worker processes released together by a barrier, each claiming up to B
   jobs at a time and completing them, until its claim finds nothing;
3. latency: one idle worker woken by LISTEN/NOTIFY (or polling), and jobs submitted
   one at a time at a slow pace; submit call -> job in the worker's hands.

Clocks: ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process of the
machine), so times taken in different processes can be subtracted.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue as queue_module
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Target = Callable[..., None]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for an empty sample."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100.0 * len(ordered))) - 1]


def peak_rss_mb() -> float:
    """Peak resident set size of this process, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dsn", required=True, help="libpq URL of an empty database")
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--submit-batch", type=int, default=1_000)
    p.add_argument("--claim-batch", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=2, help="worker processes")
    p.add_argument("--latency-samples", type=int, default=200)
    p.add_argument("--stats", choices=("autovacuum", "none", "all"), default="autovacuum",
                   help="statistics before the drain: 'autovacuum' ANALYZEs the tables that "
                        "autovacuum's analyze rule would pick (changed rows > threshold + "
                        "scale x rows, the server's settings), 'all' VACUUM ANALYZEs "
                        "everything, 'none' leaves them")
    p.add_argument("--latency-interval", type=float, default=0.02,
                   help="seconds between two latency submissions")
    return p


def database_name(dsn: str) -> str:
    return dsn.rsplit("/", 1)[-1].split("?", 1)[0]


def emit(result: dict[str, Any]) -> None:
    """The driver's one line of figures on stdout."""
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    print(f"  [{os.path.basename(sys.argv[0])}] {message}", file=sys.stderr, flush=True)


# --- PostgreSQL backend CPU ------------------------------------------------------------


def _cpu_seconds(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


def _backends(database: str) -> list[int]:
    """pids of the server processes serving connections to ``database``."""
    found = []
    needle = f" {database} ".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if command.startswith(b"postgres:") and needle in command.replace(b"\0", b" "):
            found.append(int(entry.name))
    return found


class BackendCpu:
    """CPU seconds used by the database's server processes between ``mark()`` and
    ``total()``. A thread samples them every 50 ms, so a backend that exits before the
    end still counts with its last reading (up to 50 ms of its CPU may be missed)."""

    def __init__(self, database: str) -> None:
        self.database = database
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._marked = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> BackendCpu:
        self._thread.start()
        return self

    def _sample(self) -> None:
        for pid in _backends(self.database):
            cpu = _cpu_seconds(pid)
            if cpu is None:
                continue
            with self._lock:
                if self._marked:
                    self._first.setdefault(pid, cpu)
                self._last[pid] = cpu

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample()

    def mark(self) -> None:
        with self._lock:
            self._first = dict(self._last)
            self._marked = True
        self._sample()

    def total(self) -> float:
        self._sample()
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            return sum(self._last[pid] - self._first.get(pid, self._last[pid])
                       for pid in self._last if pid in self._first)


# --- the drain phase ----------------------------------------------------------------------


@dataclass
class Gate:
    """Handed to each worker process: wait at the barrier, then report once."""

    barrier: Any
    results: Any
    index: int
    cpu_start: float = 0.0
    started: float = 0.0

    def wait(self) -> float:
        self.barrier.wait(timeout=300)
        self.cpu_start = time.process_time()
        self.started = time.monotonic()
        return self.started

    def report(self, done: int, *, errors: int = 0, first_error: str = "",
               ended: float | None = None, **extra: Any) -> None:
        self.results.put({
            "index": self.index, "done": done, "errors": errors, "first_error": first_error,
            "start": self.started, "end": ended if ended is not None else time.monotonic(),
            "cpu": time.process_time() - self.cpu_start, "rss_mb": peak_rss_mb(), **extra,
        })

    def crash(self, exc: BaseException) -> None:
        self.results.put({"index": self.index, "crash": f"{type(exc).__name__}: {exc}"})


@dataclass
class DrainResult:
    jobs: int
    done: int
    seconds: float
    client_cpu: float
    db_cpu: float
    rss_mb: float
    errors: int
    first_error: str
    extra: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        rate = self.done / self.seconds if self.seconds > 0 else 0.0
        per = max(self.done, 1)
        return {
            "jobs": self.jobs, "done": self.done, "seconds": self.seconds, "rate": rate,
            "client_cpu_ms_per_job": self.client_cpu * 1000 / per,
            "db_cpu_ms_per_job": self.db_cpu * 1000 / per,
            "worker_rss_mb": self.rss_mb, "errors": self.errors,
            "first_error": self.first_error, "workers": self.extra,
        }


def drain(target: Target, args: tuple[Any, ...], concurrency: int, database: str,
          jobs: int, timeout: float = 900.0) -> DrainResult:
    """Run ``target(*args, gate)`` in ``concurrency`` spawned processes, released at
    once; each calls ``gate.wait()`` when connected and ``gate.report()`` when its
    claim comes back empty."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(concurrency + 1)
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(*args, Gate(barrier, results, i)))
                 for i in range(concurrency)]
    sampler = BackendCpu(database).start()
    for process in processes:
        process.start()
    try:
        barrier.wait(timeout=300)
    except Exception as exc:
        for process in processes:
            process.kill()
        raise SystemExit(f"workers did not reach the barrier: {exc}") from None
    sampler.mark()
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(reports) < concurrency:
        try:
            reports.append(results.get(timeout=2))
        except queue_module.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for process in processes:
                    process.kill()
                raise SystemExit(f"{len(dead)} worker(s) died or the drain hung") from None
    db_cpu = sampler.total()
    for process in processes:
        process.join(timeout=60)
    crashes = [r["crash"] for r in reports if "crash" in r]
    if crashes:
        raise SystemExit(f"worker crashed: {crashes[0]}")
    return DrainResult(
        jobs=jobs, done=sum(r["done"] for r in reports),
        seconds=max(r["end"] for r in reports) - min(r["start"] for r in reports),
        client_cpu=sum(r["cpu"] for r in reports), db_cpu=db_cpu,
        rss_mb=max(r["rss_mb"] for r in reports), errors=sum(r["errors"] for r in reports),
        first_error=next((r["first_error"] for r in reports if r["first_error"]), ""),
        extra=[{k: v for k, v in r.items() if k not in ("start", "end")} for r in reports],
    )


# --- the latency phase --------------------------------------------------------------------


class LatencyProbe:
    """One listening worker process; the driver submits jobs one at a time and marks
    each (key, submit start, submit end); the worker puts (key, claimed at) pairs."""

    def __init__(self, target: Target, args: tuple[Any, ...], samples: int) -> None:
        ctx = mp.get_context("spawn")
        self.ready = ctx.Event()
        self.stop = ctx.Event()
        self.results = ctx.Queue()
        self.samples = samples
        self.sent: dict[str, tuple[float, float]] = {}
        self.process = ctx.Process(target=target,
                                   args=(*args, self.ready, self.stop, self.results, samples))

    def start(self, timeout: float = 60.0) -> LatencyProbe:
        self.process.start()
        if not self.ready.wait(timeout):
            self.process.kill()
            raise SystemExit("the latency worker did not get ready")
        time.sleep(0.2)  # let its LISTEN settle
        return self

    def mark(self, key: object, started: float, ended: float) -> None:
        self.sent[str(key)] = (started, ended)

    def finish(self, timeout: float = 30.0) -> dict[str, Any]:
        claimed: dict[str, float] = {}
        rss = math.nan
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.results.get(timeout=0.5)
            except queue_module.Empty:
                if self.process.exitcode not in (None, 0):
                    break
                continue
            if message[0] == "claimed":
                claimed[str(message[1])] = message[2]
            elif message[0] == "done":
                rss = message[1]
                break
            if len(claimed) >= self.samples:
                self.stop.set()
        self.stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
        waits = [claimed[k] - s for k, (s, _) in self.sent.items() if k in claimed]
        after_commit = [claimed[k] - e for k, (_, e) in self.sent.items() if k in claimed]
        submit = [e - s for s, e in self.sent.values()]
        return {
            "samples": len(waits), "missing": len(self.sent) - len(waits),
            "p50_ms": percentile(waits, 50) * 1000, "p99_ms": percentile(waits, 99) * 1000,
            "after_submit_p50_ms": percentile(after_commit, 50) * 1000,
            "after_submit_p99_ms": percentile(after_commit, 99) * 1000,
            "submit_call_p50_ms": percentile(submit, 50) * 1000,
            "worker_rss_mb": rss,
        }


def claimed(results: Any, key: object) -> None:
    """From the latency worker: ``key`` is in its hands now."""
    results.put(("claimed", str(key), time.monotonic()))


def latency_done(results: Any) -> None:
    results.put(("done", peak_rss_mb()))


def prepare_statistics(dsn: str, mode: str) -> list[str]:
    """Before the drain, statistics as a server with autovacuum on would have them soon
    after the enqueue (this one may run with autovacuum off): ANALYZE each table whose
    rows changed since its last analyze exceed autovacuum's threshold. Returns them."""
    import psycopg

    if mode == "none":
        return []
    time.sleep(0.5)  # the enqueue's backend has exited: its counters are flushed
    with psycopg.connect(dsn, autocommit=True) as conn:
        if mode == "all":
            conn.execute("VACUUM ANALYZE")
            return ["*"]
        setting = conn.execute("SELECT current_setting('autovacuum_analyze_threshold'), "
                               "current_setting('autovacuum_analyze_scale_factor')").fetchone()
        threshold, scale = (float(v) for v in setting) if setting else (50.0, 0.1)
        rows = conn.execute(
            "SELECT s.schemaname, s.relname, s.n_mod_since_analyze, c.reltuples "
            "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid").fetchall()
        picked = [f'"{schema}"."{name}"' for schema, name, changed, tuples in rows
                  if changed > threshold + scale * max(float(tuples), 0.0)]
        for name in picked:
            conn.execute(f"ANALYZE {name}")
        return picked


def timed_batches(submit: Callable[[int, int], object], jobs: int, batch: int
                  ) -> dict[str, float]:
    """Call ``submit(lo, hi)`` for each batch; the enqueue figures."""
    times = []
    for lo in range(0, jobs, batch):
        started = time.perf_counter()
        submit(lo, min(lo + batch, jobs))
        times.append(time.perf_counter() - started)
    total = sum(times)
    return {"jobs": jobs, "batch": batch, "seconds": total,
            "rate": jobs / total if total > 0 else 0.0,
            "batch_p50_ms": percentile(times, 50) * 1000,
            "batch_p99_ms": percentile(times, 99) * 1000}
