"""What every process the worker starts must do before it runs: die with the worker.

A SIGKILLed (or OOM-killed) worker runs no cleanup; a child that outlives it runs on
beside the next attempt of the same run: a git clone or push writing into a workspace
the next attempt removes, an agent released after the worker is gone.
``PR_SET_PDEATHSIG`` makes the kernel SIGKILL the child when the thread that started it
dies; it is set in the child before exec (and kept across exec of a program that is
not set-user-ID), so there is no moment the child runs without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
try:  # looked up here, not in the forked child
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None

Preexec = Callable[[], None]


def die_with_parent() -> Preexec | None:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that starts it dies (so
    start it from a thread that outlives it: the one that waits for it). None where
    prctl is missing."""
    prctl = _prctl
    if prctl is None:
        return None
    parent = os.getpid()

    def apply() -> None:
        # In the forked child of a threaded worker: one prctl, no imports, no locks.
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the worker died before prctl took hold
            os._exit(137)

    return apply


def chained(*steps: Preexec | None) -> Preexec | None:
    """One ``preexec_fn`` running each given step in order (None when none is given)."""
    wanted = [step for step in steps if step is not None]
    if not wanted:
        return None
    if len(wanted) == 1:
        return wanted[0]

    def apply() -> None:
        for step in wanted:
            step()

    return apply
