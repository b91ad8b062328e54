"""Resource limits of the agent's process tree (agents/resources.py) with real
processes: the watch that ends a fork bomb, a memory hog and a CPU burner as
LIMIT_EXCEEDED naming the limit, and the kernel rlimits behind it.

The fork bombs run as an unused user under RLIMIT_NPROC (tests/resource_support.py):
with the watch broken, the test fails and the machine is fine."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.agents.base import AttemptLimits, StopReason
from runlane.agents.resources import ProcessTree, ResourceLimits, Usage, over_limits

from .resource_support import (
    FORK_BOMB,
    MEMORY_HOG,
    PY,
    confined,
    live_processes_of,
    subreaper,
    unused_uid,
)
from .test_agent_command import Agent, FakeControl


@pytest.fixture
def agent(tmp_path: Path) -> Agent:
    return Agent(tmp_path)


@pytest.fixture
def unsandboxed(tmp_path: Path) -> Agent:
    """SANDBOX=off, for the fork bombs: their safety net (an unused user under
    RLIMIT_NPROC, switched to by `confined`) needs the capability to change user, which
    the sandbox drops. The watch is the same in both modes (it follows bwrap's
    processes as the shell's); test_a_memory_hog... and the CPU test run sandboxed."""
    return Agent(tmp_path, mode="off")


@pytest.fixture
def bomb_uid() -> Iterator[int]:
    yield from unused_uid()


@pytest.fixture
def reaps() -> Iterator[None]:
    yield from subreaper()


def wait_gone(pids: dict[int, int], timeout: float = 10.0) -> bool:
    """Whether every one of ``pids`` is dead (a zombie or reaped) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            states.append(stat[stat.rfind(b")") + 2:][:1])
        if all(s in (b"Z", b"X") for s in states):
            return True
        time.sleep(0.02)
    return False


def limits(wall: float = 60.0, **resources: float) -> AttemptLimits:
    """The outer bound of every test here is its wall clock: a broken watch ends in
    TIMEOUT, not LIMIT_EXCEEDED."""
    return AttemptLimits(wall_clock_seconds=wall, resources=ResourceLimits(**resources))


# --- the watch -------------------------------------------------------------------------


def test_a_fork_bomb_ends_limit_exceeded_and_nothing_of_it_is_left(
        unsandboxed: Agent, bomb_uid: int, reaps: None) -> None:
    started = time.monotonic()
    result = unsandboxed.run(confined(FORK_BOMB + '; sleep 60', bomb_uid), FakeControl(),
                       limits(wall=30, max_processes=32))
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, unsandboxed.log()[-500:])
    assert result.limit is not None and result.limit.startswith("max_processes 32 exceeded")
    assert time.monotonic() - started < 25
    assert live_processes_of(bomb_uid) == []
    assert "max_processes 32 exceeded" in unsandboxed.log()


def test_a_fork_bomb_that_left_the_process_group_is_killed_too(
        unsandboxed: Agent, bomb_uid: int, reaps: None) -> None:
    """setsid: the bomb is in a session of its own, out of reach of the process-group
    kill; the watch still counts it (a session a member leads) and kills it."""
    result = unsandboxed.run(confined(f"setsid sh -c '{FORK_BOMB}' & wait; sleep 60", bomb_uid),
                       FakeControl(), limits(wall=30, max_processes=32))
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, unsandboxed.log()[-500:])
    assert result.limit is not None and "max_processes" in result.limit
    assert live_processes_of(bomb_uid) == []


def test_what_the_shell_leaves_behind_is_judged_before_it_is_terminated(
        unsandboxed: Agent, reaps: None) -> None:
    """A shell that exits at once, leaving its children over the limit (as a fork
    bomb's first process does): judged by one last sample, not just terminated as the
    leftovers of an agent that exited 0. Without the sandbox only: in bwrap the
    shell's exit ends its PID namespace, and the leftovers with it."""
    result = unsandboxed.run("for i in $(seq 40); do sleep 60 & done", FakeControl(),
                       limits(wall=60, max_processes=32))
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, unsandboxed.log()[-500:])
    assert result.limit is not None and result.limit.startswith("max_processes 32 exceeded")


def test_orphans_in_a_session_of_their_own_stay_in_the_tree(agent: Agent,
                                                            reaps: None) -> None:
    """A double fork into a new session: the intermediate exits at once, so the
    sleepers are orphans outside the agent's group and session. The agent's first
    process is a child subreaper: they are re-parented to it and counted, not lost to
    init (or to the worker). (Were a sample to see the intermediate in its one
    millisecond of life, the session would be known anyway: without the subreaper this
    test fails nearly always, not always.)"""
    result = agent.run("sleep 0.3; (setsid sh -c 'for i in $(seq 40); do sleep 60 & done; "
                       "wait' &); sleep 60", FakeControl(), limits(wall=5, max_processes=32))
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, agent.log()[-500:])
    assert result.limit is not None and result.limit.startswith("max_processes 32 exceeded")


