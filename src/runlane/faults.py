"""Crash points for fault drills: ``RUNLANE_FAULT_CRASH_AT=<name>`` makes the process
kill itself with SIGKILL when it reaches that point, as a real crash would (no
cleanup, no final writes). Used by the drills and the chaos harness; unset in
production, where each call is one dictionary lookup."""

from __future__ import annotations

import os
import signal


def crash_point(name: str) -> None:
    if os.environ.get("RUNLANE_FAULT_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
