"""The worker end to end against an agent that plants git configuration and swaps its
.git, on SQLite and PostgreSQL; and the workspace root a worker accepts at start."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.api import Runlane
from runlane.codehost.local_forge import LocalForge
from runlane.settings import Settings, SettingsInvalid, default_workspace_dir

from .conftest import WITH_PGBOUNCER, db_url_with_pgbouncer
from .support import bare_remote, cli_env, one_line_error

# This suite runs through PgBouncer (transaction pooling) too.
db_url = pytest.fixture(params=WITH_PGBOUNCER)(db_url_with_pgbouncer)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    settings = Settings(database_url=db_url, workspace_dir=tmp_path / "workspaces",
                        artifacts_dir=tmp_path / "artifacts", heartbeat_seconds=0.2,
                        agent_term_grace_seconds=0.5)
    with Runlane(settings=settings) as lane:
        yield lane


def run_worker(lane: Runlane, forge_dir: Path, agent: str) -> list[str]:
    worker = lane.worker(agent_command=agent, exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(forge_dir))
    thread = threading.Thread(target=worker.run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return worker.outcomes


# Everything an agent could leave for the worker's `git add`, `commit` and `push`.
PLANTS = """
git config filter.x.clean "touch '{marker}'; echo FILTERED"
git config filter.x.required true
git config core.sshCommand "touch '{marker}'; false"
git config credential.helper "!touch '{marker}'; echo password=x"
git config core.fsmonitor "touch '{marker}'; false"
git config 'url.{decoy}.insteadOf' '{remote}'
git config 'url.{decoy}.pushInsteadOf' '{remote}'
printf '[filter "y"]\\n\\tclean = touch {marker}; cat\\n' > "$RUNLANE_ARTIFACTS_DIR/inc"
git config include.path "$RUNLANE_ARTIFACTS_DIR/inc"
mkdir -p .git/hooks && printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/pre-push
chmod +x .git/hooks/pre-push
echo '* filter=x' > .gitattributes
echo '*.md filter=y' >> .gitattributes
"""
# ... or swap its .git for a repository of its own that pushes to the decoy.
SWAP = """
git init -q '{evil}'
git -C '{evil}' config filter.x.clean "touch '{marker}'; echo FILTERED"
git -C '{evil}' config 'url.{decoy}.pushInsteadOf' '{remote}'
rm -rf .git && echo 'gitdir: {evil}/.git' > .git
echo '* filter=x' > .gitattributes
"""


@pytest.mark.parametrize("how", ["plant", "swap"])
def test_nothing_an_agent_plants_in_its_clone_acts_for_the_worker(
        lane: Runlane, tmp_path: Path, how: str) -> None:
    """The run still commits the agent's real change and pushes it to the task's
    remote; the planted filter, ssh command, helper, hook, include and URL rewrites
    never run or redirect (their marker is never written, the decoy gets nothing)."""
    remote = bare_remote(tmp_path)
    forge_dir = tmp_path / "forge"
    decoy, marker = tmp_path / "decoy.git", tmp_path / "planted-ran"
    git("init", "--quiet", "--bare", str(decoy))
    script = (PLANTS if how == "plant" else SWAP).format(
        marker=marker, decoy=decoy, remote=remote, evil=tmp_path / "evil")
    run_id = lane.submit("acme", str(remote), "improve the readme", max_attempts=1).run_id
    agent = f"set -e\n{script}\necho 'improved by the agent' > README.md\n"
    assert run_worker(lane, forge_dir, agent) == ["pull_request"], lane.run(run_id)["message"]
    run = lane.run(run_id)
    branch = f"agent/{run['task_id']}/{run_id}"
    assert git("--git-dir", str(remote), "show", f"{branch}:README.md") == (
        "improved by the agent\n")
    assert ".git" not in git("--git-dir", str(remote), "ls-tree", "--name-only",
                             branch).split()
    assert git("--git-dir", str(decoy), "for-each-ref") == ""
    assert not marker.exists()
    assert lane.audit() == []


# --- the workspace root -----------------------------------------------------------------


def test_workspaces_default_to_the_workers_state_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNLANE_WORKSPACE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert Settings().workspace_dir == tmp_path / "state" / "runlane" / "workspaces"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")  # ignored, as the spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_workspace_dir() == tmp_path / "home" / ".local" / "state" / "runlane" / (
        "workspaces")
    assert Settings().workspace_dir == default_workspace_dir()


def test_a_worker_makes_its_default_workspace_root_private(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNLANE_WORKSPACE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'w.db'}",
                        artifacts_dir=tmp_path / "artifacts")
    with Runlane(settings=settings) as lane:
        lane.upgrade_schema()
        lane.worker(agent_command="true")
    root = tmp_path / "state" / "runlane" / "workspaces"
    for made in (root, root.parent, root.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made


@pytest.mark.parametrize("unsafe", ["group-writable", "world-writable-parent",
                                    "other-owner"])
def test_a_worker_refuses_a_workspace_root_another_user_can_write(
        tmp_path: Path, unsafe: str) -> None:
    root = tmp_path / "shared" / "ws"
    root.mkdir(parents=True, mode=0o700)
    if unsafe == "group-writable":
        root.chmod(0o770)
        says = f"WORKSPACE_DIR {root}: writable by other users (mode 0770); fix: chmod go-w"
    elif unsafe == "world-writable-parent":
        (tmp_path / "shared").chmod(0o777)
        says = (f"WORKSPACE_DIR {root}: {tmp_path / 'shared'}, on its path, is writable by other "
                "users without the sticky bit")
    else:
        os.chown(root, 65534, 65534)  # the tests run as root
        says = f"WORKSPACE_DIR {root}: owned by uid 65534"
    env = cli_env(tmp_path, RUNLANE_WORKSPACE_DIR=str(root),
                  RUNLANE_DATABASE_URL=f"sqlite:///{tmp_path / 'w.db'}")
    cli = [sys.executable, "-m", "runlane"]
    subprocess.run([*cli, "db", "upgrade"], cwd=tmp_path, env=env, check=True,
                   capture_output=True)
    done = subprocess.run([*cli, "worker", "--agent-command", "true", "--exit-when-idle"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    one_line_error(done, 2, says)
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'w.db'}", workspace_dir=root)
    with Runlane(settings=settings) as lane, pytest.raises(SettingsInvalid) as caught:
        lane.worker(agent_command="true")
    assert str(caught.value).startswith(says) and caught.value.exit_code == 2
