"""Every limit of the policy is enforced (issue 22, item 8): through a real worker on
SQLite and PostgreSQL, each over its limit ends the run LIMIT_EXCEEDED with the limit
named in its message. The agent-cooperation limits (tool calls, iterations, shell
command seconds) come from control lines or an in-process agent's context; tokens
from the cost line, counted per run like cost; verifier minutes by the worker; the
process tree's limits from the run's snapshot, with a fork bomb and a memory hog
under a real `runlane worker` that goes on serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runlane.agents.python import AgentContext, AgentStopped, PythonAgentRunner
from runlane.api import Runlane
from runlane.codehost.local_forge import LocalForge
from runlane.domain.policy import parse_policy
from runlane.store.store import Store

from .resource_support import FORK_BOMB, MEMORY_HOG, confined, live_processes_of, unused_uid
from .support import bare_remote, fast_lane

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    return bare_remote(tmp_path)


@pytest.fixture
def forge_dir(tmp_path: Path) -> Path:
    return tmp_path / "forge"


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    with fast_lane(db_url, tmp_path) as lane:
        yield lane


@pytest.fixture
def bomb_uid() -> Iterator[int]:
    yield from unused_uid()


def limits(lane: Runlane, **values: Any) -> None:
    text = "[defaults.limits]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
    lane.store.apply_policy(parse_policy(text), source="test")


def run_one(lane: Runlane, remote: Path, forge_dir: Path, agent: str | PythonAgentRunner, *,
            max_attempts: int = 1, **options: Any) -> dict[str, Any]:
    """Submit one run, work it off with an in-process worker, return it; also how long
    the worker took (``elapsed``): an agent stopped by a limit does not run on."""
    run_id = lane.submit("acme", str(remote), "improve the code",
                         max_attempts=max_attempts).run_id
    if isinstance(agent, str):
        options["agent_command"] = agent
    else:
        options["agent"] = agent
    worker = lane.worker(exit_when_idle=True, code_host_for=lambda repo: LocalForge(forge_dir),
                         **options)
    started = time.monotonic()
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    run = lane.run(run_id).model_dump()
    run["elapsed"] = time.monotonic() - started
    return run


def line(**fields: Any) -> str:
    return f"echo '{json.dumps(fields)}'"


def assert_over(run: dict[str, Any], message_start: str) -> None:
    assert (run["status"], run["reason_code"]) == ("FAILED", "LIMIT_EXCEEDED"), run
    assert run["message"].startswith(message_start), run["message"]
    # Stopped at once: every agent here would otherwise sleep 60 s.
    assert run["elapsed"] < 30, run["elapsed"]


# --- limits that need the agent's cooperation -------------------------------------------


def test_tool_calls_over_the_limit(lane: Runlane, remote: Path, forge_dir: Path) -> None:
    limits(lane, max_tool_calls=2)
    agent = "; ".join([
        line(runlane="tool_call", id="a", name="read_file"),
        line(runlane="tool_call", id="a", seconds=0.1),  # its end: the same call
        line(runlane="tool_call", id="b", name="bash"),
        line(runlane="tool_call", id="c", name="edit"),
        "sleep 60"])
    assert_over(run_one(lane, remote, forge_dir, agent),
                "max_tool_calls 2 exceeded: 3 tool calls")


def test_tool_calls_within_the_limit_do_not_stop_the_agent(lane: Runlane, remote: Path,
                                                          forge_dir: Path) -> None:
    limits(lane, max_tool_calls=2, max_agent_iterations=1, max_shell_command_seconds=30)
    agent = "; ".join([
        line(runlane="iteration"),
        line(runlane="tool_call", id=1, name="bash", shell=True),
        line(runlane="tool_call", id=1, seconds=0.2),
        line(runlane="tool_call", id=2, name="edit"),
        "echo done > done.txt"])
    run = run_one(lane, remote, forge_dir, agent)
    assert (run["status"], run["outcome"]) == ("SUCCEEDED", "pull_request"), run


def test_iterations_over_the_limit(lane: Runlane, remote: Path, forge_dir: Path) -> None:
    limits(lane, max_agent_iterations=2)
    agent = "; ".join([line(runlane="iteration")] * 3 + ["sleep 60"])
    assert_over(run_one(lane, remote, forge_dir, agent),
                "max_agent_iterations 2 exceeded: 3 iterations")


def test_a_shell_command_over_its_seconds_is_stopped_while_it_runs(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    limits(lane, max_shell_command_seconds=0.5)
    agent = "; ".join([line(runlane="tool_call", id="c1", name="bash", shell=True), "sleep 60"])
    run = run_one(lane, remote, forge_dir, agent)
    assert_over(run, "max_shell_command_seconds 0.5 exceeded: tool call c1 (bash) has run")


def test_a_shell_command_reported_after_it_ran_too_long(lane: Runlane, remote: Path,
                                                        forge_dir: Path) -> None:
    limits(lane, max_shell_command_seconds=2)
    agent = "; ".join([
        line(runlane="tool_call", id="c1", name="bash", shell=True, seconds=3), "sleep 60"])
    assert_over(run_one(lane, remote, forge_dir, agent),
                "max_shell_command_seconds 2 exceeded: tool call c1 (bash) ran 3.0 s")


@pytest.mark.parametrize("kind", ["input", "output"])
def test_tokens_are_counted_per_run_across_attempts(lane: Runlane, remote: Path,
                                                    forge_dir: Path, kind: str) -> None:
    """60 tokens in the first attempt, which then fails retryably; 60 more in the
    second: 120 over the run's 100, although neither attempt alone is over it."""
    limits(lane, **{f"max_model_{kind}_tokens": 100})
    cost = line(runlane="cost", usd=0.01, **{f"{kind}_tokens": 60})
    retry = line(runlane="fail", reason_code="PROVIDER_RATE_LIMIT", retry_after_seconds=0.1)
    agent = (f'{cost}; if [ "$RUNLANE_ATTEMPT" = 1 ]; then {retry}; exit 1; fi; sleep 60')
    run = run_one(lane, remote, forge_dir, agent, max_attempts=3)
    assert_over(run, f"max_model_{kind}_tokens 100 exceeded: run {run['run_id']} has used "
                     f"120 {kind} tokens")
    assert [a["reason_code"] for a in run["attempts"]] == ["PROVIDER_RATE_LIMIT",
                                                           "LIMIT_EXCEEDED"]
    # The crossing is recorded on the run and on the attempt that crossed it (issue 29).
    first, second = run["attempts"]
    assert first["cost_exceeded_at"] is None
    assert run["cost_exceeded_at"] == second["cost_exceeded_at"] is not None


