"""The guard (runlane.sandbox.guard): the process that ends an agent at its lease
deadline when its worker cannot. Found by the long fault-harness run: slow agents of
healthy workers ended AGENT_FAILED. Here, with real bubblewrap, real processes and
real signals: every lease extension reaches the guard though no runner polls; an agent
the guard ended is a lost lease, never a failed agent (nor a finished one); a command
whose deadline passed before it was released never runs; and the agent command dies
with its worker's thread from before it executes."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runlane.agents import command
from runlane.agents.base import AgentResult, AttemptLimits, StopReason
from runlane.agents.command import CommandRunner
from runlane.sandbox import Sandbox, SandboxConfig
from runlane.sandbox.guard import forget, guard
from runlane.store.store import Store
from runlane.worker.attempt import AttemptState

from .support import attempts_of, bare_remote, processes_in, spec
from .test_worker import (  # noqa: F401 - fixtures
    WorkerProcess,
    forge_dir,
    status_of,
    wait_until,
    workers,
)

GRACE = 0.3


def state(deadline_in: float | None = None) -> AttemptState:
    """An attempt's shared state as the worker keeps it (no database is reached)."""
    s = AttemptState(lease=Any, store=Any, stop_grace=GRACE)  # type: ignore[arg-type]
    if deadline_in is not None:
        s.local_deadline = time.monotonic() + deadline_in
    return s


