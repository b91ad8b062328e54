"""What a user asks for: the task contract, validated before anything is written."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runlane.domain.reasons import Reason
from runlane.domain.routing import canonical_requirements, parse_requirements

PRIORITY_CLASSES: dict[str, int] = {
    "critical": 0,
    "high": 50,
    "normal": 100,
    "low": 150,
    "batch": 200,
}
MAX_PRIORITY = 1000

# Optional context sections, in the order they are truncated when a task is over
# the payload cap (seed 004): the least valuable first. The prompt itself is never
# truncated; a task whose prompt alone is over the cap is refused.
CONTEXT_TRUNCATION_ORDER: tuple[str, ...] = (
    "summary",  # an older summary of the conversation or issue
    "history",  # older verbatim history; cut from its oldest (first) lines
    "comments",  # review or issue comments
    "diff",  # the full diff the task refers to
    "ci_failures",  # CI failure excerpts: kept longest, most actionable
)
DEFAULT_PAYLOAD_CAP_BYTES = 4 * 1024 * 1024
TRUNCATION_MARK = "\n[runlane: truncated {n} bytes]\n"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_SCP_LIKE = re.compile(r"^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^\s]+$")
_URL_SCHEMES = {"http", "https", "ssh", "git", "file"}


class TaskInvalid(ValueError):
    """A task that cannot be accepted; ``field`` names the offending input."""

    def __init__(self, field: str, problem: str, reason: str = Reason.TASK_CONTRACT_INVALID):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.reason = reason


def valid_name(value: str) -> bool:
    """A tenant, queue or user name: 1-128 characters of letters, digits and ._:@/-."""
    return bool(_NAME.match(value))


def parse_priority(value: int | str) -> int:
    if isinstance(value, bool):
        raise ValueError("must be an integer or one of " + ", ".join(PRIORITY_CLASSES))
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip().lower()
        if text in PRIORITY_CLASSES:
            return PRIORITY_CLASSES[text]
        if not re.fullmatch(r"[+-]?\d+", text):
            raise ValueError(
                f"{value!r} is not an integer or one of " + ", ".join(PRIORITY_CLASSES)
            )
        number = int(text)
    if not 0 <= number <= MAX_PRIORITY:
        raise ValueError(f"must be between 0 and {MAX_PRIORITY} (lower runs first)")
    return number


def validate_repo(value: str) -> str:
    repo = value.strip()
    if not repo:
        raise ValueError("must not be empty")
    if any(ch.isspace() for ch in repo):
        raise ValueError(f"{value!r} contains white space")
    if _SCP_LIKE.match(repo):
        return repo
    if "://" in repo:
        parsed = urlparse(repo)
        if parsed.scheme not in _URL_SCHEMES:
            raise ValueError(
                f"{value!r}: scheme {parsed.scheme!r} is not one of {sorted(_URL_SCHEMES)}"
            )
        if parsed.scheme != "file" and not parsed.hostname:
            raise ValueError(f"{value!r} has no host")
        if not parsed.path or parsed.path == "/":
            raise ValueError(f"{value!r} has no repository path")
        return repo
    if ":" in repo.split("/", 1)[0]:
        raise ValueError(f"{value!r} is neither a URL, user@host:path nor a local path")
    return repo  # a local path (absolute or relative to where the worker runs)


class TaskSpec(BaseModel):
    """One task as submitted (CLI flags, a JSON Lines row, or the Python API)."""

    # No infinities or NaN: a cost of inf is stored and then printed as `Infinity`,
    # which is not JSON.
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, allow_inf_nan=False)

    tenant: str
    repo: str
    prompt: str
    # Unset queue/priority: the policy decides (a repository rule, else its defaults).
    queue: str | None = None
    priority: int | None = None
    # Not empty: an unset shell variable would make every such task one task.
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    context: dict[str, str] = Field(default_factory=dict)
    # Required worker capabilities (routing.py syntax: "java", "git,maven", 12, ">=21").
    requires: dict[str, Any] = Field(default_factory=dict)
    depends_on: list[str] = Field(default_factory=list, max_length=100)
    parent_task_id: str | None = None
    user: str | None = None
    estimated_cost_usd: float | None = Field(default=None, ge=0)
    # The model provider the task's agent uses (its capacity: the policy's providers);
    # unset: its queue's default in the policy, else none.
    provider: str | None = None

    @field_validator("tenant", "queue", "user", "provider")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must not be empty")
        if not valid_name(value):
            raise ValueError(
                f"{value!r} must be 1-128 characters of letters, digits and ._:@/-"
            )
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        return validate_repo(value)

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, value: Any) -> int | None:
        return None if value is None else parse_priority(value)

    @field_validator("requires")
    @classmethod
    def _requires(cls, value: dict[str, Any]) -> dict[str, Any]:
        parse_requirements(value)  # raises ValueError naming the bad requirement
        return value

    @field_validator("depends_on")
    @classmethod
    def _depends_on(cls, value: list[str]) -> list[str]:
        # Not empty: `--depends-on "$DEP"` with DEP unset named no task, and the insert
        # then failed on the foreign key as a database error.
        if any(not task_id for task_id in value):
            raise ValueError("a task id must not be empty")
        return sorted(set(value))

    @field_validator("parent_task_id")
    @classmethod
    def _parent(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("must not be empty")
        return value

    @field_validator("*")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        """JSON may carry "\\u0000"; PostgreSQL stores no NUL character (SQLite did):
        the same task must be refused, as bad input, on both engines."""
        where = _nul_in(value)
        if where is not None:
            raise ValueError("holds a NUL character (\\u0000)"
                             + (f" in {where}" if where else ""))
        return value

    @field_validator("context")
    @classmethod
    def _context(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value) - set(CONTEXT_TRUNCATION_ORDER))
        if unknown:
            raise ValueError(
                f"unknown section(s) {unknown}; known: {list(CONTEXT_TRUNCATION_ORDER)}"
            )
        return value


def _nul_in(value: Any, path: str = "") -> str | None:
    """Where ``value`` (a string, or a list or dict of them, keys too) holds a NUL
    character: ``""`` for the value itself, else the key or index; None if nowhere."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _nul_in(key, repr(key)) or _nul_in(item, repr(key))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _nul_in(item, str(index))
            if found is not None:
                return found
    return None


