"""Git workspaces: a fresh clone per attempt, what the agent changed, the run's commit
and its push. Uses the git CLI (no library), each call in its own process group so a
timeout kills git's helpers too (``git-remote-https``, ``ssh``).

Every question about changes is asked relative to the commit the clone started
from (``base_sha``), not to ``HEAD``: an agent that commits on its own still has
its changes counted, and :meth:`Workspace.commit_all` squashes them into the one
commit that carries the run's trailer.

Hardening against what an agent may leave in its clone (its ``.git`` is the agent's:
it can write any configuration there, replace it with a ``gitdir:`` file or a symbolic
link, plant alternates or replace objects). The worker never asks that ``.git``
anything once the agent has started: right after the clone, before the agent runs,
it copies the clone's git directory to one of its own beside the workspace
(``WORKSPACE_DIR/<name>.git``, out of the agent's sight in the sandbox), and every
later git call of the worker runs with ``--git-dir`` that copy and ``--work-tree``
the workspace. On every call, the clone included, git reads no configuration file
(``GIT_CONFIG_NOSYSTEM``, ``GIT_CONFIG_GLOBAL=/dev/null``, and the copy's own config is
the one git wrote when it cloned), runs in a minimal environment with ``-c`` overrides
(no hooks, fsmonitor, excludes or attributes files of the home directory), and speaks
only the protocols the task validator accepts (``GIT_ALLOW_PROTOCOL``: no ``ext::`` or other
remote helpers). The worker's own credential, HTTP and ssh settings (from its system
and global configuration, read when it clones) are passed on through
``GIT_CONFIG_COUNT``, so git's credential helpers still authenticate the clone and
the push. A local repository is cloned with ``--no-hardlinks``: a hard-linked object
file, rewritten in place by the agent, changed the origin repository itself.
``ls-remote`` and ``push`` go to the URL recorded right after the clone.

Git dies with its worker: every git process gets ``PR_SET_PDEATHSIG`` SIGKILL (a
SIGKILLed worker's clone or push does not run on into the next attempt's cleanup),
and every git call on a workspace inherits the workspace's lock descriptor, so the
lock (an ``flock`` on the open file) is held while any git process of the attempt,
or a helper it started (``ssh``, ``git-remote-https``), still lives: a later
attempt's :meth:`Workspace.remove_named` never deletes a tree a live git writes to.
"""

from __future__ import annotations

import contextlib
import errno
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
from runlane.children import dying_with_parent
from runlane.errors import RunlaneError, redact_credentials

AUTHOR_NAME = "runlane"
AUTHOR_EMAIL = "runlane@localhost"
DEFAULT_TIMEOUT_SECONDS = 300.0
LOCAL_TIMEOUT_SECONDS = 120.0  # for git commands that do not touch the network

# Options on every git call: nothing an agent wrote runs for us, and nothing of the
# worker's home directory decides what is committed.
_SAFE = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
         "-c", "commit.gpgsign=false", "-c", "core.quotePath=false",
         "-c", "core.excludesFile=/dev/null", "-c", "core.attributesFile=/dev/null")
# The transports of the repositories the task validator accepts (domain/tasks.py: a
# path or file://, http(s), ssh and scp-like user@host:path, git://). Not ``ext::``
# nor any other remote helper (``foo::url`` runs ``git-remote-foo``).
ALLOWED_PROTOCOLS = ("file", "git", "http", "https", "ssh")
# What git is given of the worker's environment: how to find programs, and what the
# worker's credential helpers, proxies, TLS and ssh need. Nothing else: no GIT_DIR,
# GIT_CONFIG_*, GIT_EXEC_PATH, GIT_TEMPLATE_DIR, GIT_TRACE* (which logs credentials)...
_PASSED_VARS = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "SSH_AUTH_SOCK", "GIT_SSH",
    "GIT_SSH_COMMAND", "GIT_SSH_VARIANT", "http_proxy", "https_proxy", "HTTPS_PROXY",
    "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "CURL_CA_BUNDLE", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME",
    "XDG_STATE_HOME", "XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS", "GH_TOKEN",
    "GH_ENTERPRISE_TOKEN", "GH_HOST", "GH_CONFIG_DIR", "GITHUB_TOKEN"})
