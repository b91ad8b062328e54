"""Worker processes on one machine (``runlane up`` and the demo): start N
``runlane worker`` processes, restart any that die, drain them all on stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import structlog

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


class WorkerPool:
    def __init__(self, worker_args: Sequence[str], count: int, *, database_url: str,
                 env: dict[str, str] | None = None, stderr: int | None = None) -> None:
        self.command = [sys.executable, "-m", "runlane", "--database-url", database_url,
                        "worker", *worker_args]
        self.count = count
        # The workers drain when this process dies (see follow_supervisor), so that a
        # killed `runlane up` or demo leaves no worker behind.
        self.env = {**os.environ, **(env or {}), SUPERVISOR_ENV: str(os.getpid())}
        self.stderr = stderr
        self.processes: list[subprocess.Popen[bytes]] = []
        self.restarts = 0
        self.stopping = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command, env=self.env, stdout=subprocess.DEVNULL,
                                stderr=self.stderr, stdin=subprocess.DEVNULL)

    def start(self) -> None:
        self.processes = [self._spawn() for _ in range(self.count)]
        log.info("workers_started", pids=self.pids())

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def supervise(self) -> int:
        """Restart workers that exited while the pool is running; returns restarts."""
        restarted = 0
        for i, process in enumerate(self.processes):
            code = process.poll()
            if code is not None and not self.stopping:
                log.warning("worker_died", pid=process.pid, exit_code=code)
                self.processes[i] = self._spawn()
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
