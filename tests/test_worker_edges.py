"""Review of the worker and finalizer against CONTRACT.md's agent protocol and DESIGN.md's
invariants, with real agent processes, real git repositories (a local bare repository is
the remote) and the local forge (a review, 2026-12-02). Each test here failed before its
fix."""

# ruff: noqa: F811  (the fixtures of test_worker, imported, are parameters here)
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runlane.agents.base import AttemptLimits
from runlane.api import Runlane
from runlane.codehost.local_forge import LocalForge

from .test_worker import (  # noqa: F401 - fixtures
    agent_branches,
    db_url,
    forge_dir,
    lane,
    pstore,
    pull_requests,
    remote,
    run_worker,
    submit_one,
    workers,
)

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def files_on_branch(remote: Path, branch: str) -> list[str]:
    out = subprocess.run(["git", "--git-dir", str(remote), "diff", "--name-only",
                          f"main...{branch}"], capture_output=True, text=True, check=True)
    return sorted(out.stdout.split())


# --- the verify command's own output --------------------------------------------------------


def test_files_the_verify_command_writes_are_not_committed_past_the_limits(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """The changed-files limit is checked after the agent, before the verify command; the
    finalizer then commits whatever the verify command left too (caches, reports)."""
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir, "echo fix > fix.txt",
               verify_command="mkdir -p .cache && touch .cache/a .cache/b report.xml",
               limits=AttemptLimits(max_changed_files=1))
    run = lane.run(run_id)
    branches = agent_branches(remote)
    pushed = files_on_branch(remote, branches[0]) if branches else []
    assert len(pushed) <= 1, (run["status"], run["outcome"], pushed)


