"""The gauges read from the database, as a prometheus_client collector: one statement
per reading (store/gauges.py), kept for ``cache_seconds`` (the METRICS_CACHE_SECONDS
setting), so that any number of scrapers, and scrapes of several endpoints of one
process, cost one statement per interval. Served by ``serve``, ``maintain`` and ``up``
(not by a worker: a fleet of workers would read the same figures once each)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from runlane.observability import metrics
from runlane.store.gauges import GaugeReading, read_gauges
from runlane.store.policy import utc_day
from runlane.store.store import Store

S = "runlane_scheduler_"


class DatabaseGauges:
    """A collector of the database's gauges over ``store``."""

    def __init__(self, store: Store, *, cache_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, GaugeReading] | None = None
        # The policy version the budgets are of, and each budgeted tenant's budget.
        self._budgets: tuple[int, dict[str, float]] | None = None
        self.readings = 0  # statements run (for tests and the benchmark)

    def reading(self) -> GaugeReading:
        """The cached reading, or a new one when it is ``cache_seconds`` old. One reader
        at a time: scrapers that come together wait for the one statement."""
        with self._lock:
            cached = self._cached
            if cached is not None and self._clock() - cached[0] < self.cache_seconds:
                return cached[1]
            reading = self._read()
            self._cached = (self._clock(), reading)
            return reading

    def budgets(self) -> dict[str, float]:
        return dict(self._budgets[1]) if self._budgets else {}

    def _read(self) -> GaugeReading:
        if self._budgets is None:
            self._load_budgets()
        assert self._budgets is not None
        reading = self._statement()
        if reading.policy_version != self._budgets[0]:
            # A new policy (rare): its budgets name other tenants; read them again.
            self._load_budgets()
            reading = self._statement()
        return reading

    def _statement(self) -> GaugeReading:
        assert self._budgets is not None
        pinned = self.store.clock.now()
        day = utc_day(pinned if pinned is not None else time.time())
        self.readings += 1
        return read_gauges(self.store, tenants=sorted(self._budgets[1]), day=day)

    def _load_budgets(self) -> None:
        version, policy = self.store.current_policy()
        metrics.name_tenants(policy.tenants)
        self._budgets = (version, {
            tenant: float(p.daily_model_budget_usd) for tenant, p in policy.tenants.items()
            if p.daily_model_budget_usd is not None})

    def describe(self) -> Iterator[Metric]:
        """The families without reading the database (registering asks for them)."""
        yield from _families(GaugeReading(), {})

    def collect(self) -> Iterator[Metric]:
        yield from _families(self.reading(), self.budgets())


def _families(r: GaugeReading, budgets: dict[str, float]) -> Iterator[Metric]:
    depth = GaugeMetricFamily(S + "queue_depth", "Runs QUEUED, by queue (in backoff "
                              "included): the lanes' counts.", labels=["queue"])
    for queue, n in sorted(r.queue_depth.items()):
        depth.add_metric([queue], n)
    yield depth
    age = GaugeMetricFamily(S + "queue_oldest_ready_age_seconds", "Seconds the queue's "
                            "oldest ready run has waited since it became ready (entered the "
                            "queue, or its backoff ended), unclaimed.", labels=["queue"])
    for queue in sorted(r.queue_depth):
        age.add_metric([queue], r.oldest_ready_age.get(queue, 0.0))
    yield age
    yield GaugeMetricFamily(S + "lease_active", "Active leases (attempts running).",
                            value=r.active_leases)
    yield GaugeMetricFamily(S + "worker_active", "Workers registered and not stopped or "
                            "dead (STARTING, READY, DRAINING).", value=len(r.heartbeat_lag))
    lag = GaugeMetricFamily(S + "worker_heartbeat_lag_seconds", "Seconds since each live "
                            "worker's last heartbeat.", labels=["worker_id"])
    for worker_id, seconds in sorted(r.heartbeat_lag.items()):
        lag.add_metric([worker_id], seconds)
    yield lag
    budget = GaugeMetricFamily("runlane_tenant_budget_usd", "A tenant's daily model "
                               "budget (tenants the policy gives one).", labels=["tenant"])
    spent = GaugeMetricFamily("runlane_tenant_spend_today_usd", "What a tenant with a "
                              "daily budget has spent today (UTC).", labels=["tenant"])
    for tenant, usd in sorted(budgets.items()):
        budget.add_metric([tenant], usd)
        spent.add_metric([tenant], r.spend_today.get(tenant, 0.0))
    yield budget
    yield spent
    yield GaugeMetricFamily("runlane_metrics_db_read_seconds", "How long the last reading "
                            "of these gauges took (one statement).", value=r.seconds)
