"""One maintenance leader per database: of several ``runlane up`` / ``runlane maintain``
nodes, the one holding the maintenance lock (store/leadership.py) runs the passes.

A node that is not leader tries the lock again every ``retry_seconds`` (well below the
lease TTL), so when the leader dies another takes over within one lease TTL: the
reaper is running again before the dead leader's workers' leases expire, or soon
after. The leader checks its lock as often; when the lock's session is gone (a
PostgreSQL restart) it stops its passes, lets each finish the one it is in, and
contends again. Passes stay safe if two nodes ever run them at once (a leader whose
connection hangs while the server has already let its lock go): the reaper and the
others claim rows with SKIP LOCKED and write with compare-and-set.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Callable, Sequence

import structlog

from runlane.services.maintenance import MaintenanceService
from runlane.store.leadership import MaintenanceLock

log = structlog.get_logger("runlane.maintenance")

# The longest a node waits between two tries of the lock (and a leader between two
# checks of it), whatever the lease TTL.
MAX_RETRY_SECONDS = 5.0


def retry_seconds(lease_ttl_seconds: float) -> float:
    """A quarter of the lease TTL, at most MAX_RETRY_SECONDS: a new leader's reaper runs
    well within one TTL of the old leader's death."""
    return max(0.05, min(lease_ttl_seconds / 4, MAX_RETRY_SECONDS))


def new_node_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


class MaintenanceLeader:
    """Runs ``services`` (each on a thread of its own) while this node holds ``lock``."""

    def __init__(self, lock: MaintenanceLock,
                 services: Callable[[], Sequence[MaintenanceService]], *,
                 retry_seconds: float, node_id: str | None = None) -> None:
        self.lock = lock
        self.services = services  # fresh ones per term: a scheduler's first pass
        self.retry_seconds = retry_seconds
        self.node_id = node_id or new_node_id()
        self.terms = 0
        self.leading = threading.Event()

    def run_forever(self, stop: threading.Event) -> None:
        """Contend, lead, and on a loss contend again, until ``stop``."""
        try:
            while not stop.is_set():
                try:
                    if self.lock.try_acquire():
                        self._lead(stop)
                        continue
                except Exception as exc:  # a bug must not end maintenance on this node
                    log.error("maintenance_leader_failed", node=self.node_id,
                              error=f"{type(exc).__name__}: {exc}")
                    self.lock.release()
                stop.wait(self.retry_seconds)
        finally:
            self.lock.release()

    def _lead(self, stop: threading.Event) -> None:
        self.terms += 1
        log.info("maintenance_leader_acquired", node=self.node_id, term=self.terms)
        term = threading.Event()
        threads = []
        for service in self.services():
            service.node = self.node_id
            threads.append(threading.Thread(target=service.run_forever, args=(term,),
                                            daemon=True, name=f"runlane-{service.name}"))
        self.leading.set()
        for t in threads:
            t.start()
        lost = False
        while not stop.wait(self.retry_seconds):
            if not self.lock.still_held():
                lost = True
                log.warning("maintenance_leader_lost", node=self.node_id,
                            term=self.terms, consequence="passes stopped; contending again")
                break
        term.set()
        for t in threads:  # each finishes the pass it is in
            t.join()
        self.leading.clear()
        if not lost:
            self.lock.release()
            log.info("maintenance_leader_released", node=self.node_id,
                     term=self.terms)
