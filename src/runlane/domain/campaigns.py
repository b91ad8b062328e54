"""Campaigns: one change across many repositories, rolled out canary -> ramp -> all.

A campaign file (TOML) is validated here into one immutable value; errors name the
file, the dotted field and the problem, as the policy's do. Pure: the rollout plan
(which target is in which batch), the release rule (when the next batch may start)
and the stop rule (failure rate over the last N counted finishes) are functions of
values the store reads. Nothing here knows SQL.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from runlane.domain.reasons import Reason
from runlane.domain.tasks import parse_priority, valid_name, validate_repo
from runlane.errors import RunlaneError

MAX_TARGETS = 10_000
# Campaign runs take this priority class unless the file names another: an interactive
# run of the same tenant (``normal``) is always taken first.
DEFAULT_PRIORITY = "batch"
# Reasons that never count toward the stop rule unless the file says otherwise: a user
# cancelling a run, and the campaign's own stop, say nothing about the change.
DEFAULT_IGNORED_REASONS: tuple[str, ...] = (Reason.CANCELLED_BY_USER.value,
                                            Reason.CAMPAIGN_STOPPED.value)
_TOML_AT = re.compile(r"\s*\(at (line \d+, column \d+|end of document)\)$")
_VAR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CampaignInvalid(RunlaneError, ValueError):
    """A campaign that cannot be created; names the file, the dotted field and the problem
    (bad input: exit 2, HTTP 422)."""

    exit_code = 2
    reason_code = "CAMPAIGN_INVALID"

    def __init__(self, source: str, field: str, problem: str):
        super().__init__(f"{source}: {field}: {problem}")
        self.source = source
        self.field = field
        self.problem = problem


class CampaignStatus(StrEnum):
    """A campaign's own state (its runs keep theirs, in domain/states.py)."""

    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
    STOPPED = "STOPPED"
    COMPLETED = "COMPLETED"


# The operator's moves between campaign states; COMPLETED and STOPPED are final (a
# retry-failed of a finished campaign makes it ACTIVE again: see ``may_retry``).
CAMPAIGN_TRANSITIONS: dict[CampaignStatus, frozenset[CampaignStatus]] = {
    CampaignStatus.ACTIVE: frozenset({CampaignStatus.PAUSED, CampaignStatus.STOPPED,
                                      CampaignStatus.COMPLETED}),
    CampaignStatus.PAUSED: frozenset({CampaignStatus.ACTIVE, CampaignStatus.STOPPED}),
    CampaignStatus.STOPPED: frozenset({CampaignStatus.ACTIVE}),
    CampaignStatus.COMPLETED: frozenset({CampaignStatus.ACTIVE}),
}


class TargetState(StrEnum):
    PENDING = "PENDING"  # not dispatched: no task yet
    ACTIVE = "ACTIVE"  # its run exists and has not ended
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"  # ended FAILED or POLICY_DENIED
    CANCELLED = "CANCELLED"  # its run was cancelled, or the campaign stopped first


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _reason(value: str) -> str:
    if value not in Reason.__members__:
        raise ValueError(f"{value!r} is not a reason code runlane records")
    return value


ReasonCode = Annotated[str, Field(min_length=1)]


class Target(_Model):
    """One repository of the campaign, with its variables and its owner."""

    repo: str
    vars: dict[str, str] = Field(default_factory=dict)
    owner: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        return validate_repo(value)

    @field_validator("vars")
    @classmethod
    def _vars(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _VAR.match(name) or name == "repo":
                raise ValueError(f"{name!r} is not a variable name (letters, digits, _; "
                                 "not 'repo')")
        return value

    @property
    def key(self) -> str:
        """The target's identity in its campaign: its repository and variables."""
        text = json.dumps({"repo": self.repo, "vars": self.vars}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]


class TaskFields(_Model):
    """What every run of the campaign gets."""

    queue: str = "default"
    priority: int = Field(default_factory=lambda: parse_priority(DEFAULT_PRIORITY))
    requires: dict[str, Any] = Field(default_factory=dict)
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    estimated_cost_usd: float | None = Field(default=None, ge=0)
    user: str | None = None

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, value: Any) -> int:
        return parse_priority(value)

    @field_validator("queue", "user")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not valid_name(value):
            raise ValueError(f"{value!r} must be 1-128 characters of letters, digits "
                             "and ._:@/-")
        return value


Step = int | Literal["all"]


