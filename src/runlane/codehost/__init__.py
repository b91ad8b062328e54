"""Code hosts: where branches are pushed and pull requests opened.

``GitHubClient`` is imported on first use: it needs httpx, the `github` extra.
"""

from typing import Any

from runlane.codehost.base import (
    CodeHost,
    CodeHostError,
    PullRequest,
    PullRequestExists,
    branch_name,
    pr_marker,
    withdrawal_marker,
)
from runlane.codehost.factory import code_host_for
from runlane.codehost.github_names import parse_github_repo
from runlane.codehost.local_forge import LocalForge, normalize_repo

__all__ = [
    "CodeHost",
    "CodeHostError",
    "GitHubClient",
    "LocalForge",
    "PullRequest",
    "PullRequestExists",
    "branch_name",
    "code_host_for",
    "normalize_repo",
    "parse_github_repo",
    "pr_marker",
    "withdrawal_marker",
]


def __getattr__(name: str) -> Any:
    if name == "GitHubClient":
        from runlane.codehost.github import GitHubClient

        return GitHubClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
