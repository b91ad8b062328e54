"""runlane against its peers on one PostgreSQL server: a benchmark, issue 5.

One invocation runs the same workload through runlane, PgQueuer (asyncpg and
psycopg), Procrastinate and raw SQL baselines: N no-op jobs enqueued in batches, then
drained by C worker processes claiming up to B at a time; then submit -> claim
latency with LISTEN/NOTIFY. Rounds are interleaved (A B C A B C ...); medians are
reported with runlane's ratio to each peer. Every system gets a fresh database on
the same server per round. The peers run from a separate venv (bench/.venv-peers,
bench/requirements-peers.txt); runlane never imports them. Then SQLite with 1, 2
and 8 processes (bench/sqlite_procs.py), and a profile of runlane's claim+complete.

    .venv/bin/python bench/peers.py --write docs/benchmarks.md
    .venv/bin/python bench/peers.py --quick          # a smoke run, about two minutes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lifecycle
import sqlite_procs
from lifecycle import libpq, load_average, progress, table, with_database
from runlane.logs import configure_logging
from runlane.store.engine import PLANNER_OPTIONS

BENCH = Path(__file__).resolve().parent
WORKLOADS = BENCH / "peer_workloads"
PEER_PYTHON = BENCH / ".venv-peers" / "bin" / "python"
PY_SPY = BENCH / ".venv-peers" / "bin" / "py-spy"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
START, END = "<!-- peer-comparison:start -->", "<!-- peer-comparison:end -->"
DRAIN_TARGET = 1.5  # runlane claim+complete / PgQueuer (asyncpg)
SUBMIT_TARGET = 1.0  # runlane batch submit / PgQueuer batch enqueue
LATENCY_TARGET_MS = 5.0  # submit -> claim p50, PostgreSQL with LISTEN/NOTIFY
SQLITE_TARGET = 1_000.0  # runs/s with 2 processes


@dataclass(frozen=True)
class System:
    key: str
    label: str
    venv: str  # "runlane" or "peer"
    script: str
    args: tuple[str, ...] = ()
    role: str = "peer"  # runlane, peer, baseline, floor, prototype, variant
    migrate: bool = False  # a database migrated by runlane first (floor, prototype)
    latency: bool = True
    jobs_divisor: int = 1  # a slow variant drains N / divisor jobs


SYSTEMS = (
    System("runlane", "runlane", "runlane", "runlane_driver.py", role="runlane"),
    System("pgqueuer-asyncpg", "PgQueuer (asyncpg)", "peer", "pgqueuer_driver.py",
           ("--driver", "asyncpg")),
    System("pgqueuer-psycopg", "PgQueuer (psycopg)", "peer", "pgqueuer_driver.py",
           ("--driver", "psycopg")),
    System("procrastinate", "Procrastinate", "peer", "procrastinate_driver.py"),
    System("raw", "raw SQL, one table", "peer", "raw_sql_driver.py", ("--shape", "minimal"),
           role="baseline"),
    System("runlane-stages", "runlane, worker stages", "runlane", "runlane_driver.py",
           ("--stages", "worker"), role="variant", latency=False, jobs_divisor=4),
    System("floor", "runlane's rows, no scheduling (raw SQL floor)", "peer",
           "raw_sql_driver.py", ("--shape", "runlane-batch"), role="floor", migrate=True,
           latency=False),
    System("proto", "prototype: runlane rows, 1 statement per claim and per complete",
           "peer", "raw_sql_driver.py", ("--shape", "runlane"), role="prototype",
           migrate=True, latency=False),
)
PEERS = ("pgqueuer-asyncpg", "pgqueuer-psycopg", "procrastinate", "raw")


@dataclass(frozen=True)
class Sizes:
    jobs: int
    submit_batch: int
    claim_batch: int
    concurrency: int
    latency_samples: int
    profile_jobs: int
    sqlite_jobs: int
    sqlite_procs: tuple[int, ...]


FULL = Sizes(jobs=20_000, submit_batch=1_000, claim_batch=10, concurrency=2,
             latency_samples=200, profile_jobs=5_000, sqlite_jobs=10_000,
             sqlite_procs=(1, 2, 8))
QUICK = Sizes(jobs=1_000, submit_batch=250, claim_batch=10, concurrency=2, latency_samples=30,
              profile_jobs=1_000, sqlite_jobs=1_000, sqlite_procs=(1, 2, 8))


# --- running the drivers -------------------------------------------------------------------


def python_for(system: System) -> str:
    return sys.executable if system.venv == "runlane" else str(PEER_PYTHON)


def create_database(admin_url: str, name: str) -> str:
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return libpq(with_database(admin_url, name))


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(libpq(admin_url), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def run_driver(python: str, script: str, args: Sequence[str], *, timeout: float = 3600.0,
               prefix: Sequence[str] = ()) -> dict[str, Any]:
    """Run one driver; its last stdout line is its JSON figures."""
    command = [*prefix, python, str(WORKLOADS / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          cwd=BENCH.parent, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{script} {' '.join(args)} failed ({done.returncode}):\n"
                         + done.stderr[-3000:])
    figures: dict[str, Any] = json.loads(lines[-1])
    figures["stderr"] = done.stderr
    return figures


def run_system(system: System, admin_url: str, sizes: Sizes, round_no: int) -> dict[str, Any]:
    name = f"bench_peers_{os.getpid()}_{system.key.replace('-', '_')}"
    dsn = create_database(admin_url, name)
    try:
        if system.migrate:
            lifecycle.migrate(dsn)
        load = load_average()
        floor = commit_floor(dsn)
        other = OtherCpu(name)
        started = time.monotonic()
        jobs = sizes.jobs // system.jobs_divisor
        figures = run_driver(python_for(system), system.script, [
            "--dsn", dsn, "--jobs", str(jobs), "--submit-batch", str(sizes.submit_batch),
            "--claim-batch", str(sizes.claim_batch), "--concurrency", str(sizes.concurrency),
            "--latency-samples", str(sizes.latency_samples if system.latency else 0),
            *system.args])
        figures["wall_seconds"] = time.monotonic() - started
        figures["other_cores"] = other.cores()
        figures["load"] = load
        figures["commit_floor_ms"] = floor
        figures["round"] = round_no
    finally:
        drop_database(admin_url, name)
    drain = figures["drain"]
    progress(f"round {round_no + 1} {system.key}: drain {drain['rate']:,.0f}/s "
             f"({drain['done']}/{drain['jobs']}, errors {drain['errors']})"
             + (f", enqueue {figures['enqueue']['rate']:,.0f}/s" if "enqueue" in figures else "")
             + (f", latency p50 {figures['latency']['p50_ms']:.2f} ms"
                if "latency" in figures else "")
             + (f", audit {figures['audit']['violations']} violations"
                if "audit" in figures else "")
             + f", other CPU {figures['other_cores']:.2f} cores, load {load}, "
             f"commit floor {floor:.2f} ms")
    return figures


def commit_floor(dsn: str, samples: int = 60) -> float:
    """p50 ms of a one-row INSERT + COMMIT in a logged scratch table: the WAL flush under
    every commit, which other programs' commits on the same server slow down."""
    times = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_floor (i integer)")
        for i in range(samples + 10):
            started = time.perf_counter()
            with conn.transaction():
                conn.execute("INSERT INTO bench_floor VALUES (%s)", (i,))
            if i >= 10:
                times.append(time.perf_counter() - started)
        conn.execute("DROP TABLE bench_floor")
    return statistics.median(times) * 1000