def test_kill_reaches_processes_that_left_the_process_group(tmp_path: Path) -> None:
    """A tree that sampled nothing yet knows only the root's group: the kill finds the
    rest (a new session's processes) pass by pass and kills them by pid."""
    import subprocess
    proc = subprocess.Popen(["/bin/sh", "-c", "setsid sh -c 'sleep 60 & sleep 60 & wait' & wait"],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            seen = ProcessTree(proc.pid).sample()
            if len(seen.members) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert len(seen.members) == 4, seen  # sh, the setsid'd sh, two sleeps
        ProcessTree(proc.pid).kill()
        assert wait_gone(seen.members)
    finally:
        for pid in seen.members:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_memory_hog_ends_limit_exceeded_killed_without_a_grace(agent: Agent,
                                                                 reaps: None) -> None:
    """It ignores SIGTERM, and the runner's grace is 30 s: a tree over a resource limit
    gets SIGKILL at once (it would go on growing through a grace)."""
    hog = MEMORY_HOG.replace("import time", "import signal, time\n"
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    started = time.monotonic()
    result = agent.run(hog, FakeControl(), limits(wall=60, max_memory_mb=64),
                       term_grace_seconds=30)
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, agent.log()[-500:])
    assert result.limit is not None and result.limit.startswith("max_memory_mb 64 exceeded")
    assert result.signal == signal.SIGKILL
    assert time.monotonic() - started < 20


def test_memory_a_process_only_maps_from_a_file_is_not_counted(
        agent: Agent, reaps: None) -> None:
    """Private (anonymous) memory only: git maps whole pack files, which the kernel
    can drop at any time; an agent is not stopped for reading a large repository."""
    big = agent.workspace / "pack"
    with big.open("wb") as f:
        f.write(b"p" * (128 << 20))
    code = ("import mmap, time\n"
            "f = open('pack', 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            "sum(m[i] for i in range(0, len(m), 4096))\n"
            "open('mapped', 'w').write('ok'); time.sleep(0.5)")
    result = agent.run(f"{PY} -c \"{code}\"", FakeControl(), limits(wall=60, max_memory_mb=64))
    assert (agent.workspace / "mapped").exists(), agent.log()
    assert result.stopped is None and result.exit_code == 0, (result, agent.log()[-500:])


def test_cpu_seconds_are_summed_over_the_whole_tree(agent: Agent,
                                                    reaps: None) -> None:
    """Two burners, each under the per-process rlimit (max_cpu_seconds + 1): only the
    watch, which sums the tree, sees the limit passed (the shell's `wait` exits 0 when
    the kernel kills them)."""
    burn = f"{PY} -c 'while True: pass'"
    result = agent.run(f"{burn} & {burn} & wait", FakeControl(),
                       limits(wall=60, max_cpu_seconds=1))
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, agent.log()[-500:])
    assert result.limit is not None and result.limit.startswith("max_cpu_seconds 1 exceeded")


def test_no_limits_no_watch(agent: Agent, reaps: None) -> None:
    result = agent.run(f"{MEMORY_HOG.replace('range(128)', 'range(4)').replace('120', '0')}",
                       FakeControl(), limits(wall=60))
    assert result.stopped is None and result.exit_code == 0 and result.limit is None


def test_over_limits_names_each_limit_with_its_figures() -> None:
    lim = ResourceLimits(max_processes=10, max_memory_mb=100, max_cpu_seconds=5)
    ok = Usage(tasks=10, memory_bytes=100 << 20, cpu_seconds=5.0, members={})
    assert over_limits(lim, ok) is None
    assert over_limits(lim, Usage(11, 0, 0.0, {}, complete=False)) == (
        "max_processes 10 exceeded: the agent had at least 11 processes and threads")
    assert over_limits(lim, Usage(1, 150 << 20, 0.0, {})) == (
        "max_memory_mb 100 exceeded: the agent's processes held 150 MB")
    assert over_limits(lim, Usage(1, 0, 5.5, {})) == (
        "max_cpu_seconds 5 exceeded: the agent's processes used 5.5 CPU seconds")


