"""The scheduling policy file (TOML): defaults, limits, tenants, repositories, rules.

One validated, immutable value; the store records each distinct version (by
digest) and every run records the version that admitted it (seed 000 §28).
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import replace
from fnmatch import fnmatchcase
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from runlane.domain.reasons import Reason
from runlane.domain.repos import canonical_pattern
from runlane.domain.retry import RetryPolicy
from runlane.domain.routing import (
    KEY_PATTERN,
    Requirement,
    parse_requirement_value,
    requirements_to_mapping,
)
from runlane.domain.tasks import PRIORITY_CLASSES, parse_priority

RISK_CLASSES: tuple[str, ...] = ("low", "medium", "high", "critical")
# Risk classes whose runs get no network unless their limits say `network = true`.
NETWORK_OFF_RISKS = frozenset({"high", "critical"})
RULE_FIELDS: tuple[str, ...] = ("tenant", "repo", "queue", "user", "risk_class")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_REASON_CODE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TOML_AT = re.compile(r"\s*\(at (line \d+, column \d+|end of document)\)$")


class PolicyInvalid(ValueError):
    """A policy that cannot be applied; names the file, the dotted field and the problem."""

    def __init__(self, source: str, field: str, problem: str):
        super().__init__(f"{source}: {field}: {problem}")
        self.source = source
        self.field = field
        self.problem = problem


def _name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{value!r} must be 1-128 characters of letters, digits and ._:@/-")
    return value


def _risk(value: str) -> str:
    if value not in RISK_CLASSES:
        raise ValueError(f"{value!r} is not a risk class ({', '.join(RISK_CLASSES)})")
    return value


def _requirement_key(value: str) -> str:
    if not KEY_PATTERN.match(value):
        raise ValueError(f"{value!r} may only contain letters, digits, '_', '.' and '-'")
    return value


RequirementTable = Annotated[
    dict[
        Annotated[str, AfterValidator(_requirement_key)],
        Annotated[Requirement, PlainValidator(parse_requirement_value)],
    ],
    PlainSerializer(requirements_to_mapping),
]
Name = Annotated[str, AfterValidator(_name)]
RiskClass = Annotated[str, AfterValidator(_risk)]


def _globs(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(g, str) for g in items):
        raise ValueError("must be a glob string or a list of glob strings")
    if not items or not all(items):
        raise ValueError("a glob must not be empty")
    return tuple(sorted(set(items)))  # a set (any may match): one digest in any order


Globs = Annotated[tuple[str, ...], PlainValidator(_globs), PlainSerializer(list)]


def _repo_globs(value: Any) -> tuple[str, ...]:
    """Repository globs in the canonical form of repositories (domain/repos.py), as the
    runs they are matched against: ``git@github.com:acme/app.git`` and
    ``https://github.com/acme/app`` are one pattern, and match one repository."""
    return tuple(sorted({canonical_pattern(g) for g in _globs(value)}))


RepoGlobs = Annotated[tuple[str, ...], PlainValidator(_repo_globs), PlainSerializer(list)]


# The largest count a policy may set: the database's integer (a larger limit was
# applied, and then every claim failed on it).
MAX_COUNT = 2**31 - 1


class _Model(BaseModel):
    # No infinities or NaN (a weight of inf was applied and printed as `Infinity`).
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# Who holds a run to each limit (docs/policy.md says the same, field by field):
# "worker" (the attempt driver), "store" (cost and tokens, as reported), "watch" (the
# runner samples the process tree; kernel rlimits behind it), "kernel" (an rlimit
# alone), "agent" (its own control lines: an agent that never reports is not held).
# A limit without an entry here is refused at `policy apply`: a limit the policy
# accepts is never silently ignored.
LIMIT_ENFORCEMENT: dict[str, str] = {
    "max_wall_clock_minutes": "worker",
    "max_agent_iterations": "agent",
    "max_tool_calls": "agent",
    "max_shell_command_seconds": "agent",
    "max_verifier_minutes": "worker",
    "max_changed_files": "worker",
    "max_diff_lines": "worker",
    "max_model_input_tokens": "store",
    "max_model_output_tokens": "store",
    "max_cost_usd": "store",
    "max_cpu_seconds": "watch",
    "max_memory_mb": "watch",
    "max_processes": "watch",
    "max_file_size_mb": "kernel",
    "max_open_files": "kernel",
    "max_address_space_mb": "kernel",
    # Terms of the sandbox rather than limits: bwrap holds the run to them.
    "network": "sandbox",
    "secrets": "sandbox",
}

