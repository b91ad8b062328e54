"""Resource limits of an agent's process tree: the policy's ``max_cpu_seconds``,
``max_memory_mb``, ``max_processes``, ``max_file_size_mb``, ``max_open_files`` and
``max_address_space_mb``, applied to the agent command and to the verify command.

Two mechanisms, because neither alone gives both safety and a clear verdict:

- **rlimits**, set in the child before exec and inherited by everything it starts.
  They bind each process on its own and the kernel enforces them without us: a
  file cannot grow past ``RLIMIT_FSIZE`` (SIGXFSZ), a process cannot open more than
  ``RLIMIT_NOFILE`` files (EMFILE) or map more than ``RLIMIT_AS`` (ENOMEM), and
  ``RLIMIT_CPU`` ends it (SIGXCPU). But an error shows up to the runner only as the
  agent's exit status, which cannot be told from any other failure; only a signal
  that ended the agent command itself can be classified.
- **a watch**, which samples the tree from /proc on every poll of the runner
  (``CommandRunner._watch``) and kills it the moment it is over ``max_processes``,
  ``max_memory_mb`` or ``max_cpu_seconds``, summed over the whole tree: the attempt
  then ends LIMIT_EXCEEDED with the limit named. ``RLIMIT_CPU`` stays a second above
  the limit as the backstop of a process whose watch is late.

RLIMIT_NPROC is not used: it counts every process of the user on the machine (not
of one tree: a worker's agents share a user) and never binds root. Nor are cgroups,
which users' machines may not offer.

The tree is found from /proc alone, so it works on a bare agent and on one inside a
sandbox's PID namespace (whose processes are the root's descendants) alike. When it
is watched, the agent command's first process is made a child subreaper (kept
across exec): a descendant orphaned by its parent, even in a session of its own
(a double fork, a ``setsid`` fork bomb), is re-parented to it and stays in the tree,
rather than going to init and out of sight.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import math
import os
import resource
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MB = 1 << 20
# RLIMIT_CPU backstop: this many seconds above max_cpu_seconds SIGXCPU ends a process,
# and SIGKILL two seconds later (a process may catch SIGXCPU). The watch sees the
# tree's sum, which is at least any one process's time, within one sample.
CPU_BACKSTOP_SECONDS = 1
CPU_KILL_AFTER_SECONDS = 2
# Every this many samples, the watch reads every process again, not only the tree's
# and the new ones (at a 50 ms poll: once a second).
FULL_SCAN_EVERY = 20
# The limits the watch samples, and those set only as rlimits.
WATCHED = ("max_processes", "max_memory_mb", "max_cpu_seconds")
KERNEL_ONLY = ("max_file_size_mb", "max_open_files", "max_address_space_mb")

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_PR_SET_CHILD_SUBREAPER = 36
try:  # looked up here, not in the forked child
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _figure(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class ResourceLimits:
    """One process tree's limits; None is no limit."""

    max_cpu_seconds: float | None = None
    max_memory_mb: float | None = None
    max_processes: int | None = None
    max_file_size_mb: float | None = None
    max_open_files: int | None = None
    max_address_space_mb: float | None = None

    @classmethod
    def from_snapshot(cls, limits: Mapping[str, Any]) -> ResourceLimits:
        """From a run's limits snapshot (the policy's field names)."""
        return cls(**{name: limits.get(name) for name in WATCHED + KERNEL_ONLY})

    @property
    def watched(self) -> bool:
        """Whether a watch must sample the tree (it costs a /proc scan per poll)."""
        return any(getattr(self, name) is not None for name in WATCHED)

    def rlimits(self) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) for every limit the kernel holds the tree to."""
        out = []
        if self.max_cpu_seconds is not None:
            soft = math.ceil(self.max_cpu_seconds) + CPU_BACKSTOP_SECONDS
            out.append((resource.RLIMIT_CPU, soft, soft + CPU_KILL_AFTER_SECONDS))
        for name, which in (("max_file_size_mb", resource.RLIMIT_FSIZE),
                            ("max_address_space_mb", resource.RLIMIT_AS)):
            mb = getattr(self, name)
            if mb is not None:
                size = max(1, int(mb * MB))
                out.append((which, size, size))
        if self.max_open_files is not None:
            out.append((resource.RLIMIT_NOFILE, self.max_open_files, self.max_open_files))
        return out

    def preexec(self) -> Callable[[], None] | None:
        """What the child runs before exec (``Popen(preexec_fn=...)``); None when there
        is nothing to set, so that Popen keeps its faster spawn without one."""
        wanted = self.rlimits()
        subreaper = self.watched and _prctl is not None
        if not wanted and not subreaper:
            return None
        prctl = _prctl

        def apply() -> None:
            # Runs in the forked child of a threaded worker: only setrlimit and prctl
            # calls, no imports, no logging, no locks.
            if subreaper and prctl is not None:
                prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            for which, soft, hard in wanted:
                cur_soft, cur_hard = resource.getrlimit(which)
                # Tighten, never loosen: a worker started under a lower limit (an
                # administrator's) keeps its agents under it.
                if cur_hard != resource.RLIM_INFINITY:
                    hard = min(hard, cur_hard)
                soft = min(soft, hard)
                if cur_soft != resource.RLIM_INFINITY:
                    soft = min(soft, cur_soft)
                resource.setrlimit(which, (soft, hard))

        return apply

    def ended_by(self, returncode: int | None) -> str | None:
        """The limit a signal named in the agent command's end says it hit: the command
        killed by SIGXCPU or SIGXFSZ, or exiting 128 + that signal as a shell (and a
        sandbox) reports a child's; None otherwise, and when that limit is not set."""
        if returncode is None:
            return None
        sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
        if sig == signal.SIGXFSZ and self.max_file_size_mb is not None:
            return (f"max_file_size_mb {_figure(self.max_file_size_mb)} exceeded: a process "
                    "of the agent wrote past it and was ended by SIGXFSZ")
        if sig == signal.SIGXCPU and self.max_cpu_seconds is not None:
            return (f"max_cpu_seconds {_figure(self.max_cpu_seconds)} exceeded: a process "
                    "of the agent was ended by SIGXCPU")
        return None


