"""Pick the code host for a task's repository."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from runlane.codehost.base import CodeHost, CodeHostError
from runlane.codehost.github_names import DEFAULT_API_URL, github_host, parse_github_repo
from runlane.codehost.local_forge import FORGE_DIR_ENV, LocalForge, default_forge_dir, is_local_repo
from runlane.domain.repos import host_path_url, shorthand_host_from_env
from runlane.extras import MissingDependency, require

GITHUB_HOSTS = frozenset({"github.com", "www.github.com"})


def code_host_for(repo: str, *, env: Mapping[str, str] | None = None) -> CodeHost:
    """``LocalForge`` for local paths and ``file://`` URLs; ``GitHubClient`` for
    ``https://github.com/OWNER/NAME(.git)``, ``git@github.com:OWNER/NAME.git`` and
    ``OWNER/NAME`` (and for URLs on the host of ``RUNLANE_GITHUB_API_URL``, i.e.
    GitHub Enterprise).

    Environment: ``RUNLANE_FORGE_DIR`` (LocalForge storage), ``RUNLANE_GITHUB_TOKEN``
    else ``GITHUB_TOKEN``, ``RUNLANE_GITHUB_API_URL`` (default https://api.github.com).
    A ``GitHubClient`` holds a connection pool: call ``close()`` when done.
    Anything else: ``CodeHostError(transient=False)``.
    """
    env = os.environ if env is None else env
    if is_local_repo(repo):
        forge_dir = env.get(FORGE_DIR_ENV)
        return LocalForge(Path(forge_dir).expanduser() if forge_dir else default_forge_dir())
    api_url = env.get("RUNLANE_GITHUB_API_URL") or DEFAULT_API_URL
    hosts = set(GITHUB_HOSTS)
    if api_url.rstrip("/") != DEFAULT_API_URL:
        api_host = urlsplit(api_url).hostname
        if api_host:
            hosts.add(api_host.lower())
    host = github_host(repo)
    if host is None or host in hosts:
        parse_github_repo(repo)  # refuse a malformed repository now, not at the first call
        token = env.get("RUNLANE_GITHUB_TOKEN") or env.get("GITHUB_TOKEN") or None
        try:  # the GitHub client needs httpx, the `github` extra (runlane.extras)
            require("httpx", "The GitHub code host")
        except MissingDependency as exc:
            raise CodeHostError(str(exc), transient=False) from None
        from runlane.codehost.github import GitHubClient

        return GitHubClient(api_url, token=token)
    raise CodeHostError(f"no code host knows repository {repo!r} (want a local path, a "
                        "file:// URL or a GitHub repository)", transient=False)


def clone_source(repo: str, *, env: Mapping[str, str] | None = None) -> str:
    """What ``git clone`` is given for a task's repository: the repository itself, but
    ``OWNER/NAME`` (a GitHub repository, as code_host_for reads it) becomes
    ``https://HOST/OWNER/NAME.git``, HOST being github.com or, with
    ``RUNLANE_GITHUB_API_URL`` set, its host (GitHub Enterprise). Given as is, git
    took ``OWNER/NAME`` for a local path and the run failed TASK_CONTRACT_INVALID
    (a review of 2026-12-02); so it took ``github.com/OWNER/NAME``, now cloned from
    ``https://github.com/OWNER/NAME``. A path that exists on disk stays a path."""
    env = os.environ if env is None else env
    if is_local_repo(repo):
        return repo
    if (url := host_path_url(repo)) is not None:
        return url
    if github_host(repo) is not None:
        return repo
    try:
        owner, name = parse_github_repo(repo)
    except CodeHostError:
        return repo  # not a repository name code_host_for knows: git says what is wrong
    return f"https://{shorthand_host_from_env(env)}/{owner}/{name}.git"


def configured_hosts(env: Mapping[str, str] | None = None) -> list[str]:
    """The code hosts this machine's workers know, one line each (``runlane info``
    and a refused submit list them)."""
    env = os.environ if env is None else env
    forge = env.get(FORGE_DIR_ENV) or str(default_forge_dir())
    api_url = env.get("RUNLANE_GITHUB_API_URL") or DEFAULT_API_URL
    names = sorted(GITHUB_HOSTS - {"www.github.com"})
    if api_url.rstrip("/") != DEFAULT_API_URL and urlsplit(api_url).hostname:
        names.append(str(urlsplit(api_url).hostname))
    token = ("a token is set" if env.get("RUNLANE_GITHUB_TOKEN") or env.get("GITHUB_TOKEN")
             else "no token yet: set RUNLANE_GITHUB_TOKEN")
    return [f"local: paths and file:// URLs on this machine (pull requests kept in {forge})",
            f"GitHub: https://{'|'.join(names)}/OWNER/NAME, git@HOST:OWNER/NAME.git and "
            f"OWNER/NAME (API {api_url}; {token})"]


ADD_A_HOST = ("to add GitHub Enterprise, set RUNLANE_GITHUB_API_URL=https://HOST/api/v3 "
              "(and RUNLANE_GITHUB_TOKEN) where the workers run; or clone the repository to "
              "a local path and submit that")


def repository_problem(repo: str, env: Mapping[str, str] | None = None) -> str | None:
    """Why no run of ``repo`` can ever succeed on this machine's code hosts (None: one
    serves it): no code host knows it, or it is a local path that does not exist."""
    from runlane.errors import redact_credentials

    shown = redact_credentials(repo)
    try:
        host = code_host_for(repo, env=env)
    except CodeHostError:
        return (f"no configured code host serves repository {shown!r}; the code hosts "
                f"are: {'; '.join(configured_hosts(env))}. {ADD_A_HOST[0].upper()}"
                f"{ADD_A_HOST[1:]}")
    close = getattr(host, "close", None)
    if callable(close):
        close()
    if is_local_repo(repo):
        path = (Path(urlsplit(repo).path) if repo.startswith("file://")
                else Path(repo).expanduser())
        if not path.exists():
            return f"repository {shown!r} does not exist on this machine ({path.absolute()})"
    return None
