"""How fast is the run lifecycle? A benchmark (not a test) of the store, issue 2.

Measures, on SQLite (a WAL file in a temp dir) and PostgreSQL (a dedicated
database, dropped and recreated):

1. submit: no-op runs submitted per second through ``Store.submit`` in batches;
2. claim + complete: runs claimed and completed per second by 1, 2 and 4
   claimer processes (spawn) with claim batches of 1 and 50, each cell audited;
3. claim latency (PostgreSQL) at growing queue depths, populated with set-based
   SQL, with the EXPLAIN (ANALYZE, BUFFERS) of the claim's candidate scan.

Progress goes to stderr (one line per cell), the Markdown report to stdout, and
with ``--write PATH`` to that file too::

    .venv/bin/python bench/lifecycle.py --write docs/benchmarks.md
    .venv/bin/python bench/lifecycle.py --quick          # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import multiprocessing as mp
import os
import platform
import pstats
import queue as queue_module
import re
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import make_url

import runlane
from runlane.domain.tasks import TaskSpec, parse_task
from runlane.logs import configure_logging
from runlane.store import claim_sql, dialect_sql
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.store import Store

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
# Every benchmark's server: RUNLANE_BENCH_POSTGRES_URL, else the local test database.
BENCH_POSTGRES_URL = os.environ.get("RUNLANE_BENCH_POSTGRES_URL", DEFAULT_POSTGRES_URL)
BENCH_DATABASE = "runlane_bench"
TABLES = ("side_effects, run_events, attempts, runs, task_dependencies, tasks, workers, lanes, "
          "limit_counters, routes, policy_versions, tenant_spend")
QUEUE = "default"
LEASE_TTL = 60.0
SUBMIT_TARGET = 10_000.0  # runs/s on PostgreSQL
LATENCY_RATIO_TARGET = 1.2  # p50(deepest) / p50(shallowest)
PRIORITY_MIX = (0, 50, 50, 100, 100, 100, 100, 100, 150, 200)  # one in ten critical, ...
PRIORITY_CASE = (
    "CASE mod(g, 10) WHEN 0 THEN 0 WHEN 1 THEN 50 WHEN 2 THEN 50 "
    "WHEN 8 THEN 150 WHEN 9 THEN 200 ELSE 100 END"
)
REPO = "https://git.example.com/acme/app.git"


@dataclass(frozen=True)
class Sizes:
    submit_runs: int
    submit_batch: int
    cell_runs: int
    claimers: tuple[int, ...]
    claim_batches: tuple[int, ...]
    depths: tuple[int, ...]
    latency_samples: int
    latency_warmup: int


FULL = Sizes(
    submit_runs=20_000, submit_batch=1_000, cell_runs=4_000, claimers=(1, 2, 4),
    claim_batches=(1, 50), depths=(1_000, 100_000, 1_000_000), latency_samples=500,
    latency_warmup=20,
)
QUICK = Sizes(
    submit_runs=2_000, submit_batch=500, cell_runs=300, claimers=(1, 2, 4),
    claim_batches=(1, 50), depths=(1_000, 10_000), latency_samples=100, latency_warmup=10,
)


# --- small helpers ---------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def rates(values: Sequence[float]) -> str:
    return " / ".join(f"{v:,.0f}" for v in values)


def ms(seconds: float) -> str:
    return f"{seconds * 1000.0:.2f}"


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f}" if seconds > 0 else "n/a"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table; ``align`` has one letter per column (l or r), default right."""
    marks = [":---" if (align[i:i + 1] or "r") == "l" else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(marks) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# Profiles, per-statement timings and query plans go into a report only with --details:
# docs/benchmarks.md keeps each benchmark's figures readable, and the evidence behind
# them is one flag away (set by each script from its --details flag).
DETAILS = False


def add_details_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--details", action="store_true",
                        help="also print profiles, per-statement timings and query plans")


START, END = "<!-- lifecycle:start -->", "<!-- lifecycle:end -->"


def merge_section(path: Path, section: str, start: str, end: str) -> None:
    """Replace a benchmark's section of ``path`` (between its ``start`` and ``end``
    markers, which the section carries), or append it at the end; nothing else in the
    file changes (it is re-read right before writing)."""
    existing = path.read_text() if path.exists() else ""
    if start in existing and end in existing:
        head, _, rest = existing.partition(start)
        _, _, tail = rest.partition(end)
        updated = head + section.rstrip("\n") + tail
    else:
        updated = existing.rstrip("\n") + "\n\n" + section
    path.write_text(updated)


def libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def migrate(url: str) -> None:
    engine = build_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()


def fresh_postgres(admin_url: str, name: str = BENCH_DATABASE) -> str:
    """Drop and recreate a benchmark database, migrated to head; return its URL."""
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = with_database(admin_url, name)
    migrate(url)
    return url


def drop_postgres(admin_url: str, name: str) -> None:
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def fresh_sqlite(directory: Path, name: str) -> str:
    path = directory / f"{name}.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    migrate(url)
    return url