class OtherCpu:
    """CPU used meanwhile by processes that are neither ours nor our database's backends,
    in cores (a lower bound, read from /proc)."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.started = time.monotonic()
        self.before = self._foreign()

    def _foreign(self) -> dict[int, float]:
        table_ = lifecycle._processes()
        me = os.getpid()

        def ours(pid: int) -> bool:
            seen = 0
            while pid > 1 and seen < 64:
                if pid == me:
                    return True
                pid, seen = table_[pid][0] if pid in table_ else 0, seen + 1
            return False

        return {pid: cpu for pid, (_, cpu, command) in table_.items()
                if not ours(pid) and f" {self.database} " not in f" {command} "
                and not (command.startswith("postgres:")
                         and any(n in command for n in lifecycle.POSTGRES_SHARED))}

    def cores(self) -> float:
        after = self._foreign()
        used = sum(cpu - self.before.get(pid, 0.0) for pid, cpu in after.items())
        elapsed = time.monotonic() - self.started
        return max(used, 0.0) / elapsed if elapsed > 0 else 0.0


# --- summaries ------------------------------------------------------------------------------


def get(figures: dict[str, Any], path: str) -> float | None:
    value: Any = figures
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, int | float) else None


def median_of(rounds: Sequence[dict[str, Any]], path: str) -> float | None:
    values = [v for v in (get(r, path) for r in rounds) if v is not None and v == v]
    return float(statistics.median(values)) if values else None


def fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    if value is None or value != value:
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def by_round(rounds: Sequence[dict[str, Any]], path: str, digits: int = 0) -> str:
    return " / ".join(fmt(get(r, path), digits) for r in rounds)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def statements_per_job(figures: dict[str, Any]) -> float | None:
    workers = figures["drain"].get("workers", [])
    if not workers or "statements" not in workers[0]:
        return None
    done = max(int(figures["drain"]["done"]), 1)
    return float(sum(w["statements"] for w in workers)) / done


# --- profile of runlane's claim + complete ---------------------------------------------------


def parse_traces(directory: Path) -> dict[str, float]:
    """Round trips and protocol messages in libpq traces: a round trip is a burst of
    frontend messages followed by the backend's answer."""
    counts: Counter[str] = Counter()
    for path in directory.glob("*.trace"):
        previous = ""
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) < 3:
                continue
            side, kind = parts[0], parts[2]
            if side == "B" and previous == "F":
                counts["round_trips"] += 1
            if side == "F":
                counts[f"F:{kind}"] += 1
                if kind == "Query":
                    text_ = parts[3] if len(parts) > 3 else ""
                    word = text_.strip(' "').split(" ")[0].upper()
                    counts[f"Query:{word}"] += 1
            previous = side if side in ("F", "B") else previous
    return dict(counts)