_PASSED_PREFIXES = ("GIT_SSL_", "GCM_")
# The worker's own settings git is given (from its system and global configuration):
# what authenticates it and reaches the remote. Not url.*.insteadOf (the push goes to
# the task's URL), filters, core.* programs or anything else.
_CARRIED_SECTIONS = ("credential.", "http.")
_CARRIED_KEYS = frozenset({"core.sshcommand", "ssh.variant"})
# Variables that would point git at another repository than the one in cwd.
_REPO_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
              "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_COMMON_DIR",
              "GIT_PREFIX")

GitConfig = tuple[tuple[str, str], ...]


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


def worker_git_config() -> GitConfig:
    """The worker's own credential, HTTP and ssh settings, in order, from its system and
    global git configuration (never a repository's): what its git calls are given, so
    that git's credential helpers of the worker's user authenticate the clone and the
    push while nothing the agent writes can add a helper."""
    env = {k: v for k, v in os.environ.items() if k not in _REPO_VARS}
    env.update(LC_ALL="C", LANGUAGE="C")
    try:
        done = subprocess.run(["git", "config", "--null", "--show-scope", "--includes",
                               "--list"], cwd="/", env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=LOCAL_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkspaceError(f"cannot read the worker's git configuration: {exc}") from None
    if done.returncode != 0:
        raise WorkspaceError("cannot read the worker's git configuration: "
                             + _summary(done.stderr.decode("utf-8", "replace")))
    fields = done.stdout.decode("utf-8", "surrogateescape").split("\0")
    carried = []
    for scope, entry in zip(fields[0::2], fields[1::2], strict=False):
        key, newline, value = entry.partition("\n")
        if scope in ("system", "global") and (
                key.startswith(_CARRIED_SECTIONS) or key in _CARRIED_KEYS):
            carried.append((key, value if newline else "true"))  # a bare key is true
    return tuple(carried)


def _env(config: GitConfig, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k in _PASSED_VARS or k.startswith(_PASSED_PREFIXES)}
    env.update(LC_ALL="C", LANGUAGE="C", GIT_TERMINAL_PROMPT="0", GCM_INTERACTIVE="never",
               GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
               GIT_ALLOW_PROTOCOL=":".join(ALLOWED_PROTOCOLS), GIT_CONFIG_COUNT=str(len(config)))
    for i, (key, value) in enumerate(config):  # in the environment, not argv: a token
        env[f"GIT_CONFIG_KEY_{i}"] = key       # in http.extraHeader stays out of ps
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    if extra:
        env.update(extra)
    return env


def _git(args: list[str], *, cwd: Path | None, timeout: float, config: GitConfig = (),
         env: dict[str, str] | None = None, stdin: bytes | None = None,
         hold: int | None = None) -> _Done:
    """Run git; on timeout kill its whole process group. What it creates is the
    worker's alone (umask 077). It dies with the worker (runlane.children);
    ``hold``: the workspace's lock descriptor, inherited by git and every process it
    starts, so the lock outlives none of them."""
    argv, preexec = dying_with_parent(["git", *_SAFE, *args])
    proc = subprocess.Popen(
        argv, cwd=cwd, env=_env(config, env), umask=0o077,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=preexec, pass_fds=() if hold is None else (hold,))
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
            if not os.path.islink(failed):  # chmod follows links: a link the agent left
                os.chmod(failed, stat.S_IRWXU)  # to a file of the worker's stays as is
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
    """A clone of the task's repository for one attempt, and the worker's own git
    directory for it (``<path>.git``): what the worker asks git once the agent has
    started goes there, never to the clone's ``.git``."""

    def __init__(self, path: Path, *, remote_url: str, base_branch: str,
                 base_sha: str | None, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                 git_config: GitConfig | None = None) -> None:
        self.path = path
        self.git_dir = _git_dir_of(path)
        self._lock_fd: int | None = None  # held while this attempt uses the clone
        # The agent's changes as a tree, taken when it exited (keep_agent_tree): what
        # the finalizer commits, whatever the verify command writes afterwards.
        self.agent_tree: str | None = None
        self.remote_url = remote_url  # origin's URL as the clone recorded it
        self._base_branch = base_branch
        self.base_sha = base_sha  # the commit the clone checked out; None: empty repo
        self.timeout = timeout  # for network operations (ls-remote, push)
        self._config = worker_git_config() if git_config is None else git_config

    def __repr__(self) -> str:
        return f"Workspace({str(self.path)!r}, base={self._base_branch}@{self.base_sha})"

    @classmethod
    def clone(cls, repo: str, root: Path, name: str, *,
              timeout: float = DEFAULT_TIMEOUT_SECONDS) -> Workspace:
        """A fresh clone of ``repo`` (a local path, file:// URL or any git URL) into
        ``root/name`` (removed first if it exists), and the worker's git directory
        ``root/name.git``. Raises CloneFailed; ``transient`` for network failures and
        for a clone that took longer than ``timeout``."""
        if not name or name in (".", "..") or "/" in name or os.sep in name:
            raise ValueError(f"bad workspace name {name!r}")
        make_private_dirs(root)
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
        git_dir = _git_dir_of(dest)
        _rmtree(dest)
        _rmtree(git_dir)
        if repo.startswith("~"):  # a local path of the user's (submit accepts it)
            repo = os.path.expanduser(repo)
        try:
            config = worker_git_config()
        except WorkspaceError as exc:
            raise CloneFailed(str(exc)) from None
        # --no-hardlinks: a clone of a path hard-links the origin's object files, and
        # an agent that rewrote one in place changed the origin repository.
        done = _git(["clone", "--quiet", "--no-hardlinks", "--", repo, str(dest)], cwd=None,
                    timeout=timeout, config=config, hold=lock_fd)
        if done.timed_out or done.code != 0:
            _rmtree(dest)
            if done.timed_out:
                raise CloneFailed(f"git clone of {repo} timed out after {timeout:g} s",
                                  transient=True)
            raise CloneFailed(f"git clone of {repo} failed: {_summary(done.stderr)}",
                              transient=is_transient(done.stderr))
        try:
            cloned = dest / ".git"  # the agent has not run yet
            remote_url = _local(["config", "--get", "remote.origin.url"], cloned,
                                hold=lock_fd).strip()
            branch = _git(["--git-dir", str(cloned), "symbolic-ref", "--quiet", "--short",
                           "HEAD"], cwd=cloned, timeout=LOCAL_TIMEOUT_SECONDS, hold=lock_fd
                          ).stdout.decode().strip()
            sha = _git(["--git-dir", str(cloned), "rev-parse", "--verify", "--quiet",
                        "HEAD^{commit}"], cwd=cloned, timeout=LOCAL_TIMEOUT_SECONDS,
                       hold=lock_fd).stdout.decode().strip()
            if not sha and _local(["for-each-ref", "--count=1", "refs/remotes/origin/"],
                                  cloned, hold=lock_fd).strip():
                # The remote's HEAD names a branch it does not have (`git init --bare`,
                # then a push of main): not an empty repository. Running the agent in
                # an empty directory pushed a root commit with no common history.
                raise CloneFailed(
                    f"{repo}: its HEAD names no branch it has, so it has no "
                    "default branch to work on (set it: git symbolic-ref HEAD "
                    "refs/heads/<branch> in the repository)")
            _copy_git_dir(dest, git_dir, timeout, hold=lock_fd)
        except WorkspaceError:
            _rmtree(dest)
            _rmtree(git_dir)
            raise
        workspace = cls(dest, remote_url=remote_url or repo, base_branch=branch or "main",
                        base_sha=sha or None, timeout=timeout, git_config=config)
        workspace._lock_fd = lock_fd
        return workspace

    def _git(self, args: list[str], *, timeout: float = LOCAL_TIMEOUT_SECONDS,
             env: dict[str, str] | None = None, stdin: bytes | None = None) -> _Done:
        """git on the worker's own git directory, with the workspace as work tree."""
        return _git(["--git-dir", str(self.git_dir), "--work-tree", str(self.path), *args],
                    cwd=self.path, timeout=timeout, config=self._config, env=env, stdin=stdin,
                    hold=self._lock_fd)

    def _local(self, args: list[str], *, env: dict[str, str] | None = None,
               stdin: bytes | None = None) -> str:
        """A git command that does not touch the network; its stdout, or WorkspaceError."""
        return _stdout(args[0], self._git(args, env=env, stdin=stdin))

    # --- what changed ----------------------------------------------------------

    def _base(self) -> str:
        """The commit (or, for an empty repository, the empty tree) to compare with."""
        if self.base_sha is not None:
            return self.base_sha
        return self._local(["hash-object", "-t", "tree", "--stdin"], stdin=b"").strip()

    def _untracked(self) -> list[str]:
        out = self._local(["ls-files", "--others", "--exclude-standard", "-z"])
        return [p for p in out.split("\0") if p]

    def changed_files(self) -> list[str]:
        """Paths changed since the clone: tracked ones modified, added or deleted, and
        untracked ones not ignored; sorted."""
        out = self._local(["diff", "--no-ext-diff", "--no-textconv", "--no-renames",
                           "--name-only", "-z", self._base(), "--"])
        return sorted({p for p in out.split("\0") if p} | set(self._untracked()))

    def diff_line_count(self) -> int:
        """Lines added plus lines removed since the clone, untracked files included
        (binary files count 0, as in ``git diff --numstat``)."""
        out = self._local(["diff", "--no-ext-diff", "--no-textconv", "--no-renames",
                           "--numstat", "-z", self._base(), "--"])
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
        return self._local(["rev-parse", f"{self._base()}^{{tree}}"]).strip()

    def _tree_of_the_worktree(self) -> str:
        """Every change since the clone, as a tree (in an index of its own). Raises
        AgentLeftBadTree for a git repository the agent made inside the workspace: it
        would be committed as a bare gitlink (no files, no .gitmodules), or not at all."""
        base = self._base()
        with tempfile.TemporaryDirectory(prefix="runlane-index-") as tmp:
            index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            self._local(["read-tree", base], env=index)
            added = self._git(["add", "--all", "--", "."], env=index)
            if added.timed_out or added.code != 0:
                raise AgentLeftBadTree(
                    f"the agent's changes cannot be committed: {_summary(added.stderr)}")
            tree = self._local(["write-tree"], env=index).strip()
        links = set(self._local(["ls-tree", "-r", "-z", tree]).split("\0")) - set(
            self._local(["ls-tree", "-r", "-z", base]).split("\0"))
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
                return (f"max_changed_files {limits.max_changed_files} exceeded: "
                        f"{files} changed files")
        if limits.max_diff_lines is not None:
            lines = self.diff_line_count()
            if lines > limits.max_diff_lines:
                return f"max_diff_lines {limits.max_diff_lines} exceeded: {lines} changed lines"
        return None

    # --- the run's commit and its push -----------------------------------------

    def commit_all(self, branch: str, message: str, trailer: str, *,
                   timestamp: int | None = None) -> str:
        """Commit every change since the clone as one commit on ``branch`` (created, or
        reset, with the clone's base commit as parent; HEAD of the worker's git directory
        moves to it, the agent's .git is left alone). The message
        ends with ``trailer`` as its own paragraph. Author and committer are
        runlane <runlane@localhost>; with ``timestamp`` (Unix seconds) the dates are
        fixed too, so the same changes give the same sha. Returns the commit's sha.
        Raises WorkspaceError when there is nothing to commit."""
        if self._git(["check-ref-format", f"refs/heads/{branch}"]).code != 0:
            raise WorkspaceError(f"invalid branch name {branch!r}")
        tree = self.agent_tree or self._tree_of_the_worktree()
        if tree == self._base_tree():
            raise WorkspaceError("nothing to commit: the workspace has no changes")
        who = {"GIT_AUTHOR_NAME": AUTHOR_NAME, "GIT_AUTHOR_EMAIL": AUTHOR_EMAIL,
               "GIT_COMMITTER_NAME": AUTHOR_NAME, "GIT_COMMITTER_EMAIL": AUTHOR_EMAIL}
        if timestamp is not None:
            who["GIT_AUTHOR_DATE"] = who["GIT_COMMITTER_DATE"] = f"@{int(timestamp)} +0000"
        parent = ["-p", self.base_sha] if self.base_sha is not None else []
        sha = self._local(["commit-tree", tree, *parent, "-m",
                           message.strip() or "runlane agent run", "-m", trailer],
                          env=who).strip()
        self._local(["update-ref", "-m", "runlane: commit_all", f"refs/heads/{branch}", sha])
        self._local(["symbolic-ref", "HEAD", f"refs/heads/{branch}"])
        self._local(["reset", "--quiet", "--mixed"])  # index = the new commit
        return sha

    def remote_commit_carries(self, sha: str, trailer: str, *,
                              timeout: float | None = None) -> bool:
        """Whether the remote's commit ``sha`` (fetched if this clone lacks it) has
        ``trailer`` in its message: the mark of runlane's own commit for the run.
        ``timeout`` (seconds) caps the fetch below the workspace's own."""
        have = self._git(["cat-file", "-e", f"{sha}^{{commit}}"])
        if have.code != 0:
            done = self._git(["fetch", "--quiet", "--no-tags", "--", self.remote_url, sha],
                             timeout=self._capped(timeout))
            if done.timed_out or done.code != 0:
                raise PushFailed(f"cannot fetch {sha} from the remote: "
                                 f"{'timed out' if done.timed_out else _summary(done.stderr)}",
                                 transient=done.timed_out or is_transient(done.stderr))
        message = self._local(["log", "-1", "--format=%B", sha])
        return trailer in message.splitlines()

    def remote_branch_sha(self, branch: str, *, timeout: float | None = None) -> str | None:
        """The sha of ``branch`` on the remote, or None when it has no such branch.
        Raises PushFailed when the remote cannot be asked. ``timeout`` (seconds) caps
        the call below the workspace's own."""
        timeout = self._capped(timeout)
        return _branch_sha(self._git(["ls-remote", "--", self.remote_url, f"refs/heads/{branch}"],
                                     timeout=timeout), branch, timeout)

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
        done = self._git(["push", "--quiet", "--no-verify",
                          f"--force-with-lease={ref}:{expected or ''}", "--", self.remote_url,
                          f"{ref}:{ref}"], timeout=timeout)
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
        """Delete the clone and the worker's git directory; safe to call again."""
        _rmtree(self.path)
        _rmtree(self.git_dir)
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
        lock, git_dir = _lock_path(dest), _git_dir_of(dest)
        if not any(os.path.lexists(p) for p in (dest, git_dir, lock)):
            return False
        try:
            fd = _hold(lock, wait=False)
        except BlockingIOError:
            return False  # its attempt is alive
        except WorkspaceError:
            return False  # not a lock file of runlane's (a symbolic link): left alone
        try:
            _rmtree(dest)
            _rmtree(git_dir)
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        finally:
            os.close(fd)
        return True


def remote_branch_sha(url: str, branch: str, *, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                      config: GitConfig | None = None) -> str | None:
    """The sha of ``branch`` at the repository ``url`` (``git ls-remote``), None when
    it has no such branch; without a clone (a withdrawal records the branch it finds).
    Runs in an empty directory, so no repository's configuration is read. ``config``:
    the worker's own git settings passed on (its credential helpers; read now when not
    given). Raises PushFailed when the remote cannot be asked."""
    with tempfile.TemporaryDirectory(prefix="runlane-ls-remote-") as empty:
        done = _git(["ls-remote", "--", url, f"refs/heads/{branch}"], cwd=Path(empty),
                    timeout=timeout, config=worker_git_config() if config is None else config)
    return _branch_sha(done, branch, timeout)


def _branch_sha(done: _Done, branch: str, timeout: float) -> str | None:
    """The branch's sha in what ``git ls-remote URL refs/heads/BRANCH`` answered."""
    ref = f"refs/heads/{branch}"
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


def _git_dir_of(dest: Path) -> Path:
    """The worker's own git directory for the clone ``dest``: beside it, not in it."""
    return dest.with_name(dest.name + ".git")


def _hold(lock: Path, *, wait: bool = True) -> int:
    """An exclusive flock on ``lock`` (created): its descriptor. Raises
    BlockingIOError when another process holds it and ``wait`` is false, and
    WorkspaceError when ``lock`` is not a regular file of the worker's: it is opened
    without following a symbolic link (one planted there, to a file of the worker's,
    was created, locked and later unlinked through)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR):
            raise WorkspaceError(f"{lock} is not a lock file of runlane's (a symbolic link, "
                                 "a directory or a special file): remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise WorkspaceError(f"{lock} is not a lock file of runlane's (not a regular "
                                 "file of this user's): remove it")
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _copy_git_dir(dest: Path, git_dir: Path, timeout: float, *, hold: int | None = None
                  ) -> None:
    """The worker's own copy of the clone's git directory, made before the agent runs:
    its objects copied (not hard-linked, which the agent could rewrite in place), its
    config the one git writes for a clone, its index the checkout's (so that a diff of
    the work tree need not read every file)."""
    done = _git(["clone", "--quiet", "--bare", "--no-hardlinks", "--", str(dest / ".git"),
                 str(git_dir)], cwd=None, timeout=timeout, hold=hold)
    if done.timed_out or done.code != 0:
        raise CloneFailed("cannot copy the clone's git directory: "
                          f"{'timed out' if done.timed_out else _summary(done.stderr)}",
                          transient=done.timed_out)
    with contextlib.suppress(FileNotFoundError):  # none: an empty repository
        shutil.copyfile(dest / ".git" / "index", git_dir / "index")
    # The highest-priority attributes file is the worker's: the work tree's
    # `.gitattributes` (the agent's) cannot mark a text file `-diff` or `binary` and
    # so count 0 lines against max_diff_lines; git decides by content, as without one.
    (git_dir / "info").mkdir(mode=0o700, exist_ok=True)
    (git_dir / "info" / "attributes").write_text("* !diff\n")


def make_private_dirs(path: Path) -> None:
    """``path`` and its missing parents, created 0700 (only what is missing: the mode
    of an existing directory is the operator's, and checked by check_workspace_root)."""
    missing = []
    here = Path(os.path.abspath(path))
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)


