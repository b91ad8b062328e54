"""Which processes belong to one agent command, and how to signal all of them.

Two answers, one interface (:class:`Members`):

* :class:`ProcessGroup` (``SANDBOX=off``): the process group the shell leads. A
  process that calls ``setsid`` leaves it, and is out of reach.
* :class:`Namespace` (``SANDBOX=bwrap``): every process of the sandbox's own PID
  namespace, whatever session or group it made for itself. bwrap's reaper is PID 1
  of that namespace: when it dies, the kernel kills every other process of the
  namespace and bwrap itself exits only after that, so "bwrap has exited" means
  "nothing of the agent is left".
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from enum import Enum
from typing import Protocol


class GroupState(Enum):
    ALIVE = "alive"
    ZOMBIES = "zombies"  # only exited processes not yet reaped by their parent (init)
    GONE = "gone"


class Members(Protocol):
    """The processes of one agent command, as the runner stops them."""

    def state(self) -> GroupState: ...

    def signal(self, sig: signal.Signals) -> None: ...

    def reap_adopted(self) -> None:
        """Reap exited members re-parented to this process (a worker that is PID 1
        of its container, or a child subreaper)."""
        ...

    def exit_status(self, returncode: int | None) -> int | None:
        """The shell's status as Popen tells it: negative for the signal that ended it."""
        ...


# --- SANDBOX=off: the process group ----------------------------------------------------


def _proc_stat(entry: str) -> list[bytes] | None:
    """The fields of /proc/ENTRY/stat after the command name: state, ppid, pgrp, ..."""
    try:
        with open(f"/proc/{entry}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None  # gone meanwhile
    return stat[stat.rfind(b")") + 2:].split()


def group_members(pgid: int) -> list[tuple[int, bytes, int]] | None:
    """(pid, state, ppid) of every process of the group, from /proc (Linux); None
    when /proc cannot tell."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _proc_stat(entry)
        if fields is not None and len(fields) >= 3 and int(fields[2]) == pgid:
            found.append((int(entry), fields[0], int(fields[1])))
    return found


class ProcessGroup:
    """The process group ``pgid`` that ``leader`` (Popen's child, which Popen reaps)
    started with ``start_new_session``."""

    def __init__(self, pgid: int, leader: int) -> None:
        self.pgid = pgid
        self.leader = leader

    def state(self) -> GroupState:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return GroupState.GONE
        except PermissionError:
            return GroupState.ALIVE
        members = group_members(self.pgid)
        if members is None or any(state not in (b"Z", b"X") for _, state, _ in members):
            return GroupState.ALIVE
        return GroupState.ZOMBIES

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def exit_status(self, returncode: int | None) -> int | None:
        return returncode

    def reap_adopted(self) -> None:
        me = os.getpid()
        for pid, state, ppid in group_members(self.pgid) or []:
            if ppid == me and pid != self.leader and state == b"Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)


# --- SANDBOX=bwrap: the PID namespace ----------------------------------------------------


# How long to wait for bwrap's --info-fd answer when it is needed (it comes within
# milliseconds of the start; a bwrap that fails before writing it closes the pipe).
INFO_WAIT_SECONDS = 5.0


def namespace_members(pid_namespace: int) -> list[int]:
    """Host pids of every process in PID namespace ``pid_namespace`` (its inode)."""
    wanted = f"pid:[{pid_namespace}]"
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == wanted:
                found.append(int(entry))
        except OSError:
            continue  # gone meanwhile, or not ours to look at
    return found


class Namespace:
    """The processes of one bwrap sandbox. ``info`` is the read end of bwrap's
    ``--info-fd`` pipe (owned from now on: closed by :meth:`close`)."""

    def __init__(self, proc: subprocess.Popen[bytes], info: int) -> None:
        self.proc = proc
        self._info_fd: int | None = info
        self._info: dict[str, int] | None = None
        self.signalled = False

    def close(self) -> None:
        if self._info_fd is not None:
            os.close(self._info_fd)
            self._info_fd = None

    def info(self, timeout: float = INFO_WAIT_SECONDS) -> dict[str, int]:
        """bwrap's JSON: ``child-pid`` (host pid of the namespace's PID 1) and
        ``pid-namespace``; empty when bwrap exited before writing it, or did not write
        it within ``timeout`` seconds."""
        if self._info is not None:
            return self._info
        data = b""
        deadline = time.monotonic() + timeout
        while self._info_fd is not None and time.monotonic() < deadline:
            ready, _, _ = select.select([self._info_fd], [], [], 0.05)
            if not ready:
                if self.proc.poll() is not None and not data:
                    break
                continue
            chunk = os.read(self._info_fd, 4096)
            if not chunk:
                break
            data += chunk
        try:
            parsed = json.loads(data) if data else {}
        except ValueError:
            parsed = {}
        self._info = {k: v for k, v in parsed.items() if isinstance(v, int)}
        self.close()
        return self._info

    def state(self) -> GroupState:
        # bwrap exits only once its namespace's PID 1 has: by then the kernel has
        # killed and reaped every other process of the namespace.
        return GroupState.ALIVE if self.proc.poll() is None else GroupState.GONE

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is not None:
            return
        self.signalled = True
        info = self.info()
        init, namespace = info.get("child-pid"), info.get("pid-namespace")
        if sig == signal.SIGKILL or init is None or namespace is None:
            # PID 1 of the namespace takes every other member with it; bwrap itself
            # (and, before the namespace exists, --die-with-parent) does the rest.
            if init is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(init, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL if sig == signal.SIGKILL else sig)
            return
        # Every member but PID 1 (bwrap's reaper: were it to die, the kernel would
        # SIGKILL the rest at once, with no grace), whatever group it put itself in.
        for pid in namespace_members(namespace):
            if pid != init:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def reap_adopted(self) -> None:
        """bwrap reaps its own; nothing of the namespace is ever re-parented to us."""

    def exit_status(self, returncode: int | None) -> int | None:
        """bwrap exits 128+N when the shell was ended by signal N: told apart from a
        shell's own exit status only when we sent a signal."""
        if self.signalled and returncode is not None and 128 < returncode <= 128 + 64:
            return -(returncode - 128)
        return returncode