def profile_round_trips(admin_url: str, sizes: Sizes, stages: str) -> dict[str, Any]:
    name = f"bench_peers_{os.getpid()}_trace"
    dsn = create_database(admin_url, name)
    directory = Path(tempfile.mkdtemp(prefix="runlane-trace-"))
    try:
        figures = run_driver(sys.executable, "runlane_driver.py", [
            "--dsn", dsn, "--jobs", str(min(sizes.jobs, 2_000)), "--submit-batch", "1000",
            "--claim-batch", str(sizes.claim_batch), "--concurrency", "1",
            "--latency-samples", "0", "--stages", stages, "--trace-dir", str(directory)])
        counts = parse_traces(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        drop_database(admin_url, name)
    done = max(figures["drain"]["done"], 1)
    worker = figures["drain"]["workers"][0]
    return {
        "stages": stages, "runs": done,
        "round_trips": counts.get("round_trips", 0) / done,
        "statements": worker["statements"] / done, "commits": worker["commits"] / done,
        "extended": counts.get("F:Execute", 0) / done,
        "begin": counts.get("Query:BEGIN", 0) / done,
        "commit": counts.get("Query:COMMIT", 0) / done,
        "simple_other": sum(v for k, v in counts.items() if k.startswith("Query:")
                            and k not in ("Query:BEGIN", "Query:COMMIT")) / done,
    }


def classify(stack: list[str]) -> str:
    """The category of one sampled stack (leaf last): where its time goes."""
    for frame in reversed(stack):
        function, _, where = frame.partition(" (")
        if "psycopg" in where and function.rsplit(".", 1)[-1].startswith("wait"):
            return "waiting on PostgreSQL (socket: round trips, server, commit flush)"
        if "psycopg" in where:
            return "psycopg (Python side)"
        if "sqlalchemy" in where:
            return "SQLAlchemy"
        if "structlog" in where:
            return "structlog"
        if "/runlane/" in where:
            return "runlane"
    return "other (interpreter, stdlib)"


def profile_pyspy(admin_url: str, sizes: Sizes) -> dict[str, Any] | None:
    if not PY_SPY.exists():
        return None
    name = f"bench_peers_{os.getpid()}_pyspy"
    dsn = create_database(admin_url, name)
    out = Path(tempfile.mkdtemp(prefix="runlane-pyspy-")) / "samples.txt"
    try:
        figures = run_driver(sys.executable, "runlane_driver.py", [
            "--dsn", dsn, "--jobs", str(min(sizes.jobs, 5_000)), "--submit-batch", "1000",
            "--claim-batch", str(sizes.claim_batch), "--concurrency", "1",
            "--latency-samples", "0"],
            prefix=[str(PY_SPY), "record", "--subprocesses", "--idle", "--rate", "200",
                    "--format", "raw", "--output", str(out), "--"])
        samples: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for line in out.read_text().splitlines():
            stack_text, _, count_text = line.rpartition(" ")
            if "drain_worker" not in stack_text or not count_text.isdigit():
                continue
            stack = stack_text.split(";")
            samples[classify(stack)] += int(count_text)
            leaf = stack[-1]
            own[re.sub(r"\s+\(.*?([^/]+/[^/]+\.py):\d+\)", r" (\1)", leaf)] += int(count_text)
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
        drop_database(admin_url, name)
    total = sum(samples.values()) or 1
    return {"rate": figures["drain"]["rate"], "samples": total,
            "shares": {k: v / total for k, v in samples.most_common()},
            "top": [(k, v / total) for k, v in own.most_common(12)]}


def profile_explain(admin_url: str, sizes: Sizes) -> dict[str, Any]:
    name = f"bench_peers_{os.getpid()}_explain"
    dsn = create_database(admin_url, name)
    try:
        return run_driver(sys.executable, "runlane_driver.py", [
            "--dsn", dsn, "--jobs", str(sizes.profile_jobs), "--claim-batch",
            str(sizes.claim_batch), "--explain"])
    finally:
        drop_database(admin_url, name)


# --- environment ---------------------------------------------------------------------------


def lscpu() -> tuple[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return lifecycle.cpu_model(), str(os.cpu_count())
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", lifecycle.cpu_model()).strip()
    return model, fields.get("CPU(s)", str(os.cpu_count())).strip()


def postgres_settings(url: str) -> dict[str, str]:
    names = ("server_version", "shared_buffers", "synchronous_commit", "fsync", "wal_level",
             "autovacuum", "jit", "max_connections", "work_mem", "max_wal_size",
             "checkpoint_timeout")
    with psycopg.connect(libpq(url)) as conn:
        return {n: str(conn.execute(f"SHOW {n}").fetchone()[0])  # type: ignore[index]
                for n in names}


# --- the report ----------------------------------------------------------------------------


@dataclass
class Report:
    command: str
    started: datetime
    sizes: Sizes
    repeat: int
    environment: list[tuple[str, str]]
    rounds: dict[str, list[dict[str, Any]]]
    sqlite: list[dict[str, Any]]
    traces: list[dict[str, Any]]
    pyspy: dict[str, Any] | None
    explained: dict[str, Any] | None
    notes: list[str]
    wall_seconds: float = 0.0

    def system(self, key: str) -> System:
        return next(s for s in SYSTEMS if s.key == key)

    def med(self, key: str, path: str) -> float | None:
        return median_of(self.rounds.get(key, []), path)

    def render(self) -> str:
        s = self.sizes
        parts = [
            START, "", "## Peer comparison: `bench/peers.py`", "",
            f"Produced by `{self.command}` on {self.started:%Y-%m-%d %H:%M} UTC; the whole "
            f"run took {self.wall_seconds / 60:.1f} min of wall time. Regenerate with `make "
            "bench` (after the lifecycle benchmark) or `make bench-peers`; every figure and "
            "ratio below comes from that one run.", "",
            table(["", ""], self.environment, "ll"), "",
            "### Workload", "",
            f"Each system, on its own fresh database of the same server: {s.jobs:,} no-op "
            f"jobs enqueued in batches of {s.submit_batch:,} by one process (timed per "
            f"batch; payloads built untimed), then drained by {s.concurrency} worker "
            f"processes (spawned and connected before a barrier releases them) that claim up "
            f"to {s.claim_batch} jobs at a time and complete each, until a claim comes back "
            "empty; the clock runs from the barrier to the last completion. Then submit -> "
            f"claim latency: one idle worker woken by LISTEN/NOTIFY, {s.latency_samples} jobs "
            "submitted one at a time 20 ms apart, measured from the submit call to the job "
            f"in the worker's hands. {self.repeat} rounds, interleaved (every system once per "
            "round, in the same order); each figure is the median of the rounds, with every "
            "round shown. Statistics: this server runs with autovacuum off, so before each "
            "drain every table that autovacuum's analyze rule would pick after the enqueue "
            "(rows changed > autovacuum_analyze_threshold + autovacuum_analyze_scale_factor "
            "x rows) is ANALYZEd, for every system alike: the state a default server reaches "
            "within a minute of a bulk enqueue. Tables not yet written (runlane's attempts) "
            "keep no statistics, as they would.", "",
            "- runlane: `Store.submit` of TaskSpecs (8 tenants, no idempotency key); each "
            "worker loops `Store.claim(limit=B)` and completes each claimed batch with one "
            "`Store.complete_many(leases)` (CLAIMED -> FINALIZING -> SUCCEEDED, one "
            "transaction per batch: one statement of data-modifying CTEs, "
            "COMPLETE_WRITE_PG). *runlane, worker "
            "stages* also walks the stages a real worker's no-op attempt takes (`advance` "
            "to PREPARING_SANDBOX, RUNNING, FINALIZING, then `complete_many`). Latency: "
            "`runlane.store.wakeup.Listener`, then `claim(limit=1)`.",
            "- PgQueuer: `Queries.enqueue` with lists; per worker a `QueueManager` with a "
            "no-op entrypoint, `run(batch_size=B, mode=drain)`; durable (logged) tables, "
            "its default. Its completions are buffered and written B at a time.",
            "- Procrastinate: `batch_defer_async`; per worker `run_worker_async(wait=False, "
            "concurrency=B)` (it fetches one job per call); jobs kept (`delete_jobs=never`, "
            "the default).",
            "- raw SQL, one table: psycopg, autocommit; claim = one `UPDATE ... WHERE id IN "
            "(SELECT ... FOR UPDATE SKIP LOCKED LIMIT B) RETURNING`, complete = one UPDATE "
            "per job. The floor for this shape of loop.",
        ]
        if self.keys(("floor", "prototype")):
            parts += [
                "- runlane's rows, no scheduling (bench/peer_workloads/raw_sql_driver.py "
                "`--shape runlane-batch`, not runlane code): on runlane's schema (migrated "
                "by runlane), psycopg, autocommit, the rows runlane's data model requires "
                "and nothing else. Enqueue: one statement per batch writes each run's task, "
                "run and event (ids made by the client; no admission, lane counts or "
                "idempotency). Claim: one statement walks one lane (`ix_runs_lane_dispatch`, "
                "the tenants' lanes in turn) and writes the run's compare-and-set with its "
                "fencing token, the attempt with its lease and the event; complete: one "
                "statement per claimed batch, fenced on the live lease, the run and attempt "
                "ended, two events. No lane counts or passes, no limit counters, no policy, "
                "no Python per run. The most runlane's data model allows on this server: "
                "what the rows and the invariants cost before any scheduling."
                + (" *prototype* (`--systems proto`): the same, completing each run in its "
                   "own statement." if self.keys(("prototype",)) else ""), ""]
        parts.append("")
        parts += self.render_drain() + self.render_enqueue() + self.render_latency()
        parts += self.render_targets() + self.render_sqlite() + self.render_profile()
        parts += self.render_analysis()
        parts += ["### Notes", "", *[f"- {n}" for n in self.notes], "", END, ""]
        return "\n".join(parts)

    def keys(self, roles: Sequence[str]) -> list[str]:
        return [s.key for s in SYSTEMS if s.role in roles and s.key in self.rounds]

    def render_drain(self) -> list[str]:
        base = self.med("runlane", "drain.rate")
        rows = []
        for key in self.keys(("runlane", "peer", "baseline", "floor", "variant", "prototype")):
            rounds = self.rounds[key]
            rate = self.med(key, "drain.rate")
            statements = [v for v in (statements_per_job(r) for r in rounds) if v is not None]
            errors = sum(int(r["drain"]["errors"]) for r in rounds)
            lost = sum(int(r["drain"]["jobs"]) - int(r["drain"]["done"]) for r in rounds)
            rows.append([
                self.system(key).label, fmt(rate), by_round(rounds, "drain.rate"),
                "1.00x" if key == "runlane" else fmt(ratio(base, rate), 2, "x"),
                fmt(self.med(key, "drain.client_cpu_ms_per_job"), 3),
                fmt(self.med(key, "drain.db_cpu_ms_per_job"), 3),
                fmt(statistics.median(statements), 2) if statements else "-",
                fmt(self.med(key, "drain.worker_rss_mb"), 0),
                f"{errors} / {lost}", fmt(self.med(key, "other_cores"), 2),
                by_round(rounds, "commit_floor_ms", 2),
            ])
        return [
            "### Claim + complete (drain)", "",
            table(["System", "Jobs/s", "Jobs/s by round", "runlane / system",
                   "Client CPU ms/job", "DB CPU ms/job", "Statements/job",
                   "Worker peak RSS MiB", "Errors / lost", "Other CPU",
                   "Commit floor ms by round"], rows, "lrrrrrrrrrr"),
            "",
            "Client CPU: the worker processes' own CPU time; DB CPU: that of the PostgreSQL "
            "server processes serving the system's database (sampled every 50 ms from "
            "/proc); both divided by the jobs completed (the machine's cores give 1,000 "
            "CPU-ms per second each). Statements/job: statements the workers sent "
            "(runlane: SQLAlchemy executes, an executemany counted once; PgQueuer: driver "
            "calls; raw: executes), BEGIN/COMMIT and pings not included. Other CPU: cores "
            "used meanwhile by processes that are not the benchmark's (a lower bound: "
            "short-lived processes are missed). Commit floor: p50 of a one-row INSERT + "
            "COMMIT on the same server just before the system's run; it rises when other "
            "programs commit on the server (the WAL flush is shared). *runlane, worker "
            "stages* drains N/4 jobs.", "",
            *self.render_audits(),
        ]

    def render_audits(self) -> list[str]:
        """runlane's ``Store.audit()`` after each round (drain and latency included)."""
        lines = []
        for key in self.keys(("runlane", "variant")):
            audits = [r["audit"] for r in self.rounds[key] if "audit" in r]
            if not audits:
                continue
            found = sum(int(a["violations"]) for a in audits)
            first = next((a["first"] for a in audits if a["first"]), "")
            verdict = "clean" if not found else f"**{found} violations** (first: {first})"
            lines.append(f"- {self.system(key).label}: `Store.audit()` on the database "
                         f"after each of its {len(audits)} rounds: {verdict}.")
        return [*lines, ""] if lines else []

    def render_enqueue(self) -> list[str]:
        base = self.med("runlane", "enqueue.rate")
        rows = []
        for key in self.keys(("runlane", "peer", "baseline", "floor")):
            rounds = self.rounds[key]
            rate = self.med(key, "enqueue.rate")
            rows.append([
                self.system(key).label, fmt(rate), by_round(rounds, "enqueue.rate"),
                "1.00x" if key == "runlane" else fmt(ratio(base, rate), 2, "x"),
                fmt(self.med(key, "enqueue.batch_p50_ms"), 1),
                fmt(self.med(key, "enqueue.batch_p99_ms"), 1),
            ])
        return ["### Batch enqueue", "",
                table(["System", "Jobs/s", "Jobs/s by round", "runlane / system",
                       "Batch p50 ms", "Batch p99 ms"], rows, "lrrrrr"), ""]

    def render_latency(self) -> list[str]:
        rows = []
        for key in self.keys(("runlane", "peer", "baseline")):
            rounds = [r for r in self.rounds[key] if "latency" in r]
            if not rounds:
                continue
            rows.append([
                self.system(key).label, fmt(median_of(rounds, "latency.p50_ms"), 2),
                by_round(rounds, "latency.p50_ms", 2),
                fmt(median_of(rounds, "latency.p99_ms"), 2),
                fmt(median_of(rounds, "latency.submit_call_p50_ms"), 2),
                fmt(median_of(rounds, "latency.after_submit_p50_ms"), 2),
                f"{sum(int(r['latency']['samples']) for r in rounds)} / "
                f"{sum(int(r['latency']['missing']) for r in rounds)}",
            ])
        return ["### Submit -> claim latency (LISTEN/NOTIFY)", "",
                table(["System", "p50 ms", "p50 ms by round", "p99 ms", "Submit call p50 ms",
                       "From submit return, p50 ms", "Samples / missing"], rows, "lrrrrrr"),
                "",
                "p50 and p99: from the submit call to the job in the worker's hands (runlane: "
                "`claim` returned it; peers: their handler started). *From submit return*: "
                "the same, less the submit call itself (wake-up + claim).", ""]

    def render_targets(self) -> list[str]:
        drain = ratio(self.med("runlane", "drain.rate"), self.med("pgqueuer-asyncpg",
                                                                    "drain.rate"))
        submit = ratio(self.med("runlane", "enqueue.rate"),
                       self.med("pgqueuer-asyncpg", "enqueue.rate"))
        latency = self.med("runlane", "latency.p50_ms")
        sqlite2 = next((c["rate"] for c in self.sqlite if c["processes"] == 2), None)

        def verdict(value: float | None, target: float, higher: bool = True) -> str:
            if value is None:
                return "not measured"
            met = value >= target if higher else value <= target
            if met:
                return "met"
            gap = target / value if higher else value / target
            return f"**missed** ({gap:.1f}x short)"

        floor_drain = ratio(self.med("floor", "drain.rate"),
                            self.med("pgqueuer-asyncpg", "drain.rate"))
        floor_submit = ratio(self.med("floor", "enqueue.rate"),
                             self.med("pgqueuer-asyncpg", "enqueue.rate"))
        rows = [
            ["runlane claim+complete / PgQueuer (asyncpg), same concurrency",
             f">= {DRAIN_TARGET:.1f}x", fmt(drain, 2, "x"), verdict(drain, DRAIN_TARGET)],
            *([["(bound) runlane's rows, no scheduling / PgQueuer (asyncpg), same "
                "concurrency", f">= {DRAIN_TARGET:.1f}x", fmt(floor_drain, 2, "x"),
                verdict(floor_drain, DRAIN_TARGET)]] if floor_drain is not None else []),
            ["runlane batch submit / PgQueuer batch enqueue", f">= {SUBMIT_TARGET:.1f}x",
             fmt(submit, 2, "x"), verdict(submit, SUBMIT_TARGET)],
            *([["(bound) runlane's rows, no scheduling: batch enqueue / PgQueuer's",
                f">= {SUBMIT_TARGET:.1f}x", fmt(floor_submit, 2, "x"),
                verdict(floor_submit, SUBMIT_TARGET)]] if floor_submit is not None else []),
            ["runlane submit -> claim p50, PostgreSQL, LISTEN/NOTIFY",
             f"<= {LATENCY_TARGET_MS:.0f} ms", fmt(latency, 2, " ms"),
             verdict(latency, LATENCY_TARGET_MS, higher=False)],
            ["runlane SQLite claim+complete, 2 processes", f">= {SQLITE_TARGET:,.0f} runs/s",
             fmt(sqlite2, 0, " runs/s"), verdict(sqlite2, SQLITE_TARGET)],
        ]
        return ["### Targets", "", table(["What", "Target", "Measured (medians)", ""], rows,
                                         "lrrl"), "",
                *(["(bound): the same ratio for the raw SQL loop that writes only the rows "
                   "runlane's data model requires (Workload). runlane cannot beat it with "
                   "those rows on this server: where the bound misses a target, so must "
                   "runlane, and the gap between runlane and the bound is what its own "
                   "code costs.", ""] if floor_drain is not None else [])]

    def render_sqlite(self) -> list[str]:
        if not self.sqlite:
            return []
        return ["### SQLite: 1, 2 and 8 processes", "", sqlite_procs.render(self.sqlite), ""]

    def render_profile(self) -> list[str]:
        out = ["### Where runlane's claim + complete spends its time", ""]
        if self.traces:
            rows = [[t["stages"], f"{t['runs']:,}", fmt(t["round_trips"], 2),
                     fmt(t["statements"], 2), fmt(t["extended"], 2), fmt(t["begin"], 2),
                     fmt(t["commit"], 2), fmt(t["simple_other"], 2), fmt(t["commits"], 2)]
                    for t in self.traces]
            out += [
                f"Per run, one worker process, claim batch {self.sizes.claim_batch}, counted "
                "in libpq's protocol trace of every connection (a round trip = a burst of "
                "client messages answered by the server) and in SQLAlchemy's events:", "",
                table(["Path", "Runs", "Round trips", "Statements", "Extended-protocol "
                       "executes", "BEGIN", "COMMIT", "Other simple queries (pings, ...)",
                       "Transactions"], rows, "lrrrrrrrr"), ""]
        if self.explained and lifecycle.DETAILS:
            e = self.explained
            batch = e["batch"]
            rows = []
            totals: dict[str, list[float]] = {}
            for name, st in sorted(e["statements"].items()):
                phase, _, statement = name.partition("|")
                if statement.startswith("SET auto_explain"):
                    continue
                runs = max(e["sampled"].get(phase, 1), 1)
                calls, executions = st["client_calls"] / runs, st["server_executions"] / runs
                wall = calls * st["client_p50_ms"]
                server = executions * st["server_p50_ms"]
                total = totals.setdefault(phase, [0.0, 0.0, 0.0])
                total[0] += calls
                total[1] += wall if wall == wall else 0.0
                total[2] += server if server == server else 0.0
                rows.append([phase, statement, fmt(calls, 2), fmt(st["client_p50_ms"], 3),
                             fmt(wall, 3), fmt(executions, 2), fmt(st["server_p50_ms"], 3),
                             fmt(server, 3)])
            for phase, (calls, wall, server) in totals.items():
                rows.append([phase, "**all statements**", fmt(calls, 2), "", fmt(wall, 3), "",
                             "", fmt(server, 3)])
            out += [
                f"Each statement of claim (limit {batch}) + complete, one process, "
                f"{e['runs']:,} queued runs, sampled over the first "
                f"{e['sampled'].get('first', 0)} runs and the last "
                f"{e['sampled'].get('last', 0)} runs of the drain. Client: SQLAlchemy's "
                "execute as the store calls it (driver, network and server; an executemany is "
                "one call); server: the executor's time per execution from auto_explain "
                "(ANALYZE, BUFFERS, sent to the session as notices). Not in either: the "
                "BEGIN, COMMIT and ping round trips of each transaction (see the table above). "
                f"A SELECT 1 round trip here: p50 {e['select1_p50_ms']:.3f} ms; a one-row "
                f"INSERT + COMMIT: p50 {e['commit_p50_ms']:.3f} ms.", "",
                table(["Sample", "Statement", "Calls/run", "Client p50 ms", "Client ms/run",
                       "Server executions/run", "Server p50 ms", "Server ms/run"],
                      rows, "llrrrrrr"), ""]
            plans = {n: st["plan"] for n, st in e["statements"].items()
                     if n.startswith("last|") and st["plan"]}
            if plans:
                out += ["Plans at the end of the drain (auto_explain, compact):", "", "```text"]
                for name, plan in sorted(plans.items()):
                    out += [f"-- {name.partition('|')[2]}", plan]
                out += ["```", ""]
        if self.pyspy and lifecycle.DETAILS:
            p = self.pyspy
            rows = [[k, f"{v * 100:.1f}%"] for k, v in p["shares"].items()]
            top = [[k, f"{v * 100:.1f}%"] for k, v in p["top"]]
            out += [
                f"py-spy (200 Hz, idle samples included) of one worker draining "
                f"{min(self.sizes.jobs, 5_000):,} runs ({p['rate']:,.0f} runs/s under the "
                f"profiler), {p['samples']:,} samples: each sample is charged to the "
                "innermost frame of runlane, SQLAlchemy, psycopg or structlog on its stack.",
                "", table(["Where", "Share of the worker's wall time"], rows, "lr"), "",
                table(["Innermost frame", "Share"], top, "lr"), ""]
        return out


    def render_analysis(self) -> list[str]:
        """What costs what, and what would close the gap: the figures of this run put
        together (the reasoning is fixed text about the current statements; every
        number comes from above)."""
        run = self.med("runlane", "drain.rate")
        pgq = self.med("pgqueuer-asyncpg", "drain.rate")
        floor = self.med("floor", "drain.rate")
        stages = self.med("runlane-stages", "drain.rate")
        direct = next((t for t in self.traces if t["stages"] == "direct"), None)
        if run is None or pgq is None or direct is None:
            return []

        def spj(key: str) -> str:
            values = [v for v in (statements_per_job(r) for r in self.rounds.get(key, []))
                      if v is not None]
            return fmt(statistics.median(values), 2) if values else "-"

        def x(a: float | None, b: float | None) -> str:
            return fmt(ratio(a, b), 1, "x")

        def cpu(key: str, side: str) -> str:
            return fmt(self.med(key, f"drain.{side}_cpu_ms_per_job"), 2)

        b = self.sizes.claim_batch
        lines = [
            "### What costs what, and what would close the gap", "",
            f"- **Round trips.** runlane's claim+complete costs {direct['round_trips']:.1f} "
            f"round trips per run (traced). A claim of up to {b} is a transaction of two "
            "statements (`PICK_AND_WALK_PG`: the page of lanes and each lane's runs, locked; "
            "`CLAIM_WRITE_PG`: slots, compare-and-set, attempts, events, lanes) between "
            "BEGIN and COMMIT; the batch's completion is one autocommit statement "
            f"(`COMPLETE_WRITE_PG`). runlane sends {spj('runlane')} statements per job, "
            f"PgQueuer {spj('pgqueuer-asyncpg')} (one dequeue per batch, completions "
            f"buffered and written B at a time), the one-table raw loop {spj('raw')}.",
            f"- **Transactions.** runlane commits {direct['commits']:.2f} times per run (each "
            "a WAL flush with synchronous_commit on); PgQueuer about 2/B.",
            f"- **CPU per job.** runlane client {cpu('runlane', 'client')} ms and server "
            f"{cpu('runlane', 'db')} ms; PgQueuer (asyncpg) {cpu('pgqueuer-asyncpg', 'client')}"
            f" and {cpu('pgqueuer-asyncpg', 'db')} ms. With clients and server on the same 2 "
            "cores, the sum bounds the rate: this, not the number of round trips, is the gap.",
        ]
        if self.explained:
            last = {k.partition("|")[2]: v for k, v in self.explained["statements"].items()
                    if k.startswith("last|")}
            runs = max(self.explained["sampled"].get("last", 1), 1)
            server = sum(v["server_executions"] / runs * v["server_p50_ms"]
                         for v in last.values() if v["server_p50_ms"] == v["server_p50_ms"])
            client = sum(v["client_calls"] / runs * v["client_p50_ms"]
                         for v in last.values() if v["client_p50_ms"] == v["client_p50_ms"])
            lines.append(
                f"- **Server vs client.** Of the {client:.2f} ms per run that one worker "
                f"spends inside the store's statements, the executor needs {server:.2f} ms "
                "(auto_explain); the rest is planning, round-trip latency, parse/bind, "
                "and Python on both ends.")
        if self.pyspy:
            shares = self.pyspy["shares"]
            waiting = sum(v for k, v in shares.items() if k.startswith("waiting"))
            lines.append(
                f"- **Python.** py-spy: a worker spends {waiting * 100:.0f}% of its wall time "
                "waiting on the socket, SQLAlchemy "
                f"{shares.get('SQLAlchemy', 0) * 100:.0f}%, psycopg's Python side "
                f"{shares.get('psycopg (Python side)', 0) * 100:.0f}%, runlane's own code "
                f"{shares.get('runlane', 0) * 100:.0f}%, structlog "
                f"{shares.get('structlog', 0) * 100:.0f}%.")
        lines += [
            f"- **Worker stages.** A real worker's no-op run also `advance`s through "
            f"PREPARING_SANDBOX, RUNNING and FINALIZING: "
            f"{next((t['round_trips'] for t in self.traces if t['stages'] == 'worker'), 0):.1f}"
            f" round trips per run, {fmt(stages)} runs/s ({x(run, stages)} slower than "
            "claim -> complete). For real agent runs (minutes each) this is noise; it only "
            "matters for this benchmark.",
            *([f"- **The bound.** The raw SQL loop that writes only runlane's rows "
               f"(Workload) drains {fmt(floor)} jobs/s, {fmt(ratio(floor, pgq), 2, 'x')} "
               f"PgQueuer (asyncpg), with server CPU {cpu('floor', 'db')} ms per job against "
               f"PgQueuer's {cpu('pgqueuer-asyncpg', 'db')} and client CPU "
               f"{cpu('floor', 'client')}. runlane reaches {fmt(ratio(run, floor), 2, 'x')} "
               "of it: the rest of runlane's gap is its scheduling (lane counts and passes, "
               "limit counters, admission at claim) and its Python; the part of the gap to "
               "the target that the bound itself leaves is the data model's (an attempt, "
               "three events and two non-HOT run updates per run against PgQueuer's one "
               "row)."] if floor is not None else []), "",
            "What would close the drain gap, by expected gain:", "",
            "1. **Fewer rows written per run.** A run costs the server an attempt inserted "
            "and updated, three events (CLAIMED, FINALIZING, SUCCEEDED), two updates of "
            "the run row that touch indexed columns (no HOT update: `status` is in the "
            "dispatch index's predicate), lane and counter updates; PgQueuer writes one "
            "row and logs one. The foreign-key checks per attempt, event and run are gone "
            "(migration 0007, 2026-12-01). Folding the events of a completion into the "
            "attempt row is the schema decision left; the audit trail and the fault "
            "harness's checks read those events.",
            "2. **Planning.** Until the night of 2026-11-30 the claim's pick was planned "
            "on every claim (its generic plan costed the served routes at 10, so "
            "PostgreSQL kept custom plans): 0.5-0.7 ms of server time per claim. Its "
            "generic plan now wins (the routes LIMITed to the array's length); a run of "
            "an older commit still pays it. The claim's other statements settle on "
            "generic plans already; forcing them for everything lost.",
            "3. **Client CPU.** The hot statements on the DBAPI cursor instead of "
            "SQLAlchemy `text()` execution (about 140 -> 65 us of CPU per statement, "
            "measured on the pick), and fewer objects per lease.", "",
            "Submit: one autocommit statement per batch (`SUBMIT_WRITE_PG`: tasks, routes, "
            "lanes, runs and the submission events as data-modifying CTEs, the policy "
            "version checked inside), one round trip; PgQueuer inserts one row per job. "
            "The server's share per 1,000 runs is the three inserts with their indexes "
            "and two foreign-key triggers per run; the client's is admission and ids per "
            "spec. Latency: the submit call is "
            f"{fmt(self.med('runlane', 'latency.submit_call_p50_ms'), 2)} ms p50 here, then "
            "the NOTIFY wakes the worker and its claim runs (about as long again); the raw "
            f"loop's whole submit -> claim is {fmt(self.med('raw', 'latency.p50_ms'), 2)} ms.",
            ""]
        return lines


def merge_section(path: Path, section: str) -> None:
    """Put the section in the file: replace the previous one, or append it."""
    existing = path.read_text() if path.exists() else ""
    if START in existing and END in existing:
        head, _, rest = existing.partition(START)
        _, _, tail = rest.partition(END)
        updated = head.rstrip() + "\n\n" + section.rstrip() + "\n" + tail.lstrip("\n")
    else:
        updated = existing.rstrip() + "\n\n" + section.rstrip() + "\n"
    path.write_text(updated)


# --- main ----------------------------------------------------------------------------------


def rerender(path: Path, write: Path | None, notes: list[str]) -> int:
    data = json.loads(path.read_text())
    sizes = Sizes(**{**data["sizes"], "sqlite_procs": tuple(data["sizes"]["sqlite_procs"])})
    report = Report(data["command"], datetime.fromisoformat(data["started"]), sizes,
                    data["repeat"], [tuple(e) for e in data["environment"]], data["rounds"],
                    data["sqlite"], data["traces"], data["pyspy"], data["explain"],
                    [*data.get("notes", []), *notes])
    report.wall_seconds = data["wall_seconds"]
    section = report.render()
    sys.stdout.write(section)
    if write is not None:
        merge_section(write, section)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke run")
    parser.add_argument("--repeat", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--jobs", type=int, help="N (default 20,000; 1,000 with --quick)")
    parser.add_argument("--concurrency", type=int, help="worker processes (default 2)")
    parser.add_argument("--claim-batch", type=int, help="claim batch B (default 10)")
    parser.add_argument("--systems", help="comma-separated keys (default: all but the "
                        "prototypes): " + ", ".join(s.key for s in SYSTEMS))
    parser.add_argument("--no-sqlite", action="store_true")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="put the section into PATH (replacing an earlier one)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also dump every figure")
    parser.add_argument("--postgres-url", default=os.environ.get(
        "RUNLANE_BENCH_POSTGRES_URL", DEFAULT_POSTGRES_URL))
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("--from-json", type=Path, metavar="PATH",
                        help="render the report of an earlier --json dump, measure nothing")
    lifecycle.add_details_flag(parser)
    args = parser.parse_args(argv)
    lifecycle.DETAILS = args.details
    configure_logging("WARNING")
    if args.from_json is not None:
        return rerender(args.from_json, args.write, list(args.note))
    if not PEER_PYTHON.exists():
        raise SystemExit(f"no peer venv at {PEER_PYTHON}: run `make bench-peers` (it creates "
                         "it from bench/requirements-peers.txt)")
    sizes = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("jobs", args.jobs), ("concurrency", args.concurrency),
                                   ("claim_batch", args.claim_batch)) if v}
    if overrides:
        sizes = Sizes(**{**sizes.__dict__, **overrides})
    repeat = max(1, args.repeat or 3)
    # The per-run-completion prototype only on request.
    keys = args.systems.split(",") if args.systems else [s.key for s in SYSTEMS
                                                          if s.role != "prototype"]
    systems = [s for s in SYSTEMS if s.key in keys]
    started = datetime.now(UTC)
    wall = time.monotonic()
    model, cores = lscpu()
    pg = postgres_settings(args.postgres_url)
    load_start = load_average()
    environment = [
        ("Date (UTC)", f"{started:%Y-%m-%d %H:%M:%S}"),
        ("Machine", f"{model}, {cores} CPUs (lscpu), {lifecycle.memory_total()} RAM; "
         "clients and server share them"),
        ("OS / Python", f"{os.uname().sysname} {os.uname().release} / CPython "
         f"{sys.version.split()[0]}"),
        ("PostgreSQL", f"{pg['server_version']} on the same machine, default settings of "
         f"this install: shared_buffers {pg['shared_buffers']}, synchronous_commit "
         f"{pg['synchronous_commit']}, fsync {pg['fsync']}, wal_level {pg['wal_level']}, "
         f"autovacuum {pg['autovacuum']}, jit {pg['jit']} (runlane's connections set "
         f"`{PLANNER_OPTIONS}`), max_connections {pg['max_connections']}, work_mem "
         f"{pg['work_mem']}"),
        ("runlane", lifecycle.runlane_source()),
        ("Sizes", f"N {sizes.jobs:,}, submit batch {sizes.submit_batch:,}, claim batch B "
         f"{sizes.claim_batch}, C {sizes.concurrency} worker processes, {repeat} rounds"),
    ]
    progress(f"peers start; load {load_start}")
    rounds: dict[str, list[dict[str, Any]]] = {s.key: [] for s in systems}
    peer_versions: dict[str, str] = {}
    for round_no in range(repeat):
        for system in systems:
            figures = run_system(system, args.postgres_url, sizes, round_no)
            rounds[system.key].append(figures)
            if args.json is not None:  # so far, in case the run is cut short
                args.json.with_suffix(".partial.json").write_text(json.dumps(
                    {k: [{n: v for n, v in r.items() if n != "stderr"} for r in rs]
                     for k, rs in rounds.items()}, default=str))
            if system.venv == "peer" and figures.get("version") not in (None, "-"):
                peer_versions[system.label] = f"{figures['version']} ({figures['driver']})"
            elif system.venv == "peer":
                peer_versions[system.label] = figures["driver"]
    environment.append(("Peers (bench/requirements-peers.txt, a venv of their own)", "; ".join(
        f"{k} {v}" for k, v in peer_versions.items())))
    sqlite: list[dict[str, Any]] = []
    if not args.no_sqlite:
        sqlite = sqlite_procs.run_cells(sizes.sqlite_procs, sizes.sqlite_jobs,
                                        sizes.claim_batch, repeat)
    traces: list[dict[str, Any]] = []
    pyspy = explained = None
    if not args.no_profile:
        for stages in ("direct", "worker"):
            traces.append(profile_round_trips(args.postgres_url, sizes, stages))
            progress(f"round trips per run ({stages}): {traces[-1]['round_trips']:.2f}")
        explained = profile_explain(args.postgres_url, sizes)
        progress("explain done")
        pyspy = profile_pyspy(args.postgres_url, sizes)
        progress("py-spy done")
    environment.append(("Load average (1/5/15 min)",
                        f"{load_start} at start, {load_average()} at end"))
    command = lifecycle.display_command(sys.argv if argv is None else ["bench/peers.py",
                                                                        *argv])
    report = Report(command, started, sizes, repeat, environment, rounds, sqlite, traces,
                    pyspy, explained, list(args.note))
    report.wall_seconds = time.monotonic() - wall
    section = report.render()
    sys.stdout.write(section)
    if args.write is not None:
        merge_section(args.write, section)
        progress(f"wrote {args.write}")
    if args.json is not None:
        def strip(r: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in r.items() if k != "stderr"}

        args.json.write_text(json.dumps({
            "rounds": {k: [strip(r) for r in v] for k, v in rounds.items()},
            "sqlite": sqlite, "traces": traces, "pyspy": pyspy, "explain": explained,
            "environment": environment, "sizes": sizes.__dict__, "repeat": repeat,
            "command": command, "started": started.isoformat(),
            "wall_seconds": report.wall_seconds, "notes": list(args.note)},
            indent=1, default=str))
    progress(f"done in {report.wall_seconds / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
