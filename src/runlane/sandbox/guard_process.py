"""The guard: one small process per worker that ends an agent whose lease deadline
passed while its worker could not (SIGSTOPped, frozen, wedged).

The worker ends its agents itself before their leases run out (its local deadline,
worker/attempt.py); but a worker that is paused does nothing, its leases expire, the
reaper requeues its runs and another worker starts them: the paused worker's agents
would run on beside the new ones. The guard is a separate process, so it is not
paused with the worker: at each agent's deadline (the worker's local deadline, sent
after every heartbeat that extended the lease) it does what the worker would, SIGTERM
to every process of the agent, SIGKILL after the grace, and all of it before the lease
expires.

Standard library only, run as a script (``python -I -S guard_process.py``): it starts
once per worker. It reads commands on stdin, one per line, times on the host's
monotonic clock (the same in every process of the machine)::

    watch KEY ns INIT_PID PID_NAMESPACE DEADLINE GRACE   # a bwrap sandbox
    watch KEY pg PGID 0 DEADLINE GRACE                   # SANDBOX=off: a process group
    extend KEY DEADLINE
    forget KEY

On its stdout: ``ready`` once, then ``fired KEY`` when it ends an agent (before the
first signal), so that the worker tells a lost lease from a failed agent.

End of input (the worker exited or died): every agent still watched is killed at
once, and the guard exits.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import select
import signal
import sys
import time
from dataclasses import dataclass

MAX_WAIT_SECONDS = 1.0


@dataclass
class Entry:
    kind: str  # "ns" or "pg"
    target: int  # the namespace's PID 1 (host pid), or the process group
    namespace: int
    deadline: float
    grace: float
    terminated_at: float | None = None


def _namespace_members(namespace: int) -> list[int]:
    wanted = f"pid:[{namespace}]"
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry}/ns/pid") == wanted:
                    found.append(int(entry))
    return found


def _signal(entry: Entry, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if entry.kind == "pg":
            os.killpg(entry.target, sig)
        elif sig == signal.SIGKILL:
            os.kill(entry.target, sig)  # the namespace's PID 1: the kernel does the rest
        else:
            for pid in _namespace_members(entry.namespace):
                if pid != entry.target:  # PID 1 going first would SIGKILL the rest at once
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)


def _say(event: str, key: str, **fields: object) -> None:
    at = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
    with contextlib.suppress(OSError):  # a closed stderr must not stop the guard acting
        print(json.dumps({"event": event, "level": "warning",
                          "logger": "runlane.sandbox.guard", "key": key, **fields,
                          "timestamp": at}), file=sys.stderr, flush=True)


class Guard:
    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}

    def command(self, line: str) -> None:
        words = line.split()
        try:
            if words[0] == "watch":
                key, kind, target, namespace, deadline, grace = words[1:7]
                self.entries[key] = Entry(kind, int(target), int(namespace), float(deadline),
                                          float(grace))
            elif words[0] == "extend" and words[1] in self.entries:
                self.entries[words[1]].deadline = float(words[2])
            elif words[0] == "forget":
                self.entries.pop(words[1], None)
        except (IndexError, ValueError):
            _say("sandbox_guard_bad_command", "-", line=line[:200])

    def due(self, now: float) -> float:
        """Act on every entry whose time came; seconds until the next one's."""
        wait = MAX_WAIT_SECONDS
        for key, entry in list(self.entries.items()):
            if entry.terminated_at is None and now >= entry.deadline:
                _say("sandbox_guard_stopping", key, reason="the lease deadline passed with no "
                     "word from the worker: SIGTERM to every process of the agent")
                # Before the first signal: a worker that sees its agent gone finds this
                # in the pipe and reports a lost lease, not a failed agent.
                with contextlib.suppress(OSError):  # a worker gone: nobody to tell
                    print(f"fired {key}", flush=True)
                _signal(entry, signal.SIGTERM)
                entry.terminated_at = now
            if entry.terminated_at is not None:
                if now >= entry.terminated_at + entry.grace:
                    _signal(entry, signal.SIGKILL)
                    del self.entries[key]
                    continue
                wait = min(wait, entry.terminated_at + entry.grace - now)
            else:
                wait = min(wait, entry.deadline - now)
        return max(wait, 0.0)

    def kill_all(self) -> None:
        for entry in self.entries.values():
            _signal(entry, signal.SIGKILL)
        self.entries.clear()


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # it ends when its worker does: end of input
    guard = Guard()
    pending = b""
    print("ready", flush=True)  # the worker waits for this before it claims anything
    while True:
        ready, _, _ = select.select([0], [], [], guard.due(time.monotonic()))
        if not ready:
            continue
        data = os.read(0, 65536)
        if not data:
            guard.kill_all()
            return 0
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                guard.command(line.decode(errors="replace"))


if __name__ == "__main__":
    sys.exit(main())
