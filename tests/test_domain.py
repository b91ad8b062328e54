"""Pure domain: the transition table, retry and backoff, task validation and payloads."""

from __future__ import annotations

import json
import random

import pytest

from runlane.domain.policy import parse_policy, run_scopes
from runlane.domain.reasons import DEFAULT_RETRYABLE, Reason
from runlane.domain.retry import RetryPolicy, RunBudget, backoff_delay, decide
from runlane.domain.states import (
    INITIAL,
    STAGES,
    TERMINAL,
    TRANSITIONS,
    IllegalTransition,
    RunStatus,
    check_path,
    is_allowed,
    sources_of,
)
from runlane.domain.tasks import (
    CONTEXT_TRUNCATION_ORDER,
    TaskInvalid,
    enforce_payload_cap,
    parse_priority,
    parse_task,
    payload_size,
)

S = RunStatus


# --- transition table ---------------------------------------------------------------


def test_every_state_is_in_the_table() -> None:
    assert set(TRANSITIONS) == set(RunStatus)


def test_nothing_leaves_a_terminal_state() -> None:
    for status in TERMINAL:
        assert TRANSITIONS[status] == frozenset()
        for target in RunStatus:
            assert not is_allowed(status, target)


def test_cancellation_is_monotonic() -> None:
    assert TRANSITIONS[S.CANCEL_REQUESTED] == {S.CANCELLING, S.CANCELLED}
    assert TRANSITIONS[S.CANCELLING] == {S.CANCELLED}
    assert not is_allowed(S.CANCELLED, S.RUNNING)
    assert not is_allowed(S.CANCEL_REQUESTED, S.QUEUED)


def test_every_state_is_reachable_from_an_initial_state() -> None:
    seen = set(INITIAL)
    frontier = list(INITIAL)
    while frontier:
        for target in TRANSITIONS[frontier.pop()]:
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(RunStatus)


def test_stages_only_move_forward_and_success_only_from_finalizing() -> None:
    for i, stage in enumerate(STAGES):
        for earlier in STAGES[:i]:
            assert not is_allowed(stage, earlier)
    assert sources_of(S.SUCCEEDED) == {S.FINALIZING}


def test_retry_goes_back_to_the_queue_only_through_failed_retryable() -> None:
    # AWAITING_APPROVAL: an approved run, never a retry (it has had no attempt).
    assert sources_of(S.QUEUED) == {S.ADMITTED, S.WAITING_CAPACITY, S.FAILED_RETRYABLE,
                                    S.AWAITING_APPROVAL}


def test_check_path_validates_every_hop() -> None:
    assert check_path([S.RUNNING], [S.FAILED_RETRYABLE, S.QUEUED]) == {S.RUNNING}
    with pytest.raises(IllegalTransition):
        check_path([S.RUNNING], [S.QUEUED])
    with pytest.raises(IllegalTransition):
        check_path([S.RUNNING], [S.FAILED_RETRYABLE, S.RUNNING])
    with pytest.raises(IllegalTransition):
        check_path([S.SUCCEEDED], [S.QUEUED])


# --- retry and backoff ----------------------------------------------------------------


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    rng = random.Random(3)
    for attempt, base in [(1, 30), (2, 60), (3, 120), (4, 240)]:
        delay = backoff_delay(attempt, 30, 1800, rng)
        assert base <= delay <= base * 1.25


def test_backoff_is_capped() -> None:
    for _ in range(50):
        assert 1800 <= backoff_delay(30, 30, 1800) <= 1800 * 1.25


def test_jitter_spreads_retries() -> None:
    delays = {round(backoff_delay(2, 30, 1800), 6) for _ in range(20)}
    assert len(delays) > 10


POLICY = RetryPolicy(base_seconds=30, max_seconds=1800)


def budget(attempts: int = 1, max_attempts: int = 3, elapsed: float = 0.0,
           cost: float = 0.0) -> RunBudget:
    return RunBudget(attempts, max_attempts, elapsed, cost)


@pytest.mark.parametrize("reason", sorted(DEFAULT_RETRYABLE))
def test_retryable_reasons_are_retried(reason: str) -> None:
    assert decide(reason, budget(), POLICY).retry


@pytest.mark.parametrize("reason", [Reason.VERIFIER_FAILED, Reason.POLICY_DENIED,
                                    Reason.AGENT_FAILED, Reason.JUDGE_REJECTED,
                                    Reason.TASK_CONTRACT_INVALID, Reason.LIMIT_EXCEEDED])
def test_other_reasons_fail_the_run(reason: str) -> None:
    decision = decide(reason, budget(), POLICY)
    assert not decision.retry and decision.final_reason == reason


def test_attempt_budget_is_respected() -> None:
    assert decide(Reason.WORKER_LOST, budget(2, 3), POLICY).retry
    decision = decide(Reason.WORKER_LOST, budget(3, 3), POLICY)
    assert not decision.retry and decision.final_reason == Reason.WORKER_LOST


def test_time_and_cost_budgets_stop_retries() -> None:
    policy = RetryPolicy(max_total_run_seconds=600, max_cost_usd=5.0)
    assert decide(Reason.TIMEOUT, budget(elapsed=599, cost=4.9), policy).retry
    for b in (budget(elapsed=600), budget(cost=5.0)):
        decision = decide(Reason.TIMEOUT, b, policy)
        assert not decision.retry and decision.final_reason == Reason.RETRY_BUDGET_EXHAUSTED


