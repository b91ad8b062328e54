"""Finalization edges: side effects across retries, races and code-host errors.

Each test drives real attempts (``AttemptDriver.run``) on a real database (SQLite and
PostgreSQL), with a real agent subprocess, a real bare git repository as the remote
and, for GitHub, the fake GitHub over real HTTP (``tests/fake_github.py``). The
task's repository is the local bare one (git clones and pushes there); its pull
requests live on the fake, through ``GitHubFor`` below.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.agents.command import CommandRunner
from runlane.clock import ManualClock
from runlane.codehost.base import PullRequest, branch_name
from runlane.codehost.github import GitHubClient
from runlane.codehost.local_forge import LocalForge
from runlane.store import history
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.worker.attempt import AttemptDriver, AttemptSettings, AttemptState
from runlane.worker.finalizer import (
    MAX_PR_BODY_CHARS,
    PUSH_EFFECT,
    pr_body,
    pr_title,
    trailer,
)
from runlane.workspace import Workspace

from . import fake_github
from .fake_github import FakeGitHub
from .support import attempts_of, bare_remote, events_of, run_row, spec

TTL = 60.0
GH_REPO = "octo/app"
AGENT_WRITES = "echo 'fixed' > fix.txt"


@pytest.fixture
def remote(tmp_path: Path) -> Path:
    """A bare repository with one commit on main: a real remote."""
    return bare_remote(tmp_path)


def agent_branches(remote: Path) -> list[str]:
    out = subprocess.run(["git", "--git-dir", str(remote), "branch", "--list", "agent/*"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub(token="s3cr3t-token") as gh:
        gh.add_repo(GH_REPO)
        yield gh


class GitHubFor:
    """The GitHub client for a task whose git remote is a local bare repository: every
    call goes to the fake's ``octo/app`` (what ``OWNER/NAME`` would be on GitHub)."""

    def __init__(self, client: GitHubClient) -> None:
        self.client = client

    def find_pull_request(self, repo: str, head_branch: str, marker: str
                          ) -> PullRequest | None:
        return self.client.find_pull_request(GH_REPO, head_branch, marker)

    def open_pull_request(self, repo: str, **kwargs: Any) -> PullRequest:
        return self.client.open_pull_request(GH_REPO, **kwargs)

    def list_pull_requests(self, repo: str) -> list[PullRequest]:
        return self.client.list_pull_requests(GH_REPO)

    def close_pull_request(self, repo: str, number: int) -> PullRequest:
        return self.client.close_pull_request(GH_REPO, number)

    def comment_on_pull_request(self, repo: str, number: int, body: str, *,
                                marker: str) -> bool:
        return self.client.comment_on_pull_request(GH_REPO, number, body, marker=marker)

    def set_deadline(self, deadline: float | None) -> None:
        self.client.set_deadline(deadline)

    def close(self) -> None:
        self.client.close()


def github_host(fake: FakeGitHub, timeout: float = 10.0) -> Any:
    return lambda repo: GitHubFor(GitHubClient(fake.url, token="s3cr3t-token",
                                               timeout=timeout))


def driver_for(store: Store, tmp_path: Path, code_host_for: Any,
               agent: str = AGENT_WRITES) -> AttemptDriver:
    return AttemptDriver(store, CommandRunner(agent, term_grace_seconds=0.5),
                         AttemptSettings(tmp_path / "workspaces", tmp_path / "artifacts"),
                         code_host_for=code_host_for)


def claim(store: Store) -> Lease:
    [lease] = store.claim("w1", lease_ttl=TTL)
    return lease


def run_attempt(store: Store, driver: AttemptDriver) -> str:
    return driver.run(AttemptState(claim(store), store))


# --- the code host's rate limit -------------------------------------------------------------