def test_an_agent_without_changes_gets_no_pull_request_of_verify_output(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """CONTRACT.md: no change at all (by the agent) succeeds with outcome no_changes and
    opens nothing; a verify command that writes a cache must not turn it into a PR."""
    run_id = submit_one(lane, remote)
    assert run_worker(lane, forge_dir, "echo nothing to do",
                      verify_command="touch .verify-cache") == ["no_changes"]
    assert lane.run(run_id)["outcome"] == "no_changes"
    assert agent_branches(remote) == [] and pull_requests(forge_dir, remote) == []


# --- an agent that pushes the run's branch itself -------------------------------------------


def test_a_branch_the_agent_pushed_itself_is_not_adopted_as_the_runs_push(
        lane: Runlane, remote: Path, forge_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent pushes a work-in-progress commit to the run's branch name (it knows the
    ids), then keeps working. The finalizer's lookup adopts any branch of that name, so
    the pull request shows the stale work in progress, without the final change and
    without the run's trailer (invariant 8: the marker identifies runlane's own push).
    SANDBOX=off: an agent with the network and a token of its own can push to a hosted
    remote; the local bare remote standing for it here the sandbox (rightly) hides."""
    monkeypatch.setattr(lane.settings, "sandbox", "off")
    run_id = submit_one(lane, remote)
    task_id = lane.run(run_id)["task_id"]
    agent = ("git checkout -q -b agent/$RUNLANE_TASK_ID/$RUNLANE_RUN_ID && echo wip > wip.txt "
             "&& git add wip.txt && git -c user.name=a -c user.email=a@a commit -qm wip "
             "&& git push -q origin HEAD && echo final > final.txt")
    assert run_worker(lane, forge_dir, agent) == ["pull_request"]
    branch = f"agent/{task_id}/{run_id}"
    message = subprocess.run(["git", "--git-dir", str(remote), "log", "-1", "--format=%B",
                              branch], capture_output=True, text=True, check=True).stdout
    pushed = files_on_branch(remote, branch)
    assert (f"Agent-Run-ID: {run_id}" in message, pushed) == (True, ["final.txt", "wip.txt"])


# --- the repository's default branch ------------------------------------------------------


@pytest.fixture
def dangling_head_remote(tmp_path: Path) -> Path:
    """`git init --bare` (HEAD -> master) then `git push … main`: an ordinary way to make
    a remote; its HEAD names a branch that does not exist, main holds the code."""
    seed = tmp_path / "seed2"
    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True, env=GIT_ENV)
    (seed / "README.md").write_text("hello\n")
    subprocess.run(["git", "add", "."], cwd=seed, check=True, env=GIT_ENV)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=seed, check=True, env=GIT_ENV)
    bare = tmp_path / "dangling.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True, env=GIT_ENV)
    subprocess.run(["git", "symbolic-ref", "HEAD", "refs/heads/master"], cwd=bare, check=True)
    subprocess.run(["git", "push", "-q", str(bare), "main"], cwd=seed, check=True, env=GIT_ENV)
    return bare


def test_a_remote_whose_head_names_no_branch_is_not_treated_as_an_empty_repository(
        lane: Runlane, dangling_head_remote: Path, forge_dir: Path) -> None:
    """The clone checks nothing out, the workspace takes it for an empty repository: the
    agent runs in an empty directory, and its work is pushed as a root commit with no
    history in common with main (then the pull request to "master" fails). Expected: the
    agent sees the repository's files, or the run fails before the agent runs, pushing
    nothing."""
    run_id = submit_one(lane, dangling_head_remote, max_attempts=1)
    run_worker(lane, forge_dir, "ls -A > \"$RUNLANE_ARTIFACTS_DIR/seen\"; echo x > new.txt")
    run = lane.run(run_id)
    seen_file = Path(lane.settings.artifacts_dir) / run_id / "1" / "seen"
    seen = seen_file.read_text().split() if seen_file.exists() else []  # the agent ran?
    pushed = agent_branches(dangling_head_remote)
    assert "README.md" in seen or (pushed == [] and run["reason_code"] not in (
        None, "WORKER_ERROR")), (seen, pushed, run["status"], run["reason_code"],
                                 run["attempts"][-1]["message"])


# --- a cancel that arrives between the push and the pull request ----------------------------


class CancelOnLookup:
    """The real local forge; the user's cancel lands while the finalizer looks the pull
    request up (after the push, before the pull request is opened)."""

    def __init__(self, forge: LocalForge, cancel: Any) -> None:
        self.forge = forge
        self.cancel = cancel

    def find_pull_request(self, repo: str, head_branch: str, marker: str) -> Any:
        if self.cancel is not None:
            self.cancel()
            self.cancel = None
        return self.forge.find_pull_request(repo, head_branch, marker)

    def open_pull_request(self, repo: str, **kw: Any) -> Any:
        return self.forge.open_pull_request(repo, **kw)

    def list_pull_requests(self, repo: str) -> Any:
        return self.forge.list_pull_requests(repo)


def test_no_pull_request_is_opened_after_the_cancel_was_requested(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """Invariants 5 and 8, CONTRACT.md: nothing irreversible after a cancel. The cancel
    is checked once, when the intent is recorded; the lookup and the create follow
    without a second look, so the pull request is opened after the cancel and the run
    then ends CANCELLED with an open pull request."""
    sub = lane.submit("acme", str(remote), "improve the code")
    host = CancelOnLookup(LocalForge(forge_dir), lambda: lane.cancel(sub.task_id))
    worker = lane.worker(agent_command="echo change > change.txt", exit_when_idle=True,
                         code_host_for=lambda repo: host)
    worker.run()
    run = lane.run(sub.run_id)
    prs = pull_requests(forge_dir, remote)
    assert (run["status"], [pr.state for pr in prs]) == ("CANCELLED", [])


# --- exit 0 means done ------------------------------------------------------------------------


def test_an_agent_that_exits_0_after_an_earlier_fail_line_is_done(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """CONTRACT.md: "Exit 0: the agent is done"; a fail line classifies a non-zero exit.
    An agent that reported a rate limit, waited and then finished its work with exit 0
    has its work thrown away and the attempt failed PROVIDER_RATE_LIMIT."""
    run_id = submit_one(lane, remote, max_attempts=1)
    agent = ("echo '{\"runlane\": \"fail\", \"reason_code\": \"PROVIDER_RATE_LIMIT\", "
             "\"message\": \"429, retrying\"}'; echo done > result.txt; exit 0")
    run_worker(lane, forge_dir, agent)
    run = lane.run(run_id)
    assert (run["status"], run["outcome"], run["reason_code"]) == (
        "SUCCEEDED", "pull_request", None)


# --- cost lines the parser accepts --------------------------------------------------------------


def test_a_cost_line_with_a_large_token_count_still_counts_its_dollars(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """parse_control_line accepts any non-negative integer token count; the store cannot
    hold one past 64 bits, the whole report (dollars included) is dropped with a warning,
    and the run's cost limit is never enforced."""
    from runlane.domain.policy import parse_policy

    lane.store.apply_policy(parse_policy("[defaults.limits]\nmax_cost_usd = 0.5\n"),
                            source="test")
    run_id = submit_one(lane, remote, max_attempts=1)
    cost = ("echo '{\"runlane\": \"cost\", \"usd\": 0.4, "
            "\"input_tokens\": 100000000000000000000}'")
    run_worker(lane, forge_dir, f"{cost}; {cost}; sleep 2; echo x > x.txt")
    run = lane.run(run_id)
    assert (run["status"], run["reason_code"], run["cost_usd"]) == (
        "FAILED", "LIMIT_EXCEEDED", pytest.approx(0.8))


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL: see the docstring
def test_runs_show_json_stays_json_after_large_cost_lines(
        lane: Runlane, remote: Path, forge_dir: Path, db_url: str) -> None:
    """Two accepted cost lines of 1e308 dollars: SQLite sums them to inf and `runs show
    --json` prints `Infinity`, which is not JSON (CONTRACT.md: exactly one JSON document);
    PostgreSQL refuses the sum and the second report is lost with a warning (a run that
    then reads 1e308, which this test cannot tell from right)."""
    import json
    import sys

    from .test_worker import ROOT

    run_id = submit_one(lane, remote, max_attempts=1)
    cost = "echo '{\"runlane\": \"cost\", \"usd\": 1e308}'"
    run_worker(lane, forge_dir, f"{cost}; {cost}; echo x > x.txt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    out = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url, "runs",
                          "show", run_id, "--json"], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    shown = json.loads(out, parse_constant=refuse)
    attempts_cost = sum(a["cost_usd"] for a in shown["attempts"])
    assert shown["cost_usd"] == attempts_cost


