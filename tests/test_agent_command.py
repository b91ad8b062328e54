"""The agent command protocol (CONTRACT.md) with real /bin/sh processes: control lines,
logs, environment, and stopping the whole process group (grandchildren included).
Every test runs in bubblewrap (SANDBOX=bwrap, the default) and without (SANDBOX=off),
whose process-group mechanics the runner still has."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runlane.agents.base import AgentResult, AttemptLimits, Failure, StopReason
from runlane.agents.command import (
    MARKER,
    CommandRunner,
    CostReport,
    MalformedControlLine,
    ProgressReport,
    parse_control_line,
)
from runlane.sandbox import Sandbox, SandboxConfig

from .resource_support import subreaper
from .support import processes_in

GRACE = 0.3
STOP_AFTER = 0.3
PY = sys.executable


class FakeControl:
    """The worker's side: stops after ``stop_after`` seconds with ``reason``; records
    costs and progress; ``on_stop`` runs once, when the stop is first reported."""

    def __init__(self, stop_after: float | None = None,
                 reason: StopReason = StopReason.CANCELLED,
                 on_stop: Callable[[], None] | None = None) -> None:
        self.start = time.monotonic()
        self.stop_after = stop_after
        self.reason = reason
        self.on_stop = on_stop
        self.stopped_at: float | None = None
        self.costs: list[tuple[float, int, int]] = []
        self.messages: list[str] = []
        self.threads: set[str] = set()

    def stop_reason(self) -> StopReason | None:
        if self.stop_after is None or time.monotonic() - self.start < self.stop_after:
            return None
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
            if self.on_stop is not None:
                self.on_stop()
        return self.reason

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None:
        self.threads.add(threading.current_thread().name)
        self.costs.append((usd, input_tokens, output_tokens))

    def progress(self, message: str) -> None:
        self.messages.append(message)


class Agent:
    """One workspace and artifacts directory; runs commands in them, in ``mode``."""

    def __init__(self, tmp_path: Path, mode: str = "bwrap") -> None:
        self.mode = mode
        self.sandbox = Sandbox(SandboxConfig(mode=mode))  # type: ignore[arg-type]
        self.workspace = tmp_path / "workspace"
        self.artifacts = tmp_path / "artifacts"
        self.workspace.mkdir()
        self.env = {
            "RUNLANE_TASK_ID": "task-1", "RUNLANE_RUN_ID": "run-1", "RUNLANE_ATTEMPT": "2",
            "RUNLANE_TENANT": "acme", "RUNLANE_REPO": "/srv/git/app.git",
            "RUNLANE_PROMPT": "fix the 'flaky' test\nand \"quote\" $HOME properly",
            "RUNLANE_WORKSPACE": str(self.workspace),
            "RUNLANE_ARTIFACTS_DIR": str(self.artifacts), "PY": PY,
        }

    def run(self, command: str, control: FakeControl | None = None,
            limits: AttemptLimits | None = None, **runner: Any) -> AgentResult:
        runner.setdefault("term_grace_seconds", GRACE)
        runner.setdefault("sandbox", self.sandbox)
        return CommandRunner(command, **runner).run(
            workspace=self.workspace, artifacts_dir=self.artifacts, env=self.env,
            control=control or FakeControl(), limits=limits or AttemptLimits())

    def log(self) -> str:
        return (self.artifacts / "agent.log").read_text()

    def number(self, name: str) -> int:
        return int((self.artifacts / name).read_text())


@pytest.fixture(params=["bwrap", "off"])
def agent(tmp_path: Path, request: pytest.FixtureRequest) -> Agent:
    return Agent(tmp_path, request.param)


@pytest.fixture
def worker_reaps() -> Iterator[None]:
    """Make this process a child subreaper for the test, as a worker that is PID 1 of
    its container is: the agent's orphans are re-parented to us, not to init, and the
    runner must reap them itself. (It also makes these tests fast and their timing
    tight: init here may take seconds to reap an orphan.)"""
    yield from subreaper()


def assert_all_gone(agent: Agent) -> None:
    """No process of the agent is left: the shell, its background grandchild, anything
    else that ran in its workspace (found from the host: pids an agent writes from
    inside its PID namespace mean nothing here)."""
    assert processes_in(agent.workspace) == []


# Starts a background grandchild, which outlives the shell unless the runner ends it.
PROLOGUE = "sleep 100 & "


# --- control lines and the log ----------------------------------------------------


def test_plain_lines_go_to_the_log_and_control_lines_to_the_control(agent: Agent) -> None:
    control = FakeControl()
    result = agent.run(
        "echo hello; "
        """echo '{"runlane": "progress", "message": "reading the code"}'; """
        """echo '{"runlane": "cost", "usd": 0.02, "input_tokens": 1200, "output_tokens": 300}';"""
        """echo '  {"runlane":"progress","message":"tests pass"}  '; """
        "echo oops >&2; "
        """echo '{"other": "json"}'; """
        "printf 'last line without newline'", control)
    assert result.exit_code == 0 and result.succeeded
    assert result.failure is None and result.stopped is None and result.signal is None
    assert result.progress == ["reading the code", "tests pass"]
    assert control.messages == result.progress
    assert control.costs == [(0.02, 1200, 300)]
    assert control.threads == {"runlane-agent-output"}  # callbacks come from the reader
    assert result.log_path == agent.artifacts / "agent.log"
    lines = agent.log().splitlines()
    assert sorted(lines) == sorted(["hello", "oops", '{"other": "json"}',
                                    "last line without newline"])
    assert "runlane" not in agent.log()


def test_fail_line_classifies_the_failure_and_the_last_one_wins(agent: Agent) -> None:
    result = agent.run(
        """echo '{"runlane": "fail", "reason_code": "AGENT_FAILED", "message": "first"}'; """
        """echo '{"runlane": "fail", "reason_code": "PROVIDER_RATE_LIMIT", """
        """"retry_after_seconds": 5, "message": "429 from the provider"}'; exit 3""")
    assert result.exit_code == 3
    assert result.failure == Failure("PROVIDER_RATE_LIMIT", "429 from the provider", 5.0)
    assert not result.succeeded
    assert "429" not in agent.log()