# The largest size in MB a limit may give (an rlimit counts bytes in 63 bits).
MAX_MB = float(2**40)


def _unset_is_absent(value: Any) -> bool:
    return value is None


def unenforced(limits: dict[str, Any], enforcement: dict[str, str]) -> list[str]:
    """The limits set in ``limits`` that nothing in ``enforcement`` holds a run to."""
    return [name for name, value in limits.items()
            if value is not None and name not in enforcement]


class Limits(_Model):
    """Per-run limits (seed 000 §28), snapshotted on each run at admission."""

    max_wall_clock_minutes: float | None = Field(default=None, gt=0)
    max_agent_iterations: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_tool_calls: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_shell_command_seconds: float | None = Field(default=None, gt=0)
    max_verifier_minutes: float | None = Field(default=None, gt=0)
    max_changed_files: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_diff_lines: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_model_input_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_model_output_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_cost_usd: float | None = Field(default=None, ge=0)
    # The agent's process tree (agents/resources.py). Left out of the canonical
    # document when unset, so that a policy that sets none keeps the digest it had
    # before they existed (applying it again after an upgrade makes no new version).
    max_cpu_seconds: float | None = Field(default=None, gt=0, le=MAX_MB,
                                          exclude_if=_unset_is_absent)
    max_memory_mb: float | None = Field(default=None, gt=0, le=MAX_MB,
                                        exclude_if=_unset_is_absent)
    # At least 1: the agent's own shell is a process; 0 could never run an agent.
    max_processes: int | None = Field(default=None, ge=1, le=MAX_COUNT,
                                      exclude_if=_unset_is_absent)
    max_file_size_mb: float | None = Field(default=None, gt=0, le=MAX_MB,
                                           exclude_if=_unset_is_absent)
    # At least 3: stdin, stdout and stderr; fewer and no agent command could start.
    max_open_files: int | None = Field(default=None, ge=3, le=MAX_COUNT,
                                       exclude_if=_unset_is_absent)
    max_address_space_mb: float | None = Field(default=None, gt=0, le=MAX_MB,
                                               exclude_if=_unset_is_absent)

    # The sandbox's terms (docs/sandbox.md): the host network or none (unset: on for
    # low and medium risk, off for high and critical), and the names of the worker's
    # environment variables given to the agent as files in $RUNLANE_SECRETS_DIR.
    network: bool | None = Field(default=None, exclude_if=_unset_is_absent)
    secrets: tuple[str, ...] | None = Field(default=None, exclude_if=_unset_is_absent)

    @model_validator(mode="after")
    def _enforced(self) -> Limits:
        missing = unenforced(dict(self), LIMIT_ENFORCEMENT)
        if missing:
            raise ValueError(f"{missing[0]}: runlane does not enforce this limit "
                             "(remove it from the policy)")
        return self

    @field_validator("secrets", mode="before")
    @classmethod
    def _secret_names(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of environment variable names")
        for name in value:
            if not _SECRET_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name.upper().startswith("RUNLANE_"):
                raise ValueError(f"{name}: RUNLANE_* variables are runlane's own settings "
                                 "and are never given to agents")
        return tuple(sorted(set(value)))  # a set: one digest in any order

    def snapshot(self) -> dict[str, Any]:
        # JSON types (secrets as a list): the snapshot is compared with the stored one.
        return {k: v for k, v in self.model_dump(mode="json").items() if v is not None}


class Defaults(_Model):
    queue: str = "default"
    priority: int = PRIORITY_CLASSES["normal"]
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    risk_class: str = "low"
    limits: Limits = Limits()
    requires: RequirementTable = {}

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str) -> str:
        return _name(value)

    @field_validator("risk_class")
    @classmethod
    def _risk_class(cls, value: str) -> str:
        return _risk(value)

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, value: Any) -> int:
        return parse_priority(value)


class Concurrency(_Model):
    """Maximum active runs per scope; an absent limit is no limit."""

    global_max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    per_tenant_max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    per_repository_max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    per_user_max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    per_risk_class_max_active: dict[RiskClass, Annotated[int, Field(ge=0, le=MAX_COUNT)]] = {}
    per_queue_max_active: dict[Name, Annotated[int, Field(ge=0, le=MAX_COUNT)]] = {}


