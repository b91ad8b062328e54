"""Worker processes on one machine (``runlane up`` and the demo): start N
``runlane worker`` processes, restart any that die, drain them all on stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from runlane.errors import RunlaneError

log = structlog.get_logger("runlane.supervisor")

SUPERVISOR_ENV = "RUNLANE_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1


def follow_supervisor() -> None:
    """In a worker started by a WorkerPool: get SIGTERM (a drain) when the supervisor
    dies. Linux only (prctl); elsewhere, and for workers started by hand, nothing."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if not supervisor or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(supervisor):  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class WorkerCrashLoop(RunlaneError):
    """A worker died again and again right after starting: restarting it cannot help
    (a bad setting, directory or agent command); ``up`` stops with its error."""


@dataclass(frozen=True)
class Backoff:
    """How a dead worker is restarted: after ``base_seconds``, doubled for each death
    in a row (up to ``max_seconds``) of a worker that lived less than
    ``healthy_seconds``; ``crash_loop_limit`` such deaths in a row stop the pool."""

    base_seconds: float = 1.0
    max_seconds: float = 60.0
    healthy_seconds: float = 30.0
    crash_loop_limit: int = 5

    def delay(self, deaths: int) -> float:
        return float(min(self.base_seconds * 2 ** max(deaths - 1, 0), self.max_seconds))


@dataclass
class _Slot:
    process: subprocess.Popen[bytes]
    started: float
    deaths: int = 0  # in a row, each within healthy_seconds of its start
    restart_at: float | None = None  # dead, to be restarted then
    done: bool = False  # exited 0 with done_when_idle: not restarted
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    reader: threading.Thread | None = None


TAIL_LINES = 20


class WorkerPool:
    """N ``runlane worker`` processes. Their stderr is passed through to this
    process's, its last lines kept to say why a worker died (unless ``stderr`` is
    given: then it goes there)."""

    def __init__(self, worker_args: Sequence[str], count: int, *, database_url: str,
                 env: dict[str, str] | None = None, stderr: int | None = None,
                 backoff: Backoff | None = None, done_when_idle: bool = False) -> None:
        self.command = [sys.executable, "-m", "runlane", "--database-url", database_url,
                        "worker", *worker_args]
        self.count = count
        # The workers drain when this process dies (see follow_supervisor), so that a
        # killed `runlane up` or demo leaves no worker behind.
        self.env = {**os.environ, **(env or {}), SUPERVISOR_ENV: str(os.getpid())}
        self.stderr = stderr
        self.backoff = backoff or Backoff()
        self.done_when_idle = done_when_idle
        self.slots: list[_Slot] = []
        self.restarts = 0
        self.stopping = False

    @property
    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [slot.process for slot in self.slots]

    def _spawn(self, slot: _Slot | None = None) -> _Slot:
        capture = self.stderr is None
        process = subprocess.Popen(self.command, env=self.env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE if capture else self.stderr,
                                   stdin=subprocess.DEVNULL)
        if slot is None:
            slot = _Slot(process, time.monotonic())
        else:
            slot.process, slot.started, slot.restart_at = process, time.monotonic(), None
        if capture:
            slot.reader = threading.Thread(target=_pass_through, args=(process, slot.tail),
                                           daemon=True,
                                           name=f"runlane-worker-{process.pid}-stderr")
            slot.reader.start()
        return slot

    def start(self) -> None:
        self.slots = [self._spawn() for _ in range(self.count)]
        log.info("workers_started", pids=self.pids())

    def pids(self) -> list[int]:
        return [slot.process.pid for slot in self.slots]

    def all_done(self) -> bool:
        """Every worker exited 0 with done_when_idle (`up --exit-when-idle`)."""
        return bool(self.slots) and all(slot.done for slot in self.slots)

    def supervise(self) -> int:
        """Restart workers that died, each after its backoff; returns restarts made.
        Raises WorkerCrashLoop, with the worker's last error line, when one died
        ``crash_loop_limit`` times in a row soon after starting."""
        restarted = 0
        now = time.monotonic()
        for slot in self.slots:
            if self.stopping or slot.done:
                continue
            if slot.restart_at is None:
                code = slot.process.poll()
                if code is None:
                    continue
                if code == 0 and self.done_when_idle:
                    slot.done = True
                    continue
                lived = now - slot.started
                slot.deaths = slot.deaths + 1 if lived < self.backoff.healthy_seconds else 1
                if slot.deaths >= self.backoff.crash_loop_limit:
                    if slot.reader is not None:  # its last lines, to say why
                        slot.reader.join(timeout=5)
                    raise WorkerCrashLoop(
                        f"a worker died {slot.deaths} times in a row, each within "
                        f"{self.backoff.healthy_seconds:g} s of its start (last exit code "
                        f"{code}): {_last_error(slot.tail)}")
                slot.restart_at = now + self.backoff.delay(slot.deaths)
                log.warning("worker_died", pid=slot.process.pid, exit_code=code,
                            lived_seconds=round(lived, 3),
                            restart_in_seconds=round(slot.restart_at - now, 3))
            if slot.restart_at is not None and now >= slot.restart_at:
                self._spawn(slot)
                restarted += 1
        self.restarts += restarted
        return restarted

    def stop(self, grace_seconds: float = 30.0) -> None:
        """SIGTERM (drain) every worker; SIGKILL whatever is left after the grace."""
        self.stopping = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for process in self.processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _pass_through(process: subprocess.Popen[bytes], tail: deque[str]) -> None:
    """Copy a worker's stderr to ours, line by line, keeping its last lines."""
    assert process.stderr is not None
    for raw in process.stderr:
        try:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
        except (OSError, ValueError):
            pass
        tail.append(raw.decode("utf-8", errors="replace").rstrip())
    process.stderr.close()


def _last_error(tail: deque[str]) -> str:
    """The worker's own one-line error (``error: ...``), else its last line."""
    for line in reversed(tail):
        if line.startswith(("error: ", "internal error: ")):
            return line
    return tail[-1] if tail else "it printed nothing"
