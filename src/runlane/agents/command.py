"""The agent command (README, "Workers and the agent command").

``/bin/sh -c CMD`` runs in the workspace, inside the worker's sandbox
(:mod:`runlane.sandbox`: bubblewrap, or with ``SANDBOX=off`` its own process group
and session), with stdin from /dev/null. One reader thread pumps stdout and stderr:
control lines (``{"runlane": ...}``) go to the attempt's control, every other line
to ``artifacts_dir/log_name``, written and flushed line by line so a killed
agent's partial log survives. The calling thread polls the control's stop reason
and the wall-clock limit; on either, the whole process group gets SIGTERM, then
SIGKILL after the grace. Whatever happens, :meth:`CommandRunner.run` returns only
once no process of the group is left (leftover background children of an agent
that exited on its own are terminated the same way; in the sandbox the kernel kills
them as soon as the shell exits). "The group" is the sandbox's PID namespace with
bwrap, the shell's process group without (runlane.sandbox.processes).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import selectors
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import structlog

from runlane.agents.base import AgentResult, AttemptControl, AttemptLimits, Failure, StopReason
from runlane.agents.resources import ResourceWatch
from runlane.children import chained, dying_with_parent
from runlane.domain.reasons import Reason
from runlane.observability import metrics, tracing
from runlane.sandbox import GroupState, Members, Sandbox
from runlane.sandbox.environment import agent_environment as agent_environment
from runlane.sandbox.guard import forget, guard
from runlane.sandbox.processes import Namespace

log = structlog.get_logger("runlane.agents")

MARKER = "[runlane]"  # prefix of the lines the runner itself writes into the log
MAX_LINE_BYTES = 1 << 20  # a longer line without a newline is logged in pieces
MAX_MESSAGE_CHARS = 4096  # messages of control lines are cut to this length
_READ_CHUNK = 65536
_SELECT_SECONDS = 0.05
_KNOWN_REASONS = frozenset(r.value for r in Reason)


# --- control lines -------------------------------------------------------------


class MalformedControlLine(ValueError):
    """A line that is meant as a control line (a JSON object with a "runlane" key,
    or something that tries to be) but cannot be honoured."""


@dataclass(frozen=True)
class CostReport:
    usd: float
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class ProgressReport:
    message: str


@dataclass(frozen=True)
class ToolCallReport:
    """A tool call begins (``seconds`` None) or ended after ``seconds``; a line whose
    ``id`` was reported before is the same call, not another."""

    id: str | None = None
    name: str | None = None
    shell: bool = False
    seconds: float | None = None


@dataclass(frozen=True)
class IterationReport:
    """The agent begins one more iteration of its loop."""


ControlMessage = Failure | CostReport | ProgressReport | ToolCallReport | IterationReport
MAX_ID_CHARS = 200  # a tool call's id and name are cut to this length


# A line that reads like an attempt at a control line but is not JSON (`cost 0.01`,
# `runlane: fail TIMEOUT`): logged as it is, with a warning saying what a control line is.
_CONTROL_ISH = re.compile(r"^\s*(?:runlane\s*[:=]?\s*)?(cost|fail|progress|tool_call|iteration)"
                          r"(?:\s*[:=]\s*|\s+)\S", re.IGNORECASE)
CONTROL_LINE_HINT = ('control lines are one JSON object per line, e.g. '
                     '{"runlane": "cost", "usd": 0.01}')


def control_ish(line: str) -> str | None:
    """The control kind a non-JSON line seems to attempt (``cost 0.01``), or None."""
    match = _CONTROL_ISH.match(line)
    return match.group(1).lower() if match else None


def parse_control_line(line: str) -> ControlMessage | None:
    """The control message a stdout line carries; None for an ordinary log line.

    Raises MalformedControlLine for a JSON object with a "runlane" key whose kind
    or fields are wrong (and for a line that looks like one but is not valid JSON).
    """
    text = line.strip()
    if not (text.startswith("{") and text.endswith("}")):
        if text.startswith("{") and '"runlane"' in text:
            raise MalformedControlLine("not valid JSON: a JSON object on one line")
        return None
    try:
        obj: Any = json.loads(text)
    except ValueError as exc:
        if '"runlane"' in text:
            raise MalformedControlLine(f"not valid JSON: {exc}") from None
        return None
    if not isinstance(obj, dict) or "runlane" not in obj:
        return None
    kind = obj["runlane"]
    if kind == "fail":
        return _parse_fail(obj)
    if kind == "cost":
        return _parse_cost(obj)
    if kind == "progress":
        message = obj.get("message")
        if not isinstance(message, str):
            raise MalformedControlLine('"progress" needs a string "message"')
        return ProgressReport(message[:MAX_MESSAGE_CHARS])
    if kind == "tool_call":
        return _parse_tool_call(obj)
    if kind == "iteration":
        return IterationReport()
    raise MalformedControlLine(
        f"unknown kind {kind!r} (expected fail, cost, progress, tool_call or iteration)")


def _parse_tool_call(obj: dict[str, Any]) -> ToolCallReport:
    call_id = obj.get("id")
    if isinstance(call_id, int) and not isinstance(call_id, bool):
        call_id = str(call_id)
    if call_id is not None and not isinstance(call_id, str):
        raise MalformedControlLine('"id" of a tool_call must be a string')
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        raise MalformedControlLine('"name" of a tool_call must be a string')
    shell = obj.get("shell", False)
    if not isinstance(shell, bool):
        raise MalformedControlLine('"shell" of a tool_call must be true or false')
    seconds = obj.get("seconds")
    if seconds is not None:
        seconds = _number(seconds, "seconds")
    return ToolCallReport(id=None if call_id is None else call_id[:MAX_ID_CHARS],
                          name=None if name is None else name[:MAX_ID_CHARS],
                          shell=shell, seconds=seconds)


def _parse_fail(obj: dict[str, Any]) -> Failure:
    return checked_failure(obj.get("reason_code"), obj.get("message"),
                           obj.get("retry_after_seconds"))


def _parse_cost(obj: dict[str, Any]) -> CostReport:
    if "usd" not in obj:
        raise MalformedControlLine('"cost" needs "usd"')
    return checked_cost(obj["usd"], obj.get("input_tokens", 0), obj.get("output_tokens", 0))


# The checks of a failure and of a cost report, whichever way an agent gives them: a
# control line, or an in-process agent's AgentFailed and report_cost (agents/python.py).


def checked_failure(code: Any, message: Any, retry_after: Any) -> Failure:
    """The failure an agent reports, or MalformedControlLine when it cannot be taken as
    one (an unknown reason code: the attempt then fails AGENT_FAILED)."""
    if not isinstance(code, str) or code not in _KNOWN_REASONS:
        raise MalformedControlLine(f"unknown reason code {code!r}")
    if message is not None and not isinstance(message, str):
        raise MalformedControlLine('"message" must be a string')
    if retry_after is not None:
        retry_after = _number(retry_after, "retry_after_seconds")
    return Failure(reason_code=code,
                   message=message[:MAX_MESSAGE_CHARS] if message is not None else None,
                   retry_after_seconds=retry_after)


def checked_cost(usd: Any, input_tokens: Any, output_tokens: Any) -> CostReport:
    """A cost report, each figure clamped to what one report may count; raises
    MalformedControlLine (a ValueError) for a negative, non-finite or non-number figure."""
    return CostReport(usd=_number(usd, "usd"),
                      input_tokens=_count(input_tokens, "input_tokens"),
                      output_tokens=_count(output_tokens, "output_tokens"))


# The largest figures one cost line counts for: more is taken as this much. A larger
# figure made a report the database cannot hold (dropped whole, dollars and all, so
# the run's cost limit never fired) or sums that overflow to infinity; this much
# still trips any cost limit.
MAX_LINE_USD = 1e9
MAX_LINE_TOKENS = 2**53


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise MalformedControlLine(f'"{name}" must be a non-negative number, got {value!r}')
    return min(float(value), MAX_LINE_USD)


def _count(value: Any, name: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedControlLine(f'"{name}" must be a non-negative integer, got {value!r}')
    return min(value, MAX_LINE_TOKENS)


# --- the log -------------------------------------------------------------------


_LOG_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_log(path: Path) -> int:
    """The log file, appended to. The artifacts directory is the agent's to write: what
    it left at this name (a symlink to a file of the worker's, a FIFO, a directory) is
    set aside as ``NAME.agent-planted``, never followed or written through (the worker
    writes ``verify.log`` after the agent ran, outside any sandbox)."""
    try:
        fd = os.open(path, _LOG_FLAGS, 0o644)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a FIFO; EISDIR: a directory
        if exc.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise
    path.rename(path.with_name(f"{path.name}.agent-planted"))
    fd = os.open(path, _LOG_FLAGS | os.O_EXCL, 0o644)
    os.set_blocking(fd, True)
    return fd


class _Log:
    """The attempt's log: appended to (a retry never erases evidence), one flush a line.
    Written by the reader thread and by the runner; a lock keeps lines whole."""

    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] | None = os.fdopen(_open_log(path), "ab")
        self._lock = threading.Lock()

    def line(self, data: bytes) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(data if data.endswith(b"\n") else data + b"\n")
            self._file.flush()

    def note(self, text: str) -> None:
        self.line(f"{MARKER} {text}\n".encode())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# --- the reader thread ---------------------------------------------------------


class _Pump:
    """Reads the agent's stdout and stderr until both reach EOF (or until told to stop,
    when a process outside the group still holds a pipe open) and splits them into lines."""

    def __init__(self, stdout: IO[bytes], stderr: IO[bytes], on_stdout: Callable[[bytes], None],
                 on_stderr: Callable[[bytes], None], log_: _Log) -> None:
        self._streams = {stdout.fileno(): on_stdout, stderr.fileno(): on_stderr}
        self._log = log_
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runlane-agent-output",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, drain_seconds: float) -> bool:
        """Wait for EOF on both pipes; True when it came, False when we gave up."""
        self._thread.join(drain_seconds)
        if not self._thread.is_alive():
            return True
        self._stop.set()
        self._thread.join()
        return False

    def _run(self) -> None:
        buffers = {fd: bytearray() for fd in self._streams}
        with selectors.DefaultSelector() as sel:
            for fd in self._streams:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map() and not self._stop.is_set():
                for key, _ in sel.select(_SELECT_SECONDS):
                    fd = key.fd
                    try:
                        chunk = os.read(fd, _READ_CHUNK)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    buf = buffers[fd]
                    buf += chunk
                    self._emit_lines(fd, buf)
        for fd, buf in buffers.items():  # a last line without a newline
            if buf:
                self._deliver(fd, bytes(buf))

    def _emit_lines(self, fd: int, buf: bytearray) -> None:
        while True:
            end = buf.find(b"\n")
            if end < 0:
                if len(buf) >= MAX_LINE_BYTES:
                    self._deliver(fd, bytes(buf[:MAX_LINE_BYTES]))
                    del buf[:MAX_LINE_BYTES]
                    continue
                return
            self._deliver(fd, bytes(buf[:end + 1]))
            del buf[:end + 1]

    def _deliver(self, fd: int, line: bytes) -> None:
        try:
            self._streams[fd](line)
        except Exception as exc:  # never let one line stop the pump (the agent would block)
            log.warning("agent_output_handler_failed", error=repr(exc))
            self._log.note(f"WARNING could not handle an output line: {exc!r}")


# --- the runner ----------------------------------------------------------------


class CommandRunner:
    """Runs the agent command (README, "Workers and the agent command") for one attempt.

    ``term_grace_seconds``: how long the process group has between SIGTERM and SIGKILL.
    ``poll_seconds``: how often the stop reason and the wall clock are checked.
    ``drain_seconds``: how long to wait for the output pipes to close once the group
    is gone (only a process that left the group can hold them open longer).
    ``reap_timeout_seconds``: how long to wait, after the last process of the group
    exited, until its zombies are reaped (by init) and the group no longer exists.
    ``sandbox``: where the command runs (default: bubblewrap with the default view).
    """

    def __init__(self, command: str, *, sandbox: Sandbox | None = None,
                 term_grace_seconds: float = 5.0,
                 poll_seconds: float = 0.05, drain_seconds: float = 2.0,
                 reap_timeout_seconds: float = 10.0) -> None:
        self.command = command
        self.sandbox = sandbox if sandbox is not None else Sandbox()
        self.term_grace_seconds = term_grace_seconds
        self.poll_seconds = poll_seconds
        self.drain_seconds = drain_seconds
        self.reap_timeout_seconds = reap_timeout_seconds

    def run(self, *, workspace: Path, artifacts_dir: Path, env: dict[str, str],
            control: AttemptControl, limits: AttemptLimits,
            log_name: str = "agent.log") -> AgentResult:
        artifacts_dir.mkdir(parents=True, exist_ok=True)
        log_path = artifacts_dir / log_name
        out = _Log(log_path)
        started = time.monotonic()
        # The sandbox's start, from its preparation to the command's release, as a
        # child of the stage running the command (observability/tracing.py).
        starting = tracing.start_stage("runlane.sandbox_start",
                                       {"runlane.sandbox.mode": self.sandbox.mode})
        try:
            spawn = self.sandbox.prepare(self.command, workspace=workspace,
                                         artifacts_dir=artifacts_dir, env=env,
                                         network=limits.network, secrets=limits.secrets)
        except BaseException as exc:
            starting.fail(exc)
            if isinstance(exc, Exception):
                metrics.sandbox_start_failed()
            raise
        for note in spawn.notes:
            out.note(note)
        # SIGKILL when this thread dies, from before bwrap runs: its own
        # --die-with-parent takes hold only once it runs, and a worker dead before that
        # closed the block pipe (its EOF releases the command, unwatched and orphaned).
        argv, dies = dying_with_parent(spawn.argv)
        try:
            proc = subprocess.Popen(
                argv, cwd=workspace, env=spawn.env, pass_fds=spawn.pass_fds,
                # The kernel's resource limits (a preexec_fn only when the policy sets one).
                preexec_fn=chained(limits.resources.preexec(), dies),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, close_fds=True)
        except (OSError, subprocess.SubprocessError) as exc:
            starting.fail(exc)
            spawn.close()
            out.note(f"ERROR could not start the agent command: {exc}")
            out.close()
            log.error("agent_start_failed", error=str(exc), workspace=str(workspace))
            metrics.sandbox_start_failed()
            return AgentResult(exit_code=None, log_path=log_path, duration_seconds=0.0)
        spawn.started()
        assert proc.stdout is not None and proc.stderr is not None
        pgid = proc.pid  # start_new_session: bwrap (or the shell) leads its own group
        members = spawn.members(proc)
        # A guard process ends the agent at its lease deadline if this worker cannot;
        # the command runs once it is watched, and only if it may still start: a worker
        # paused between the start and here (its deadline passed, the run maybe another
        # worker's by now) never lets it run. What is held is killed, and the watch
        # below finds the reason.
        control, guard_key = guard(members, control, self.term_grace_seconds)
        if not spawn.held or self._may_start(control):
            spawn.release()
            if starting.recording:
                starting.end(_sandbox_attributes(workspace, proc, members))
        else:
            members.signal(signal.SIGKILL)
            starting.fail("not released: the attempt must stop")
        lines = _ControlLines(control, out)
        pump = _Pump(proc.stdout, proc.stderr, lines.stdout_line, out.line, out)
        pump.start()
        deadline = (started + limits.wall_clock_seconds
                    if limits.wall_clock_seconds is not None else None)
        watch = ResourceWatch(limits.resources, proc.pid) if limits.resources.watched else None
        stopped: StopReason | None = None
        limit: str | None = None  # the resource limit the runner stopped it for
        killed = False
        try:
            stopped = self._watch(proc, control, deadline, watch)
            if watch is not None and watch.exceeded is not None:
                # Over a resource limit the tree itself is the danger (a fork bomb, a
                # memory hog): no grace, SIGKILL to every process of it at once.
                limit = watch.exceeded
                log.warning("agent_resource_limit", limit=limit, pgid=pgid)
                out.note(f"stopping the agent: {limit}: SIGKILL to its processes")
                watch.kill()
            elif stopped is not None:
                out.note(f"stopping the agent ({stopped.value}): SIGTERM to its process group")
                log.info("agent_stopping", reason=stopped.value, pgid=pgid)
        finally:
            # Also on an exception (or KeyboardInterrupt) here: nothing of the group survives.
            killed = self._end_group(proc, members, out, requested=stopped is not None,
                                     watch=watch)
            if forget(guard_key) and stopped is None:
                # The guard ended it: its lease deadline passed while this worker did not
                # act (paused). Whatever its exit status says, the lease is the cause.
                stopped = StopReason.LEASE_LOST
                out.note("the agent was ended by the worker's guard: its lease deadline "
                         "passed")
                log.warning("agent_ended_by_guard", pgid=pgid)
            if stopped is None:
                # A kernel limit whose signal ended the agent command (SIGXFSZ, SIGXCPU).
                limit = limits.resources.ended_by(proc.returncode)
                if limit is not None:
                    stopped = StopReason.LIMIT_EXCEEDED
                    out.note(f"the agent command ended over a limit: {limit}")
                    log.warning("agent_resource_limit", limit=limit, pgid=pgid)
            if not pump.finish(self.drain_seconds):
                out.note("WARNING a process outside the agent's process group still holds its "
                         "output open; stopped reading")
            proc.stdout.close()
            proc.stderr.close()
            out.close()
            spawn.close()
        code = members.exit_status(proc.returncode)
        return AgentResult(
            exit_code=code if code is not None and code >= 0 else None,
            failure=lines.failure, stopped=stopped, log_path=log_path,
            progress=lines.progress,
            signal=-code if code is not None and code < 0 else None, killed=killed,
            duration_seconds=time.monotonic() - started, limit=limit)

    @staticmethod
    def _may_start(control: AttemptControl) -> bool:
        """Whether a command held by its sandbox may be released now: nothing says stop
        (its lease deadline has not passed, no cancel, no drain)."""
        return control.stop_reason() is None

    def _watch(self, proc: subprocess.Popen[bytes], control: AttemptControl,
               deadline: float | None, watch: ResourceWatch | None) -> StopReason | None:
        """Wait for the shell to exit; the stop reason when it must be stopped first."""
        while True:
            reason = control.stop_reason()
            if reason is None and deadline is not None and time.monotonic() >= deadline:
                reason = StopReason.TIMEOUT
            if reason is None and watch is not None and watch.check() is not None:
                reason = StopReason.LIMIT_EXCEEDED
            if reason is not None:
                return reason
            try:
                proc.wait(timeout=self.poll_seconds)
            except subprocess.TimeoutExpired:
                continue
            # The shell is gone; what it left behind (a fork bomb whose first process
            # returns at once) is judged before it is terminated as leftovers.
            if watch is not None and watch.check() is not None:
                return StopReason.LIMIT_EXCEEDED
            return None

    def _end_group(self, proc: subprocess.Popen[bytes], group: Members, out: _Log, *,
                   requested: bool, watch: ResourceWatch | None = None) -> bool:
        """SIGTERM, grace, SIGKILL to whatever of the group still runs; then wait until
        the group no longer exists. True when SIGKILL was needed. The resource watch
        goes on through the grace: a process tree that goes over a limit while it is
        being stopped is killed at once."""
        killed = False
        proc.poll()  # reap the shell if it exited, so it is not counted as alive
        pgid = proc.pid
        if group.state() is GroupState.ALIVE:
            if not requested:
                out.note("the agent's shell exited but processes of its group remain: "
                         "SIGTERM to its process group")
            group.signal(signal.SIGTERM)
            grace_end = time.monotonic() + self.term_grace_seconds
            while True:
                proc.poll()
                if group.state() is not GroupState.ALIVE:
                    break
                if watch is not None and watch.exceeded is None and watch.check() is not None:
                    out.note(f"{watch.exceeded} while stopping: SIGKILL to its processes")
                    watch.kill()
                    killed = True
                if time.monotonic() >= grace_end:
                    out.note(f"the process group outlived the {self.term_grace_seconds:g} s "
                             "grace: SIGKILL")
                    log.warning("agent_sigkill", pgid=pgid)
                    group.signal(signal.SIGKILL)
                    killed = True
                    break
                time.sleep(min(self.poll_seconds, 0.05))
        reap_end = time.monotonic() + self.reap_timeout_seconds
        while True:
            proc.poll()
            state = group.state()
            if state is GroupState.GONE:
                break
            if time.monotonic() >= reap_end:
                out.note(f"WARNING process group {pgid} still exists ({state.value}) "
                         f"{self.reap_timeout_seconds:g} s after it was ended")
                log.warning("agent_group_not_reaped", pgid=pgid, state=state.value)
                break
            if state is GroupState.ZOMBIES:
                group.reap_adopted()
            else:  # past the grace, something runs again (a late fork): no more grace
                group.signal(signal.SIGKILL)
                killed = True
            time.sleep(0.01)
        if proc.returncode is None:
            try:
                proc.wait(timeout=self.reap_timeout_seconds)
            except subprocess.TimeoutExpired:
                log.warning("agent_shell_not_reaped", pid=proc.pid)
        return killed


def _sandbox_attributes(workspace: Path, proc: subprocess.Popen[bytes],
                        members: Members) -> dict[str, Any]:
    """What names a started sandbox in its span: the workspace it sees (the attempt's
    ``runlane.sandbox_id``), and the process to look for on the host: with bwrap the
    host pid of its namespace's PID 1 and the namespace, without the shell's pid (it
    leads the command's process group)."""
    attributes: dict[str, Any] = {"runlane.sandbox_id": workspace.name,
                                  "runlane.sandbox.pid": proc.pid}
    if isinstance(members, Namespace):
        info = members.info()  # bwrap wrote it before the command's release; kept
        attributes["runlane.sandbox.pid"] = info.get("child-pid", proc.pid)
        attributes["runlane.sandbox.pid_namespace"] = info.get("pid-namespace")
    return attributes


class _ControlLines:
    """What the stdout lines say: handled on the reader thread."""

    def __init__(self, control: AttemptControl, out: _Log) -> None:
        self._control = control
        self._out = out
        self.failure: Failure | None = None
        self.progress: list[str] = []
        self._warned: set[str] = set()

    def stdout_line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace")
        try:
            message = parse_control_line(text)
        except MalformedControlLine as exc:
            self._out.note(f"WARNING malformed control line ignored ({exc}): {text.rstrip()}")
            return
        if message is None:
            self._out.line(raw)
            kind = control_ish(text)
            if kind is not None and kind not in self._warned:
                self._warned.add(kind)  # once per kind and attempt: it may be a log line
                self._out.note(f"WARNING the line above looks like a {kind!r} control line "
                               f"but is not one, so runlane ignored it ({CONTROL_LINE_HINT})")
        elif isinstance(message, Failure):
            self.failure = message  # the last one wins
        elif isinstance(message, CostReport):
            self._call("report_cost", lambda: self._control.report_cost(
                message.usd, message.input_tokens, message.output_tokens))
        elif isinstance(message, ToolCallReport):
            self._call("tool_call", lambda: self._control.tool_call(
                message.id, message.name, shell=message.shell, seconds=message.seconds))
        elif isinstance(message, IterationReport):
            self._call("iteration", self._control.iteration)
        else:
            self.progress.append(message.message)
            self._call("progress", lambda: self._control.progress(message.message))

    def _call(self, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:
            log.warning("agent_control_callback_failed", callback=what, error=repr(exc))
            self._out.note(f"WARNING control.{what} failed: {exc!r}")