def test_fail_line_with_exit_zero_is_still_a_failure(agent: Agent) -> None:
    result = agent.run("""echo '{"runlane": "fail", "reason_code": "TIMEOUT"}'""")
    assert result.exit_code == 0
    assert result.failure == Failure("TIMEOUT")
    assert not result.succeeded


def test_non_zero_exit_without_a_fail_line_is_just_reported(agent: Agent) -> None:
    result = agent.run("echo working; exit 7")
    assert result.exit_code == 7 and result.failure is None and result.stopped is None
    assert not result.succeeded
    assert agent.log() == "working\n"


MALFORMED = [
    '{"runlane": "explode"}',
    '{"runlane": "fail"}',
    '{"runlane": "fail", "reason_code": "NOT_A_REASON"}',
    '{"runlane": "fail", "reason_code": "TIMEOUT", "retry_after_seconds": -1}',
    '{"runlane": "fail", "reason_code": "TIMEOUT", "message": 42}',
    '{"runlane": "cost", "usd": "a lot"}',
    '{"runlane": "cost", "input_tokens": 5}',
    '{"runlane": "cost", "usd": 1, "input_tokens": 1.5}',
    '{"runlane": "cost", "usd": true}',
    '{"runlane": "cost", "usd": NaN}',
    '{"runlane": "progress"}',
    '{"runlane": "progress", "message": ["a"]}',
    '{"runlane": "progress", "message": "unterminated}',
]


def test_malformed_control_lines_are_logged_with_a_warning(agent: Agent) -> None:
    script = agent.workspace / "malformed.txt"
    script.write_text("\n".join(["before", *MALFORMED, "after"]) + "\n")
    control = FakeControl()
    result = agent.run(f"cat '{script}'", control)
    assert result.exit_code == 0 and result.succeeded
    assert result.failure is None and result.progress == []
    assert control.costs == [] and control.messages == []
    lines = agent.log().splitlines()
    assert lines[0] == "before" and lines[-1] == "after"
    warnings = lines[1:-1]
    assert len(warnings) == len(MALFORMED)
    for warning, line in zip(warnings, MALFORMED, strict=True):
        assert warning.startswith(f"{MARKER} WARNING malformed control line")
        assert warning.endswith(line)


