"""Errors a caller can act on. Each carries a one-line message for the CLI."""

from __future__ import annotations

import re

# The user[:password]@ of a URL (up to its last @ before the path, so a password
# holding an unencoded @ goes too).
_CREDENTIALS = re.compile(r"(://)[^/\s]*@")


def redact_credentials(text: str) -> str:
    """``scheme://***@host/...`` for every ``scheme://user:secret@host/...`` in ``text``:
    no credentials of a URL in a message that ends up in the database or a log."""
    return _CREDENTIALS.sub(r"\1***@", text)


class RunlaneError(Exception):
    """Base of every error runlane reports to a user instead of a traceback."""

    exit_code = 1


class NotFound(RunlaneError):
    """No such row, or one the caller's principal may not see (the same answer, so an
    id of another tenant tells nothing)."""

    exit_code = 3


class Unauthenticated(RunlaneError):
    """No token, or one that is unknown, revoked or expired (HTTP 401)."""

    exit_code = 2
    reason_code = "UNAUTHENTICATED"


class Forbidden(RunlaneError):
    """The principal sees the row but its role may not do this (HTTP 403)."""

    exit_code = 2
    reason_code = "FORBIDDEN"


class Conflict(RunlaneError):
    """The request contradicts what is stored, e.g. an idempotency key already used with
    another body (HTTP 409); nothing was written."""

    exit_code = 2
    reason_code = "IDEMPOTENCY_CONFLICT"
    field: str | None = None  # the field of the request that differs, when known


class ApprovalRefused(Conflict):
    """An approve or reject of a run that is not waiting for approval: it was decided
    otherwise, expired, has moved on or was never held (HTTP 409); nothing was
    written. The same decision again is no refusal: it answers the first one."""

    reason_code = "NOT_AWAITING_APPROVAL"


class RetryRefused(Conflict):
    """A retry of a task whose newest run has not ended (``TASK_NOT_FINISHED``), or
    that another retry just made (``RETRY_RACE``), or whose runs retention deleted
    (``NO_RUN_TO_RETRY``); nothing was written (HTTP 409)."""

    def __init__(self, message: str, reason_code: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code


class DatabaseUnavailable(RunlaneError):
    exit_code = 4


class SchemaOutdated(RunlaneError):
    exit_code = 4


class SchemaTooNew(RunlaneError):
    """The database was migrated by a newer runlane: upgrading runlane, not the
    database, is the fix."""

    exit_code = 4


class LeaseLost(RunlaneError):
    """A fenced write was refused: the lease expired, was revoked, or a newer one exists.

    The worker must stop at once and write nothing more about the run.
    """


class CancelRequested(RunlaneError):
    """A fenced write was refused because the run is being cancelled."""


class TransitionRefused(RunlaneError):
    """A compare-and-set status write lost: the run is not in the expected state."""


class PolicyDenied(RunlaneError):
    """The policy in force now forbids this run (checked before every side effect)."""

    def __init__(self, message: str, reason_code: str = "POLICY_DENIED") -> None:
        super().__init__(message)
        self.reason_code = reason_code


class CostLimitExceeded(RunlaneError):
    """A run reported more cost than its limits snapshot allows."""
