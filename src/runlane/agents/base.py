"""What every agent runner shares: how it asks whether to stop, and what it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from runlane.agents.resources import ResourceLimits


class StopReason(StrEnum):
    """Why a runner stopped the agent before it finished on its own."""

    CANCELLED = "cancelled"  # the run got CANCEL_REQUESTED
    LEASE_LOST = "lease_lost"  # the heartbeat could not extend the lease
    TIMEOUT = "timeout"  # the run's wall-clock limit passed
    LIMIT_EXCEEDED = "limit_exceeded"  # e.g. reported cost over the run's maximum
    DRAINING = "draining"  # the worker's drain grace period is over


class AttemptControl(Protocol):
    """The worker's side of a running attempt, as a runner sees it."""

    def stop_reason(self) -> StopReason | None:
        """Non-None as soon as the agent must stop (polled often; must be cheap)."""
        ...

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None: ...

    def progress(self, message: str) -> None: ...

    def tool_call(self, call_id: str | None, name: str | None, *, shell: bool = False,
                  seconds: float | None = None) -> None:
        """The agent started (or, with ``seconds``, ended) a tool call: counted against
        ``max_tool_calls``; a shell command is timed against ``max_shell_command_seconds``."""
        ...

    def iteration(self) -> None:
        """The agent began one more iteration of its loop (``max_agent_iterations``)."""
        ...

    def effect(self, key: str, *, find: Callable[[], dict[str, Any] | None],
               do: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Perform an external side effect at most once per run (the ledger)."""
        ...


@dataclass(frozen=True)
class Failure:
    """A failure the agent classified itself with a control line."""

    reason_code: str
    message: str | None = None
    retry_after_seconds: float | None = None


@dataclass(frozen=True)
class AttemptLimits:
    wall_clock_seconds: float | None = None
    max_changed_files: int | None = None
    max_diff_lines: int | None = None
    # The process tree's limits (agents/resources.py): the command runner applies them;
    # an in-process agent is the worker's own thread and cannot be held to them.
    resources: ResourceLimits = field(default_factory=ResourceLimits)
    # The sandbox's terms from the run's policy: the host network or none, and the
    # names of the worker's variables given to the agent as files (runlane.sandbox).
    network: bool = True
    secrets: tuple[str, ...] = ()


@dataclass
class AgentResult:
    """How the agent's part of an attempt ended."""

    exit_code: int | None  # None when it was killed or never started
    failure: Failure | None = None  # the last {"runlane": "fail"} control line, if any
    stopped: StopReason | None = None
    log_path: Path | None = None
    progress: list[str] = field(default_factory=list)
    signal: int | None = None  # the signal that ended the agent's shell, if one did
    killed: bool = False  # True when the process group had to be SIGKILLed after the grace
    duration_seconds: float | None = None  # wall-clock time from start to the group gone
    limit: str | None = None  # with LIMIT_EXCEEDED by the runner: the limit and its figures

    @property
    def succeeded(self) -> bool:
        return self.stopped is None and self.exit_code == 0 and self.failure is None
