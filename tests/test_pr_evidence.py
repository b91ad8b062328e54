"""Pull-request evidence is never lost, and the stale push window is closed (issue 22,
items 5 and 6), on SQLite and PostgreSQL.

Real parts throughout: real worker processes killed with SIGKILL and paused with
SIGSTOP, real git remotes (a bare repository, with a server-side hook that logs every
push that lands), the local forge, and the fake GitHub over real HTTP
(``tests/fake_github.py``). In-process tests drive real attempts (``AttemptDriver``)
with a pinned clock where the reaper's timing matters.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from runlane.clock import ManualClock
from runlane.codehost.base import (
    CodeHostError,
    PullRequest,
    branch_name,
    withdrawal_marker,
)
from runlane.codehost.github import GitHubClient
from runlane.codehost.local_forge import LocalForge
from runlane.domain.retry import MAX_FINALIZE_ONLY_ATTEMPTS, RetryPolicy, decide_finalize_only
from runlane.services.evidence_audit import CHECK, remote_audit
from runlane.store.evidence import CLOSE_EFFECT, MAX_WITHDRAWAL_TRIES
from runlane.store.invariants import check_database
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.worker.attempt import AttemptState
from runlane.worker.withdraw import Withdrawer
from runlane.workspace import PushFailed, Workspace

from . import test_worker
from .fake_github import FakeGitHub
from .support import attempts_of, cli_env, run_row, spec
from .test_finalize_edges import TTL, GitHubFor, claim, driver_for, run_attempt
from .test_worker import (
    AGENT_WRITES,
    WorkerProcess,
    agent_branches,
    pull_requests,
    reap_until,
    status_of,
    wait_until,
)

# The real-worker fixtures of tests/test_worker.py (processes, forge, remote).
workers = test_worker.workers
pstore = test_worker.pstore
remote = test_worker.remote
forge_dir = test_worker.forge_dir

GH_REPO = "octo/app"


def ledger(store: Store, run_id: str) -> dict[str, Any]:
    return {e.effect_key: e for e in store.side_effects(run_id)}


def remote_violations(store: Store, host_for: Callable[[str], Any]) -> list[str]:
    return [f"{v.check}: {v.detail}" for v in remote_audit(store, host_for).violations]


def note_events(store: Store, run_id: str, reason: str) -> list[Any]:
    with store.engine.connect() as conn:
        return conn.execute(text(
            "SELECT from_status, to_status, attempt_no, message FROM run_events "
            "WHERE run_id = :r AND reason_code = :reason ORDER BY event_id"),
            {"r": run_id, "reason": reason}).all()


def last_event_message(store: Store, run_id: str, to_status: str) -> str:
    with store.engine.connect() as conn:
        return str(conn.execute(text(
            "SELECT message FROM run_events WHERE run_id = :r AND to_status = :s "
            "ORDER BY event_id DESC LIMIT 1"), {"r": run_id, "s": to_status}).scalar())


@pytest.fixture
def fake() -> Iterator[FakeGitHub]:
    with FakeGitHub(token="s3cr3t-token", page_size=2) as gh:
        gh.add_repo(GH_REPO)
        yield gh


def github_for(fake: FakeGitHub) -> Callable[[str], Any]:
    return lambda repo: GitHubFor(GitHubClient(fake.url, token="s3cr3t-token", timeout=5.0))


# --- the decision (pure) -------------------------------------------------------------------


def test_finalize_only_decisions_are_bounded_and_never_retry_nothing() -> None:
    """Any failure of a finalize-only attempt is worth another look, up to the cap;
    one that found nothing ends the run; a drained one is given back at once."""
    policy = RetryPolicy(base_seconds=1.0, max_seconds=10.0)
    assert decide_finalize_only("WORKER_LOST", 0, policy).retry
    assert decide_finalize_only("WORKER_ERROR", 2, policy).retry  # not retried by decide()
    capped = decide_finalize_only("WORKER_LOST", MAX_FINALIZE_ONLY_ATTEMPTS, policy)
    assert (capped.retry, capped.final_reason) == (False, "WORKER_LOST")
    nothing = decide_finalize_only("NOTHING_TO_FINALIZE", 0, policy)
    assert (nothing.retry, nothing.final_reason) == (False, "NOTHING_TO_FINALIZE")
    drained = decide_finalize_only("LEASE_RELEASED", MAX_FINALIZE_ONLY_ATTEMPTS, policy)
    assert (drained.retry, drained.delay_seconds) == (True, 0.0)
    waits = decide_finalize_only("CODE_HOST_FAILED_TRANSIENT", 1, policy, 600.0)
    assert waits.retry and waits.delay_seconds == 600.0


# --- item 5: the last attempt dies after the code host acted (drill 4, real workers) ------


@pytest.mark.parametrize("crash_at", ["after_effect:pull_request", "after_effect:push_branch"])
def test_drill_4_on_the_last_attempt_ends_succeeded_through_a_finalize_only_attempt(
        pstore: Store, remote: Path, forge_dir: Path, tmp_path: Path,
        workers: Callable[..., WorkerProcess], crash_at: str) -> None:
    """``max_attempts=1``: the worker is SIGKILLed after the code host created the pull
    request (or the branch landed), before the ledger recorded it. Before, the reaper
    ended the run FAILED with its pull request open and ``runlane audit`` clean. Now
    the run gets one finalize-only attempt outside its budget, which records what the
    code host holds, opens the pull request from the pushed branch if it is missing,
    and never runs the agent (the retry worker's agent would fail)."""
    [sub] = pstore.submit([spec(repo=str(remote), max_attempts=1)])
    crashing = workers(AGENT_WRITES, env={"RUNLANE_FAULT_CRASH_AT": crash_at})
    assert crashing.wait(30) == -signal.SIGKILL
    reap_until(pstore, sub.run_id, "QUEUED", 10)
    run = run_row(pstore, sub.run_id)
    assert run.finalize_only_after == 1
    granted = last_event_message(pstore, sub.run_id, "QUEUED")
    assert granted.startswith("finalize-only attempt 2 (1 of at most 3), outside the "
                              "attempt budget: attempt 1 ended WORKER_LOST"), granted
    retry = workers("exit 1", "--exit-when-idle")
    assert retry.wait(60) == 0
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.outcome, run.attempt_count) == ("SUCCEEDED", "pull_request", 2)
    first, second = attempts_of(pstore, sub.run_id)
    assert (first.status, first.reason_code) == ("FAILED", "WORKER_LOST")
    assert second.status == "SUCCEEDED"
    assert not (tmp_path / "artifacts" / sub.run_id / "2" / "agent.log").exists(), \
        "the finalize-only attempt ran the agent"
    assert len(agent_branches(remote)) == 1
    [pr] = pull_requests(forge_dir, remote)
    [recorded] = pstore.pull_requests()
    assert (recorded["number"], pr.state) == (pr.number, "open")
    assert recorded["adopted"] is (crash_at == "after_effect:pull_request")
    assert pstore.audit() == []
    assert remote_violations(pstore, lambda repo: LocalForge(forge_dir)) == []


