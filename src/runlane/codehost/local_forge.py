"""A code host for git repositories on disk that behaves like an external service.

``LocalForge`` keeps its pull requests in its own storage, outside runlane's
database: one JSON file per repository under a root directory. Numbers count
1, 2, 3 ... per repository; a second *open* pull request for the same head
branch is refused with ``PullRequestExists``, exactly as a hosted forge would.

Several processes (and threads) may use one root at once: every
read-modify-write holds an exclusive ``flock`` on a per-repository lock file and
the JSON file is replaced atomically (write a temporary file, fsync, rename), so
readers never see a torn file and need no lock.

Repositories are local paths (``/srv/git/app.git``, ``./app``, ``~/app``) or
``file://`` URLs; both name the same repository when they resolve to the same
absolute path. Bare and non-bare repositories both work.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from runlane.codehost.base import CodeHostError, PullRequest, PullRequestExists
from runlane.faults import pause_point

FORGE_DIR_ENV = "RUNLANE_FORGE_DIR"
GIT_TIMEOUT_SECONDS = 30.0
_FORMAT = 1


def default_forge_dir() -> Path:
    """``$RUNLANE_FORGE_DIR``, else ``$XDG_DATA_HOME/runlane/forge``, else
    ``~/.local/share/runlane/forge``."""
    explicit = os.environ.get(FORGE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home).expanduser() if data_home else Path.home() / ".local" / "share"
    return base / "runlane" / "forge"


def is_local_repo(repo: str) -> bool:
    """Whether ``repo`` names a repository on this machine: a ``file://`` URL, an
    absolute, home-relative or dot-relative path, or an existing path."""
    if repo.startswith("file://"):
        return True
    if "://" in repo or re.match(r"^[\w.-]+@[\w.-]+:", repo):
        return False  # another URL scheme, or scp-like ssh syntax (git@host:o/r)
    if repo.startswith(("/", "~", "./", "../")) or repo in (".", ".."):
        return True
    return Path(repo).exists()


def normalize_repo(repo: str) -> str:
    """The forge's key for a repository: its resolved absolute path.

    ``/x/repo.git``, ``/x/repo.git/``, ``/x/../x/repo.git`` and ``file:///x/repo.git``
    all give ``/x/repo.git`` (symbolic links resolved too).
    """
    if repo.startswith("file://"):
        parts = urlsplit(repo)
        if parts.netloc not in ("", "localhost"):
            raise CodeHostError(f"file URL with a remote host is not local: {repo}",
                                transient=False)
        path = unquote(parts.path)
    elif is_local_repo(repo):
        path = repo
    else:
        raise CodeHostError(f"not a local repository path or file:// URL: {repo}",
                            transient=False)
    if not path:
        raise CodeHostError(f"empty repository path: {repo!r}", transient=False)
    return str(Path(path).expanduser().resolve())


def _pr_from_record(repo: str, rec: dict[str, Any]) -> PullRequest:
    return PullRequest(repo=repo, number=int(rec["number"]), url=str(rec["url"]),
                       head_branch=str(rec["head_branch"]), base_branch=str(rec["base_branch"]),
                       title=str(rec["title"]), body=str(rec["body"]), state=str(rec["state"]))


class LocalForge:
    """Pull requests for local git repositories, stored under ``root``."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *,
                 check_base: bool = True) -> None:
        self.root = Path(root).expanduser() if root is not None else default_forge_dir()
        self.check_base = check_base
        self._deadline: float | None = None  # set_deadline: a time.monotonic() value

    # -- the CodeHost interface -------------------------------------------------

    def find_pull_request(self, repo: str, head_branch: str, marker: str) -> PullRequest | None:
        """The pull request from ``head_branch`` whose body carries ``marker``: the
        open one if there is one, else the newest closed one; None when none."""
        key = normalize_repo(repo)
        matches = [rec for rec in self._read(key)["pulls"]
                   if rec["head_branch"] == head_branch and marker in rec["body"]]
        if not matches:
            return None
        best = max(matches, key=lambda rec: (rec["state"] == "open", rec["number"]))
        return _pr_from_record(key, best)

    def open_pull_request(self, repo: str, *, head_branch: str, base_branch: str, title: str,
                          body: str) -> PullRequest:
        """Open pull request number N+1. Refuses (``PullRequestExists``) when one is
        open for ``head_branch``, and (``CodeHostError``, not transient) when the path
        is not a git repository or a branch does not exist in it."""
        key = normalize_repo(repo)
        if head_branch == base_branch:
            raise CodeHostError(f"head and base are the same branch: {head_branch}",
                                transient=False)
        self._require_branch(key, head_branch, "head")
        if self.check_base:
            self._require_branch(key, base_branch, "base")
        pause_point("before_pull_request_lock")  # the branches looked up, nothing written
        with self._locked(key):
            doc = self._read(key)
            for rec in doc["pulls"]:
                if rec["head_branch"] == head_branch and rec["state"] == "open":
                    raise PullRequestExists(
                        f"a pull request is already open for {head_branch} in {key}: "
                        f"#{rec['number']}")
            # The caller's deadline again, right before the write: a caller paused since
            # it checked its lease (during the git lookups above, or waiting for the
            # lock) writes nothing; what is left of the window is the write itself.
            self._time_left(f"open a pull request for {head_branch!r} in {key}")
            pause_point("before_pull_request_write")  # checked, not yet written
            number = int(doc["next_number"])
            rec = {"number": number, "url": f"forge://{key}/pulls/{number}",
                   "head_branch": head_branch, "base_branch": base_branch, "title": title,
                   "body": body, "state": "open", "created_at": time.time(),
                   "closed_at": None, "pid": os.getpid()}
            doc["pulls"].append(rec)
            doc["next_number"] = number + 1
            self._write(key, doc)
        return _pr_from_record(key, rec)

    def list_pull_requests(self, repo: str) -> list[PullRequest]:
        """Every pull request of the repository, open and closed, by number."""
        key = normalize_repo(repo)
        return [_pr_from_record(key, rec)
                for rec in sorted(self._read(key)["pulls"], key=lambda r: int(r["number"]))]

    # -- beyond the interface (tests, tooling) ------------------------------------

    def get_pull_request(self, repo: str, number: int) -> PullRequest | None:
        key = normalize_repo(repo)
        for rec in self._read(key)["pulls"]:
            if rec["number"] == number:
                return _pr_from_record(key, rec)
        return None

    def comment_on_pull_request(self, repo: str, number: int, body: str, *,
                                marker: str) -> bool:
        """Add a comment to pull request ``number`` unless one carrying ``marker`` is
        there already; True when added."""
        key = normalize_repo(repo)
        with self._locked(key):
            doc = self._read(key)
            for rec in doc["pulls"]:
                if rec["number"] == number:
                    comments = rec.setdefault("comments", [])
                    if any(marker in str(c.get("body", "")) for c in comments):
                        return False
                    comments.append({"body": body, "created_at": time.time(),
                                     "pid": os.getpid()})
                    self._write(key, doc)
                    return True
        raise CodeHostError(f"no pull request #{number} in {key}", transient=False)

    def comments(self, repo: str, number: int) -> list[str]:
        """The bodies of pull request ``number``'s comments, oldest first."""
        key = normalize_repo(repo)
        for rec in self._read(key)["pulls"]:
            if rec["number"] == number:
                return [str(c.get("body", "")) for c in rec.get("comments", [])]
        raise CodeHostError(f"no pull request #{number} in {key}", transient=False)

    def set_deadline(self, deadline: float | None) -> None:
        """Bound the git calls this forge makes (``time.monotonic()`` value, or None),
        and refuse to write a new pull request past it (checked under the lock, right
        before the write)."""
        self._deadline = deadline

    def _time_left(self, what: str) -> float:
        """Seconds until the caller's deadline (``GIT_TIMEOUT_SECONDS`` at most);
        raises a transient CodeHostError when it has passed."""
        if self._deadline is None:
            return GIT_TIMEOUT_SECONDS
        left = min(GIT_TIMEOUT_SECONDS, self._deadline - time.monotonic())
        if left <= 0:
            raise CodeHostError(f"no time left to {what}", transient=True)
        return left

    def close_pull_request(self, repo: str, number: int) -> PullRequest:
        """Close pull request ``number`` (repeating is harmless)."""
        key = normalize_repo(repo)
        with self._locked(key):
            doc = self._read(key)
            for rec in doc["pulls"]:
                if rec["number"] == number:
                    if rec["state"] != "closed":
                        rec["state"] = "closed"
                        rec["closed_at"] = time.time()
                        self._write(key, doc)
                    return _pr_from_record(key, rec)
        raise CodeHostError(f"no pull request #{number} in {key}", transient=False)

    def close(self) -> None:
        """Nothing to release; present so callers can close any code host."""

    # -- storage ---------------------------------------------------------------------

    def _stem(self, key: str) -> str:
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(key).name or "root")[:60]
        return f"{name}-{digest}"

    def _data_path(self, key: str) -> Path:
        return self.root / f"{self._stem(key)}.json"

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        """An exclusive lock on the repository's records, across processes and threads
        (``flock`` locks belong to the open file, so each call opens its own)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / f"{self._stem(key)}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _read(self, key: str) -> dict[str, Any]:
        path = self._data_path(key)
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"format": _FORMAT, "repo": key, "next_number": 1, "pulls": []}
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise CodeHostError(f"forge storage is corrupt: {path}: {exc}",
                                transient=False) from exc
        if not isinstance(doc, dict) or doc.get("repo") != key:
            raise CodeHostError(f"forge storage {path} does not belong to {key}",
                                transient=False)
        return doc

    def _write(self, key: str, doc: dict[str, Any]) -> None:
        """Replace the repository's file atomically: a reader sees the old or the new
        document, never a part of one, even if this process dies mid-write."""
        path = self._data_path(key)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # -- git ----------------------------------------------------------------------------

    def _require_branch(self, key: str, branch: str, role: str) -> None:
        if not Path(key).exists():
            raise CodeHostError(f"repository does not exist: {key}", transient=False)
        ref = f"refs/heads/{branch}"
        env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
        timeout = self._time_left(f"look {branch!r} up in {key}")
        try:
            proc = subprocess.run(["git", "ls-remote", "--heads", "--", key, ref],
                                  capture_output=True, text=True, env=env,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise CodeHostError(f"git ls-remote timed out on {key}", transient=True) from exc
        except OSError as exc:
            raise CodeHostError(f"cannot run git: {exc}", transient=False) from exc
        if proc.returncode != 0:
            detail = proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else ""
            raise CodeHostError(f"not a git repository: {key}: {detail}", transient=False)
        refs = {line.split("\t", 1)[1] for line in proc.stdout.splitlines() if "\t" in line}
        if ref not in refs:
            raise CodeHostError(f"{role} branch {branch!r} does not exist in {key}",
                                transient=False)