def test_rate_limit_waits_at_least_retry_after() -> None:
    decision = decide(Reason.PROVIDER_RATE_LIMIT, budget(), POLICY, retry_after_seconds=500)
    assert decision.delay_seconds >= 500
    short = decide(Reason.PROVIDER_RATE_LIMIT, budget(), POLICY, retry_after_seconds=1)
    assert short.delay_seconds >= 30  # never sooner than the backoff


# --- task validation ------------------------------------------------------------------


def good(**fields: object) -> dict[str, object]:
    return {"tenant": "acme", "repo": "https://git.example.com/acme/app.git",
            "prompt": "do it", **fields}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"tenant": ""}, "tenant"),
        ({"tenant": "   "}, "tenant"),
        ({"colour": "red"}, "colour"),
        ({"repo": "ftp://example.com/x.git"}, "repo"),
        ({"repo": "https://"}, "repo"),
        ({"repo": "not a path"}, "repo"),
        ({"repo": "c:weird"}, "repo"),
        ({"priority": "soon"}, "priority"),
        ({"priority": "1.5"}, "priority"),
        ({"priority": -1}, "priority"),
        ({"prompt": ""}, "prompt"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"context": {"secrets": "x"}}, "context"),
    ],
)
def test_bad_input_names_the_field(fields: dict[str, object], field: str) -> None:
    with pytest.raises(TaskInvalid) as caught:
        parse_task(good(**fields))
    assert caught.value.field == field
    assert field in str(caught.value)


def test_missing_field_is_named() -> None:
    raw = good()
    del raw["prompt"]
    with pytest.raises(TaskInvalid, match="prompt: is required"):
        parse_task(raw)


@pytest.mark.parametrize("repo", ["/srv/git/app.git", "relative/repo", "git@github.com:a/b.git",
                                  "ssh://git@host/a/b.git", "file:///srv/git/app.git"])
def test_valid_repos(repo: str) -> None:
    assert parse_task(good(repo=repo)).repo == repo


def test_priority_classes_and_integers() -> None:
    assert [parse_priority(p) for p in ("critical", "HIGH", "normal", "low", "batch")] == [
        0, 50, 100, 150, 200]
    assert parse_priority("42") == 42
    assert parse_task(good()).priority is None  # unset: the policy decides (default normal)


# --- payload cap ------------------------------------------------------------------------


def test_small_task_is_untouched() -> None:
    spec = parse_task(good(context={"diff": "x" * 100}))
    fitted, report = enforce_payload_cap(spec, 10_000)
    assert fitted == spec and report.truncated_sections == ()


def test_sections_are_truncated_in_the_documented_order() -> None:
    context = {name: name[0] * 3000 for name in CONTEXT_TRUNCATION_ORDER}
    spec = parse_task(good(context=context))
    cap = payload_size(spec) - 4000  # needs all of summary and part of history
    fitted, report = enforce_payload_cap(spec, cap)
    assert payload_size(fitted) <= cap
    assert report.truncated_sections == ("summary", "history")
    assert fitted.context["summary"] == ""
    assert fitted.context["history"].startswith("\n[runlane: truncated")  # oldest lines cut
    for kept in ("comments", "diff", "ci_failures"):
        assert fitted.context[kept] == context[kept]


def test_escaped_text_still_fits() -> None:
    spec = parse_task(good(context={"diff": '"\n' * 5000, "ci_failures": "keep me"}))
    cap = payload_size(spec) // 2
    fitted, report = enforce_payload_cap(spec, cap)
    assert payload_size(fitted) <= cap
    assert report.truncated_sections == ("diff",)
    assert fitted.context["ci_failures"] == "keep me"


def test_too_large_even_without_context_is_refused() -> None:
    spec = parse_task(good(prompt="p" * 5000, context={"diff": "d" * 100}))
    with pytest.raises(TaskInvalid) as caught:
        enforce_payload_cap(spec, 1000)
    assert caught.value.reason == Reason.PAYLOAD_TOO_LARGE
    assert "PAYLOAD_TOO_LARGE" in str(caught.value)
    assert json.dumps(spec.context)  # the input itself was not mutated
    assert spec.context["diff"] == "d" * 100


def test_a_runs_scopes_are_the_scopes_a_policy_can_limit() -> None:
    """run_scopes (what an attempt holds, limited or not) names the same scopes as
    concurrency_limits_for when a policy limits every one: a limit applied later
    counts the attempts already running in its scope."""
    policy = parse_policy(
        "[concurrency]\nglobal_max_active = 9\nper_tenant_max_active = 9\n"
        "per_repository_max_active = 9\nper_user_max_active = 9\n"
        "per_risk_class_max_active = { high = 9 }\nper_queue_max_active = { batch = 9 }\n")
    for user in ("ann", None):
        limits = policy.concurrency_limits_for(tenant="a", repo="r", user=user,
                                               risk_class="high", queue="batch")
        assert sorted(limits) == run_scopes("a", "r", user, "high", "batch")
        assert len(limits) == (6 if user else 5)