class PausedWorker:
    """A control whose lease deadline passes without it noticing: the worker was
    SIGSTOPped past the deadline, and on SIGCONT its heartbeat extended the lease
    before its attempt thread looked (its stop reason says nothing)."""

    def __init__(self, deadline_in: float) -> None:
        self.local_deadline = time.monotonic() + deadline_in

    def stop_reason(self) -> StopReason | None:
        return None

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None: ...

    def progress(self, message: str) -> None: ...

    def tool_call(self, call_id: str | None, name: str | None, *, shell: bool = False,
                  seconds: float | None = None) -> None: ...

    def iteration(self) -> None: ...

    def effect(self, key: str, *, find: Callable[[], dict[str, Any] | None],
               do: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return do()


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    workspace, artifacts = tmp_path / "ws", tmp_path / "art"
    workspace.mkdir()
    artifacts.mkdir()
    return workspace, artifacts


def alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def test_every_lease_extension_reaches_the_guard_though_no_runner_polls(
        tmp_path: Path) -> None:
    """An agent in bwrap under the guard; the heartbeat extends its lease again and
    again (``AttemptState.extended``, as worker.py's heartbeat loop does) while nobody
    polls the guarded control (a runner busy elsewhere). The guard must learn each new
    deadline from the heartbeat itself: the agent lives well past the first deadline,
    and once the extensions stop, the guard ends it at the last one and says so."""
    workspace, artifacts = dirs(tmp_path)
    spawn = Sandbox().prepare("sleep 60", workspace=workspace, artifacts_dir=artifacts,
                              env={})
    proc = subprocess.Popen(spawn.argv, cwd=workspace, env=spawn.env,
                            pass_fds=spawn.pass_fds, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    spawn.started()
    members = spawn.members(proc)
    attempt = state()
    ttl = 2.0
    attempt.extended(time.monotonic(), ttl)  # the claim: deadline in 2 - 0.4 - 0.3 s
    first_deadline = attempt.local_deadline
    _unpolled, key = guard(members, attempt, GRACE)  # the runner would poll this
    assert key is not None
    spawn.release()
    try:
        wait_until(lambda: bool(processes_in(workspace)), 10, "the agent to run")
        # The heartbeat, every 0.3 s, for a good while past the first deadline and its
        # grace; the guarded control is never polled.
        heartbeat = threading.Event()
        until = first_deadline + GRACE + 2.0
        while time.monotonic() < until:
            attempt.extended(time.monotonic(), ttl)
            assert alive(proc), "the guard ended an agent whose lease was being extended"
            heartbeat.wait(0.3)
        last_deadline = attempt.local_deadline
        wait_until(lambda: not alive(proc), last_deadline - time.monotonic() + GRACE + 5,
                   "the guard to end the agent at its last deadline")
        assert time.monotonic() >= last_deadline
        assert forget(key) is True  # the guard says it ended it
        key = None
    finally:
        forget(key)
        members.signal(signal.SIGKILL)
        proc.wait()
        spawn.close()


@pytest.mark.parametrize("agent", ["sleep 60",
                                   # catches SIGTERM and exits 0, as if it had finished
                                   "trap 'exit 0' TERM; sleep 60 & wait"])
def test_an_agent_the_guard_ended_is_a_lost_lease_never_a_failed_or_finished_agent(
        tmp_path: Path, agent: str) -> None:
    """The guard ends the agent at its lease deadline while the runner, told nothing
    (its worker was paused), only sees the command exit: with 143, or with 0 from an
    agent that catches SIGTERM. Either way the result is LEASE_LOST (the attempt stops
    and writes nothing of it), not an exit status: AGENT_FAILED, or work pushed as done."""
    workspace, artifacts = dirs(tmp_path)
    runner = CommandRunner(agent, term_grace_seconds=GRACE)
    result = runner.run(workspace=workspace, artifacts_dir=artifacts, env={},
                        control=PausedWorker(deadline_in=1.5), limits=AttemptLimits())
    log = (artifacts / "agent.log").read_text()
    assert result.stopped is StopReason.LEASE_LOST, (result, log)
    assert "ended by the worker's guard" in log
    assert not processes_in(workspace)


@pytest.mark.parametrize("variant", ["as_shipped", "without_guard"])
def test_a_command_whose_deadline_passed_before_its_release_never_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    """The worker was paused between starting bwrap (which holds the command on its
    block pipe) and releasing it; on resuming, its lease deadline has passed and the run
    may be another worker's. The command does not run a single line, and the attempt
    stops as a lost lease: the runner releases nothing whose control says stop. Also
    without the guard, which is no more than a racy backstop here: its SIGTERM can find
    the namespace holding only its init (nobody to signal), and its SIGKILL comes a
    grace later, while the released command runs."""
    if variant == "without_guard":
        monkeypatch.setattr(command, "guard", lambda members, control, grace: (control, None))
    workspace, artifacts = dirs(tmp_path)
    ran = artifacts / "ran"
    runner = CommandRunner(f'touch "{ran}"; sleep 60', term_grace_seconds=2.0)
    attempt = state(deadline_in=-1.0)
    result = runner.run(workspace=workspace, artifacts_dir=artifacts, env={},
                        control=attempt, limits=AttemptLimits())
    assert result.stopped is StopReason.LEASE_LOST
    assert not ran.exists(), "the command ran after its lease deadline"
    assert attempt.deadline_fired and attempt.lost.is_set()


PDEATHSIG = ("import ctypes; v = ctypes.c_int(); "
             "ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print('pdeathsig', v.value)")


def test_the_agent_command_dies_with_its_workers_thread_from_before_it_executes(
        tmp_path: Path) -> None:
    """The agent's process gets PR_SET_PDEATHSIG (SIGKILL) in the child, before exec:
    with bwrap, bwrap's own --die-with-parent takes hold only once it runs, and a worker
    dead before that closes the block pipe, whose end releases the command. Seen from
    the command itself (SANDBOX=off, executed in place of its shell)."""
    workspace, artifacts = dirs(tmp_path)
    runner = CommandRunner(f'exec {sys.executable} -c "{PDEATHSIG}"',
                           sandbox=Sandbox(SandboxConfig(mode="off")))
    result: AgentResult = runner.run(workspace=workspace, artifacts_dir=artifacts, env={},
                                     control=state(), limits=AttemptLimits())
    assert result.exit_code == 0
    assert f"pdeathsig {int(signal.SIGKILL)}" in (artifacts / "agent.log").read_text()


def test_a_resumed_worker_whose_agent_the_guard_ended_does_not_fail_the_run(
        db_url: str, tmp_path: Path,
        workers: Callable[..., WorkerProcess]) -> None:  # noqa: F811
    """The worker is SIGSTOPped; the guard ends its agent at the local deadline; the
    worker is resumed before its lease expires, and its heartbeat may extend the lease
    again. The attempt ends as a lost lease (given back, or recovered by the reaper),
    never AGENT_FAILED: the agent did not fail, its worker was paused."""
    store = Store(db_url)
    [sub] = store.submit([spec(repo=str(bare_remote(tmp_path)))])
    # TTL 6 s: the guard ends the agent 6 - 1.2 - 1 = 3.8 s after the last beat, so the
    # worker can be resumed with the lease still live.
    worker = workers('touch "$RUNLANE_ARTIFACTS_DIR/started"; sleep 60',
                     env={"RUNLANE_LEASE_TTL_SECONDS": "6", "RUNLANE_HEARTBEAT_SECONDS": "1",
                          "RUNLANE_AGENT_TERM_GRACE_SECONDS": "1"})
    started = tmp_path / "artifacts" / sub.run_id / "1" / "started"
    workspace = tmp_path / "workspaces" / f"{sub.run_id}-1"
    try:
        wait_until(lambda: started.exists() and status_of(store, sub.run_id) == "RUNNING", 30,
                   "the agent to run")
        worker.signal(signal.SIGSTOP)
        wait_until(lambda: not processes_in(workspace), 15, "the guard to end the agent")
        worker.signal(signal.SIGCONT)
        wait_until(lambda: attempts_of(store, sub.run_id)[0].ended_at is not None, 30,
                   "the first attempt to end")
        first = attempts_of(store, sub.run_id)[0]
        assert first.reason_code != "AGENT_FAILED", first
        assert first.reason_code in ("LEASE_RELEASED", "WORKER_LOST"), first
    finally:
        with contextlib.suppress(ProcessLookupError):
            worker.signal(signal.SIGCONT)
        worker.stop()
        store.close()
