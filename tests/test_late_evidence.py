"""Late evidence: a push or a pull request made by a worker whose lease was lost while
it was inside the call (a paused worker resumed) is recorded and, when its run has
already ended without success, withdrawn; the local forge checks the caller's deadline
under its lock, right before it writes a pull request (docs/reliability.md, "Pull-request
evidence"). On SQLite and PostgreSQL.

Real worker processes stopped with SIGSTOP at the forge's pause points
(``RUNLANE_FAULT_PAUSE_AT``), as the fault harness's ``stop`` fault stopped one inside its
pull-request step; in-process attempts (``AttemptDriver``) on a pinned clock where the
order of the cancel, the withdrawal and the late call is the point.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.codehost.base import PullRequest, withdrawal_marker
from runlane.codehost.github import GitHubClient
from runlane.codehost.local_forge import LocalForge
from runlane.store.evidence import CLOSE_EFFECT, PULL_REQUEST_EFFECT, PUSH_EFFECT
from runlane.store.invariants import check_database
from runlane.store.store import Store
from runlane.worker.attempt import AttemptState
from runlane.worker.withdraw import HOLD_SECONDS, Withdrawer, withdraw
from runlane.workspace import Workspace

from . import test_pr_evidence, test_worker
from .fake_github import FakeGitHub
from .support import attempts_of, cli_env, run_row, spec
from .test_finalize_edges import TTL, claim, driver_for
from .test_pr_evidence import (
    GH_REPO,
    _state,
    github_for,
    ledger,
    note_events,
    remote_violations,
)
from .test_worker import AGENT_WRITES, WorkerProcess, pull_requests, reap_until, wait_until

workers = test_worker.workers
pstore = test_worker.pstore
remote = test_worker.remote
forge_dir = test_worker.forge_dir
fake = test_pr_evidence.fake

LATE = "LATE_EFFECT_RECORDED"
# The paused worker's lease: long enough that its window is still open when it reaches
# the forge's pause point on a loaded machine (the reaper takes it back after that).
PAUSED_TTL = "3"


def cli_remote_audit(db_url: str, tmp_path: Path, forge: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url, "audit",
                           "--remote-checks", "--json"], capture_output=True, text=True,
                          env=cli_env(tmp_path, RUNLANE_FORGE_DIR=str(forge)), timeout=120)


def _cancelled_while_paused(pstore: Store, sub: Any, paused: WorkerProcess,
                            workers: Callable[..., WorkerProcess]) -> None:
    """The run is cancelled and ends CANCELLED (the reaper: no attempt after a cancel)
    while ``paused`` is stopped; another worker takes its withdrawal, which finds no pull
    request (the paused worker has not written it)."""
    wait_until(lambda: _state(paused.pid) == "T", 60, "the worker to pause in the forge")
    assert pstore.cancel(sub.task_id).runs[sub.run_id] == "CANCEL_REQUESTED"
    reap_until(pstore, sub.run_id, "CANCELLED", 20)
    other = workers("exit 1", "--exit-when-idle")
    assert other.wait(60) == 0
    close = ledger(pstore, sub.run_id)[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None
    assert close.result["pull_request"] is None  # looked before the paused write
    assert run_row(pstore, sub.run_id).close_due_at is None


# --- item 5: the paused worker's late pull request is recorded and withdrawn (real) ---------


def test_a_pull_request_written_after_the_run_was_cancelled_is_recorded_and_closed(
        db_url: str, pstore: Store, remote: Path, forge_dir: Path, tmp_path: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    """The fault harness's finding: the worker stops (SIGSTOP) inside its pull-request
    call, past its lease window check and the forge's own deadline check, before the
    forge writes the record. Meanwhile its lease expires, the run is cancelled and ends
    CANCELLED, and its withdrawal finds nothing (DONE). Resumed, the worker writes the
    pull request and the ledger refuses the result (LeaseLost). Before, nothing closed
    that pull request. Now the worker records it as late evidence, the run is due a
    withdrawal again, and a worker closes it with the cancellation comment; the run
    stays CANCELLED and both audits are clean."""
    [sub] = pstore.submit([spec(repo=str(remote))])
    paused = workers(AGENT_WRITES, "--exit-when-idle",
                     env={"RUNLANE_FAULT_PAUSE_AT": "before_pull_request_write",
                          "RUNLANE_LEASE_TTL_SECONDS": PAUSED_TTL})
    try:
        _cancelled_while_paused(pstore, sub, paused, workers)
        assert pull_requests(forge_dir, remote) == []
    finally:
        paused.signal(signal.SIGCONT)
    assert paused.wait(60) == 0  # wrote, recorded it late, then took the withdrawal
    logged = paused.process.stderr.read().decode() if paused.process.stderr else ""

    [pr] = pull_requests(forge_dir, remote)
    assert pr.state == "closed", "the late pull request was left open"
    assert "late_effect_recorded" in logged, logged[-3000:]
    [comment] = LocalForge(forge_dir).comments(str(remote), pr.number)
    assert "was cancelled (CANCELLED_BY_USER)" in comment
    assert withdrawal_marker(sub.run_id) in comment
    run = run_row(pstore, sub.run_id)
    assert (run.status, run.close_due_at) == ("CANCELLED", None)
    assert [(a.status, a.reason_code) for a in attempts_of(pstore, sub.run_id)] == [
        ("CANCELLED", "WORKER_LOST")]  # the late record changed no attempt
    effects = ledger(pstore, sub.run_id)
    late_pr = effects[PULL_REQUEST_EFFECT]
    assert (late_pr.status, late_pr.fencing_token) == ("INTENT", 1)  # no state changed
    assert late_pr.result is not None
    [entry] = late_pr.result["late"]
    assert (entry["fencing_token"], entry["attempt_no"]) == (1, 1)
    assert entry["result"]["number"] == pr.number
    close = effects[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None
    assert (close.result["pull_request"]["number"], close.result["closed"]) == (pr.number, True)
    [note] = note_events(pstore, sub.run_id, LATE)
    assert (note.from_status, note.to_status, note.attempt_no) == ("CANCELLED", "CANCELLED", 1)
    assert f"opened pull request #{pr.number}" in note.message
    assert pstore.audit() == [] and check_database(pstore) == []
    assert remote_violations(pstore, lambda repo: LocalForge(forge_dir)) == []
    out = cli_remote_audit(db_url, tmp_path, forge_dir)
    assert out.returncode == 0, (out.stdout, out.stderr[-2000:])
    assert json.loads(out.stdout)["violations"] == []


# --- the local forge checks the deadline under its lock (real) -------------------------------


def test_a_worker_resumed_before_the_forge_took_its_lock_writes_no_pull_request(
        db_url: str, pstore: Store, remote: Path, forge_dir: Path, tmp_path: Path,
        workers: Callable[..., WorkerProcess]) -> None:
    """The same pause, earlier in the forge's call: its git lookups done, its lock not
    yet taken. Before, the forge checked the caller's deadline only to bound its git
    lookup: resumed, it wrote the pull request. Now it checks it again under the lock,
    right before the write, finds it passed and writes nothing: no pull request at all,
    nothing late to record."""
    [sub] = pstore.submit([spec(repo=str(remote))])
    paused = workers(AGENT_WRITES, "--exit-when-idle",
                     env={"RUNLANE_FAULT_PAUSE_AT": "before_pull_request_lock",
                          "RUNLANE_LEASE_TTL_SECONDS": PAUSED_TTL})
    try:
        _cancelled_while_paused(pstore, sub, paused, workers)
    finally:
        paused.signal(signal.SIGCONT)
    assert paused.wait(60) == 0
    logged = paused.process.stderr.read().decode() if paused.process.stderr else ""
    assert pull_requests(forge_dir, remote) == [], "the resumed worker wrote a pull request"
    assert "late_effect_recorded" not in logged
    assert note_events(pstore, sub.run_id, LATE) == []
    assert run_row(pstore, sub.run_id).status == "CANCELLED"
    assert pstore.audit() == [] and check_database(pstore) == []
    assert remote_violations(pstore, lambda repo: LocalForge(forge_dir)) == []


# --- late evidence, in process: the order of the cancel, the withdrawal and the call -------


@pytest.mark.parametrize(("effect", "host", "finished"), [
    (PULL_REQUEST_EFFECT, "local_forge", False),
    (PULL_REQUEST_EFFECT, "github", False),
    (PUSH_EFFECT, "local_forge", True),
])
def test_a_late_effect_of_a_cancelled_run_reopens_its_withdrawal(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path, fake: FakeGitHub,
        monkeypatch: pytest.MonkeyPatch, effect: str, host: str, finished: bool) -> None:
    """Inside the call (after every check the worker makes): the run is cancelled, its
    lease taken back (CANCELLED), and a withdrawal taken that finds nothing; then the
    call lands. Pull request: the withdrawal is still held when the late record comes,
    and its "nothing" is refused (taken over). Push: the withdrawal was done (recorded
    "no branch") and is opened again. Either way the next withdrawal records what the
    code host holds, and the remote audit is clean; without the late record it reports
    an open pull request, or a branch commit the ledger does not record."""
    [sub] = store.submit([spec(repo=str(remote))])
    forge = tmp_path / "forge"
    host_for = (lambda repo: LocalForge(forge)) if host == "local_forge" else github_for(fake)
    held: list[Any] = []

    def lose_the_run() -> None:
        store.cancel(sub.task_id)
        clock.advance(TTL + 1)
        assert store.reap_expired_leases() == 1
        assert run_row(store, sub.run_id).status == "CANCELLED"
        w = store.take_withdrawal("w2", hold_seconds=HOLD_SECONDS)
        assert w is not None
        found = withdraw(w, host_for)
        assert found["pull_request"] is None  # the call has not landed
        assert (found["branch_sha"] is None) is (effect == PUSH_EFFECT)
        if finished:
            assert store.withdrawal_done(w, found)
        held.append((w, found))

    if effect == PUSH_EFFECT:
        real_push = Workspace.push

        def push_late(self: Workspace, branch: str, **kwargs: Any) -> None:
            lose_the_run()
            real_push(self, branch, **kwargs)

        monkeypatch.setattr(Workspace, "push", push_late)
    else:
        owner: Any = GitHubClient if host == "github" else LocalForge
        real_open = owner.open_pull_request

        def open_late(self: Any, repo: str, **kwargs: Any) -> PullRequest:
            lose_the_run()
            return real_open(self, repo, **kwargs)  # type: ignore[no-any-return]

        monkeypatch.setattr(owner, "open_pull_request", open_late)

    assert driver_for(store, tmp_path, host_for).run(AttemptState(claim(store), store)) \
        == "lease_lost"
    monkeypatch.undo()
    [(w, found)] = held
    run = run_row(store, sub.run_id)
    assert run.status == "CANCELLED" and run.close_due_at is not None  # due again
    if not finished:
        assert not store.withdrawal_done(w, found)  # its look predates the late call
    row = ledger(store, sub.run_id)[effect]
    assert (row.status, row.fencing_token) == ("INTENT", 1)
    assert row.result is not None and row.result["late"][0]["fencing_token"] == 1
    [note] = note_events(store, sub.run_id, LATE)
    assert (note.from_status, note.to_status) == ("CANCELLED", "CANCELLED")
    assert store.audit() == []  # the note is not a transition

    assert Withdrawer(store, host_for, "w3").run_once() == 1
    close = ledger(store, sub.run_id)[CLOSE_EFFECT]
    assert close.status == "DONE" and close.result is not None
    branch_sha = subprocess.run(
        ["git", "--git-dir", str(remote), "rev-parse", str(close.result["branch"])],
        capture_output=True, text=True, check=True).stdout.strip()
    assert close.result["branch_sha"] == branch_sha
    if effect == PULL_REQUEST_EFFECT:
        found_host = host_for(str(remote))
        try:
            [pr] = found_host.list_pull_requests(str(remote))
        finally:
            found_host.close()
        assert pr.state == "closed"
        assert (close.result["pull_request"]["number"], close.result["closed"]) == (
            pr.number, True)
        comments = (LocalForge(forge).comments(str(remote), pr.number)
                    if host == "local_forge" else fake.comments(GH_REPO, pr.number))
        assert len(comments) == 1 and "was cancelled (CANCELLED_BY_USER)" in comments[0]
    assert run_row(store, sub.run_id).status == "CANCELLED"
    assert store.audit() == [] and check_database(store) == []
    assert remote_violations(store, host_for) == []


def test_a_late_pull_request_of_a_live_run_is_adopted_by_its_next_attempt(
        store: Store, clock: ManualClock, tmp_path: Path, remote: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 1's lease is taken back and attempt 2 has begun while attempt 1 is still
    inside its pull-request call; then the call lands. The late record changes nothing
    of the run or of attempt 2's lease (no withdrawal: the run is live), and attempt 2
    finds the pull request by its marker, adopts it and completes the run: one pull
    request, recorded by attempt 2's lease. The stale lease's note is not a stale
    write (``runlane audit``)."""
    [sub] = store.submit([spec(repo=str(remote))])
    forge = tmp_path / "forge"
    host_for: Callable[[str], Any] = lambda repo: LocalForge(forge)  # noqa: E731
    real_open = LocalForge.open_pull_request
    second: list[Any] = []

    def open_after_the_next_claim(self: LocalForge, repo: str, **kwargs: Any) -> PullRequest:
        clock.advance(TTL + 1)
        assert store.reap_expired_leases() == 1
        clock.advance(1000)  # past the retry's backoff
        second.append(store.claim("w2", lease_ttl=TTL)[0])
        clock.advance(1)  # the late call lands after attempt 2 began
        return real_open(self, repo, **kwargs)

    monkeypatch.setattr(LocalForge, "open_pull_request", open_after_the_next_claim)
    assert driver_for(store, tmp_path, host_for).run(AttemptState(claim(store), store)) \
        == "lease_lost"
    monkeypatch.undo()
    [lease2] = second
    assert lease2.attempt_no == 2
    run = run_row(store, sub.run_id)
    assert (run.status, run.close_due_at) == ("CLAIMED", None)  # live: nothing to withdraw
    [note] = note_events(store, sub.run_id, LATE)
    assert (note.from_status, note.to_status, note.attempt_no) == ("CLAIMED", "CLAIMED", 1)
    assert "looks it up by its marker" in note.message

    assert driver_for(store, tmp_path, host_for).run(AttemptState(lease2, store)) \
        == "pull_request"
    run = run_row(store, sub.run_id)
    assert (run.status, run.outcome) == ("SUCCEEDED", "pull_request")
    [pr] = LocalForge(forge).list_pull_requests(str(remote))
    assert pr.state == "open"
    [recorded] = store.pull_requests()
    assert (recorded["number"], recorded["adopted"]) == (pr.number, True)
    row = ledger(store, sub.run_id)[PULL_REQUEST_EFFECT]
    assert (row.status, row.fencing_token) == ("DONE", lease2.fencing_token)
    assert CLOSE_EFFECT not in ledger(store, sub.run_id)
    with store.engine.connect() as conn:
        actors = [r.actor for r in conn.execute(text(
            "SELECT actor FROM run_events WHERE run_id = :r AND reason_code = :c"),
            {"r": sub.run_id, "c": LATE})]
    assert actors == ["w1"]  # the stale lease's own report, after attempt 2 began
    assert store.audit() == [] and check_database(store) == []
