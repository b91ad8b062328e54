"""Bounds for the tests that run a fork bomb or a memory hog on purpose: if runlane's
mechanism is broken, the test fails and the machine (shared with other work) is
still fine."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shlex
import signal
import sys
import time
from collections.abc import Iterator

import pytest

PY = sys.executable
FORK_BOMB = "b() { b | b & }; b"
# A memory hog that stops by itself at 1 GiB (then waits to be stopped): touched pages
# (8 MiB at a time), so that they are resident, not just reserved.
MEMORY_HOG = (f"{PY} -c 'import time\nheld = []\nfor _ in range(128): "
              "held.append(b\"x\" * (8 << 20))\ntime.sleep(120)'")


def confined(command: str, uid: int, nproc: int = 600) -> str:
    """``command`` run by ``sh -c`` as ``uid`` (a user nothing else on the machine
    runs as) under RLIMIT_NPROC ``nproc``: the outer bound of a fork bomb when the
    mechanism under test fails. RLIMIT_NPROC binds only non-root users and counts every
    process of the user, which is why runlane itself cannot use it; here the user is
    the test's own."""
    code = ("import os, resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_NPROC, ({nproc}, {nproc}))\n"
            f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n"
            "os.execv('/bin/sh', ['sh', '-c', sys.argv[1]])")
    return f"{PY} -c {shlex.quote(code)} {shlex.quote(command)}"


def processes_of(uid: int) -> dict[int, bytes]:
    """pid -> state of every process of ``uid``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        found[int(entry)] = stat[stat.rfind(b")") + 2:][:1]
    return found


def live_processes_of(uid: int) -> list[int]:
    return [pid for pid, state in processes_of(uid).items() if state not in (b"Z", b"X")]


def kill_all_of(uid: int, timeout: float = 30.0) -> None:
    """Stop, then kill, every process of ``uid`` (the test's own user): what a broken
    mechanism left behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = live_processes_of(uid)
        if not live:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in live:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        time.sleep(0.05)


def unused_uid() -> Iterator[int]:
    """(For a fixture.) A user id no process runs as; whatever of it is left is killed
    afterwards."""
    for _ in range(100):
        uid = random.randrange(61000, 64000)
        if not processes_of(uid):
            break
    else:
        pytest.skip("no unused user id found")
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    try:
        yield uid
    finally:
        kill_all_of(uid)


PR_SET_CHILD_SUBREAPER = 36


def subreaper() -> Iterator[None]:
    """(For a fixture.) This process a child subreaper for the test, so that orphans
    are re-parented to it and reaped at once by the runner (init here may take
    seconds to reap thousands of a fork bomb's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) is not available")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
