"""Git workspaces: a fresh clone per attempt, what the agent changed, the run's commit
and its push. Uses the git CLI (no library), each call in its own process group so a
timeout kills git's helpers too (``git-remote-https``, ``ssh``).

Every question about changes is asked relative to the commit the clone started
from (``base_sha``), not to ``HEAD``: an agent that commits on its own still has
its changes counted, and :meth:`Workspace.commit_all` squashes them into the one
commit that carries the run's trailer.

Hardening against what an agent may leave in its clone: git never runs hooks
(``core.hooksPath=/dev/null``, ``--no-verify``), fsmonitor, external diff drivers or
textconv filters for us; ``ls-remote`` and ``push`` go to the URL recorded right
after the clone, not to whatever ``origin`` says later. (Repository configuration
the agent writes, e.g. ``url.*.insteadOf`` or clean filters, is still read by git;
the agent runs with the worker's own rights anyway.)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runlane.agents.base import AttemptLimits
from runlane.errors import RunlaneError, redact_credentials

AUTHOR_NAME = "runlane"
AUTHOR_EMAIL = "runlane@localhost"
DEFAULT_TIMEOUT_SECONDS = 300.0
LOCAL_TIMEOUT_SECONDS = 120.0  # for git commands that do not touch the network

# Options on every git call: nothing an agent wrote into its clone runs for us.
_SAFE = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
         "-c", "commit.gpgsign=false", "-c", "core.quotePath=false")
# Variables that would point git at another repository than the one in cwd.
_REPO_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
              "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_COMMON_DIR",
              "GIT_PREFIX")


class WorkspaceError(RunlaneError):
    """A git operation failed; ``transient`` says whether retrying may help."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(redact_credentials(message))
        self.transient = transient


class CloneFailed(WorkspaceError):
    """The task's repository could not be cloned."""


class PushFailed(WorkspaceError):
    """The run's branch could not be pushed (or looked up on the remote)."""


class AgentLeftBadTree(WorkspaceError):
    """What the agent left cannot be committed as it is (a git repository of its own
    inside the workspace): the agent's doing, not runlane's."""


# --- classification of git's complaints ----------------------------------------

# Checked first: the remote answered, and what it said will not change on a retry.
_PERMANENT = re.compile("|".join((
    r"does not exist",
    r"not found",
    r"does not appear to be a git repository",
    r"not a git repository",
    r"authentication failed",
    r"permission denied",
    r"could not read (username|password)",
    r"invalid username or password",
    r"host key verification failed",
    r"access denied",
    r"forbidden",
    r"returned error: 4\d\d",  # HTTP 4xx, except the two below (matched as transient)
    r"http 4\d\d",
    r"\[rejected\]",
    r"\[remote rejected\]",
    r"non-fast-forward",
)))
_TRANSIENT_HTTP_4XX = re.compile(r"(returned error:|http) (408|429)\b")
# The network or the server failed: worth another attempt.
_TRANSIENT = re.compile("|".join((
    r"could not resolve host",
    r"couldn't resolve host",
    r"could not resolve proxy",
    r"temporary failure in name resolution",
    r"connection refused",
    r"connection timed out",
    r"connection reset",
    r"operation timed out",
    r"timed out",
    r"early eof",
    r"remote end hung up",
    r"unexpected disconnect",
    r"network is unreachable",
    r"no route to host",
    r"failed to connect",
    r"couldn't connect to server",
    r"could not connect to server",
    r"empty reply from server",
    r"transfer closed",
    r"gnutls",
    r"ssl_(connect|read|write)|tls connection",
    r"returned error: 5\d\d",
    r"http 5\d\d",
    r"rpc failed",
    r"broken pipe",
)))


def is_transient(stderr: str) -> bool:
    """Whether a failed git network operation may succeed when retried, from its stderr
    (git runs with LC_ALL=C, so the messages are the English ones)."""
    text = stderr.lower()
    if _TRANSIENT_HTTP_4XX.search(text):
        return True
    if _PERMANENT.search(text):
        return False
    return bool(_TRANSIENT.search(text))  # unknown: permanent ("Could not read from
    # remote repository" alone, e.g., is as often an access problem as a network one)


