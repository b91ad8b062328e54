"""Crash and pause points for fault drills.

``RUNLANE_FAULT_CRASH_AT=<name>`` makes the process kill itself with SIGKILL when it
reaches that point, as a real crash would (no cleanup, no final writes).
``RUNLANE_FAULT_PAUSE_AT=<name>`` makes it stop itself (SIGSTOP, the whole process:
its heartbeat too) the first time it reaches that point, as a paused VM or a stuck
process would; whoever sends SIGCONT resumes it right there. Used by the drills, the
tests and the chaos harness; unset in production, where each call is one dictionary
lookup.

Points: ``after_effect:<key>`` (an effect done outside, not yet recorded: drill 4),
``before_push`` and ``before_pull_request`` (the lease checked, the call not yet made:
the stale window of a push or a pull request; ``before_push`` is also a crash point,
a death after the push intent named its commit and before anything was pushed);
in the local forge, ``before_pull_request_lock`` (its git lookups done, its lock not
yet taken: the window it closes by checking the caller's deadline under the lock)
and ``before_pull_request_write`` (that check passed, the record not yet written:
the window left, which a worker resumed there fills with late evidence);
``worker_start`` (`runlane worker` before anything: a worker that cannot start, which
`runlane up` restarts with backoff until its crash-loop limit);
``campaign_dispatch_submitted`` (a campaign's dispatch: its targets' tasks written,
the targets not yet marked, the transaction not committed);
``campaign_notification_posted`` (a campaign's notification sent, its delivery not yet
recorded).
"""

from __future__ import annotations

import os
import signal
import threading

_paused: set[str] = set()


def crash_point(name: str) -> None:
    if os.environ.get("RUNLANE_FAULT_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def pause_point(name: str) -> None:
    if os.environ.get("RUNLANE_FAULT_PAUSE_AT") == name and name not in _paused:
        _paused.add(name)
        # Sent to this thread, not to the process: a process-directed SIGSTOP is taken
        # by whichever thread the kernel picks (the main one, say), and this thread ran
        # on until the group stop reached it, making the call it was to pause before
        # (a push seen landing while the worker was "paused"). This thread stops
        # before the call returns, and the whole process with it.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
