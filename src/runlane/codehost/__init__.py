"""Code hosts: where branches are pushed and pull requests opened."""

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
from runlane.codehost.github import GitHubClient, parse_github_repo
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
