"""The scheduler service: passes over waiting runs, event-driven and periodic.

Admission itself happens in the submitting transaction; what is left for a pass is
the work that waits on time or on other runs: deferred runs whose retry-after has
come, and (as a repair) admitted runs whose dependencies all ended. Passes are
single-flight per process (seed 003): a trigger that arrives while a pass runs
folds into exactly one follow-up pass, never a queue of them and never dropped,
and a caller that finds a pass running returns at once instead of waiting (no
caller ever waits on a pass, so no wait cycle can form). Across processes the
pass takes rows with SKIP LOCKED and writes with compare-and-set, so several
schedulers are safe and never wait on each other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runlane.services.maintenance import MaintenanceService
from runlane.services.notifications import Notifier
from runlane.store.approvals import expire_approvals
from runlane.store.policy import SCHEDULE_CHANNEL
from runlane.store.store import Store
from runlane.store.wakeup import Listener


class PassTrigger:
    """Single-flight passes with coalesced demand."""

    def __init__(self, run_pass: Callable[[], dict[str, int]]) -> None:
        self._run_pass = run_pass
        self._lock = threading.Lock()
        self._pending = False
        self._running = False

    def request(self) -> None:
        """Record demand for a pass (cheap; callable from any thread)."""
        with self._lock:
            self._pending = True

    def run_pending(self) -> bool:
        """Run passes while demand is pending; False when a pass is already running
        (this demand folds into it) or there was none."""
        with self._lock:
            if self._running or not self._pending:
                return False
            self._running, self._pending = True, False
        try:
            while True:
                self._run_pass()
                with self._lock:
                    # Stop running in the block that finds no demand: a request made
                    # after a separate check found the pass still running, returned,
                    # and was never run.
                    if not self._pending:
                        self._running = False
                        return True
                    self._pending = False
        except BaseException:
            with self._lock:
                self._running = False  # the demand that came meanwhile stays pending
            raise


@dataclass(frozen=True)
class SchedulerConfig:
    interval_seconds: float = 5.0
    page_size: int = 200
    default_max_attempts: int = 3  # of a campaign's runs whose file names none


class Scheduler(MaintenanceService):
    """Re-admits deferred runs when their retry-after comes; resolves dependencies;
    ends the runs whose approval gate's timeout passed."""

    name = "scheduler"

    def __init__(self, store: Store, config: SchedulerConfig | None = None) -> None:
        self.store = store
        self.config = config or SchedulerConfig()
        self.interval_seconds = self.config.interval_seconds
        self.trigger = PassTrigger(self._pass)
        self.notifier = Notifier(store)
        self._last: dict[str, int] = {}
        self._policy_seen: int | None = None
        self._backlog_left = False  # the last backlog pass skipped runs claims held
        self.passes = 0

    def _pass(self) -> dict[str, int]:
        self.passes += 1
        # A new policy may admit deferred runs before their retry-after: look at all.
        version = self.store.current_policy()[0]
        changed = self._policy_seen is not None and version != self._policy_seen
        # The queued backlog admitted under an older version is admitted again after a
        # change, after a pass that could not reach all of it, and on this scheduler's
        # first pass unless a pass already did so under this version (a change may
        # have come while no scheduler ran); under version 0 every run was admitted
        # under it.
        backlog = version > 0 and (
            changed or self._backlog_left
            or (self._policy_seen is None and not self.store.backlog_admitted(version)))
        # Deferred runs too, on a first pass that catches up with a version no pass
        # has seen through (every `maintain --once` is a first pass: a lifted rule
        # left its runs deferred until their retry-after).
        first = self._policy_seen is None
        self._last = self.store.schedule_pass(page_size=self.config.page_size,
                                              not_yet_due=changed or (first and backlog),
                                              queued_under_older=backlog)
        # Approval gates whose timeout passed end their runs (APPROVAL_EXPIRED).
        self._last.update(expire_approvals(self.store, page_size=self.config.page_size))
        # Campaigns: release the batches their rollout allows, dispatch their targets,
        # send their notifications (store/campaigns.py, services/notifications.py).
        self._last.update(self.store.campaign_pass(
            default_max_attempts=self.config.default_max_attempts))
        self._last.update(self.notifier.run_once())
        # Only once the pass is done: one that failed is run again in full.
        self._policy_seen = version
        self._backlog_left = self._last.get("queued_skipped", 0) > 0
        return self._last

    def run_once(self) -> dict[str, int]:
        self.trigger.request()
        if not self.trigger.run_pending():
            return {}
        return dict(self._last)

    def run_forever(self, stop: threading.Event) -> None:
        """Periodic passes, and on PostgreSQL an immediate one when a policy is
        applied anywhere (NOTIFY); a burst of notifications folds into one pass."""
        if not self.store.is_postgres:
            super().run_forever(stop)
            return
        with Listener(self.store.url, channels=(SCHEDULE_CHANNEL,),
                      listen_database_url=self.store.listen_url).start() as listener:
            # LISTEN before the first pass reads the version in force: a policy applied
            # in between was notified to nobody and waited for the periodic pass.
            listener.wait_connected()
            due = 0.0
            woken: list[Any] = []
            while not stop.is_set():
                if woken or time.monotonic() >= due:
                    due = time.monotonic() + self.interval_seconds
                    self.run_logged()
                woken = listener.wait(min(1.0, max(0.0, due - time.monotonic())))