def test_the_cost_limit_names_itself(lane: Runlane, remote: Path, forge_dir: Path) -> None:
    limits(lane, max_cost_usd=0.5)
    agent = f"{line(runlane='cost', usd=0.3)}; {line(runlane='cost', usd=0.3)}; sleep 60"
    run = run_one(lane, remote, forge_dir, agent)
    assert_over(run, "max_cost_usd 0.5 exceeded: run ")
    # When the limit was crossed, on the run and its attempt (issue 29): by the second
    # report, after the attempt started, before it ended.
    [attempt] = run["attempts"]
    assert run["cost_exceeded_at"] == attempt["cost_exceeded_at"]
    assert attempt["started_at"] <= run["cost_exceeded_at"] <= attempt["ended_at"]


@pytest.mark.parametrize(("limit", "agent", "message"), [
    ("max_changed_files", "touch a b c", "max_changed_files 2 exceeded: 3 changed files"),
    ("max_diff_lines", "seq 1 50 > a", "max_diff_lines 2 exceeded: 50 changed lines"),
])
def test_the_size_limits_name_themselves(lane: Runlane, remote: Path, forge_dir: Path,
                                         limit: str, agent: str, message: str) -> None:
    limits(lane, **{limit: 2})
    assert_over(run_one(lane, remote, forge_dir, agent), message)


# --- verifier minutes -------------------------------------------------------------------


def test_a_verify_command_over_max_verifier_minutes(lane: Runlane, remote: Path,
                                                    forge_dir: Path) -> None:
    limits(lane, max_verifier_minutes=0.01, max_wall_clock_minutes=10)
    run = run_one(lane, remote, forge_dir, "touch a", verify_command="sleep 60")
    assert_over(run, "max_verifier_minutes 0.01 exceeded: the verify command ran")


def test_a_verify_command_past_the_runs_wall_clock_is_a_timeout(lane: Runlane, remote: Path,
                                                                 forge_dir: Path) -> None:
    """The run's wall clock ends first: TIMEOUT (retryable), not the verifier's limit."""
    limits(lane, max_verifier_minutes=10, max_wall_clock_minutes=0.02)
    run = run_one(lane, remote, forge_dir, "touch a", verify_command="sleep 60")
    assert (run["status"], run["reason_code"]) == ("FAILED", "TIMEOUT"), run


