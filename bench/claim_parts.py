"""What each part of runlane's one-statement claim costs the server, against the FIFO
claim of ``bench/scheduler.py``, on the same database (issue 4's 1.5x FIFO target).

The claim's statement and parameters are those of a real ``Store.claim`` just made
(captured from the engine's cursor events); it is executed again under ``EXPLAIN
(ANALYZE, TIMING OFF, SUMMARY ON)`` on a connection of its own, whole and with one part
of its writes taken out at a time, in a rotating order, each execution rolled back.
TIMING OFF reads no clock per plan node, so the figure is close to the statement's
own execution time. The difference between the whole statement and a variant is what
that part costs. The FIFO claim (``UPDATE ... FROM (SELECT ... SKIP LOCKED)`` and its
attempt rows, as ``bench/scheduler.py`` sends them) is executed the same way.

Not in any figure: the round trip, planning (both run as prepared statements on
generic plans) and the commit (one WAL flush each). Progress goes to stderr, the
Markdown section to stdout and, with ``--write``, into that file::

    .venv/bin/python bench/claim_parts.py --write docs/benchmarks.md
    .venv/bin/python bench/claim_parts.py --quick      # 100,000 runs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import (
    display_command,
    drop_postgres,
    fresh_postgres,
    libpq,
    load_average,
    memory_total,
    merge_section,
    postgres_facts,
    progress,
    runlane_source,
    table,
)
from runlane.logs import configure_logging
from runlane.store.dialect_sql import compact
from scheduler import (
    DEFAULT_POSTGRES_URL,
    FIFO_ATTEMPT,
    FIFO_CLAIM,
    FULL,
    QUEUE,
    QUICK,
    WORKER,
    Runlane,
    lscpu,
    numbered,
    populate,
)

START, END = "<!-- claim-parts:start -->", "<!-- claim-parts:end -->"
LIMITS = (1, 10)


def _cut(statement: str, start: str, end: str, replacement: str = "") -> str:
    """``statement`` with the text from ``start`` through ``end`` replaced."""
    start, end = compact(start).strip(), compact(end).strip()
    i = statement.index(start)
    j = statement.index(end, i) + len(end)
    return statement[:i] + replacement + statement[j:]


# Each variant: the one-statement claim without one part of its writes. The edits
# work on the text as sent (compacted); one that no longer matches fails loudly
# (str.index), rather than measuring the whole statement under another name.
PARTS: dict[str, Callable[[str], str]] = {
    "the event rows (INSERT run_events)": lambda q: _cut(
        q, "events AS (\nINSERT INTO run_events", "FROM claimed, t),\n"),
    "the attempt rows (INSERT attempts)": lambda q: _cut(
        q, "new_attempts AS (\nINSERT INTO attempts",
        "JOIN picked p ON p.run_id = c.run_id, t),\n"),
    "the lanes' update (queued count, pass)": lambda q: _cut(
        q, "lane_counts AS (\nUPDATE lanes", "lane_locks)))",
        "lane_counts AS (SELECT lane_id FROM lane_locks)"),
    "the counters' update (slots; still locked)": lambda q: _cut(
        q, "slots AS (\nUPDATE limit_counters c", "RETURNING c.scope, c.active >= c.max_active"
        " AS at_limit)", "slots AS (SELECT c.scope, c.active >= c.max_active AS at_limit "
        "FROM limit_counters c WHERE c.scope = ANY(ARRAY(SELECT scope FROM slot_deltas)) "
        "AND (SELECT ok FROM room))"),
}


def execution_ms(cursor: psycopg.RawCursor[Any], statement: str, params: Sequence[Any]
                 ) -> float:
    cursor.execute(("EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON) " + statement).encode(),
                   params, prepare=False)
    for (line,) in cursor.fetchall():
        if line.startswith("Execution Time:"):
            return float(line.split()[2])
    raise RuntimeError("EXPLAIN ANALYZE printed no execution time")


def measure(url: str, samples: int) -> dict[int, dict[str, list[float]]]:
    """Per claim limit, per variant: the server's execution times (ms)."""
    runlane = Runlane(url)
    captured: list[tuple[str, Any]] = []

    @event.listens_for(runlane.store._autocommit_engine, "before_cursor_execute")
    def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "INSERT INTO attempts" in statement and "page" in statement:
            captured.append((statement, params))

    fifo_claim, _ = numbered(FIFO_CLAIM)
    fifo_attempt, _ = numbered(FIFO_ATTEMPT)
    found: dict[int, dict[str, list[float]]] = {}
    with psycopg.connect(libpq(url), cursor_factory=psycopg.RawCursor) as conn:
        conn.execute(b"SET jit = off")
        for limit in LIMITS:
            times: dict[str, list[float]] = found.setdefault(limit, {})
            for _ in range(10):  # warm-up: caches, the statement's plan on the server
                runlane.claim(limit)
                runlane.settle()
            for i in range(samples):
                captured.clear()
                if runlane.claim(limit) != limit or len(captured) != 1:
                    raise RuntimeError("the claim was not one statement that took "
                                       f"{limit} runs: the variants would not apply")
                runlane.settle()
                statement, params = captured[0]
                variants = {"whole statement": statement} | {
                    f"without {part}": cut(statement) for part, cut in PARTS.items()}
                names = [*variants, "FIFO claim + attempt rows"]
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    with conn.cursor() as cursor:
                        if name in variants:
                            ms = execution_ms(cursor, variants[name], params)
                        else:
                            ms = execution_ms(cursor, fifo_claim, (QUEUE, limit, WORKER))
                            jobs = cursor.execute(
                                b"SELECT id, attempts FROM fifo_jobs WHERE worker_id = $1"
                                b" AND status = 'claimed' ORDER BY claimed_at DESC, id"
                                b" LIMIT $2", (WORKER, limit)).fetchall()
                            now = time.time()
                            for job_id, attempts in jobs:
                                ms += execution_ms(cursor, fifo_attempt,
                                                   (job_id, attempts, WORKER, now, now + 600))
                    conn.rollback()
                    times.setdefault(name, []).append(ms)
            progress(f"limit {limit}: {samples} samples of {len(names)} statements")
    runlane.store.close()
    return found