def parse_task(raw: dict[str, Any], where: str = "") -> TaskSpec:
    """Validate one raw task, turning pydantic's report into one line naming the field."""
    try:
        return TaskSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "task"
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        elif first["type"] == "missing":
            message = "is required"
        raise TaskInvalid(f"{where}{field}", message) from None


@dataclass(frozen=True)
class PayloadReport:
    size_bytes: int
    truncated_sections: tuple[str, ...]


def payload_size(spec: TaskSpec) -> int:
    """The task's size as compact UTF-8 JSON, serialised by pydantic's core (a
    quarter of the time of ``model_dump`` then ``json.dumps``: it is measured for
    every submitted task)."""
    return len(pydantic_core.to_json(spec))


def enforce_payload_cap(spec: TaskSpec, cap_bytes: int = DEFAULT_PAYLOAD_CAP_BYTES) -> tuple[
    TaskSpec, PayloadReport
]:
    """Fit a task under the payload cap by truncating context in the documented order.

    Returns the (possibly truncated) task; raises ``TaskInvalid`` with
    ``PAYLOAD_TOO_LARGE`` only when every optional section is already empty.
    """
    size = payload_size(spec)
    if size <= cap_bytes:
        return spec, PayloadReport(size, ())
    context = dict(spec.context)
    truncated: list[str] = []
    for section in CONTEXT_TRUNCATION_ORDER:
        # JSON escaping makes encoded size differ from text size: cut, measure, repeat.
        while context.get(section) and size > cap_bytes:
            encoded = context[section].encode()
            keep = max(len(encoded) - (size - cap_bytes) - len(TRUNCATION_MARK) - 16, 0)
            removed = len(encoded) - keep
            if keep == 0:
                context[section] = ""
            elif section == "history":  # drop the oldest lines first
                context[section] = (TRUNCATION_MARK.format(n=removed)
                                    + encoded[removed:].decode(errors="ignore"))
            else:
                context[section] = (encoded[:keep].decode(errors="ignore")
                                    + TRUNCATION_MARK.format(n=removed))
            if section not in truncated:
                truncated.append(section)
            spec = spec.model_copy(update={"context": context})
            size = payload_size(spec)
        if size <= cap_bytes:
            return spec, PayloadReport(size, tuple(truncated))
    raise TaskInvalid(
        "prompt",
        f"PAYLOAD_TOO_LARGE: task is {size} bytes after truncating every context section; "
        f"the cap is {cap_bytes}",
        reason=Reason.PAYLOAD_TOO_LARGE,
    )


