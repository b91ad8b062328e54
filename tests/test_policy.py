"""The policy file: loading, every error path, the canonical document and its digest."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runlane.domain.policy import (
    Policy,
    PolicyInvalid,
    load_policy,
    parse_policy,
    policy_digest,
    policy_document,
    policy_from_document,
)
from runlane.domain.retry import RetryPolicy
from runlane.domain.routing import canonical_requirements, parse_requirements

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "policy.toml"

FULL = """
allow_unknown_tenants = false

[defaults]
queue = "default"
priority = "high"
max_attempts = 4
risk_class = "medium"
[defaults.limits]
max_wall_clock_minutes = 45
max_cost_usd = 5
[defaults.requires]
tools = "git"

[concurrency]
global_max_active = 200
per_tenant_max_active = 20
per_repository_max_active = 2
per_user_max_active = 5
[concurrency.per_risk_class_max_active]
high = 10
[concurrency.per_queue_max_active]
java = 8

[retry]
base_seconds = 10
max_seconds = 600

[tenants.platform-team]
weight = 2
max_active = 7
max_queued = 500
daily_model_budget_usd = 200
allowed_risk_classes = ["medium", "low"]

[tenants.web]
max_queued = 3

[[repositories]]
match = "*/payments-*"
risk_class = "high"
autonomous_agents = false
message = "analysis only"

[[repositories]]
match = "*/java-*"
queue = "java"
max_attempts = 2
max_active = 1
requires = { jdk = ">=21", tools = "git,maven" }
limits = { max_cost_usd = 2.0 }

