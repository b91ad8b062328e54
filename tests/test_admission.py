"""Admission: every decision path, the order of checks, the terms, determinism."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runlane.domain.admission import (
    DEFER_SECONDS,
    AdmissionRequest,
    Decision,
    TenantUsage,
    admit,
    next_utc_midnight,
)
from runlane.domain.policy import Policy, load_policy, parse_policy
from runlane.domain.reasons import Reason
from runlane.domain.routing import parse_requirements

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z
IDLE = TenantUsage(queued_runs=0, spent_today_usd=0.0)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "policy.toml"

POLICY = parse_policy(
    """
allow_unknown_tenants = false

[defaults]
queue = "default"
priority = "normal"
max_attempts = 3
risk_class = "low"
[defaults.limits]
max_wall_clock_minutes = 45
max_cost_usd = 5.0
max_changed_files = 50
[defaults.requires]
tools = ["git"]

[concurrency]
global_max_active = 200
per_user_max_active = 5
[concurrency.per_queue_max_active]
java = 8

[tenants.acme]
weight = 2.0
max_active = 20
max_queued = 10
daily_model_budget_usd = 100
allowed_risk_classes = ["low", "medium"]

[tenants.trusted]

[tenants.contractors]

[[repositories]]
match = "*/payments-*"
risk_class = "medium"
autonomous_agents = false
message = "This repository only allows analysis-only mode for AI agents."

[[repositories]]
match = "*/vault-*"
risk_class = "critical"

[[repositories]]
match = "*/java-*"
risk_class = "medium"
queue = "java"
max_attempts = 2
requires = { jdk = ">=21", tools = "git,maven" }
limits = { max_cost_usd = 2.0, max_wall_clock_minutes = 90 }

[[rules]]
when = { tenant = "contractors" }
action = "deny"
reason_code = "TENANT_SUSPENDED"
message = "contractors are suspended"

[[rules]]
when = { tenant = "acme", queue = "freeze-*" }
action = "defer"
retry_after_seconds = 600

[[rules]]
when = { tenant = "acme", user = "root" }
action = "deny"

