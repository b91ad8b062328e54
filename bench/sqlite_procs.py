"""runlane on SQLite with 1, 2 and 8 worker processes (issue 5, part 4).

The peer workload (bench/peer_workloads/runlane_driver.py) on a WAL file in a temp
dir: N no-op runs submitted in batches, then drained by P processes claiming up to B
at a time. Counts every "database is locked" that reaches a caller of the store (it
must stay 0) and, from the workers' logs, the busy retries the store absorbed.

    .venv/bin/python bench/sqlite_procs.py            # 1, 2, 8 processes, 3 rounds
    .venv/bin/python bench/sqlite_procs.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DRIVER = Path(__file__).resolve().parent / "peer_workloads" / "runlane_driver.py"


def progress(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def run_once(directory: Path, processes: int, jobs: int, batch: int, name: str
             ) -> dict[str, Any]:
    url = f"sqlite:///{directory / name}.db"
    done = subprocess.run(
        [sys.executable, str(DRIVER), "--dsn", url, "--jobs", str(jobs), "--submit-batch",
         "1000", "--claim-batch", str(batch), "--concurrency", str(processes),
         "--latency-samples", "0"],
        capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"sqlite run with {processes} processes failed:\n{done.stderr[-3000:]}")
    figures: dict[str, Any] = json.loads(lines[-1])
    drain = figures["drain"]
    locked_in_stderr = done.stderr.count("database is locked")
    return {
        "rate": drain["rate"], "done": drain["done"], "jobs": drain["jobs"],
        "errors": drain["errors"],
        "locked": sum(int(w.get("locked", 0)) for w in drain["workers"]) + locked_in_stderr,
        "busy_retries": done.stderr.count("sqlite_busy_retry"),
        "client_cpu_ms_per_job": drain["client_cpu_ms_per_job"],
        "rss_mb": drain["worker_rss_mb"], "enqueue_rate": figures["enqueue"]["rate"],
    }


def run_cells(procs: Sequence[int], jobs: int, batch: int, repeat: int) -> list[dict[str, Any]]:
    """Every process count once per round (interleaved); the median round of each."""
    results: dict[int, list[dict[str, Any]]] = {p: [] for p in procs}
    with tempfile.TemporaryDirectory(prefix="runlane-sqlite-procs-") as tmp:
        for round_no in range(repeat):
            for p in procs:
                figures = run_once(Path(tmp), p, jobs, batch, f"p{p}-r{round_no}")
                results[p].append(figures)
                progress(f"sqlite round {round_no + 1}, {p} process(es): "
                         f"{figures['rate']:,.0f} runs/s, locked {figures['locked']}, "
                         f"busy retries {figures['busy_retries']}")
    cells = []
    for p, rounds in results.items():
        chosen = sorted(rounds, key=lambda r: r["rate"])[(len(rounds) - 1) // 2]
        cells.append({
            **chosen, "processes": p, "batch": batch, "rounds": [r["rate"] for r in rounds],
            "locked": sum(r["locked"] for r in rounds),
            "busy_retries": sum(r["busy_retries"] for r in rounds),
            "errors": sum(r["errors"] for r in rounds),
            "lost": sum(r["jobs"] - r["done"] for r in rounds),
            "enqueue_rate": statistics.median(r["enqueue_rate"] for r in rounds),
        })
    return cells


def render(cells: Sequence[dict[str, Any]]) -> str:
    header = ["Processes", "Claim batch", "Runs/s", "Runs/s by round", "Submit runs/s",
              "Client CPU ms/run", "Worker peak RSS MiB", "'database is locked' to a caller",
              "Busy retries absorbed", "Errors / lost"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(["---:"] * len(header)) + " |"]
    for c in cells:
        lines.append("| " + " | ".join([
            str(c["processes"]), str(c["batch"]), f"{c['rate']:,.0f}",
            " / ".join(f"{r:,.0f}" for r in c["rounds"]), f"{c['enqueue_rate']:,.0f}",
            f"{c['client_cpu_ms_per_job']:.3f}", f"{c['rss_mb']:.0f}", str(c["locked"]),
            str(c["busy_retries"]), f"{c['errors']} / {c['lost']}"]) + " |")
    jobs = cells[0]["jobs"] if cells else 0
    return ("\n".join(lines) + "\n\n"
            f"{jobs:,} runs per cell, a fresh WAL file each (synchronous=NORMAL, BEGIN "
            "IMMEDIATE, busy timeout 60 s), every round's cells interleaved; the median "
            "round shown, errors, locks and retries summed over all rounds. Client CPU "
            "includes SQLite itself (it runs in the worker processes).")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--claim-batch", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--processes", default="1,2,8")
    args = parser.parse_args(argv)
    jobs = args.jobs or (1_000 if args.quick else 10_000)
    procs = [int(p) for p in args.processes.split(",")]
    cells = run_cells(procs, jobs, args.claim_batch, 1 if args.quick else args.repeat)
    sys.stdout.write(render(cells) + "\n")
    return 0 if all(c["locked"] == 0 for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
