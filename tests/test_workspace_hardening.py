"""What an agent can leave in its clone never acts for the worker's git: configuration
it plants (filters, ssh commands, credential helpers, URL rewrites, includes), a
``.git`` it replaces, remote helpers; and the workspace's files, lock and root are the
worker's alone. Real git, a local bare repository as the remote, the agent a real
shell command run in the clone."""

from __future__ import annotations

import http.server
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.workspace import (
    CloneFailed,
    PushFailed,
    Workspace,
    WorkspaceError,
    make_private_dirs,
    unsafe_workspace_root,
)

from .test_workspace import BRANCH, TRAILER, git, make_remote


@pytest.fixture(autouse=True)
def isolated_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worker's own (global) git configuration: empty unless a test writes it."""
    config = tmp_path / "gitconfig"
    config.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return config


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    return make_remote(tmp_path)


@pytest.fixture
def ws(remote: Path, tmp_path: Path) -> Iterator[Workspace]:
    workspace = Workspace.clone(str(remote), tmp_path / "workspaces", "run-1-1")
    yield workspace
    workspace.remove()


def agent(ws: Workspace, script: str) -> None:
    """Run ``script`` as an agent would: a shell in the clone, with git at hand."""
    subprocess.run(["sh", "-ec", script], cwd=ws.path, check=True, capture_output=True)


def finalize(ws: Workspace) -> str:
    """What the worker does once the agent has exited: take its tree, check the
    limits, commit, look the branch up, push. Returns the commit's sha."""
    ws.keep_agent_tree()
    assert ws.has_changes()
    ws.changed_files()
    ws.diff_line_count()
    sha = ws.commit_all(BRANCH, "msg", TRAILER)
    assert ws.remote_branch_sha(BRANCH) is None
    ws.push(BRANCH)
    return sha


def pushed_file(remote: Path, path: str) -> str:
    return git("--git-dir", str(remote), "show", f"{BRANCH}:{path}")


# --- configuration the agent plants --------------------------------------------------


def test_a_clean_filter_the_agent_planted_never_runs(ws: Workspace, remote: Path,
                                                     tmp_path: Path) -> None:
    marker = tmp_path / "filter-ran"
    agent(ws, f"""
        git config filter.x.clean "touch '{marker}'; echo FILTERED"
        git config filter.x.smudge "touch '{marker}'; cat"
        git config filter.x.required true
        git config diff.x.textconv "touch '{marker}'; cat"
        git config diff.external "touch '{marker}'; true"
        echo '* filter=x diff=x' > .gitattributes
        echo '* filter=x' > .git/info/attributes
        echo 'the agent wrote this' > README.md
    """)
    finalize(ws)
    assert not marker.exists()
    assert pushed_file(remote, "README.md") == "the agent wrote this\n"  # not FILTERED
    assert pushed_file(remote, ".gitattributes") == "* filter=x diff=x\n"


def test_an_include_the_agent_planted_is_ignored(ws: Workspace, remote: Path,
                                                 tmp_path: Path) -> None:
    marker = tmp_path / "include-ran"
    planted = tmp_path / "planted.cfg"
    agent(ws, f"""
        printf '[filter "x"]\\n\\tclean = touch {marker}; cat\\n' > '{planted}'
        git config include.path '{planted}'
        git config 'includeIf.gitdir:/.path' '{planted}'
        echo '* filter=x' > .gitattributes
        echo 'changed' > README.md
    """)
    assert "touch" in git("config", "filter.x.clean", cwd=ws.path)  # git would use it
    finalize(ws)
    assert not marker.exists()
    assert pushed_file(remote, "README.md") == "changed\n"


def test_url_rewrites_the_agent_planted_do_not_move_the_push(ws: Workspace, remote: Path,
                                                             tmp_path: Path) -> None:
    decoy = tmp_path / "decoy.git"
    git("init", "--quiet", "--bare", str(decoy))
    agent(ws, f"""
        git config 'url.{decoy}.insteadOf' '{remote}'
        git config 'url.{decoy}.pushInsteadOf' '{remote}'
        echo 'changed' > README.md
    """)
    sha = finalize(ws)
    assert git("--git-dir", str(remote), "rev-parse", f"refs/heads/{BRANCH}").strip() == sha
    assert git("--git-dir", str(decoy), "for-each-ref") == ""


