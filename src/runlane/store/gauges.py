"""The database's gauges for a metrics scrape: one statement (store/gauges_sql.py), its
rows as a plain value; observability/gauges.py caches it and makes the metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runlane.store import gauges_sql

if TYPE_CHECKING:
    from runlane.store.store import Store


@dataclass(frozen=True)
class GaugeReading:
    """What one scrape's statement read. Ages and lags are seconds by the database's
    clock (or the store's pinned one)."""

    queue_depth: dict[str, int] = field(default_factory=dict)
    oldest_ready_age: dict[str, float] = field(default_factory=dict)  # queues with one
    active_leases: int = 0
    heartbeat_lag: dict[str, float] = field(default_factory=dict)  # live worker -> seconds
    spend_today: dict[str, float] = field(default_factory=dict)  # tenant -> USD
    policy_version: int = 0
    seconds: float = 0.0  # how long the statement took, round trip included


def gauge_parameters(store: Store, *, tenants: Sequence[str], day: str) -> dict[str, Any]:
    """The parameters of gauges_sql.GAUGES (also for its EXPLAIN, in tests and bench/)."""
    return {"now": store.clock.now(), "day": day, "oldest": gauges_sql.OLDEST_QUEUED,
            "tenants": list(tenants) if store.is_postgres else json.dumps(list(tenants))}


def read_gauges(store: Store, *, tenants: Sequence[str], day: str) -> GaugeReading:
    """Every gauge in one statement; ``tenants``: those whose spend on ``day`` (UTC,
    YYYY-MM-DD) to read (the tenants with a daily budget)."""
    started = time.perf_counter()
    # PostgreSQL: autocommit, one round trip (no BEGIN, no ROLLBACK at the pool's return:
    # one statement reads one snapshot anyway); SQLite: a deferred read.
    engine = store._autocommit_engine if store.is_postgres else store.reads
    with engine.connect() as conn:
        rows = conn.execute(store._q(gauges_sql.GAUGES[store.dialect]),
                            gauge_parameters(store, tenants=tenants, day=day)).all()
    seconds = time.perf_counter() - started
    depth: dict[str, int] = {}
    ages: dict[str, float] = {}
    lags: dict[str, float] = {}
    spend: dict[str, float] = {}
    leases = version = 0
    for kind, label, value, age in rows:
        if kind == "queue":
            depth[label] = int(value or 0)
            if age is not None:
                ages[label] = max(float(age), 0.0)
        elif kind == "leases":
            leases = int(value or 0)
        elif kind == "worker":
            lags[label] = max(float(value), 0.0)
        elif kind == "spend":
            spend[label] = float(value or 0.0)
        elif kind == "policy":
            version = int(value or 0)
    return GaugeReading(depth, ages, leases, lags, spend, version, seconds)