[[rules]]
when = { tenant = "contractors", queue = "*" }
action = "deny"
reason_code = "TENANT_SUSPENDED"
message = "suspended"
"""


def problem_of(text: str) -> PolicyInvalid:
    with pytest.raises(PolicyInvalid) as caught:
        parse_policy(text, source="policy.toml")
    error = caught.value
    assert str(error) == f"policy.toml: {error.field}: {error.problem}"
    assert "\n" not in str(error)
    return error


# --- loading ----------------------------------------------------------------------------


def test_a_full_policy_loads_with_its_values() -> None:
    policy = parse_policy(FULL)
    assert policy.allow_unknown_tenants is False
    assert policy.defaults.priority == 50  # "high", through parse_priority
    assert policy.defaults.risk_class == "medium"
    assert policy.defaults.limits.snapshot() == {"max_wall_clock_minutes": 45.0,
                                                 "max_cost_usd": 5.0}
    assert policy.defaults.requires == parse_requirements({"tools": "git"})
    assert policy.tenants["platform-team"].weight == 2.0
    assert policy.tenants["platform-team"].allowed_risk_classes == ("low", "medium")
    assert [r.match for r in policy.repositories] == ["*/payments-*", "*/java-*"]
    assert policy.repositories[1].requires == parse_requirements(
        {"jdk": ">=21", "tools": ["git", "maven"]})
    assert policy.rules[0].reason_code == "TENANT_SUSPENDED"


def test_the_example_file_loads() -> None:
    policy = load_policy(EXAMPLE)
    assert policy.allow_unknown_tenants is False
    assert policy.tenants["platform-team"].weight == 2.0
    assert policy.repository_rule("git@host:acme/payments-api") is not None
    assert policy.rules and policy.repositories and policy.concurrency.global_max_active


def test_the_example_in_the_docs_is_the_example_file() -> None:
    doc = (ROOT / "docs" / "policy.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, flags=re.S)
    assert blocks, "docs/policy.md has no ```toml block"
    assert policy_digest(parse_policy(blocks[-1])) == policy_digest(load_policy(EXAMPLE))


def test_the_empty_policy_is_the_default() -> None:
    assert parse_policy("") == Policy.default()
    empty = Policy.default()
    assert empty.allow_unknown_tenants is True
    assert empty.tenant_max_active("anyone") is None
    assert empty.concurrency_limits_for("t", "r", "u", "low", "default") == {}
    assert empty.repository_rule("anything") is None
    assert empty.defaults.limits.snapshot() == {}


def test_load_policy_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[tenants.a]\nweight = -1\n")
    with pytest.raises(PolicyInvalid) as caught:
        load_policy(path)
    assert caught.value.source == str(path)
    assert str(caught.value).startswith(f"{path}: tenants.a.weight: ")


def test_a_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyInvalid, match="cannot read"):
        load_policy(tmp_path / "nope.toml")


def test_a_binary_file_is_a_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PolicyInvalid, match="not UTF-8"):
        load_policy(path)


# --- errors -----------------------------------------------------------------------------


def test_a_toml_syntax_error_names_the_line() -> None:
    error = problem_of('[defaults]\nqueue = "a"\nmax_attempts = \n')
    assert error.field.startswith("line 3")
    assert error.problem and "line" not in error.problem


@pytest.mark.parametrize(
    ("text", "field", "problem"),
    [
        ("colour = 1", "colour", "unknown field"),
        ("[defaults]\nqeue = 'x'", "defaults.qeue", "unknown field"),
        ("[defaults.limits]\nmax_cost = 1", "defaults.limits.max_cost", "unknown field"),
        ("[defaults.limits]\nnetwork = 'on'", "defaults.limits.network", "valid boolean"),
        ("[defaults.limits]\nsecrets = 'KEY'", "defaults.limits.secrets",
         "list of environment variable names"),
        ("[defaults.limits]\nsecrets = ['a-key']", "defaults.limits.secrets",
         "'a-key' is not an environment variable name"),
        ("[defaults.limits]\nsecrets = ['RUNLANE_DATABASE_URL']", "defaults.limits.secrets",
         "never given to agents"),
        ("[tenants.a]\nweigth = 1", "tenants.a.weigth", "unknown field"),
        ("[[repositories]]\nmatch='*'\nqueu='x'", "repositories[0].queu", "unknown field"),
        ("[[rules]]\naction='deny'\nwhen={team='x'}", "rules[0].when.team", "unknown field"),
        ("[tenants.platform-team]\nweight = 0", "tenants.platform-team.weight",
         "greater than 0"),
        ("[tenants.a]\nweight = -2.5", "tenants.a.weight", "greater than 0"),
        ("[tenants.a]\nweight = '2'", "tenants.a.weight", "valid number"),
        ("[tenants.a]\nmax_active = 1.5", "tenants.a.max_active", "valid integer"),
        ("[tenants.a]\nallowed_risk_classes = 'low'", "tenants.a.allowed_risk_classes",
         "list of risk classes"),
        ("[tenants.a]\nallowed_risk_classes = ['low', 'extreme']",
         "tenants.a.allowed_risk_classes", "'extreme' is not a risk class"),
        ("[tenants.'a b']", "tenants.a b", "bad name"),
        ("[defaults]\npriority = 'urgent'", "defaults.priority", "'urgent' is not an integer"),
        ("[defaults]\npriority = 5000", "defaults.priority", "between 0 and 1000"),
        ("[defaults]\npriority = true", "defaults.priority", "must be an integer"),
        ("[defaults]\nmax_attempts = 0", "defaults.max_attempts", "greater than or equal to 1"),
        ("[defaults]\nrisk_class = 'HIGH'", "defaults.risk_class", "is not a risk class"),
        ("[defaults]\nqueue = 'a queue'", "defaults.queue", "letters, digits"),
        ("[defaults.requires]\njdk = '>=x'", "defaults.requires.jdk", "not a version"),
        ("[defaults.requires]\n'a b' = 1", "defaults.requires.a b", "bad name"),
        ("[defaults]\nrequires = 'jdk>=21'", "defaults.requires", "valid dictionary"),
        ("[concurrency]\nglobal_max_active = -1", "concurrency.global_max_active",
         "greater than or equal to 0"),
        ("[concurrency.per_risk_class_max_active]\nhuge = 1",
         "concurrency.per_risk_class_max_active.huge", "is not a risk class"),
        ("[retry]\nbase_seconds = 60\nmax_seconds = 10", "retry",
         "max_seconds must be at least base_seconds"),
        ("[[repositories]]\nmatch = 5", "repositories[0].match", "valid string"),
        ("[[repositories]]\nmatch = ['*']", "repositories[0].match", "valid string"),
        ("[[repositories]]\nmatch = ''", "repositories[0].match", "at least 1 character"),
        ("[[repositories]]\nrisk_class = 'low'", "repositories[0].match", "is required"),
        ("[[repositories]]\nmatch='a'\n[[repositories]]\nmatch='b'\nautonomous_agents = 'no'",
         "repositories[1].autonomous_agents", "valid boolean"),
        ("[[rules]]\naction = 'allow'", "rules[0].action", "'deny', 'defer' or 'admit'"),
        ("[[rules]]\nwhen = {tenant = 'x'}", "rules[0].action", "is required"),
        ("[[rules]]\naction = 'deny'\nwhen = {tenant = 5}", "rules[0].when.tenant",
         "glob string or a list of glob strings"),
        ("[[rules]]\naction = 'deny'\nwhen = {repo = ['a', 1]}", "rules[0].when.repo",
         "glob string or a list of glob strings"),
        ("[[rules]]\naction = 'deny'\nreason_code = 'suspended'", "rules[0].reason_code",
         "UPPER_SNAKE_CASE"),
        ("[[rules]]\naction = 'deny'\nretry_after_seconds = 5", "rules[0]",
         'only for action = "defer"'),
        ("[[rules]]\naction = 'admit'\nreason_code = 'X'", "rules[0]", "only for action"),
        ("rules = 5", "rules", "valid tuple"),
        ("allow_unknown_tenants = 'yes'", "allow_unknown_tenants", "valid boolean"),
    ],
)
def test_errors_name_the_field_and_the_problem(text: str, field: str, problem: str) -> None:
    error = problem_of(text)
    assert error.source == "policy.toml"
    assert error.field == field
    assert problem in error.problem


def test_a_policy_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^<string>: x: unknown field$"):
        parse_policy("x = 1")


# --- helpers the store calls ------------------------------------------------------------


def test_tenant_weight_and_max_active() -> None:
    policy = parse_policy(FULL)
    assert policy.tenant_weight("platform-team") == 2.0
    assert policy.tenant_weight("web") == 1.0
    assert policy.tenant_weight("unknown") == 1.0
    assert policy.tenant_max_active("platform-team") == 7  # its own
    assert policy.tenant_max_active("web") == 20  # per_tenant_max_active
    assert policy.tenant_max_active("unknown") == 20


def test_repository_rule_is_the_first_match() -> None:
    policy = parse_policy(
        "[[repositories]]\nmatch = '*/java-legacy'\nqueue = 'old'\n"
        "[[repositories]]\nmatch = '*/java-*'\nqueue = 'java'\n"
    )
    assert (rule := policy.repository_rule("git@h:acme/java-legacy")) and rule.queue == "old"
    assert (rule := policy.repository_rule("git@h:acme/java-new")) and rule.queue == "java"
    assert policy.repository_rule("git@h:acme/go-new") is None
    assert policy.repository_rule("git@h:acme/JAVA-new") is None  # globs are case-sensitive


def test_concurrency_limits_for_every_scope() -> None:
    policy = parse_policy(FULL)
    assert policy.concurrency_limits_for(
        "platform-team", "git@h:acme/java-x", "bob", "high", "java") == {
        "global": 200,
        "tenant:platform-team": 7,
        "repo:git@h:acme/java-x": 1,  # the repository rule's max_active
        "user:bob": 5,
        "risk:high": 10,
        "queue:java": 8,
    }


def test_concurrency_limits_only_for_scopes_with_a_limit() -> None:
    policy = parse_policy(FULL)
    assert policy.concurrency_limits_for("web", "/srv/repo", None, "low", "default") == {
        "global": 200,
        "tenant:web": 20,
        "repo:/srv/repo": 2,
    }
    only_queue = parse_policy("[concurrency.per_queue_max_active]\njava = 3")
    assert only_queue.concurrency_limits_for("t", "r", "u", "low", "java") == {"queue:java": 3}
    assert only_queue.concurrency_limits_for("t", "r", "u", "low", "go") == {}


def test_a_zero_limit_is_kept_not_dropped() -> None:
    policy = parse_policy("[tenants.paused]\nmax_active = 0")
    assert policy.concurrency_limits_for("paused", "r", None, "low", "q") == {"tenant:paused": 0}


def test_retry_policy_overrides_only_what_the_policy_says() -> None:
    base = RetryPolicy(base_seconds=5, max_seconds=50, max_attempts=9, max_cost_usd=1.0)
    assert Policy.default().retry_policy(base) == base
    applied = parse_policy(FULL).retry_policy(base)
    assert (applied.base_seconds, applied.max_seconds) == (10.0, 600.0)
    assert applied.max_attempts == 4  # defaults.max_attempts
    assert applied.max_cost_usd == 1.0  # untouched
    assert applied.retryable == base.retryable


# --- document and digest ----------------------------------------------------------------


def test_the_document_fills_defaults_and_parses_back() -> None:
    policy = parse_policy(FULL)
    document = policy_document(policy)
    assert document["defaults"]["limits"]["max_diff_lines"] is None
    assert document["tenants"]["web"]["weight"] == 1.0
    assert document["repositories"][1]["requires"] == {"jdk": ">=21", "tools": ["git", "maven"]}
    again = policy_from_document(document)
    assert again == policy
    assert policy_digest(again) == policy_digest(policy)
    example = load_policy(EXAMPLE)
    assert policy_from_document(policy_document(example)) == example


def test_a_bad_document_is_a_policy_error() -> None:
    with pytest.raises(PolicyInvalid, match=r"^stored: tenants.a.weight: "):
        policy_from_document({"tenants": {"a": {"weight": 0}}}, source="stored")


REFORMATTED = """
# same policy, different spelling and order
[[repositories]]
match = "*/payments-*"
message = "analysis only"
autonomous_agents = false
risk_class = "high"

