"""Maintenance services, all of one shape: a config with defaults, ``run_once()``
returning counts, and ``run_forever()`` looping around it. Each is safe to run on
several machines at once: they claim work with SKIP LOCKED and write with CAS."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields

import structlog

from runlane.store.maintenance import WALL_CLOCK_MARGIN_SECONDS, session_lost
from runlane.store.maintenance_sql import FIRST_KEY
from runlane.store.store import Store

log = structlog.get_logger("runlane.maintenance")


def _check_config(config: object) -> None:
    """Every count at least 1, every duration at least 0 (a negative grace would
    repair runs that need nothing; a batch of 0 would walk nothing)."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if isinstance(value, int) and value < 1:
            raise ValueError(f"{type(config).__name__}.{f.name} must be at least 1, "
                             f"not {value}")
        if isinstance(value, float) and not value >= 0:
            raise ValueError(f"{type(config).__name__}.{f.name} must be at least 0, "
                             f"not {value}")


@dataclass(frozen=True)
class ReaperConfig:
    """``interval_seconds`` between passes (5); a pass walks the expired leases oldest
    first, ``batch_size`` (100) at a time, until a batch comes back short or
    ``max_batches_per_pass`` (50) batches."""

    interval_seconds: float = 5.0
    batch_size: int = 100
    max_batches_per_pass: int = 50

    def __post_init__(self) -> None:
        _check_config(self)


@dataclass(frozen=True)
class ReconcilerConfig:
    """``interval_seconds`` between passes (60); each repair's candidates walked
    ``batch_size`` (100) at a time, at most ``max_batches_per_pass`` (50) batches; the
    graces of repairs 1, 4 and 5 (60, 60, 180); repair 6 times out an attempt past its
    run's ``max_wall_clock_minutes`` plus ``wall_clock_margin_seconds`` (1800: clone
    and finalize, which the limit does not cover), or past ``max_attempt_seconds``
    (7200, MAX_ATTEMPT_SECONDS) when its run has no wall-clock limit."""

    interval_seconds: float = 60.0
    batch_size: int = 100
    admitted_grace_seconds: float = 60.0
    active_grace_seconds: float = 60.0
    worker_grace_seconds: float = 180.0
    max_attempt_seconds: float = 7200.0
    wall_clock_margin_seconds: float = WALL_CLOCK_MARGIN_SECONDS
    max_batches_per_pass: int = 50

    def __post_init__(self) -> None:
        _check_config(self)


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
    node: str | None = None  # the maintenance leader running it (services/leader.py)

    def run_once(self) -> dict[str, int]:
        raise NotImplementedError

    def run_logged(self) -> None:
        """One pass for a loop: counts logged, a failure logged and survived (the
        next pass may succeed). Each pass's start and end are logged at DEBUG with the
        node and wall-clock time: what shows that two nodes' passes never overlapped."""
        log.debug("maintenance_pass_started", service=self.name, node=self.node,
                  at=time.time())
        try:
            counts = self.run_once()
            if any(counts.values()):
                log.info("maintenance_pass", service=self.name, **counts)
        except Exception as exc:
            if session_lost(exc):  # a restarted database, a terminated backend: no row's
                first = (str(exc).splitlines() or [""])[0][:300]
                log.warning("maintenance_pass_interrupted", service=self.name,
                            error=f"{type(exc).__name__}: {first}",
                            consequence="the next pass takes up the rest")
                return
            log.error("maintenance_failed", service=self.name, error=str(exc))
        finally:
            log.debug("maintenance_pass_ended", service=self.name, node=self.node,
                      at=time.time())

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.run_logged()
            stop.wait(self.interval_seconds)


class Reaper(MaintenanceService):
    """Expires leases whose time has passed and recovers their runs (WORKER_LOST).

    A pass walks the expired leases with a keyset, (expiry, run id) past the last one
    seen, never re-reading a fixed head: a lease whose recovery raises is logged,
    counted (``rows_failed``) and passed over, and every lease behind it is still
    reaped in the same pass. The next pass starts from the oldest again, so the
    failing lease is tried again (it may have been fixed) without holding up others."""

    name = "reaper"

    def __init__(self, store: Store, config: ReaperConfig | None = None) -> None:
        self.store = store
        self.config = config or ReaperConfig()
        self.interval_seconds = self.config.interval_seconds

    def run_once(self) -> dict[str, int]:
        reaped = failed = 0
        after = FIRST_KEY
        for _ in range(self.config.max_batches_per_pass):
            batch = self.store.reap_expired_batch(limit=self.config.batch_size, after=after)
            reaped += batch.reaped
            failed += batch.failed
            # Not ``reaped < batch_size``: with several reapers, one that finds its
            # batch taken by another (reaped 0) would end its pass with more waiting.
            if batch.listed < self.config.batch_size or batch.last is None:
                break
            after = batch.last
        return {"expired_leases": reaped, "rows_failed": failed}


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
            wall_clock_margin=c.wall_clock_margin_seconds, limit=c.batch_size,
            max_pages=c.max_batches_per_pass,
        )