def test_an_ssh_command_the_agent_planted_never_runs(ws: Workspace, tmp_path: Path) -> None:
    marker = tmp_path / "ssh-ran"
    agent(ws, f"""
        git config core.sshCommand "touch '{marker}'; false"
        git config core.gitProxy "touch '{marker}'; false"
    """)
    over_ssh = Workspace(ws.path, remote_url="ssh://git@127.0.0.1:9/x.git",
                         base_branch="main", base_sha=ws.base_sha, timeout=20)
    with pytest.raises(PushFailed):
        over_ssh.remote_branch_sha(BRANCH)
    assert not marker.exists()


class _AskForPassword(http.server.BaseHTTPRequestHandler):
    """An HTTP git remote that wants a password: 401 until it is given one."""

    seen: list[str | None]

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        self.send_response(401 if self.headers.get("Authorization") is None else 404)
        self.send_header("WWW-Authenticate", 'Basic realm="git"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def password_remote() -> Iterator[tuple[str, list[str | None]]]:
    seen: list[str | None] = []
    handler = type("Handler", (_AskForPassword,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/x.git", seen
    server.shutdown()
    server.server_close()


def test_a_credential_helper_the_agent_planted_never_runs_the_workers_does(
        ws: Workspace, tmp_path: Path, isolated_git: Path,
        password_remote: tuple[str, list[str | None]]) -> None:
    """The repository's helpers are not asked; the worker's own (its global config)
    still authenticate: git's credential helpers of the worker's user keep working."""
    url, seen = password_remote
    marker = tmp_path / "helper-ran"
    agent(ws, f"""
        git config credential.helper "!touch '{marker}'; echo username=agent; echo password=x"
        git config 'credential.{url}.helper' "!touch '{marker}'; echo password=x"
    """)
    isolated_git.write_text('[credential]\n\thelper = "!f() { echo username=worker; '
                            'echo password=s3cret; }; f"\n')
    over_http = Workspace(ws.path, remote_url=url, base_branch="main",
                          base_sha=ws.base_sha, timeout=20)
    with pytest.raises(PushFailed) as caught:
        over_http.remote_branch_sha(BRANCH)  # 404 once authenticated: not a repository
    assert not marker.exists()
    assert "Basic d29ya2VyOnMzY3JldA==" in seen, seen  # worker:s3cret
    assert "s3cret" not in str(caught.value)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worker's home directory, where git finds its global configuration."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GIT_CONFIG_GLOBAL")
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return home


def test_the_workers_own_config_gives_credentials_only(remote: Path, tmp_path: Path,
                                                      home: Path) -> None:
    """Of the worker's own configuration git is given what authenticates and reaches
    the remote, nothing that runs a filter or rewrites the push: what is committed and
    where it goes do not depend on the machine."""
    marker = tmp_path / "global-filter-ran"
    decoy = tmp_path / "decoy.git"
    git("init", "--quiet", "--bare", str(decoy))
    (home / ".gitconfig").write_text(f'[filter "x"]\n\tclean = touch {marker}; cat\n'
                                     f'[url "{decoy}"]\n\tpushInsteadOf = {remote}\n'
                                     '[credential]\n\thelper = cache\n')
    ws = Workspace.clone(str(remote), tmp_path / "w", "run")
    agent(ws, "echo '* filter=x' > .gitattributes; echo changed > README.md")
    sha = finalize(ws)
    assert not marker.exists()
    assert git("--git-dir", str(remote), "rev-parse", f"refs/heads/{BRANCH}").strip() == sha
    assert git("--git-dir", str(decoy), "for-each-ref") == ""


def test_git_as_the_worker_runs_it_reads_no_configuration_file_but_its_own(
        ws: Workspace, home: Path) -> None:
    """No system, global (home) or repository file of anyone else: settings come from
    the command line (the overrides and the worker's carried credential settings) and
    from the worker's own copy of the git directory."""
    (home / ".gitconfig").write_text("[core]\n\tpager = cat\n")
    agent(ws, "git config core.pager cat")
    done = ws._git(["config", "--list", "--show-origin"])
    origins = {line.split("\t", 1)[0] for line in done.stdout.decode().splitlines()}
    assert origins <= {"command line:", f"file:{ws.git_dir}/config"}, origins


def test_the_home_directorys_ignore_file_does_not_decide_what_is_committed(
        ws: Workspace, remote: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home_ignore = tmp_path / "xdg" / "git" / "ignore"
    home_ignore.parent.mkdir(parents=True)
    home_ignore.write_text("*.txt\n")
    (tmp_path / "xdg" / "git" / "attributes").write_text("*.md -diff\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    agent(ws, "echo new > notes.txt; echo changed > README.md")
    assert ws.changed_files() == ["README.md", "notes.txt"]
    assert ws.diff_line_count() == 1 + 2 + 1  # README.md is text, not binary
    finalize(ws)
    assert pushed_file(remote, "notes.txt") == "new\n"


def test_git_variables_of_the_workers_environment_do_not_reach_its_git(
        ws: Workspace, remote: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "env-filter-ran"
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", f"'filter.x.clean'='touch {marker}; cat'")
    monkeypatch.setenv("GIT_TRACE", str(tmp_path / "trace"))  # would log credentials
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "elsewhere"))
    agent_env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    subprocess.run(["sh", "-c", "echo '* filter=x' > .gitattributes; echo x > README.md"],
                   cwd=ws.path, env=agent_env, check=True)
    finalize(ws)
    assert not marker.exists() and not (tmp_path / "trace").exists()
    assert pushed_file(remote, "README.md") == "x\n"


# --- a .git the agent replaced --------------------------------------------------------


@pytest.mark.parametrize("how", ["gitdir-file", "symlink"])
def test_a_replaced_dot_git_is_ignored(ws: Workspace, remote: Path, tmp_path: Path,
                                       how: str) -> None:
    """The agent swaps its .git for a repository of its own (a `gitdir:` file or a
    symbolic link): the worker's git never looks at it, commits the agent's files and
    pushes to the task's remote."""
    marker = tmp_path / "evil-ran"
    evil = tmp_path / "evil"
    git("init", "--quiet", "-b", "main", str(evil))
    git("config", "filter.x.clean", f"touch '{marker}'; echo FILTERED", cwd=evil)
    git("config", "core.hooksPath", str(tmp_path / "hooks"), cwd=evil)
    decoy = tmp_path / "decoy.git"
    git("init", "--quiet", "--bare", str(decoy))
    git("config", f"url.{decoy}.pushInsteadOf", str(remote), cwd=evil)
    link = (f"rm -rf .git; echo 'gitdir: {evil}/.git' > .git" if how == "gitdir-file"
            else f"rm -rf .git; ln -s '{evil}/.git' .git")
    agent(ws, f"{link}\necho '* filter=x' > .gitattributes\necho changed > README.md")
    finalize(ws)
    assert not marker.exists()
    assert pushed_file(remote, "README.md") == "changed\n"
    files = git("--git-dir", str(remote), "ls-tree", "-r", "--name-only", BRANCH).split()
    assert ".git" not in files
    assert git("--git-dir", str(decoy), "for-each-ref") == ""


def test_replaced_objects_do_not_hide_changes_from_the_limits(ws: Workspace) -> None:
    """A replace ref in the agent's .git (the base's README shown as the agent's) does
    not make its change vanish from what the worker counts and commits."""
    agent(ws, """
        echo 'changed' > README.md
        blob=$(git hash-object -w README.md)
        git replace "$(git rev-parse HEAD:README.md)" "$blob"
    """)
    assert git("diff", "--stat", "HEAD", cwd=ws.path) == ""  # git in the clone sees none
    assert ws.changed_files() == ["README.md"]
    assert ws.diff_line_count() == 3  # hello, world removed; changed added


# --- remote helpers, hard links ------------------------------------------------------


def test_a_remote_helper_is_never_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the transports of the repositories a task may name: `evil::x` would run
    git-remote-evil from the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "helper-ran"
    helper = bin_dir / "git-remote-evil"
    helper.write_text(f"#!/bin/sh\ntouch '{marker}'\nexit 1\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for repo in ("evil::x", "ext::sh -c touch% " + str(marker)):
        with pytest.raises(CloneFailed):
            Workspace.clone(repo, tmp_path / "w", "run")
    assert not marker.exists()


def test_a_clone_shares_no_object_file_with_its_origin(ws: Workspace, remote: Path) -> None:
    """A clone of a path used to hard-link the origin's objects: rewriting one in the
    clone (its owner may chmod it) rewrote the origin repository."""
    for git_dir in (ws.path / ".git", ws.git_dir):
        objects = [p for p in (git_dir / "objects").rglob("*") if p.is_file()]
        assert objects
        assert all(p.stat().st_nlink == 1 for p in objects), objects
    for packed in (ws.path / ".git" / "objects").rglob("*"):
        if packed.is_file():
            packed.chmod(0o600)
            packed.write_bytes(b"rewritten by the agent")
    git("--git-dir", str(remote), "fsck", "--strict")  # the origin is intact
    ws.keep_agent_tree()  # and the worker's copy too
    assert not ws.has_changes()


# --- modes, the lock, the root -------------------------------------------------------


def test_a_clone_and_its_git_directory_are_the_workers_alone(ws: Workspace) -> None:
    for path in (ws.path, ws.git_dir, ws.path / "README.md", ws.path / ".git" / "config",
                 ws.git_dir / "HEAD", ws.path.parent):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))


def test_the_workspace_root_and_its_missing_parents_are_made_0700(tmp_path: Path) -> None:
    root = tmp_path / "state" / "runlane" / "workspaces"
    make_private_dirs(root)
    for made in (root, root.parent, root.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert unsafe_workspace_root(root) is None


@pytest.mark.parametrize("target", ["missing", "existing"])
def test_a_symlink_planted_at_the_lock_path_is_not_followed(remote: Path, tmp_path: Path,
                                                            target: str) -> None:
    root = tmp_path / "w"
    root.mkdir()
    victim = tmp_path / "victim"
    if target == "existing":
        victim.write_text("the worker's file\n")
    (root / "run.lock").symlink_to(victim)
    with pytest.raises(WorkspaceError, match="not a lock file"):
        Workspace.clone(str(remote), root, "run")
    assert not Workspace.remove_named(root, "run")
    if target == "existing":
        assert victim.read_text() == "the worker's file\n"
    else:
        assert not victim.exists()  # never created through the link
    assert (root / "run.lock").is_symlink() and not (root / "run").exists()


def test_a_fifo_at_the_lock_path_is_refused_without_hanging(remote: Path, tmp_path: Path
                                                            ) -> None:
    root = tmp_path / "w"
    root.mkdir()
    os.mkfifo(root / "run.lock")
    with pytest.raises(WorkspaceError, match="not a lock file"):
        Workspace.clone(str(remote), root, "run")


def test_removing_a_clone_never_chmods_through_a_link_the_agent_left(remote: Path,
                                                                     tmp_path: Path) -> None:
    """Removal makes read-only directories writable again to empty them; a symbolic
    link in one, to a file of the worker's, had that file chmodded 0700 through it.
    (Root ignores modes: the removal runs without CAP_DAC_OVERRIDE then.)"""
    root = tmp_path / "w"
    ws = Workspace.clone(str(remote), root, "run")
    victim = tmp_path / "credentials"
    victim.write_text("secret\n")
    victim.chmod(0o400)
    agent(ws, f"mkdir trap; ln -s '{victim}' trap/link; chmod 500 trap")
    ws.release()  # as a killed attempt leaves it
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root ignores directory modes, and setpriv is missing")
    as_owner = ([] if os.geteuid() != 0 else
                ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner"])
    subprocess.run([*as_owner, sys.executable, "-c",
                    "import sys; from pathlib import Path; from runlane.workspace import "
                    "Workspace; assert Workspace.remove_named(Path(sys.argv[1]), 'run')",
                    str(root)], check=True)
    assert not ws.path.exists()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o400


@pytest.mark.parametrize(("mode", "says"), [
    (0o777, "writable by other users (mode 0777)"),
    (0o770, "writable by other users (mode 0770)"),
    (0o1777, "writable by other users (mode 1777)"),
])
def test_a_root_other_users_can_write_is_unsafe(tmp_path: Path, mode: int, says: str) -> None:
    root = tmp_path / "ws"
    root.mkdir()
    root.chmod(mode)
    reason = unsafe_workspace_root(root)
    assert reason is not None and says in reason and f"chmod go-w {root}" in reason
    root.chmod(0o755)  # readable is the operator's choice; the clones are 0700
    assert unsafe_workspace_root(root) is None


def test_a_root_another_user_owns_is_unsafe(tmp_path: Path) -> None:
    root = tmp_path / "ws"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)  # the tests run as root
    reason = unsafe_workspace_root(root)
    assert reason is not None and "owned by uid 65534" in reason


def test_a_parent_that_lets_another_user_swap_the_root_is_unsafe(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    root = shared / "ws"
    root.mkdir(parents=True, mode=0o700)
    shared.chmod(0o777)  # anyone may rename ws away and put theirs in its place
    reason = unsafe_workspace_root(root)
    assert reason is not None and f"{shared}, on its path, is writable by other users" in reason
    shared.chmod(0o1777)  # sticky, as /tmp: only the owner of ws may rename it
    assert unsafe_workspace_root(root) is None
    shared.chmod(0o755)
    os.chown(shared, 65534, 65534)
    reason = unsafe_workspace_root(root)
    assert reason is not None and f"{shared}, on its path, is owned by uid 65534" in reason


def test_a_symlinked_root_is_checked_where_it_points_and_on_the_way(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert unsafe_workspace_root(link) is None
    real.chmod(0o777)
    reason = unsafe_workspace_root(link)
    assert reason is not None and "writable by other users" in reason
    real.chmod(0o700)
    os.lchown(link, 65534, 65534)  # its owner can point it elsewhere
    reason = unsafe_workspace_root(link)
    assert reason is not None and f"{link}, on its path, is owned by uid 65534" in reason


# --- git dies with its worker, and the workspace's lock outlives no git process -------------

# A "worker": clones (or clones, commits and pushes) through an ssh remote whose ssh
# command hangs, so that its git process is alive when the test SIGKILLs it.
GIT_WORKER = r'''
import sys
from pathlib import Path
from runlane.workspace import Workspace
mode, root, remote = sys.argv[1:4]
if mode == "clone":
    Workspace.clone("ssh://example.invalid/repo.git", Path(root), "run-1-1", timeout=600)
else:
    ws = Workspace.clone(remote, Path(root), "run-1-1", timeout=600)
    (ws.path / "new.txt").write_text("work\n")
    ws.keep_agent_tree()
    ws.commit_all("agent/task-1/run-1", "msg", "Agent-Run-ID: run-1")
    ws.remote_url = "ssh://example.invalid/repo.git"
    ws.push("agent/task-1/run-1")
'''


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z...), None when it is gone."""
    try:
        stat_ = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat_[stat_.rfind(b")") + 2:].split()[0].decode()


def _ppid(pid: int) -> int:
    stat_ = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat_[stat_.rfind(b")") + 2:].split()[1])


@pytest.mark.parametrize("mode", ["clone", "push"])
def test_git_dies_with_its_worker_and_the_lock_outlives_no_git_process(
        remote: Path, tmp_path: Path, mode: str) -> None:
    """SIGKILL a worker while its git runs (a clone; a push, as the finalizer's): git
    gets SIGKILL with it (PR_SET_PDEATHSIG), and the workspace's lock stays held as long
    as any process git started lives (here its ssh, which a dead git does not stop), so
    the next attempt's cleanup (``remove_named``) leaves the tree alone until the last
    one is gone, then removes it."""
    from .support import SRC
    from .test_worker import wait_until

    ssh = tmp_path / "ssh.sh"
    pid_file = tmp_path / "ssh.pid"
    ssh.write_text(f'#!/bin/sh\necho $$ > "{pid_file}.tmp"\nmv "{pid_file}.tmp" "{pid_file}"\n'
                   "exec sleep 300\n")
    ssh.chmod(0o755)
    root = tmp_path / "workspaces"
    env = {**os.environ, "PYTHONPATH": SRC, "GIT_SSH_COMMAND": str(ssh),
           "GIT_SSH_VARIANT": "simple"}
    worker = subprocess.Popen([sys.executable, "-c", GIT_WORKER, mode, str(root), str(remote)],
                              env=env, stderr=subprocess.PIPE)
    ssh_pid = 0
    try:
        wait_until(lambda: pid_file.exists() or worker.poll() is not None, 30,
                   f"the worker's git {mode} to start its ssh")
        assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
        ssh_pid = int(pid_file.read_text())
        git_pid = _ppid(ssh_pid)
        assert _ppid(git_pid) == worker.pid  # the worker's own git
        assert not Workspace.remove_named(root, "run-1-1")  # its worker holds it

        worker.kill()
        worker.wait()
        wait_until(lambda: _state(git_pid) in (None, "Z"), 5, "git to die with its worker")
        assert _state(ssh_pid) not in (None, "Z")  # git's own child lives on...
        assert not Workspace.remove_named(root, "run-1-1")  # ...and holds the lock
        assert (root / "run-1-1").exists() or mode == "clone"

        os.kill(ssh_pid, signal.SIGKILL)
        wait_until(lambda: _state(ssh_pid) in (None, "Z"), 5, "the ssh command to end")
        assert Workspace.remove_named(root, "run-1-1")
        assert not (root / "run-1-1").exists()
    finally:
        worker.kill()
        worker.wait()
        if ssh_pid and _state(ssh_pid) not in (None, "Z"):
            os.kill(ssh_pid, signal.SIGKILL)
