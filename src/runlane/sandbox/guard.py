"""The worker's side of the guard (runlane.sandbox.guard_process): one guard process per
worker process, started at the first agent that has a lease deadline, fed that
deadline at the start and at every extension, told to forget the agent once its
processes are gone."""

from __future__ import annotations

import itertools
import math
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import structlog

from runlane.agents.base import AttemptControl, StopReason
from runlane.sandbox.processes import Members, Namespace, ProcessGroup

log = structlog.get_logger("runlane.sandbox")

SCRIPT = Path(__file__).with_name("guard_process.py")
START_TIMEOUT_SECONDS = 30.0


class _GuardProcess:
    """The one guard process of this process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        self._keys = itertools.count(1)
        self._failed = False

    def key(self) -> str:
        return str(next(self._keys))

    def start(self) -> None:
        """Start the guard (if it is not running) and wait until it reads commands."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._failed or (self._proc is not None and self._proc.poll() is None):
            return
        try:
            # Its own session: a Ctrl-C meant for the worker does not end it (it ends at
            # the end of its input, when the worker does).
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(SCRIPT)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, start_new_session=True, close_fds=True)
            self._stdin = self._proc.stdin
            assert self._proc.stdout is not None
            ready, _, _ = select.select([self._proc.stdout], [], [], START_TIMEOUT_SECONDS)
            if not ready or self._proc.stdout.readline().strip() != b"ready":
                raise OSError(f"the guard did not start within {START_TIMEOUT_SECONDS:g} s")
        except OSError as exc:
            self._failed = True
            log.error("sandbox_guard_failed", error=str(exc),
                      consequence="an agent of a paused worker may outlive its lease")

    def send(self, line: str) -> None:
        with self._lock:
            self._start()
            if self._failed:
                return
            try:
                assert self._stdin is not None
                self._stdin.write(line.encode() + b"\n")
                self._stdin.flush()
            except OSError as exc:
                self._failed = True
                log.error("sandbox_guard_failed", error=str(exc),
                          consequence="an agent of a paused worker may outlive its lease")


_GUARD = _GuardProcess()


def _deadline(control: AttemptControl) -> float | None:
    """When the agent must be gone by the worker's own clock (``AttemptState``'s local
    deadline, monotonic), if the control has one."""
    value = getattr(control, "local_deadline", None)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class GuardedControl:
    """``control`` as the runner polls it, telling the guard each new deadline."""

    def __init__(self, control: AttemptControl, key: str) -> None:
        self._control = control
        self._key = key
        self._sent = _deadline(control)

    def stop_reason(self) -> StopReason | None:
        deadline = _deadline(self._control)
        if deadline is not None and deadline != self._sent:
            self._sent = deadline
            _GUARD.send(f"extend {self._key} {deadline!r}")
        return self._control.stop_reason()

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None:
        self._control.report_cost(usd, input_tokens, output_tokens)

    def progress(self, message: str) -> None:
        self._control.progress(message)

    def effect(self, key: str, *, find: Callable[[], dict[str, Any] | None],
               do: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return self._control.effect(key, find=find, do=do)

    def __getattr__(self, name: str) -> Any:  # anything else a control may have
        return getattr(self._control, name)


def guard(members: Members, control: AttemptControl, grace: float
          ) -> tuple[AttemptControl, str | None]:
    """Put the agent of ``members`` under the guard when ``control`` has a deadline: the
    control to poll, and the key to :func:`forget` at the end (None: not guarded)."""
    deadline = _deadline(control)
    if deadline is None:
        return control, None
    if isinstance(members, Namespace):
        try:
            info = members.info()
        except OSError:
            info = {}
        if "child-pid" not in info or "pid-namespace" not in info:
            return control, None  # bwrap did not start: nothing to guard
        target = f"ns {info['child-pid']} {info['pid-namespace']}"
    elif isinstance(members, ProcessGroup):
        target = f"pg {members.pgid} 0"
    else:
        return control, None
    key = _GUARD.key()
    _GUARD.send(f"watch {key} {target} {deadline!r} {grace!r}")
    return GuardedControl(control, key), key


def start() -> None:
    """Start this process's guard now (a worker does, before it claims anything): not at
    the first agent, when a busy machine could take a second to start a Python."""
    _GUARD.start()


def forget(key: str | None) -> None:
    if key is not None:
        _GUARD.send(f"forget {key}")
