"""Names of GitHub repositories: what the code host factory reads without the GitHub
client (its httpx, the `github` extra, is needed only to talk to GitHub)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from runlane.codehost.base import CodeHostError
from runlane.domain.repos import host_path_url

DEFAULT_API_URL = "https://api.github.com"

_OWNER = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})"
_NAME = r"[A-Za-z0-9._-]+"
_SHORT = re.compile(rf"^({_OWNER})/({_NAME})$")
_SCP = re.compile(rf"^[\w.-]+@([\w.-]+):/?({_OWNER})/({_NAME})/?$")


def _strip_git(name: str) -> str:
    return name[:-4] if name.endswith(".git") else name


def parse_github_repo(repo: str) -> tuple[str, str]:
    """``(owner, name)`` from ``OWNER/NAME``, ``https://HOST/OWNER/NAME(.git)``,
    ``HOST/OWNER/NAME`` (that URL without its scheme), ``ssh://git@HOST/OWNER/NAME.git``
    or ``git@HOST:OWNER/NAME.git``."""
    text = repo.strip()
    text = host_path_url(text) or text
    short = _SHORT.match(text)
    scp = _SCP.match(text)
    if short:
        owner, name = short.group(1), short.group(2)
    elif scp:
        owner, name = scp.group(2), scp.group(3)
    else:
        parts = urlsplit(text)
        if parts.scheme not in ("https", "http", "ssh", "git") or not parts.netloc:
            raise CodeHostError(f"not a GitHub repository: {repo}", transient=False)
        segments = [s for s in parts.path.split("/") if s]
        if len(segments) != 2:
            raise CodeHostError(f"not a GitHub repository URL (want OWNER/NAME): {repo}",
                                transient=False)
        owner, name = segments
    name = _strip_git(name)
    if not re.fullmatch(_OWNER, owner) or not re.fullmatch(_NAME, name) or name in (".", ".."):
        raise CodeHostError(f"not a GitHub repository: {repo}", transient=False)
    return owner, name


def github_host(repo: str) -> str | None:
    """The host named in a repository URL (``github.com`` ...), None for ``OWNER/NAME``."""
    text = repo.strip()
    text = host_path_url(text) or text
    if _SHORT.match(text):
        return None
    if scp := _SCP.match(text):
        return scp.group(1).lower()
    host = urlsplit(text).hostname
    return host.lower() if host else None