def test_the_tree_counts_threads_descendants_and_group_orphans(tmp_path: Path) -> None:
    import subprocess
    threads = (f"{PY} -c 'import threading, time\n"
               "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() "
               "for _ in range(5)]\ntime.sleep(30)'")
    # An orphan: its parent (the subshell) exits at once; it keeps the group.
    proc = subprocess.Popen(["/bin/sh", "-c", f"(sleep 30 &) ; {threads} & sleep 30"],
                            start_new_session=True)
    try:
        tree = ProcessTree(proc.pid)
        deadline = time.monotonic() + 20
        while True:
            usage = tree.sample()
            if usage.tasks >= 9 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # sh, the orphan sleep, python with 6 threads, sleep: 9 tasks, 4 processes.
        assert (usage.tasks, len(usage.members)) == (9, 4), usage
        assert usage.complete
        tree.kill()
        assert wait_gone(usage.members)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- the kernel's rlimits --------------------------------------------------------------


def rlimits_of_the_agent(agent: Agent, lim: AttemptLimits) -> dict[str, list[str]]:
    """The agent's /proc/self/limits: name -> [soft, hard]."""
    result = agent.run("cat /proc/self/limits > limits.txt", FakeControl(), lim)
    assert result.exit_code == 0, agent.log()
    return {line[:26].strip(): line[26:].split()[:2]
            for line in (agent.workspace / "limits.txt").read_text().splitlines()[1:]}


def test_the_agent_runs_under_the_rlimits_of_its_limits(agent: Agent) -> None:
    rows = rlimits_of_the_agent(agent, limits(
        max_cpu_seconds=10, max_file_size_mb=2, max_open_files=64, max_address_space_mb=4096))
    assert rows["Max cpu time"] == ["11", "13"]  # the backstop: a second above the watch
    assert rows["Max file size"] == [str(2 << 20)] * 2
    assert rows["Max open files"] == ["64", "64"]
    assert rows["Max address space"] == [str(4096 << 20)] * 2


def test_a_limit_never_loosens_what_the_worker_runs_under(agent: Agent) -> None:
    """The worker runs with a lower soft limit than its hard one (an administrator's
    choice): a policy limit above both keeps the agent under both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        rows = rlimits_of_the_agent(agent, limits(max_open_files=hard + 1000))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert rows["Max open files"] == ["256", str(hard)]


def test_a_file_past_max_file_size_ends_limit_exceeded(agent: Agent) -> None:
    result = agent.run("head -c 3000000 /dev/zero > big.bin", FakeControl(),
                       limits(max_file_size_mb=1))
    assert result.stopped is StopReason.LIMIT_EXCEEDED, (result, agent.log()[-500:])
    assert result.limit is not None and result.limit.startswith("max_file_size_mb 1 exceeded")
    assert (agent.workspace / "big.bin").stat().st_size <= 1 << 20


def test_without_the_file_size_limit_the_same_status_is_an_ordinary_exit(agent: Agent) -> None:
    """Exit 153 (128 + SIGXFSZ) is only taken as the limit when the limit is set."""
    result = agent.run("exit 153", FakeControl(), limits())
    assert result.stopped is None and result.exit_code == 153 and result.limit is None


def test_open_files_past_the_limit_fail_in_the_agent(agent: Agent) -> None:
    code = ("import os\nfds = []\ntry:\n    while True: fds.append(os.open('/dev/null', 0))\n"
            "except OSError:\n    os.close(fds.pop())\n"
            "    open('opened', 'w').write(str(len(fds) + 1))")
    result = agent.run(f"{PY} -c \"{code}\"", FakeControl(), limits(max_open_files=32))
    assert result.exit_code == 0, agent.log()
    assert int((agent.workspace / "opened").read_text()) < 32


def test_address_space_past_the_limit_fails_in_the_agent(agent: Agent) -> None:
    code = "b = bytearray(400 << 20)"
    result = agent.run(f"{PY} -c '{code}'", FakeControl(), limits(max_address_space_mb=200))
    assert result.exit_code == 1 and "MemoryError" in agent.log()
