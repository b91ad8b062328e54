"""``runlane demo``: the run lifecycle on SQLite, start to finish, in a few seconds.

Three worker threads claim runs, heartbeat, walk the stages and finish them. The
scripted prompts make one run hit a provider rate limit (retried after its
retry-after), one worker die mid-run (its lease expires, the reaper recovers the
run, another worker finishes it) and one run get cancelled while it runs (the
cancel reaches its worker through the heartbeat). The agent-command workers,
git workspaces and pull requests of issue 3 replace the scripted agent later.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from runlane.api import Runlane
from runlane.domain.reasons import Reason
from runlane.domain.states import TERMINAL, RunStatus
from runlane.errors import CancelRequested, LeaseLost
from runlane.services.maintenance import Reaper, ReaperConfig
from runlane.settings import Settings
from runlane.store.store import Lease, Store

S = RunStatus
LEASE_TTL = 1.5
HEARTBEAT = 0.3

TASKS: list[tuple[str, str]] = [
    ("acme", "rename the deprecated config flag"),
    ("acme", "fix the flaky login test"),
    ("acme", "rate-limit: bump the HTTP client and update call sites"),
    ("acme", "crash: migrate the build to the new toolchain"),
    ("acme", "add type hints to the billing module"),
    ("acme", "slow: rewrite the search indexer"),
    ("globex", "update the README install section"),
    ("globex", "remove dead feature flags"),
    ("globex", "rate-limit: regenerate the API client"),
    ("globex", "fix the timezone bug in reports"),
]


class _WorkerDied(Exception):
    """The scripted agent's way of killing its worker mid-run."""


def _work(store: Store, worker_id: str, stop: threading.Event, crashed: set[str]) -> None:
    rng = random.Random(worker_id)
    while not stop.is_set():
        leases = store.claim(worker_id, limit=1, lease_ttl=LEASE_TTL)
        if not leases:
            stop.wait(0.1)
            continue
        lease = leases[0]
        prompt = store.get_run(lease.run_id)["task"]["prompt"]
        try:
            _attempt(store, lease, prompt, rng, crashed)
        except _WorkerDied:
            return  # no release, no more heartbeats: the reaper must find the run
        except (LeaseLost, CancelRequested):
            continue


def _attempt(store: Store, lease: Lease, prompt: str, rng: random.Random,
             crashed: set[str]) -> None:
    store.advance(lease, S.PREPARING_SANDBOX)
    store.advance(lease, S.RUNNING)
    duration = 3.0 if prompt.startswith("slow") else rng.uniform(0.3, 0.8)
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        if prompt.startswith("crash") and lease.run_id not in crashed:
            crashed.add(lease.run_id)
            raise _WorkerDied
        beat = store.heartbeat(lease.worker_id, [lease], lease_ttl=LEASE_TTL)
        if lease.run_id in beat.lost:
            raise LeaseLost(lease.run_id)
        if lease.run_id in beat.cancel_requested:
            store.acknowledge_cancel(lease)
            store.finish_cancel(lease)
            return
        time.sleep(min(HEARTBEAT, max(deadline - time.monotonic(), 0)))
    store.report_cost(lease, round(rng.uniform(0.01, 0.2), 3), input_tokens=1200,
                      output_tokens=300)
    if prompt.startswith("rate-limit") and lease.attempt_no == 1:
        store.fail(lease, Reason.PROVIDER_RATE_LIMIT, message="429 from the model provider",
                   retry_after_seconds=1.0)
        return
    store.advance(lease, S.VERIFYING)
    store.advance(lease, S.FINALIZING)
    store.complete(lease, outcome="changes_ready")


def _table(store: Store, elapsed: float) -> Table:
    counts = Counter(r["status"] for r in store.list_runs())
    table = Table(title=f"runlane demo - {elapsed:4.1f}s")
    table.add_column("state")
    table.add_column("runs", justify="right")
    for status in S:
        if counts.get(status.value):
            table.add_row(status.value, str(counts[status.value]))
    return table


