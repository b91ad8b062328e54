"""Capability routing: parsing, matching, canonical route keys and merging."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runlane.domain.routing import (
    VERSION_OPS,
    AtLeast,
    CapabilityValue,
    Equals,
    Includes,
    Requirement,
    VersionConstraint,
    Versions,
    _version_ok,
    canonical_capabilities,
    canonical_requirements,
    merge_requirements,
    parse_capabilities,
    parse_capability,
    parse_requirement,
    parse_requirements,
    parse_version,
    requirement_text,
    requirements_from_canonical,
    satisfies,
    unmet,
)


def req(*texts: str) -> dict[str, Requirement]:
    return parse_requirements(list(texts))


def caps(*texts: str) -> dict[str, CapabilityValue]:
    return parse_capabilities(list(texts))


# --- parsing requirements ---------------------------------------------------------------


def test_each_kind_parses_from_its_cli_spelling() -> None:
    assert parse_requirement("language=java") == ("language", Equals("java"))
    assert parse_requirement("tools=git,maven") == (
        "tools", Includes(frozenset({"git", "maven"})))
    assert parse_requirement("workspace_gb=12") == ("workspace_gb", AtLeast(12.0))
    assert parse_requirement("jdk>=21") == (
        "jdk", Versions((VersionConstraint(">=", (21,)),)))
    assert parse_requirement("jdk==21.0.1") == (
        "jdk", Versions((VersionConstraint("==", (21, 0, 1)),)))


@pytest.mark.parametrize("op", [">=", ">", "<=", "<", "==", "!="])
def test_every_version_operator_parses(op: str) -> None:
    key, parsed = parse_requirement(f"jdk{op}17")
    assert key == "jdk"
    assert parsed == Versions((VersionConstraint(op, (17,)),))


def test_spaces_around_key_operator_and_value_are_ignored() -> None:
    assert parse_requirement(" jdk >= 21 ") == parse_requirement("jdk>=21")
    assert parse_requirement("tools = git , maven") == parse_requirement("tools=git,maven")


def test_an_equals_sign_before_an_operator_reads_as_the_operator() -> None:
    # The mapping form {"jdk": ">=21"} and `--require jdk=>=21` mean the same.
    assert parse_requirement("jdk=>=21") == parse_requirement("jdk>=21")
    assert parse_requirement("jdk===21") == parse_requirement("jdk==21")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (">=21", "empty key"),
        ("=java", "empty key"),
        ("jdk", "expected KEY=VALUE"),
        ("jdk>=2x", "'2x' is not a version"),
        ("jdk>=21.", "is not a version"),
        ("jdk<>21", "bad operator '<>'"),
        ("jdk=<>21", "bad operator '=<>'"),
        ("jdk=!21", "bad operator '=!'"),
        ("jdk>=", "has no version after it"),
        ("jdk>=17,22", "'22' has no operator"),
        ("jdk=", "empty value"),
        ("tools=git,,maven", "has an empty item"),
        ("a b=1", "key 'a b' may only contain"),
        ("kéy=1", "may only contain"),
        ("jdk>=21,<=17", "no version satisfies"),
        ("jdk==17,==21", "no version satisfies"),
    ],
)
def test_bad_requirements_name_the_text_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_requirement(text)
    message = str(caught.value)
    assert message.startswith(f"requirement {text!r}") or f"{text!r}" in message
    assert problem in message
    assert "\n" not in message


def test_mapping_form_of_a_jsonl_task() -> None:
    parsed = parse_requirements(
        {"tools": ["git", "maven"], "jdk": ">=21", "workspace_gb": 12, "language": "java",
         "needs_network": False}
    )
    assert parsed == {
        "tools": Includes(frozenset({"git", "maven"})),
        "jdk": Versions((VersionConstraint(">=", (21,)),)),
        "workspace_gb": AtLeast(12.0),
        "language": Equals("java"),
        "needs_network": Equals("false"),
    }


@pytest.mark.parametrize(
    ("mapping", "problem"),
    [
        ({"tools": []}, "empty list"),
        ({"tools": ["git", ""]}, "non-empty string"),
        ({"tools": ["a,b"]}, "without commas"),
        ({"x": None}, "is not a string, number, boolean or list"),
        ({"x": {"a": 1}}, "is not a string, number, boolean or list"),
        ({"x": float("inf")}, "not a finite number"),
        ({"": "java"}, "empty key"),
        ({"jdk": ">=abc"}, "not a version"),
    ],
)
def test_bad_mapping_values_are_refused(mapping: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match="requirement") as caught:
        parse_requirements(mapping)
    assert problem in str(caught.value)


def test_a_bare_string_is_not_a_list_of_requirements() -> None:
    with pytest.raises(ValueError, match="expected a mapping or a list"):
        parse_requirements("jdk>=21")


def test_repeated_cli_requirements_merge() -> None:
    assert req("jdk>=17", "jdk<22") == req("jdk>=17,<22")
    assert req("workspace_gb=8", "workspace_gb=12") == req("workspace_gb=12")
    # A plain value repeated accumulates into a set, as a repeated capability does.
    assert req("tools=git", "tools=maven") == {"tools": Includes(frozenset({"git", "maven"}))}
    assert req("tools=git", "tools=git") == {"tools": Equals("git")}
    with pytest.raises(ValueError, match="no version satisfies"):
        req("jdk>=21", "jdk<17")


def test_versions_compare_as_integer_tuples_and_ignore_trailing_zeros() -> None:
    assert parse_version("21") == parse_version("21.0.0")
    assert parse_version("21.0.10") > parse_version("21.0.9")  # not a string comparison
    assert parse_version("9") < parse_version("21")
    with pytest.raises(ValueError, match="not a version"):
        parse_version("21-ea")


# --- capabilities -----------------------------------------------------------------------


def test_capability_parsing() -> None:
    assert parse_capability("jdk=21.0.2") == ("jdk", "21.0.2")
    assert parse_capability("tools=git,maven") == ("tools", frozenset({"git", "maven"}))
    assert parse_capability("workspace_gb = 40") == ("workspace_gb", "40")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("jdk", "expected KEY=VALUE"),
        ("=21", "empty key"),
        ("jdk=", "empty value"),
        ("jdk>=21", "comparisons belong to requirements"),
        ("jdk==21", "comparisons belong to requirements"),
        ("a b=1", "may only contain"),
        ("tools=git,", "has an empty item"),
    ],
)
def test_bad_capabilities_name_the_text_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_capability(text)
    assert f"capability {text!r}" in str(caught.value)
    assert problem in str(caught.value)


def test_a_capability_given_twice_holds_both_values() -> None:
    assert caps("jdk=17", "jdk=21") == {"jdk": frozenset({"17", "21"})}
    assert caps("tools=git", "tools=maven,rg") == {"tools": frozenset({"git", "maven", "rg"})}


def test_capabilities_from_a_mapping() -> None:
    parsed = parse_capabilities(
        {"jdk": "21.0.2", "tools": ["git", "maven"], "workspace_gb": 40, "gpu": False,
         "langs": "java,go"}
    )
    assert parsed == {
        "jdk": "21.0.2",
        "tools": frozenset({"git", "maven"}),
        "workspace_gb": "40",
        "gpu": "false",
        "langs": frozenset({"java", "go"}),
    }
    with pytest.raises(ValueError, match="capability 'x'"):
        parse_capabilities({"x": None})
    with pytest.raises(ValueError, match="empty list"):
        parse_capabilities({"x": []})


def test_canonical_capabilities_is_order_independent() -> None:
    assert canonical_capabilities(caps("tools=maven,git", "jdk=21")) == canonical_capabilities(
        caps("jdk=21", "tools=git,maven")
    ) == '{"jdk":"21","tools":["git","maven"]}'


# --- matching ---------------------------------------------------------------------------


def test_equality_matches_the_value_or_set_membership() -> None:
    need = req("language=java")
    assert satisfies(need, caps("language=java"))
    assert satisfies(need, caps("language=go,java"))
    assert not satisfies(need, caps("language=go"))
    assert unmet(need, caps("language=go,kotlin")) == ["language=java: worker has go,kotlin"]


def test_sets_must_be_a_subset_of_the_workers() -> None:
    need = req("tools=git,maven")
    assert satisfies(need, caps("tools=git,maven,ripgrep"))
    assert not satisfies(need, caps("tools=git"))
    assert unmet(need, caps("tools=git")) == ["tools: worker lacks maven"]
    assert unmet(need, caps("tools=rg")) == ["tools: worker lacks git, maven"]


def test_numbers_are_at_least() -> None:
    need = req("workspace_gb=12")
    assert satisfies(need, caps("workspace_gb=12"))
    assert satisfies(need, caps("workspace_gb=40"))
    assert satisfies(need, caps("workspace_gb=12.5"))
    assert not satisfies(need, caps("workspace_gb=8"))
    assert unmet(need, caps("workspace_gb=8")) == ["workspace_gb>=12: worker has 8"]
    assert unmet(need, caps("workspace_gb=big")) == [
        "workspace_gb>=12: worker has big, not a number"]


@pytest.mark.parametrize(
    ("requirement", "worker", "ok"),
    [
        ("jdk>=21", "21.0.2", True),
        ("jdk>=21", "21", True),
        ("jdk>=21", "17.0.2", False),
        ("jdk>21", "21.0.0", False),
        ("jdk>21", "21.0.1", True),
        ("jdk<=17", "17.0.0", True),
        ("jdk<=17", "17.0.1", False),
        ("jdk<17", "11", True),
        ("jdk<17", "17", False),
        ("jdk==21.0.1", "21.0.1", True),
        ("jdk==21.0.1", "21.0.2", False),
        ("jdk==21", "21.0.0", True),
        ("jdk!=8", "8.0", False),
        ("jdk!=8", "11", True),
        ("jdk>=17,<22", "21.0.9", True),
        ("jdk>=17,<22", "22", False),
        ("jdk>=21", "21.0.10", True),
        ("jdk>21.0.9", "21.0.10", True),  # 10 > 9: integers, not text
    ],
)
def test_versions(requirement: str, worker: str, ok: bool) -> None:
    assert satisfies(req(requirement), {"jdk": worker}) is ok


def test_version_unmet_messages() -> None:
    assert unmet(req("jdk>=21"), caps("jdk=17.0.2")) == ["jdk>=21: worker has 17.0.2"]
    assert unmet(req("jdk>=21"), caps("jdk=temurin")) == [
        "jdk>=21: worker has temurin, not a version"]


def test_a_worker_with_several_versions_matches_when_one_does() -> None:
    assert satisfies(req("jdk>=21"), caps("jdk=17,21.0.2"))
    assert not satisfies(req("jdk>=21,<22"), caps("jdk=17,22"))


def test_an_undeclared_capability_is_unmet_and_reasons_are_sorted_by_key() -> None:
    reasons = unmet(req("gpu=true", "jdk>=21", "tools=git"), caps("tools=git"))
    assert reasons == ["gpu: worker does not declare it", "jdk: worker does not declare it"]


def test_no_requirements_match_every_worker() -> None:
    assert satisfies({}, {})
    assert unmet({}, caps("jdk=21")) == []


def test_the_full_example_of_the_seed() -> None:
    need = parse_requirements(
        {"language": "java", "jdk": ">=21", "build_tools": ["maven"], "needs_network": False,
         "workspace_gb": 12, "model_provider": "openai", "sandbox_profile": "restricted"}
    )
    worker = parse_capabilities(
        ["language=java,kotlin", "jdk=21.0.2", "build_tools=maven,gradle", "needs_network=false",
         "workspace_gb=40", "model_provider=openai", "sandbox_profile=restricted"]
    )
    assert satisfies(need, worker)
    small = {**worker, "workspace_gb": "8", "needs_network": "true"}
    assert unmet(need, small) == [
        "needs_network=false: worker has true", "workspace_gb>=12: worker has 8"]


# --- canonical route key ----------------------------------------------------------------


def test_equivalent_spellings_give_the_same_route_key() -> None:
    spellings = [
        req("tools=maven,git", "jdk>=21.0", "workspace_gb=12", "language=java"),
        req("language=java", "workspace_gb=12.0", "jdk=>=21", "tools=git,maven"),
        req("jdk>=17", "jdk>=21", "tools=git", "tools=maven", "workspace_gb=8",
            "workspace_gb=12", "language=java"),
        parse_requirements({"jdk": ">=21.0.0", "tools": ["maven", "git", "git"],
                            "workspace_gb": 12, "language": "java"}),
    ]
    keys = {canonical_requirements(s) for s in spellings}
    assert keys == {'{"jdk":">=21","language":"java","tools":["git","maven"],"workspace_gb":12}'}


def test_different_requirements_give_different_route_keys() -> None:
    assert canonical_requirements(req("jdk>=21")) != canonical_requirements(req("jdk>21"))
    assert canonical_requirements(req("x=12")) != canonical_requirements(req("x=12.5"))


def test_no_requirements_is_the_empty_route_key() -> None:
    assert canonical_requirements({}) == ""
    assert requirements_from_canonical("") == {}


def test_redundant_version_constraints_are_normalised() -> None:
    assert canonical_requirements(req("jdk>=21,<=21")) == '{"jdk":"==21"}'
    assert canonical_requirements(req("jdk>=21,!=8,!=22")) == '{"jdk":">=21,!=22"}'
    assert canonical_requirements(req("jdk>=21,>21")) == '{"jdk":">21"}'
    assert canonical_requirements(req("jdk<22,<=22")) == '{"jdk":"<22"}'
    assert canonical_requirements(req("jdk==21,>=17")) == '{"jdk":"==21"}'


def test_bad_route_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        requirements_from_canonical("{jdk")
    with pytest.raises(ValueError, match="not a JSON object"):
        requirements_from_canonical("[1]")


def test_requirement_text_reads_like_the_cli() -> None:
    assert [requirement_text(k, v) for k, v in sorted(
        req("jdk>=17,<22", "tools=maven,git", "workspace_gb=12", "language=java").items())] == [
        "jdk>=17,<22", "language=java", "tools=git,maven", "workspace_gb>=12"]


_word = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)
_version = st.lists(st.integers(0, 30), min_size=1, max_size=4).map(
    lambda parts: ".".join(map(str, parts)))
_requirement: st.SearchStrategy[object] = st.one_of(
    _word,
    st.lists(_word, min_size=1, max_size=4),
    st.integers(0, 10_000),
    st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.tuples(st.sampled_from([">=", ">", "<=", "<", "!="]), _version).map("".join),
)


@given(st.dictionaries(_word, _requirement, max_size=6))
def test_canonical_round_trip(mapping: dict[str, object]) -> None:
    parsed = parse_requirements(mapping)
    key = canonical_requirements(parsed)
    assert requirements_from_canonical(key) == parsed
    assert canonical_requirements(requirements_from_canonical(key)) == key


@given(st.dictionaries(_word, _requirement, max_size=6), st.randoms())
def test_route_key_ignores_order(mapping: dict[str, object], rnd: random.Random) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    shuffled = {k: (list(reversed(v)) if isinstance(v, list) else v) for k, v in items}
    assert canonical_requirements(parse_requirements(shuffled)) == canonical_requirements(
        parse_requirements(mapping))


# --- merging ----------------------------------------------------------------------------


def test_task_requirements_add_to_the_policys() -> None:
    merged = merge_requirements(req("tools=git"), req("language=java"))
    assert merged == req("tools=git", "language=java")


def test_merge_keeps_the_stricter_of_two_on_one_key() -> None:
    assert merge_requirements(req("workspace_gb=12"), req("workspace_gb=8")) == req(
        "workspace_gb=12")
    assert merge_requirements(req("workspace_gb=8"), req("workspace_gb=12")) == req(
        "workspace_gb=12")
    assert merge_requirements(req("tools=git,maven"), req("tools=rg,git")) == req(
        "tools=git,maven,rg")
    assert merge_requirements(req("jdk>=17"), req("jdk<22")) == req("jdk>=17,<22")
    assert merge_requirements(req("jdk>=17"), req("jdk>=21")) == req("jdk>=21")
    assert merge_requirements(req("language=java"), req("language=java")) == req(
        "language=java")
    assert merge_requirements(req("tools=git,maven"), req("tools=rg")) == {
        "tools": Includes(frozenset({"git", "maven", "rg"}))}


def test_merge_does_not_modify_its_inputs() -> None:
    base = req("tools=git,maven")
    merged = merge_requirements(base, req("tools=rg", "jdk>=21"))
    assert base == req("tools=git,maven")
    assert merged == req("tools=git,maven,rg", "jdk>=21")


@pytest.mark.parametrize(
    ("base", "extra", "problem"),
    [
        ("language=java", "language=go", "language=java conflicts with language=go"),
        ("jdk>=21", "jdk<=17", "no version satisfies >=21,<=17"),
        ("jdk==21", "jdk==17", "no version satisfies"),
        ("jdk==21", "jdk!=21", "no version satisfies"),
        ("jdk>21", "jdk<=21", "no version satisfies"),
        ("workspace_gb=12", "workspace_gb>=12", "conflicts with"),
        ("workspace_gb=12", "workspace_gb=big", "conflicts with"),
    ],
)
def test_merge_conflicts(base: str, extra: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        merge_requirements(req(base), req(extra))
    key = re.match(r"[a-z_]+", base).group()  # type: ignore[union-attr]
    assert f"requirement {key!r}" in str(caught.value)
    assert problem in str(caught.value)


def test_a_list_is_open_to_additions_a_plain_value_is_not() -> None:
    listed = merge_requirements(parse_requirements({"tools": ["git"]}),
                                parse_requirements({"tools": "maven"}))
    assert listed == {"tools": Includes(frozenset({"git", "maven"}))}
    with pytest.raises(ValueError, match="sandbox=restricted conflicts with sandbox=open"):
        merge_requirements(parse_requirements({"sandbox": "restricted"}),
                           parse_requirements({"sandbox": "open"}))
    # Both still match a worker the same way.
    worker = caps("tools=git,rg")
    assert satisfies(parse_requirements({"tools": ["git"]}), worker)
    assert satisfies(parse_requirements({"tools": "git"}), worker)


def _tuple_order(version: tuple[int, ...], op: str, bound: tuple[int, ...]) -> bool:
    """The comparison runlane made before packaging.specifiers: integer tuples."""
    return {">=": version >= bound, ">": version > bound, "<=": version <= bound,
            "<": version < bound, "==": version == bound, "!=": version != bound}[op]


_DOTTED = st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=4).map(
    lambda parts: ".".join(map(str, parts)))


@given(version=_DOTTED, op=st.sampled_from(VERSION_OPS), bound=_DOTTED)
def test_specifiers_compare_dotted_integers_as_integer_tuples(
        version: str, op: str, bound: str) -> None:
    """Version constraints go through packaging.specifiers (PEP 440); on runlane's
    versions (dotted integers, trailing zeros ignored) every operator answers what
    the comparison of integer tuples answered."""
    v, b = parse_version(version), parse_version(bound)
    assert _version_ok(v, VersionConstraint(op, b)) is _tuple_order(v, op, b)
