"""``runlane demo``: the main job on the embedded default (SQLite), start to finish.

It makes a small fleet of local git repositories (bare repositories are real
remotes), submits tasks for two tenants, and runs three real ``runlane worker``
processes with the bundled scripted agent (``runlane.demo_agent``), which edits
files, sometimes reports PROVIDER_RATE_LIMIT and is sometimes slow. Midway it
SIGKILLs the worker process running one run (the reaper recovers the run and
another worker finishes it) and cancels one task while its agent runs. A policy is
applied first: acme weighs twice globex in the fair share, each tenant may run 3
runs at once, and the legal repository is closed to autonomous agents (its task
is denied at admission). A live
table shows runs by state; the summary counts runs, attempts by reason, branches
and pull requests, and says how to look further. The database stays.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from runlane.api import Runlane
from runlane.domain.policy import parse_policy
from runlane.domain.states import TERMINAL, RunStatus
from runlane.errors import RunlaneError
from runlane.services.maintenance import Reaper, ReaperConfig, Reconciler, ReconcilerConfig
from runlane.services.scheduler import Scheduler, SchedulerConfig
from runlane.services.supervisor import WorkerPool
from runlane.settings import Settings

S = RunStatus
REPOS = ("acme-api", "acme-web", "globex-shop", "acme-legal")
KILL_PROMPT = "slow: migrate the build to the new toolchain"
CANCEL_PROMPT = "slow: rewrite the search indexer"
TASKS: list[tuple[str, str, str]] = [
    ("acme", "acme-api", "rename the deprecated config flag"),
    ("acme", "acme-api", "fix the flaky login test"),
    ("acme", "acme-web", "rate-limit: bump the HTTP client and update call sites"),
    ("acme", "acme-web", KILL_PROMPT),
    ("acme", "acme-api", "add type hints to the billing module"),
    ("acme", "acme-web", CANCEL_PROMPT),
    ("acme", "acme-api", "noop: check the changelog is up to date"),
    ("globex", "globex-shop", "update the README install section"),
    ("globex", "globex-shop", "remove dead feature flags"),
    ("globex", "globex-shop", "rate-limit: regenerate the API client"),
    ("globex", "globex-shop", "fix the timezone bug in reports"),
    ("globex", "globex-shop", "add a health check endpoint"),
    ("acme", "acme-legal", "reword the privacy policy"),
]
DEMO_POLICY = """
[concurrency]
per_tenant_max_active = 3

[tenants.acme]
weight = 2.0

[tenants.globex]
weight = 1.0

