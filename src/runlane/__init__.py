"""runlane: a durable run scheduler for background AI coding agents."""

from runlane.api import InvalidArgument, Runlane
from runlane.clock import DatabaseClock, ManualClock
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.errors import CancelRequested, LeaseLost, RunlaneError
from runlane.logs import log_to_stderr_unless_configured
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.version import __version__

log_to_stderr_unless_configured()

__all__ = [
    "CancelRequested",
    "DatabaseClock",
    "InvalidArgument",
    "Lease",
    "LeaseLost",
    "ManualClock",
    "Reason",
    "RunStatus",
    "Runlane",
    "RunlaneError",
    "Store",
    "__version__",
]