# --- in-process agents ------------------------------------------------------------------


def test_in_process_agents_are_held_to_the_same_counts(lane: Runlane, remote: Path,
                                                       forge_dir: Path) -> None:
    limits(lane, max_tool_calls=3, max_agent_iterations=5)
    calls: list[str] = []

    def agent(ctx: AgentContext) -> None:
        for step in range(10):
            ctx.iteration()
            ctx.tool_call("read_file")
            calls.append(f"call {step}")

    run = run_one(lane, remote, forge_dir, PythonAgentRunner(agent))
    assert_over(run, "max_tool_calls 3 exceeded: 4 tool calls")
    assert calls == ["call 0", "call 1", "call 2"]  # the fourth raised AgentStopped


def test_an_in_process_shell_command_over_its_seconds(lane: Runlane, remote: Path,
                                                      forge_dir: Path) -> None:
    limits(lane, max_shell_command_seconds=0.2, max_agent_iterations=2)
    stopped: list[str] = []

    def agent(ctx: AgentContext) -> None:
        try:
            with ctx.tool_call("bash", shell=True):
                subprocess.run(["sleep", "0.5"], check=True)
        except AgentStopped as stop:
            stopped.append(stop.reason.value)
            raise

    run = run_one(lane, remote, forge_dir, PythonAgentRunner(agent))
    assert_over(run, "max_shell_command_seconds 0.2 exceeded: tool call py-0 (bash) ran")
    assert stopped == ["limit_exceeded"]


# --- the process tree, under a real worker process ----------------------------------------


