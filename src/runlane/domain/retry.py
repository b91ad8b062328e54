"""Retry classification and backoff: pure functions of a failure and a budget."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from runlane.domain.reasons import DEFAULT_RETRYABLE, Reason

# Releases of one run that do not count against its attempts (a drain, a local lease
# deadline); the next one is charged (LEASE_RELEASED_OVER_CAP). Without a cap a run
# could be claimed and given back forever (the MAX_UNCHARGED_RELEASES setting).
DEFAULT_MAX_UNCHARGED_RELEASES = 5


@dataclass(frozen=True)
class RetryPolicy:
    """How a run's failures are retried (seed 000 §14-§15)."""

    base_seconds: float = 30.0
    max_seconds: float = 1800.0
    max_attempts: int = 3
    max_total_run_seconds: float | None = None
    max_cost_usd: float | None = None
    retryable: frozenset[str] = field(default_factory=lambda: frozenset(DEFAULT_RETRYABLE))
    # An explicit delay table (the policy's ``delays_seconds``): the delay after
    # attempt n is entry n (1-based), the last one repeated, exactly (no jitter: the
    # table is what the operator wrote). None: exponential from base_seconds.
    delays_seconds: tuple[float, ...] | None = None

    def delay(self, attempt_no: int, rng: random.Random | None = None) -> float:
        """The delay after attempt ``attempt_no`` (1-based): the table's entry, or
        the exponential backoff with jitter."""
        if self.delays_seconds:
            index = min(max(attempt_no, 1), len(self.delays_seconds)) - 1
            return float(self.delays_seconds[index])
        return backoff_delay(attempt_no, self.base_seconds, self.max_seconds, rng)

    def with_rules(self, rules: Mapping[str, Any]) -> RetryPolicy:
        """This policy (the settings') with a run's recorded retry rules over it
        (``Policy.retry_rules_for``: JSON, as stored in the run's admission)."""
        if not rules:
            return self
        changes: dict[str, Any] = {k: rules[k] for k in _SCALAR_RULES if k in rules}
        if "retryable" in rules:
            # A drained worker's lease given back is never the run's failure: retried
            # whatever the list says (a policy cannot end runs by draining workers).
            changes["retryable"] = frozenset(rules["retryable"]) | {Reason.LEASE_RELEASED}
        if "delays_seconds" in rules:
            changes["delays_seconds"] = tuple(float(d) for d in rules["delays_seconds"])
        elif "base_seconds" in rules or "max_seconds" in rules:
            changes["delays_seconds"] = None
        return replace(self, **changes)


_SCALAR_RULES = ("base_seconds", "max_seconds", "max_total_run_seconds", "max_cost_usd")


@dataclass(frozen=True)
class RunBudget:
    """What a run has spent so far, read inside the transaction that decides."""

    attempt_count: int  # attempts charged against max_attempts, the current one included
    max_attempts: int
    elapsed_seconds: float
    cost_usd: float


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_seconds: float = 0.0
    # Why the run ends when it is not retried (the failure's own code, or a budget code).
    final_reason: str | None = None


def backoff_delay(
    attempt_no: int, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Exponential delay after attempt ``attempt_no`` (1-based), capped, plus up to 25% jitter.

    The jitter is added on top of the capped value so that a storm of failures
    spreads out instead of retrying in lock step.
    """
    exponent = min(max(attempt_no - 1, 0), 20)
    capped = min(base * (2**exponent), cap)
    jitter = (rng or random).uniform(0.0, capped / 4) if capped > 0 else 0.0
    return float(capped + jitter)


def decide(
    reason: str,
    budget: RunBudget,
    policy: RetryPolicy,
    retry_after_seconds: float | None = None,
    rng: random.Random | None = None,
) -> RetryDecision:
    """Whether a failed attempt is retried, and after how long."""
    if reason not in policy.retryable:
        return RetryDecision(retry=False, final_reason=reason)
    # A lease given back by a draining worker is not the run's fault: it does not use
    # up an attempt (the attempt is kept as evidence, but not charged).
    if reason != Reason.LEASE_RELEASED and budget.attempt_count >= budget.max_attempts:
        return RetryDecision(retry=False, final_reason=reason)
    if (
        policy.max_total_run_seconds is not None
        and budget.elapsed_seconds >= policy.max_total_run_seconds
    ) or (policy.max_cost_usd is not None and budget.cost_usd >= policy.max_cost_usd):
        return RetryDecision(retry=False, final_reason=Reason.RETRY_BUDGET_EXHAUSTED)
    delay = policy.delay(budget.attempt_count, rng)
    if reason == Reason.LEASE_RELEASED:
        # A drained worker gave the run back on purpose: no penalty delay.
        delay = 0.0
    if retry_after_seconds is not None:
        delay = max(delay, float(retry_after_seconds))
    return RetryDecision(retry=True, delay_seconds=delay)


# How many finalize-only attempts a run gets at most (docs/reliability.md): enough to
# outlast a worker dying or a code host failing once or twice, never a loop.
MAX_FINALIZE_ONLY_ATTEMPTS = 3


def decide_finalize_only(
    reason: str,
    finalize_attempts: int,
    policy: RetryPolicy,
    retry_after_seconds: float | None = None,
    rng: random.Random | None = None,
    *,
    cap: int = MAX_FINALIZE_ONLY_ATTEMPTS,
) -> RetryDecision:
    """Whether a run whose push or pull request was begun gets another finalize-only
    attempt, where the ordinary decision (``decide``) would end it, or its last
    finalize-only attempt ended.

    ``finalize_attempts``: the finalize-only attempts already ended, this one included
    (0 when it is the agent's attempt that ended), drained ones left out. Such an
    attempt only looks the run's branch and pull request up on the code host and
    records them, so any failure is worth another look, up to ``cap``; not when it
    found nothing there, and not a drained one, which is given back at once."""
    if reason == Reason.NOTHING_TO_FINALIZE:
        return RetryDecision(retry=False, final_reason=reason)
    if reason == Reason.LEASE_RELEASED:
        return RetryDecision(retry=True, delay_seconds=0.0)
    if finalize_attempts >= cap:
        return RetryDecision(retry=False, final_reason=reason)
    delay = policy.delay(finalize_attempts + 1, rng)
    if retry_after_seconds is not None:
        delay = max(delay, float(retry_after_seconds))
    return RetryDecision(retry=True, delay_seconds=delay)