def _normal(value: Any) -> Any:
    """``value`` with every set or tuple as a sorted list: the same request always has
    the same text, whatever the order a set iterates in (it changes per process)."""
    if isinstance(value, dict):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_normal(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return value


def task_digest(spec: TaskSpec) -> str:
    """The SHA-256 of a task as asked (before any truncation): the same tenant and
    idempotency key with another digest is another request under a used key, a
    conflict. Normalized: priority classes are their numbers, requirements are their
    route key (sets sorted), mapping keys are sorted; a field left unset is null (so an
    unset queue differs from ``--queue default``: the first lets the policy choose)."""
    fields = spec.model_dump()
    if fields.get("provider") is None:  # added later: unset, the digest it always had
        fields.pop("provider", None)
    # A requirement's set is a set whatever its order ("git,maven" = "maven,git").
    fields["requires"] = canonical_requirements(parse_requirements(spec.requires))
    text = json.dumps(_normal(fields), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()


# The fields a conflict names, in the order it looks at them (the first that differs).
CONFLICT_FIELDS = ("repo", "prompt", "requires", "queue", "priority", "max_attempts",
                   "context", "depends_on", "parent_task_id", "user", "estimated_cost_usd")


def differing_field(spec: TaskSpec, earlier: TaskSpec | dict[str, Any]) -> str | None:
    """The first field in which ``spec`` asks otherwise than ``earlier`` (another spec,
    or a stored task's row: queue, priority and max attempts as decided, context as
    kept), or None when no stored field tells."""
    if isinstance(earlier, TaskSpec):
        mine, theirs = spec.model_dump(), earlier.model_dump()
        mine["requires"] = canonical_requirements(parse_requirements(spec.requires))
        theirs["requires"] = canonical_requirements(parse_requirements(earlier.requires))
        return next((f for f in CONFLICT_FIELDS if _normal(mine[f]) != _normal(theirs[f])),
                    None)
    stored = dict(earlier)
    context = stored.get("context")
    if isinstance(context, str):
        context = json.loads(context)
    truncated = stored.get("truncated_sections")
    asked: dict[str, Any] = {
        "repo": (spec.repo, stored.get("repo")),
        "prompt": (spec.prompt, stored.get("prompt")),
        "requires": (canonical_requirements(parse_requirements(spec.requires)),
                     stored.get("requires") or ""),
        "user": (spec.user, stored.get("user_id")),
        "parent_task_id": (spec.parent_task_id, stored.get("parent_task_id")),
        "estimated_cost_usd": (spec.estimated_cost_usd, stored.get("estimated_cost_usd")),
    }
    if not truncated or truncated in ("[]", []):
        asked["context"] = (spec.context or {}, context or {})
    for name, value in (("queue", spec.queue), ("priority", spec.priority),
                        ("max_attempts", spec.max_attempts)):
        if value is not None:  # unset: the policy chose, nothing to compare
            asked[name] = (value, stored.get(name))
    return next((f for f in CONFLICT_FIELDS if f in asked and asked[f][0] != asked[f][1]),
                None)
