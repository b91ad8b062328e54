"""The policy's retry rules (``[retry]`` and its per-tenant and per-queue layers): the
reason codes retried and the delays between attempts, recorded in each run's admission
and followed when its attempts fail. On both engines, with an injectable clock."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.policy import PolicyInvalid, parse_policy
from runlane.domain.reasons import DEFAULT_RETRYABLE, Reason
from runlane.domain.retry import RetryPolicy
from runlane.settings import Settings

REPO = "/srv/git/app.git"
TTL = 60.0

RULES = """
[retry]
base_seconds = 1
max_seconds = 2
[retry.tenants.acme]
delays_seconds = [5]
retryable = ["AGENT_FAILED", "TIMEOUT"]
[retry.queues.batch]
delays_seconds = [30, 120, 600]
"""


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def admission(lane: Runlane, run_id: str) -> dict[str, object]:
    with lane.store.engine.connect() as conn:
        record = conn.execute(text("SELECT admission FROM runs WHERE run_id = :r"),
                              {"r": run_id}).scalar()
    return record if isinstance(record, dict) else json.loads(record)


def fail_once(lane: Runlane, run_id: str, reason: str) -> float:
    """Claim ``run_id`` now and fail its attempt with ``reason``: its next visibility
    minus now (the delay), or -1 when the run ended."""
    [lease] = lane.store.claim("w1", run_id=run_id, lease_ttl=TTL)
    lane.store.fail(lease, reason)
    run = lane.run(run_id)
    if run.status != "QUEUED":
        return -1.0
    with lane.store.engine.connect() as conn:
        visible = conn.execute(text("SELECT visible_at FROM runs WHERE run_id = :r"),
                               {"r": run_id}).scalar()
    return float(visible) - lane.store.clock.now()


def test_a_queue_retry_table_is_followed_exactly(lane: Runlane, clock: ManualClock) -> None:
    lane.store.apply_policy(parse_policy(RULES, "policy.toml"), source="policy.toml")
    run = lane.submit("globex", REPO, "fix it", queue="batch", max_attempts=5)
    starts = []
    for _ in range(5):
        # Not a moment early: the claim finds nothing just before the delay is over.
        clock.advance(-0.01)
        assert lane.store.claim("w1", run_id=run.run_id, lease_ttl=TTL) == []
        clock.advance(0.01)
        [lease] = lane.store.claim("w1", run_id=run.run_id, lease_ttl=TTL)
        starts.append(clock.now())
        lane.store.fail(lease, Reason.TIMEOUT)
        if lane.run(run.run_id).status != "QUEUED":
            break
        with lane.store.engine.connect() as conn:
            visible = conn.execute(text("SELECT visible_at FROM runs WHERE run_id = :r"),
                                   {"r": run.run_id}).scalar()
        clock.advance(float(visible) - clock.now())
    # Attempt start times: the table's delays one after another, the last repeated.
    assert [round(s - starts[0], 6) for s in starts] == [0, 30, 150, 750, 1350]
    shown = lane.run(run.run_id)
    assert [round(a.started_at.timestamp() - starts[0], 6) for a in shown.attempts] == [
        0, 30, 150, 750, 1350]
    assert shown.status == "FAILED"


def test_tenant_layer_and_queue_over_tenant(lane: Runlane, clock: ManualClock) -> None:
    lane.store.apply_policy(parse_policy(RULES, "policy.toml"), source="policy.toml")
    acme = lane.submit("acme", REPO, "a", max_attempts=3)
    acme_batch = lane.submit("acme", REPO, "b", queue="batch", max_attempts=3)
    globex = lane.submit("globex", REPO, "c", max_attempts=3)
    # acme's own table and its retryable codes (AGENT_FAILED is not retried by default).
    assert fail_once(lane, acme.run_id, Reason.AGENT_FAILED) == pytest.approx(5)
    # The queue's table over the tenant's; the tenant's codes still apply.
    assert fail_once(lane, acme_batch.run_id, Reason.AGENT_FAILED) == pytest.approx(30)
    # Another tenant: the default codes (AGENT_FAILED ends the run), global exponential.
    assert fail_once(lane, globex.run_id, Reason.AGENT_FAILED) == -1
    assert lane.run(globex.run_id).status == "FAILED"
    second = lane.submit("globex", REPO, "d", max_attempts=3)
    assert 1.0 <= fail_once(lane, second.run_id, Reason.TIMEOUT) <= 1.25  # base 1, jitter
    # acme's list replaces the defaults: WORKER_LOST is not in it, the run ends.
    third = lane.submit("acme", REPO, "e", max_attempts=3)
    assert fail_once(lane, third.run_id, Reason.WORKER_LOST) == -1


def test_the_rules_a_run_was_admitted_with_are_the_ones_it_fails_under(
        lane: Runlane, clock: ManualClock) -> None:
    lane.store.apply_policy(parse_policy(RULES, "policy.toml"), source="policy.toml")
    run = lane.submit("acme", REPO, "fix it", queue="batch", max_attempts=3)
    assert admission(lane, run.run_id)["retry"] == {
        "delays_seconds": [30.0, 120.0, 600.0], "retryable": ["AGENT_FAILED", "TIMEOUT"]}
    [lease] = lane.store.claim("w1", run_id=run.run_id, lease_ttl=TTL)
    # A policy change while it runs: its failure keeps the rules it was admitted with.
    lane.store.apply_policy(parse_policy("[retry.queues.batch]\ndelays_seconds = [900]\n"),
                            source="other.toml")
    lane.store.fail(lease, Reason.AGENT_FAILED)
    with lane.store.engine.connect() as conn:
        visible = conn.execute(text("SELECT visible_at FROM runs WHERE run_id = :r"),
                               {"r": run.run_id}).scalar()
    assert float(visible) - clock.now() == pytest.approx(30)


def test_without_rules_the_settings_retry_policy_is_unchanged(lane: Runlane) -> None:
    run = lane.submit("acme", REPO, "fix it")
    assert admission(lane, run.run_id)["retry"] == {}
    settings = Settings().retry_policy()
    assert settings.with_rules({}) == settings
    assert settings.retryable == DEFAULT_RETRYABLE and settings.delays_seconds is None
    assert parse_policy("").retry_policy(settings) == settings
    # The exponential delay after attempt 1 is base_seconds plus up to 25% jitter.
    assert 30 <= RetryPolicy().delay(1) <= 37.5


def test_a_drained_lease_is_retried_whatever_the_list() -> None:
    policy = RetryPolicy().with_rules({"retryable": ["TIMEOUT"]})
    assert policy.retryable == {"TIMEOUT", "LEASE_RELEASED"}


def test_a_layer_replaces_the_delay_shape_below_it() -> None:
    policy = parse_policy("[retry]\ndelays_seconds = [1, 2]\n"
                          "[retry.queues.q]\nbase_seconds = 7\n")
    assert policy.retry_rules_for("t", "q") == {"base_seconds": 7.0}
    assert policy.retry_rules_for("t", "other") == {"delays_seconds": [1.0, 2.0]}
    assert RetryPolicy().with_rules({"base_seconds": 7.0}).delays_seconds is None


@pytest.mark.parametrize(
    ("text_", "field", "problem"),
    [
        ("[retry]\ndelays_seconds = [30, 60]\nbase_seconds = 5", "retry",
         "either delays_seconds"),
        ("[retry.queues.batch]\ndelays_seconds = [1]\nmax_seconds = 5", "retry.queues.batch",
         "either delays_seconds"),
        ("[retry]\ndelays_seconds = []", "retry.delays_seconds", "at least 1 item"),
        ("[retry]\ndelays_seconds = [30, -1]", "retry.delays_seconds[1]",
         "greater than or equal to 0"),
        ("[retry]\ndelays_seconds = 30", "retry.delays_seconds", "valid tuple"),
        ("[retry.tenants.acme]\nretryable = ['TIMEOUT', 'TIMEOUTS']",
         "retry.tenants.acme.retryable[1]", "not a runlane reason code"),
        ("[retry.tenants.acme]\nbase_seconds = 9\nmax_seconds = 3", "retry.tenants.acme",
         "max_seconds must be at least base_seconds"),
        ("[retry.queues.batch]\nbackoff = 'linear'", "retry.queues.batch.backoff",
         "unknown field"),
        ("[retry.queues.'bad name']\ndelays_seconds = [1]", "retry.queues.bad name",
         "bad name"),
    ],
)
def test_retry_errors_name_the_file_field_and_problem(text_: str, field: str,
                                                      problem: str) -> None:
    with pytest.raises(PolicyInvalid) as caught:
        parse_policy(text_, "policy.toml")
    assert (caught.value.source, caught.value.field) == ("policy.toml", field)
    assert problem in caught.value.problem
