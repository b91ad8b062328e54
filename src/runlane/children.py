"""What every process the worker starts must do before it runs: die with the worker.

A SIGKILLed (or OOM-killed) worker runs no cleanup; a child that outlives it runs on
beside the next attempt of the same run: a git clone or push writing into a workspace
the next attempt removes, an agent released after the worker is gone.
``PR_SET_PDEATHSIG`` makes the kernel SIGKILL the child when the thread that started it
dies; it is set before the command runs (and kept across exec of a program that is
not set-user-ID), so there is no moment the command runs without it.

:func:`dying_with_parent` sets it through util-linux's ``setpriv --pdeathsig`` and a
``/bin/sh`` that checks its parent is still this process, rather than in a
``preexec_fn``: a ``preexec_fn`` makes Python fork the worker (copying its page tables)
instead of vfork, about 13 ms of kernel time per git call for a 100 MB worker against
1.5 ms for the two small execs; a worker runs a dozen git calls per attempt.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
try:  # looked up here, not in the forked child
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None

Preexec = Callable[[], None]
SHELL = "/bin/sh"
# Run by SHELL between setpriv and the command: $1 is the worker's pid. A worker that
# died before setpriv's prctl took hold is no longer the parent: the command never runs.
_PARENT_CHECK = '[ "$PPID" = "$1" ] || exit 137; shift; exec "$@"'


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


@functools.cache
def _setpriv() -> str | None:
    """setpriv's path when it knows ``--pdeathsig`` (util-linux 2.33+), else None."""
    path = shutil.which("setpriv")
    if path is None or not os.access(SHELL, os.X_OK):
        return None
    try:
        done = subprocess.run([path, "--pdeathsig", "KILL", "--", SHELL, "-c", "exit 0"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if done.returncode == 0 else None


def dying_with_parent(argv: list[str]) -> tuple[list[str], Preexec | None]:
    """The argv and ``preexec_fn`` that start ``argv`` so that it gets SIGKILL when the
    thread starting it dies (start it from the thread that waits for it): prefixed with
    setpriv and the parent check, and no ``preexec_fn`` (so Popen keeps its vfork);
    where setpriv cannot, ``argv`` as is and :func:`die_with_parent`. The process keeps
    its pid through both execs: its group, its signals and its exit status are the
    command's (137 when the worker was already gone)."""
    setpriv = _setpriv()
    if setpriv is None:
        return list(argv), die_with_parent()
    return [setpriv, "--pdeathsig", "KILL", "--", SHELL, "-c", _PARENT_CHECK, "sh",
            str(os.getpid()), *argv], None
