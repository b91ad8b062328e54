"""Admission control (seed 000 §16): may this run enter the queue now, and on what terms?

A pure function of the request, the policy, the tenant's usage and the time, so
that a decision can be recomputed and audited: same inputs, same decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from runlane.domain.policy import DEFER_SECONDS, NETWORK_OFF_RISKS, Policy
from runlane.domain.reasons import Reason
from runlane.domain.routing import Requirement, canonical_requirements, merge_requirements
from runlane.errors import redact_credentials

DEFAULT_MAX_ATTEMPTS = 3
DAY_SECONDS = 86_400

# REQUIRE_APPROVAL: the run would be admitted, and an approval gate holds it first.
DecisionKind = Literal["ADMIT", "DENY", "DEFER", "REQUIRE_APPROVAL"]


@dataclass(frozen=True)
class AdmissionRequest:
    tenant: str
    repo: str  # the canonical form (domain/repos.py): what scopes and patterns name
    queue: str | None = None  # None: the repository rule's queue, else the default
    priority: int | None = None
    user: str | None = None
    max_attempts: int | None = None
    requires: Mapping[str, Requirement] = field(default_factory=dict)
    estimated_cost_usd: float | None = None  # the task's own estimate (approval gates)
    # False: a run already past its gate (approved, or re-checked at claim or before a
    # side effect): approval gates do not hold it again, every other check applies.
    gated: bool = True
    provider: str | None = None  # None: the queue's provider in the policy, if any


@dataclass(frozen=True)
class TenantUsage:
    """Read by the store in the admitting transaction."""

    queued_runs: int = 0
    spent_today_usd: float = 0.0


@dataclass(frozen=True)
class Decision:
    decision: DecisionKind
    reason_code: str | None
    message: str | None
    # epoch seconds: a DEFER's retry-after, a REQUIRE_APPROVAL's expiry
    retry_after: float | None
    queue: str
    priority: int
    max_attempts: int
    risk_class: str
    requires: str  # the route key (routing.canonical_requirements)
    limits: dict[str, Any]  # numbers, plus network (bool) and secrets (names)
    concurrency: dict[str, int]
    weight: float
    policy_version: int
    # The retry rules in force for this run (Policy.retry_rules_for): what its failed
    # attempts are retried under, over the settings' retry policy.
    retry: dict[str, Any] = field(default_factory=dict)
    # The model provider the run uses (the task's, else its queue's in the policy).
    provider: str | None = None

    def to_json(self) -> dict[str, Any]:
        # What dataclasses.asdict returns (its values are scalars and flat dicts of
        # scalars), built directly: asdict's recursive deep copy was a tenth of a
        # 1,000-run submit.
        data = {name: getattr(self, name) for name in _DECISION_FIELDS}
        data["limits"] = dict(self.limits)
        data["concurrency"] = dict(self.concurrency)
        data["retry"] = dict(self.retry)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Decision:
        return cls(**{**data, "limits": dict(data["limits"]),
                      "concurrency": dict(data["concurrency"]),
                      "retry": dict(data.get("retry") or {})})


_DECISION_FIELDS = tuple(f.name for f in fields(Decision))


def next_utc_midnight(now: float) -> float:
    return float((math.floor(now / DAY_SECONDS) + 1) * DAY_SECONDS)


class TimeNeeded(Exception):
    """Admission was asked without the time (``now=None``) and this decision needs it:
    a DEFER's retry-after. The caller reads the time and decides again."""


def _known(now: float | None) -> float:
    if now is None:
        raise TimeNeeded
    return now


