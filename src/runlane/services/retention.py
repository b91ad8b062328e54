"""The retention service: keeps the hot tables small by pruning finished runs older
than ``keep_days``, a bounded number of short batches per pass (same shape as the
services of ``maintenance``: a config with defaults, ``run_once()``, a loop)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from runlane.services.maintenance import MaintenanceService
from runlane.store.retention import (
    PruneCursor,
    PruneResult,
    RetentionStatements,
    prune_finished,
)
from runlane.store.store import Store

DAY = 86_400.0


@dataclass(frozen=True)
class RetentionConfig:
    keep_days: float = 30.0
    batch_size: int = 500  # runs per transaction
    # 2,000,000 runs a pass: a backlog (retention turned on late, a lowered RETENTION_DAYS)
    # goes in one pass, not one pass an hour (bench/retention.py: 1,000,000 in ...).
    max_batches_per_pass: int = 4000
    pause_seconds: float = 0.05  # between two batches: other writers get the locks
    interval_seconds: float = 3600.0


class Pruner(MaintenanceService):
    """Deletes finished runs (and their attempts, events, side effects and tasks) whose
    last change is older than ``keep_days``; never an unfinished or leased run."""

    name = "retention"

    def __init__(self, store: Store, config: RetentionConfig | None = None) -> None:
        self.store = store
        self.config = config or RetentionConfig()
        self.interval_seconds = self.config.interval_seconds
        self._statements: RetentionStatements | None = None

    def prune_batch(self, cursor: PruneCursor | None = None) -> PruneResult:
        if self._statements is None:
            self._statements = RetentionStatements(self.store)
        return prune_finished(self.store, keep_seconds=self.config.keep_days * DAY,
                              limit=self.config.batch_size, statements=self._statements,
                              cursor=cursor)

    def run_once(self) -> dict[str, int]:
        total = PruneResult()
        batches = 0
        cursor = PruneCursor()  # one walk per pass, oldest first
        for _ in range(self.config.max_batches_per_pass):
            pruned = self.prune_batch(cursor)
            batches += 1
            total += pruned
            if pruned.runs < self.config.batch_size:
                break
            time.sleep(self.config.pause_seconds)
        return {f"{name}_pruned": count for name, count in asdict(total).items()} | {
            "prune_batches": batches}