def pg_admin(url: str, *statements: str) -> None:
    """Run maintenance statements (TRUNCATE, VACUUM ...) in autocommit."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def make_specs(count: int, tag: str) -> list[TaskSpec]:
    """No-op tasks as a client would send them: a few tenants, a priority mix, keys."""
    return [
        parse_task({
            "tenant": f"tenant-{i % 8}",
            "repo": REPO,
            "prompt": "no-op",
            "priority": PRIORITY_MIX[i % len(PRIORITY_MIX)],
            "idempotency_key": f"{tag}-{i}",
        })
        for i in range(count)
    ]


def submit_all(store: Store, specs: Sequence[TaskSpec], batch: int) -> None:
    for i in range(0, len(specs), batch):
        store.submit(specs[i:i + batch])


def status_counts(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT status, COUNT(*) AS n FROM runs GROUP BY status"))
        return {str(r.status): int(r.n) for r in rows}


@dataclass(frozen=True)
class AuditResult:
    violations: int
    seconds: float
    first: str = ""

    @property
    def label(self) -> str:
        return "clean" if self.violations == 0 else f"{self.violations} VIOLATIONS ({self.first})"


def audit(store: Store) -> AuditResult:
    started = time.perf_counter()
    found = store.audit()
    first = f"{found[0].check}: {found[0].detail}" if found else ""
    return AuditResult(len(found), time.perf_counter() - started, first)


@contextmanager
def timed() -> Iterator[Callable[[], float]]:
    started = time.perf_counter()
    finished: list[float] = []
    yield lambda: (finished[0] if finished else time.perf_counter()) - started
    finished.append(time.perf_counter())


# --- environment -------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def load_average() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


POSTGRES_SHARED = ("checkpointer", "background writer", "walwriter", "autovacuum launcher",
                   "logical replication launcher", "archiver", "startup", "bin/postgres")


def _processes() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds used so far, command line), from /proc."""
    ticks = float(os.sysconf("SC_CLK_TCK"))
    table: dict[int, tuple[int, float, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks,
                                  command)
    return table


def process_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by one process; 0.0 if unknown."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / float(os.sysconf("SC_CLK_TCK"))


class OtherCpu:
    """CPU used by processes that are not this benchmark's while it measures: other
    programs and other databases' PostgreSQL backends (the server's shared background
    processes are not counted). Processes that start and exit between two readings are
    missed, so this is a lower bound. Shown as cores: 1.0 = one core busy elsewhere."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.before = self._foreign()

    @staticmethod
    def _foreign() -> dict[int, float]:
        table = _processes()
        me = os.getpid()

        def ours(pid: int) -> bool:
            seen = 0
            while pid > 1 and seen < 64:
                if pid == me:
                    return True
                pid, seen = table[pid][0] if pid in table else 0, seen + 1
            return False

        foreign: dict[int, float] = {}
        for pid, (_, cpu, command) in table.items():
            if ours(pid) or BENCH_DATABASE in command:
                continue
            postgres = command.startswith("postgres:") or "bin/postgres" in command
            if postgres and any(name in command for name in POSTGRES_SHARED):
                continue
            foreign[pid] = cpu
        return foreign

    def cores(self) -> float:
        after = self._foreign()
        used = sum(cpu - self.before.get(pid, 0.0) for pid, cpu in after.items())
        elapsed = time.monotonic() - self.started
        return max(used, 0.0) / elapsed if elapsed > 0 else 0.0


def git(*args: str) -> str:
    """A read-only git command in the benchmark's repository; '' when it fails."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def runlane_source() -> str:
    """Which runlane was measured: the commit, and whether its source differed from it."""
    revision = git("rev-parse", "--short", "HEAD") or "unknown"
    package = Path(runlane.__file__).resolve().parent
    top = git("rev-parse", "--show-toplevel")
    if top and package.is_relative_to(Path(top)):
        changed = git("diff", "--name-only", "HEAD", "--", str(package)).splitlines()
        state = f"{len(changed)} file(s) modified" if changed else "clean"
        return f"commit {revision}, imported from the working tree ({state})"
    return f"imported from `{package}` (outside the repository at commit {revision})"


def postgres_facts(url: str) -> dict[str, str]:
    names = ("server_version", "shared_buffers", "synchronous_commit", "fsync", "work_mem")
    with psycopg.connect(libpq(url)) as conn:
        return {name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                for name in names}


def display_command(argv: Sequence[str]) -> str:
    shown = [re.sub(r"://([^:/@]+):[^@]+@", r"://\1:***@", arg) for arg in argv]
    prefix = "".join(f"{name}={shlex.quote(os.environ[name])} "
                     for name in ("PYTHONPATH", "PGOPTIONS") if os.environ.get(name))
    return prefix + "python " + shlex.join(shown)


def commit_floor(url: str, samples: int = 300) -> tuple[float, float]:
    """p50 and p99 of the cheapest write transaction through a runlane engine (one
    one-row INSERT and its COMMIT, in a scratch table): the floor under every claim and
    complete, set by the commit's flush to disk."""
    engine = build_engine(url)
    times: list[float] = []
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE bench_floor (id INTEGER NOT NULL, at FLOAT)"))
        for i in range(samples + 20):
            started = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO bench_floor (id, at) VALUES (:i, :at)"),
                             {"i": i, "at": time.time()})
            if i >= 20:
                times.append(time.perf_counter() - started)
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE bench_floor"))
    finally:
        engine.dispose()
    return percentile(times, 50), percentile(times, 99)


# --- 1. submit ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitResult:
    backend: str
    runs: int
    batch: int
    seconds: float
    batch_times: list[float]
    parse_seconds: float
    audit: AuditResult
    other_cores: float
    round_rates: tuple[float, ...] = ()  # runs/s of every round, in order

    @property
    def throughput(self) -> float:
        return self.runs / self.seconds if self.seconds > 0 else 0.0


def bench_submit(backend: str, url: str, sizes: Sizes, round_no: int) -> SubmitResult:
    with timed() as parse_elapsed:
        specs = make_specs(sizes.submit_runs, f"submit-{backend}-{round_no}")
    store = Store(url)
    try:
        store.submit(make_specs(50, f"warmup-{backend}-{round_no}"))  # connect, compile
        batch_times: list[float] = []
        other = OtherCpu()
        with timed() as elapsed:
            for i in range(0, len(specs), sizes.submit_batch):
                started = time.perf_counter()
                store.submit(specs[i:i + sizes.submit_batch])
                batch_times.append(time.perf_counter() - started)
        counts = status_counts(store)
        expected = sizes.submit_runs + 50
        if counts.get("QUEUED", 0) != expected:
            raise SystemExit(f"submit on {backend}: expected {expected} QUEUED, got {counts}")
        other_cores = other.cores()
        result = SubmitResult(backend, sizes.submit_runs, sizes.submit_batch, elapsed(),
                              batch_times, parse_elapsed(), audit(store), other_cores)
    finally:
        store.close()
    progress(f"submit {backend} round {round_no + 1}: {sizes.submit_runs} runs in batches of "
             f"{sizes.submit_batch}: "
             f"{rate(result.runs, result.seconds)} runs/s, audit {result.audit.label}, "
             f"other CPU {result.other_cores:.2f} cores")
    return result


def profile_submit(url: str, batch: int) -> str:
    """cProfile of one submit batch (PostgreSQL): where the time goes, top functions."""
    specs = make_specs(batch, "profile")
    store = Store(url)
    try:
        store.submit(make_specs(10, "profile-warmup"))
        profiler = cProfile.Profile()
        profiler.enable()
        store.submit(specs)
        profiler.disable()
    finally:
        store.close()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    cleaned = [re.sub(r"/\S*/(site-packages|src|lib/python3\.\d+)/", "", line)
               for line in lines[start:] if line.strip()]
    return "\n".join(cleaned)


