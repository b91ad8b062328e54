"""Repository identity: one canonical form for every spelling of one repository.

A task names its repository as its submitter wrote it: ``https://github.com/acme/app``,
``https://github.com/acme/app.git``, ``git@github.com:acme/app.git``,
``github.com/acme/app/``, ``acme/app``, ``/srv/git/app.git``, ``file:///srv/git/app.git``.
Used raw, each spelling was a repository of its own: four concurrency scopes where
there is one repository (a per-repository limit of 1 ran four runs at once), and a
deny rule written for one spelling let the others through. ``canonical_repo`` gives
every spelling of one repository one string, the run's *identity*: its concurrency
scope (``repo:...``), what policy patterns match, and what ``runs list``, ``runs show``
and ``prs list`` print. The written form stays on the task: it is what git clones
and what the code host is asked about (it may carry credentials; the identity never
does).

The canonical forms:

* A repository on a host (``https``, ``http``, ``ssh``, ``git`` URLs, scp-style
  ``user@host:path``, ``host.name/path``, GitHub's ``OWNER/NAME``) is
  ``https://HOST/PATH``: the host lower-cased (a trailing dot and ``www.`` of
  github.com dropped), the path with ``.`` and ``..`` segments, repeated and
  trailing slashes and every trailing ``.git`` removed, and percent-encoded letters,
  digits and ``-._~`` decoded. Left out, on purpose:

  - the transport (scheme) and the **user** of an ``ssh://`` URL or scp address:
    code hosts (GitHub, GitLab, Gitea, Bitbucket) serve one repository at one path
    over every transport, and the ssh user (``git``) is a login, not a part of the
    repository's name. Kept, ``ssh://git@github.com/acme/app`` and
    ``https://github.com/acme/app`` would be two identities of one repository, and a
    rule written for one would not hold the other;
  - the **port**: a code host's ssh often listens on another port than its https
    (GitLab's 2222), so a port names a way in, not a repository; kept, a rule on
    ``https://host/acme/app`` was bypassed by ``ssh://git@host:2222/acme/app``;
  - credentials (``https://user:TOKEN@host/...``), a query and a fragment.

  The price of leaving them out is paid in the safe direction: two repositories that
  differ only in these (two git servers on one host at different ports, two ssh
  users' home directories under one relative path) are one identity, so they share
  one per-repository limit and one rule matches both; no spelling ever escapes one.
  The https scheme is written because it makes the identity a link for the common
  hosts, and keeps it unambiguous when read again (``host/path`` is also a relative
  path).
* On GitHub hosts (github.com, and the host of ``RUNLANE_GITHUB_API_URL`` for
  GitHub Enterprise) the path is lower-cased too: GitHub's owner and repository names
  are case-insensitive (``Acme/App`` is ``acme/app``), so a case change would
  otherwise be another spelling.
* ``OWNER/NAME`` (as ``codehost.factory`` reads it) is ``https://github.com/owner/name``
  (the Enterprise host when ``RUNLANE_GITHUB_API_URL`` names one), unless a path of
  that name exists where it is submitted: then it is a local path, as for the code
  host.
* A local path or ``file://`` URL is the absolute path with ``~`` expanded and
  symbolic links resolved (``os.path.realpath``), trailing slashes dropped; ``.git``
  is kept (``/srv/app.git`` and ``/srv/app`` are two directories). A relative path
  is resolved against the working directory of the process that canonicalises it
  (the submitter), so the identity of a local path is a fact of the machine that
  submitted the task.

The canonical form of a canonical form is itself (tests/test_repos.py checks it with
hypothesis), so it is safe to canonicalise a stored identity again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

DEFAULT_GITHUB_API_URL = "https://api.github.com"
GITHUB_HOST = "github.com"
# The hosts that are github.com (a link to www.github.com redirects to github.com).
_HOST_ALIASES = {"www.github.com": GITHUB_HOST}
GLOB_CHARS = frozenset("*?[")

_OWNER = r"[A-Za-z0-9][A-Za-z0-9-]{0,38}"
_SHORTHAND = re.compile(rf"^({_OWNER})/([A-Za-z0-9._-]+)$")
# In a pattern, OWNER/NAME with glob characters in the name (``acme/*``).
_SHORTHAND_PATTERN = re.compile(rf"^({_OWNER})/([^/]+)$")
# scp-style ssh: ``[user@]host:path``, the colon before any slash (git's own rule).
_SCP = re.compile(r"^(?:[^@/:]+@)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._*?-]+):(?!//)(.*)$")
# ``scheme://[user[:password]@]host[:port][/path]``, read by hand: ``urlsplit`` takes a
# pattern's ``?`` for a query and refuses a ``[`` in the host.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)(.*)$", re.S)
# ``host.name/path``: a first segment that is a DNS name with at least one dot.
_HOST_PATH = re.compile(r"^([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)(/.*)$")
_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def github_shorthand_host(api_url: str | None) -> str:
    """The host ``OWNER/NAME`` lives on: github.com, or the host of a GitHub Enterprise
    API URL (``RUNLANE_GITHUB_API_URL``), as ``codehost.factory.clone_source`` clones it."""
    url = (api_url or DEFAULT_GITHUB_API_URL).rstrip("/")
    if url == DEFAULT_GITHUB_API_URL:
        return GITHUB_HOST
    host = urlsplit(url).hostname
    return host.lower() if host else GITHUB_HOST


def shorthand_host_from_env(env: Mapping[str, str] | None = None) -> str:
    """``github_shorthand_host`` of ``RUNLANE_GITHUB_API_URL`` in ``env`` (the process's)."""
    env = os.environ if env is None else env
    return github_shorthand_host(env.get("RUNLANE_GITHUB_API_URL"))


def host_path_url(written: str) -> str | None:
    """``https://host.name/path`` for a repository written ``host.name/path`` (a URL
    without its scheme, as a browser's address bar shows it), else None. Git would
    take it for a relative path: the clone and the code host are given the URL."""
    text = written.strip()
    return f"https://{text}" if _HOST_PATH.match(text) else None


def has_glob(text: str) -> bool:
    return any(ch in GLOB_CHARS for ch in text)


def canonical_repo(written: str, *, github_host: str | None = None,
                   cwd: str | None = None) -> str:
    """The identity of the repository ``written`` names (see the module docstring).

    ``github_host``: where ``OWNER/NAME`` lives (default: from ``RUNLANE_GITHUB_API_URL``);
    ``cwd``: what a relative local path is relative to (default: the process's).
    Idempotent: ``canonical_repo(canonical_repo(x)) == canonical_repo(x)``.
    """
    return _canonical(written.strip(), pattern=False,
                      github_host=github_host or shorthand_host_from_env(), cwd=cwd)


def canonical_pattern(pattern: str, *, github_host: str | None = None,
                      cwd: str | None = None) -> str:
    """A policy's repository pattern (a glob) brought to the canonical form, so that it
    matches every spelling of the repositories it names. Without glob characters it
    is a repository: ``canonical_repo``. With them, they are kept as they are and the
    rest is read as ``canonical_repo`` reads a repository
    (``git@github.com:acme/*.git`` -> ``https://github.com/acme/*``); ``OWNER/NAME*``
    is GitHub (no file system is consulted: write ``./owner/*`` for a relative path).
    A pattern that starts with a glob character (``*/payments-*``) names no host or
    path to normalise and is kept as written."""
    text = pattern.strip()
    if not has_glob(text):  # a repository
        return canonical_repo(text, github_host=github_host, cwd=cwd) if text else pattern
    if text[0] in GLOB_CHARS:
        return pattern
    return _canonical(text, pattern=True,
                      github_host=github_host or shorthand_host_from_env(), cwd=cwd)


def _canonical(text: str, *, pattern: bool, github_host: str, cwd: str | None) -> str:
    github_hosts = frozenset({GITHUB_HOST, github_host.lower()})
    if url := _URL.match(text):
        scheme, netloc, path = url.group(1).lower(), url.group(2), url.group(3)
        if not pattern:  # a query or a fragment is no part of a repository's name
            netloc, slash, path = re.split(r"[?#]", netloc + path, maxsplit=1)[0].partition("/")
            path = slash + path
        host = _host(netloc)
        if scheme == "file":
            if host in ("", "localhost"):
                return _local(unquote(path) or "/", cwd)
            return f"file://{host}{_path(path, lower=False)}"
        return _remote(host, path, github_hosts)
    if text.startswith(("/", "~", "./", "../")) or text in (".", ".."):
        return _local(text, cwd)
    if scp := _SCP.match(text):
        path = scp.group(2)
        # A path, all of it: its ? and # are no query and no fragment (a pattern's ? is
        # a glob's).
        path = path.replace("#", "%23") if pattern else \
            path.replace("?", "%3F").replace("#", "%23")
        return _remote(scp.group(1).strip("[]"), path, github_hosts)
    if not pattern and os.path.lexists(os.path.join(cwd or os.getcwd(), text)):
        return _local(text, cwd)  # a path of that name exists: local, as for the code host
    short = (_SHORTHAND_PATTERN if pattern and has_glob(text) else _SHORTHAND).match(text)
    if short and short.group(2) not in (".", ".."):
        return _remote(github_host, f"/{short.group(1)}/{short.group(2)}", github_hosts)
    if _HOST_PATH.match(text):  # read as the https URL it is cloned from (host_path_url)
        return _canonical(f"https://{text}", pattern=pattern, github_host=github_host,
                          cwd=cwd)
    return _local(text, cwd)  # a relative path that does not exist here (yet)


def _host(netloc: str) -> str:
    """The host of a URL's authority: no credentials (up to the last ``@``), no port,
    no brackets around an IPv6 address; lower-cased."""
    host = netloc.rpartition("@")[2]
    if host.startswith("[") and ":" in host.partition("]")[0]:  # [::1], not a glob's [ab]
        host = host[1:].partition("]")[0]
    else:
        host = host.partition(":")[0]
    return host.lower()


def _remote(host: str, path: str, github_hosts: frozenset[str]) -> str:
    host = host.lower().rstrip(".")
    host = _HOST_ALIASES.get(host, host)
    shown = f"[{host}]" if ":" in host else host
    return f"https://{shown}{_path(path, lower=host in github_hosts)}"


def _path(path: str, *, lower: bool) -> str:
    """A remote repository's path: ``/a/b`` with no empty, ``.`` or ``..`` segment, no
    trailing ``.git``, percent-encoded unreserved characters decoded and the other
    escapes in upper case; ``""`` for none. Repeated until nothing changes, so each
    step's result (``x/...git`` leaves ``x/..``) is normalised again."""
    for _ in range(len(path) + 2):
        result = _path_once(path.lower() if lower else path)
        if result == path:
            return result
        path = result
    return path


def _path_once(path: str) -> str:
    path = _PERCENT.sub(_percent, path)
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    while segments and segments[-1].endswith(".git"):
        segments[-1] = segments[-1][: -len(".git")]
        if not segments[-1]:
            segments.pop()
    return "".join(f"/{s}" for s in segments)


def _percent(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED else f"%{match.group(1).upper()}"


def _local(path: str, cwd: str | None) -> str:
    absolute = os.path.join(cwd or os.getcwd(), os.path.expanduser(path))
    try:
        return os.path.realpath(absolute)
    except (ValueError, UnicodeError):  # a NUL, a lone surrogate: no such file anywhere
        return os.path.normpath(absolute)
