"""Capability routing (seed 000 §17): what a run requires, what a worker offers.

A run's requirements are normalised once, at admission, into a canonical text
(the route key). Equivalent spellings give the same key, so runs that need the
same kind of worker group together and a worker matches a key, not a prompt.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from packaging.specifiers import Specifier

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
_VERSION = re.compile(r"^\d+(?:\.\d+)*$")
_NUMBER = re.compile(r"^[+-]?\d+(?:\.\d+)?$")
_OP_CHARS = "<>=!"
VERSION_OPS: tuple[str, ...] = (">=", ">", "<=", "<", "==", "!=")

Version = tuple[int, ...]
CapabilityValue = str | frozenset[str]


@dataclass(frozen=True)
class Equals:
    """The worker's value is this one (or, for a set, contains it)."""

    value: str


@dataclass(frozen=True)
class Includes:
    """The worker's set contains every one of these."""

    values: frozenset[str]


@dataclass(frozen=True)
class AtLeast:
    """The worker's number is at least this."""

    number: float


@dataclass(frozen=True)
class VersionConstraint:
    op: str
    version: Version


@dataclass(frozen=True)
class Versions:
    """Every constraint holds; always normalised (see ``_normalise``), never empty."""

    constraints: tuple[VersionConstraint, ...]


Requirement = Equals | Includes | AtLeast | Versions


# --- small helpers ---------------------------------------------------------------------


def _check_key(key: str, what: str, text: str) -> str:
    key = key.strip()
    if not key:
        raise ValueError(f"{what} {text!r}: empty key")
    if not KEY_PATTERN.match(key):
        raise ValueError(
            f"{what} {text!r}: key {key!r} may only contain letters, digits, '_', '.' and '-'"
        )
    return key


