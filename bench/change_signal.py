"""How fast a cancel and a submit reach a worker at default settings, on SQLite (the
change signal: PRAGMA data_version, store/wakeup.py) and on PostgreSQL (LISTEN/NOTIFY),
and what an idle SQLite worker costs.

For each database, a real `runlane worker` process (default intervals: heartbeat 10 s,
poll 1 s, CHANGE_POLL_SECONDS 0.05; the bwrap sandbox):
- submit -> claim: ``--samples`` runs submitted one at a time to the idle worker (agent
  ``true``; the next submit once the worker is idle again); the latency is the attempt's
  ``started_at`` minus the run's ``created_at`` (both the database's clock);
- cancel -> agent gone: ``--samples`` runs, ``--concurrency`` at a time, each agent a
  ``sleep`` with a marker in its command line; each cancel is timed from its commit
  (``Store.cancel`` returned) until no process with the run's marker is left (/proc,
  looked at every 2 ms);
- SQLite only: an idle worker's CPU (user + system, all its threads, /proc) over
  ``--idle-seconds``, as a share of one core.

    .venv/bin/python bench/change_signal.py --write docs/benchmarks.md
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
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(BENCH))

from lifecycle import merge_section  # noqa: E402
from runlane.domain.tasks import parse_task  # noqa: E402
from runlane.store.engine import build_engine  # noqa: E402
from runlane.store.migrate import upgrade  # noqa: E402
from runlane.store.store import Store  # noqa: E402

START, END = "<!-- change-signal:start -->", "<!-- change-signal:end -->"
PG_URL = os.environ.get("RUNLANE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def bare_remote(where: Path) -> Path:
    seed, remote = where / "seed", where / "remote.git"
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True, env=env)
    (seed / "README.md").write_text("bench\n")
    subprocess.run(["git", "add", "."], cwd=seed, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=seed, check=True, env=env)
    subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(remote)], check=True)
    return remote


def fresh_database(kind: str, where: Path) -> str:
    if kind == "sqlite":
        url = f"sqlite:///{where / 'runlane.db'}"
    else:
        import psycopg

        name = f"bench_signal_{os.getpid()}"
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
        url = PG_URL.rsplit("/", 1)[0] + "/" + name
    engine = build_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


def drop_database(url: str) -> None:
    if url.startswith("postgresql"):
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def start_worker(url: str, where: Path, agent: str, concurrency: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"RUNLANE_FORGE_DIR": str(where / "forge"),
                "RUNLANE_ARTIFACTS_DIR": str(where / "artifacts"),
                "RUNLANE_WORKSPACE_DIR": str(where / "workspaces"),
                "RUNLANE_METRICS": "false"})
    return subprocess.Popen(
        [sys.executable, "-m", "runlane", "--database-url", url, "worker",
         "--concurrency", str(concurrency), "--agent-command", agent],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(check: Any, timeout: float, what: str, step: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(step)


def status(store: Store, run_id: str) -> str:
    with store.reads.connect() as conn:
        return str(conn.execute(text("SELECT status FROM runs WHERE run_id = :r"),
                                {"r": run_id}).scalar())


def marked(marker: str) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        return True
            except OSError:
                continue
    return False


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def claim_latencies(url: str, where: Path, remote: Path, samples: int) -> list[float]:
    store = Store(url)
    worker = start_worker(url, where, "true", 1)
    try:
        time.sleep(3)  # registered, past its first look: idle
        out = []
        for _ in range(samples):
            [sub] = store.submit([parse_task({"tenant": "bench", "repo": str(remote),
                                              "prompt": "nothing"})])
            wait_for(lambda s=sub: status(store, s.run_id) in ("SUCCEEDED", "FAILED"), 60,
                     "the run", step=0.02)
            with store.reads.connect() as conn:
                out.append(float(conn.execute(text(
                    "SELECT a.started_at - r.created_at FROM attempts a JOIN runs r "
                    "ON r.run_id = a.run_id WHERE a.run_id = :r AND a.attempt_no = 1"),
                    {"r": sub.run_id}).scalar()))
            time.sleep(0.3)  # idle again, waiting
        return out
    finally:
        worker.terminate()
        worker.wait()
        store.close()


def cancel_latencies(url: str, where: Path, remote: Path, samples: int,
                     concurrency: int) -> list[float]:
    store = Store(url)
    # The marker rides in the agent's command line through the task's prompt.
    worker = start_worker(
        url, where, 'exec python3 -c "import time; time.sleep(600)" "$RUNLANE_RUN_ID"',
        concurrency)
    out: list[float] = []
    try:
        while len(out) < samples:
            subs = store.submit([parse_task({"tenant": "bench", "repo": str(remote),
                                             "prompt": f"wait {uuid.uuid4()}"})
                                 for _ in range(min(concurrency, samples - len(out)))])
            wait_for(lambda subs=subs: all(marked(s.run_id) for s in subs), 60, "the agents", 0.05)
            for sub in subs:
                store.cancel(sub.task_id)
                committed = time.monotonic()
                wait_for(lambda s=sub: not marked(s.run_id), 30, "the agent to exit", 0.002)
                out.append(time.monotonic() - committed)
            wait_for(lambda subs=subs: all(status(store, s.run_id) == "CANCELLED" for s in subs),
                     60,
                     "CANCELLED", 0.05)
        return out
    finally:
        worker.terminate()
        worker.wait()
        store.close()


def idle_cpu(url: str, where: Path, seconds: float) -> float:
    worker = start_worker(url, where, "true", 1)
    try:
        time.sleep(3)
        before, started = cpu_seconds(worker.pid), time.monotonic()
        time.sleep(seconds)
        return (cpu_seconds(worker.pid) - before) / (time.monotonic() - started)
    finally:
        worker.terminate()
        worker.wait()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    rows, idle = [], None
    for kind in args.databases.split(","):
        with tempfile.TemporaryDirectory(prefix="rl-signal-") as tmp:
            where = Path(tmp)
            remote = bare_remote(where)
            url = fresh_database(kind, where)
            try:
                claims = claim_latencies(url, where, remote, args.samples)
                cancels = cancel_latencies(url, where, remote, args.samples, args.concurrency)
                if kind == "sqlite":
                    idle = idle_cpu(url, where, args.idle_seconds)
            finally:
                drop_database(url)
        rows.append((kind, claims, cancels))
        print(f"{kind}: claim p50 {statistics.median(claims) * 1000:.0f} ms "
              f"p99 {pct(claims, 0.99) * 1000:.0f} ms; cancel p50 "
              f"{statistics.median(cancels) * 1000:.0f} ms p99 {pct(cancels, 0.99) * 1000:.0f} ms",
              flush=True)
    if idle is not None:
        print(f"sqlite idle worker: {idle * 100:.2f}% of a core")
    lines = [START, "## Cancel and wake-up at default settings: `bench/change_signal.py`", "",
             f"Date: {time.strftime('%Y-%m-%d')}. Machine: {os.cpu_count()} cores, "
             f"{platform.platform()}, Python "
             f"{platform.python_version()}. Command: `.venv/bin/python bench/change_signal.py"
             f" --write docs/benchmarks.md` ({args.samples} samples each, cancels "
             f"{args.concurrency} runs at a time). A real `runlane worker` at default "
             "settings (heartbeat 10 s, poll 1 s, `CHANGE_POLL_SECONDS` 0.05, bwrap). "
             "Submit -> claim: the attempt's start minus the run's creation (database "
             "clock), one submit at a time to an idle worker. Cancel -> agent gone: from "
             "the cancel's commit until no process of the run is left (/proc every 2 ms).",
             "", "| database | submit -> claim p50 | p99 | cancel -> agent gone p50 | p99 |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for kind, claims, cancels in rows:
        lines.append(f"| {kind} | {statistics.median(claims) * 1000:.0f} ms | "
                     f"{pct(claims, 0.99) * 1000:.0f} ms | "
                     f"{statistics.median(cancels) * 1000:.0f} ms | "
                     f"{pct(cancels, 0.99) * 1000:.0f} ms |")
    if idle is not None:
        lines += ["", f"An idle SQLite worker (its change signal read 20 times a second, "
                  f"its poll once a second, a look and no claim) used {idle * 100:.2f}% of "
                  f"one core over {args.idle_seconds:.0f} s (target: at most 1%)."]
    lines += ["", "Targets (SQLite, default settings): cancel within 1 s, submit -> claim "
              "p50 under 150 ms.", END]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write:
        merge_section(args.write, section, START, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