def test_a_finalize_only_attempt_that_finds_nothing_fails_the_run_without_the_agent(
        pstore: Store, remote: Path, forge_dir: Path, tmp_path: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    """The last attempt dies after its push intent named its commit, before anything
    was pushed. Its finalize-only attempt finds neither that commit on the run's branch
    nor a pull request: the run ends FAILED, NOTHING_TO_FINALIZE, without the agent
    running again (the retry worker's agent would fail AGENT_FAILED, and be retried),
    and its withdrawal records that the code host holds nothing."""
    [sub] = pstore.submit([spec(repo=str(remote), max_attempts=1)])
    crashing = workers(AGENT_WRITES, env={"RUNLANE_FAULT_CRASH_AT": "before_push"})
    assert crashing.wait(30) == -signal.SIGKILL
    assert agent_branches(remote) == []
    reap_until(pstore, sub.run_id, "QUEUED", 10)
    retry = workers("exit 1", "--exit-when-idle")
    assert retry.wait(60) == 0
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.reason_code) == ("FAILED", "NOTHING_TO_FINALIZE")
    assert "found neither the run's branch nor its pull request" in run.message
    assert [(a.status, a.reason_code) for a in attempts_of(pstore, sub.run_id)] == [
        ("FAILED", "WORKER_LOST"), ("FAILED", "NOTHING_TO_FINALIZE")]
    assert not (tmp_path / "artifacts" / sub.run_id / "2" / "agent.log").exists(), \
        "the finalize-only attempt ran the agent"
    assert agent_branches(remote) == [] and pull_requests(forge_dir, remote) == []
    close = ledger(pstore, sub.run_id)[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None
    assert (close.result["pull_request"], close.result["branch_sha"]) == (None, None)
    assert pstore.audit() == []
    assert remote_violations(pstore, lambda repo: LocalForge(forge_dir)) == []


# --- item 5: finalize-only attempts that keep dying are capped -----------------------------


def test_finalize_only_attempts_that_keep_dying_are_capped_then_the_pull_request_is_closed(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attempt dies after the code host opened (or found) the pull request and
    before the ledger recorded it. The run gets at most three finalize-only attempts
    (outside its budget of one: the audit's attempt budget leaves them out); then it
    ends FAILED, and its withdrawal closes the open pull request with a comment and
    records it: the run never ends FAILED with it open and unrecorded."""
    [sub] = store.submit([spec(repo=str(remote), max_attempts=1)])
    forge = tmp_path / "forge"
    real_done = Store.effect_done

    def dies_before_recording_the_pull_request(self: Store, lease: Lease, key: str,
                                               result: dict[str, Any]) -> None:
        if key == "pull_request":  # the connection drops: the attempt is abandoned
            raise OperationalError("UPDATE side_effects ...", {},
                                   Exception("server closed the connection unexpectedly"))
        real_done(self, lease, key, result)

    monkeypatch.setattr(Store, "effect_done", dies_before_recording_the_pull_request)
    driver = driver_for(store, tmp_path, lambda repo: LocalForge(forge), agent=AGENT_WRITES)
    for _ in range(10):  # bounded: a loop without its cap fails here, not forever
        assert run_attempt(store, driver) == "abandoned"
        clock.advance(TTL + 1)
        assert store.reap_expired_leases() == 1
        if run_row(store, sub.run_id).status != "QUEUED":
            break
        clock.advance(1000)
    run = run_row(store, sub.run_id)
    assert (run.status, run.reason_code, run.attempt_count) == ("FAILED", "WORKER_LOST", 4)
    assert run.finalize_only_after == 1
    assert "3 finalize-only attempt(s) ended without recording" in run.message
    [pr] = LocalForge(forge).list_pull_requests(str(remote))
    assert pr.state == "open"
    assert run.close_due_at is not None  # its withdrawal is due
    assert store.audit() == []  # due, so not unsettled; and no attempt over budget

    assert Withdrawer(store, lambda repo: LocalForge(forge), "w2").run_once() == 1
    [pr] = LocalForge(forge).list_pull_requests(str(remote))
    assert pr.state == "closed"
    [comment] = LocalForge(forge).comments(str(remote), pr.number)
    assert withdrawal_marker(sub.run_id) in comment and "failed (WORKER_LOST)" in comment
    close = ledger(store, sub.run_id)[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None
    assert close.result["pull_request"]["number"] == pr.number and close.result["closed"]
    assert close.result["branch_sha"] is not None
    assert run_row(store, sub.run_id).close_due_at is None
    assert store.audit() == []
    assert remote_violations(store, lambda repo: LocalForge(forge)) == []


# --- item 5: a cancel that lands while the pull request is opened ---------------------------


@pytest.mark.parametrize("host", ["local_forge", "github"])
def test_a_cancel_while_the_pull_request_is_opened_closes_it_with_a_comment(
        store: Store, tmp_path: Path, remote: Path, fake: FakeGitHub,
        monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """The cancel lands while the code host creates the pull request: before, the run
    ended CANCELLED with its pull request open. Now the run ends CANCELLED (the cancel
    is honoured) and a worker closes the pull request with a comment naming the
    cancellation, once (a second pass adds nothing), and records it in the ledger."""
    [sub] = store.submit([spec(repo=str(remote))])
    forge = tmp_path / "forge"
    host_for = (lambda repo: LocalForge(forge)) if host == "local_forge" else github_for(fake)
    real_open = GitHubClient.open_pull_request if host == "github" else LocalForge.open_pull_request
    owner: Any = GitHubClient if host == "github" else LocalForge

    def cancel_then_open(self: Any, repo: str, **kwargs: Any) -> PullRequest:
        store.cancel(sub.task_id)
        return real_open(self, repo, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(owner, "open_pull_request", cancel_then_open)
    assert run_attempt(store, driver_for(store, tmp_path, host_for)) == "cancelled"
    run = run_row(store, sub.run_id)
    assert run.status == "CANCELLED" and run.close_due_at is not None

    def prs() -> list[PullRequest]:
        found = host_for(str(remote))
        try:
            return list(found.list_pull_requests(str(remote)))
        finally:
            found.close()

    [pr] = prs()
    assert pr.state == "open"
    # The fault harness waits for it, and reports one left due when it stops.
    assert [v.check for v in check_database(store)] == ["withdrawal_not_done"]
    assert Withdrawer(store, host_for, "w2").run_once() == 1
    assert Withdrawer(store, host_for, "w2").run_once() == 0  # nothing due any more
    [pr] = prs()
    assert pr.state == "closed"
    comments = (LocalForge(forge).comments(str(remote), pr.number) if host == "local_forge"
                else fake.comments(GH_REPO, pr.number))
    assert len(comments) == 1
    assert "was cancelled (CANCELLED_BY_USER)" in comments[0]
    assert withdrawal_marker(sub.run_id) in comments[0]
    close = ledger(store, sub.run_id)[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None
    assert (close.result["pull_request"]["number"], close.result["closed"]) == (pr.number, True)
    assert close.result["run_status"] == "CANCELLED"
    assert run_row(store, sub.run_id).status == "CANCELLED"  # a terminal state stays
    assert store.audit() == [] and check_database(store) == []
    assert remote_violations(store, host_for) == []


def test_a_withdrawal_that_died_between_its_comment_and_its_close_comments_once(
        store: Store, tmp_path: Path, remote: Path, fake: FakeGitHub,
        monkeypatch: pytest.MonkeyPatch, clock: ManualClock) -> None:
    """The close fails (a 502) after the comment was posted: the withdrawal is tried
    again after a backoff, finds its comment by its marker and does not post it twice."""
    [sub] = store.submit([spec(repo=str(remote))])
    host_for = github_for(fake)
    real_open = GitHubClient.open_pull_request

    def cancel_then_open(self: GitHubClient, repo: str, **kwargs: Any) -> PullRequest:
        store.cancel(sub.task_id)
        return real_open(self, repo, **kwargs)

    monkeypatch.setattr(GitHubClient, "open_pull_request", cancel_then_open)
    assert run_attempt(store, driver_for(store, tmp_path, host_for)) == "cancelled"
    # find (1 page), comments list, comment post; then the close answers 502
    fake.fail_next(1, 502, after=3)
    assert Withdrawer(store, host_for, "w2").run_once() == 1
    [pr] = fake.pulls(GH_REPO)
    assert pr["state"] == "open" and len(fake.comments(GH_REPO, pr["number"])) == 1
    clock.advance(1000)  # past the backoff
    assert Withdrawer(store, host_for, "w2").run_once() == 1
    [pr] = fake.pulls(GH_REPO)
    assert pr["state"] == "closed" and len(fake.comments(GH_REPO, pr["number"])) == 1
    close = ledger(store, sub.run_id)[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None and close.result["tries"] == 2
    assert store.audit() == []


# --- item 5: a cancel after the worker died mid pull request (real workers) ----------------


def test_a_cancel_after_the_worker_died_mid_pull_request_is_withdrawn_by_another_worker(
        pstore: Store, remote: Path, forge_dir: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    """The worker is SIGKILLed after the code host created the pull request; the user
    cancels; the reaper ends the run CANCELLED (no attempt after a cancel). Another
    worker, between claims, closes the pull request with a comment and records it."""
    [sub] = pstore.submit([spec(repo=str(remote))])
    crashing = workers(AGENT_WRITES, env={"RUNLANE_FAULT_CRASH_AT": "after_effect:pull_request"})
    assert crashing.wait(30) == -signal.SIGKILL
    assert pstore.cancel(sub.task_id).runs[sub.run_id] == "CANCEL_REQUESTED"
    reap_until(pstore, sub.run_id, "CANCELLED", 10)
    [pr] = pull_requests(forge_dir, remote)
    assert pr.state == "open"
    other = workers("exit 1", "--exit-when-idle")
    assert other.wait(60) == 0
    [pr] = pull_requests(forge_dir, remote)
    assert pr.state == "closed"
    [comment] = LocalForge(forge_dir).comments(str(remote), pr.number)
    assert "was cancelled" in comment
    assert [(a.status, a.reason_code) for a in attempts_of(pstore, sub.run_id)] == [
        ("CANCELLED", "WORKER_LOST")]  # no attempt after the cancel
    assert ledger(pstore, sub.run_id)[CLOSE_EFFECT].status == "DONE"
    assert pstore.audit() == [] and check_database(pstore) == []
    assert remote_violations(pstore, lambda repo: LocalForge(forge_dir)) == []


# --- item 5: the audit sees what the ledger does not record ---------------------------------


class CountingForge(LocalForge):
    """A local forge that counts the lookups made through it, and can refuse closes."""

    looked: list[str] = []
    refuse_close = False

    def find_pull_request(self, repo: str, head_branch: str, marker: str
                          ) -> PullRequest | None:
        CountingForge.looked.append(head_branch)
        return super().find_pull_request(repo, head_branch, marker)

    def close_pull_request(self, repo: str, number: int) -> PullRequest:
        if CountingForge.refuse_close:
            raise CodeHostError("502 Bad Gateway", transient=True)
        return super().close_pull_request(repo, number)


def test_the_audit_reports_an_open_pull_request_of_a_failed_run_that_nobody_recorded(
        db_url: str, store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run failed for good with its pull request open (its finalize-only attempts all
    died before recording it), and every withdrawal failed: ``runlane audit`` reports it
    from the database (``pull_request_evidence_unsettled``) and, with
    ``--remote-checks``, from the code host (the open pull request). It asks the code
    host about that run only, not about runs that succeeded or failed before a push."""
    forge = tmp_path / "forge"
    CountingForge.looked, CountingForge.refuse_close = [], True
    host_for: Callable[[str], Any] = lambda repo: CountingForge(forge)  # noqa: E731
    [sub] = store.submit([spec(repo=str(remote), max_attempts=1)])
    real_done = Store.effect_done

    def dies_before_recording_the_pull_request(self: Store, lease: Lease, key: str,
                                               result: dict[str, Any]) -> None:
        if key == "pull_request":
            raise OperationalError("UPDATE side_effects ...", {}, Exception("connection lost"))
        real_done(self, lease, key, result)

    monkeypatch.setattr(Store, "effect_done", dies_before_recording_the_pull_request)
    driver = driver_for(store, tmp_path, host_for)
    for _ in range(10):
        run_attempt(store, driver)
        clock.advance(TTL + 1)
        store.reap_expired_leases()
        if run_row(store, sub.run_id).status != "QUEUED":
            break
        clock.advance(1000)
    monkeypatch.undo()
    assert run_row(store, sub.run_id).status == "FAILED"
    for _ in range(MAX_WITHDRAWAL_TRIES):
        assert Withdrawer(store, host_for, "w2").run_once() == 1
        clock.advance(10_000)
    assert run_row(store, sub.run_id).close_due_at is None  # given up
    assert ledger(store, sub.run_id)[CLOSE_EFFECT].result["gave_up"] is True
    # Runs the remote check must not look at: succeeded, and failed before any push.
    store.submit([spec(repo=str(remote), prompt="fine")])
    assert run_attempt(store, driver_for(store, tmp_path, host_for)) == "pull_request"
    store.submit([spec(repo=str(remote), prompt="fails", max_attempts=1)])
    assert run_attempt(store, driver_for(store, tmp_path, host_for, agent="exit 3")) \
        == "AGENT_FAILED"

    assert [(v.check, v.run_id) for v in store.audit()] == [
        ("pull_request_evidence_unsettled", sub.run_id)]
    CountingForge.looked = []
    audit = remote_audit(store, host_for)
    branch = branch_name(sub.task_id, sub.run_id)
    assert CountingForge.looked == [branch]  # bounded: only the run that may have one
    assert audit.checked == 1
    [violation] = audit.violations
    assert (violation.check, violation.run_id) == (CHECK, sub.run_id)
    assert "ended FAILED, and its pull request #1 is open" in violation.detail

    # The command: exit 1 with both checks; without --remote-checks, the database's.
    env = cli_env(tmp_path, RUNLANE_FORGE_DIR=str(forge))
    out = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url, "audit",
                          "--remote-checks", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert sorted(v["check"] for v in json.loads(out.stdout)["violations"]) == [
        "pull_request_evidence_unsettled", CHECK]
    out = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url, "audit",
                          "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert [v["check"] for v in json.loads(out.stdout)["violations"]] == [
        "pull_request_evidence_unsettled"]


# --- item 6: no call outlives the lease --------------------------------------------------


def test_every_push_and_code_host_call_is_bounded_by_what_the_lease_has_left(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path, fake: FakeGitHub,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The push's timeout and the code host's deadline are what the lease has left
    (here 20 s of a 60 s lease by the database's clock), not the push's 300 s or the
    client's own timeout; each is taken right before its call."""
    [sub] = store.submit([spec(repo=str(remote))])
    timeouts: list[float] = []
    deadlines: list[float] = []
    real_push = Workspace.push
    real_deadline = GitHubClient.set_deadline

    def spy_push(self: Workspace, branch: str, *, expected: str | None = None,
                 timeout: float | None = None) -> None:
        assert timeout is not None
        timeouts.append(timeout)
        real_push(self, branch, expected=expected, timeout=timeout)

    def spy_deadline(self: GitHubClient, deadline: float | None) -> None:
        assert deadline is not None
        deadlines.append(deadline - time.monotonic())
        real_deadline(self, deadline)

    monkeypatch.setattr(Workspace, "push", spy_push)
    monkeypatch.setattr(GitHubClient, "set_deadline", spy_deadline)
    lease = claim(store)
    clock.advance(TTL - 20)  # the database says: 20 s left
    ended = driver_for(store, tmp_path, github_for(fake)).run(AttemptState(lease, store))
    assert ended == "pull_request"
    assert timeouts and all(0 < t <= 20 for t in timeouts), timeouts
    assert deadlines and all(0 < d <= 20 for d in deadlines), deadlines
    assert run_row(store, sub.run_id).status == "SUCCEEDED"


def test_a_code_host_call_past_its_deadline_is_cut_short(fake: FakeGitHub,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A GitHub answer slower than the lease's window: the request is given up at the
    deadline (a transient error), not after the client's own 10 s timeout."""
    from . import fake_github

    real_handle = fake_github._Handler._handle

    def slow(self: Any, method: str) -> None:
        time.sleep(3.0)
        real_handle(self, method)

    monkeypatch.setattr(fake_github._Handler, "_handle", slow)
    client = GitHubClient(fake.url, token="s3cr3t-token", timeout=10.0)
    client.set_deadline(time.monotonic() + 0.5)
    started = time.monotonic()
    with pytest.raises(CodeHostError) as raised:
        client.find_pull_request(GH_REPO, "agent/x/y", "marker")
    assert raised.value.transient and time.monotonic() - started < 2.5
    with pytest.raises(CodeHostError, match="no time left"):
        client.find_pull_request(GH_REPO, "agent/x/y", "marker")
    client.close()


def test_a_push_is_made_only_over_the_commit_it_expects(tmp_path: Path, remote: Path) -> None:
    """``Workspace.push(expected=...)``: over no branch only when none is there; over a
    commit only when it is that one."""
    one = Workspace.clone(str(remote), tmp_path / "ws", "one")
    two = Workspace.clone(str(remote), tmp_path / "ws", "two")
    (one.path / "a.txt").write_text("one\n")
    (two.path / "a.txt").write_text("two\n")
    first = one.commit_all("agent/t/r", "one", "Agent-Run-ID: r")
    second = two.commit_all("agent/t/r", "two", "Agent-Run-ID: r")
    one.push("agent/t/r", expected=None)
    one.push("agent/t/r", expected=None)  # the same commit again: up to date
    with pytest.raises(PushFailed):
        two.push("agent/t/r", expected=None)  # something is there: not over it
    with pytest.raises(PushFailed):
        two.push("agent/t/r", expected=second)  # not what is there
    assert two.remote_branch_sha("agent/t/r") == first
    two.push("agent/t/r", expected=first)
    assert two.remote_branch_sha("agent/t/r") == second


# --- item 6: a real worker paused between its lease check and its push ---------------------


def _log_pushes(remote: Path, log: Path) -> None:
    """A server-side hook: every ref update that lands on the remote, one line each."""
    hook = remote / "hooks" / "post-receive"
    hook.write_text(f"#!/bin/sh\ncat >> {log}\n")
    hook.chmod(0o755)


def _state(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return raw[raw.rfind(")") + 2:].split()[0]


def test_a_worker_paused_between_its_lease_check_and_its_push_pushes_nothing(
        pstore: Store, remote: Path, forge_dir: Path, tmp_path: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    """Attempt 1's worker stops itself (SIGSTOP) right after its lease check, before its
    push, and stays paused past its lease. Attempt 2 takes the run over; while its agent
    works, the paused worker is resumed. Before, it pushed then: its stale commit landed
    first and attempt 2 adopted it, dropping its own agent's work. Now it finds the
    lease's window closed and makes no call: the remote's log shows no push of it, and
    the run's branch and pull request are attempt 2's work."""
    pushes = tmp_path / "pushes.log"
    _log_pushes(remote, pushes)
    # The gate lies in attempt 2's artifacts directory: the one place outside its
    # workspace that a sandboxed agent sees and the test can reach.
    agent = ('if [ "$RUNLANE_ATTEMPT" = 1 ]; then echo one > change.txt; else '
             'while [ ! -e "$RUNLANE_ARTIFACTS_DIR/gate" ]; do sleep 0.05; done; '
             'echo two > change.txt; fi')
    [sub] = pstore.submit([spec(repo=str(remote))])
    gate = tmp_path / "artifacts" / sub.run_id / "2" / "gate"
    stale = workers(agent, "--exit-when-idle", env={"RUNLANE_FAULT_PAUSE_AT": "before_push"})
    wait_until(lambda: _state(stale.pid) == "T", 60, "the worker to pause before its push")
    try:
        reap_until(pstore, sub.run_id, "QUEUED", 10)
        fresh = workers(agent, "--exit-when-idle")
        wait_until(lambda: run_row(pstore, sub.run_id).attempt_count == 2
                   and status_of(pstore, sub.run_id) == "RUNNING", 60, "attempt 2's agent")
    finally:
        stale.signal(signal.SIGCONT)
    assert stale.wait(60) == 0  # its window closed: it gave up without a call
    landed_while_paused = pushes.read_text() if pushes.exists() else ""
    gate.touch()
    assert fresh.wait(60) == 0
    assert landed_while_paused == "", f"the paused worker pushed: {landed_while_paused}"
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "pull_request")
    push = ledger(pstore, sub.run_id)["push_branch"]
    assert push.attempt_no == 2 and push.result is not None
    branch = branch_name(sub.task_id, sub.run_id)
    assert [ln.split()[1:] for ln in pushes.read_text().splitlines()] == [
        [push.result["sha"], f"refs/heads/{branch}"]]  # attempt 2's push, and only it
    shown = subprocess.run(["git", "--git-dir", str(remote), "show", f"{branch}:change.txt"],
                           capture_output=True, text=True, check=True).stdout
    assert shown == "two\n"  # attempt 2's agent's work
    [pr] = pull_requests(forge_dir, remote)
    assert pstore.pull_requests()[0]["number"] == pr.number
    assert pstore.audit() == []


def test_a_worker_paused_between_its_lease_check_and_its_pull_request_call_makes_none(
        pstore: Store, remote: Path, forge_dir: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    """The same before the pull request call: attempt 1 pushed (recorded), stopped
    itself after its lease check and before the call, and is resumed after the reaper
    took its lease back. It opens nothing; attempt 2 finishes from the recorded push
    without the agent, and the one pull request is attempt 2's (its body names it)."""
    [sub] = pstore.submit([spec(repo=str(remote))])
    stale = workers(AGENT_WRITES, "--exit-when-idle",
                    env={"RUNLANE_FAULT_PAUSE_AT": "before_pull_request"})
    wait_until(lambda: _state(stale.pid) == "T", 60, "the worker to pause before its call")
    try:
        reap_until(pstore, sub.run_id, "QUEUED", 10)
    finally:
        stale.signal(signal.SIGCONT)
    assert stale.wait(60) == 0  # gave attempt 1 up; then (idle-exit) finished attempt 2
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.outcome, run.attempt_count) == ("SUCCEEDED", "pull_request", 2)
    [pr] = pull_requests(forge_dir, remote)
    assert f"run `{sub.run_id}` (attempt 2)" in pr.body, pr.body
    [recorded] = pstore.pull_requests()
    assert (recorded["number"], recorded["adopted"]) == (pr.number, False)
    assert pstore.audit() == []