def parse_version(text: str) -> Version:
    """Dotted integers; trailing zeros dropped so that 21 == 21.0 == 21.0.0."""
    text = text.strip()
    if not _VERSION.match(text):
        raise ValueError(f"{text!r} is not a version (dotted integers like 21 or 21.0.2)")
    parts = [int(p) for p in text.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def format_version(version: Version) -> str:
    return ".".join(str(p) for p in version) if version else "0"


def format_number(number: float) -> str:
    return str(int(number)) if float(number).is_integer() else repr(float(number))


def _json_number(number: float) -> int | float:
    return int(number) if float(number).is_integer() else float(number)


def _parse_number(text: str) -> float | None:
    return float(text) if _NUMBER.match(text.strip()) else None


@functools.lru_cache(maxsize=4096)
def _specifier(op: str, version: Version) -> Specifier:
    return Specifier(f"{op}{format_version(version)}")


def _version_ok(version: Version, c: VersionConstraint) -> bool:
    """``version`` meets ``c``, as ``packaging.specifiers`` (PEP 440) compares them. On
    runlane's versions (dotted integers, no pre-, post- or local part) that is the
    order of their integer tuples, trailing zeros ignored (tests/test_routing.py
    checks the two agree)."""
    return _specifier(c.op, c.version).contains(format_version(version), prereleases=True)


def format_constraints(versions: Versions) -> str:
    return ",".join(f"{c.op}{format_version(c.version)}" for c in versions.constraints)


def _normalise(constraints: Iterable[VersionConstraint]) -> Versions:
    """Keep the strictest bounds, drop redundant ones, refuse an empty range.

    Normalising is what makes ``>=17,>=21`` and ``>=21`` the same route key.
    """
    given = list(constraints)
    spelled = ",".join(f"{c.op}{format_version(c.version)}" for c in given)
    conflict = ValueError(f"no version satisfies {spelled}")
    equal = {c.version for c in given if c.op == "=="}
    lowers = [c for c in given if c.op in (">=", ">")]
    uppers = [c for c in given if c.op in ("<=", "<")]
    # Lower bound: a higher version is stricter; at the same version ">" is stricter.
    lower = max(lowers, key=lambda c: (c.version, c.op == ">"), default=None)
    upper = min(uppers, key=lambda c: (c.version, c.op == "<="), default=None)
    bounds = [c for c in (lower, upper) if c is not None]
    if lower and upper and lower.version == upper.version and (lower.op, upper.op) == (">=", "<="):
        equal.add(lower.version)  # >=v,<=v is ==v
    if len(equal) > 1:
        raise conflict
    if equal:
        (only,) = equal
        if not all(_version_ok(only, c) for c in given):
            raise conflict
        return Versions((VersionConstraint("==", only),))
    if lower and upper and (
        lower.version > upper.version
        or (lower.version == upper.version and (lower.op == ">" or upper.op == "<"))
    ):
        raise conflict
    # An excluded version outside the bounds excludes nothing more: drop it.
    excluded = sorted({c.version for c in given if c.op == "!="
                       and all(_version_ok(c.version, b) for b in bounds)})
    return Versions(tuple(bounds) + tuple(VersionConstraint("!=", v) for v in excluded))


def _parse_constraints(text: str) -> Versions:
    constraints = []
    for item in text.split(","):
        item = item.strip()
        i = 0
        while i < len(item) and item[i] in _OP_CHARS:
            i += 1
        op, rest = item[:i], item[i:].strip()
        if not op:
            raise ValueError(f"{item!r} has no operator (use one of {', '.join(VERSION_OPS)})")
        if op not in VERSION_OPS:
            raise ValueError(f"bad operator {op!r} (use one of {', '.join(VERSION_OPS)})")
        if not rest:
            raise ValueError(f"{op!r} has no version after it")
        constraints.append(VersionConstraint(op, parse_version(rest)))
    return _normalise(constraints)


def _parse_equals_value(value: str) -> Requirement:
    """The value of ``KEY=VALUE``: a list, a number, version constraints, or a string."""
    value = value.strip()
    if not value:
        raise ValueError("empty value")
    if value[0] in _OP_CHARS:
        return _parse_constraints(value)
    if "," in value:
        items = [v.strip() for v in value.split(",")]
        if not all(items):
            raise ValueError(f"{value!r} has an empty item")
        return Includes(frozenset(items))
    number = _parse_number(value)
    if number is not None:
        return AtLeast(number)
    return Equals(value)


# --- parsing ---------------------------------------------------------------------------


def parse_requirement(text: str) -> tuple[str, Requirement]:
    """``language=java``, ``tools=git,maven``, ``workspace_gb=12``, ``jdk>=21``, ``jdk>=17,<22``."""
    at = next((i for i, ch in enumerate(text) if ch in _OP_CHARS), None)
    if at is None:
        raise ValueError(f"requirement {text!r}: expected KEY=VALUE or KEY>=VERSION")
    key = _check_key(text[:at], "requirement", text)
    rest = text[at:]
    end = at
    while end < len(text) and text[end] in _OP_CHARS:
        end += 1
    op = text[at:end]
    try:
        if op == "=" or (op.startswith("=") and op[1:] in VERSION_OPS):
            return key, _parse_equals_value(rest[1:])
        if op in VERSION_OPS:
            return key, _parse_constraints(rest)
        raise ValueError(f"bad operator {op!r} (use =, or one of {', '.join(VERSION_OPS)})")
    except ValueError as exc:
        raise ValueError(f"requirement {text!r}: {exc}") from None


def parse_requirement_value(value: object) -> Requirement:
    """One value of a ``requires`` table (JSON Lines task or policy file)."""
    if isinstance(value, bool):
        return Equals("true" if value else "false")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        return AtLeast(float(value))
    if isinstance(value, str):
        return _parse_equals_value(value)
    if isinstance(value, list | tuple | set | frozenset):
        items = [_scalar_text(v) for v in value]
        if not items:
            raise ValueError("empty list")
        return Includes(frozenset(items))
    raise ValueError(f"{value!r} is not a string, number, boolean or list of strings")


def _scalar_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float) and math.isfinite(value):
        return format_number(value)
    if isinstance(value, str) and value.strip() and "," not in value:
        return value.strip()
    raise ValueError(f"list item {value!r} must be a non-empty string without commas")