# --- the process tree ------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """What the tree held at one sample."""

    tasks: int  # processes and their threads, as the kernel counts them for `ulimit -u`
    memory_bytes: int  # private resident memory: anonymous pages (not file-backed ones)
    cpu_seconds: float  # user + system, of live processes and of their reaped children
    members: dict[int, int]  # pid -> start time (clock ticks since boot): its identity
    complete: bool = True  # False when the sample stopped early, over the task limit


@dataclass(frozen=True)
class _Stat:
    pid: int
    ppid: int
    pgrp: int
    session: int
    rest: bytes  # the fields after the session, parsed only for members

    @property
    def zombie(self) -> bool:
        return self.rest[:1] == b"Z"

    def figures(self) -> tuple[int, int, int]:
        """(cpu ticks with reaped children's, threads, start time)."""
        f = self.rest.split()
        # rest = state tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
        # cutime cstime priority nice num_threads itrealvalue starttime ...
        return (int(f[8]) + int(f[9]) + int(f[10]) + int(f[11]), int(f[14]), int(f[16]))


_Members = dict[int, tuple[_Stat, tuple[int, int, int]]]  # pid -> (stat, figures)


def _read(path: str, size: int = 1024) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # gone meanwhile
    try:
        return os.read(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def _stat(pid: int, proc: str) -> _Stat | None:
    """The fields of /proc/PID/stat that decide membership; the rest left unparsed (a
    sample reads every process on the machine: this is most of its cost)."""
    raw = _read(f"{proc}/{pid}/stat")
    if raw is None:
        return None
    # comm may hold spaces and parentheses: the fields start after the last ')'.
    try:
        state, ppid, pgrp, session, rest = raw[raw.rfind(b")") + 2:].split(b" ", 4)
        return _Stat(pid, int(ppid), int(pgrp), int(session), state + b" " + rest)
    except ValueError:
        return None


def _start(pid: int, proc: str) -> int | None:
    st = _stat(pid, proc)
    try:
        return None if st is None else st.figures()[2]
    except (IndexError, ValueError):
        return None


def _private_bytes(pid: int, proc: str) -> int:
    """Resident minus shared pages (statm): the anonymous memory a process holds, not
    the file pages it maps (git maps whole pack files) that the kernel can drop."""
    raw = _read(f"{proc}/{pid}/statm", 256)
    if not raw:
        return 0
    fields = raw.split()
    try:
        return max(0, int(fields[1]) - int(fields[2])) * _PAGE
    except (IndexError, ValueError):
        return 0


class ProcessTree:
    """The processes of one agent: the root, its descendants, and every process of a
    process group or session one of them leads (so the orphans of a double fork or a
    fork bomb, re-parented to init, are still counted while they keep the group or
    session they were born in). ``root`` is the process runlane started (the shell, or
    the sandbox around it); it leads its own session (``start_new_session``).

    Groups and sessions are only trusted while a sample finds a process in them: an
    emptied one's number may be given to an unrelated process later.
    """

    def __init__(self, root: int, *, proc: str = "/proc") -> None:
        self.root = root
        self.proc = proc
        # Until the first sample: the root leads its own group and session. After it,
        # only those a sample found a member in (an emptied group's number may be given
        # to another process), and the root only while it is the process first seen.
        self._root_start: int | None = None
        self._groups: set[int] = {root}
        self._sessions: set[int] = {root}
        # The pids a complete scan found outside the tree: not read again (most of a
        # scan's cost), since a process outside never joins it (its parent, group
        # and session can only become ones of its own or init's). A pid is given to a
        # new process only after the kernel went round all of them; every
        # FULL_SCAN_EVERY-th scan reads every process again all the same.
        self._outside: set[int] = set()
        self._scans = 0

    def sample(self, *, memory: bool = True, stop_above: int | None = None) -> Usage:
        """One look at /proc. ``stop_above``: stop reading once the tree has more tasks
        than this (a fork bomb makes the scan long; the answer is known already)."""
        members, tasks, complete = self._scan(stop_above)
        return self._usage(members, tasks, memory=memory and complete, complete=complete)

    def _scan(self, stop_above: int | None = None) -> tuple[_Members, int, bool]:
        pids = sorted(int(e) for e in os.listdir(self.proc) if e.isdigit())
        # From the root upwards first: its descendants mostly have higher pids.
        at = bisect.bisect_left(pids, self.root)
        members: _Members = {}
        others: list[_Stat] = []
        outside = set() if self._scans % FULL_SCAN_EVERY == 0 else self._outside
        still_outside: list[int] = []
        self._scans += 1
        tasks = 0
        for pid in pids[at:] + pids[:at]:
            if pid in outside:
                still_outside.append(pid)
                continue
            st = _stat(pid, self.proc)
            if st is None:
                continue
            if not self._belongs(st, members):
                others.append(st)
                continue
            tasks += self._join(st, members)
            if stop_above is not None and tasks > stop_above:
                return members, tasks, False
        # A child listed before its parent (pids wrap around), or a member found by a
        # group a later member leads: look again until nothing more joins.
        grew = True
        while grew and others:
            grew = False
            rest = []
            for st in others:
                if self._belongs(st, members):
                    tasks += self._join(st, members)
                    grew = True
                else:
                    rest.append(st)
            others = rest
        self._outside = {st.pid for st in others}.union(still_outside)
        self._groups = {st.pgrp for st, _ in members.values()}
        self._sessions = {st.session for st, _ in members.values()}
        return members, tasks, True

    def _belongs(self, st: _Stat, members: Mapping[int, object]) -> bool:
        if st.pid == self.root:
            start = st.figures()[2]
            if self._root_start is None:  # the first sample: runlane's unreaped child
                self._root_start = start
            return start == self._root_start
        return (st.ppid in members or st.pgrp in self._groups or st.session in self._sessions
                or st.pgrp in members or st.session in members)

    @staticmethod
    def _join(st: _Stat, members: _Members) -> int:
        """Add a member; how many tasks it counts for (a zombie holds its pid: one)."""
        try:
            figures = st.figures()
        except (IndexError, ValueError):
            figures = (0, 1, 0)
        members[st.pid] = (st, figures)
        return max(figures[1], 1)

    def _usage(self, members: _Members, tasks: int, *, memory: bool,
               complete: bool) -> Usage:
        held = sum(_private_bytes(pid, self.proc) for pid, (st, _) in members.items()
                   if not st.zombie) if memory else 0
        return Usage(tasks=tasks, memory_bytes=held,
                     cpu_seconds=sum(f[0] for _, f in members.values()) / _CLK_TCK,
                     members={pid: f[2] for pid, (_, f) in members.items()},
                     complete=complete)

    def kill(self, *, timeout: float = 5.0) -> None:
        """SIGKILL every process of the tree, those that left its process group too.
        Frozen first, so that none exits meanwhile and orphans its children out of the
        tree's sight, and none forks: SIGSTOP to the root's process group (one atomic
        signal, a fork racing with it fails: a fork bomb in the group stops growing
        there, whatever its size), then pass after pass to the groups found and to each
        live process not yet stopped, until a pass finds none; then SIGKILL to all."""
        _signal_group(self.root, signal.SIGSTOP)
        stopped: dict[int, int] = {}
        groups: set[int] = {self.root}
        deadline = time.monotonic() + timeout
        while True:
            members, _, _ = self._scan()
            new = {pid: f[2] for pid, (st, f) in members.items()
                   if not st.zombie and stopped.get(pid) != f[2]}
            if not new or time.monotonic() >= deadline:
                break
            found = {members[pid][0].pgrp for pid in new} - groups
            for group in found:  # each seen in this scan: not a number given away since
                _signal_group(group, signal.SIGSTOP)
            groups |= found
            for pid, start in new.items():
                if _signal(pid, start, signal.SIGSTOP, self.proc):
                    stopped[pid] = start
        for group in groups:
            _signal_group(group, signal.SIGKILL)
        for pid, start in stopped.items():
            _signal(pid, start, signal.SIGKILL, self.proc)


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _signal(pid: int, start: int, sig: signal.Signals, proc: str) -> bool:
    """Signal ``pid`` only if it is still the process that started at ``start``: a pid
    whose process ended may already belong to another (a fork bomb cycles through
    them), and the worker runs as root. A pidfd pins the process while we check."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd (Linux before 5.3): check, then kill
        if _start(pid, proc) != start:
            return False
        try:
            os.kill(pid, sig)
        except OSError:
            return False
        return True
    try:
        if _start(pid, proc) != start:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# --- the watch -------------------------------------------------------------------------


class ResourceWatch:
    """Checks one tree against its limits; ``check()`` is called on every poll of the
    runner and returns (and keeps, in ``exceeded``) the message naming the limit the
    tree is over, or None."""

    def __init__(self, limits: ResourceLimits, root: int, *, proc: str = "/proc") -> None:
        self.limits = limits
        self.tree = ProcessTree(root, proc=proc)
        self.exceeded: str | None = None
        self.samples = 0

    def check(self) -> str | None:
        if self.exceeded is not None:
            return self.exceeded
        lim = self.limits
        usage = self.tree.sample(memory=lim.max_memory_mb is not None,
                                 stop_above=lim.max_processes)
        self.samples += 1
        self.exceeded = over_limits(lim, usage)
        return self.exceeded

    def kill(self) -> None:
        self.tree.kill()


def over_limits(limits: ResourceLimits, usage: Usage) -> str | None:
    """The message naming the first watched limit ``usage`` is over, or None."""
    if limits.max_processes is not None and usage.tasks > limits.max_processes:
        more = "" if usage.complete else "at least "
        return (f"max_processes {limits.max_processes} exceeded: the agent had {more}"
                f"{usage.tasks} processes and threads")
    if limits.max_memory_mb is not None and usage.memory_bytes > limits.max_memory_mb * MB:
        return (f"max_memory_mb {_figure(limits.max_memory_mb)} exceeded: the agent's "
                f"processes held {usage.memory_bytes / MB:.0f} MB")
    if limits.max_cpu_seconds is not None and usage.cpu_seconds > limits.max_cpu_seconds:
        return (f"max_cpu_seconds {_figure(limits.max_cpu_seconds)} exceeded: the agent's "
                f"processes used {usage.cpu_seconds:.1f} CPU seconds")
    return None