def _empty_is_absent(value: Any) -> bool:
    return not value


def _retryable_code(value: str) -> str:
    if value not in Reason.__members__:
        raise ValueError(f"{value!r} is not a runlane reason code")
    return value


class RetryRules(_Model):
    """One layer of retry rules (``[retry]``, ``[retry.tenants.NAME]``,
    ``[retry.queues.NAME]``); an absent field keeps the layer below's value.

    The delay after a failed attempt is either exponential (``base_seconds`` doubled
    per attempt up to ``max_seconds``, plus jitter) or the table ``delays_seconds``
    (entry n after attempt n, the last repeated, exactly): one layer gives one or the
    other. New fields are left out of the canonical document when unset, so that a
    policy without them keeps its digest."""

    base_seconds: float | None = Field(default=None, gt=0)
    max_seconds: float | None = Field(default=None, gt=0)
    max_total_run_seconds: float | None = Field(default=None, gt=0)
    max_cost_usd: float | None = Field(default=None, ge=0)
    delays_seconds: tuple[Annotated[float, Field(ge=0, le=MAX_MB)], ...] | None = Field(
        default=None, min_length=1, max_length=100, exclude_if=_unset_is_absent)
    retryable: tuple[Annotated[str, AfterValidator(_retryable_code)], ...] | None = Field(
        default=None, exclude_if=_unset_is_absent)

    @field_validator("delays_seconds", "retryable", mode="before")
    @classmethod
    def _array(cls, value: Any) -> Any:
        if isinstance(value, list):  # TOML arrays are lists; strict mode wants a tuple
            return tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                         for v in value)
        return value

    @field_validator("retryable", mode="after")
    @classmethod
    def _code_set(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if value is None else tuple(sorted(set(value)))  # a set: one digest

    @model_validator(mode="after")
    def _order(self) -> RetryRules:
        if self.delays_seconds is not None and (self.base_seconds is not None
                                                or self.max_seconds is not None):
            raise ValueError("give either delays_seconds (a table) or base_seconds/"
                             "max_seconds (exponential), not both")
        if (self.base_seconds is not None and self.max_seconds is not None
                and self.max_seconds < self.base_seconds):
            raise ValueError("max_seconds must be at least base_seconds")
        return self

    def rules(self) -> dict[str, Any]:
        """The fields this layer sets, as JSON (what a run's admission records)."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in self.model_dump(exclude={"tenants", "queues"}).items()
                if v is not None}


def overlay_retry_rules(below: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """``layer``'s rules over ``below``'s: a layer that gives a delay table drops the
    exponential parameters below it, and one that gives either parameter drops a table."""
    out = dict(below)
    if "delays_seconds" in layer:
        out.pop("base_seconds", None)
        out.pop("max_seconds", None)
    elif "base_seconds" in layer or "max_seconds" in layer:
        out.pop("delays_seconds", None)
    out.update(layer)
    return out


class Retry(RetryRules):
    """``[retry]``: the global layer, with per-tenant and per-queue layers over it
    (precedence: queue over tenant over global over the settings)."""

    tenants: dict[Name, RetryRules] = Field(default={}, exclude_if=_empty_is_absent)
    queues: dict[Name, RetryRules] = Field(default={}, exclude_if=_empty_is_absent)

    def rules_for(self, tenant: str, queue: str) -> dict[str, Any]:
        """The rules in force for a run of ``tenant`` in ``queue`` (over the settings)."""
        rules = self.rules()
        for layer in (self.tenants.get(tenant), self.queues.get(queue)):
            if layer is not None:
                rules = overlay_retry_rules(rules, layer.rules())
        return rules


class ProviderPolicy(_Model):
    """``[providers.NAME]``: the capacity of one model provider, shared by every tenant.
    ``max_active``: its runs active at once (the scope ``provider:NAME``, counted in the
    claim with the other limits, all or nothing)."""

    max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    # Model tokens (input + output) its runs may report per clock minute, all tenants
    # together: the report that reaches it pauses the provider until the minute ends.
    tokens_per_minute: int | None = Field(default=None, ge=1, le=2**62)


class TenantPolicy(_Model):
    weight: float = Field(default=1.0, gt=0)
    max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    max_queued: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    daily_model_budget_usd: float | None = Field(default=None, ge=0)
    allowed_risk_classes: tuple[str, ...] | None = None

    @field_validator("allowed_risk_classes", mode="before")
    @classmethod
    def _risks(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of risk classes")
        return tuple(sorted({_risk(v) for v in value}, key=RISK_CLASSES.index))


class RepositoryPolicy(_Model):
    match: str = Field(min_length=1)
    risk_class: str | None = None
    autonomous_agents: bool = True
    message: str | None = None
    queue: str | None = None
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    max_active: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    requires: RequirementTable = {}
    limits: Limits = Limits()

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        return None if value is None else _name(value)

    @field_validator("risk_class")
    @classmethod
    def _risk_class(cls, value: str | None) -> str | None:
        return None if value is None else _risk(value)

    @field_validator("match")
    @classmethod
    def _match(cls, value: str) -> str:
        return canonical_pattern(value)

    def matches(self, repo: str) -> bool:
        """``repo``: the run's canonical repository (``domain.repos.canonical_repo``);
        ``match`` was brought to that form when the policy was read."""
        return fnmatchcase(repo, self.match)


class RuleWhen(_Model):
    """Globs on the run's facts; every given field must match (an empty table always does)."""

    tenant: Globs | None = None
    repo: RepoGlobs | None = None  # matched against the run's canonical repository
    queue: Globs | None = None
    user: Globs | None = None
    risk_class: Globs | None = None


# How long a DEFER waits when nothing better is known (a full queue, a rule without
# retry_after_seconds): long enough not to spin, short enough to notice free room.
DEFER_SECONDS = 60.0


class Rule(_Model):
    name: str | None = None
    when: RuleWhen = RuleWhen()
    action: Literal["deny", "defer", "admit"]
    reason_code: str | None = None
    message: str | None = None
    retry_after_seconds: float | None = Field(default=None, gt=0)

    @field_validator("reason_code")
    @classmethod
    def _code(cls, value: str | None) -> str | None:
        if value is not None and not _REASON_CODE.match(value):
            raise ValueError(f"{value!r} must be UPPER_SNAKE_CASE, like TENANT_SUSPENDED")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Rule:
        if self.retry_after_seconds is not None and self.action != "defer":
            raise ValueError('retry_after_seconds is only for action = "defer"')
        if self.reason_code is not None and self.action == "admit":
            raise ValueError('reason_code is only for action = "deny" or "defer"')
        if self.action == "defer" and self.retry_after_seconds is None:
            # The default written out: the same rule with or without it is one digest.
            object.__setattr__(self, "retry_after_seconds", DEFER_SECONDS)
        return self

    def matches(self, facts: dict[str, str]) -> bool:
        for field in RULE_FIELDS:
            globs: tuple[str, ...] | None = getattr(self.when, field)
            if globs is not None and not any(fnmatchcase(facts[field], g) for g in globs):
                return False
        return True


# --- approval gates (docs/policy.md, "Approval gates") ---------------------------------

# How long a run waits for its approval when the gate does not say: one day.
APPROVAL_TIMEOUT_SECONDS = 86_400.0


class ApprovalWhen(RuleWhen):
    """A rule's globs, and the task's estimated cost: a gate with
    ``estimated_cost_usd_above`` holds only runs whose task estimated more (a task that
    gave no estimate is not held by it)."""

    estimated_cost_usd_above: float | None = Field(default=None, ge=0)


class ApprovalGate(_Model):
    """A run that would be admitted and matches ``when`` waits in AWAITING_APPROVAL
    until a person approves it (then it is admitted again under the policy in force),
    rejects it or ``timeout_seconds`` pass (POLICY_DENIED, APPROVAL_REJECTED or
    APPROVAL_EXPIRED). Gates hold runs at admission only: the checks at claim and
    before side effects never send a queued or running run back to wait."""

    name: str | None = None
    when: ApprovalWhen = ApprovalWhen()
    timeout_seconds: float = Field(default=APPROVAL_TIMEOUT_SECONDS, gt=0, le=366 * 86_400)
    message: str | None = None

    def matches(self, facts: dict[str, str], estimated_cost_usd: float | None) -> bool:
        threshold = self.when.estimated_cost_usd_above
        if threshold is not None and (estimated_cost_usd is None
                                      or estimated_cost_usd <= threshold):
            return False
        for field in RULE_FIELDS:
            globs: tuple[str, ...] | None = getattr(self.when, field)
            if globs is not None and not any(fnmatchcase(facts[field], g) for g in globs):
                return False
        return True


def _no_gates(value: tuple[ApprovalGate, ...]) -> bool:
    return not value


class Policy(_Model):
    allow_unknown_tenants: bool = True
    defaults: Defaults = Defaults()
    concurrency: Concurrency = Concurrency()
    retry: Retry = Retry()
    tenants: dict[Name, TenantPolicy] = {}
    repositories: tuple[RepositoryPolicy, ...] = ()
    rules: tuple[Rule, ...] = ()
    # Left out of the canonical document when empty: a policy without gates keeps the
    # digest it had before they existed.
    approvals: tuple[ApprovalGate, ...] = Field(default=(), exclude_if=_no_gates)
    # Provider capacity (docs/policy.md): limits per model provider, and the provider of
    # a queue's runs that name none. Left out of the canonical document when empty.
    providers: dict[Name, ProviderPolicy] = Field(default={}, exclude_if=_empty_is_absent)
    queue_providers: dict[Name, Name] = Field(default={}, exclude_if=_empty_is_absent)

    @field_validator("repositories", "rules", "approvals", mode="before")
    @classmethod
    def _array(cls, value: Any) -> Any:
        if isinstance(value, list):  # TOML arrays are lists; strict mode wants a tuple
            return tuple(value)
        return value

    @field_validator("queue_providers", mode="after")
    @classmethod
    def _known_providers(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        declared = info.data.get("providers", {})
        for queue, provider in value.items():
            if provider not in declared:
                raise ValueError(f"{queue}: provider {provider!r} has no "
                                 f"[providers.{provider}] table")
        return value

    @classmethod
    def default(cls) -> Policy:
        """The policy in force before any was applied: everything admitted, no limits."""
        return cls()

    @cached_property
    def provider_token_budgets(self) -> dict[str, int]:
        """Provider -> tokens per minute, for the providers that have a budget."""
        return {name: p.tokens_per_minute for name, p in self.providers.items()
                if p.tokens_per_minute is not None}

    @cached_property
    def has_budgets(self) -> bool:
        """Whether any tenant has a daily model budget (asked on every claim: cached,
        a policy of 1,000 tenants is not walked per claim)."""
        return any(t.daily_model_budget_usd is not None for t in self.tenants.values())

    @cached_property
    def needs_usage(self) -> bool:
        """Whether admission needs the tenants' queued counts and spend at all."""
        return self.has_budgets or any(t.max_queued is not None
                                       for t in self.tenants.values())

    def tenant_weight(self, tenant: str) -> float:
        found = self.tenants.get(tenant)
        return found.weight if found else 1.0

    def tenant_max_active(self, tenant: str) -> int | None:
        found = self.tenants.get(tenant)
        if found and found.max_active is not None:
            return found.max_active
        return self.concurrency.per_tenant_max_active

    def repository_rule(self, repo: str) -> RepositoryPolicy | None:
        return next((r for r in self.repositories if r.matches(repo)), None)

    def matching_rule(
        self, tenant: str, repo: str, queue: str, user: str | None, risk_class: str
    ) -> tuple[int, Rule] | None:
        """The first rule whose globs all match; a missing user matches as ``""``."""
        facts = {"tenant": tenant, "repo": repo, "queue": queue, "user": user or "",
                 "risk_class": risk_class}
        return next(((i, r) for i, r in enumerate(self.rules) if r.matches(facts)), None)

    def approval_gate(
        self, tenant: str, repo: str, queue: str, user: str | None, risk_class: str,
        estimated_cost_usd: float | None,
    ) -> tuple[int, ApprovalGate] | None:
        """The first approval gate that holds this run, if any."""
        if not self.approvals:
            return None
        facts = {"tenant": tenant, "repo": repo, "queue": queue, "user": user or "",
                 "risk_class": risk_class}
        return next(((i, g) for i, g in enumerate(self.approvals)
                     if g.matches(facts, estimated_cost_usd)), None)

    def concurrency_limits_for(
        self, tenant: str, repo: str, user: str | None, risk_class: str, queue: str,
        provider: str | None = None,
    ) -> dict[str, int]:
        """Scope key -> max active runs, only for the scopes that have a limit."""
        c = self.concurrency
        rule = self.repository_rule(repo)
        candidates: dict[str, int | None] = {
            "global": c.global_max_active,
            f"tenant:{tenant}": self.tenant_max_active(tenant),
            f"repo:{repo}": rule.max_active if rule and rule.max_active is not None
            else c.per_repository_max_active,
            f"user:{user}": c.per_user_max_active if user is not None else None,
            f"risk:{risk_class}": c.per_risk_class_max_active.get(risk_class),
            f"queue:{queue}": c.per_queue_max_active.get(queue),
        }
        if provider is not None and provider in self.providers:
            candidates[f"provider:{provider}"] = self.providers[provider].max_active
        return {k: v for k, v in candidates.items() if v is not None}

    def retry_rules_for(self, tenant: str, queue: str) -> dict[str, Any]:
        """The retry rules a run of ``tenant`` in ``queue`` is admitted with (JSON,
        recorded in its admission); the same dict for every run when no layer is
        per tenant or per queue (asked once per run of a submit)."""
        if not self.retry.tenants and not self.retry.queues:
            return self._global_retry_rules
        return self.retry.rules_for(tenant, queue)

    @cached_property
    def _global_retry_rules(self) -> dict[str, Any]:
        return self.retry.rules()

    def retry_policy(self, base: RetryPolicy | None = None) -> RetryPolicy:
        """``base`` (from the settings) with this policy's global retry overrides
        applied (a run admitted before retry rules were recorded fails under these)."""
        policy = (base or RetryPolicy()).with_rules(self.retry.rules())
        if self.defaults.max_attempts is not None:
            policy = replace(policy, max_attempts=self.defaults.max_attempts)
        return policy


# --- loading ---------------------------------------------------------------------------


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "[key]":
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _problem(error: Any) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "is required"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["loc"] and error["loc"][-1] == "[key]":
        return f"bad name: {message}"
    if kind not in ("value_error", "assertion_error") and not isinstance(
        error.get("input"), dict
    ):
        message += f" (got {error['input']!r})"
    return message


def policy_from_document(data: Any, source: str = "<document>") -> Policy:
    """Validate already-parsed data (TOML tables or a stored ``policy_document``)."""
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise PolicyInvalid(source, _dotted(first["loc"]), _problem(first)) from None


def parse_policy(text: str, source: str = "<string>") -> Policy:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        where = _TOML_AT.search(message)
        field = where.group(1) if where else "(syntax)"
        raise PolicyInvalid(source, field, _TOML_AT.sub("", message)) from None
    return policy_from_document(data, source)


def read_policy_text(path: str | Path) -> str:
    """The text of a policy file; PolicyInvalid when it cannot be read as UTF-8."""
    source = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyInvalid(source, "(file)", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PolicyInvalid(source, "(file)", "is not UTF-8 text") from None


def load_policy(path: str | Path) -> Policy:
    return parse_policy(read_policy_text(path), str(path))


def policy_document(policy: Policy) -> dict[str, Any]:
    """Canonical JSON-able form with every default filled in; parses back to ``policy``."""
    data: dict[str, Any] = policy.model_dump(mode="json")
    return data


def policy_digest(policy: Policy) -> str:
    """sha256 of the canonical JSON: unchanged by formatting or the order of tables."""
    text = json.dumps(policy_document(policy), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def run_scopes(tenant: str, repo: str, user: str | None, risk_class: str,
               queue: str, provider: str | None = None) -> list[str]:
    """Every concurrency scope a run is in, limited or not, sorted. An attempt holds a
    slot in each (``attempts.limit_scopes``): a limit applied while it runs then counts
    it (a new counter starts at the attempts that hold its scope) and its end gives
    that slot back. With only the scopes limited at its claim, a tenant limited to 2
    after 2 of its runs started took 2 more (4 live against 2; a review of
    2026-12-02). The same list in SQL: ``claim_sql.RUN_SCOPES``."""
    scopes = ["global", f"tenant:{tenant}", f"repo:{repo}", f"risk:{risk_class}",
              f"queue:{queue}"]
    if user is not None:
        scopes.append(f"user:{user}")
    if provider is not None:
        scopes.append(f"provider:{provider}")
    return sorted(scopes)