def test_a_code_host_rate_limit_retry_after_delays_the_retry(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        fake: FakeGitHub) -> None:
    """GitHub answers 429 with ``Retry-After: 3600`` (or a rate-limit 403 with
    ``X-RateLimit-Reset``): ``GitHubClient`` reads it into ``CodeHostError.retry_after``,
    but ``AttemptDriver.run`` fails the attempt CODE_HOST_FAILED_TRANSIENT *without*
    passing ``retry_after`` on, so the run is retried after the ordinary backoff (here
    at most 12.5 s; 30 s by default) instead of an hour. Every worker hammers a rate
    limited API, each retry burns an attempt, and the run fails for good long before
    the limit resets, with its branch already pushed and no pull request."""
    [sub] = store.submit([spec(repo=str(remote))])
    fake.fail_next(1, 429, retry_after="3600")  # the finalizer's first call: the lookup
    ended = run_attempt(store, driver_for(store, tmp_path, github_host(fake)))
    assert ended == "CODE_HOST_FAILED_TRANSIENT"
    [first] = attempts_of(store, sub.run_id)
    assert first.retry_after_seconds == 3600, (
        f"the attempt recorded retry_after_seconds={first.retry_after_seconds!r}, "
        "not the 3600 s GitHub asked for")
    clock.advance(200)  # past any ordinary backoff of the test's retry policy
    assert store.claim("w1", lease_ttl=TTL) == [], \
        "the run was claimed again 200 s later, while GitHub said to wait 3600 s"
    assert store.audit() == []


# --- a stale push that lands between the look and the push -----------------------------------


