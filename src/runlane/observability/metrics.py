"""Prometheus metrics of this process (docs/metrics.md lists every one).

Each thing is counted once, where it happens: a claim in ``Store.claim``, a retry and
an attempt's end in ``Store._end_attempt``, a run's end in ``Store._set_status``, an
expired lease in the reaper's walk, a side effect in ``worker/effects.py``. The counts
are this process's: a ``runlane submit`` that exits takes its counts with it, what
``serve``, ``maintain``, ``up`` and the workers count is what a scrape sees. The
gauges read from the database (queue depth, oldest ready age, leases, workers) are
not here: ``observability/gauges.py``, served by ``serve``, ``maintain`` and ``up``.

Recording is a flag test and a prometheus_client increment; ``RUNLANE_METRICS=off``
(the ``METRICS`` setting) makes every recording function return at the flag test.
The metric objects are made on first use, so that ``runlane up`` can switch this
process to prometheus_client's multiprocess mode (``use_multiprocess``) before any
exists: its workers then write their counts to files in a private directory, and
``up`` serves their sum on one port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from runlane.errors import RunlaneError

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The label of a tenant the policy does not name (docs/metrics.md: a tenant label is
# only ever a name the policy bounds).
OTHER_TENANT = "_other"
# The concurrency scopes' prefixes (domain.policy.run_scopes) and their dimension.
DIMENSIONS = {"global": "global", "tenant": "tenant", "repo": "repository",
              "user": "user", "risk": "risk", "queue": "queue", "provider": "provider"}
# A side effect's kind: the ledger's keys are the kind itself (push_branch,
# pull_request, close_pull_request) or ``agent:<the agent's own key>`` (unbounded).
_EFFECT_KINDS = frozenset({"push_branch", "pull_request", "close_pull_request"})

DB_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RUN_SECONDS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
               7200.0, 14400.0, 28800.0, 86400.0)
CANCEL_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _flag(value: str | None) -> bool:
    """What pydantic takes as false for the METRICS setting, and nothing else."""
    return (value or "").strip().lower() not in {"0", "off", "false", "no", "f", "n"}


_on = _flag(os.environ.get("RUNLANE_METRICS"))
_named_tenants: frozenset[str] = frozenset()
_lock = threading.Lock()


@dataclass(frozen=True)
class _Metrics:
    """Every metric object of this process, made together in one registry."""

    registry: CollectorRegistry
    admission_accepted: Counter
    admission_denied: Counter
    claim_success: Counter
    claim_empty: Counter
    lease_expired: Counter
    retry: Counter
    run_duration: Histogram
    capacity_denied: Counter
    cancellation_latency: Histogram
    attempts: Counter
    side_effects: Counter
    sandbox_start_failures: Counter
    policy_decisions: Counter
    cost_usd: Counter
    claim_db_seconds: Histogram
    heartbeat_db_seconds: Histogram


def _build() -> _Metrics:
    # No `_created` series beside every counter and histogram: noise here.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    r = CollectorRegistry(auto_describe=True)
    s = "runlane_scheduler_"
    return _Metrics(
        registry=r,
        admission_accepted=Counter(
            s + "admission_accepted", "Runs admitted at submit (queued, or waiting for "
            "their dependencies).", registry=r),
        admission_denied=Counter(
            s + "admission_denied", "Runs denied at submit (POLICY_DENIED).", registry=r),
        claim_success=Counter(
            s + "claim_success", "Runs claimed (one per lease a claim returned).",
            ["queue"], registry=r),
        claim_empty=Counter(
            s + "claim_empty", "Claims that found nothing to claim.", ["queue"], registry=r),
        lease_expired=Counter(
            s + "lease_expired", "Leases the reaper found expired and recovered "
            "(WORKER_LOST).", registry=r),
        retry=Counter(
            s + "retry", "Attempts whose run was queued again for another attempt, by the "
            "attempt's reason.", ["reason_code"], registry=r),
        run_duration=Histogram(
            s + "run_duration_seconds", "Runs ended, from creation to their end, by final "
            "status.", ["status"], buckets=RUN_SECONDS, registry=r),
        capacity_denied=Counter(
            s + "capacity_denied", "Claim candidates held back by a concurrency limit at "
            "capacity, by the limit's dimension.", ["dimension"], registry=r),
        cancellation_latency=Histogram(
            s + "cancellation_latency_seconds", "From a cancel request to its run's "
            "CANCELLED.", buckets=CANCEL_SECONDS, registry=r),
        attempts=Counter(
            "runlane_attempts", "Attempts ended, by outcome (SUCCEEDED, or the reason "
            "code they ended with).", ["outcome"], registry=r),
        side_effects=Counter(
            "runlane_side_effects", "External side effects through the ledger, by kind "
            "and result (performed, adopted, already_done, late, failed).",
            ["kind", "result"], registry=r),
        sandbox_start_failures=Counter(
            "runlane_sandbox_start_failures", "Agent or verify commands whose sandbox "
            "could not be prepared or whose process could not start.", registry=r),
        policy_decisions=Counter(
            "runlane_policy_decisions", "Admission decisions by stage (submit, claim, "
            "scheduler, side_effect, approval), action and reason code.",
            ["stage", "action", "reason_code"], registry=r),
        cost_usd=Counter(
            "runlane_cost_usd", "Model cost agents reported, in USD, by tenant (tenants "
            "the policy does not name: _other).", ["tenant"], registry=r),
        claim_db_seconds=Histogram(
            "runlane_db_claim_seconds", "Database time of one claim (all its round "
            "trips).", buckets=DB_SECONDS, registry=r),
        heartbeat_db_seconds=Histogram(
            "runlane_db_heartbeat_seconds", "Database time of one worker heartbeat (its "
            "leases and its worker row).", buckets=DB_SECONDS, registry=r),
    )


_metrics: _Metrics | None = None
# Each labelled child once looked up: ``labels()`` validates and locks on every call
# (1.4 us of a 2 us increment).
_children: dict[tuple[object, tuple[str, ...]], Any] = {}


def _child(metric: Counter | Histogram, *values: str) -> Any:
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


def _m() -> _Metrics:
    global _metrics
    m = _metrics
    if m is None:
        with _lock:
            if _metrics is None:
                _metrics = _build()
            m = _metrics
    return m


# --- switches -----------------------------------------------------------------------


def enabled() -> bool:
    return _on


def set_enabled(on: bool) -> None:
    """The METRICS setting: off, every recording function returns at once."""
    global _on
    _on = on


def use_multiprocess(directory: str) -> None:
    """Count in prometheus_client's multiprocess files under ``directory`` (and so do
    the processes this one starts: the variable is inherited). Before any metric is
    made: the metric objects made earlier, if any, are dropped with their counts."""
    global _metrics
    with _lock:
        os.environ[MULTIPROC_ENV] = directory
        values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
        _metrics = None
        _children.clear()


def multiprocess_directory() -> str | None:
    directory = os.environ.get(MULTIPROC_ENV)
    return directory if directory and os.path.isdir(directory) else None


def name_tenants(names: Iterable[str]) -> None:
    """Tenants a policy names: their own tenant label (every other is ``_other``)."""
    global _named_tenants
    new = frozenset(names) - _named_tenants
    if new:
        _named_tenants = _named_tenants | new


def tenant_label(tenant: str) -> str:
    return tenant if tenant in _named_tenants else OTHER_TENANT


def dimension_of(scope: str) -> str:
    """``repo:acme/app`` -> ``repository``: the dimension of a concurrency scope."""
    return DIMENSIONS.get(scope.split(":", 1)[0], "other")


def effect_kind(key: str) -> str:
    return key if key in _EFFECT_KINDS else ("agent" if key.startswith("agent:") else "other")


# --- recording ----------------------------------------------------------------------


def submitted(statuses: Iterable[tuple[str, str | None]]) -> None:
    """Runs created by a submit, each ``(status, reason_code)``: accepted, denied or
    deferred by admission (a replay of an idempotency key created nothing: not here)."""
    if not _on:
        return
    m = _m()
    for status, reason in statuses:
        if status == "POLICY_DENIED":
            m.admission_denied.inc()
            _child(m.run_duration, "POLICY_DENIED").observe(0.0)
            action = "deny"
        elif status == "WAITING_CAPACITY":
            action = "defer"
        elif status == "AWAITING_APPROVAL":
            action = "require_approval"
        else:
            m.admission_accepted.inc()
            action = "admit"
        _child(m.policy_decisions, "submit", action, reason or "").inc()


def policy_decision(stage: str, action: str, reason_code: str | None) -> None:
    if _on:
        _child(_m().policy_decisions, stage, action.lower(), reason_code or "").inc()


def claimed(queue: str, runs: int, seconds: float) -> None:
    if not _on:
        return
    m = _m()
    if runs:
        _child(m.claim_success, queue).inc(runs)
    else:
        _child(m.claim_empty, queue).inc()
    m.claim_db_seconds.observe(seconds)


def heartbeat(seconds: float) -> None:
    if _on:
        _m().heartbeat_db_seconds.observe(seconds)


def leases_expired(n: int) -> None:
    if _on and n:
        _m().lease_expired.inc(n)


def retried(reason_code: str) -> None:
    if _on:
        _child(_m().retry, reason_code).inc()


def attempt_ended(outcome: str) -> None:
    if _on:
        _child(_m().attempts, outcome).inc()


def run_ended(status: str, seconds: float) -> None:
    if _on:
        _child(_m().run_duration, status).observe(max(seconds, 0.0))


def cancelled(latency_seconds: float) -> None:
    if _on:
        _m().cancellation_latency.observe(max(latency_seconds, 0.0))


def capacity_denied(dimension: str) -> None:
    if _on:
        _child(_m().capacity_denied, dimension).inc()


def side_effect(key: str, result: str) -> None:
    if _on:
        _child(_m().side_effects, effect_kind(key), result).inc()


def sandbox_start_failed() -> None:
    if _on:
        _m().sandbox_start_failures.inc()


def cost(tenant: str, usd: float) -> None:
    if _on and usd > 0:
        _child(_m().cost_usd, tenant_label(tenant)).inc(usd)


# --- exposition -----------------------------------------------------------------------


def registry(*extra: Collector) -> CollectorRegistry:
    """What a scrape of this process shows: its own counts (in multiprocess mode, the
    sum of every process's files) and ``extra`` collectors (the database's gauges)."""
    directory = multiprocess_directory()
    if directory is None and not extra:
        return _m().registry
    served = CollectorRegistry(auto_describe=False)
    if directory is not None:
        MultiProcessCollector(served, path=directory)  # type: ignore[no-untyped-call]
    else:
        served.register(_m().registry)
    for collector in extra:
        served.register(collector)
    return served


# The text format every Prometheus reads (prometheus_client's own server picks by the
# request's Accept header; /metrics of `runlane serve` answers this one).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(served: CollectorRegistry) -> tuple[bytes, str]:
    """The text exposition of ``served`` and its content type."""
    return generate_latest(served), CONTENT_TYPE


class MetricsPortUnavailable(RunlaneError):
    """``--metrics-port`` cannot be listened on (in use, or not ours to take)."""


def serve(served: CollectorRegistry, host: str, port: int) -> Callable[[], None]:
    """``served`` on http://host:port/metrics (any path, as prometheus_client answers)
    on a daemon thread, unauthenticated: the function returned stops it."""
    try:
        server, thread = start_http_server(port, addr=host, registry=served)
    except OSError as exc:
        raise MetricsPortUnavailable(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


@contextlib.contextmanager
def counting_across_processes(on: bool) -> Iterator[None]:
    """``runlane up``: this process and the workers it starts count in multiprocess
    files of a private directory (mode 0700) while the block runs; removed after."""
    if not on or not _on:
        yield
        return
    directory = tempfile.mkdtemp(prefix="runlane-metrics-")
    use_multiprocess(directory)
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)