@pytest.mark.parametrize(("line", "expected"), [
    ("plain text", None),
    ("{not json at all}", None),
    ('{"key": "value"}', None),
    ("[1, 2]", None),
    ('{"runlane": "progress", "message": "hi"}', ProgressReport("hi")),
    ('{"runlane": "cost", "usd": 1}', CostReport(1.0, 0, 0)),
    ('{"runlane": "cost", "usd": 0.5, "input_tokens": 10, "output_tokens": 2.0}',
     CostReport(0.5, 10, 2)),
    ('{"runlane": "fail", "reason_code": "PROVIDER_RATE_LIMIT", "retry_after_seconds": null,'
     ' "extra": 1}', Failure("PROVIDER_RATE_LIMIT")),
])
def test_parse_control_line(line: str, expected: object) -> None:
    assert parse_control_line(line) == expected


@pytest.mark.parametrize("line", MALFORMED)
def test_parse_control_line_rejects(line: str) -> None:
    with pytest.raises(MalformedControlLine):
        parse_control_line(line)


def test_a_failing_control_callback_does_not_stop_the_runner(agent: Agent) -> None:
    class Broken(FakeControl):
        def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None:
            raise RuntimeError("database down")

    control = Broken()
    result = agent.run("""echo '{"runlane": "cost", "usd": 1}'; """
                       """echo '{"runlane": "progress", "message": "still here"}'; echo end""",
                       control)
    assert result.succeeded
    assert control.messages == ["still here"]
    assert "WARNING control.report_cost failed" in agent.log()
    assert agent.log().endswith("end\n")


def test_a_long_line_without_newline_is_logged_whole(agent: Agent) -> None:
    result = agent.run("head -c 3000000 /dev/zero | tr '\\0' x")
    assert result.succeeded
    assert agent.log().replace("\n", "") == "x" * 3_000_000


def test_the_log_is_appended_to_never_truncated(agent: Agent) -> None:
    agent.run("echo first attempt")
    agent.run("echo second attempt")
    assert agent.log() == "first attempt\nsecond attempt\n"


def test_log_name_is_used(agent: Agent) -> None:
    result = CommandRunner("echo verified", sandbox=agent.sandbox).run(
        workspace=agent.workspace, artifacts_dir=agent.artifacts, env=agent.env,
        control=FakeControl(), limits=AttemptLimits(), log_name="verify.log")
    assert result.log_path == agent.artifacts / "verify.log"
    assert result.log_path.read_text() == "verified\n"


@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory"])
def test_a_log_name_the_agent_planted_is_set_aside_never_written_through(
        agent: Agent, tmp_path: Path, planted: str) -> None:
    """The worker opens verify.log after the agent ran, outside its sandbox, in the
    artifacts directory the agent could write: a symlink planted there made the worker
    append the verify command's output to any file it could write (as root: any), a
    FIFO hung it. What is there is set aside, and the log is a new file."""
    victim = tmp_path / "victim"
    victim.write_text("the worker's file\n")
    plant = {"symlink": f'ln -s {victim} "$RUNLANE_ARTIFACTS_DIR/verify.log"',
             "fifo": 'mkfifo "$RUNLANE_ARTIFACTS_DIR/verify.log"',
             "directory": 'mkdir "$RUNLANE_ARTIFACTS_DIR/verify.log"'}[planted]
    assert agent.run(plant).succeeded
    verified = CommandRunner("echo written by verify", sandbox=agent.sandbox).run(
        workspace=agent.workspace, artifacts_dir=agent.artifacts, env=agent.env,
        control=FakeControl(), limits=AttemptLimits(), log_name="verify.log")
    assert verified.succeeded
    assert victim.read_text() == "the worker's file\n"
    assert (agent.artifacts / "verify.log").read_text() == "written by verify\n"
    assert (agent.artifacts / "verify.log.agent-planted").is_symlink() is (planted == "symlink")


# --- environment ---------------------------------------------------------------


