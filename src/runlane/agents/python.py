"""In-process agents: a Python callable instead of a command.

The agent receives an ``AgentContext``. It calls ``checkpoint()`` between steps
(it raises as soon as the run is cancelled, the lease is lost, the wall clock is
over, a limit is exceeded, or the worker drains), reports cost, iterations and tool
calls (held to the run's limits as a command agent's control lines are), and
performs any external side effect through ``effect(key, find=…, do=…)`` so a
retried attempt never repeats it. To fail with a reason code it raises
``AgentFailed``.

    def my_agent(ctx: AgentContext) -> None:
        for step in plan(ctx.prompt):
            ctx.iteration()
            with ctx.tool_call("bash", shell=True):
                apply(step, ctx.workspace)
            ctx.report_cost(0.01, input_tokens=900, output_tokens=120)

An in-process agent is the worker's own thread: the process resource limits
(``max_memory_mb`` and the others of agents/resources.py) cannot apply to it, and a
shell command it runs itself is timed when it ends, not stopped while it runs.

    Runlane(...).worker(agent=PythonAgentRunner(my_agent)).run()
"""

from __future__ import annotations

import itertools
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from runlane.agents.base import (
    AgentResult,
    AttemptControl,
    AttemptLimits,
    Failure,
    StopReason,
)
from runlane.agents.command import (
    MAX_MESSAGE_CHARS,
    MalformedControlLine,
    checked_cost,
    checked_failure,
)
from runlane.domain.reasons import Reason


class AgentStopped(Exception):
    """Raised by ``checkpoint()``: the agent must return now."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class AgentFailed(Exception):
    """Raise to end the attempt with a reason code (e.g. PROVIDER_RATE_LIMIT)."""

    def __init__(self, reason_code: str, message: str | None = None,
                 retry_after_seconds: float | None = None) -> None:
        super().__init__(message or reason_code)
        self.failure = Failure(reason_code, message, retry_after_seconds)


class ToolCall:
    """One tool call of an in-process agent (``AgentContext.tool_call``). Used as a
    context manager, its end is reported with its duration (a shell command's is held
    to ``max_shell_command_seconds``)."""

    def __init__(self, ctx: AgentContext, call_id: str, name: str, shell: bool) -> None:
        self.ctx = ctx
        self.id = call_id
        self.name = name
        self.shell = shell
        self.started = time.monotonic()

    def __enter__(self) -> ToolCall:
        if self.shell:  # the same id again: not another call; its clock starts
            self.started = time.monotonic()
            self.ctx.control.tool_call(self.id, self.name, shell=True)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.ctx.control.tool_call(self.id, self.name, shell=self.shell,
                                   seconds=time.monotonic() - self.started)
        if kind is None:
            self.ctx.checkpoint()


@dataclass
class AgentContext:
    workspace: Path
    artifacts_dir: Path
    env: dict[str, str]
    control: AttemptControl
    deadline: float | None
    _call_ids: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def prompt(self) -> str:
        return self.env["RUNLANE_PROMPT"]

    @property
    def run_id(self) -> str:
        return self.env["RUNLANE_RUN_ID"]

    @property
    def attempt(self) -> int:
        return int(self.env["RUNLANE_ATTEMPT"])

    def checkpoint(self) -> None:
        reason = self.control.stop_reason()
        if reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            reason = StopReason.TIMEOUT
        if reason is not None:
            raise AgentStopped(reason)

    def report_cost(self, usd: float, *, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Checked as a `cost` control line is: a negative or non-finite figure raises
        ValueError (a negative cost would lower the run's cost limit and the budgets);
        a huge one counts as at most what one line may."""
        report = checked_cost(usd, input_tokens, output_tokens)
        self.control.report_cost(report.usd, report.input_tokens, report.output_tokens)

    def progress(self, message: str) -> None:
        self.control.progress(message)

    def tool_call(self, name: str, *, shell: bool = False) -> ToolCall:
        """Count one tool call against ``max_tool_calls`` (raises AgentStopped when the
        run is over a limit). ``with ctx.tool_call("bash", shell=True): ...`` also
        times it: a shell command is held to ``max_shell_command_seconds`` when it ends
        (the agent's own thread runs it: nothing can stop it before)."""
        call = ToolCall(self, f"py-{next(self._call_ids)}", name, shell)
        self.control.tool_call(call.id, name)
        self.checkpoint()
        return call

    def iteration(self) -> None:
        """Count one iteration of the agent's loop against ``max_agent_iterations``
        (raises AgentStopped when the run is over a limit)."""
        self.control.iteration()
        self.checkpoint()

    def effect(self, key: str, *, find: Callable[[], dict[str, Any] | None],
               do: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        self.checkpoint()
        return self.control.effect(key, find=find, do=do)


PythonAgent = Callable[[AgentContext], None]


def _classified(failure: Failure) -> Failure:
    """The failure as a `fail` control line would be taken: one with an unknown reason
    code (or a bad retry-after) is AGENT_FAILED, its message kept. (A code only runlane
    may record is turned into AGENT_FAILED by the driver, for both kinds of agent.)"""
    try:
        return checked_failure(failure.reason_code, failure.message,
                               failure.retry_after_seconds)
    except MalformedControlLine as exc:
        said = f": {failure.message}" if failure.message else ""
        return Failure(Reason.AGENT_FAILED,
                       f"agent failed with {exc}{said}"[:MAX_MESSAGE_CHARS])


class PythonAgentRunner:
    """Runs a Python agent on the attempt's thread; same results as the command runner."""

    def __init__(self, agent: PythonAgent) -> None:
        self.agent = agent

    def run(self, *, workspace: Path, artifacts_dir: Path, env: dict[str, str],
            control: AttemptControl, limits: AttemptLimits,
            log_name: str = "agent.log") -> AgentResult:
        artifacts_dir.mkdir(parents=True, exist_ok=True)
        log_path = artifacts_dir / log_name
        started = time.monotonic()
        deadline = (started + limits.wall_clock_seconds
                    if limits.wall_clock_seconds is not None else None)
        ctx = AgentContext(workspace, artifacts_dir, env, control, deadline)
        unheld = [name for name, value in vars(limits.resources).items() if value is not None]
        if unheld:  # said in the attempt's log, not silently ignored
            with log_path.open("a") as fh:
                fh.write(f"[runlane] in-process agent: {', '.join(unheld)} apply only to "
                         "agent commands, not to this agent\n")
        try:
            self.agent(ctx)
        except AgentStopped as stop:
            return AgentResult(exit_code=None, stopped=stop.reason, log_path=log_path)
        except AgentFailed as failed:
            return AgentResult(exit_code=1, failure=_classified(failed.failure),
                               log_path=log_path)
        except Exception as exc:
            with log_path.open("a") as fh:
                fh.write(traceback.format_exc())
            # The exception's message is the run's message, as a command's `fail` line is.
            return AgentResult(exit_code=1, log_path=log_path, failure=Failure(
                Reason.AGENT_FAILED, f"{type(exc).__name__}: {exc}"[:MAX_MESSAGE_CHARS]))
        finally:
            with log_path.open("a") as fh:
                fh.write(f"[runlane] python agent ran {time.monotonic() - started:.3f}s\n")
        return AgentResult(exit_code=0, log_path=log_path)
