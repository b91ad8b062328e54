"""The limits an agent is held to through its own reports: ``max_tool_calls``,
``max_agent_iterations`` and ``max_shell_command_seconds``.

runlane cannot see an agent's tool calls or loop from outside; the agent says so
with control lines (``{"runlane": "tool_call", ...}``, ``{"runlane": "iteration"}``)
or, in process, through its context. An agent that never reports is not limited by
them (docs/policy.md says so). Counted per attempt: each attempt starts a fresh
agent on a fresh clone, and a retry after a lost worker must not find its budget
spent by the dead one. (Cost and tokens, money, are counted per run by the store.)

Pure: the caller passes the time (a monotonic clock) and holds any lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# An agent that opens this many shell commands without ending any is not timed for
# more (each open one costs memory in the worker; it is still counted as a tool call).
MAX_OPEN_SHELL_CALLS = 1024


def _figure(value: float) -> str:
    return f"{value:g}"


@dataclass
class _Open:
    name: str | None
    since: float


@dataclass
class CooperativeLimits:
    """Counts of one attempt against its limits snapshot; each method returns the
    message naming the limit the report goes over (the run's message), or None."""

    max_tool_calls: int | None = None
    max_agent_iterations: int | None = None
    max_shell_command_seconds: float | None = None
    tool_calls: int = 0
    iterations: int = 0
    _seen: set[str] = field(default_factory=set)
    _open: dict[str, _Open] = field(default_factory=dict)

    @classmethod
    def from_snapshot(cls, limits: Mapping[str, Any]) -> CooperativeLimits:
        return cls(max_tool_calls=limits.get("max_tool_calls"),
                   max_agent_iterations=limits.get("max_agent_iterations"),
                   max_shell_command_seconds=limits.get("max_shell_command_seconds"))

    @property
    def timing(self) -> bool:
        """Whether a shell command is open and timed (checked on every poll)."""
        return bool(self._open)

    def tool_call(self, call_id: str | None, name: str | None, *, shell: bool,
                  seconds: float | None, now: float) -> str | None:
        """A tool call begins (``seconds`` None) or has ended after ``seconds``. A call
        is counted once: a line with an ``id`` seen before is the same call."""
        new = call_id is None or call_id not in self._seen
        if new:
            self.tool_calls += 1
            if call_id is not None and self.max_tool_calls is not None:
                self._seen.add(call_id)  # at most max_tool_calls + 1 ids: then it stops
        over = None
        if new and self.max_tool_calls is not None and self.tool_calls > self.max_tool_calls:
            over = (f"max_tool_calls {self.max_tool_calls} exceeded: "
                    f"{self.tool_calls} tool calls")
        limit = self.max_shell_command_seconds
        if limit is None:
            return over
        if seconds is None:
            if shell and call_id is not None and len(self._open) < MAX_OPEN_SHELL_CALLS:
                self._open.setdefault(call_id, _Open(name, now))
            return over
        began = self._open.pop(call_id, None) if call_id is not None else None
        if not (shell or began is not None):
            return over
        # The agent's own figure, or the time between its two lines if that is longer
        # (an agent whose figure is short, or whose output was held in a buffer).
        took = max(seconds, now - began.since) if began is not None else seconds
        if over is None and took > limit:
            over = (f"max_shell_command_seconds {_figure(limit)} exceeded: "
                    f"{_call(call_id, name or (began.name if began else None))} "
                    f"ran {took:.1f} s")
        return over

    def overdue(self, now: float) -> str | None:
        """An open shell command past its limit: the agent is stopped while it runs."""
        limit = self.max_shell_command_seconds
        if limit is None:
            return None
        for call_id, call in self._open.items():
            if now - call.since > limit:
                return (f"max_shell_command_seconds {_figure(limit)} exceeded: "
                        f"{_call(call_id, call.name)} has run {now - call.since:.1f} s")
        return None

    def iteration(self) -> str | None:
        self.iterations += 1
        limit = self.max_agent_iterations
        if limit is not None and self.iterations > limit:
            return f"max_agent_iterations {limit} exceeded: {self.iterations} iterations"
        return None


def _call(call_id: str | None, name: str | None) -> str:
    said = "tool call"
    if call_id is not None:
        said += f" {call_id}"
    if name:
        said += f" ({name})"
    return said