# --- repository paths -------------------------------------------------------------------------


def test_a_home_relative_repository_is_cloned(lane: Runlane, remote: Path, forge_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """submit accepts `~/repo.git` (a local path), the local forge resolves it (its
    docstring lists `~/app`), but the clone hands `~` to git unexpanded: the run fails
    TASK_CONTRACT_INVALID "repository '~/repo.git' does not exist"."""
    monkeypatch.setenv("HOME", str(remote.parent))
    run_id = lane.submit("acme", "~/repo.git", "improve the code", max_attempts=1).run_id
    run_worker(lane, forge_dir, "echo x > x.txt")
    run = lane.run(run_id)
    assert (run["status"], run["outcome"]) == ("SUCCEEDED", "pull_request"), (
        run["reason_code"], run["attempts"][-1]["message"])


# --- a git repository the agent creates inside the workspace --------------------------------------


def test_a_repository_cloned_inside_the_workspace_is_not_pushed_as_a_dangling_gitlink(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """The agent vendors a library with `git clone … vendor/lib`. commit_all's `git add
    --all` records it as a gitlink (mode 160000) to a commit the remote does not have,
    without a .gitmodules: the pull request holds none of vendor/lib's files, and the run
    SUCCEEDS."""
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir, "git clone -q \"$RUNLANE_REPO\" vendor/lib && echo x > x.txt")
    run = lane.run(run_id)
    pushed = ""
    for branch in agent_branches(remote):
        pushed += subprocess.run(["git", "--git-dir", str(remote), "ls-tree", "-r", branch],
                                 capture_output=True, text=True, check=True).stdout
    assert "160000 commit" not in pushed, (run["status"], pushed)


def test_an_empty_repository_the_agent_created_is_not_a_worker_error(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """The agent runs `git init` in a subdirectory: `git add --all` refuses it, the
    WorkspaceError escapes the finalizer as an "attempt_crashed" traceback, and the run
    fails WORKER_ERROR, the code for a bug of runlane itself ("not retried blindly"),
    for what the agent left in its workspace."""
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir, "mkdir sub && cd sub && git init -q && echo x > f")
    run = lane.run(run_id)
    assert run["reason_code"] != "WORKER_ERROR", run["attempts"][-1]["message"]


# --- the run's wall-clock limit ----------------------------------------------------------------


def test_the_wall_clock_limit_covers_the_agent_and_the_verify_command_together(
        lane: Runlane, remote: Path, forge_dir: Path) -> None:
    """TIMEOUT means "the run's wall-clock limit passed", yet the agent and the verify
    command each get the whole limit from their own start: with a 1.5 s limit, 1 s of
    agent and 1 s of verify (2 s) succeed and open a pull request."""
    run_id = submit_one(lane, remote, max_attempts=1)
    run_worker(lane, forge_dir, "sleep 1; echo x > x.txt", verify_command="sleep 1",
               limits=AttemptLimits(wall_clock_seconds=1.5))
    run = lane.run(run_id)
    assert (run["status"], run["reason_code"]) == ("FAILED", "TIMEOUT")
    assert agent_branches(remote) == []