[[repositories]]
match = "*/acme-legal.git"
autonomous_agents = false
message = "legal documents are edited by people only"
"""
WORKER_ENV = {
    "RUNLANE_LEASE_TTL_SECONDS": "3",
    "RUNLANE_HEARTBEAT_SECONDS": "0.4",
    "RUNLANE_RETRY_BASE_SECONDS": "0.5",
    "RUNLANE_RETRY_MAX_SECONDS": "2",
    "RUNLANE_DRAIN_GRACE_SECONDS": "5",
    "RUNLANE_AGENT_TERM_GRACE_SECONDS": "1",
    "DEMO_AGENT_SLOW_SECONDS": "4",
}


def _git(*args: str, cwd: Path | None = None) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "demo", "GIT_AUTHOR_EMAIL": "demo@local",
                        "GIT_COMMITTER_NAME": "demo", "GIT_COMMITTER_EMAIL": "demo@local"})


def make_fleet(root: Path) -> dict[str, Path]:
    """Bare repositories with one commit each: the remotes the workers push to."""
    root.mkdir(parents=True, exist_ok=True)
    fleet: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in REPOS:
            seed = Path(scratch) / name
            _git("init", "-q", "-b", "main", str(seed))
            (seed / "README.md").write_text(f"# {name}\n")
            _git("add", "README.md", cwd=seed)
            _git("commit", "-q", "-m", "initial commit", cwd=seed)
            bare = root / f"{name}.git"
            _git("clone", "-q", "--bare", str(seed), str(bare))
            fleet[name] = bare
    return fleet


def _table(runs: list[dict[str, Any]], elapsed: float, note: str) -> Table:
    counts = Counter(r["status"] for r in runs)
    table = Table(title=f"runlane demo - {elapsed:4.1f}s", caption=note)
    table.add_column("state")
    table.add_column("runs", justify="right")
    for status in S:
        if counts.get(status.value):
            table.add_row(status.value, str(counts[status.value]))
    return table


class DemoDirectoryInvalid(RunlaneError):
    exit_code = 2


# Written into the demo's directory: only a directory that holds it (an earlier
# demo's) is emptied by the next demo. It used to be deleted whatever it held.
MARKER = ".runlane-demo"


def _fresh_directory(directory: Path) -> Path:
    """``directory``, empty but for the marker: an earlier demo's is emptied; an
    existing file, or a directory with anything else in it, is refused."""
    if directory.exists() or directory.is_symlink():
        if not directory.is_dir() or directory.is_symlink():
            raise DemoDirectoryInvalid(f"--directory {directory} exists and is not a directory")
        earlier = (directory / MARKER).exists() or (  # or one from before the marker
            (directory / "runlane.db").is_file() and (directory / "repos").is_dir())
        if not earlier and any(directory.iterdir()):
            raise DemoDirectoryInvalid(
                f"--directory {directory} holds files of its own (no {MARKER}): the "
                "demo empties its directory; choose a new or empty one")
        shutil.rmtree(directory)
    try:
        directory.mkdir(parents=True)
        (directory / MARKER).write_text("runlane demo: the next demo empties this directory\n")
    except OSError as exc:
        raise DemoDirectoryInvalid(
            f"--directory {directory}: cannot create it: {exc.strerror}") from None
    return directory.resolve()


def run_demo(directory: Path, console: Console | None = None, *, workers: int = 3,
             timeout: float = 90.0) -> dict[str, Any]:
    started = time.monotonic()
    directory = _fresh_directory(directory)
    url = f"sqlite:///{directory / 'runlane.db'}"
    fleet = make_fleet(directory / "repos")
    env = {**WORKER_ENV, "RUNLANE_FORGE_DIR": str(directory / "forge"),
           "RUNLANE_ARTIFACTS_DIR": str(directory / "artifacts"),
           "RUNLANE_WORKSPACE_DIR": str(directory / "workspaces"),
           "RUNLANE_LOG_LEVEL": "WARNING"}
    lane = Runlane(settings=Settings(database_url=url, lease_ttl_seconds=3,
                                     heartbeat_seconds=0.4, agent_term_grace_seconds=1,
                                     retry_base_seconds=0.5,
                                     retry_max_seconds=2))
    # The agents run in the workers' sandbox (SANDBOX, bwrap unless set otherwise):
    # refused here, with the fix, rather than by workers restarted forever.
    for name in ("workspaces", "artifacts"):
        (directory / name).mkdir()
    sandbox = lane.sandbox(directory / "workspaces", directory / "artifacts")
    sandbox.check(workspace_root=directory / "workspaces",
                  artifacts_root=directory / "artifacts")
    passed = os.environ.get("RUNLANE_SANDBOX_PASS_ENV", "")
    env["RUNLANE_SANDBOX_PASS_ENV"] = ",".join(p for p in (passed, "DEMO_AGENT_SLOW_SECONDS")
                                               if p)
    lane.upgrade_schema()
    lane.store.apply_policy(parse_policy(DEMO_POLICY, source="demo policy"), source="demo")
    rows = [{"tenant": tenant, "repo": str(fleet[repo]), "prompt": prompt,
             "idempotency_key": f"demo-{i}",
             "priority": "high" if prompt.startswith("fix") else "normal"}
            for i, (tenant, repo, prompt) in enumerate(TASKS)]
    submissions = lane.submit_batch(rows)
    again = lane.submit_batch(rows[:2])  # a duplicate submit creates nothing
    by_prompt = {prompt: sub for (_, _, prompt), sub in zip(TASKS, submissions, strict=True)}

    stop = threading.Event()
    services = [Reaper(lane.store, ReaperConfig(interval_seconds=0.25)),
                Reconciler(lane.store, ReconcilerConfig(interval_seconds=1.0)),
                Scheduler(lane.store, SchedulerConfig(interval_seconds=1.0))]
    threads = [threading.Thread(target=s.run_forever, args=(stop,), daemon=True)
               for s in services]
    for t in threads:
        t.start()
    pool = WorkerPool(["--agent-command", f"{sys.executable} -m runlane.demo_agent",
                       "--concurrency", "2"], workers, database_url=url, env=env,
                      stderr=subprocess.DEVNULL)
    pool.start()
    killed: int | None = None
    cancelled = False
    note = "starting workers"
    live = Live(_table([], 0, note), console=console, refresh_per_second=8,
                transient=False) if console else None
    if live:
        live.start()
    try:
        while time.monotonic() - started < timeout:
            runs = lane.runs()
            status = {r["run_id"]: r["status"] for r in runs}
            victim = by_prompt[KILL_PROMPT].run_id
            if killed is None and status[victim] == S.RUNNING:
                worker_id = lane.run(victim)["attempts"][-1]["worker_id"]
                killed = int(worker_id.split("/")[1])
                os.kill(killed, signal.SIGKILL)
                note = f"SIGKILLed worker process {killed} in the middle of a run"
            target = by_prompt[CANCEL_PROMPT]
            if not cancelled and status[target.run_id] == S.RUNNING:
                lane.cancel(target.task_id)
                cancelled = True
                note = "cancelled a task while its agent runs"
            pool.supervise()
            if live:
                live.update(_table(runs, time.monotonic() - started, note))
            if all(S(s) in TERMINAL for s in status.values()):
                break
            time.sleep(0.1)
    finally:
        pool.stop(grace_seconds=10)
        stop.set()
        for t in threads:
            t.join(timeout=5)
        if live:
            live.update(_table(lane.runs(), time.monotonic() - started, "done"))
            live.stop()
    summary = _summary(lane, submissions, again, fleet, time.monotonic() - started,
                       killed, pool.restarts, url)
    summary["sandbox"] = sandbox.mode
    # A token to look at the demo's runs in the dashboard: admin (both tenants), for a
    # week; only its hash stays in the database.
    token = lane.create_token(role="admin", name="demo",
                              expires_at=datetime.now(UTC) + timedelta(days=7))
    summary["dashboard"] = {"command": f".venv/bin/runlane --database-url {url} serve",
                            "url": "http://127.0.0.1:8080/", "token": token.token}
    lane.close()
    if console:
        _print_summary(console, summary, url)
    return summary


def _summary(lane: Runlane, submissions: list[Any], again: list[Any], fleet: dict[str, Path],
             wall: float, killed: int | None, restarts: int, url: str) -> dict[str, Any]:
    runs = lane.runs()
    attempts = [(r["run_id"], a) for r in runs for a in lane.run(r["run_id"]).attempts]
    pull_requests = lane.pull_requests()
    branches = 0
    for bare in fleet.values():
        listed = subprocess.run(["git", "--git-dir", str(bare), "branch", "--list", "agent/*"],
                                capture_output=True, text=True, check=True).stdout
        branches += len(listed.split())
    recovered = next((run_id for run_id, a in attempts if a.reason_code == "WORKER_LOST"),
                     None)
    return {
        "database": url,
        "tasks": len(submissions),
        "duplicate_submits_ignored": sum(1 for s in again if not s.created),
        "admission": dict(Counter(
            f"{(r['admission'] or {}).get('decision')}"
            + (f" {r['reason_code']}" if (r["admission"] or {}).get("decision") != "ADMIT"
               else "") for r in runs)),
        "peak_active_per_tenant": _peak_active(lane),
        "runs_by_state": dict(Counter(r["status"] for r in runs)),
        "outcomes": dict(Counter(r["outcome"] for r in runs if r["outcome"])),
        "attempts": len(attempts),
        "attempts_by_reason": dict(Counter(a.reason_code for _, a in attempts
                                           if a.reason_code)),
        "retries": len(attempts) - len(runs),
        "pull_requests": len(pull_requests),
        "agent_branches": branches,
        "worker_killed": killed,
        "worker_restarts": restarts,
        "recovered_run": recovered,
        "cost_usd": round(sum(r["cost_usd"] for r in runs), 3),
        "wall_seconds": round(wall, 2),
        "violations": [v.__dict__ for v in lane.audit()],
    }


def _peak_active(lane: Runlane) -> dict[str, int]:
    """The most runs each tenant had leased at one instant (its limit is 3)."""
    spans: dict[str, list[tuple[float, int]]] = {}
    for r in lane.runs():
        for a in lane.run(r["run_id"])["attempts"]:
            end = a["lease_ended_at"] or a["ended_at"] or a["lease_expires_at"]
            spans.setdefault(r["tenant"], []).extend([(a["started_at"], 1), (end, -1)])
    peaks: dict[str, int] = {}
    for tenant, points in spans.items():
        active = peak = 0
        for _, step in sorted(points):
            active += step
            peak = max(peak, active)
        peaks[tenant] = peak
    return peaks


def _print_summary(console: Console, summary: dict[str, Any], url: str) -> None:
    def line(label: str, counts: dict[str, int]) -> None:
        text = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        console.print(f"{label:<20}{text}", soft_wrap=True)

    console.print(f"\n[bold]{summary['tasks']} tasks, {summary['attempts']} attempts, "
                  f"{summary['retries']} retries in {summary['wall_seconds']}s[/bold] "
                  f"({summary['duplicate_submits_ignored']} duplicate submits ignored)")
    line("admission:", summary["admission"])
    line("peak active:", summary["peak_active_per_tenant"])
    line("runs by state:", summary["runs_by_state"])
    line("outcomes:", summary["outcomes"])
    line("attempts ended by:", summary["attempts_by_reason"])
    console.print(f"{'pull requests:':<20}{summary['pull_requests']} opened, "
                  f"{summary['agent_branches']} agent branches pushed")
    console.print(f"{'recovery:':<20}worker {summary['worker_killed']} SIGKILLed, "
                  f"{summary['worker_restarts']} worker restart(s), cost "
                  f"${summary['cost_usd']}")
    console.print(f"{'sandbox:':<20}" + (
        "every agent ran in bubblewrap (SANDBOX=bwrap)" if summary["sandbox"] == "bwrap"
        else "[red]off (SANDBOX=off): agents ran unconfined[/red]"))
    violations = summary["violations"]
    console.print("audit:              " + ("all invariants hold" if not violations
                                           else f"[red]{len(violations)} violation(s)[/red]"))
    show = summary["recovered_run"] or ""
    console.print(f"\nlook further:\n  .venv/bin/runlane --database-url {url} runs list\n"
                  f"  .venv/bin/runlane --database-url {url} runs show {show}\n"
                  f"  .venv/bin/runlane --database-url {url} prs list\n"
                  f"  .venv/bin/runlane --database-url {url} audit", soft_wrap=True)
    dashboard = summary["dashboard"]
    console.print("\n[bold]see it in a browser:[/bold]", soft_wrap=True)
    console.print(f"  {dashboard['command']}", soft_wrap=True, markup=False,
                  highlight=False)
    console.print(f"  then open {dashboard['url']} and sign in with this token (admin, "
                  f"valid 7 days, shown once):\n  {dashboard['token']}", soft_wrap=True,
                  markup=False, highlight=False)