def _summary(stderr: str, limit: int = 2000) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    # Redacted before it is cut (a cut inside a URL's user:secret@ would keep the secret);
    # WorkspaceError redacts its whole message anyway.
    text = redact_credentials(" | ".join(lines)) or "no message"
    return text if len(text) <= limit else text[:limit] + "..."


# --- running git ---------------------------------------------------------------


@dataclass(frozen=True)
class _Done:
    code: int
    stdout: bytes
    stderr: str
    timed_out: bool = False


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _REPO_VARS}
    env.update(LC_ALL="C", LANGUAGE="C", GIT_TERMINAL_PROMPT="0", GCM_INTERACTIVE="never")
    if extra:
        env.update(extra)
    return env


def _git(args: list[str], *, cwd: Path | None, timeout: float,
         env: dict[str, str] | None = None, stdin: bytes | None = None) -> _Done:
    """Run git; on timeout kill its whole process group."""
    proc = subprocess.Popen(
        ["git", *_SAFE, *args], cwd=cwd, env=_env(env),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return _Done(proc.returncode, out, err.decode("utf-8", "replace"), timed_out=True)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return _Done(proc.returncode, out, err.decode("utf-8", "replace"))


def _rmtree(path: Path) -> None:
    """Remove a tree even where an agent left it read-only; a missing path is fine."""

    def retry(func: Callable[..., Any], failed: str, *_: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            os.chmod(failed, stat.S_IRWXU)
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile by another
            func(failed)

    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)


def _count_lines(path: Path) -> int:
    """Lines git would count for a new file: 0 for a binary one, 1 for a symlink."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISLNK(st.st_mode):
        return 1
    if not stat.S_ISREG(st.st_mode):
        return 0
    lines = 0
    last = b""
    with open(path, "rb") as f:
        first = True
        while chunk := f.read(1 << 16):
            if first and b"\0" in chunk[:8000]:
                return 0  # git's binary heuristic
            first = False
            lines += chunk.count(b"\n")
            last = chunk
    return lines + (1 if last and not last.endswith(b"\n") else 0)


# --- the workspace -------------------------------------------------------------


class Workspace:
    """A clone of the task's repository for one attempt."""

    def __init__(self, path: Path, *, remote_url: str, base_branch: str,
                 base_sha: str | None, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.path = path
        self._lock_fd: int | None = None  # held while this attempt uses the clone
        # The agent's changes as a tree, taken when it exited (keep_agent_tree): what
        # the finalizer commits, whatever the verify command writes afterwards.
        self.agent_tree: str | None = None
        self.remote_url = remote_url  # origin's URL as the clone recorded it
        self._base_branch = base_branch
        self.base_sha = base_sha  # the commit the clone checked out; None: empty repo
        self.timeout = timeout  # for network operations (ls-remote, push)

    def __repr__(self) -> str:
        return f"Workspace({str(self.path)!r}, base={self._base_branch}@{self.base_sha})"

    @classmethod
    def clone(cls, repo: str, root: Path, name: str, *,
              timeout: float = DEFAULT_TIMEOUT_SECONDS) -> Workspace:
        """A fresh clone of ``repo`` (a local path, file:// URL or any git URL) into
        ``root/name`` (removed first if it exists). Raises CloneFailed; ``transient``
        for network failures and for a clone that took longer than ``timeout``."""
        if not name or name in (".", "..") or "/" in name or os.sep in name:
            raise ValueError(f"bad workspace name {name!r}")
        root.mkdir(parents=True, exist_ok=True)
        dest = (root / name).absolute()
        lock_fd = _hold(_lock_path(dest))  # ours for the attempt's life (remove_named)
        try:
            return cls._cloned(repo, dest, lock_fd, timeout)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                _lock_path(dest).unlink()
            os.close(lock_fd)
            raise

    @classmethod
    def _cloned(cls, repo: str, dest: Path, lock_fd: int, timeout: float) -> Workspace:
        _rmtree(dest)
        if repo.startswith("~"):  # a local path of the user's (submit accepts it)
            repo = os.path.expanduser(repo)
        done = _git(["clone", "--quiet", "--", repo, str(dest)], cwd=None, timeout=timeout)
        if done.timed_out or done.code != 0:
            _rmtree(dest)
            if done.timed_out:
                raise CloneFailed(f"git clone of {repo} timed out after {timeout:g} s",
                                  transient=True)
            raise CloneFailed(f"git clone of {repo} failed: {_summary(done.stderr)}",
                              transient=is_transient(done.stderr))
        try:
            remote_url = _local(["config", "--get", "remote.origin.url"], dest).strip()
            branch = _git(["symbolic-ref", "--quiet", "--short", "HEAD"], cwd=dest,
                          timeout=LOCAL_TIMEOUT_SECONDS).stdout.decode().strip()
            sha = _git(["rev-parse", "--verify", "--quiet", "HEAD^{commit}"], cwd=dest,
                       timeout=LOCAL_TIMEOUT_SECONDS).stdout.decode().strip()
            if not sha and _local(["for-each-ref", "--count=1", "refs/remotes/origin/"],
                                  dest).strip():
                # The remote's HEAD names a branch it does not have (`git init --bare`,
                # then a push of main): not an empty repository. Running the agent in
                # an empty directory pushed a root commit with no common history.
                raise CloneFailed(
                    f"{repo}: its HEAD names no branch it has, so it has no "
                    "default branch to work on (set it: git symbolic-ref HEAD "
                    "refs/heads/<branch> in the repository)")
        except WorkspaceError:
            _rmtree(dest)
            raise
        workspace = cls(dest, remote_url=remote_url or repo, base_branch=branch or "main",
                        base_sha=sha or None, timeout=timeout)
        workspace._lock_fd = lock_fd
        return workspace

    # --- what changed ----------------------------------------------------------

    def _base(self) -> str:
        """The commit (or, for an empty repository, the empty tree) to compare with."""
        if self.base_sha is not None:
            return self.base_sha
        return _local(["hash-object", "-t", "tree", "--stdin"], self.path, stdin=b"").strip()

    def _untracked(self) -> list[str]:
        out = _local(["ls-files", "--others", "--exclude-standard", "-z"], self.path)
        return [p for p in out.split("\0") if p]

    def changed_files(self) -> list[str]:
        """Paths changed since the clone: tracked ones modified, added or deleted, and
        untracked ones not ignored; sorted."""
        out = _local(["diff", "--no-ext-diff", "--no-textconv", "--no-renames",
                      "--name-only", "-z", self._base(), "--"], self.path)
        return sorted({p for p in out.split("\0") if p} | set(self._untracked()))

    def diff_line_count(self) -> int:
        """Lines added plus lines removed since the clone, untracked files included
        (binary files count 0, as in ``git diff --numstat``)."""
        out = _local(["diff", "--no-ext-diff", "--no-textconv", "--no-renames",
                      "--numstat", "-z", self._base(), "--"], self.path)
        total = 0
        for record in out.split("\0"):
            parts = record.split("\t")
            if len(parts) >= 2:
                total += sum(int(n) for n in parts[:2] if n.isdigit())
        return total + sum(_count_lines(self.path / p) for p in self._untracked())

    def has_changes(self) -> bool:
        if self.agent_tree is not None:
            return self.agent_tree != self._base_tree()
        return bool(self.changed_files())

    def _base_tree(self) -> str:
        return _local(["rev-parse", f"{self._base()}^{{tree}}"], self.path).strip()

    def _tree_of_the_worktree(self) -> str:
        """Every change since the clone, as a tree (in an index of its own). Raises
        AgentLeftBadTree for a git repository the agent made inside the workspace: it
        would be committed as a bare gitlink (no files, no .gitmodules), or not at all."""
        base = self._base()
        with tempfile.TemporaryDirectory(prefix="runlane-index-") as tmp:
            index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            _local(["read-tree", base], self.path, env=index)
            added = _git(["add", "--all", "--", "."], cwd=self.path,
                         timeout=LOCAL_TIMEOUT_SECONDS, env=index)
            if added.timed_out or added.code != 0:
                raise AgentLeftBadTree(
                    f"the agent's changes cannot be committed: {_summary(added.stderr)}")
            tree = _local(["write-tree"], self.path, env=index).strip()
        links = set(_local(["ls-tree", "-r", "-z", tree], self.path).split("\0")) - set(
            _local(["ls-tree", "-r", "-z", base], self.path).split("\0"))
        nested = sorted(entry.partition("\t")[2] for entry in links
                        if entry.startswith("160000 "))
        if nested:
            raise AgentLeftBadTree(
                f"the agent left a git repository of its own at {', '.join(nested)}: "
                "remove its .git (to commit its files) or leave it out of the workspace")
        return tree

    def keep_agent_tree(self) -> None:
        """Take the agent's changes as they are when it exits: the finalizer commits
        them, and ``has_changes`` asks about them, whatever runs in the workspace
        afterwards (a verify command's caches and reports are not the agent's work)."""
        self.agent_tree = self._tree_of_the_worktree()

    def check_limits(self, limits: AttemptLimits) -> str | None:
        """Why the changes exceed the attempt's limits, or None when they do not."""
        if limits.max_changed_files is not None:
            files = len(self.changed_files())
            if files > limits.max_changed_files:
                return (f"{files} changed files, over the limit of "
                        f"{limits.max_changed_files}")
        if limits.max_diff_lines is not None:
            lines = self.diff_line_count()
            if lines > limits.max_diff_lines:
                return f"{lines} changed lines, over the limit of {limits.max_diff_lines}"
        return None

    # --- the run's commit and its push -----------------------------------------

    def commit_all(self, branch: str, message: str, trailer: str, *,
                   timestamp: int | None = None) -> str:
        """Commit every change since the clone as one commit on ``branch`` (created, or
        reset, with the clone's base commit as parent; HEAD moves to it). The message
        ends with ``trailer`` as its own paragraph. Author and committer are
        runlane <runlane@localhost>; with ``timestamp`` (Unix seconds) the dates are
        fixed too, so the same changes give the same sha. Returns the commit's sha.
        Raises WorkspaceError when there is nothing to commit."""
        if _git(["check-ref-format", f"refs/heads/{branch}"], cwd=self.path,
                timeout=LOCAL_TIMEOUT_SECONDS).code != 0:
            raise WorkspaceError(f"invalid branch name {branch!r}")
        tree = self.agent_tree or self._tree_of_the_worktree()
        if tree == self._base_tree():
            raise WorkspaceError("nothing to commit: the workspace has no changes")
        who = {"GIT_AUTHOR_NAME": AUTHOR_NAME, "GIT_AUTHOR_EMAIL": AUTHOR_EMAIL,
               "GIT_COMMITTER_NAME": AUTHOR_NAME, "GIT_COMMITTER_EMAIL": AUTHOR_EMAIL}
        if timestamp is not None:
            who["GIT_AUTHOR_DATE"] = who["GIT_COMMITTER_DATE"] = f"@{int(timestamp)} +0000"
        parent = ["-p", self.base_sha] if self.base_sha is not None else []
        sha = _local(["commit-tree", tree, *parent, "-m", message.strip() or "runlane agent run",
                      "-m", trailer], self.path, env=who).strip()
        _local(["update-ref", "-m", "runlane: commit_all", f"refs/heads/{branch}", sha],
               self.path)
        _local(["symbolic-ref", "HEAD", f"refs/heads/{branch}"], self.path)
        _local(["reset", "--quiet", "--mixed"], self.path)  # index = the new commit
        return sha

    def remote_commit_carries(self, sha: str, trailer: str, *,
                              timeout: float | None = None) -> bool:
        """Whether the remote's commit ``sha`` (fetched if this clone lacks it) has
        ``trailer`` in its message: the mark of runlane's own commit for the run.
        ``timeout`` (seconds) caps the fetch below the workspace's own."""
        have = _git(["cat-file", "-e", f"{sha}^{{commit}}"], cwd=self.path,
                    timeout=LOCAL_TIMEOUT_SECONDS)
        if have.code != 0:
            done = _git(["fetch", "--quiet", "--no-tags", "--", self.remote_url, sha],
                        cwd=self.path, timeout=self._capped(timeout))
            if done.timed_out or done.code != 0:
                raise PushFailed(f"cannot fetch {sha} from the remote: "
                                 f"{'timed out' if done.timed_out else _summary(done.stderr)}",
                                 transient=done.timed_out or is_transient(done.stderr))
        message = _local(["log", "-1", "--format=%B", sha], self.path)
        return trailer in message.splitlines()

    def remote_branch_sha(self, branch: str, *, timeout: float | None = None) -> str | None:
        """The sha of ``branch`` on the remote, or None when it has no such branch.
        Raises PushFailed when the remote cannot be asked. ``timeout`` (seconds) caps
        the call below the workspace's own."""
        return remote_branch_sha(self.remote_url, branch, timeout=self._capped(timeout),
                                 cwd=self.path)

    def push(self, branch: str, *, expected: str | None = None,
             timeout: float | None = None) -> None:
        """Push the local ``branch`` to the same name on the remote, only if the remote's
        branch is what the caller saw: ``expected`` its commit, None for no branch at
        all (``--force-with-lease=REF:EXPECTED``). Whatever landed there since (a push
        that outlived its lease, the agent's own push) is never overwritten unseen: the
        push is rejected. ``timeout`` (seconds) caps the push below the workspace's own
        (the finalizer passes what its lease has left)."""
        ref = f"refs/heads/{branch}"
        timeout = self._capped(timeout)
        done = _git(["push", "--quiet", "--no-verify",
                     f"--force-with-lease={ref}:{expected or ''}", "--", self.remote_url,
                     f"{ref}:{ref}"], cwd=self.path, timeout=timeout)
        if done.timed_out:
            raise PushFailed(f"git push timed out after {timeout:g} s", transient=True)
        if done.code != 0:
            raise PushFailed(f"git push of {branch} failed: {_summary(done.stderr)}",
                             transient=is_transient(done.stderr))

    def base_branch(self) -> str:
        """The branch the clone checked out: the remote's default branch."""
        return self._base_branch

    def _capped(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else max(0.0, min(self.timeout, timeout))

    def remove(self) -> None:
        """Delete the clone; safe to call again."""
        _rmtree(self.path)
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                _lock_path(self.path).unlink()
        self.release()

    def release(self) -> None:
        """Let go of the clone's lock, keeping the clone (kept for inspection)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @staticmethod
    def remove_named(root: Path, name: str) -> bool:
        """Delete the clone ``root/name`` if its attempt is gone: the process that
        cloned it holds its lock file while it lives (a SIGKILL releases it; a stopped
        or still running attempt keeps it, and removes its clone itself). True when
        removed."""
        if not name or name in (".", "..") or "/" in name or os.sep in name:
            return False
        dest = (root / name).absolute()
        lock = _lock_path(dest)
        if not dest.exists() and not lock.exists():
            return False
        try:
            fd = _hold(lock, wait=False)
        except BlockingIOError:
            return False  # its attempt is alive
        try:
            _rmtree(dest)
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        finally:
            os.close(fd)
        return True


def remote_branch_sha(url: str, branch: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                      cwd: Path | None = None) -> str | None:
    """The sha of ``branch`` at the repository ``url`` (``git ls-remote``), None when
    it has no such branch; without a clone (a withdrawal records the branch it finds).
    Raises PushFailed when the remote cannot be asked."""
    ref = f"refs/heads/{branch}"
    done = _git(["ls-remote", "--", url, ref], cwd=cwd, timeout=timeout)
    if done.timed_out:
        raise PushFailed(f"git ls-remote timed out after {timeout:g} s", transient=True)
    if done.code != 0:
        raise PushFailed(f"git ls-remote failed: {_summary(done.stderr)}",
                         transient=is_transient(done.stderr))
    for line in done.stdout.decode().splitlines():
        sha, _, name = line.partition("\t")
        if name == ref:
            return sha
    return None


def _lock_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".lock")


def _hold(lock: Path, *, wait: bool = True) -> int:
    """An exclusive flock on ``lock`` (created): its descriptor. Raises
    BlockingIOError when another process holds it and ``wait`` is false."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _local(args: list[str], cwd: Path, *, env: dict[str, str] | None = None,
           stdin: bytes | None = None) -> str:
    """A git command that does not touch the network; its stdout, or WorkspaceError."""
    done = _git(args, cwd=cwd, timeout=LOCAL_TIMEOUT_SECONDS, env=env, stdin=stdin)
    if done.timed_out or done.code != 0:
        what = "timed out" if done.timed_out else f"failed: {_summary(done.stderr)}"
        raise WorkspaceError(f"git {args[0]} {what}")
    return done.stdout.decode("utf-8", "surrogateescape")
