"""What idle workers cost PostgreSQL, and how many workers one submit sets claiming.

For each count in ``--workers``, a fresh PostgreSQL database and that many real
`runlane worker` processes at default settings (poll 1 s backing off to
IDLE_POLL_MAX_SECONDS 20, heartbeat 10 s; sandbox off, which only changes their start):
- statements per second per idle worker: the server's table counters of the database
  (``pg_stat_user_tables``: sequential and index scans, inserted rows; each of an idle
  worker's statements scans one table once) over ``--window`` seconds, after
  ``--warm-up`` seconds in which their polls back off;
- empty claims per submit: ``--submits`` runs submitted one at a time (the next once
  the last is claimed and the others had time to look), after as many that let each
  worker learn how many race it; the workers' ``runlane_scheduler_claim_empty``
  counters (multiprocess files), and the submit -> claim p50 (database clock).
``--src DIR`` runs the workers from another source tree (a `git archive` of an older
commit): the figures before a change.

    .venv/bin/python bench/idle.py --workers 10,100 --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(BENCH))

from change_signal import bare_remote, drop_database, fresh_database  # noqa: E402
from lifecycle import merge_section  # noqa: E402
from runlane.domain.tasks import parse_task  # noqa: E402
from runlane.store.store import Store  # noqa: E402

START, END = "<!-- idle:start -->", "<!-- idle:end -->"
PG_URL = os.environ.get("RUNLANE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def statements(url: str) -> int:
    """Statements on runlane's tables as the server's table counters see them (scans
    and inserted rows): each of an idle worker's statements scans one table once. Not
    the transaction counters, which count too what idle sessions run for the server
    itself (LISTEN queue reads, cache catch-up after DDL anywhere on the server)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT COALESCE(SUM(seq_scan + COALESCE(idx_scan, 0) "
                           "+ n_tup_ins), 0) FROM pg_stat_user_tables").fetchone()
        return int(row[0]) if row else 0


def server() -> str:
    """The server's version and max_connections (100 idle workers hold about 200)."""
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()
        most = conn.execute("SHOW max_connections").fetchone()
    return f"{(version or ['?'])[0].split()[0]} (max_connections {(most or ['?'])[0]})"


def claim_empty(directory: Path) -> float:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return sum(s.value for f in registry.collect() for s in f.samples
               if s.name == "runlane_scheduler_claim_empty_total")


def wait_for(check: Any, timeout: float, what: str, step: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(step)


def scalar(store: Store, sql: str, **params: Any) -> Any:
    with store.reads.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def measure(n: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="rl-idle-") as tmp:
        where = Path(tmp)
        remote = bare_remote(where)
        url = fresh_database("postgresql", where)
        metrics_dir = where / "metrics"
        metrics_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        env.update({"RUNLANE_FORGE_DIR": str(where / "forge"),
                    "RUNLANE_ARTIFACTS_DIR": str(where / "artifacts"),
                    "RUNLANE_WORKSPACE_DIR": str(where / "workspaces"),
                    "RUNLANE_SANDBOX": "off", "RUNLANE_LOG_LEVEL": "ERROR",
                    "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
        if args.src:
            env["PYTHONPATH"] = str(Path(args.src).absolute())
        store = Store(url)
        workers: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(n):
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "runlane", "--database-url", url, "worker",
                     "--agent-command", "true"], cwd=where, env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                time.sleep(args.stagger)
            wait_for(lambda: scalar(store, "SELECT COUNT(*) FROM workers") == n, 600,
                     "the workers to register", step=0.5)
            time.sleep(args.warm_up)
            before, started = statements(url), time.monotonic()
            time.sleep(args.window)
            seen = statements(url) - before
            per_worker = seen / (time.monotonic() - started) / n
            print(f"{n} idle workers: {per_worker:.3f} statements/s each", flush=True)
            latencies: list[float] = []
            empty_before = claim_empty(metrics_dir)
            for i in range(2 * args.submits):
                if i == args.submits:
                    empty_before = claim_empty(metrics_dir)
                    latencies.clear()
                [sub] = store.submit([parse_task({"tenant": "bench", "repo": str(remote),
                                                  "prompt": "nothing"})])
                wait_for(lambda s=sub: scalar(store, "SELECT status FROM runs WHERE run_id"
                                              " = :r", r=s.run_id) != "QUEUED", 60,
                         "the claim")
                time.sleep(args.settle)
                latencies.append(float(scalar(
                    store, "SELECT a.started_at - r.created_at FROM attempts a JOIN runs r "
                    "ON r.run_id = a.run_id WHERE a.run_id = :r AND a.attempt_no = 1",
                    r=sub.run_id)))
            empty = (claim_empty(metrics_dir) - empty_before) / args.submits
            print(f"{n} idle workers: {empty:.2f} empty claims per submit, submit -> claim "
                  f"p50 {statistics.median(latencies) * 1000:.1f} ms", flush=True)
            return {"statements": per_worker, "empty": empty,
                    "claim_p50_ms": statistics.median(latencies) * 1000}
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                try:
                    w.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    w.kill()
                    w.wait()
            store.close()
            drop_database(url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="10,100")
    parser.add_argument("--warm-up", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--submits", type=int, default=12)
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds after each claim before the next submit")
    parser.add_argument("--stagger", type=float, default=0.05,
                        help="seconds between two worker starts")
    parser.add_argument("--src", help="run the workers from this source tree")
    parser.add_argument("--before-src", help="also measure the workers of this tree "
                        "(a `git archive` of the commit before), as the table's first rows")
    parser.add_argument("--before-label", default="before")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    rows = []
    for label, src in ((args.before_label, args.before_src), ("this change", args.src)):
        if label != "this change" and not src:
            continue
        args.src = src
        for n in counts:
            rows.append((label, n, measure(n, args)))
    lines = [START, "## Idle workers: `bench/idle.py`", "",
             f"Date: {time.strftime('%Y-%m-%d')}. Machine: {os.cpu_count()} cores, "
             f"{platform.platform()}, Python {platform.python_version()}, PostgreSQL "
             f"{server()} on the same machine. Command: `.venv/bin/python bench/idle.py --workers "
             f"{args.workers}{' --before-src DIR' if args.before_src else ''} --write "
             "docs/benchmarks.md`. Real `runlane worker` processes at default settings "
             "(heartbeat 10 s, poll 1 s, `IDLE_POLL_MAX_SECONDS` 20; sandbox off). "
             "Statements: the server's table counters of the database "
             f"(`pg_stat_user_tables`: scans and inserted rows; each of an idle worker's "
             f"statements scans one table once) over {args.window:.0f} s, after "
             f"{args.warm_up:.0f} s idle. Empty claims: the workers' "
             f"`runlane_scheduler_claim_empty` over {args.submits} submits made one at "
             "a time (each once the last was "
             f"claimed and {args.settle:g} s had passed), after as many more.", "",
             "| workers | idle workers | statements/s per idle worker | empty claims per "
             "submit | submit -> claim p50 |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, n, r in rows:
        lines.append(f"| {label} | {n} | {r['statements']:.3f} | {r['empty']:.2f} | "
                     f"{r['claim_p50_ms']:.1f} ms |")
    lines += ["", "Targets: at most 0.2 statements a second per idle worker at 100 idle "
              "workers; one submit claimed by a bounded number of workers.", END]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write:
        merge_section(args.write, section, START, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
