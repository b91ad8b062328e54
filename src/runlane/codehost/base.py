"""The code-host interface the finalizer uses. Every call is safe to repeat: the
finalizer looks a pull request up by its marker before it opens one, and a
withdrawal looks its comment up before it posts one.

A host may also offer ``set_deadline(deadline)`` (a ``time.monotonic()`` value, or
None): no call it makes after that may last past it (the finalizer passes the end of
its lease's window); ``GitHubClient`` and ``LocalForge`` do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from runlane.errors import RunlaneError, redact_credentials


def pr_marker(run_id: str) -> str:
    return f"<!-- agent-run-id: {run_id} -->"


def branch_name(task_id: str, run_id: str) -> str:
    return f"agent/{task_id}/{run_id}"


def withdrawal_marker(run_id: str) -> str:
    """The marker of runlane's comment on a pull request it closed: looked up before
    the comment is posted, so a retried withdrawal never comments twice."""
    return f"<!-- runlane-withdrawn: {run_id} -->"


@dataclass(frozen=True)
class PullRequest:
    repo: str
    number: int
    url: str
    head_branch: str
    base_branch: str
    title: str
    body: str
    state: str  # "open" or "closed"


class PullRequestExists(RunlaneError):
    """The host refused a second open pull request for the same head branch."""


class CodeHostError(RunlaneError):
    """The host failed; ``transient`` says whether retrying may help.

    ``retry_after`` (seconds) is set when the host said how long to wait
    (HTTP 429 or a rate-limit 403 with ``Retry-After`` / ``X-RateLimit-Reset``);
    None otherwise. ``status`` is the HTTP status when there was one.
    """

    def __init__(self, message: str, *, transient: bool, retry_after: float | None = None,
                 status: int | None = None) -> None:
        super().__init__(redact_credentials(message))  # a repository URL may carry a token
        self.transient = transient
        self.retry_after = retry_after
        self.status = status


class CodeHost(Protocol):
    def find_pull_request(self, repo: str, head_branch: str, marker: str) -> PullRequest | None:
        """The pull request (open or closed) from ``head_branch`` whose body carries
        ``marker``, or None."""
        ...

    def open_pull_request(self, repo: str, *, head_branch: str, base_branch: str, title: str,
                          body: str) -> PullRequest:
        """Open a pull request; raises PullRequestExists when one is open for the head."""
        ...

    def list_pull_requests(self, repo: str) -> list[PullRequest]: ...

    def close_pull_request(self, repo: str, number: int) -> PullRequest:
        """Close pull request ``number`` (repeating is harmless); the closed one."""
        ...

    def comment_on_pull_request(self, repo: str, number: int, body: str, *,
                                marker: str) -> bool:
        """Post ``body`` on pull request ``number`` unless a comment carrying ``marker``
        is already there; True when it posted one."""
        ...