def render(command: str, started: datetime, runs: int, samples: int,
           environment: list[tuple[str, str]], found: dict[int, dict[str, list[float]]],
           wall: float) -> str:
    lines = [START, "## What each part of a claim costs the server: `bench/claim_parts.py`", "",
             f"Produced by `{command}` on {started:%Y-%m-%d %H:%M} UTC ({wall / 60:.1f} min)"
             f", on {runs:,} queued runs populated as `bench/scheduler.py` does (the GPU "
             f"worker's claim; fairness, limits and routing on). {samples} samples per "
             "claim limit, the statements of each sample in rotating order. Server "
             "execution time only: EXPLAIN (ANALYZE, TIMING OFF) of the statement a "
             "real claim just sent, rolled back; no round trip, no planning, no commit. "
             "`bench/claim_parts.py` says how.", "",
             table(["", ""], [["**" + k + "**", v] for k, v in environment], "ll"), ""]
    for limit, times in found.items():
        whole = statistics.median(times["whole statement"])
        fifo = statistics.median(times["FIFO claim + attempt rows"])
        rows = []
        for name, values in times.items():
            p50 = statistics.median(values)
            saved = "" if name in ("whole statement", "FIFO claim + attempt rows") \
                else f"{whole - p50:+.3f}"
            rows.append([name, f"{p50:.3f}", saved, f"{p50 / fifo:.2f}x"])
        lines += [f"**Claim of {limit}**: the whole statement {whole:.3f} ms against FIFO's "
                  f"{fifo:.3f} ms ({whole / fifo:.2f}x).", "",
                  table(["Statement", "Execution p50 ms", "Part's cost (whole - this)",
                         "/ FIFO"], rows, "lrrr"), ""]
    lines += [END, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.runs:,} runs instead of {FULL.runs:,}")
    parser.add_argument("--samples", type=int, default=60, help="samples per claim limit")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL,
                        help="a server and any database on it (default %(default)s)")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="also put the Markdown section into PATH")
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    shape = QUICK if args.quick else FULL
    started = datetime.now(UTC)
    wall = time.monotonic()
    name = f"runlane_bench_parts_{os.getpid()}"
    url = fresh_postgres(args.postgres_url, name)
    load_before = load_average()
    try:
        progress(f"populating {name}: {shape.runs:,} runs + {shape.runs:,} FIFO jobs")
        populate(url, shape)
        found = measure(url, args.samples)
        facts = postgres_facts(url)
    finally:
        drop_postgres(args.postgres_url, name)
    environment = [
        ("Machine", f"{lscpu()}; {memory_total()} RAM"),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("PostgreSQL", f"{facts['server_version']} on the same machine; shared_buffers "
                       f"{facts['shared_buffers']}, jit off for these executions"),
        ("runlane", runlane_source()),
        ("Load average (1/5/15 min)", f"{load_before} at start, {load_average()} at end"),
    ]
    section = render(display_command([sys.argv[0], *(argv or sys.argv[1:])]), started,
                     shape.runs, args.samples, environment, found, time.monotonic() - wall)
    sys.stdout.write(section)
    if args.write is not None:
        merge_section(args.write, section, START, END)
        progress(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