def test_a_stale_push_that_lands_first_is_replaced_never_adopted_and_reported(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 1 recorded its push intent (naming its commit), then lost its lease with
    its ``git push`` still on its way (the push runs in its own session and outlives a
    SIGKILLed worker; a paused worker's push lands late). Attempt 2 finds no branch,
    runs its agent, commits and pushes; attempt 1's push lands in between. Before, the
    rejected push looked again and adopted any commit carrying the run's trailer:
    attempt 2's pull request showed attempt 1's work and its own agent's was dropped.
    Now attempt 2's push is conditional on what it saw (no branch), is rejected, and
    the commit it then finds is neither its own nor the one the ledger recorded (its
    intent named its own): it is replaced (``--force-with-lease`` over that commit),
    never adopted, and reported on the run and in the ledger."""
    [sub] = store.submit([spec(repo=str(remote))])
    forge = tmp_path / "forge"
    driver = driver_for(store, tmp_path, lambda repo: LocalForge(forge))
    branch = branch_name(sub.task_id, sub.run_id)

    # Attempt 1: its commit, its intent naming it; then its lease is lost.
    first = claim(store)
    orphan = Workspace.clone(str(remote), tmp_path / "orphan", "attempt-1")
    (orphan.path / "fix.txt").write_text("fixed by attempt 1\n")
    stale = orphan.commit_all(branch, pr_title({"prompt": "fix the flaky test"}),
                              trailer(sub.run_id))
    store.effect_intent(first, PUSH_EFFECT, intent={"sha": stale})
    clock.advance(TTL + 1)
    assert store.reap_expired_leases() == 1
    clock.advance(1000)

    real_push = Workspace.push
    landed: list[str] = []

    def push_after_the_stale_one_lands(self: Workspace, branch: str, *,
                                       expected: str | None = None,
                                       timeout: float | None = None) -> None:
        if not landed:
            real_push(orphan, branch)  # attempt 1's push lands now
            landed.append(branch)
        real_push(self, branch, expected=expected, timeout=timeout)

    monkeypatch.setattr(Workspace, "push", push_after_the_stale_one_lands)
    assert run_attempt(store, driver) == "pull_request"
    assert landed, "the race was not staged"
    run = run_row(store, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "pull_request")
    push = {e.effect_key: e for e in store.side_effects(sub.run_id)}[PUSH_EFFECT]
    assert push.attempt_no == 2 and push.result is not None
    assert push.result["sha"] != stale, "attempt 1's stale commit was adopted"
    assert push.result["replaced"] == stale
    on_remote = subprocess.run(["git", "--git-dir", str(remote), "rev-parse", branch],
                               capture_output=True, text=True, check=True).stdout.strip()
    assert on_remote == push.result["sha"]
    shown = subprocess.run(["git", "--git-dir", str(remote), "show", f"{branch}:fix.txt"],
                           capture_output=True, text=True, check=True).stdout
    assert shown == "fixed\n"  # attempt 2's agent's work, not attempt 1's
    with store.engine.connect() as conn:
        notes = conn.execute(text(
            "SELECT from_status, to_status, attempt_no, message FROM run_events "
            "WHERE run_id = :r AND reason_code = 'STALE_PUSH_REPLACED'"),
            {"r": sub.run_id}).all()
    assert [(n.from_status, n.to_status, n.attempt_no) for n in notes] == [
        ("FINALIZING", "FINALIZING", 2)]
    assert stale in notes[0].message
    assert len(LocalForge(forge).list_pull_requests(str(remote))) == 1
    assert store.audit() == []


# --- a pull request created although the client did not hear back ----------------------------


def test_a_pull_request_created_despite_a_timed_out_response_is_adopted(
        store: Store, tmp_path: Path, remote: Path, fake: FakeGitHub,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GitHub creates the pull request but the response does not arrive in time (a read
    timeout; a 502 from GitHub's front end after the create does the same). The client
    raises a transient CodeHostError and the attempt fails CODE_HOST_FAILED_TRANSIENT
    without looking the marker up again, although the ambiguity is exactly what the
    marker is for. On the run's last attempt (here its only one) the run ends FAILED
    while its pull request is open on GitHub: the run's record and the code host
    disagree for good (``runlane prs list`` shows nothing). With attempts left, an
    attempt and a backoff are spent on a pull request that already exists."""
    [sub] = store.submit([spec(repo=str(remote), max_attempts=1)])
    real_handle = fake_github._Handler._handle

    def create_then_answer_late(self: Any, method: str) -> None:
        if method != "POST":
            return real_handle(self, method)
        wire, self.wfile = self.wfile, io.BytesIO()
        try:
            real_handle(self, method)  # the pull request is created now
            answer = self.wfile.getvalue()
        finally:
            self.wfile = wire
        time.sleep(1.5)  # ... and its answer comes after the client gave up
        with contextlib.suppress(OSError):
            wire.write(answer)
        return None

    monkeypatch.setattr(fake_github._Handler, "_handle", create_then_answer_late)
    run_attempt(store, driver_for(store, tmp_path, github_host(fake, timeout=0.5)))
    assert len(fake.pulls(GH_REPO)) == 1
    run = run_row(store, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "pull_request"), (
        f"run ended {run.status} {run.reason_code}: {run.message!r} while its pull "
        f"request #{fake.pulls(GH_REPO)[0]['number']} is open")
    [recorded] = store.pull_requests()
    assert recorded["number"] == fake.pulls(GH_REPO)[0]["number"]
    assert store.audit() == []


# --- GitHub's eventual consistency right after a push ---------------------------------------


def test_a_head_not_yet_visible_right_after_the_push_is_retried_not_failed(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        fake: FakeGitHub) -> None:
    """Right after a push GitHub may not know the new branch yet and refuses the pull
    request with 422 ``Validation Failed`` (``head`` ``invalid``). ``GitHubClient._classify``
    makes every 422 but "already exists" permanent, so the attempt ends WORKER_ERROR and
    the run FAILED with its branch pushed and no pull request, although the branch was
    pushed by this very attempt a moment before and a retry (which resumes from the
    pushed branch without running the agent) would open it."""
    [sub] = store.submit([spec(repo=str(remote))])
    fake.check_branches = True  # GitHub does not see the branch yet
    driver = driver_for(store, tmp_path, github_host(fake))
    run_attempt(store, driver)
    fake.branches.add((GH_REPO, branch_name(sub.task_id, sub.run_id)))  # now it does
    clock.advance(1000)
    if run_row(store, sub.run_id).status == "QUEUED":
        run_attempt(store, driver)
    run = run_row(store, sub.run_id)
    assert run.status == "SUCCEEDED", (
        f"run ended {run.status} {run.reason_code}: {run.message!r} with its branch "
        "pushed and no pull request")
    assert len(fake.pulls(GH_REPO)) == 1
    assert store.audit() == []


# --- GitHub's limit on a pull request's body -----------------------------------------------


def test_a_long_prompt_still_opens_one_pull_request_with_the_marker(
        store: Store, tmp_path: Path, remote: Path, fake: FakeGitHub) -> None:
    """``finalizer.pr_body`` puts the task's whole prompt in the pull request's body and
    the run's marker *after* it. Prompts may be up to the 4 MB payload cap, but GitHub
    refuses a body over 65,536 characters (422 "body is too long"; the fake refuses it
    the same way), which ``GitHubClient._classify`` makes permanent: every run of a task
    with a long prompt (a pasted log, an issue thread) does its work, pushes its branch
    and then fails WORKER_ERROR without a pull request. The body must be cut to fit,
    keeping the marker (the identity the retries look the pull request up by)."""
    prompt = "fix the flaky test\n\n" + "log line: connection reset by peer\n" * 2500
    [sub] = store.submit([spec(repo=str(remote), prompt=prompt)])
    run_attempt(store, driver_for(store, tmp_path, github_host(fake)))
    run = run_row(store, sub.run_id)
    assert run.status == "SUCCEEDED", (
        f"run ended {run.status} {run.reason_code}: {run.message!r} with its branch "
        f"pushed ({len(agent_branches(remote))}) and no pull request")
    [pr] = fake.pulls(GH_REPO)
    assert len(pr["body"]) <= fake_github.MAX_BODY == 65536
    assert pr["body"].startswith("fix the flaky test\n\nlog line: connection reset")
    assert "the prompt is cut here" in pr["body"]
    assert pr["body"].endswith(f"<!-- agent-run-id: {sub.run_id} -->\n")
    assert store.audit() == []


def test_pr_body_is_cut_only_when_it_would_not_fit() -> None:
    task = {"task_id": "t1", "prompt": ""}
    footer = len(pr_body(task, "r1", 1))
    fits = {**task, "prompt": "x" * (MAX_PR_BODY_CHARS - footer)}
    assert pr_body(fits, "r1", 1) == fits["prompt"] + pr_body(task, "r1", 1)
    over = {**task, "prompt": "x" * (MAX_PR_BODY_CHARS - footer + 1)}
    body = pr_body(over, "r1", 1)
    assert len(body) <= MAX_PR_BODY_CHARS
    assert "the prompt is cut here" in body and body.endswith("<!-- agent-run-id: r1 -->\n")
    huge = pr_body({**task, "prompt": "y" * 4_000_000}, "r1", 1)
    assert len(huge) <= MAX_PR_BODY_CHARS and "4,000,000 characters in all" in huge


# --- a run whose pull request is recorded is not failed for want of attempts -----------------


def test_a_worker_lost_after_its_pull_request_was_recorded_does_not_fail_the_run(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's last attempt (here its only one) pushes, opens its pull request and
    records both in the ledger; then the database connection drops on the completion
    write (or the worker dies right there). The attempt is abandoned, the reaper ends it
    WORKER_LOST and, the attempt budget being spent, fails the run for good
    (``Store._end_attempt`` decides by the budget alone). The run is FAILED while its
    pull request is open and listed by ``runlane prs list``: the finalizer's own rule,
    "a retry must not end FAILED while the run's branch and pull request exist", is
    broken by the reaper. Finishing a run whose effects are all done needs no agent and
    no budget (``Finalizer.resume``), so it must not be refused for lack of attempts."""
    from sqlalchemy.exc import OperationalError

    [sub] = store.submit([spec(repo=str(remote), max_attempts=1)])
    forge = tmp_path / "forge"
    real_complete = Store.complete
    dropped: list[str] = []

    def connection_drops_once(self: Store, lease: Lease, **kwargs: Any) -> None:
        if not dropped:
            dropped.append(lease.run_id)
            raise OperationalError("UPDATE runs ...", {},
                                   Exception("server closed the connection unexpectedly"))
        real_complete(self, lease, **kwargs)

    monkeypatch.setattr(Store, "complete", connection_drops_once)
    driver = driver_for(store, tmp_path, lambda repo: LocalForge(forge))
    assert run_attempt(store, driver) == "abandoned"
    assert [e.status for e in store.side_effects(sub.run_id)] == ["DONE", "DONE"]
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    if run_row(store, sub.run_id).status == "QUEUED":
        clock.advance(1000)
        run_attempt(store, driver)
    run = run_row(store, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "pull_request"), (
        f"run ended {run.status} {run.reason_code} with its pull request "
        f"{store.pull_requests()[0]['url']} recorded and open")
    assert_completed_from_the_ledger(store, sub.run_id, remote, forge,
                                     attempt_reasons=["WORKER_LOST"])


def assert_completed_from_the_ledger(store: Store, run_id: str, remote: Path, forge: Path,
                                     *, attempt_reasons: list[str]) -> None:
    """Completed by the attempt's end, with no other attempt: the lost or failed attempt
    kept as evidence, the reason in the run's events, one branch, one pull request, and
    every invariant of ``runlane audit``."""
    run = run_row(store, run_id)
    assert run.reason_code == attempt_reasons[-1]  # the last failure's, as for any run
    assert [(a.status, a.reason_code) for a in attempts_of(store, run_id)] == [
        ("FAILED", reason) for reason in attempt_reasons]
    assert events_of(store, run_id)[-1] == ("FINALIZING", "SUCCEEDED")
    with store.engine.connect() as conn:
        last = conn.execute(text(history.RUN_HISTORY), {"run_id": run_id}).all()[-1]
    assert last.reason_code == attempt_reasons[-1]
    assert last.message.startswith("completed from the recorded pull request ")
    assert f"attempt {len(attempt_reasons)} ended {attempt_reasons[-1]}" in last.message
    assert len(agent_branches(remote)) == 1
    assert len(LocalForge(forge).list_pull_requests(str(remote))) == 1
    assert len(store.pull_requests()) == 1
    assert store.audit() == []


def test_an_attempt_that_fails_after_its_pull_request_was_recorded_completes_the_run(
        store: Store, tmp_path: Path, remote: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the worker's side: the completion write raises an unexpected error
    (WORKER_ERROR, not retried) on a run with attempts left. The run is completed from
    its recorded pull request at once: not failed, not queued for another attempt."""
    [sub] = store.submit([spec(repo=str(remote), max_attempts=3)])
    forge = tmp_path / "forge"

    def completion_breaks(self: Store, lease: Lease, **kwargs: Any) -> None:
        raise RuntimeError("a bug in the completion")

    monkeypatch.setattr(Store, "complete", completion_breaks)
    driver = driver_for(store, tmp_path, lambda repo: LocalForge(forge))
    assert run_attempt(store, driver) == "WORKER_ERROR"
    run = run_row(store, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "pull_request"), (
        f"run ended {run.status} {run.reason_code} with its pull request recorded")
    assert_completed_from_the_ledger(store, sub.run_id, remote, forge,
                                     attempt_reasons=["WORKER_ERROR"])


# --- credentials in a repository URL ---------------------------------------------------------

SECRET = "ghp_s3cr3tT0ken"


@pytest.mark.parametrize("repo", [
    f"https://bob:{SECRET}@github.com/octo/app/tree/main",  # GitHub, not OWNER/NAME
    f"https://x-access-token:{SECRET}@git.example.com/octo/app.git",  # no code host
    f"https://{SECRET}@github.com/octo",  # a token alone, no name
    f"https://bob:p@ss{SECRET}@git.example.com/octo/app.git",  # an unencoded @
])
def test_a_repository_url_with_credentials_never_reaches_a_run_message(
        store: Store, tmp_path: Path, repo: str) -> None:
    """``parse_github_repo`` and ``code_host_for`` put the repository they refuse in
    their error, which the attempt records as the run's message (TASK_CONTRACT_INVALID):
    the token of ``https://user:TOKEN@host/...`` must not be in it, in an event or in an
    attempt (what the workspace already did for git's errors)."""
    from runlane.codehost.factory import code_host_for

    [sub] = store.submit([spec(repo=repo)])
    ended = run_attempt(store, driver_for(store, tmp_path, code_host_for))
    assert ended == "TASK_CONTRACT_INVALID"
    run = run_row(store, sub.run_id)
    assert run.status == "FAILED" and "***@" in run.message, run.message
    with store.engine.connect() as conn:
        written = [str(v) for v in conn.execute(text(
            "SELECT message FROM run_events WHERE run_id = :r UNION ALL "
            "SELECT message FROM attempts WHERE run_id = :r UNION ALL "
            "SELECT end_message FROM attempts WHERE run_id = :r"), {"r": sub.run_id}
            ).scalars()]
    for text_ in [run.message, *written]:
        assert SECRET not in text_ and "p@ss" not in text_, text_
    assert store.audit() == []