def run_demo(directory: Path, console: Console | None = None,
             workers: int = 3, timeout: float = 60.0) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / "runlane.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    url = f"sqlite:///{db}"
    settings = Settings(database_url=url, lease_ttl_seconds=LEASE_TTL,
                        heartbeat_seconds=HEARTBEAT, retry_base_seconds=0.5,
                        retry_max_seconds=2.0, max_attempts=3)
    started = time.monotonic()
    lane = Runlane(settings=settings, rng=random.Random(7))
    lane.upgrade_schema()
    rows = [{"tenant": t, "repo": f"/srv/git/{t}/service.git", "prompt": p,
             "idempotency_key": f"demo-{i}", "priority": "high" if "fix" in p else "normal"}
            for i, (t, p) in enumerate(TASKS)]
    submissions = lane.submit_batch(rows)
    again = lane.submit_batch(rows[:2])  # a duplicate submit creates nothing
    store = lane.store
    stop = threading.Event()
    crashed: set[str] = set()
    reaper = Reaper(store, ReaperConfig(interval_seconds=0.2))
    threads = [threading.Thread(target=reaper.run_forever, args=(stop,), daemon=True)]
    threads += [threading.Thread(target=_work, args=(store, f"demo-worker-{n}", stop, crashed),
                                 daemon=True) for n in range(1, workers + 1)]
    for t in threads:
        t.start()
    slow_task = next(s.task_id for s, (_, p) in zip(submissions, TASKS, strict=True)
                     if p.startswith("slow"))
    cancelled = False
    replacement = workers
    live = Live(_table(store, 0), console=console, refresh_per_second=8) if console else None
    if live:
        live.start()
    try:
        while time.monotonic() - started < timeout:
            runs = store.list_runs()
            if not cancelled and any(r["task_id"] == slow_task and r["status"] == S.RUNNING
                                     for r in runs):
                lane.cancel(slow_task)
                cancelled = True
            alive = sum(1 for t in threads[1:] if t.is_alive())
            if alive < workers:  # a worker died: start a replacement, as a supervisor would
                replacement += 1
                t = threading.Thread(target=_work, args=(
                    store, f"demo-worker-{replacement}", stop, crashed), daemon=True)
                t.start()
                threads.append(t)
            if live:
                live.update(_table(store, time.monotonic() - started))
            if all(S(r["status"]) in TERMINAL for r in runs):
                break
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        if live:
            live.update(_table(store, time.monotonic() - started))
            live.stop()
    return _summary(lane, submissions, again, time.monotonic() - started, console, url)


def _summary(lane: Runlane, submissions: list[Any], again: list[Any], wall: float,
             console: Console | None, url: str) -> dict[str, Any]:
    runs = lane.runs()
    details = [lane.run(r["run_id"]) for r in runs]
    attempts = [a for d in details for a in d["attempts"]]
    retried = Counter(a["reason_code"] for a in attempts if a["reason_code"])
    violations = [v.__dict__ for v in lane.audit()]
    summary = {
        "database": url,
        "tasks": len(submissions),
        "duplicate_submits_ignored": sum(1 for s in again if not s.created),
        "runs_by_state": dict(Counter(r["status"] for r in runs)),
        "attempts": len(attempts),
        "attempts_by_reason": dict(retried),
        "cost_usd": round(sum(r["cost_usd"] for r in runs), 3),
        "wall_seconds": round(wall, 2),
        "violations": violations,
    }
    lane.close()
    if console:
        console.print(f"\n[bold]{summary['tasks']} tasks[/bold], "
                      f"{summary['duplicate_submits_ignored']} duplicate submits ignored, "
                      f"{summary['attempts']} attempts in {summary['wall_seconds']}s")
        console.print("runs by state:    " + ", ".join(
            f"{k} {v}" for k, v in sorted(summary["runs_by_state"].items())))
        console.print("attempts ended by: " + ", ".join(
            f"{k} {v}" for k, v in sorted(retried.items())))
        console.print("audit: " + ("all invariants hold" if not violations
                                   else f"[red]{len(violations)} violation(s)[/red]"))
        recovered = next((d["run_id"] for d in details if any(
            a["reason_code"] == Reason.WORKER_LOST for a in d["attempts"])), runs[0]["run_id"])
        console.print(f"\nlook further:\n  runlane --database-url {url} runs list\n"
                      f"  runlane --database-url {url} runs show {recovered}\n"
                      f"  runlane --database-url {url} audit", soft_wrap=True)
    return summary
