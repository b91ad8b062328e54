"""Git workspaces against real repositories: a bare repository in tmp_path is the remote."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runlane.agents.base import AttemptLimits
from runlane.workspace import (
    AUTHOR_EMAIL,
    AUTHOR_NAME,
    CloneFailed,
    PushFailed,
    Workspace,
    WorkspaceError,
    is_transient,
)

BRANCH = "agent/task-1/run-1"
TRAILER = "Agent-Run-ID: run-1"
APP = "".join(f"line {i}\n" for i in range(10))


def git(*args: str, cwd: Path | None = None, stdin: str | None = None) -> str:
    done = subprocess.run(["git", "-c", "user.name=Test", "-c", "user.email=test@example.com",
                           *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                          check=True)
    return done.stdout


def wgit(ws: Workspace, *args: str, stdin: str | None = None) -> str:
    """git on the worker's own git directory of ``ws`` (where its commits are)."""
    return git("--git-dir", str(ws.git_dir), "--work-tree", str(ws.path), *args, cwd=ws.path,
               stdin=stdin)


@pytest.fixture(autouse=True)
def isolated_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No user or system git configuration leaks into the tests."""
    config = tmp_path / "gitconfig"
    config.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def make_remote(tmp_path: Path, name: str = "remote.git", branch: str = "main") -> Path:
    bare = tmp_path / name
    git("init", "--quiet", "--bare", "-b", branch, str(bare))
    seed = tmp_path / f"seed-{name}"
    git("init", "--quiet", "-b", branch, str(seed))
    (seed / "README.md").write_text("hello\nworld\n")
    (seed / "src").mkdir()
    (seed / "src" / "app.py").write_text(APP)
    (seed / ".gitignore").write_text("*.log\nbuild/\n")
    (seed / "blob.bin").write_bytes(b"\0\1\2binary\0")
    git("add", "--all", cwd=seed)
    git("commit", "--quiet", "-m", "initial", cwd=seed)
    git("push", "--quiet", str(bare), f"{branch}:{branch}", cwd=seed)
    return bare


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    return make_remote(tmp_path)


@pytest.fixture
def ws(remote: Path, tmp_path: Path) -> Iterator[Workspace]:
    workspace = Workspace.clone(str(remote), tmp_path / "workspaces", "run-1-1")
    yield workspace
    workspace.remove()


def edit(ws: Workspace) -> None:
    """What an agent might do: every kind of change, plus ignored files."""
    (ws.path / "README.md").write_text("hello\nthere\n")  # 1 removed, 1 added
    with open(ws.path / "src" / "app.py", "a") as f:
        f.write("line 10\nline 11\n")  # 2 added
    (ws.path / "blob.bin").unlink()  # binary: counts as a file, 0 lines
    (ws.path / "new.txt").write_text("a\nb\nc")  # untracked, 3 lines (no final newline)
    (ws.path / "docs").mkdir()
    (ws.path / "docs" / "guide.md").write_text("# guide\n")  # untracked, 1 line
    (ws.path / "debug.log").write_text("ignored\n")
    (ws.path / "build").mkdir()
    (ws.path / "build" / "out.txt").write_text("ignored\n")


EDITED = ["README.md", "blob.bin", "docs/guide.md", "new.txt", "src/app.py"]
EDITED_LINES = 2 + 2 + 0 + 3 + 1


# --- clone ---------------------------------------------------------------------


def test_clone_of_a_local_bare_repository(ws: Workspace, remote: Path, tmp_path: Path) -> None:
    assert ws.path == tmp_path / "workspaces" / "run-1-1"
    assert (ws.path / "README.md").read_text() == "hello\nworld\n"
    assert ws.base_branch() == "main"
    assert ws.base_sha == git("rev-parse", "main", cwd=remote).strip()
    assert ws.remote_url == str(remote)
    assert ws.changed_files() == [] and ws.diff_line_count() == 0 and not ws.has_changes()


def test_clone_of_a_file_url_follows_the_remote_default_branch(tmp_path: Path) -> None:
    remote = make_remote(tmp_path, branch="trunk")
    ws = Workspace.clone(remote.as_uri(), tmp_path / "w", "run")
    assert ws.base_branch() == "trunk"
    assert git("branch", "--show-current", cwd=ws.path).strip() == "trunk"


def test_clone_replaces_a_leftover_directory(remote: Path, tmp_path: Path) -> None:
    leftover = tmp_path / "w" / "run"
    leftover.mkdir(parents=True)
    (leftover / "junk").write_text("from a crashed attempt")
    ws = Workspace.clone(str(remote), tmp_path / "w", "run")
    assert not (ws.path / "junk").exists() and (ws.path / "README.md").exists()


@pytest.mark.parametrize("name", ["", ".", "..", "a/b"])
def test_clone_refuses_a_bad_name(remote: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError):
        Workspace.clone(str(remote), tmp_path / "w", name)


def test_clone_failures_are_permanent_when_the_repository_is_wrong(tmp_path: Path) -> None:
    (tmp_path / "plain-dir").mkdir()
    for repo in [str(tmp_path / "missing.git"), str(tmp_path / "plain-dir"),
                 (tmp_path / "missing.git").as_uri()]:
        with pytest.raises(CloneFailed) as caught:
            Workspace.clone(repo, tmp_path / "w", "run")
        assert not caught.value.transient, str(caught.value)
        assert not (tmp_path / "w" / "run").exists()


def test_clone_failure_is_transient_when_the_host_refuses_connections(tmp_path: Path) -> None:
    with pytest.raises(CloneFailed) as caught:
        Workspace.clone("http://user:s3cret@127.0.0.1:9/x.git", tmp_path / "w", "run")
    assert caught.value.transient, str(caught.value)
    assert "s3cret" not in str(caught.value)  # no credentials in messages
    assert not (tmp_path / "w" / "run").exists()


def test_clone_timeout_is_transient(tmp_path: Path) -> None:
    with socket.socket() as server:  # accepts connections (backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(CloneFailed) as caught:
            Workspace.clone(f"http://127.0.0.1:{port}/x.git", tmp_path / "w", "run",
                            timeout=0.5)
    assert caught.value.transient and "timed out" in str(caught.value)
    assert time.monotonic() - started < 5
    assert not (tmp_path / "w" / "run").exists()


@pytest.mark.parametrize(("stderr", "transient"), [
    ("fatal: unable to access 'https://h/x.git/': Could not resolve host: h", True),
    ("ssh: Could not resolve hostname h: Name or service not known\n"
     "fatal: Could not read from remote repository.\n\nPlease make sure you have the "
     "correct access rights\nand the repository exists.", True),
    ("ssh: connect to host h port 22: Connection refused\n"
     "fatal: Could not read from remote repository.", True),
    ("ssh: connect to host h port 22: Connection timed out", True),
    ("fatal: unable to access 'https://h/x.git/': Failed to connect to h port 443 after "
     "0 ms: Couldn't connect to server", True),
    ("error: RPC failed; curl 56 GnuTLS recv error (-54): Error in the pull function.\n"
     "fatal: early EOF\nfatal: index-pack failed", True),
    ("fatal: the remote end hung up unexpectedly", True),
    ("fatal: unable to access 'https://h/x.git/': The requested URL returned error: 503", True),
    ("fatal: unable to access 'https://h/x.git/': The requested URL returned error: 429", True),
    ("read: Connection reset by peer", True),
    ("remote: Repository not found.\nfatal: repository 'https://h/x.git/' not found", False),
    ("fatal: repository '/srv/x.git' does not exist", False),
    ("fatal: '/srv/x' does not appear to be a git repository\n"
     "fatal: Could not read from remote repository.", False),
    ("fatal: Authentication failed for 'https://h/x.git/'", False),
    ("git@h: Permission denied (publickey).\n"
     "fatal: Could not read from remote repository.", False),
    ("fatal: could not read Username for 'https://h': terminal prompts disabled", False),
    ("fatal: unable to access 'https://h/x.git/': The requested URL returned error: 403", False),
    ("error: RPC failed; HTTP 413 curl 22 The requested URL returned error: 413\n"
     "fatal: the remote end hung up unexpectedly", False),
    (" ! [rejected]        b -> b (fetch first)\nerror: failed to push some refs", False),
    ("fatal: Could not read from remote repository.", False),
    ("something nobody has seen before", False),
])
def test_failure_classification(stderr: str, transient: bool) -> None:
    assert is_transient(stderr) is transient


# --- what changed --------------------------------------------------------------


def test_changed_files_and_diff_lines(ws: Workspace) -> None:
    edit(ws)
    assert ws.changed_files() == EDITED
    assert ws.diff_line_count() == EDITED_LINES
    assert ws.has_changes()
    # Cross-check with git's own count once everything is staged.
    git("add", "--all", cwd=ws.path)
    numstat = git("diff", "--cached", "--numstat", str(ws.base_sha), cwd=ws.path)
    assert sum(int(n) for row in numstat.splitlines() for n in row.split("\t")[:2]
               if n != "-") == EDITED_LINES


def test_only_ignored_files_are_no_changes(ws: Workspace) -> None:
    (ws.path / "agent.log").write_text("noise\n")
    assert not ws.has_changes() and ws.diff_line_count() == 0


def test_changes_the_agent_committed_itself_are_counted(ws: Workspace) -> None:
    (ws.path / "README.md").write_text("hello\nworld\nagain\n")
    git("commit", "--quiet", "-am", "agent's own commit", cwd=ws.path)
    (ws.path / "new.txt").write_text("x\n")
    assert ws.changed_files() == ["README.md", "new.txt"]
    assert ws.diff_line_count() == 2


def test_the_agents_gitattributes_cannot_hide_lines_from_the_diff_limit(
        ws: Workspace) -> None:
    """`-diff` (or `binary`) in the work tree's .gitattributes made git count a text
    file's changes as 0 lines: the worker's own attributes file overrides it, while a
    file that is binary by its content still counts 0."""
    (ws.path / ".gitattributes").write_text("* -diff\n*.md binary\n")
    (ws.path / "README.md").write_text("".join(f"line {i}\n" for i in range(50)))
    (ws.path / "blob.bin").write_bytes(b"\0binary\n" * 3)
    git("add", "blob.bin", cwd=ws.path)
    git("commit", "--quiet", "-m", "agent's binary", cwd=ws.path)
    assert ws.diff_line_count() >= 50 + 2  # README.md's lines and the attributes file's
    lines = ws.check_limits(AttemptLimits(max_diff_lines=10))
    assert lines is not None and "max_diff_lines 10 exceeded" in lines


def test_check_limits(ws: Workspace) -> None:
    edit(ws)
    assert ws.check_limits(AttemptLimits()) is None
    assert ws.check_limits(AttemptLimits(max_changed_files=5, max_diff_lines=8)) is None
    files = ws.check_limits(AttemptLimits(max_changed_files=4))
    assert files is not None and "5 changed files" in files and "4" in files
    lines = ws.check_limits(AttemptLimits(max_changed_files=5, max_diff_lines=7))
    assert lines is not None and "8 changed lines" in lines


# --- commit --------------------------------------------------------------------


def test_commit_all_puts_every_change_in_one_commit_with_the_trailer(ws: Workspace) -> None:
    edit(ws)
    sha = ws.commit_all(BRANCH, "Fix the flaky test", TRAILER)
    assert sha == wgit(ws, "rev-parse", f"refs/heads/{BRANCH}").strip()
    assert wgit(ws, "symbolic-ref", "HEAD").strip() == f"refs/heads/{BRANCH}"
    message = wgit(ws, "log", "-1", "--format=%B", sha)
    assert message.strip() == f"Fix the flaky test\n\n{TRAILER}"
    assert wgit(ws, "interpret-trailers", "--parse", stdin=message).strip() == TRAILER
    who = wgit(ws, "log", "-1", "--format=%an <%ae>|%cn <%ce>", sha).strip()
    assert who == f"{AUTHOR_NAME} <{AUTHOR_EMAIL}>|{AUTHOR_NAME} <{AUTHOR_EMAIL}>"
    assert wgit(ws, "log", "-1", "--format=%P", sha).strip() == ws.base_sha
    files = wgit(ws, "ls-tree", "-r", "--name-only", sha).split()
    assert sorted(files) == [".gitignore", "README.md", "docs/guide.md", "new.txt", "src/app.py"]
    assert wgit(ws, "status", "--porcelain") == ""  # index and tree match the commit


def test_commit_all_squashes_the_agent_commits_onto_the_base(ws: Workspace) -> None:
    (ws.path / "README.md").write_text("committed by the agent\n")
    git("commit", "--quiet", "-am", "agent's own commit", cwd=ws.path)
    git("checkout", "--quiet", "--detach", cwd=ws.path)  # and left HEAD detached
    (ws.path / "later.txt").write_text("not committed\n")
    sha = ws.commit_all(BRANCH, "msg", TRAILER)
    assert wgit(ws, "log", "-1", "--format=%P", sha).strip() == ws.base_sha
    assert wgit(ws, "show", f"{sha}:README.md") == "committed by the agent\n"
    assert wgit(ws, "show", f"{sha}:later.txt") == "not committed\n"


def test_commit_all_is_repeatable_and_resets_the_branch(ws: Workspace) -> None:
    edit(ws)
    first = ws.commit_all(BRANCH, "msg", TRAILER, timestamp=1_800_000_000)
    assert ws.commit_all(BRANCH, "msg", TRAILER, timestamp=1_800_000_000) == first
    (ws.path / "more.txt").write_text("more\n")
    second = ws.commit_all(BRANCH, "msg", TRAILER)
    assert second != first
    assert wgit(ws, "log", "-1", "--format=%P", second).strip() == ws.base_sha


def test_commit_all_without_changes_refuses(ws: Workspace) -> None:
    (ws.path / "agent.log").write_text("ignored\n")
    with pytest.raises(WorkspaceError, match="nothing to commit"):
        ws.commit_all(BRANCH, "msg", TRAILER)


def test_commit_all_refuses_a_bad_branch_name(ws: Workspace) -> None:
    edit(ws)
    with pytest.raises(WorkspaceError, match="invalid branch name"):
        ws.commit_all("bad..name", "msg", TRAILER)


def test_hooks_the_agent_installed_never_run(ws: Workspace, remote: Path,
                                             tmp_path: Path) -> None:
    marker = tmp_path / "hook-ran"
    hook = f"#!/bin/sh\necho $0 >> '{marker}'\nexit 1\n"
    for hooks in (ws.path / ".git" / "hooks", ws.path / ".githooks"):
        hooks.mkdir(exist_ok=True)
        for name in ("pre-commit", "commit-msg", "post-commit", "pre-push",
                     "reference-transaction", "post-checkout", "post-index-change"):
            (hooks / name).write_text(hook)
            (hooks / name).chmod(0o755)
    git("config", "core.hooksPath", ".githooks", cwd=ws.path)
    edit(ws)
    sha = ws.commit_all(BRANCH, "msg", TRAILER)
    ws.push(BRANCH)
    assert ws.remote_branch_sha(BRANCH) == sha
    assert not marker.exists()


# --- push ----------------------------------------------------------------------


def test_push_then_the_remote_branch_has_the_commit(ws: Workspace, remote: Path) -> None:
    assert ws.remote_branch_sha(BRANCH) is None
    edit(ws)
    sha = ws.commit_all(BRANCH, "msg", TRAILER)
    ws.push(BRANCH)
    assert ws.remote_branch_sha(BRANCH) == sha
    assert git("rev-parse", f"refs/heads/{BRANCH}", cwd=remote).strip() == sha
    ws.push(BRANCH)  # again: already up to date, no error
    assert ws.remote_branch_sha("agent/task-1") is None  # exact ref, not a prefix


def test_pushing_over_a_different_commit_is_a_permanent_failure(remote: Path,
                                                                tmp_path: Path) -> None:
    first = Workspace.clone(str(remote), tmp_path / "w", "one")
    (first.path / "a.txt").write_text("one\n")
    first.commit_all(BRANCH, "msg", TRAILER)
    first.push(BRANCH)
    second = Workspace.clone(str(remote), tmp_path / "w", "two")
    (second.path / "a.txt").write_text("two\n")
    second.commit_all(BRANCH, "msg", TRAILER)
    with pytest.raises(PushFailed) as caught:
        second.push(BRANCH)  # no force: the first push stays
    assert not caught.value.transient, str(caught.value)


def test_push_goes_to_the_remote_of_the_clone_even_if_the_agent_rewrote_origin(
        ws: Workspace, remote: Path, tmp_path: Path) -> None:
    decoy = tmp_path / "decoy.git"
    git("init", "--quiet", "--bare", str(decoy))
    git("remote", "set-url", "origin", str(decoy), cwd=ws.path)
    edit(ws)
    sha = ws.commit_all(BRANCH, "msg", TRAILER)
    ws.push(BRANCH)
    assert git("rev-parse", f"refs/heads/{BRANCH}", cwd=remote).strip() == sha
    assert git("for-each-ref", cwd=decoy) == ""


def test_push_and_lookup_failures_against_an_unreachable_remote_are_transient(
        ws: Workspace) -> None:
    edit(ws)
    ws.commit_all(BRANCH, "msg", TRAILER)
    unreachable = Workspace(ws.path, remote_url="http://127.0.0.1:9/x.git",
                            base_branch="main", base_sha=ws.base_sha, timeout=10)
    actions: list[Callable[[], object]] = [lambda: unreachable.push(BRANCH),
                                           lambda: unreachable.remote_branch_sha(BRANCH)]
    for action in actions:
        with pytest.raises(PushFailed) as caught:
            action()
        assert caught.value.transient, str(caught.value)


def test_an_empty_remote(tmp_path: Path) -> None:
    bare = tmp_path / "empty.git"
    git("init", "--quiet", "--bare", "-b", "main", str(bare))
    ws = Workspace.clone(str(bare), tmp_path / "w", "run")
    assert ws.base_sha is None and not ws.has_changes()
    (ws.path / "first.txt").write_text("1\n2\n")
    assert ws.changed_files() == ["first.txt"] and ws.diff_line_count() == 2
    sha = ws.commit_all(BRANCH, "first", TRAILER)
    assert wgit(ws, "log", "-1", "--format=%P", sha).strip() == ""  # a root commit
    ws.push(BRANCH)
    assert ws.remote_branch_sha(BRANCH) == sha


# --- removal -------------------------------------------------------------------


def test_remove_is_idempotent_and_copes_with_read_only_directories(ws: Workspace) -> None:
    locked = ws.path / "locked"
    locked.mkdir()
    (locked / "file").write_text("x")
    locked.chmod(0o500)
    ws.remove()
    assert not ws.path.exists()
    ws.remove()
    assert not os.path.lexists(ws.path)


def test_a_clone_is_removed_by_name_only_once_its_attempt_lets_go(remote: Path,
                                                                  tmp_path: Path) -> None:
    """A later attempt removes an earlier one's clone (a killed worker's) only when no
    live process holds it: removing a clone its attempt still used crashed that
    attempt (the fault harness: two worker processes, one SIGSTOPped)."""
    root = tmp_path / "workspaces"
    held = Workspace.clone(str(remote), root, "run-1")
    assert not Workspace.remove_named(root, "run-1")  # its attempt is alive
    assert held.path.is_dir()
    held.release()  # as a SIGKILL would
    assert Workspace.remove_named(root, "run-1")
    assert sorted(p.name for p in root.iterdir()) == []