def admit(
    request: AdmissionRequest,
    policy: Policy,
    policy_version: int,
    usage: TenantUsage,
    now: float | None,
    *,
    default_max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> Decision:
    """Decide ADMIT, DENY or DEFER; every decision carries the run's terms for the record.

    Checks, first hit decides: rules, unknown tenant, repository blocks agents,
    risk class, requirements contract, daily budget, queued runs; a run they admit
    is then held by the first approval gate that matches it (``request.gated``).
    ``default_max_attempts`` is the setting used when neither task nor policy says.
    ``now`` None: the caller has not read the time (a submit saves that round trip);
    ADMIT and DENY never depend on it, a DEFER raises ``TimeNeeded``.
    """
    tenant = request.tenant
    repo_rule = policy.repository_rule(request.repo)
    defaults = policy.defaults
    risk = (repo_rule.risk_class if repo_rule else None) or defaults.risk_class
    queue = request.queue or (repo_rule.queue if repo_rule else None) or defaults.queue
    provider = request.provider or policy.queue_providers.get(queue)
    priority = request.priority if request.priority is not None else defaults.priority
    max_attempts = next(n for n in (request.max_attempts, defaults.max_attempts,
                                    default_max_attempts) if n is not None)
    if repo_rule and repo_rule.max_attempts is not None:
        max_attempts = min(max_attempts, repo_rule.max_attempts)
    limits = defaults.limits.snapshot()
    if repo_rule:
        limits.update(repo_rule.limits.snapshot())
    # Recorded resolved, so the worker never has to know the run's risk class.
    limits.setdefault("network", risk not in NETWORK_OFF_RISKS)

    contract_error: str | None = None
    requires = ""
    try:
        merged = merge_requirements(defaults.requires, repo_rule.requires if repo_rule else {})
        requires = canonical_requirements(merge_requirements(merged, request.requires))
    except ValueError as exc:
        contract_error = str(exc)

    def decide(
        kind: DecisionKind,
        code: str | None = None,
        message: str | None = None,
        retry_after: float | None = None,
    ) -> Decision:
        return Decision(
            decision=kind,
            reason_code=None if code is None else str(code),
            message=message,
            retry_after=retry_after,
            queue=queue,
            priority=priority,
            max_attempts=max_attempts,
            risk_class=risk,
            requires=requires,
            limits=dict(limits),
            concurrency=policy.concurrency_limits_for(tenant, request.repo, request.user,
                                                      risk, queue, provider),
            weight=policy.tenant_weight(tenant),
            policy_version=policy_version,
            retry=policy.retry_rules_for(tenant, queue),
            provider=provider,
        )

    def admitted() -> Decision:
        gate = policy.approval_gate(tenant, request.repo, queue, request.user, risk,
                                    request.estimated_cost_usd) if request.gated else None
        if gate is None:
            return decide("ADMIT")
        index, approval = gate
        label = (f"approval gate {approval.name!r}" if approval.name
                 else f"approval gate approvals[{index}]")
        return decide("REQUIRE_APPROVAL", Reason.APPROVAL_REQUIRED,
                      approval.message or f"held for approval by {label}",
                      _known(now) + approval.timeout_seconds)

    def contract_denied() -> Decision:
        return decide("DENY", Reason.TASK_CONTRACT_INVALID, contract_error)

    matched = policy.matching_rule(tenant, request.repo, queue, request.user, risk)
    if matched is not None:
        index, rule = matched
        label = f"policy rule {rule.name!r}" if rule.name else f"policy rule rules[{index}]"
        if rule.action == "deny":
            return decide("DENY", rule.reason_code or Reason.POLICY_RULE_DENIED,
                          rule.message or f"denied by {label}")
        if rule.action == "defer":
            wait = rule.retry_after_seconds or DEFER_SECONDS
            return decide("DEFER", rule.reason_code or Reason.POLICY_RULE_DEFERRED,
                          rule.message or f"deferred by {label}", _known(now) + wait)
        # An admit rule skips the policy checks below, never the task's own contract
        # nor an approval gate.
        return contract_denied() if contract_error else admitted()

    tenant_policy = policy.tenants.get(tenant)
    if tenant_policy is None and not policy.allow_unknown_tenants:
        return decide("DENY", Reason.TENANT_NOT_ALLOWED,
                      f"tenant {tenant!r} is not listed in the policy "
                      "and allow_unknown_tenants is false")
    if repo_rule and not repo_rule.autonomous_agents:
        return decide("DENY", Reason.REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT,
                      repo_rule.message or "repository "
                      f"{redact_credentials(request.repo)!r} does not allow "
                      f"autonomous agent runs (repositories rule {repo_rule.match!r})")
    allowed = tenant_policy.allowed_risk_classes if tenant_policy else None
    if allowed is not None and risk not in allowed:
        return decide("DENY", Reason.RISK_CLASS_NOT_ALLOWED,
                      f"tenant {tenant!r} may not run {risk}-risk work "
                      f"(allowed: {', '.join(allowed) or 'none'})")
    if contract_error:
        return contract_denied()
    budget = tenant_policy.daily_model_budget_usd if tenant_policy else None
    if budget is not None and usage.spent_today_usd >= budget:
        return decide("DEFER", Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED,
                      f"tenant {tenant!r} spent {usage.spent_today_usd:.2f} USD today, its "
                      f"daily model budget is {budget:.2f} USD",
                      next_utc_midnight(_known(now)))
    max_queued = tenant_policy.max_queued if tenant_policy else None
    if max_queued is not None and usage.queued_runs >= max_queued:
        return decide("DEFER", Reason.TENANT_QUEUE_FULL,
                      f"tenant {tenant!r} has {usage.queued_runs} queued runs "
                      f"(max_queued {max_queued})", _known(now) + DEFER_SECONDS)
    return admitted()
