"""What observability costs the peer drain (issue 24): runlane's drain driver
(bench/peer_workloads/runlane_driver.py, the worker's stages) with metrics and tracing
off, against on, in the same run.

Why: metrics are counted in the store's claim and transition paths and spans are made
around each attempt's stages, so a drain is where their cost would show. Target: with no
exporter, observability costs at most 5% of drain throughput.

Configurations, alternated round by round, each on a fresh database of the same server
(N runs submitted untimed, then drained by 2 worker processes claiming 10 at a time, each
lease walked through the worker's stages and completed):

* ``off``: ``RUNLANE_METRICS=false``, no tracer provider;
* ``metrics``: metrics on (the default);
* ``metrics+traces``: and ``OTEL_TRACES_EXPORTER=none`` (spans made, exported nowhere);
* ``metrics+otlp``: and the OTLP/HTTP exporter to a collector on loopback
  (tests/otlp_collector.py, in a process of its own);
* ``metrics+traces+INFO logs``: and the transition log lines at INFO (the worker's
  default level), JSON to the driver's stderr.

Run (about 4 minutes)::

    .venv/bin/python bench/observability.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DRIVER = BENCH / "peer_workloads" / "runlane_driver.py"
START = "<!-- observability-drain:start -->"
END = "<!-- observability-drain:end -->"

CONFIGS: dict[str, dict[str, str]] = {
    "off": {"RUNLANE_METRICS": "false"},
    "metrics": {"RUNLANE_METRICS": "true"},
    "metrics+traces": {"RUNLANE_METRICS": "true", "OTEL_TRACES_EXPORTER": "none"},
    "metrics+otlp": {"RUNLANE_METRICS": "true", "OTEL_TRACES_EXPORTER": "otlp"},
    "metrics+traces+INFO logs": {"RUNLANE_METRICS": "true", "OTEL_TRACES_EXPORTER": "none",
                                 "RUNLANE_LOG_LEVEL": "INFO"},
}


def admin_conn(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"),
                           autocommit=True, connect_timeout=5)


def drain(admin_url: str, env: dict[str, str], jobs: int) -> dict[str, Any]:
    name = f"bench_observability_{os.getpid()}"
    with admin_conn(admin_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    dsn = admin_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("RUNLANE_", "OTEL_TRACES"))}
        full.update(env)
        done = subprocess.run(
            [sys.executable, str(DRIVER), "--dsn", dsn, "--jobs", str(jobs),
             "--concurrency", "2", "--claim-batch", "10", "--latency-samples", "0",
             "--stages", "worker"],
            capture_output=True, text=True, cwd=ROOT, env=full, timeout=1800, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise SystemExit(f"the driver failed ({done.returncode}):\n{done.stderr[-3000:]}")
        figures: dict[str, Any] = json.loads(lines[-1])["drain"]
        figures["log_lines"] = done.stderr.count("\n")
        return figures
    finally:
        with admin_conn(admin_url) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def section(results: dict[str, list[float]], errors: dict[str, int], jobs: int,
            rounds: int, started: float, load_before: str) -> str:
    base = statistics.median(results["off"])
    rows = []
    for label, rates in results.items():
        p50 = statistics.median(rates)
        cost = (1 - p50 / base) * 100
        rows.append(f"| {label} | {p50:,.0f} | {', '.join(f'{r:,.0f}' for r in rates)} | "
                    f"{'-' if label == 'off' else f'{cost:+.1f}%'} | {errors[label]} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
    none = statistics.median(results["metrics+traces"])
    return "\n".join([
        START,
        "## What observability costs the drain: `bench/observability.py`",
        "",
        f"`python bench/observability.py --write docs/benchmarks.md` on {stamp}, commit "
        f"{commit}; {platform.machine()}, {os.cpu_count()} CPUs, PostgreSQL on the same "
        f"machine; load average {load_before} at start, {load_average()} at end. "
        f"{jobs:,} runs per drain, 2 worker processes claiming 10 at a time, each lease "
        f"walked through the worker's stages (runlane_driver.py `--stages worker`); "
        f"{rounds} rounds, configurations alternated within each, a fresh database each "
        f"time; the median rate, every round shown.",
        "",
        "| configuration | drain runs/s (median) | rounds | cost vs off | errors |",
        "| :--- | ---: | :--- | ---: | ---: |",
        *rows,
        "",
        f"Target: observability with no exporter (metrics and spans, `metrics+traces`) "
        f"costs at most 5% of the drain: {(1 - none / base) * 100:.1f}% here "
        f"({'met' if none >= 0.95 * base else 'missed'}). The INFO row is the transition "
        f"log lines a worker writes at its default level (one JSON line per claim and "
        f"per move); the per-call costs are in the section on tracing and the "
        f"transition logs above.",
        END,
    ])


def merge_section(path: Path, text: str) -> None:
    existing = path.read_text() if path.exists() else ""
    if START in existing and END in existing:
        head, _, rest = existing.partition(START)
        _, _, tail = rest.partition(END)
        updated = head.rstrip() + "\n\n" + text.rstrip() + "\n" + tail.lstrip("\n")
    else:
        updated = existing.rstrip() + "\n\n" + text.rstrip() + "\n"
    path.write_text(updated)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--postgres-url", default=os.environ.get(
        "RUNLANE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--jobs", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", type=Path, metavar="PATH")
    args = parser.parse_args()
    started, load_before = time.time(), load_average()
    collector = subprocess.Popen([sys.executable, "-m", "tests.otlp_collector"], cwd=ROOT,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert collector.stdin is not None and collector.stdout is not None
    results: dict[str, list[float]] = {label: [] for label in CONFIGS}
    errors = dict.fromkeys(CONFIGS, 0)
    try:
        endpoint = collector.stdout.readline().strip()
        for round_no in range(args.rounds):
            for label, env in CONFIGS.items():
                env = dict(env)
                if env.get("OTEL_TRACES_EXPORTER") == "otlp":
                    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
                figures = drain(args.postgres_url, env, args.jobs)
                results[label].append(figures["rate"])
                errors[label] += figures["errors"]
                print(f"round {round_no + 1} {label}: {figures['rate']:,.0f} runs/s "
                      f"({figures['done']}/{figures['jobs']}, errors {figures['errors']}, "
                      f"stderr lines {figures['log_lines']})", file=sys.stderr)
    finally:
        collector.stdin.close()
        spans = collector.stdout.readline().strip()
        collector.wait(timeout=60)
    print(f"the collector received {spans} spans", file=sys.stderr)
    text = section(results, errors, args.jobs, args.rounds, started, load_before)
    print(text)
    if args.write is not None:
        merge_section(args.write, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
