"""Maintenance services, all of one shape: a config with defaults, ``run_once()``
returning counts, and ``run_forever()`` looping around it. Each is safe to run on
several machines at once: they claim work with SKIP LOCKED and write with CAS."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import structlog

from runlane.store.store import Store

log = structlog.get_logger("runlane.maintenance")


@dataclass(frozen=True)
class ReaperConfig:
    interval_seconds: float = 5.0
    batch_size: int = 100
    max_batches_per_pass: int = 50


@dataclass(frozen=True)
class ReconcilerConfig:
    interval_seconds: float = 60.0
    batch_size: int = 100
    admitted_grace_seconds: float = 60.0
    active_grace_seconds: float = 60.0
    worker_grace_seconds: float = 180.0
    max_attempt_seconds: float = 7200.0


def worker_grace_seconds(heartbeat_seconds: float, lease_ttl_seconds: float) -> float:
    """How long a worker's row may go without a beat before the reconciler marks it
    DEAD: never less than the default, and longer than a few of its beats and than a
    lease (settings allow a beat every third of the TTL: a fixed grace marked healthy
    workers dead between two beats)."""
    return max(ReconcilerConfig.worker_grace_seconds, 3 * heartbeat_seconds,
               lease_ttl_seconds)


class MaintenanceService:
    name = "service"
    interval_seconds: float = 5.0

    def run_once(self) -> dict[str, int]:
        raise NotImplementedError

    def run_logged(self) -> None:
        """One pass for a loop: counts logged, a failure logged and survived (the
        next pass may succeed)."""
        try:
            counts = self.run_once()
            if any(counts.values()):
                log.info("maintenance_pass", service=self.name, **counts)
        except Exception as exc:
            log.error("maintenance_failed", service=self.name, error=str(exc))

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.run_logged()
            stop.wait(self.interval_seconds)


class Reaper(MaintenanceService):
    """Expires leases whose time has passed and recovers their runs (WORKER_LOST)."""

    name = "reaper"

    def __init__(self, store: Store, config: ReaperConfig | None = None) -> None:
        self.store = store
        self.config = config or ReaperConfig()
        self.interval_seconds = self.config.interval_seconds

    def run_once(self) -> dict[str, int]:
        total = 0
        for _ in range(self.config.max_batches_per_pass):
            listed, reaped = self.store.reap_expired_batch(limit=self.config.batch_size)
            total += reaped
            # Not ``reaped < batch_size``: with several reapers, one that finds its
            # batch taken by another (reaped 0) would end its pass with more waiting.
            if listed < self.config.batch_size:
                break
        return {"expired_leases": total}


class Reconciler(MaintenanceService):
    """The conservative repairs of seed 000 §25."""

    name = "reconciler"

    def __init__(self, store: Store, config: ReconcilerConfig | None = None) -> None:
        self.store = store
        self.config = config or ReconcilerConfig()
        self.interval_seconds = self.config.interval_seconds

    def run_once(self) -> dict[str, int]:
        c = self.config
        return self.store.reconcile(
            admitted_grace=c.admitted_grace_seconds, active_grace=c.active_grace_seconds,
            worker_grace=c.worker_grace_seconds, max_attempt_seconds=c.max_attempt_seconds,
            limit=c.batch_size,
        )