def unsafe_workspace_root(root: Path) -> str | None:
    """Why another user could write into the workspace root ``root`` (an existing
    directory) or put another directory in its place, with the fix; None when only
    this user and root can. Checked at worker start: a root another user can write is
    one where clones can be read, swapped or seeded with a symbolic link."""
    me = os.geteuid()
    given = Path(os.path.abspath(root))
    real = given.resolve()
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != me:
        return (f"owned by uid {st.st_uid}, not by this worker's uid {me}, so that user "
                f"can change what is in it; fix: chown {me} {real}, or choose another "
                "WORKSPACE_DIR")
    if st.st_mode & 0o022:
        return (f"writable by other users (mode {stat.S_IMODE(st.st_mode):04o}); fix: "
                f"chmod go-w {real} (runlane makes it 0700)")
    # Every directory above it (and every symbolic link on the way): one another user
    # owns, or can write without the sticky bit, lets that user rename the root away
    # and put their own in its place.
    links = [given] if given.is_symlink() else []
    for above in (*links, *given.parents, *real.parents):
        st = os.lstat(above)
        if st.st_uid not in (0, me):
            return (f"{above}, on its path, is owned by uid {st.st_uid}, who can replace it; "
                    "fix: choose a WORKSPACE_DIR whose parents only root or this user own")
        if (not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022
                and not st.st_mode & stat.S_ISVTX):
            return (f"{above}, on its path, is writable by other users without the sticky bit "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}), so they can replace it; fix: "
                    f"chmod go-w {above} (or chmod +t), or choose another WORKSPACE_DIR")
    return None


def _stdout(command: str, done: _Done) -> str:
    if done.timed_out or done.code != 0:
        what = "timed out" if done.timed_out else f"failed: {_summary(done.stderr)}"
        raise WorkspaceError(f"git {command} {what}")
    return done.stdout.decode("utf-8", "surrogateescape")


def _local(args: list[str], git_dir: Path, *, hold: int | None = None) -> str:
    """A git command on ``git_dir`` that does not touch the network; its stdout, or
    WorkspaceError."""
    return _stdout(args[0], _git(["--git-dir", str(git_dir), *args], cwd=git_dir,
                                 timeout=LOCAL_TIMEOUT_SECONDS, hold=hold))