[[repositories]]
limits.max_cost_usd = 2
requires.tools = ["maven", "git"]
requires.jdk = ">=21.0.0"
max_active = 1
max_attempts = 2
queue = "java"
match = "*/java-*"

[[rules]]
message = "suspended"
reason_code = "TENANT_SUSPENDED"
action = "deny"
when.queue = "*"
when.tenant = "contractors"

[tenants.web]
max_queued = 3
weight = 1.0

[tenants.platform-team]
allowed_risk_classes = ["low", "medium", "low"]
daily_model_budget_usd = 200.0
max_queued = 500
max_active = 7
weight = 2.0

[retry]
max_seconds = 600.0
base_seconds = 10.0

[concurrency]
per_queue_max_active = { java = 8 }
per_risk_class_max_active = { high = 10 }
per_user_max_active = 5
per_repository_max_active = 2
per_tenant_max_active = 20
global_max_active = 200

[defaults]
requires = { tools = "git" }
limits = { max_cost_usd = 5.0, max_wall_clock_minutes = 45.0 }
risk_class = "medium"
max_attempts = 4
priority = 50
queue = "default"
"""


def test_the_digest_ignores_formatting_and_table_order() -> None:
    text = "allow_unknown_tenants = false\n" + REFORMATTED
    assert policy_digest(parse_policy(text)) == policy_digest(parse_policy(FULL))
    assert re.fullmatch(r"[0-9a-f]{64}", policy_digest(parse_policy(FULL)))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('weight = 2\n', 'weight = 3\n'),
        ('global_max_active = 200', 'global_max_active = 201'),
        ('jdk = ">=21"', 'jdk = ">21"'),
        ('message = "suspended"', 'message = "suspended!"'),
        ('allow_unknown_tenants = false', 'allow_unknown_tenants = true'),
    ],
)
def test_the_digest_changes_when_the_policy_does(old: str, new: str) -> None:
    assert old in FULL
    changed = FULL.replace(old, new, 1)
    assert policy_digest(parse_policy(changed)) != policy_digest(parse_policy(FULL))


def test_the_order_of_repository_rules_changes_the_digest() -> None:
    a = "[[repositories]]\nmatch = 'a*'\nqueue = 'x'\n[[repositories]]\nmatch = '*'\n"
    b = "[[repositories]]\nmatch = '*'\n[[repositories]]\nmatch = 'a*'\nqueue = 'x'\n"
    assert policy_digest(parse_policy(a)) != policy_digest(parse_policy(b))


def test_the_empty_policy_has_a_stable_digest() -> None:
    assert policy_digest(Policy.default()) == policy_digest(parse_policy("# nothing\n"))
    assert policy_digest(Policy.default()) != policy_digest(
        parse_policy("allow_unknown_tenants = false"))


_names = st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)


@given(st.dictionaries(_names, st.tuples(st.integers(1, 50), st.integers(0, 100)), max_size=6),
       st.randoms())
def test_digest_is_independent_of_tenant_order(
    tenants: dict[str, tuple[int, int]], rnd: random.Random
) -> None:
    def render(items: list[tuple[str, tuple[int, int]]]) -> str:
        return "".join(f"[tenants.{name}]\nweight = {w}\nmax_queued = {q}\n"
                       for name, (w, q) in items)

    items = list(tenants.items())
    shuffled = list(items)
    rnd.shuffle(shuffled)
    first, second = parse_policy(render(items)), parse_policy(render(shuffled))
    assert policy_digest(first) == policy_digest(second)
    assert {t: p.weight for t, p in first.tenants.items()} == {
        t: float(w) for t, (w, _) in tenants.items()}


def test_requirements_in_the_document_are_canonical() -> None:
    a = parse_policy("[defaults.requires]\ntools = 'maven,git'\njdk = '>=17,>=21'")
    b = parse_policy("[defaults.requires]\njdk = '>=21.0'\ntools = ['git', 'maven']")
    assert policy_digest(a) == policy_digest(b)
    assert canonical_requirements(a.defaults.requires) == '{"jdk":">=21","tools":["git","maven"]}'