# --- 2. claim + complete -----------------------------------------------------------------


def claimer(url: str, worker_id: str, batch: int, barrier: Any, results: Any) -> None:
    """One claimer process: claim up to ``batch`` runs, complete each, until empty."""
    configure_logging("WARNING")
    store = Store(url)
    claim_times: list[float] = []
    complete_times: list[float] = []
    done = errors = 0
    first_error = ""
    try:
        backend: int | None = None
        with store.engine.connect() as conn:  # the connection is opened before the clock
            if store.is_postgres:  # the server process serving it, for its CPU time
                backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            else:
                conn.execute(text("SELECT 1"))
        barrier.wait(timeout=300)
        start = end = time.monotonic()
        cpu_start, db_cpu_start = time.process_time(), process_cpu(backend)
        while True:
            t0 = time.perf_counter()
            leases = store.claim(worker_id, QUEUE, limit=batch, lease_ttl=LEASE_TTL)
            claim_times.append(time.perf_counter() - t0)
            if not leases:
                break
            for lease in leases:
                t0 = time.perf_counter()
                try:
                    store.complete(lease)
                    done += 1
                except Exception as exc:  # a lost lease here is a finding, not a crash
                    errors += 1
                    first_error = first_error or f"{type(exc).__name__}: {exc}"
                complete_times.append(time.perf_counter() - t0)
            end = time.monotonic()
        client_cpu = time.process_time() - cpu_start
        db_cpu = process_cpu(backend) - db_cpu_start if backend is not None else None
        results.put({
            "client_cpu": client_cpu, "db_cpu": db_cpu,
            "worker_id": worker_id, "start": start, "end": end, "done": done,
            "errors": errors, "first_error": first_error, "claims": len(claim_times),
            "claim_p50": percentile(claim_times, 50), "claim_p99": percentile(claim_times, 99),
            "complete_p50": percentile(complete_times, 50) if complete_times else 0.0,
            "complete_p99": percentile(complete_times, 99) if complete_times else 0.0,
        })
    except BaseException as exc:
        results.put({"worker_id": worker_id, "crash": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        store.close()


@dataclass(frozen=True)
class CellResult:
    backend: str
    claimers: int
    batch: int
    runs: int
    seconds: float
    done: int
    errors: int
    left_queued: int
    claim_p50: float
    claim_p99: float
    complete_p50: float
    complete_p99: float
    audit: AuditResult
    statuses: dict[str, int] = field(default_factory=dict)
    first_error: str = ""
    crashed: int = 0  # claimer processes that died on an exception
    other_cores: float = 0.0
    round_rates: tuple[float, ...] = ()  # runs/s of every round, in order
    lost: int = 0  # over every round: runs submitted but not completed
    client_cpu: float = 0.0  # CPU seconds of the claimer processes (SQLite included)
    db_cpu: float | None = None  # CPU seconds of their PostgreSQL backends

    @property
    def throughput(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def per_run_ms(self, seconds: float | None) -> str:
        return "-" if seconds is None or not self.done else f"{seconds * 1000 / self.done:.2f}"


def run_cell(backend: str, url: str, claimers: int, batch: int, runs: int) -> CellResult:
    store = Store(url)
    try:
        submit_all(store, make_specs(runs, f"cell-{claimers}-{batch}"), 1_000)
    finally:
        store.close()
    if backend == "postgresql":
        pg_admin(url, "VACUUM ANALYZE")  # what autovacuum would soon do after a refill

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(claimers)
    results = ctx.Queue()
    names = [f"bench-{backend}-{i}" for i in range(claimers)]
    processes = [
        ctx.Process(target=claimer, args=(url, name, batch, barrier, results), name=name)
        for name in names
    ]
    other = OtherCpu()
    for process in processes:
        process.start()
    reports: list[dict[str, Any]] = []
    deadline = time.monotonic() + 900
    while len(reports) < claimers:
        try:
            reports.append(results.get(timeout=5))
        except queue_module.Empty:
            reported = {r["worker_id"] for r in reports}
            dead = [p for p in processes
                    if p.exitcode not in (None, 0) and p.name not in reported]
            if dead or time.monotonic() > deadline:
                for process in processes:
                    process.kill()
                raise SystemExit(
                    f"cell {backend} x{claimers} b{batch}: claimer died or hung") from None
    other_cores = other.cores()
    for process in processes:
        process.join(timeout=60)
    crashes = [str(r["crash"]) for r in reports if "crash" in r]
    reports = [r for r in reports if "crash" not in r] or [
        {"start": 0.0, "end": 0.0, "done": 0, "errors": 0, "first_error": "", "claim_p50": 0.0,
         "claim_p99": 0.0, "complete_p50": 0.0, "complete_p99": 0.0, "client_cpu": 0.0,
         "db_cpu": None}]

    store = Store(url)
    try:
        statuses = status_counts(store)
        checked = audit(store)
    finally:
        store.close()
    seconds = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    errors = sum(int(r["errors"]) for r in reports) + len(crashes)
    result = CellResult(
        backend=backend, claimers=claimers, batch=batch, runs=runs, seconds=seconds,
        done=sum(int(r["done"]) for r in reports), errors=errors,
        left_queued=statuses.get("QUEUED", 0),
        claim_p50=max(r["claim_p50"] for r in reports),
        claim_p99=max(r["claim_p99"] for r in reports),
        complete_p50=max(r["complete_p50"] for r in reports),
        complete_p99=max(r["complete_p99"] for r in reports),
        audit=checked, statuses=statuses,
        first_error=next(iter(crashes), "")
        or next((r["first_error"] for r in reports if r["first_error"]), ""),
        crashed=len(crashes), other_cores=other_cores,
        client_cpu=sum(float(r["client_cpu"]) for r in reports),
        db_cpu=None if any(r["db_cpu"] is None for r in reports)
        else sum(float(r["db_cpu"]) for r in reports),
    )
    progress(f"claim+complete {backend} claimers={claimers} batch={batch}: "
             f"{result.done}/{runs} "
             f"runs in {seconds:.2f}s = {result.throughput:,.0f}/s, errors {errors} "
             f"(crashed claimers {len(crashes)}), "
             f"left queued {result.left_queued}, audit {checked.label}, "
             f"other CPU {other_cores:.2f} cores")
    return result


def combine_audits(audits: Sequence[AuditResult]) -> AuditResult:
    first = next((a.first for a in audits if a.violations), "")
    return AuditResult(sum(a.violations for a in audits), sum(a.seconds for a in audits), first)


def median_submit(rounds: Sequence[SubmitResult]) -> SubmitResult:
    """The median round (by runs/s), carrying every round's rate and every audit."""
    chosen = sorted(rounds, key=lambda r: r.throughput)[(len(rounds) - 1) // 2]
    return replace(chosen, round_rates=tuple(r.throughput for r in rounds),
                   audit=combine_audits([r.audit for r in rounds]))


def median_cell(rounds: Sequence[CellResult]) -> CellResult:
    chosen = sorted(rounds, key=lambda r: r.throughput)[(len(rounds) - 1) // 2]
    return replace(chosen, round_rates=tuple(r.throughput for r in rounds),
                   audit=combine_audits([r.audit for r in rounds]),
                   lost=sum(r.runs - r.done for r in rounds),
                   errors=sum(r.errors for r in rounds))


def reset(backend: str, url: str, directory: Path, name: str) -> str:
    if backend == "sqlite":
        return fresh_sqlite(directory, name)
    pg_admin(url, f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE")
    return url


# --- 3. claim latency at depth (PostgreSQL) -----------------------------------------------



def v7_sql(kind: str) -> str:
    """SQL for run g's id in runlane's own layout (runlane.domain.ids, UUIDv7): the
    creation millisecond (base + g/100 s) first, then a random-looking tail."""
    return ("(overlay(overlay(overlay(md5('bench-" + kind + "-' || g) "
            "placing lpad(to_hex((%(base)s * 1000 + g * 10)::bigint), 12, '0') from 1 for 12) "
            "placing '7' from 13 for 1) placing '8' from 17 for 1))::uuid::text")


def populate(url: str, first: int, count: int, chunk: int = 100_000) -> None:
    """Append ``count`` queued runs (ids first+1 ..) with set-based SQL: a task, a run and
    its submission event each; visible in the past; the same priority mix as submit."""
    base = time.time() - 86_400.0  # a day ago; run g becomes visible at base + g/100 s
    with psycopg.connect(libpq(url)) as conn:
        for lo in range(first + 1, first + count + 1, chunk):
            hi = min(lo + chunk - 1, first + count)
            params = {"lo": lo, "hi": hi, "base": base}
            conn.execute(
                "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, "
                "idempotency_key, max_attempts, context, truncated_sections, payload_bytes, "
                "cancel_requested_at, created_at) "
                "SELECT " + v7_sql("task") + ", 'tenant-' || mod(g, 8), "
                f"%(repo)s, 'no-op', %(queue)s, {PRIORITY_CASE}, 'depth-' || g, 3, "
                "'{}'::json, '[]'::json, 120, NULL, %(base)s + g / 100.0 "
                "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g",
                {**params, "repo": REPO, "queue": QUEUE},
            )
            conn.execute(
                "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status, "
                "attempt_count, max_attempts, fencing_token, visible_at, created_at, "
                "updated_at, ended_at, reason_code, message, outcome, cost_usd) "
                "SELECT " + v7_sql("run") + ", " + v7_sql("task") + ", "
                f"'tenant-' || mod(g, 8), %(repo)s, %(queue)s, {PRIORITY_CASE}, 'QUEUED', 0, 3, 0, "
                "%(base)s + g / 100.0, %(base)s + g / 100.0, %(base)s + g / 100.0, "
                "NULL, NULL, NULL, NULL, 0 "
                "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g",
                {**params, "repo": REPO, "queue": QUEUE},
            )
            # Their lanes (one per tenant and priority here), as submit would make them.
            conn.execute(
                "INSERT INTO routes (route_key, created_at) VALUES ('', 0) "
                "ON CONFLICT (route_key) DO NOTHING")
            conn.execute(
                "INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, "
                "pass, tenant_at_limit) SELECT queue, '', priority, tenant, 1, COUNT(*), 0, 0 "
                "FROM runs WHERE lane_id IS NULL AND status = 'QUEUED' "
                "GROUP BY queue, priority, tenant "
                "ON CONFLICT (queue, route_key, priority, tenant) DO UPDATE "
                "SET queued_count = lanes.queued_count + excluded.queued_count")
            conn.execute(
                "UPDATE runs SET lane_id = l.lane_id FROM lanes l WHERE runs.lane_id IS NULL "
                "AND l.queue = runs.queue AND l.route_key = '' AND l.priority = runs.priority "
                "AND l.tenant = runs.tenant")
            conn.execute(
                "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status, "
                "reason_code, fencing_token, message) "
                "SELECT " + v7_sql("run") + ", NULL, %(base)s + g / 100.0, 'bench', "
                "NULL, 'QUEUED', NULL, NULL, 'submitted' "
                "FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS g",
                params,
            )
            conn.commit()


def claim_candidate_sql() -> str:
    """LANE_RUNS (a claim's walk of its lanes), rendered by the store's own Statements."""
    return dialect_sql.Statements("postgresql").render(claim_sql.LANE_RUNS["postgresql"]).text


def busiest_lane(conn: Any) -> int:
    return int(conn.execute(text(
        "SELECT lane_id FROM lanes WHERE queue = :q ORDER BY priority, queued_count DESC "
        "LIMIT 1"), {"q": QUEUE}).scalar_one())


def candidate_params(lane_id: int, limit: int) -> dict[str, Any]:
    """One lane, ``limit`` runs from its head."""
    return {"lane_ids": [lane_id], "shares": [limit], "now": None,
            "after_created": [float("-inf")], "after_ids": [""]}


@dataclass(frozen=True)
class Plan:
    custom: str
    generic: str
    execution_ms: float
    shared_buffers: str


def explain_claim(url: str) -> Plan:
    """EXPLAIN (ANALYZE, BUFFERS) of the candidate scan for a claim of one run, as a custom
    plan (parameters bound) and as the generic plan a prepared statement may switch to.
    Both run inside a transaction that is rolled back (they take row locks)."""
    body = claim_candidate_sql()
    store = Store(url)
    try:
        with store.engine.connect() as conn:
            lane_id = busiest_lane(conn)
            rows = conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + body),
                                candidate_params(lane_id, 1))
            custom = "\n".join(str(r[0]) for r in rows)
            conn.rollback()
            numbered = body
            for n, name in enumerate(("lane_ids", "shares", "now", "after_created",
                                      "after_ids"), start=1):
                numbered = re.sub(rf"(?<!:):{name}\b", f"${n}", numbered)
            conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
            conn.exec_driver_sql(
                "PREPARE bench_claim_probe(bigint[], integer[], double precision, "
                "double precision[], text[]) AS " + numbered)
            rows = conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_claim_probe('{{{lane_id}}}', "
                "'{1}', NULL, '{-Infinity}', '{\"\"}')")
            generic = "\n".join(str(r[0]) for r in rows)
            conn.exec_driver_sql("DEALLOCATE bench_claim_probe")
            conn.rollback()
    finally:
        store.close()
    timing = re.search(r"Execution Time: ([\d.]+) ms", custom)
    buffers = re.search(r"Buffers: (shared [^\n]*)", custom)
    return Plan(custom, generic, float(timing.group(1)) if timing else float("nan"),
                buffers.group(1).strip() if buffers else "n/a")


@dataclass(frozen=True)
class CostProbe:
    limit: int
    estimated_cost: float
    jit_ms: float | None
    execution_ms: float


def probe_claim_costs(url: str, limits: Sequence[int]) -> tuple[float, list[CostProbe]]:
    """The planner's cost estimate of the candidate scan for several claim batch sizes,
    against ``jit_above_cost``: above it, PostgreSQL JIT-compiles the claim each time."""
    body = claim_candidate_sql()
    probes: list[CostProbe] = []
    store = Store(url)
    try:
        with store.engine.connect() as conn:
            threshold = float(conn.execute(text("SHOW jit_above_cost")).scalar_one())
            if conn.execute(text("SHOW jit")).scalar_one() != "on":
                threshold = float("inf")
            lane_id = busiest_lane(conn)
            for limit in limits:
                rows = conn.execute(text("EXPLAIN (ANALYZE) " + body),
                                    candidate_params(lane_id, limit))
                plan = "\n".join(str(r[0]) for r in rows)
                conn.rollback()
                cost = re.search(r"cost=[\d.]+\.\.([\d.]+)", plan)
                jit = re.search(r"Timing: .*Total ([\d.]+) ms", plan)
                execution = re.search(r"Execution Time: ([\d.]+) ms", plan)
                probes.append(CostProbe(limit, float(cost.group(1)) if cost else float("nan"),
                                        float(jit.group(1)) if jit else None,
                                        float(execution.group(1)) if execution else float("nan")))
    finally:
        store.close()
    return threshold, probes


@dataclass(frozen=True)
class DepthResult:
    depth: int
    populate_seconds: float
    vacuum_seconds: float
    queued_before: int
    queued_after: int
    claim_times: list[float]
    complete_times: list[float]
    plan: Plan
    other_cores: float


def bench_depths(admin_url: str, sizes: Sizes, depths: Sequence[int], block: int = 25
                 ) -> tuple[list[DepthResult], tuple[float, list[CostProbe]]]:
    """One database per depth, each populated with ``depth`` queued runs (plus the runs the
    samples will take, so at least ``depth`` stay queued throughout). The samples are taken
    interleaved, ``block`` claims at a time on each database in turn, so that whatever else
    the machine does meanwhile weighs on every depth alike and their ratio stays fair."""
    per_step = sizes.latency_warmup + sizes.latency_samples
    names = {depth: f"{BENCH_DATABASE}_depth_{depth}" for depth in depths}
    urls: dict[int, str] = {}
    populate_seconds: dict[int, float] = {}
    vacuum_seconds: dict[int, float] = {}
    for depth in depths:
        urls[depth] = fresh_postgres(admin_url, names[depth])
        with timed() as populate_elapsed:
            populate(urls[depth], 0, depth + per_step)
        with timed() as vacuum_elapsed:
            pg_admin(urls[depth], "VACUUM ANALYZE tasks", "VACUUM ANALYZE runs",
                     "VACUUM ANALYZE run_events", "VACUUM ANALYZE attempts")
        populate_seconds[depth], vacuum_seconds[depth] = populate_elapsed(), vacuum_elapsed()
        progress(f"claim latency postgresql: populated {depth:,} (+{per_step}) queued runs in "
                 f"{populate_seconds[depth]:.1f}s, vacuum {vacuum_seconds[depth]:.1f}s")

    stores = {depth: Store(urls[depth]) for depth in depths}
    claim_times: dict[int, list[float]] = {depth: [] for depth in depths}
    complete_times: dict[int, list[float]] = {depth: [] for depth in depths}
    queued_before: dict[int, int] = {}
    queued_after: dict[int, int] = {}
    try:
        for depth, store in stores.items():
            queued_before[depth] = status_counts(store).get("QUEUED", 0)
            for _ in range(sizes.latency_warmup):  # connect, prepare, warm the caches
                for lease in store.claim("bench-latency", QUEUE, limit=1, lease_ttl=LEASE_TTL):
                    store.complete(lease)
        other = OtherCpu()
        order = list(depths)
        for first in range(0, sizes.latency_samples, block):
            for depth in order:
                store = stores[depth]
                for _ in range(min(block, sizes.latency_samples - first)):
                    t0 = time.perf_counter()
                    leases = store.claim("bench-latency", QUEUE, limit=1, lease_ttl=LEASE_TTL)
                    t1 = time.perf_counter()
                    if len(leases) != 1:
                        raise SystemExit(f"depth {depth}: claim returned {len(leases)} leases")
                    store.complete(leases[0])
                    claim_times[depth].append(t1 - t0)
                    complete_times[depth].append(time.perf_counter() - t1)
            order = order[1:] + order[:1]  # rotate, so no depth always follows another
        other_cores = other.cores()
        for depth, store in stores.items():
            queued_after[depth] = status_counts(store).get("QUEUED", 0)
    finally:
        for store in stores.values():
            store.close()

    results: list[DepthResult] = []
    probes: tuple[float, list[CostProbe]] = (float("inf"), [])
    for depth in depths:
        plan = explain_claim(urls[depth])
        if depth == depths[-1]:
            probes = probe_claim_costs(urls[depth], (1, 10, 50, 100, 500))
        result = DepthResult(depth, populate_seconds[depth], vacuum_seconds[depth],
                             queued_before[depth], queued_after[depth], claim_times[depth],
                             complete_times[depth], plan, other_cores)
        results.append(result)
        progress(f"claim latency postgresql depth={depth:,}: claim p50 "
                 f"{ms(percentile(result.claim_times, 50))} ms p99 "
                 f"{ms(percentile(result.claim_times, 99))} ms, scan {plan.execution_ms:.3f} ms,"
                 f" other CPU {other_cores:.2f} cores")
    return results, probes


# --- the report --------------------------------------------------------------------------


@dataclass
class Report:
    command: str
    started: datetime
    sizes: Sizes
    quick: bool
    repeat: int
    environment: list[tuple[str, str]] = field(default_factory=list)
    submits: list[SubmitResult] = field(default_factory=list)
    submit_profile: str = ""
    cells: list[CellResult] = field(default_factory=list)
    depths: list[DepthResult] = field(default_factory=list)
    depth_audit: AuditResult | None = None
    jit_above_cost: float = float("inf")
    cost_probes: list[CostProbe] = field(default_factory=list)
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        out: list[str] = []
        add = out.append
        add(START)
        add("## The run lifecycle: `bench/lifecycle.py`")
        add("")
        add(f"Produced by `{self.command}` on {self.started:%Y-%m-%d %H:%M} UTC; the whole run "
            f"took {self.wall_seconds / 60:.1f} min of wall time. Regenerate with "
            "`make bench` (or the command above); every figure and ratio of this section "
            "comes from that one run. `--details` adds the profile of a submit batch and "
            "the claim's plans."
            + (" **Quick mode: smoke-test sizes, not a measurement.**" if self.quick else ""))
        add("")
        add(table(["", ""], [[k, v] for k, v in self.environment], "ll"))
        add("")
        add(self.render_targets())
        add(self.render_submit())
        add(self.render_cells())
        add(self.render_depths())
        add(self.render_method())
        add(END)
        return "\n".join(out).rstrip() + "\n"

    def rounds_sentence(self) -> str:
        if self.repeat == 1:
            return "One round."
        return (f"Each figure is from the median of {self.repeat} rounds (by runs/s; the rounds "
                "run the whole matrix in turn, so a noisy minute hits one round of each cell "
                "rather than every round of one); audits and lost runs count every round.")

    def _pg_submit(self) -> SubmitResult | None:
        return next((s for s in self.submits if s.backend == "postgresql"), None)

    def _latency_ratio(self) -> tuple[DepthResult, DepthResult, float] | None:
        if len(self.depths) < 2:
            return None
        low, high = self.depths[0], self.depths[-1]
        return low, high, percentile(high.claim_times, 50) / percentile(low.claim_times, 50)

    def render_targets(self) -> str:
        rows: list[list[str]] = []
        pg = self._pg_submit()
        if pg is not None:
            measured = pg.runs / pg.seconds
            rows.append(["Submit, PostgreSQL, batches of "
                         f"{pg.batch:,} (median round)", f">= {SUBMIT_TARGET:,.0f} runs/s",
                         f"{measured:,.0f} runs/s",
                         "met" if measured >= SUBMIT_TARGET else "**missed**"])
        ratio = self._latency_ratio()
        if ratio is not None:
            low, high, value = ratio
            rows.append([f"Claim p50 at {high.depth:,} / at {low.depth:,} queued runs",
                         f"<= {LATENCY_RATIO_TARGET}", f"{value:.2f}",
                         "met" if value <= LATENCY_RATIO_TARGET else "**missed**"])
        clean = all(c.audit.violations == 0 for c in self.cells) and all(
            s.audit.violations == 0 for s in self.submits) and (
            self.depth_audit is None or self.depth_audit.violations == 0)
        lost = sum(c.lost for c in self.cells)
        rows.append(["Invariants (store.audit) after every cell of every round", "clean",
                     "clean" if clean else "VIOLATIONS", "met" if clean else "**missed**"])
        rows.append(["Runs submitted but not completed in the claim cells (every round)", "0",
                     str(lost),
                     "met" if lost == 0 else "**missed**"])
        return "### Targets\n\n" + table(["What", "Target", "Measured", ""], rows,
                                                 "llrl") + "\n"

    def render_submit(self) -> str:
        rows = [
            [s.backend, f"{s.runs:,}", f"{s.batch:,}", f"{s.seconds:.2f}",
             rate(s.runs, s.seconds), rates(s.round_rates), ms(percentile(s.batch_times, 50)),
             ms(percentile(s.batch_times, 99)), rate(s.runs, s.parse_seconds),
             f"{s.other_cores:.2f}", s.audit.label]
            for s in self.submits
        ]
        text_ = (
            "### 1. Submit throughput\n\n"
            "`Store.submit` with lists of `TaskSpec` built by `parse_task` (no-op prompt, "
            "8 tenants, a priority mix, an idempotency key each), one process, one batch per "
            "transaction. Building the specs (`parse_task`) is client-side and not timed; its "
            f"rate is shown for scale. {self.rounds_sentence()}\n\n"
            + table(["Backend", "Runs", "Batch", "Seconds", "Runs/s", "Runs/s by round",
                     "Batch p50 ms", "Batch p99 ms", "parse_task/s", "Other CPU", "Audit"], rows,
                    "lrrrrrrrrrl")
            + "\n"
        )
        if self.submit_profile and DETAILS:
            text_ += (
                "\nWhere a PostgreSQL submit batch spends its time (cProfile of one batch of "
                f"{self.sizes.submit_batch:,}, top functions by own time; profiling inflates "
                "the total):\n\n```text\n" + self.submit_profile + "\n```\n"
            )
        return text_

    def render_cells(self) -> str:
        rows: list[list[str]] = []
        single: dict[tuple[str, int], float] = {
            (c.backend, c.batch): c.throughput for c in self.cells if c.claimers == 1
        }
        for c in self.cells:
            base = single.get((c.backend, c.batch))
            scaling = f"{c.throughput / base:.2f}x" if base else "n/a"
            rows.append([
                c.backend, str(c.claimers), str(c.batch), f"{c.done:,}/{c.runs:,}",
                f"{c.throughput:,.0f}", rates(c.round_rates), scaling,
                ms(c.claim_p50), ms(c.claim_p99), ms(c.complete_p50), ms(c.complete_p99),
                c.per_run_ms(c.client_cpu), c.per_run_ms(c.db_cpu),
                str(c.errors), f"{c.other_cores:.2f}", c.audit.label,
            ])
        text_ = (
            "### 2. Claimed + completed per second\n\n"
            "Each cell: a fresh queue of no-op runs (submitted untimed), then N claimer "
            "processes (multiprocessing, spawn) that each loop `store.claim(worker, limit=B, "
            "lease_ttl=60)` and `store.complete(lease)` for every lease (CLAIMED -> "
            "FINALIZING -> SUCCEEDED in one fenced write) until a claim comes back empty. "
            "The clock runs from the barrier that releases all claimers to the last "
            "completion. Latencies are per call, the worst claimer's percentile. CPU per "
            "run: the claimer processes' own CPU time (for SQLite this includes the database "
            "engine, which runs in-process) and, for PostgreSQL, that of the server processes "
            "serving their connections, divided by the runs completed (the machine's "
            f"{os.cpu_count()} cores give {(os.cpu_count() or 1) * 1000:,} CPU-ms per "
            "second). " + self.rounds_sentence() + " "
            "`store.audit()` runs after every cell.\n\n"
            + table(["Backend", "Claimers", "Claim batch", "Completed", "Runs/s",
                     "Runs/s by round", "vs 1 claimer", "claim p50 ms", "claim p99 ms",
                     "complete p50 ms", "complete p99 ms", "Client CPU ms/run",
                     "DB CPU ms/run", "Errors", "Other CPU", "Audit"], rows,
                    "lrrrrrrrrrrrrrrl")
            + "\n"
        )
        odd = [c for c in self.cells if c.errors or c.left_queued or c.lost]
        for c in odd:
            first = c.first_error.splitlines()[0] if c.first_error else ""
            text_ += (f"\n- {c.backend} x{c.claimers} batch {c.batch}: {c.errors} errors, "
                      f"{c.crashed} claimer(s) crashed (first: `{first}`), {c.left_queued} "
                      f"runs left QUEUED, statuses {c.statuses}\n")
        return text_

    def render_depths(self) -> str:
        if not self.depths:
            return "### 3. Claim latency at queue depth (PostgreSQL)\n\nNot run.\n"
        rows = [
            [f"{d.depth:,}", f"{d.queued_before:,} -> {d.queued_after:,}",
             str(len(d.claim_times)), ms(percentile(d.claim_times, 50)),
             ms(percentile(d.claim_times, 99)), ms(percentile(d.complete_times, 50)),
             ms(percentile(d.complete_times, 99)), f"{d.plan.execution_ms:.3f}",
             d.plan.shared_buffers, f"{d.populate_seconds:.1f} + {d.vacuum_seconds:.1f}",
             f"{d.other_cores:.2f}"]
            for d in self.depths
        ]
        text_ = (
            "### 3. Claim latency at queue depth (PostgreSQL)\n\n"
            "One database per depth (`runlane_bench_depth_N`, migrated like the main one), "
            "populated with set-based SQL (`INSERT ... SELECT generate_series` into tasks, "
            "runs and run_events: status QUEUED, visible in the past, the same priority mix), "
            "then `VACUUM ANALYZE`; each holds the nominal depth plus the runs the samples "
            "take, so at least the nominal depth stays queued throughout. One process makes "
            f"{self.sizes.latency_warmup} untimed warm-up claims per database, then "
            f"{self.sizes.latency_samples} timed `store.claim(limit=1)` calls per database, "
            "each followed by `store.complete`, interleaved 25 at a time across the databases "
            "(in rotating order) so that the machine's state weighs on every depth alike. The "
            "scan columns come from EXPLAIN (ANALYZE, BUFFERS) of the claim's candidate SELECT "
            "on each database right after the samples. The depth databases are dropped at "
            "the end.\n\n"
            + table(["Queued runs", "Queued before -> after", "Samples", "claim p50 ms",
                     "claim p99 ms", "complete p50 ms", "complete p99 ms", "scan ms",
                     "scan buffers", "populate + vacuum s", "Other CPU"], rows,
                    "rrrrrrrrlrr")
            + "\n"
        )
        ratio = self._latency_ratio()
        if ratio is not None:
            low, high, value = ratio
            text_ += (f"\nRatio p50({high.depth:,}) / p50({low.depth:,}) = "
                      f"{ms(percentile(high.claim_times, 50))} / "
                      f"{ms(percentile(low.claim_times, 50))} = **{value:.2f}** "
                      f"(target <= {LATENCY_RATIO_TARGET}).\n")
        if self.depth_audit is not None:
            text_ += ("\n`store.audit()` on every depth's database after its samples: "
                      f"{self.depth_audit.label} ({self.depth_audit.seconds:.1f} s).\n")
        deepest = self.depths[-1]
        if DETAILS:
            text_ += (
                f"\nThe claim's walk of one lane (`LANE_CANDIDATES`, rendered by "
                f"`Statements('postgresql')`) at {deepest.depth:,} queued runs, in the busiest "
                "lane, parameters bound (`limit=1`, `now=NULL`, i.e. the database clock):\n\n"
                "```sql\n" + claim_candidate_sql().strip() + "\n```\n\n"
                "```text\n" + deepest.plan.custom + "\n```\n\n"
                "The same statement as a generic plan (`PREPARE` + `plan_cache_mode = "
                "force_generic_plan`), the plan a server-side prepared statement (psycopg "
                "prepares after 2 executions) may settle on:\n\n"
                "```text\n" + deepest.plan.generic + "\n```\n"
            )
        if self.cost_probes:
            rows = [
                [str(p.limit), f"{p.estimated_cost:,.0f}",
                 "yes" if p.estimated_cost > self.jit_above_cost else "no",
                 f"{p.jit_ms:.1f}" if p.jit_ms is not None else "-", f"{p.execution_ms:.2f}"]
                for p in self.cost_probes
            ]
            text_ += (
                f"\nThe planner's estimate of that scan by claim batch size at {deepest.depth:,} "
                f"queued runs, against `jit_above_cost` = {self.jit_above_cost:,.0f}: above "
                "it PostgreSQL JIT-compiles the claim on every execution (EXPLAIN ANALYZE, "
                "custom plans, rolled back):\n\n"
                + table(["Claim limit", "Estimated cost", "Over jit_above_cost", "JIT ms",
                         "Execution ms"], rows) + "\n"
            )
        return text_

    def render_method(self) -> str:
        lines = [
            "### Method and caveats",
            "",
            f"- Sizes: submit {self.sizes.submit_runs:,} runs per backend in batches of "
            f"{self.sizes.submit_batch:,} (after an untimed warm-up batch of 50); "
            f"{self.sizes.cell_runs:,} runs per claim cell; latency at "
            + ", ".join(f"{d:,}" for d in self.sizes.depths) + " queued runs.",
            "- SQLite: a file in a temp dir, the engine's WAL + synchronous=NORMAL + "
            "BEGIN IMMEDIATE; a fresh file per cell. PostgreSQL: database "
            f"`{BENCH_DATABASE}` dropped, recreated and migrated with "
            "`runlane.store.migrate.upgrade`; truncated and `VACUUM ANALYZE`d after each "
            "cell's refill (what autovacuum would do soon after).",
            "- Client and server share the machine's cores: with 4 claimers on 2 cores the "
            "claimers, PostgreSQL and the OS compete for CPU, so the 4-claimer cells measure "
            "contention as much as parallelism.",
            "- Everything runs with the store's database clock (`now=NULL`), as in production.",
            "- Other CPU: the CPU used meanwhile by processes that are not this benchmark's "
            "(other programs and other databases' PostgreSQL backends), in cores (1.00 = one "
            "of the machine's cores busy elsewhere), a lower bound read from /proc. On a "
            "shared machine a cell with a high figure measured contention, not runlane.",
            "- Logging: runlane's structured logs at WARNING on stderr (INFO lines are "
            "dropped, not formatted).",
            *[f"- {note}" for note in self.notes],
        ]
        return "\n".join(lines) + "\n"


# --- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--skip-million", action="store_true",
                        help="leave out the 1,000,000-run latency depth")
    parser.add_argument("--write", metavar="PATH", type=Path,
                        help="also write the Markdown report to PATH")
    parser.add_argument("--postgres-url", default=os.environ.get(
        "RUNLANE_BENCH_POSTGRES_URL", DEFAULT_POSTGRES_URL),
        help="a PostgreSQL server to benchmark on (any existing database on it; the "
             f"benchmark drops and recreates databases {BENCH_DATABASE!r} and "
             f"'{BENCH_DATABASE}_depth_N' there, and drops the latter at the end)")
    parser.add_argument("--repeat", type=int, default=None, metavar="N",
                        help="rounds of the submit and claim cells; the median round is "
                             "reported (default 3, 1 with --quick)")
    parser.add_argument("--note", action="append", default=[],
                        help="a line added to the report's method notes (repeatable)")
    add_details_flag(parser)
    args = parser.parse_args(argv)
    global DETAILS
    DETAILS = args.details
    configure_logging("WARNING")

    sizes = QUICK if args.quick else FULL
    repeat = max(1, args.repeat or (1 if args.quick else 3))
    depths = tuple(d for d in sizes.depths if not (args.skip_million and d >= 1_000_000))
    started = datetime.now(UTC)
    wall_start = time.perf_counter()
    report = Report(display_command(sys.argv if argv is None else ["bench/lifecycle.py",
                                                                    *argv]),
                    started, sizes, args.quick, repeat)

    pg_url = fresh_postgres(args.postgres_url)
    facts = postgres_facts(pg_url)
    load_start = load_average()
    report.environment = [
        ("Date (UTC)", f"{started:%Y-%m-%d %H:%M:%S}"),
        ("Machine", f"{os.cpu_count()} CPUs (nproc), {cpu_model()}, {memory_total()} RAM"),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("SQLite", f"{sqlite3.sqlite_version} (WAL, synchronous=NORMAL)"),
        ("PostgreSQL", f"{facts['server_version']} on the same machine; shared_buffers "
         f"{facts['shared_buffers']}, synchronous_commit {facts['synchronous_commit']}, "
         f"fsync {facts['fsync']}"),
        ("runlane", runlane_source()),
    ]
    progress(f"benchmark start ({'quick' if args.quick else 'full'}); load {load_start}")

    with tempfile.TemporaryDirectory(prefix="runlane-bench-") as tmp:
        directory = Path(tmp)
        urls = {"sqlite": fresh_sqlite(directory, "submit"), "postgresql": pg_url}

        for backend, url in urls.items():
            p50, p99 = commit_floor(url)
            report.environment.append((
                f"Write floor, {backend}",
                f"one-row INSERT + COMMIT through a runlane engine: p50 {ms(p50)} ms, "
                f"p99 {ms(p99)} ms"))
            progress(f"write floor {backend}: p50 {ms(p50)} ms, p99 {ms(p99)} ms")
        submits: dict[str, list[SubmitResult]] = {backend: [] for backend in urls}
        cells: dict[tuple[str, int, int], list[CellResult]] = {}
        for round_no in range(repeat):  # rounds, so that a noisy minute hits one round
            for backend, url in urls.items():
                submit_url = reset(backend, url, directory, f"submit-{round_no}")
                submits[backend].append(bench_submit(backend, submit_url, sizes, round_no))
            if round_no == 0:
                report.submit_profile = profile_submit(pg_url, sizes.submit_batch)
            for backend, url in urls.items():
                for batch in sizes.claim_batches:
                    for claimers in sizes.claimers:
                        cell_url = reset(backend, url, directory,
                                         f"cell-{claimers}-{batch}-{round_no}")
                        cells.setdefault((backend, claimers, batch), []).append(
                            run_cell(backend, cell_url, claimers, batch, sizes.cell_runs))
        report.submits = [median_submit(rounds) for rounds in submits.values()]
        report.cells = [median_cell(rounds) for rounds in cells.values()]

    if depths:
        report.depths, (report.jit_above_cost, report.cost_probes) = bench_depths(
            args.postgres_url, sizes, depths)
        audits: list[AuditResult] = []
        for depth in depths:
            store = Store(with_database(pg_url, f"{BENCH_DATABASE}_depth_{depth}"))
            try:
                audits.append(audit(store))
            finally:
                store.close()
            progress(f"audit at depth {depth:,}: {audits[-1].label} ({audits[-1].seconds:.1f}s)")
            drop_postgres(args.postgres_url, f"{BENCH_DATABASE}_depth_{depth}")
        report.depth_audit = combine_audits(audits)
    if args.skip_million and not args.quick:
        report.notes.append("Run with --skip-million: the 1,000,000-run depth was left out.")

    report.notes.extend(args.note)
    report.wall_seconds = time.perf_counter() - wall_start
    report.environment.append(("Load average (1/5/15 min)",
                               f"{load_start} at start, {load_average()} at end"))
    rendered = report.render()
    sys.stdout.write(rendered)
    if args.write is not None:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        merge_section(args.write, rendered, START, END)
        progress(f"wrote {args.write}")
    progress(f"done in {report.wall_seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