def test_a_fork_bomb_and_a_memory_hog_end_limit_exceeded_and_the_worker_serves_on(
        db_url: str, tmp_path: Path, remote: Path, forge_dir: Path, bomb_uid: int) -> None:
    store = Store(db_url)
    try:
        store.apply_policy(parse_policy(
            "[defaults.limits]\nmax_processes = 64\nmax_memory_mb = 128\n"
            "max_wall_clock_minutes = 1\n"), source="test")
        # One agent command; each run's prompt says what it does.
        agent = (f'case "$RUNLANE_PROMPT" in '
                 f'bomb) {confined(FORK_BOMB + "; sleep 60", bomb_uid)} ;; '
                 f'hog) {MEMORY_HOG} ;; '
                 f'*) echo served > served.txt ;; esac')
        runs = {prompt: store.submit([_spec(remote, prompt)])[0].run_id
                for prompt in ("bomb", "hog", "plain")}
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        env.update({"RUNLANE_FORGE_DIR": str(forge_dir),
                    "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
                    "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
                    "RUNLANE_HEARTBEAT_SECONDS": "0.3", "RUNLANE_AGENT_TERM_GRACE_SECONDS": "0.5",
                    # The bomb's safety net changes user, which the sandbox forbids
                    # (tests/test_resources.py runs the hog and the watch sandboxed).
                    "RUNLANE_SANDBOX": "off"})
        worker = subprocess.Popen(
            [sys.executable, "-m", "runlane", "--database-url", db_url, "worker",
             "--agent-command", agent], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                states = {p: store.get_run(r)["status"] for p, r in runs.items()}
                if all(s in ("SUCCEEDED", "FAILED") for s in states.values()):
                    break
                assert worker.poll() is None, worker.stderr.read().decode()[-3000:]
                time.sleep(0.1)
            ended = {p: store.get_run(r) for p, r in runs.items()}
            assert worker.poll() is None  # still serving
        finally:
            worker.kill()
            worker.wait()
        assert (ended["bomb"]["status"], ended["bomb"]["reason_code"]) == (
            "FAILED", "LIMIT_EXCEEDED"), ended["bomb"]
        assert ended["bomb"]["message"].startswith("max_processes 64 exceeded")
        assert (ended["hog"]["status"], ended["hog"]["reason_code"]) == (
            "FAILED", "LIMIT_EXCEEDED"), ended["hog"]
        assert ended["hog"]["message"].startswith("max_memory_mb 128 exceeded")
        assert ended["plain"]["status"] == "SUCCEEDED", ended["plain"]
        assert live_processes_of(bomb_uid) == []
    finally:
        store.close()


def _spec(remote: Path, prompt: str) -> Any:
    from .support import spec
    return spec(repo=str(remote), prompt=prompt, max_attempts=1)


# --- the control lines and the policy -----------------------------------------------------


def test_tool_call_and_iteration_lines_parse_and_bad_ones_are_refused() -> None:
    from runlane.agents.command import (
        IterationReport,
        MalformedControlLine,
        ToolCallReport,
        parse_control_line,
    )

    assert parse_control_line('{"runlane": "iteration"}') == IterationReport()
    assert parse_control_line('{"runlane": "tool_call", "id": "c1", "name": "bash"}') == (
        ToolCallReport("c1", "bash"))
    assert parse_control_line(
        '{"runlane": "tool_call", "id": 7, "shell": true, "seconds": 2}') == (
        ToolCallReport("7", None, shell=True, seconds=2.0))
    assert parse_control_line('{"runlane": "tool_call"}') == ToolCallReport()
    for bad in ('{"runlane": "tool_call", "id": ["a"]}',
                '{"runlane": "tool_call", "name": 5}',
                '{"runlane": "tool_call", "shell": "yes"}',
                '{"runlane": "tool_call", "seconds": -1}',
                '{"runlane": "tool_call", "seconds": "long"}'):
        with pytest.raises(MalformedControlLine):
            parse_control_line(bad)


def test_every_limit_the_policy_accepts_is_enforced_and_documented() -> None:
    from runlane.domain.policy import LIMIT_ENFORCEMENT, Limits, unenforced

    assert set(LIMIT_ENFORCEMENT) == set(Limits.model_fields)
    # The guard: a limit field nothing enforces is refused, naming it.
    partial = {k: v for k, v in LIMIT_ENFORCEMENT.items() if k != "max_tool_calls"}
    assert unenforced({"max_tool_calls": 5, "max_cost_usd": None}, partial) == [
        "max_tool_calls"]
    assert unenforced({"max_tool_calls": None}, partial) == []
    # docs/policy.md has a row for each, saying what enforces it.
    docs = (ROOT / "docs" / "policy.md").read_text()
    for name in LIMIT_ENFORCEMENT:
        assert f"| `{name}` |" in docs, name


def test_a_limit_field_nothing_enforces_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard itself: were a limit field added without what enforces it, a policy
    that sets it would be refused, not recorded and ignored."""
    from runlane.domain import policy

    monkeypatch.delitem(policy.LIMIT_ENFORCEMENT, "max_tool_calls")
    with pytest.raises(policy.PolicyInvalid, match="max_tool_calls: runlane does not enforce"):
        policy.parse_policy("[defaults.limits]\nmax_tool_calls = 5\n", "p.toml")
    policy.parse_policy("[defaults.limits]\nmax_cost_usd = 5\n", "p.toml")  # others are fine


def test_policy_apply_refuses_a_limit_that_cannot_be_enforced(db_url: str,
                                                              tmp_path: Path) -> None:
    from .support import one_line_error

    policy = tmp_path / "policy.toml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    for text, field in (("max_processes = 0", "defaults.limits.max_processes"),
                        ("max_open_files = 2", "defaults.limits.max_open_files"),
                        ("max_gpu_seconds = 5", "defaults.limits.max_gpu_seconds")):
        policy.write_text(f"[defaults.limits]\n{text}\n")
        result = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url,
                                 "policy", "apply", str(policy)], capture_output=True,
                                text=True, cwd=tmp_path, env=env, timeout=60)
        one_line_error(result, 2, field)


def test_a_policy_without_the_new_limits_keeps_its_digest() -> None:
    """Unset process limits are left out of the canonical document: a policy applied
    before they existed is not a new version when applied again."""
    from runlane.domain.policy import Policy, parse_policy, policy_digest

    # The digests of main before the process limits existed.
    assert policy_digest(Policy.default()) == (
        "299e617094697394b78cebbe9f6f286ca60dab5c6b1fb2ba46d25ed9c6ce8c15")
    assert policy_digest(parse_policy("[defaults.limits]\nmax_tool_calls = 200\n")) == (
        "211fb73cdb3a0dfe3203f17a86c8b456864bc883a9195ee618c3f0c81220bbb5")
    assert policy_digest(parse_policy("[defaults.limits]\nmax_processes = 200\n")) != (
        policy_digest(Policy.default()))
