"""The sandbox around agent and verify commands (bubblewrap), and the agent's
environment. See :mod:`runlane.sandbox.sandbox` and :mod:`runlane.sandbox.view`."""

from runlane.sandbox.environment import agent_environment
from runlane.sandbox.processes import GroupState, Members, Namespace, ProcessGroup
from runlane.sandbox.sandbox import (
    MODES,
    OFF_WARNING,
    Mode,
    Sandbox,
    SandboxConfig,
    SandboxUnavailable,
    Spawn,
)

__all__ = ["MODES", "OFF_WARNING", "GroupState", "Members", "Mode", "Namespace",
           "ProcessGroup", "Sandbox", "SandboxConfig", "SandboxUnavailable", "Spawn",
           "agent_environment"]
