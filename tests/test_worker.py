"""The worker with real git repositories, real agent subprocesses and real signals,
on SQLite and PostgreSQL: the drills of seed 000 §32 that involve a worker, drain,
a stale (paused) worker, and the agent-command protocol end to end."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from structlog.testing import capture_logs

from runlane.agents.base import AttemptLimits
from runlane.agents.python import AgentContext, AgentFailed, PythonAgentRunner
from runlane.api import Runlane
from runlane.codehost.local_forge import LocalForge
from runlane.domain.retry import RetryPolicy
from runlane.store.store import Store

from . import pgbouncer
from .conftest import WITH_PGBOUNCER, db_url_with_pgbouncer
from .support import attempts_of, bare_remote, fast_lane, processes_in, run_row, spec

# This suite runs through PgBouncer (transaction pooling) too.
db_url = pytest.fixture(params=WITH_PGBOUNCER)(db_url_with_pgbouncer)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    """A bare repository with one commit on main: a real remote."""
    return bare_remote(tmp_path)


@pytest.fixture
def forge_dir(tmp_path: Path) -> Path:
    return tmp_path / "forge"


def agent_branches(remote: Path) -> list[str]:
    out = subprocess.run(["git", "--git-dir", str(remote), "branch", "--list", "agent/*"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def pull_requests(forge_dir: Path, remote: Path) -> list[Any]:
    return LocalForge(forge_dir).list_pull_requests(str(remote))


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def status_of(store: Store, run_id: str) -> str:
    return str(run_row(store, run_id).status)


# --- real worker processes -------------------------------------------------------------


class WorkerProcess:
    def __init__(self, db_url: str, tmp_path: Path, forge_dir: Path, agent: str,
                 *args: str, env: dict[str, str] | None = None) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        self.env.update({
            "RUNLANE_FORGE_DIR": str(forge_dir),
            "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
            "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
            "RUNLANE_LEASE_TTL_SECONDS": "1.5",
            "RUNLANE_HEARTBEAT_SECONDS": "0.3",
            "RUNLANE_RETRY_BASE_SECONDS": "0.1",
            "RUNLANE_RETRY_MAX_SECONDS": "0.2",
            "RUNLANE_AGENT_TERM_GRACE_SECONDS": "0.5",
            **pgbouncer.listen_env(db_url),
            **(env or {}),
        })
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runlane", "--database-url", db_url, "worker",
             "--agent-command", agent, *args],
            cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float = 30) -> int:
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def workers(db_url: str, tmp_path: Path, forge_dir: Path) -> Iterator[
        Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(agent: str, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        process = WorkerProcess(db_url, tmp_path, forge_dir, agent, *args, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def pstore(db_url: str) -> Iterator[Store]:
    """A store on the database clock, as the worker processes use; its reaper requeues
    with the same short backoff the test workers use."""
    store = Store(db_url, retry_policy=RetryPolicy(base_seconds=0.1, max_seconds=0.2))
    yield store
    store.close()


def reap_until(store: Store, run_id: str, status: str, timeout: float) -> float:
    def reaped() -> bool:
        store.reap_expired_leases()
        return status_of(store, run_id) == status
    return wait_until(reaped, timeout, f"run {run_id} to be {status}")


AGENT_WRITES = "echo agent working; echo change-$RUNLANE_ATTEMPT > change.txt"


def test_drill_3_cancel_while_the_agent_runs(pstore: Store, remote: Path, forge_dir: Path,
                                            workers: Callable[..., WorkerProcess],
                                            tmp_path: Path) -> None:
    [sub] = pstore.submit([spec(repo=str(remote))])
    agent = ("touch \"$RUNLANE_ARTIFACTS_DIR/started\"; echo line before cancel; "
             "echo change > change.txt; sleep 60")
    worker = workers(agent)
    started = tmp_path / "artifacts" / sub.run_id / "1" / "started"
    workspace = tmp_path / "workspaces" / f"{sub.run_id}-1"
    wait_until(lambda: started.exists() and status_of(pstore, sub.run_id) == "RUNNING", 20,
               "the agent to run")
    assert processes_in(workspace)
    pstore.cancel(sub.task_id)
    cancelled_at = time.monotonic()
    gone_after = wait_until(lambda: not processes_in(workspace), 5,
                            "the agent's processes to exit")
    # One heartbeat interval (0.3 s) plus scheduling slack on a loaded 2-core machine; the
    # agent dies on SIGTERM, so the 1 s TERM grace is not needed.
    assert gone_after <= 0.3 + 2.0
    wait_until(lambda: status_of(pstore, sub.run_id) == "CANCELLED", 10, "CANCELLED")
    log = (tmp_path / "artifacts" / sub.run_id / "1" / "agent.log").read_text()
    assert "line before cancel" in log  # partial logs are kept
    assert agent_branches(remote) == []  # nothing was pushed
    assert pull_requests(forge_dir, remote) == []
    assert pstore.side_effects(sub.run_id) == []
    [attempt] = attempts_of(pstore, sub.run_id)
    assert (attempt.status, attempt.reason_code) == ("CANCELLED", "CANCELLED_BY_USER")
    assert time.monotonic() - cancelled_at < 10
    assert pstore.audit() == []
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0


@pytest.mark.parametrize("crash_at", ["after_effect:pull_request", "after_effect:push_branch"])
def test_drill_4_crash_after_the_effect_before_its_record(
        pstore: Store, remote: Path, forge_dir: Path, workers: Callable[..., WorkerProcess],
        crash_at: str) -> None:
    """The worker dies after pushing (or opening the pull request) but before the
    database recorded it. The retry finds the marker and finishes the run without
    running the agent again: exactly one branch and one pull request."""
    [sub] = pstore.submit([spec(repo=str(remote))])
    crashing = workers(AGENT_WRITES, env={"RUNLANE_FAULT_CRASH_AT": crash_at})
    assert crashing.wait(30) == -signal.SIGKILL
    assert len(agent_branches(remote)) == 1
    reap_until(pstore, sub.run_id, "QUEUED", 10)
    # The retry's agent would fail: the retry must not need it.
    retry = workers("exit 1", "--exit-when-idle")
    assert retry.wait(60) == 0
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.outcome, run.attempt_count) == ("SUCCEEDED", "pull_request", 2)
    assert len(agent_branches(remote)) == 1
    [pr] = pull_requests(forge_dir, remote)
    [recorded] = pstore.pull_requests()
    assert recorded["number"] == pr.number
    assert recorded["adopted"] is (crash_at == "after_effect:pull_request")
    assert pstore.audit() == []


def test_sigkilled_worker_run_is_finished_by_another(pstore: Store, remote: Path,
                                                   forge_dir: Path, tmp_path: Path,
                                                   workers: Callable[..., WorkerProcess]
                                                   ) -> None:
    [sub] = pstore.submit([spec(repo=str(remote))])
    agent = ("touch \"$RUNLANE_ARTIFACTS_DIR/started\"; "
             "if [ \"$RUNLANE_ATTEMPT\" = 1 ]; then sleep 60; fi; " + AGENT_WRITES)
    victim = workers(agent)
    started = tmp_path / "artifacts" / sub.run_id / "1" / "started"
    wait_until(lambda: started.exists(), 20, "attempt 1 to run")
    victim.signal(signal.SIGKILL)
    victim.wait()
    try:
        reap_until(pstore, sub.run_id, "QUEUED", 10)
        finisher = workers(agent, "--exit-when-idle")
        assert finisher.wait(60) == 0
    finally:
        for pid in processes_in(tmp_path / "workspaces" / f"{sub.run_id}-1"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # an orphaned agent (none in a sandbox)
    first, second = attempts_of(pstore, sub.run_id)
    assert (first.reason_code, first.lease_status) == ("WORKER_LOST", "EXPIRED")
    assert second.status == "SUCCEEDED" and second.worker_id != first.worker_id
    assert status_of(pstore, sub.run_id) == "SUCCEEDED"
    assert len(pull_requests(forge_dir, remote)) == 1
    assert len(agent_branches(remote)) == 1
    assert pstore.audit() == []
    # Attempt 1's clone too: the next attempt removed it, its worker being dead (it
    # stayed forever before; tests/test_worker_edges.py's review).
    assert sorted(p.name for p in (tmp_path / "workspaces").iterdir()) == []


def test_sigterm_drains_without_new_claims(pstore: Store, remote: Path,
                                           workers: Callable[..., WorkerProcess]) -> None:
    first, second = pstore.submit([spec(repo=str(remote)), spec(repo=str(remote))])
    worker = workers("sleep 1.5; " + AGENT_WRITES, env={"RUNLANE_DRAIN_GRACE_SECONDS": "20"})
    wait_until(lambda: "RUNNING" in {status_of(pstore, first.run_id),
                                     status_of(pstore, second.run_id)}, 20, "a run to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    statuses = sorted([status_of(pstore, first.run_id), status_of(pstore, second.run_id)])
    assert statuses == ["QUEUED", "SUCCEEDED"]  # finished in the grace; nothing new claimed
    queued = first if status_of(pstore, first.run_id) == "QUEUED" else second
    assert run_row(pstore, queued.run_id).attempt_count == 0
    assert {w["status"] for w in _workers(pstore)} == {"STOPPED"}


def test_drain_past_its_grace_gives_the_lease_back(pstore: Store, remote: Path,
                                                   workers: Callable[..., WorkerProcess]
                                                   ) -> None:
    [sub] = pstore.submit([spec(repo=str(remote))])
    worker = workers("sleep 60", env={"RUNLANE_DRAIN_GRACE_SECONDS": "0.3"})
    wait_until(lambda: status_of(pstore, sub.run_id) == "RUNNING", 20, "the run to start")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.reason_code) == ("QUEUED", "LEASE_RELEASED")
    [attempt] = attempts_of(pstore, sub.run_id)
    assert (attempt.lease_status, attempt.reason_code) == ("RELEASED", "LEASE_RELEASED")


def test_a_paused_worker_that_wakes_up_writes_and_pushes_nothing(
        pstore: Store, remote: Path, forge_dir: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    [sub] = pstore.submit([spec(repo=str(remote))])
    agent = "if [ \"$RUNLANE_ATTEMPT\" = 1 ]; then sleep 3; fi; " + AGENT_WRITES
    stale = workers(agent)
    wait_until(lambda: status_of(pstore, sub.run_id) == "RUNNING", 20, "attempt 1 to run")
    stale.signal(signal.SIGSTOP)
    try:
        reap_until(pstore, sub.run_id, "QUEUED", 10)  # paused past its lease
        fresh = workers(agent, "--exit-when-idle")
        assert fresh.wait(60) == 0
        assert status_of(pstore, sub.run_id) == "SUCCEEDED"
        before = pstore.get_run(sub.run_id)
    finally:
        stale.signal(signal.SIGCONT)
    time.sleep(4)  # its agent finishes; its heartbeat and finalizer find the lease gone
    stale.signal(signal.SIGTERM)
    stale.wait(30)
    after = pstore.get_run(sub.run_id)
    assert after["events"] == before["events"]  # nothing written after waking up
    assert after["attempts"] == before["attempts"]
    assert len(pull_requests(forge_dir, remote)) == 1
    assert len(agent_branches(remote)) == 1
    [pr] = pstore.pull_requests()
    assert pr["adopted"] is False
    assert pstore.audit() == []


def _workers(store: Store) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(text("SELECT * FROM workers"))]


# --- the agent-command protocol through an in-process worker ----------------------------


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    with fast_lane(db_url, tmp_path) as lane:
        yield lane


def run_worker(lane: Runlane, forge_dir: Path, agent: str, **options: Any) -> list[str]:
    worker = lane.worker(agent_command=agent, exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(forge_dir), **options)
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return worker.outcomes


def submit_one(lane: Runlane, remote: Path, **fields: Any) -> str:
    return lane.submit("acme", str(remote), "improve the code", **fields).run_id


@pytest.mark.parametrize(
    ("agent", "options", "reason", "status"),
    [
        ("exit 3", {}, "AGENT_FAILED", "FAILED"),
        ("echo '{\"runlane\": \"fail\", \"reason_code\": \"PROVIDER_RATE_LIMIT\", "
         "\"retry_after_seconds\": 0.1, \"message\": \"429\"}'; exit 1", {},
         "PROVIDER_RATE_LIMIT", "FAILED"),
        ("sleep 10", {"limits": AttemptLimits(wall_clock_seconds=0.3)}, "TIMEOUT", "FAILED"),
        ("touch a b c", {"limits": AttemptLimits(max_changed_files=2)}, "LIMIT_EXCEEDED",
         "FAILED"),
        ("seq 1 50 > a", {"limits": AttemptLimits(max_diff_lines=10)}, "LIMIT_EXCEEDED",
         "FAILED"),
        ("touch a", {"verify_command": "exit 1"}, "VERIFIER_FAILED", "FAILED"),
        ("touch a", {"judge": lambda task, ws, result: "too risky"}, "JUDGE_REJECTED",
         "FAILED"),
        ("trap '' TERM; sleep 10", {"limits": AttemptLimits(wall_clock_seconds=0.3)},
         "TIMEOUT", "FAILED"),
    ],
    ids=["exit", "fail-line", "timeout", "files", "lines", "verify", "judge",
         "ignores-sigterm"],
)
def test_agent_outcomes_map_to_reason_codes(lane: Runlane, remote: Path, forge_dir: Path,
                                           agent: str, options: dict[str, Any], reason: str,
                                           status: str) -> None:
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir, agent, **options)
    run = lane.run(run_id)
    assert (run["status"], run["reason_code"]) == (status, reason)
    assert [a["reason_code"] for a in run["attempts"]] == [reason]
    assert agent_branches(remote) == [] and pull_requests(forge_dir, remote) == []


def test_a_retryable_failure_is_retried_then_succeeds(lane: Runlane, remote: Path,
                                                     forge_dir: Path) -> None:
    run_id = submit_one(lane, remote)
    agent = ("if [ \"$RUNLANE_ATTEMPT\" = 1 ]; then echo '{\"runlane\": \"fail\", "
             "\"reason_code\": \"PROVIDER_RATE_LIMIT\", \"retry_after_seconds\": 0.2}'; "
             "exit 1; fi; echo '{\"runlane\": \"cost\", \"usd\": 0.5, \"input_tokens\": 10, "
             "\"output_tokens\": 2}'; echo done > result.txt")
    run_worker(lane, forge_dir, agent)
    run = lane.run(run_id)
    assert (run["status"], run["outcome"], run["cost_usd"]) == ("SUCCEEDED", "pull_request",
                                                                 0.5)
    first, second = run["attempts"]
    assert first["reason_code"] == "PROVIDER_RATE_LIMIT" and first["retry_after_seconds"] == 0.2
    # Due 0.2 s after the failure, the retry starts then, not at the idle worker's next
    # poll (up to IDLE_POLL_MAX_SECONDS; it took 12.6 s before the worker looked again
    # after its empty claim).
    assert 0.2 <= (second["started_at"] - first["ended_at"]).total_seconds() < 5
    assert second["cost_usd"] == 0.5 and second["input_tokens"] == 10


def test_success_opens_one_pull_request_with_the_markers(lane: Runlane, remote: Path,
                                                        forge_dir: Path) -> None:
    run_id = submit_one(lane, remote)
    task_id = lane.run(run_id)["task_id"]
    env_dump = "env | grep ^RUNLANE_ | sort > \"$RUNLANE_ARTIFACTS_DIR/env\"; pwd > where"
    assert run_worker(lane, forge_dir, env_dump, verify_command="test -f where") == [
        "pull_request"]
    branch = f"agent/{task_id}/{run_id}"
    assert agent_branches(remote) == [branch]
    message = subprocess.run(["git", "--git-dir", str(remote), "log", "-1", "--format=%B",
                              branch], capture_output=True, text=True, check=True).stdout
    assert f"Agent-Run-ID: {run_id}" in message
    [pr] = pull_requests(forge_dir, remote)
    assert f"<!-- agent-run-id: {run_id} -->" in pr.body and pr.head_branch == branch
    assert lane.pull_requests()[0]["number"] == pr.number
    env = (Path(lane.settings.artifacts_dir) / run_id / "1" / "env").read_text()
    for name in ("TASK_ID", "RUN_ID", "ATTEMPT", "TENANT", "REPO", "PROMPT", "WORKSPACE",
                 "ARTIFACTS_DIR"):
        assert f"RUNLANE_{name}=" in env
    assert f"RUNLANE_RUN_ID={run_id}" in env and "RUNLANE_ATTEMPT=1" in env
    run = lane.run(run_id)
    assert [e["to_status"] for e in run["events"]] == [
        "QUEUED", "CLAIMED", "PREPARING_SANDBOX", "RUNNING", "VERIFYING", "FINALIZING",
        "SUCCEEDED"]
    assert lane.audit() == []


def test_no_changes_succeeds_without_a_pull_request(lane: Runlane, remote: Path,
                                                   forge_dir: Path) -> None:
    run_id = submit_one(lane, remote)
    assert run_worker(lane, forge_dir, "echo nothing to do") == ["no_changes"]
    assert lane.run(run_id)["outcome"] == "no_changes"
    assert agent_branches(remote) == [] and lane.pull_requests() == []


def test_an_unreachable_repository_is_a_transient_clone_failure(lane: Runlane,
                                                               forge_dir: Path) -> None:
    run_id = lane.submit("acme", "http://127.0.0.1:9/nothing.git", "p", max_attempts=1).run_id
    run_worker(lane, forge_dir, "true")
    assert lane.run(run_id)["reason_code"] == "GIT_CLONE_FAILED_TRANSIENT"


# --- in-process Python agents ---------------------------------------------------------------


def test_python_agent_checkpoints_costs_and_effects(lane: Runlane, remote: Path,
                                                   forge_dir: Path) -> None:
    run_id = submit_one(lane, remote)
    calls: list[str] = []

    def agent(ctx: AgentContext) -> None:
        ctx.checkpoint()
        (ctx.workspace / "notes.md").write_text(ctx.prompt)
        ctx.report_cost(0.25, input_tokens=100, output_tokens=10)
        ctx.effect("notify", find=lambda: None, do=lambda: calls.append("do") or {"id": 1})
        ctx.effect("notify", find=lambda: None, do=lambda: calls.append("again") or {"id": 2})

    worker = lane.worker(agent=PythonAgentRunner(agent), exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(forge_dir))
    worker.run()
    run = lane.run(run_id)
    assert (run["status"], run["outcome"], run["cost_usd"]) == ("SUCCEEDED", "pull_request", 0.25)
    assert calls == ["do"]
    effects = {e.effect_key: e for e in lane.store.side_effects(run_id)}
    assert effects["agent:notify"].result == {"id": 1}
    assert set(effects) == {"agent:notify", "push_branch", "pull_request"}


def test_python_agent_is_cancelled_at_its_next_checkpoint(lane: Runlane, remote: Path,
                                                         forge_dir: Path) -> None:
    sub = lane.submit("acme", str(remote), "long job")
    started = threading.Event()

    def agent(ctx: AgentContext) -> None:
        started.set()
        while True:
            ctx.checkpoint()
            time.sleep(0.02)

    worker = lane.worker(agent=PythonAgentRunner(agent), exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(forge_dir))
    thread = threading.Thread(target=worker.run)
    thread.start()
    assert started.wait(20)
    lane.cancel(sub.task_id)
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert lane.run(sub.run_id)["status"] == "CANCELLED"


def test_python_agent_failure_is_classified(lane: Runlane, remote: Path, forge_dir: Path) -> None:
    run_id = submit_one(lane, remote, max_attempts=1)

    def agent(ctx: AgentContext) -> None:
        raise AgentFailed("PROVIDER_RATE_LIMIT", "429", retry_after_seconds=5)

    lane.worker(agent=PythonAgentRunner(agent), exit_when_idle=True,
                code_host_for=lambda repo: LocalForge(forge_dir)).run()
    [attempt] = lane.run(run_id)["attempts"]
    assert (attempt["reason_code"], attempt["retry_after_seconds"]) == ("PROVIDER_RATE_LIMIT", 5)


def test_up_runs_workers_and_drains_them_on_sigterm(db_url: str, pstore: Store, remote: Path,
                                                   forge_dir: Path, tmp_path: Path) -> None:
    subs = pstore.submit([spec(repo=str(remote)) for _ in range(4)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"RUNLANE_FORGE_DIR": str(forge_dir),
                "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
                "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
                "RUNLANE_HEARTBEAT_SECONDS": "0.3"})
    up = subprocess.Popen([sys.executable, "-m", "runlane", "--database-url", db_url, "up",
                           "--workers", "2", "--agent-command", AGENT_WRITES],
                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: all(status_of(pstore, s.run_id) == "SUCCEEDED" for s in subs), 60,
                   "every run to succeed")
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # never leave its workers behind
            os.killpg(up.pid, signal.SIGKILL)
        up.wait()
    assert len(pull_requests(forge_dir, remote)) == 4
    statuses = [w["status"] for w in _workers(pstore)]
    assert statuses == ["STOPPED", "STOPPED"]


def test_a_failed_attempts_workspace_is_kept_when_asked(lane: Runlane, remote: Path,
                                                       forge_dir: Path) -> None:
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir, "echo partial > work.txt; exit 2", keep_failed_workspaces=True)
    kept = Path(lane.settings.workspace_dir) / f"{run_id}-1"
    assert (kept / "work.txt").read_text() == "partial\n"
    ok = submit_one(lane, remote)
    run_worker(lane, forge_dir, "echo done > work.txt", keep_failed_workspaces=True)
    assert not (Path(lane.settings.workspace_dir) / f"{ok}-1").exists()  # success: removed


def test_an_agent_cannot_report_a_worker_only_reason(lane: Runlane, remote: Path,
                                                     forge_dir: Path) -> None:
    """Otherwise an agent could claim it was drained (no attempt charged, no delay)
    and loop forever."""
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir,
               "echo '{\"runlane\": \"fail\", \"reason_code\": \"LEASE_RELEASED\"}'; exit 1")
    run = lane.run(run_id)
    assert (run["status"], run["reason_code"], run["attempt_count"]) == (
        "FAILED", "AGENT_FAILED", 1)


def test_workers_drain_when_their_supervisor_is_killed(db_url: str, pstore: Store,
                                                       tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env["RUNLANE_HEARTBEAT_SECONDS"] = "0.3"
    up = subprocess.Popen([sys.executable, "-m", "runlane", "--database-url", db_url, "up",
                           "--workers", "2", "--agent-command", "true"],
                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: len(_workers(pstore)) == 2, 30, "two workers to register")
        up.kill()  # the supervisor alone; its workers are not signalled by anyone
        up.wait()
        wait_until(lambda: {w["status"] for w in _workers(pstore)} == {"STOPPED"}, 30,
                   "the orphaned workers to drain and stop")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)


def test_logs_carry_the_task_run_attempt_lease_and_worker_ids(lane: Runlane, remote: Path,
                                                               forge_dir: Path) -> None:
    run_id = submit_one(lane, remote)
    with capture_logs() as logs:
        run_worker(lane, forge_dir, AGENT_WRITES)
    finished = [e for e in logs if e["event"] == "attempt_finished"]
    assert len(finished) == 1
    entry = finished[0]
    assert entry["run_id"] == run_id and entry["attempt_id"] == f"{run_id}/1"
    assert entry["fencing_token"] == 1 and entry["ended"] == "pull_request"
    assert entry["task_id"] and entry["worker_id"].count("/") == 2
    effects = [e for e in logs if e["event"] == "side_effect_done"]
    assert {e["effect"] for e in effects} == {"push_branch", "pull_request"}
    assert all(e["fencing_token"] == 1 and e["attempt_id"] == f"{run_id}/1" for e in effects)


# --- the scheduler's checks inside a worker ------------------------------------------------


def test_a_run_over_its_cost_limit_is_stopped_with_limit_exceeded(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    from runlane.domain.policy import parse_policy

    lane.store.apply_policy(parse_policy("[defaults.limits]\nmax_cost_usd = 0.5\n"),
                            source="test")
    run_id = submit_one(lane, remote, max_attempts=1)
    cost = "echo '{\"runlane\": \"cost\", \"usd\": 0.4}'"
    run_worker(lane, forge_dir, f"{cost}; {cost}; sleep 10")
    run = lane.run(run_id)
    assert (run["status"], run["reason_code"]) == ("FAILED", "LIMIT_EXCEEDED")
    assert run["cost_usd"] == pytest.approx(0.8)
    # The message gives the figures (it said only "limit_exceeded": a review).
    assert "0.5" in run["message"] and "0.8" in run["message"], run["message"]
    assert agent_branches(remote) == [] and pull_requests(forge_dir, remote) == []


def test_policy_denies_after_the_agent_ran_nothing_is_pushed(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """Invariant 7, third check: the policy changes while the agent works; the push
    is refused, the run ends POLICY_DENIED, and no branch or pull request appears."""
    from runlane.domain.policy import parse_policy

    lane.store.apply_policy(parse_policy("[defaults]\nqueue = 'default'\n"), source="v1")
    run_id = submit_one(lane, remote)

    def agent(ctx: AgentContext) -> None:
        (ctx.workspace / "notes.md").write_text("change")
        lane.store.apply_policy(parse_policy(
            "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'deny'\n"
            "reason_code = 'TENANT_SUSPENDED'\n"), source="v2")

    worker = lane.worker(agent=PythonAgentRunner(agent), exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(forge_dir))
    worker.run()
    run = lane.run(run_id)
    assert (run["status"], run["reason_code"]) == ("POLICY_DENIED", "POLICY_DENIED")
    assert "policy v2" in run["attempts"][0]["message"]
    assert "v1" in run["attempts"][0]["message"]
    assert agent_branches(remote) == [] and pull_requests(forge_dir, remote) == []
    assert lane.store.side_effects(run_id) == []


def test_a_worker_only_claims_runs_its_capabilities_satisfy(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    needs_java = submit_one(lane, remote, requires={"jdk": ">=21"})
    plain = submit_one(lane, remote)
    outcomes = run_worker(lane, forge_dir, "true", capabilities={"jdk": "17.0.9"})
    assert outcomes == ["no_changes"]
    assert lane.run(plain)["status"] == "SUCCEEDED"
    assert lane.run(needs_java)["status"] == "QUEUED"
    run_worker(lane, forge_dir, "true", capabilities={"jdk": "21.0.1"})
    assert lane.run(needs_java)["status"] == "SUCCEEDED"