def parse_requirements(
    source: Mapping[str, object] | Iterable[str],
) -> dict[str, Requirement]:
    """A mapping ``{"jdk": ">=21", "tools": ["git"]}``, or ``KEY=VALUE`` texts.

    Texts on one key combine: plain values into a set, the rest as in
    ``merge_requirements``.
    """
    if isinstance(source, str):
        raise ValueError(f"requirements {source!r}: expected a mapping or a list")
    if isinstance(source, Mapping):
        out: dict[str, Requirement] = {}
        for raw_key, value in source.items():
            key = _check_key(str(raw_key), "requirement", str(raw_key))
            try:
                out[key] = parse_requirement_value(value)
            except ValueError as exc:
                raise ValueError(f"requirement {key!r}: {exc}") from None
        return out
    merged: dict[str, Requirement] = {}
    for text in source:
        key, req = parse_requirement(text)
        before = merged.get(key)
        if isinstance(before, Equals) and isinstance(req, Equals) and before != req:
            # A flag repeated accumulates, as for capabilities: tools=git tools=maven.
            merged[key] = Includes(frozenset({before.value, req.value}))
        else:
            merged = merge_requirements(merged, {key: req})
    return merged


def parse_capability(text: str) -> tuple[str, CapabilityValue]:
    """``jdk=21.0.2``, ``tools=git,maven``, ``workspace_gb=40``."""
    key_text, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"capability {text!r}: expected KEY=VALUE")
    if any(ch in _OP_CHARS for ch in key_text) or value.startswith(("=", ">", "<")):
        raise ValueError(
            f"capability {text!r}: a capability is KEY=VALUE (comparisons belong to requirements)"
        )
    key = _check_key(key_text, "capability", text)
    value = value.strip()
    if not value:
        raise ValueError(f"capability {text!r}: empty value")
    if "," in value:
        items = [v.strip() for v in value.split(",")]
        if not all(items):
            raise ValueError(f"capability {text!r}: {value!r} has an empty item")
        return key, frozenset(items)
    return key, value


def parse_capabilities(
    source: Mapping[str, object] | Iterable[str],
) -> dict[str, CapabilityValue]:
    """A mapping, or ``KEY=VALUE`` texts; a key given twice holds both values (a set)."""
    if isinstance(source, str):
        raise ValueError(f"capabilities {source!r}: expected a mapping or a list")
    pairs: list[tuple[str, CapabilityValue]] = []
    if isinstance(source, Mapping):
        for raw_key, value in source.items():
            key = _check_key(str(raw_key), "capability", str(raw_key))
            try:
                if isinstance(value, list | tuple | set | frozenset):
                    if not value:
                        raise ValueError("empty list")
                    pairs.append((key, frozenset(_scalar_text(v) for v in value)))
                elif isinstance(value, str):
                    pairs.append(parse_capability(f"{key}={value}"))
                else:
                    pairs.append((key, _scalar_text(value)))
            except ValueError as exc:
                raise ValueError(f"capability {key!r}: {exc}") from None
    else:
        pairs = [parse_capability(text) for text in source]
    out: dict[str, CapabilityValue] = {}
    for key, value in pairs:
        if key in out:
            out[key] = _as_set(out[key]) | _as_set(value)
        else:
            out[key] = value
    return out


def _as_set(value: CapabilityValue) -> frozenset[str]:
    return value if isinstance(value, frozenset) else frozenset({value})


# --- canonical form --------------------------------------------------------------------


def requirement_value(req: Requirement) -> str | int | float | list[str]:
    """The ``requires`` table value that parses back to ``req``."""
    match req:
        case Equals(value):
            return value
        case Includes(values):
            return sorted(values)
        case AtLeast(number):
            return _json_number(number)
        case Versions():
            return format_constraints(req)
    raise TypeError(f"not a requirement: {req!r}")  # pragma: no cover


def requirements_to_mapping(reqs: Mapping[str, Requirement]) -> dict[str, object]:
    return {key: requirement_value(reqs[key]) for key in sorted(reqs)}


def canonical_requirements(reqs: Mapping[str, Requirement]) -> str:
    """The route key: compact JSON with sorted keys and sets; ``""`` for none."""
    if not reqs:
        return ""
    return json.dumps(requirements_to_mapping(reqs), sort_keys=True, separators=(",", ":"))


def requirements_from_canonical(text: str) -> dict[str, Requirement]:
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"route key {text!r}: not JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"route key {text!r}: not a JSON object")
    return parse_requirements(data)