class Rollout(_Model):
    """Batch sizes: the canary first, then each step in turn; after the last step, more
    batches of its size (``"all"``: every target left, in one batch)."""

    canary: int = Field(default=5, ge=1, le=MAX_TARGETS)
    steps: tuple[Step, ...] = ("all",)
    # The next batch is released when every run of the current one ended and this
    # long has passed since the last ended ...
    wait_seconds: float = Field(default=0.0, ge=0, le=30 * 86400)
    # ... or, if set, as soon as the current batch has this many successes.
    advance_after_successes: int | None = Field(default=None, ge=1, le=MAX_TARGETS)

    @field_validator("steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        if not isinstance(value, list | tuple) or not value:
            raise ValueError("must be a non-empty list of batch sizes or \"all\"")
        for i, step in enumerate(value):
            if step == "all":
                if i != len(value) - 1:
                    raise ValueError('"all" can only be the last step')
            elif isinstance(step, bool) or not isinstance(step, int) \
                    or not 1 <= step <= MAX_TARGETS:
                raise ValueError(f"step {step!r} is neither a size in 1..{MAX_TARGETS} "
                                 'nor "all"')
        return tuple(value)


class Concurrency(_Model):
    max_active: int = Field(default=20, ge=1, le=MAX_TARGETS)
    per_repository: int = Field(default=1, ge=1, le=MAX_TARGETS)


class StopRule(_Model):
    """Stop when more than ``failure_rate`` of the last ``window`` counted finishes
    failed, once at least ``min_sample`` are in the window."""

    failure_rate: float = Field(default=0.15, ge=0, le=1)
    window: int = Field(default=50, ge=1, le=MAX_TARGETS)
    min_sample: int = Field(default=10, ge=1, le=MAX_TARGETS)
    # When set, only runs ending with one of these count as failures (others that
    # ended without success still count as finishes).
    failure_reasons: tuple[str, ...] | None = None
    # Runs ending with one of these are not counted at all.
    ignore_reasons: tuple[str, ...] = DEFAULT_IGNORED_REASONS
    # A stop (the rule's or `campaign stop`) also cancels the runs already running;
    # by default they finish.
    cancel_running: bool = False

    @field_validator("failure_reasons", "ignore_reasons", mode="before")
    @classmethod
    def _codes(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ValueError("must be a list of reason codes")
        return tuple(_reason(v) for v in value)

    @model_validator(mode="after")
    def _sample(self) -> StopRule:
        if self.min_sample > self.window:
            raise ValueError(f"min_sample {self.min_sample} is larger than window "
                             f"{self.window}: the rule could never fire")
        return self

    def counts(self, reason_code: str | None, succeeded: bool) -> bool:
        """Whether a finish enters the window at all."""
        return succeeded or reason_code not in self.ignore_reasons

    def is_failure(self, reason_code: str | None, succeeded: bool) -> bool:
        if succeeded:
            return False
        return self.failure_reasons is None or reason_code in self.failure_reasons

    def crossed(self, window: Sequence[bool]) -> bool:
        """``window``: the newest counted finishes (True = failure), at most ``window``."""
        recent = list(window)[: self.window]
        if len(recent) < self.min_sample:
            return False
        return sum(recent) / len(recent) > self.failure_rate


class Notify(_Model):
    webhook_url: str | None = Field(default=None, pattern=r"^https?://")
    # The environment variable holding the HMAC-SHA256 key (read by the sender, never
    # stored in the database).
    secret_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    log_file: str | None = None


class Campaign(_Model):
    name: str
    tenant: str
    owner: str | None = Field(default=None, min_length=1, max_length=255)
    prompt: str = Field(min_length=1, max_length=100_000)
    targets: tuple[Target, ...] = Field(min_length=1, max_length=MAX_TARGETS)
    task: TaskFields = TaskFields()
    rollout: Rollout = Rollout()
    concurrency: Concurrency = Concurrency()
    stop: StopRule = StopRule()
    notify: Notify = Notify()

    @field_validator("name", "tenant")
    @classmethod
    def _name(cls, value: str) -> str:
        if not valid_name(value):
            raise ValueError(f"{value!r} must be 1-128 characters of letters, digits "
                             "and ._:@/-")
        return value

    def batches(self) -> list[int]:
        """The size of each batch, in order, covering every target."""
        return batch_sizes(len(self.targets), self.rollout)

    def batch_of(self) -> list[int]:
        """The batch number (0 = canary) of each target, in file order."""
        out: list[int] = []
        for number, size in enumerate(self.batches()):
            out.extend([number] * size)
        return out

    def digest(self) -> str:
        """sha256 of the canonical JSON: the same file twice is the same campaign."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def batch_sizes(n: int, rollout: Rollout) -> list[int]:
    sizes: list[int] = []
    left = n
    steps: list[Step] = [rollout.canary, *rollout.steps]
    i = 0
    while left > 0:
        step = steps[min(i, len(steps) - 1)]
        size = left if step == "all" else min(int(step), left)
        sizes.append(size)
        left -= size
        i += 1
    return sizes


def render_prompt(template: str, target: Target) -> str:
    """``{repo}`` and the target's variables substituted; ``{{``/``}}`` are braces."""
    names = {field for _, field, _, _ in string.Formatter().parse(template) if field}
    values = {"repo": target.repo, **target.vars}
    missing = names - values.keys()
    if missing:
        raise KeyError(sorted(missing)[0])
    return template.format_map(values)


@dataclass(frozen=True)
class BatchProgress:
    """The current (newest released) batch as the store sees it."""

    number: int
    size: int
    finished: int
    succeeded: int
    last_finished_at: float | None


def next_batch_due(rollout: Rollout, batch: BatchProgress, batches: int, now: float) -> bool:
    """Whether the batch after ``batch`` may be released now."""
    if batch.number + 1 >= batches:
        return False
    if rollout.advance_after_successes is not None \
            and batch.succeeded >= rollout.advance_after_successes:
        return True
    if batch.finished < batch.size:
        return False
    return batch.last_finished_at is None \
        or now >= batch.last_finished_at + rollout.wait_seconds


# --- loading ---------------------------------------------------------------------------


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("[key]", "int", "literal['all']"):
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _problem(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field"
    if error["type"] == "missing":
        return "is required"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] not in ("value_error", "assertion_error") \
            and not isinstance(error.get("input"), dict | list):
        message += f" (got {error['input']!r})"
    return message


def _read_targets_file(path: Path, source: str) -> list[Any]:
    """One target per line: a JSON object (``{"repo": ..., "vars": {...}, "owner": ...}``)
    or a bare repository; blank lines and ``#`` comments are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CampaignInvalid(source, "targets_file",
                              f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CampaignInvalid(source, "targets_file", f"{path} is not UTF-8 text") from None
    rows: list[Any] = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CampaignInvalid(source, f"targets_file line {number}",
                                      f"is not JSON: {exc.msg}") from None
        else:
            rows.append({"repo": line})
        if len(rows) > MAX_TARGETS:
            raise CampaignInvalid(source, "targets_file",
                                  f"has more than {MAX_TARGETS} targets")
    return rows


def campaign_from_document(data: Any, source: str = "<document>",
                           base_dir: Path | None = None) -> Campaign:
    """Validate parsed data; ``targets_file`` is read relative to ``base_dir``."""
    if isinstance(data, dict) and "targets_file" in data:
        if base_dir is None:
            raise CampaignInvalid(source, "targets_file", "is read from a file's directory "
                                  "only; give the targets inline here")
        data = dict(data)
        name = data.pop("targets_file")
        if "targets" in data:
            raise CampaignInvalid(source, "targets_file",
                                  "give targets inline or in a file, not both")
        if not isinstance(name, str):
            raise CampaignInvalid(source, "targets_file", "must be a path")
        path = Path(name)
        if not path.is_absolute():
            path = base_dir / path
        data["targets"] = _read_targets_file(path, source)
    if isinstance(data, dict) and isinstance(data.get("targets"), list) \
            and len(data["targets"]) > MAX_TARGETS:
        raise CampaignInvalid(source, "targets",
                              f"has {len(data['targets'])} targets; at most {MAX_TARGETS}")
    try:
        campaign = Campaign.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CampaignInvalid(source, _dotted(first["loc"]), _problem(first)) from None
    seen: dict[str, int] = {}
    for i, target in enumerate(campaign.targets):
        if target.key in seen:
            raise CampaignInvalid(source, f"targets[{i}]", f"repeats targets[{seen[target.key]}] "
                                  f"({target.repo} with the same vars)")
        seen[target.key] = i
        try:
            render_prompt(campaign.prompt, target)
        except KeyError as exc:
            raise CampaignInvalid(source, f"targets[{i}]", f"{target.repo} has no variable "
                                  f"{exc} that the prompt names") from None
        except ValueError as exc:
            raise CampaignInvalid(source, "prompt", f"is not a template: {exc}") from None
    return campaign


def parse_campaign(text: str, source: str = "<string>",
                   base_dir: Path | None = None) -> Campaign:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        where = _TOML_AT.search(message)
        raise CampaignInvalid(source, where.group(1) if where else "(syntax)",
                              _TOML_AT.sub("", message)) from None
    return campaign_from_document(data, source, base_dir)


def load_campaign(path: str | Path) -> Campaign:
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CampaignInvalid(source, "(file)", f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CampaignInvalid(source, "(file)", "is not UTF-8 text") from None
    return parse_campaign(text, source, Path(path).resolve().parent)