def test_environment_cwd_stdin_and_own_session(agent: Agent,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_TEST_INHERITED", "from the worker")  # not in the allowlist
    monkeypatch.setenv("LC_TEST_LOCALE", "C")  # LC_*: in the allowlist
    monkeypatch.setenv("RUNLANE_TEST_SETTING", "runlane's own")  # not the agent's
    probe = ("import json, os; "
             "json.dump({'env': dict(os.environ), 'cwd': os.getcwd(), "
             "'stdin': os.readlink('/proc/self/fd/0'), 'sid': os.getsid(0), "
             "'pgid': os.getpgid(0), 'ppid': os.getppid()}, "
             "open(os.path.join(os.environ['RUNLANE_ARTIFACTS_DIR'], 'probe.json'), 'w'))")
    result = agent.run(f'"$PY" -c "{probe}"; echo "shell $$" ')
    assert result.succeeded
    seen = json.loads((agent.artifacts / "probe.json").read_text())
    for key, value in agent.env.items():
        assert seen["env"][key] == value
    assert "AGENT_TEST_INHERITED" not in seen["env"]
    assert seen["env"]["LC_TEST_LOCALE"] == "C"
    assert "RUNLANE_TEST_SETTING" not in seen["env"]
    assert seen["env"]["PATH"] == os.environ["PATH"]
    if agent.mode == "bwrap":
        assert seen["env"]["HOME"] == "/tmp/home" and seen["env"]["TMPDIR"] == "/tmp"
    else:
        assert seen["env"]["HOME"] == os.environ["HOME"]
    assert seen["cwd"] == str(agent.workspace)
    assert seen["stdin"] == "/dev/null"
    shell = int(agent.log().split()[-1])
    if agent.mode == "bwrap":  # a session of the sandbox's own, led by its PID 1 (bwrap)
        assert seen["pgid"] == seen["sid"] == 1 and shell == 2
    else:
        assert seen["pgid"] == seen["sid"] == shell  # the shell leads a new session
        assert seen["sid"] != os.getsid(0)


def test_variables_named_in_pass_env_are_passed(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """SANDBOX_PASS_ENV: the operator's own variables, by name; never runlane's code host
    token, whatever name it goes by."""
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_runlanes_own")  # runlane pushes with it
    monkeypatch.delenv("RUNLANE_GITHUB_TOKEN", raising=False)
    agent = Agent(tmp_path)
    agent.sandbox = Sandbox(SandboxConfig(pass_env=("HTTPS_PROXY", "GITHUB_TOKEN")))
    assert agent.run('env > "$RUNLANE_ARTIFACTS_DIR/env"').succeeded
    env = (agent.artifacts / "env").read_text()
    assert "HTTPS_PROXY=http://proxy:3128" in env.splitlines()
    assert "ghp_runlanes_own" not in env


def test_a_command_that_cannot_start_returns_no_exit_code(agent: Agent) -> None:
    agent.workspace.rmdir()
    result = agent.run("echo never")
    assert result.exit_code is None and not result.succeeded
    assert "could not start the agent command" in agent.log()


# --- stopping ------------------------------------------------------------------


@pytest.mark.parametrize("reaper", ["init", "worker"])
def test_cancel_stops_the_whole_group_within_the_grace(agent: Agent, reaper: str,
                                                      request: pytest.FixtureRequest) -> None:
    if reaper == "worker":
        request.getfixturevalue("worker_reaps")
    seen_at_stop: list[str] = []
    control = FakeControl(STOP_AFTER, on_stop=lambda: seen_at_stop.append(agent.log()))
    result = agent.run(PROLOGUE + "echo before-1; echo before-2 >&2; "
                       "while :; do sleep 0.05; done", control)
    assert result.stopped is StopReason.CANCELLED
    assert result.exit_code is None and result.signal == signal.SIGTERM
    assert not result.killed  # SIGTERM was enough: everything ended within the grace
    assert not result.succeeded
    assert_all_gone(agent)
    # The log was flushed line by line: both lines were on disk while the agent ran.
    assert sorted(seen_at_stop[0].splitlines()) == ["before-1", "before-2"]
    assert "before-1\n" in agent.log() and "stopping the agent (cancelled)" in agent.log()
    assert result.duration_seconds is not None
    # With init reaping the orphans, how long that takes is up to init.
    assert result.duration_seconds < STOP_AFTER + GRACE + (1 if reaper == "worker" else 10)


def test_an_agent_ignoring_sigterm_is_killed_after_the_grace(agent: Agent,
                                                             worker_reaps: None) -> None:
    control = FakeControl(STOP_AFTER)
    result = agent.run("trap '' TERM; " + PROLOGUE + "while :; do sleep 0.1; done", control)
    assert result.stopped is StopReason.CANCELLED
    assert result.killed and result.signal == signal.SIGKILL and result.exit_code is None
    assert control.stopped_at is not None
    assert result.duration_seconds is not None
    assert STOP_AFTER + GRACE <= result.duration_seconds < STOP_AFTER + GRACE + 2
    assert_all_gone(agent)
    assert "SIGKILL" in agent.log()


def test_a_background_grandchild_is_killed_when_the_agent_exits(agent: Agent) -> None:
    started = time.monotonic()
    result = agent.run(PROLOGUE + "echo done")
    assert result.succeeded and result.exit_code == 0 and not result.killed
    assert time.monotonic() - started < 10  # not the grandchild's 100 s
    assert_all_gone(agent)


def test_a_leftover_ignoring_sigterm_is_killed_after_the_grace(agent: Agent,
                                                               worker_reaps: None) -> None:
    result = agent.run(PROLOGUE + "(trap '' TERM; touch ready; while :; do sleep 0.1; done) & "
                       "while [ ! -e ready ]; do sleep 0.01; done; exit 0")
    assert result.exit_code == 0 and result.stopped is None
    # Without a sandbox the runner SIGKILLs it after the grace; in one, the kernel kills
    # the whole PID namespace the moment the shell exits: nothing left to kill.
    assert result.killed is (agent.mode == "off")
    assert_all_gone(agent)


def test_the_wall_clock_limit_stops_with_timeout(agent: Agent, worker_reaps: None) -> None:
    result = agent.run(PROLOGUE + "while :; do sleep 0.05; done",
                       limits=AttemptLimits(wall_clock_seconds=0.3))
    assert result.stopped is StopReason.TIMEOUT and result.exit_code is None
    assert not result.succeeded
    assert_all_gone(agent)


def test_a_lost_lease_stops_the_agent(agent: Agent, worker_reaps: None) -> None:
    control = FakeControl(0.2, reason=StopReason.LEASE_LOST)
    result = agent.run(PROLOGUE + "while :; do sleep 0.05; done", control)
    assert result.stopped is StopReason.LEASE_LOST
    assert_all_gone(agent)


def test_a_stop_already_requested_stops_at_once(agent: Agent, worker_reaps: None) -> None:
    result = agent.run("sleep 100", FakeControl(0.0, reason=StopReason.DRAINING))
    assert result.stopped is StopReason.DRAINING
    assert result.duration_seconds is not None and result.duration_seconds < 5


def test_output_held_open_outside_the_group_does_not_block_the_runner(agent: Agent) -> None:
    # A process that left the group (its own session) keeps the stdout pipe open.
    escape = ("import os, sys, time; os.setsid(); "
              "sys.stdout.write('from the escapee\\n'); "
              "sys.stdout.flush(); time.sleep(30)")
    started = time.monotonic()
    result = agent.run(f'"$PY" -c "{escape}" & sleep 0.5; echo main done', drain_seconds=0.3)
    try:
        assert result.succeeded
        assert time.monotonic() - started < 10
        assert "from the escapee" in agent.log() and "main done" in agent.log()
        if agent.mode == "off":  # out of the group's reach: it lives on
            assert "still holds its output open" in agent.log()
            assert processes_in(agent.workspace) != []
        else:  # in the sandbox's PID namespace, setsid or not: gone with the shell
            assert "still holds its output open" not in agent.log()
            assert_all_gone(agent)
    finally:
        for pid in processes_in(agent.workspace):
            os.kill(pid, signal.SIGKILL)


def test_control_ish_lines_that_are_not_json_get_one_warning_each(agent: Agent) -> None:
    """`cost 0.01` (a control line as a person might guess it) and a truncated
    `{"runlane": ...` were logged as ordinary lines and ignored in silence: the agent's
    author never learnt why no cost was recorded."""
    script = agent.workspace / "guessed.txt"
    script.write_text('cost 0.01\ncost 0.02\nprogress: half way\nFailed to fetch\n'
                      '{"runlane": "cost", "usd": 0.01\n')
    control = FakeControl()
    result = agent.run(f"cat '{script}'", control)
    assert result.succeeded and control.costs == []
    lines = agent.log().splitlines()
    warned = [line for line in lines if line.startswith(f"{MARKER} WARNING")]
    assert [w.split("looks like a ")[1].split(" ")[0] for w in warned[:2]] == \
        ["'cost'", "'progress'"], warned
    assert len(warned) == 3 and "malformed control line" in warned[2], warned
    assert '{"runlane": "cost", "usd": 0.01}' in warned[0]  # what a control line is
    assert "cost 0.01" in lines and "cost 0.02" in lines and "Failed to fetch" in lines