def canonical_capabilities(caps: Mapping[str, CapabilityValue]) -> str:
    """A worker's capabilities as compact JSON (sets sorted), for storing and comparing."""
    return json.dumps(
        {k: sorted(v) if isinstance(v, frozenset) else v for k, v in caps.items()},
        sort_keys=True,
        separators=(",", ":"),
    )


def requirement_text(key: str, req: Requirement) -> str:
    """How a requirement reads on the command line (``jdk>=21``, ``tools=git,maven``)."""
    match req:
        case Versions():
            return f"{key}{format_constraints(req)}"
        case Includes(values):
            return f"{key}={','.join(sorted(values))}"
        case AtLeast(number):
            return f"{key}>={format_number(number)}"
        case Equals(value):
            return f"{key}={value}"
    raise TypeError(f"not a requirement: {req!r}")  # pragma: no cover


# --- matching --------------------------------------------------------------------------


def _shown(value: CapabilityValue) -> str:
    return ",".join(sorted(value)) if isinstance(value, frozenset) else value


def _unmet_one(key: str, req: Requirement, have: CapabilityValue) -> str | None:
    values = _as_set(have)
    match req:
        case Equals(value):
            return None if value in values else f"{key}={value}: worker has {_shown(have)}"
        case Includes(wanted):
            missing = sorted(wanted - values)
            return None if not missing else f"{key}: worker lacks {', '.join(missing)}"
        case AtLeast(number):
            numbers = [n for n in (_parse_number(v) for v in values) if n is not None]
            if not numbers:
                return f"{key}>={format_number(number)}: worker has {_shown(have)}, not a number"
            if any(n >= number for n in numbers):
                return None
            return f"{key}>={format_number(number)}: worker has {_shown(have)}"
        case Versions(constraints):
            spec = f"{key}{format_constraints(req)}"
            versions = []
            for v in values:
                try:
                    versions.append(parse_version(v))
                except ValueError:
                    continue
            if not versions:
                return f"{spec}: worker has {_shown(have)}, not a version"
            if any(all(_version_ok(v, c) for c in constraints) for v in versions):
                return None
            return f"{spec}: worker has {_shown(have)}"
    raise TypeError(f"not a requirement: {req!r}")  # pragma: no cover


def unmet(
    reqs: Mapping[str, Requirement], capabilities: Mapping[str, CapabilityValue]
) -> list[str]:
    """Why a worker cannot run this, one line per unmet requirement (sorted by key)."""
    reasons = []
    for key in sorted(reqs):
        if key not in capabilities:
            reasons.append(f"{key}: worker does not declare it")
            continue
        reason = _unmet_one(key, reqs[key], capabilities[key])
        if reason is not None:
            reasons.append(reason)
    return reasons


def satisfies(
    reqs: Mapping[str, Requirement], capabilities: Mapping[str, CapabilityValue]
) -> bool:
    return not unmet(reqs, capabilities)


# --- merging ---------------------------------------------------------------------------


def _combine(key: str, a: Requirement, b: Requirement) -> Requirement:
    match a, b:
        case AtLeast(x), AtLeast(y):
            return AtLeast(max(x, y))
        case Includes(x), Includes(y):
            return Includes(x | y)
        case (Equals(x), Includes(y)) | (Includes(y), Equals(x)):
            return Includes(y | {x})
        case Equals(x), Equals(y) if x == y:
            return a
        case Versions(x), Versions(y):
            try:
                return _normalise(x + y)
            except ValueError as exc:
                raise ValueError(f"requirement {key!r}: {exc}") from None
    raise ValueError(
        f"requirement {key!r}: {requirement_text(key, a)} conflicts with {requirement_text(key, b)}"
    )


def merge_requirements(
    base: Mapping[str, Requirement], extra: Mapping[str, Requirement]
) -> dict[str, Requirement]:
    """``extra`` (the task's) adds to ``base`` (the policy's); on one key the stricter wins.

    Numbers take the maximum, sets the union, versions all constraints; two
    different plain values, or two kinds that do not combine, are a conflict.
    """
    merged = dict(base)
    for key, req in extra.items():
        merged[key] = _combine(key, merged[key], req) if key in merged else req
    return merged