[[rules]]
name = "oncall"
when = { tenant = ["acme", "trusted"], user = "oncall-*" }
action = "admit"
"""
)


def decide(
    tenant: str = "acme",
    repo: str = "git@host:acme/web",
    usage: TenantUsage = IDLE,
    policy: Policy = POLICY,
    **fields: object,
) -> Decision:
    request = AdmissionRequest(tenant=tenant, repo=repo, **fields)  # type: ignore[arg-type]
    return admit(request, policy, 7, usage, NOW)


# --- ADMIT and its terms ----------------------------------------------------------------


def test_admit_with_the_defaults() -> None:
    d = decide()
    assert (d.decision, d.reason_code, d.message, d.retry_after) == ("ADMIT", None, None, None)
    assert d.queue == "default"
    assert d.priority == 100
    assert d.max_attempts == 3
    assert d.risk_class == "low"
    assert d.requires == '{"tools":["git"]}'
    assert d.limits == {"max_wall_clock_minutes": 45.0, "max_cost_usd": 5.0,
                        "max_changed_files": 50, "network": True}
    assert d.concurrency == {"global": 200, "tenant:acme": 20}
    assert d.weight == 2.0
    assert d.policy_version == 7


def test_admit_on_a_repository_rule_takes_its_terms() -> None:
    d = decide(repo="git@host:acme/java-billing", user="ann")
    assert d.decision == "ADMIT"
    assert d.queue == "java"
    assert d.risk_class == "medium"
    assert d.max_attempts == 2
    assert d.requires == '{"jdk":">=21","tools":["git","maven"]}'
    assert d.limits == {"max_wall_clock_minutes": 90.0, "max_cost_usd": 2.0,
                        "max_changed_files": 50, "network": True}
    assert d.concurrency == {"global": 200, "tenant:acme": 20, "user:ann": 5, "queue:java": 8}


def test_the_tasks_own_terms_win_except_the_attempt_cap() -> None:
    d = decide(repo="git@host:acme/java-billing", queue="java-large", priority=0,
               max_attempts=5,
               requires=parse_requirements({"workspace_gb": 12, "jdk": ">=21.0.2"}))
    assert d.decision == "ADMIT"
    assert (d.queue, d.priority) == ("java-large", 0)
    assert d.max_attempts == 2  # min(task's 5, repository's 2)
    assert decide(repo="git@host:acme/java-billing", max_attempts=1).max_attempts == 1
    assert d.requires == '{"jdk":">=21.0.2","tools":["git","maven"],"workspace_gb":12}'


@pytest.mark.parametrize(("risk", "rule_says", "network"), [
    ("low", None, True), ("medium", None, True), ("high", None, False),
    ("critical", None, False), ("high", True, True), ("low", False, False)])
def test_the_network_is_recorded_resolved_off_for_high_and_critical_risk(
        risk: str, rule_says: bool | None, network: bool) -> None:
    """docs/sandbox.md: `network` unset is on for low and medium risk, off for high and
    critical; recorded on the run either way, so a worker never needs the risk class.
    A repository rule's value overrides the defaults', like every limit."""
    limits = ("" if rule_says is None
              else f"limits = {{ network = {str(rule_says).lower()} }}\n")
    policy = parse_policy(f'[defaults]\nrisk_class = "{risk}"\n'
                          '[defaults.limits]\nnetwork = true\n'
                          f'[[repositories]]\nmatch = "*"\n{limits}', "p.toml")
    if rule_says is None:  # the defaults say nothing either
        policy = parse_policy(f'[defaults]\nrisk_class = "{risk}"\n', "p.toml")
    d = admit(AdmissionRequest(tenant="t", repo="r"), policy, 0, IDLE, NOW)
    assert d.limits["network"] is network


def test_secrets_are_recorded_as_a_sorted_list_of_names() -> None:
    policy = parse_policy('[defaults.limits]\nsecrets = ["Z_KEY", "MODEL_API_KEY", "Z_KEY"]\n'
                          '[[repositories]]\nmatch = "/srv/*"\n'
                          'limits = { secrets = [] }\n', "p.toml")
    d = admit(AdmissionRequest(tenant="t", repo="r"), policy, 0, IDLE, NOW)
    assert d.limits["secrets"] == ["MODEL_API_KEY", "Z_KEY"]
    # A repository rule's list replaces the defaults' (an empty one: no secret at all).
    assert admit(AdmissionRequest(tenant="t", repo="/srv/a"), policy, 0, IDLE,
                 NOW).limits["secrets"] == []


def test_max_attempts_falls_back_to_the_setting_when_the_policy_is_silent() -> None:
    request = AdmissionRequest(tenant="t", repo="r")
    assert admit(request, Policy.default(), 0, IDLE, NOW).max_attempts == 3
    assert admit(request, Policy.default(), 0, IDLE, NOW,
                 default_max_attempts=6).max_attempts == 6
    assert admit(request, POLICY, 0, IDLE, NOW, default_max_attempts=6).max_attempts == 3
    with_task = AdmissionRequest(tenant="t", repo="r", max_attempts=9)
    assert admit(with_task, Policy.default(), 0, IDLE, NOW).max_attempts == 9


def test_the_empty_policy_admits_everything_without_limits() -> None:
    d = admit(AdmissionRequest(tenant="anyone", repo="/srv/repo", user="u"), Policy.default(), 0,
              TenantUsage(queued_runs=10**6, spent_today_usd=10**6), NOW)
    assert d.decision == "ADMIT"
    assert (d.queue, d.priority, d.risk_class, d.requires) == ("default", 100, "low", "")
    assert d.limits == {"network": True} and d.concurrency == {}  # low risk: the network
    assert d.weight == 1.0


# --- DENY and DEFER paths ---------------------------------------------------------------


def test_deny_rule_with_its_reason_code() -> None:
    d = decide(tenant="contractors")
    assert (d.decision, d.reason_code, d.message) == (
        "DENY", "TENANT_SUSPENDED", "contractors are suspended")
    assert d.retry_after is None


def test_deny_rule_without_a_reason_code() -> None:
    d = decide(user="root")
    assert (d.decision, d.reason_code) == ("DENY", Reason.POLICY_RULE_DENIED)
    assert d.message == "denied by policy rule rules[2]"
    assert decide(user="rooted").decision == "ADMIT"  # globs match the whole value


def test_defer_rule_on_the_resolved_queue() -> None:
    d = decide(queue="freeze-java")
    assert (d.decision, d.reason_code) == ("DEFER", Reason.POLICY_RULE_DEFERRED)
    assert d.retry_after == NOW + 600
    assert d.queue == "freeze-java"


def test_defer_rule_without_retry_after_waits_the_default() -> None:
    policy = parse_policy("[[rules]]\naction = 'defer'\nreason_code = 'MAINTENANCE'")
    d = decide(policy=policy)
    assert (d.decision, d.reason_code, d.retry_after) == ("DEFER", "MAINTENANCE",
                                                          NOW + DEFER_SECONDS)


def test_unknown_tenant_is_denied_only_when_unknown_tenants_are_not_allowed() -> None:
    d = decide(tenant="stranger")
    assert (d.decision, d.reason_code) == ("DENY", Reason.TENANT_NOT_ALLOWED)
    assert "stranger" in (d.message or "")
    open_policy = parse_policy("allow_unknown_tenants = true")
    assert decide(tenant="stranger", policy=open_policy).decision == "ADMIT"


def test_repository_blocks_autonomous_agents_with_the_policy_message() -> None:
    d = decide(repo="git@host:acme/payments-api")
    assert (d.decision, d.reason_code) == ("DENY", Reason.REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT)
    assert d.message == "This repository only allows analysis-only mode for AI agents."
    unnamed = parse_policy("[[repositories]]\nmatch = '*'\nautonomous_agents = false")
    message = decide(policy=unnamed).message or ""
    assert "does not allow autonomous agent runs" in message
    # The run's message names the repository without the credentials of its URL.
    message = decide(policy=unnamed, repo="https://bob:s3cr3t@git.example/a/b.git").message
    assert "'https://***@git.example/a/b.git'" in (message or "")
    assert "s3cr3t" not in (message or "")


def test_risk_class_not_allowed_for_the_tenant() -> None:
    d = decide(repo="git@host:acme/vault-keys")
    assert (d.decision, d.reason_code) == ("DENY", Reason.RISK_CLASS_NOT_ALLOWED)
    assert d.risk_class == "critical"
    assert "critical" in (d.message or "") and "low, medium" in (d.message or "")
    # A tenant without allowed_risk_classes may run any risk class.
    assert decide(tenant="trusted", repo="git@host:acme/vault-keys").decision == "ADMIT"


def test_conflicting_requirements_deny_the_task_contract() -> None:
    d = decide(repo="git@host:acme/java-billing", requires=parse_requirements({"jdk": "<=17"}))
    assert (d.decision, d.reason_code) == ("DENY", Reason.TASK_CONTRACT_INVALID)
    assert "jdk" in (d.message or "") and "no version satisfies" in (d.message or "")
    assert d.requires == ""
    d = decide(requires=parse_requirements({"tools": 3}))
    assert (d.decision, d.reason_code) == ("DENY", Reason.TASK_CONTRACT_INVALID)


def test_daily_budget_defers_to_the_next_utc_midnight() -> None:
    d = decide(usage=TenantUsage(queued_runs=0, spent_today_usd=100.0))
    assert (d.decision, d.reason_code) == ("DEFER", Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED)
    assert d.retry_after == next_utc_midnight(NOW)
    assert datetime.fromtimestamp(d.retry_after, UTC) == datetime(2027, 1, 16, tzinfo=UTC)
    assert decide(usage=TenantUsage(0, 99.99)).decision == "ADMIT"


def test_next_utc_midnight() -> None:
    midnight = datetime(2027, 1, 16, tzinfo=UTC).timestamp()
    assert next_utc_midnight(midnight - 0.001) == midnight
    assert next_utc_midnight(midnight) == midnight + 86_400  # strictly after now
    assert next_utc_midnight(NOW) > NOW


def test_a_full_queue_defers_for_a_minute() -> None:
    d = decide(usage=TenantUsage(queued_runs=10, spent_today_usd=0.0))
    assert (d.decision, d.reason_code) == ("DEFER", Reason.TENANT_QUEUE_FULL)
    assert d.retry_after == NOW + 60
    assert decide(usage=TenantUsage(queued_runs=9, spent_today_usd=0.0)).decision == "ADMIT"


def test_deny_and_defer_still_carry_the_runs_terms() -> None:
    d = decide(repo="git@host:acme/java-billing", user="ann",
               usage=TenantUsage(queued_runs=10, spent_today_usd=0.0))
    assert d.decision == "DEFER"
    assert (d.queue, d.risk_class, d.max_attempts) == ("java", "medium", 2)
    assert d.requires == '{"jdk":">=21","tools":["git","maven"]}'
    assert d.limits["max_cost_usd"] == 2.0
    assert d.concurrency["queue:java"] == 8
    assert d.weight == 2.0 and d.policy_version == 7


# --- order of checks --------------------------------------------------------------------


def test_rules_come_before_every_other_check() -> None:
    # contractors is listed, but even an unlisted tenant hits the rule first.
    policy = parse_policy(
        "allow_unknown_tenants = false\n"
        "[[rules]]\nwhen = { tenant = 'ghost' }\naction = 'deny'\nreason_code = 'GONE'"
    )
    assert decide(tenant="ghost", policy=policy).reason_code == "GONE"
    assert decide(tenant="other", policy=policy).reason_code == Reason.TENANT_NOT_ALLOWED


def test_unknown_tenant_comes_before_the_repository_block() -> None:
    d = decide(tenant="stranger", repo="git@host:acme/payments-api")
    assert d.reason_code == Reason.TENANT_NOT_ALLOWED


def test_repository_block_comes_before_the_risk_class() -> None:
    policy = parse_policy(
        "[tenants.a]\nallowed_risk_classes = ['low']\n"
        "[[repositories]]\nmatch = '*'\nrisk_class = 'high'\nautonomous_agents = false"
    )
    d = decide(tenant="a", policy=policy)
    assert d.reason_code == Reason.REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT


def test_risk_class_comes_before_the_requirements_contract() -> None:
    d = decide(repo="git@host:acme/vault-keys", requires=parse_requirements({"tools": 3}))
    assert d.reason_code == Reason.RISK_CLASS_NOT_ALLOWED


def test_requirements_contract_comes_before_the_budget() -> None:
    d = decide(requires=parse_requirements({"tools": 3}),
               usage=TenantUsage(queued_runs=99, spent_today_usd=999.0))
    assert d.reason_code == Reason.TASK_CONTRACT_INVALID


def test_budget_comes_before_the_full_queue() -> None:
    d = decide(usage=TenantUsage(queued_runs=99, spent_today_usd=999.0))
    assert d.reason_code == Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED


def test_an_admit_rule_skips_policy_checks_but_not_the_contract() -> None:
    exhausted = TenantUsage(queued_runs=99, spent_today_usd=999.0)
    d = decide(user="oncall-ann", repo="git@host:acme/payments-api", usage=exhausted)
    assert (d.decision, d.reason_code) == ("ADMIT", None)
    bad = decide(user="oncall-ann", requires=parse_requirements({"tools": 3}), usage=exhausted)
    assert (bad.decision, bad.reason_code) == ("DENY", Reason.TASK_CONTRACT_INVALID)


def test_a_run_without_a_user_matches_user_globs_as_the_empty_string() -> None:
    assert decide(user=None).decision == "ADMIT"  # rules[2] is user = "root"
    catch_all = parse_policy("[[rules]]\nwhen = { user = '*' }\naction = 'deny'")
    assert decide(user=None, policy=catch_all).decision == "DENY"  # "*" matches ""


def test_a_rule_on_risk_class_sees_the_repositorys_risk() -> None:
    policy = parse_policy(
        "[[repositories]]\nmatch = '*/core'\nrisk_class = 'high'\n"
        "[[rules]]\nwhen = { risk_class = ['high', 'critical'] }\naction = 'defer'"
    )
    assert decide(repo="git@h:a/core", policy=policy).decision == "DEFER"
    assert decide(repo="git@h:a/web", policy=policy).decision == "ADMIT"


# --- determinism and serialisation ------------------------------------------------------


def test_reason_codes_are_plain_strings() -> None:
    d = decide(tenant="stranger")
    assert type(d.reason_code) is str
    assert json.loads(json.dumps(d.to_json()))["reason_code"] == "TENANT_NOT_ALLOWED"


def test_to_json_round_trips() -> None:
    d = decide(repo="git@host:acme/java-billing", user="ann")
    data = json.loads(json.dumps(d.to_json()))
    assert set(data) == {"decision", "reason_code", "message", "retry_after", "queue",
                         "priority", "max_attempts", "risk_class", "requires", "limits",
                         "concurrency", "weight", "policy_version", "retry",
                         "provider"}
    assert Decision.from_json(data) == d


_cases = st.fixed_dictionaries(
    {
        "tenant": st.sampled_from(["acme", "trusted", "contractors", "stranger"]),
        "repo": st.sampled_from(["git@h:a/web", "git@h:a/java-x", "git@h:a/payments-y",
                                 "git@h:a/vault-z"]),
        "queue": st.sampled_from([None, "java", "freeze-x", "default"]),
        "priority": st.sampled_from([None, 0, 150]),
        "user": st.sampled_from([None, "root", "oncall-1", "ann"]),
        "max_attempts": st.sampled_from([None, 1, 5]),
        "requires": st.sampled_from([{}, {"jdk": "<=17"}, {"workspace_gb": 4}]),
        "queued": st.integers(0, 20),
        "spent": st.floats(0, 200),
        "now": st.floats(1.6e9, 2e9),
    }
)


@given(_cases)
def test_same_inputs_give_the_same_decision(case: dict[str, object]) -> None:
    def once() -> Decision:
        request = AdmissionRequest(
            tenant=case["tenant"], repo=case["repo"], queue=case["queue"],  # type: ignore[arg-type]
            priority=case["priority"], user=case["user"],  # type: ignore[arg-type]
            max_attempts=case["max_attempts"],  # type: ignore[arg-type]
            requires=parse_requirements(case["requires"]),  # type: ignore[arg-type]
        )
        usage = TenantUsage(case["queued"], case["spent"])  # type: ignore[arg-type]
        return admit(request, POLICY, 3, usage, case["now"])  # type: ignore[arg-type]

    first, second = once(), once()
    assert first == second
    assert first.to_json() == second.to_json()
    assert json.dumps(first.to_json(), sort_keys=True) == json.dumps(second.to_json(),
                                                                     sort_keys=True)
    assert (first.retry_after is None) == (first.decision != "DEFER")
    assert (first.reason_code is None) == (first.decision == "ADMIT")


def test_the_example_policy_decides_as_its_documentation_says() -> None:
    policy = load_policy(EXAMPLE)
    java = admit(AdmissionRequest(tenant="platform-team", repo="git@host:acme/java-billing"),
                 policy, 1, IDLE, NOW)
    assert java.decision == "ADMIT"
    assert (java.queue, java.risk_class, java.max_attempts) == ("java", "medium", 2)
    assert java.requires == '{"jdk":">=21","tools":["git","maven"],"workspace_gb":12}'
    assert java.limits["max_cost_usd"] == 2.0
    assert java.limits["max_wall_clock_minutes"] == 90.0
    payments = admit(AdmissionRequest(tenant="platform-team", repo="git@host:acme/payments-api"),
                     policy, 1, IDLE, NOW)
    assert payments.reason_code == Reason.REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT
    contractors = admit(AdmissionRequest(tenant="contractors", repo="git@host:acme/web"),
                        policy, 1, IDLE, NOW)
    assert contractors.reason_code == "TENANT_SUSPENDED"
    costly = admit(AdmissionRequest(tenant="web-team", repo="git@host:acme/web",
                                    estimated_cost_usd=30.0), policy, 1, IDLE, NOW)
    assert (costly.decision, costly.reason_code) == ("REQUIRE_APPROVAL",
                                                     Reason.APPROVAL_REQUIRED)
    assert java.provider == "openai"


@pytest.mark.parametrize("code", [
    "REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT", "TENANT_NOT_ALLOWED", "RISK_CLASS_NOT_ALLOWED",
    "TENANT_DAILY_MODEL_BUDGET_EXCEEDED", "TENANT_QUEUE_FULL", "POLICY_RULE_DENIED",
    "POLICY_RULE_DEFERRED", "DEPENDENCY_FAILED", "UNROUTABLE",
])
def test_admission_reason_codes_exist(code: str) -> None:
    assert Reason(code) == code
