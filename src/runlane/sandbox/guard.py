"""The worker's side of the guard (runlane.sandbox.guard_process): one guard process per
worker process, started at the first agent that has a lease deadline, fed that
deadline at the start and at every extension, told to forget the agent once its
processes are gone.

Every extension reaches the guard as the heartbeat thread obtains it (the control's
``watch_deadline``: ``AttemptState`` calls back from ``extended``), not only when the
runner next polls: a runner busy elsewhere (stopping a process group through its
grace, a slow /proc scan) must not leave the guard an old deadline at which it kills
a healthy agent. The guard says when it ended an agent (``fired KEY`` on its stdout,
written before its first signal), and :func:`forget` answers whether it did: the
runner then reports the lease as lost (LEASE_LOST), never the agent as failed."""

from __future__ import annotations

import itertools
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import structlog

from runlane.agents.base import AttemptControl, StopReason
from runlane.sandbox.processes import INFO_WAIT_SECONDS, Members, Namespace, ProcessGroup

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
        self._fired: set[str] = set()  # keys the guard said it ended, not yet forgotten
        self._pending = b""  # a partial line of its stdout

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
            self._pending = b""
            if self._read_lines(START_TIMEOUT_SECONDS) != ["ready"]:
                raise OSError(f"the guard did not start within {START_TIMEOUT_SECONDS:g} s")
        except OSError as exc:
            self._failed = True
            log.error("sandbox_guard_failed", error=str(exc),
                      consequence="an agent of a paused worker may outlive its lease")

    def _read_lines(self, timeout: float) -> list[str]:
        """The whole lines the guard has written (waiting up to ``timeout`` for the
        first); raw reads on its stdout, never a buffered reader's look-ahead."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            self._pending += chunk
            timeout = 0.0
            if self._pending.endswith(b"\n"):
                break
        *lines, self._pending = self._pending.split(b"\n")
        return [line.decode(errors="replace").strip() for line in lines if line.strip()]

    def fired(self, key: str) -> bool:
        """Whether the guard ended the agent of ``key`` (its deadline passed). It writes
        so before it signals the agent, so once the agent is seen gone the answer is
        already in the pipe: read without waiting."""
        with self._lock:
            if self._proc is not None and self._proc.stdout is not None:
                for line in self._read_lines(0.0):
                    word, _, fired_key = line.partition(" ")
                    if word == "fired":
                        self._fired.add(fired_key)
            if key in self._fired:
                self._fired.discard(key)
                return True
            return False

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
_WATCHED: dict[str, GuardedControl] = {}  # by key: what forget() closes
_WATCHED_LOCK = threading.Lock()


def _deadline(control: AttemptControl) -> float | None:
    """When the agent must be gone by the worker's own clock (``AttemptState``'s local
    deadline, monotonic), if the control has one."""
    value = getattr(control, "local_deadline", None)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


class GuardedControl:
    """``control`` as the runner polls it, telling the guard each new deadline: when the
    control announces one (``watch_deadline``, called from the heartbeat thread as it
    extends the lease) and, for a control that cannot, at each poll."""

    def __init__(self, control: AttemptControl, key: str) -> None:
        self._control = control
        self._key = key
        self._sent = _deadline(control)
        self._lock = threading.Lock()
        self._closed = False
        watch = getattr(control, "watch_deadline", None)
        self._unwatch: Callable[[], None] | None = (
            watch(self.tell) if callable(watch) else None)

    def tell(self, deadline: float | None = None) -> None:
        """Send the guard ``deadline`` (default: the control's) if it is later than the
        last one sent: the heartbeat thread and the runner's poll may both tell it, and
        an older deadline read by one must not follow a newer one sent by the other."""
        with self._lock:
            if deadline is None:
                deadline = _deadline(self._control)
            if self._closed or deadline is None or (
                    self._sent is not None and deadline <= self._sent):
                return
            self._sent = deadline
            _GUARD.send(f"extend {self._key} {deadline!r}")

    def close(self) -> None:
        """No more extensions: the agent is gone (forgotten by the guard)."""
        with self._lock:
            self._closed = True
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def stop_reason(self) -> StopReason | None:
        self.tell()
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
        # bwrap holds the command (--block-fd) until it is released, so there is no
        # hurry: wait for its answer as long as the lease allows (a busy machine can
        # take seconds), never release a command the guard could not be told of.
        try:
            info = members.info(timeout=max(INFO_WAIT_SECONDS, deadline - time.monotonic()))
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
    guarded = GuardedControl(control, key)
    with _WATCHED_LOCK:
        _WATCHED[key] = guarded
    guarded.tell()  # an extension between reading the deadline and watching it
    return guarded, key


def start() -> None:
    """Start this process's guard now (a worker does, before it claims anything): not at
    the first agent, when a busy machine could take a second to start a Python."""
    _GUARD.start()


def forget(key: str | None) -> bool:
    """The agent of ``key`` is gone: the guard stops watching it. True when the guard
    had ended it (its lease deadline passed with no word from the worker)."""
    if key is None:
        return False
    with _WATCHED_LOCK:
        guarded = _WATCHED.pop(key, None)
    if guarded is not None:
        guarded.close()
    _GUARD.send(f"forget {key}")
    return _GUARD.fired(key)
