"""Metrics counted in the store, on SQLite and PostgreSQL, on a pinned clock: each once,
after its transaction commits, with the figures the database holds; the database's
gauges from one statement whose plan reads no run beyond each lane's head, read once per
cache interval whatever the scrapers; recording switched off by the METRICS setting.
(The same metrics scraped from real processes: tests/test_metrics_scrape.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.agents.base import AttemptLimits
from runlane.agents.command import CommandRunner
from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.observability import metrics
from runlane.observability.gauges import DatabaseGauges
from runlane.sandbox import Sandbox, SandboxConfig
from runlane.store import gauges_sql
from runlane.store.gauges import gauge_parameters
from runlane.store.store import Store
from runlane.worker.effects import perform_effect

from .conftest import T0
from .support import execute, submit


def sample(name: str, **labels: str) -> float:
    return metrics._m().registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(autouse=True)
def counting() -> Iterator[None]:
    """Counting on, whatever a test before this one left (a Runlane made from settings)."""
    metrics.set_enabled(True)
    yield
    metrics.set_enabled(True)


def policy(store: Store, text_: str) -> None:
    store.apply_policy(parse_policy(text_), source="test")


def test_a_count_waits_for_its_commit_and_a_rollback_drops_it(store: Store) -> None:
    recorded: list[str] = []

    def rolled_back(conn: Any) -> None:
        store._on_commit(conn, lambda: recorded.append("rolled back"))
        raise RuntimeError("the transaction fails after the count was asked for")

    with pytest.raises(RuntimeError):
        store._transaction(rolled_back)
    assert recorded == []

    def committed(conn: Any) -> None:
        store._on_commit(conn, lambda: recorded.append("committed"))
        assert recorded == []  # not before the commit

    store._transaction(committed)
    store._transaction(lambda conn: None)  # nothing left behind for the next one
    assert recorded == ["committed"]


def test_a_retry_an_attempt_and_a_run_end_are_each_counted_once(
        store: Store, clock: ManualClock) -> None:
    retries = sample("runlane_scheduler_retry_total", reason_code="PROVIDER_RATE_LIMIT")
    limited = sample("runlane_attempts_total", outcome="PROVIDER_RATE_LIMIT")
    succeeded = sample("runlane_attempts_total", outcome="SUCCEEDED")
    durations = sample("runlane_scheduler_run_duration_seconds_count", status="SUCCEEDED")
    took = sample("runlane_scheduler_run_duration_seconds_sum", status="SUCCEEDED")
    claimed = sample("runlane_scheduler_claim_success_total", queue="default")
    empty = sample("runlane_scheduler_claim_empty_total", queue="default")
    [run] = submit(store)
    [lease] = store.claim("w1", lease_ttl=30)
    clock.advance(3.0)
    assert store.fail(lease, Reason.PROVIDER_RATE_LIMIT) is RunStatus.QUEUED
    assert store.claim("w1", lease_ttl=30) == []  # in its backoff: an empty claim
    clock.advance(200.0)
    [again] = store.claim("w1", lease_ttl=30)
    store.advance(again, RunStatus.RUNNING)
    store.complete(again, outcome="no_changes")
    assert sample("runlane_scheduler_retry_total",
                  reason_code="PROVIDER_RATE_LIMIT") == retries + 1
    assert sample("runlane_attempts_total", outcome="PROVIDER_RATE_LIMIT") == limited + 1
    assert sample("runlane_attempts_total", outcome="SUCCEEDED") == succeeded + 1
    assert sample("runlane_scheduler_run_duration_seconds_count",
                  status="SUCCEEDED") == durations + 1
    assert sample("runlane_scheduler_run_duration_seconds_sum",
                  status="SUCCEEDED") == pytest.approx(took + 203.0)
    assert sample("runlane_scheduler_claim_success_total", queue="default") == claimed + 2
    assert sample("runlane_scheduler_claim_empty_total", queue="default") == empty + 1
    assert run.status == "QUEUED"


def test_a_cancel_is_observed_once_from_its_request_to_cancelled(
        store: Store, clock: ManualClock) -> None:
    count = sample("runlane_scheduler_cancellation_latency_seconds_count")
    total = sample("runlane_scheduler_cancellation_latency_seconds_sum")
    cancelled = sample("runlane_scheduler_run_duration_seconds_count", status="CANCELLED")
    [running, waiting] = submit(store, 2)
    [lease] = store.claim("w1", lease_ttl=300)
    clock.advance(5.0)
    store.cancel(lease.task_id)
    assert sample("runlane_scheduler_cancellation_latency_seconds_count") == count  # asked
    clock.advance(2.5)
    store.acknowledge_cancel(lease)
    store.finish_cancel(lease)
    other = waiting if lease.run_id == running.run_id else running
    store.cancel(other.task_id)  # a queued run: cancelled at once, latency 0
    assert sample("runlane_scheduler_cancellation_latency_seconds_count") == count + 2
    assert sample("runlane_scheduler_cancellation_latency_seconds_sum") == pytest.approx(
        total + 2.5)
    assert sample("runlane_scheduler_run_duration_seconds_count",
                  status="CANCELLED") == cancelled + 2


def test_capacity_denials_name_the_full_scope_dimension(store: Store) -> None:
    tenant = sample("runlane_scheduler_capacity_denied_total", dimension="tenant")
    repository = sample("runlane_scheduler_capacity_denied_total", dimension="repository")
    policy(store, "[tenants.acme]\nmax_active = 1\n")
    submit(store, 2)
    assert len(store.claim("w1", limit=2, lease_ttl=30)) == 1  # one got no slot
    assert sample("runlane_scheduler_capacity_denied_total",
                  dimension="tenant") == tenant + 1
    # A full repository: the candidate without a slot, and each lane put to sleep on
    # the scope (acme's queued run, whose repository the running one holds).
    policy(store, "[concurrency]\nper_repository_max_active = 1\n")
    submit(store, 2, tenant="beta", repo="/srv/git/other.git")
    assert len(store.claim("w2", limit=2, lease_ttl=30)) == 1
    assert sample("runlane_scheduler_capacity_denied_total",
                  dimension="repository") >= repository + 2
    assert sample("runlane_scheduler_capacity_denied_total", dimension="repo") == 0


def test_admission_counts_and_policy_decisions_at_submit(store: Store) -> None:
    accepted = sample("runlane_scheduler_admission_accepted_total")
    denied = sample("runlane_scheduler_admission_denied_total")
    deny = sample("runlane_policy_decisions_total", stage="submit", action="deny",
                  reason_code="TENANT_NOT_ALLOWED")
    policy(store, "allow_unknown_tenants = false\n[tenants.acme]\n")
    submit(store, 2, idempotency_key="k")  # one task (the key), one admission
    submit(store, 1, tenant="stranger")
    assert sample("runlane_scheduler_admission_accepted_total") == accepted + 1
    assert sample("runlane_scheduler_admission_denied_total") == denied + 1
    assert sample("runlane_policy_decisions_total", stage="submit", action="deny",
                  reason_code="TENANT_NOT_ALLOWED") == deny + 1


def test_cost_is_labelled_only_with_tenants_the_policy_names(store: Store) -> None:
    policy(store, "[tenants.acme]\n")
    named, other = sample("runlane_cost_usd_total", tenant="acme"), sample(
        "runlane_cost_usd_total", tenant=metrics.OTHER_TENANT)
    submit(store)
    submit(store, tenant="someone-else")
    for lease in store.claim("w1", limit=2, lease_ttl=30):
        store.report_cost(lease, 0.5)
    assert sample("runlane_cost_usd_total", tenant="acme") == named + 0.5
    assert sample("runlane_cost_usd_total", tenant=metrics.OTHER_TENANT) == other + 0.5
    assert "someone-else" not in metrics.render(metrics.registry())[0].decode()


def test_metrics_off_count_nothing(store: Store) -> None:
    before = metrics.render(metrics.registry())[0]
    metrics.set_enabled(False)
    submit(store, 2)
    for lease in store.claim("w1", limit=2, lease_ttl=30):
        store.fail(lease, Reason.PROVIDER_RATE_LIMIT)
    store.claim("w1", lease_ttl=30)
    assert metrics.render(metrics.registry())[0] == before


# --- the database's gauges ------------------------------------------------------------


def gauges(store: Store, cache_seconds: float = 0.0) -> tuple[DatabaseGauges, ManualClock]:
    ticks = ManualClock(0.0)
    return DatabaseGauges(store, cache_seconds=cache_seconds, clock=ticks.now), ticks


def test_the_gauges_are_the_database_s_figures(store: Store, clock: ManualClock) -> None:
    policy(store, "[tenants.acme]\ndaily_model_budget_usd = 2.0\n[tenants.beta]\n")
    submit(store, 3)
    clock.advance(10.0)
    submit(store, 2, tenant="beta", queue="gpu")
    store.register_worker("w1", version="t", queues=["default"])
    clock.advance(4.0)
    [lease] = store.claim("w1", lease_ttl=60)
    store.report_cost(lease, 0.75)
    execute(store, "UPDATE runs SET visible_at = :t WHERE queue = 'gpu'", t=T0 + 1000.0)
    clock.advance(6.0)
    reading = gauges(store)[0].reading()
    assert reading.queue_depth == {"default": 2, "gpu": 2}
    # default: queued and ready since T0 (20 s); gpu: every run in its backoff, none ready
    assert reading.oldest_ready_age == {"default": pytest.approx(20.0)}
    assert reading.active_leases == 1
    assert reading.heartbeat_lag == {"w1": pytest.approx(10.0)}
    assert reading.spend_today == {"acme": pytest.approx(0.75)}
    text_ = metrics.render(metrics.registry(gauges(store)[0]))[0].decode()
    assert 'runlane_tenant_budget_usd{tenant="acme"} 2.0' in text_
    assert 'runlane_tenant_spend_today_usd{tenant="acme"} 0.75' in text_
    assert 'runlane_scheduler_queue_oldest_ready_age_seconds{queue="gpu"} 0.0' in text_
    assert "runlane_scheduler_worker_active 1.0" in text_


def test_the_gauges_cost_one_statement_per_interval_whatever_the_scrapers(
        store: Store) -> None:
    submit(store)
    cached, ticks = gauges(store, cache_seconds=5.0)
    served = metrics.registry(cached)
    for _ in range(10):
        metrics.render(served)
    assert cached.readings == 1
    ticks.advance(5.0)
    metrics.render(served)
    assert cached.readings == 2
    uncached, _ = gauges(store, cache_seconds=0.0)
    for _ in range(3):
        uncached.reading()
    assert uncached.readings == 3


def test_a_new_policy_s_budgets_are_read_at_the_next_scrape(store: Store) -> None:
    reader, _ = gauges(store)
    assert reader.reading().spend_today == {} and reader.budgets() == {}
    policy(store, "[tenants.acme]\ndaily_model_budget_usd = 3.0\n")
    reader.reading()
    assert reader.budgets() == {"acme": 3.0}


def _lanes_of_queued_runs(store: Store, lanes: int, per_lane: int) -> None:
    """``lanes`` tenants with ``per_lane`` queued runs each, in as many statements."""
    store.submit([parse_task_spec(f"t{i}") for i in range(lanes)])
    for _ in range(per_lane - 1):
        store.submit([parse_task_spec(f"t{i}") for i in range(lanes)])


def parse_task_spec(tenant: str) -> Any:
    from .support import spec
    return spec(tenant=tenant)


def test_the_gauge_statement_reads_a_fixed_number_of_runs(store: Store) -> None:
    """Its plan, with the tables' statistics taken: the runs are read through
    ix_runs_status_updated, the OLDEST_QUEUED that have waited longest and no more,
    never scanned nor sorted, whatever their number (docs/metrics.md: EXPLAIN)."""
    _lanes_of_queued_runs(store, lanes=20, per_lane=100)
    params = gauge_parameters(store, tenants=["t1"], day="2027-01-15")
    statement = gauges_sql.GAUGES[store.dialect]
    with store.engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        if store.is_postgres:
            explain = store._sql.render("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + statement)
            plan = "\n".join(conn.execute(explain, params).scalars())
            assert "Seq Scan on runs" not in plan, plan
            walk = next(line for line in plan.splitlines()
                        if "ix_runs_status_updated on runs" in line)
            assert f"actual rows={gauges_sql.OLDEST_QUEUED} loops=1" in walk, plan
        else:
            explain = store._sql.render("EXPLAIN QUERY PLAN " + statement)
            rows = conn.execute(explain, params).all()
            plan = "\n".join(str(r[-1]) for r in rows)
            runs_access = [line for line in plan.splitlines() if line.split()[1:2] == ["r"]]
            assert runs_access == ["SEARCH r USING INDEX ix_runs_status_updated (status=?)"], \
                plan
            assert "FOR ORDER BY" not in plan, plan  # in the index's order, not sorted


def test_a_retried_run_is_aged_from_the_end_of_its_backoff(
        store: Store, clock: ManualClock) -> None:
    [run] = submit(store)
    [lease] = store.claim("w1", lease_ttl=300)
    clock.advance(100.0)
    store.fail(lease, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=50.0)
    reader = gauges(store)[0]
    assert reader.reading().oldest_ready_age == {}  # in its backoff: not ready
    visible_at = float(execute_scalar(store, "SELECT visible_at FROM runs WHERE run_id = :r",
                                      r=run.run_id))
    clock.set(visible_at + 7.0)
    assert reader.reading().oldest_ready_age == {"default": pytest.approx(7.0)}


def execute_scalar(store: Store, sql: str, **params: Any) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(text(sql), params).scalar_one()


def test_side_effects_are_counted_by_kind_and_result(store: Store) -> None:
    def count(kind: str, result: str) -> float:
        return sample("runlane_side_effects_total", kind=kind, result=result)

    before = {r: count("pull_request", r) for r in ("performed", "already_done", "adopted")}
    agent_failed = count("agent", "failed")
    submit(store, 2)
    first, second = store.claim("w1", limit=2, lease_ttl=30)
    perform_effect(store, first, "pull_request", find=lambda: None, do=lambda: {"n": 1})
    perform_effect(store, first, "pull_request", find=lambda: None, do=lambda: {"n": 2})
    perform_effect(store, second, "pull_request", find=lambda: {"n": 3},
                   do=lambda: {"never": True})

    def broken() -> dict[str, Any]:
        raise RuntimeError("the code host said no")

    with pytest.raises(RuntimeError):
        perform_effect(store, second, "agent:deploy-preview", find=lambda: None, do=broken)
    assert {r: count("pull_request", r) - before[r] for r in before} == {
        "performed": 1, "already_done": 1, "adopted": 1}
    assert count("agent", "failed") == agent_failed + 1
    assert "deploy-preview" not in metrics.render(metrics.registry())[0].decode()


def test_a_sandbox_that_cannot_start_is_counted(tmp_path: Path) -> None:
    failures = sample("runlane_sandbox_start_failures_total")
    result = CommandRunner("echo never", sandbox=Sandbox(SandboxConfig(mode="off"))).run(
        workspace=tmp_path / "gone", artifacts_dir=tmp_path / "artifacts", env={},
        control=None, limits=AttemptLimits())  # type: ignore[arg-type]  # never reached
    assert result.exit_code is None
    assert sample("runlane_sandbox_start_failures_total") == failures + 1
