"""``retry``: a new run of a finished task, linked to the run it follows and visible
from both, admitted under the policy in force as a submit is, one at a time however
many callers race; refused while the task's run is on its way. On both engines."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, text
from sqlalchemy.exc import IntegrityError

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.ids import new_id
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.errors import Conflict, NotFound
from runlane.store.schema import runs

from .support import cli_env, database_state, one_line_error

REPO = "/srv/git/app.git"
TTL = 60.0


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def fail(lane: Runlane, run_id: str) -> None:
    [lease] = lane.store.claim("w1", run_id=run_id, lease_ttl=TTL)
    lane.store.fail(lease, Reason.TASK_CONTRACT_INVALID)  # not retryable: FAILED
    assert lane.run(run_id).status == "FAILED"


def succeed(lane: Runlane, run_id: str) -> None:
    [lease] = lane.store.claim("w1", run_id=run_id, lease_ttl=TTL)
    lane.store.complete(lease)


def test_a_retry_is_a_new_run_of_the_same_task_linked_both_ways(lane: Runlane) -> None:
    first = lane.submit("acme", REPO, "fix it")
    fail(lane, first.run_id)
    retried = lane.retry(first.task_id)
    assert (retried.task_id, retried.status, retried.created, retried.retry_of_run_id) == (
        first.task_id, "QUEUED", True, first.run_id)
    old, new = lane.run(first.run_id), lane.run(retried.run_id)
    assert (old.status, old.retried_by_run_id, old.retry_of_run_id) == (
        "FAILED", retried.run_id, None)
    assert (new.retry_of_run_id, new.retried_by_run_id, new.attempts) == (
        first.run_id, None, [])
    [event] = new.events
    assert (event.from_status, event.to_status) == (None, "QUEUED")
    assert f"retry of run {first.run_id}" in (event.message or "")
    assert [r.run_id for r in lane.task(first.task_id).runs] == [first.run_id,
                                                                  retried.run_id]
    # A run like any other: claimed with its own first attempt and token, and it ends.
    [lease] = lane.store.claim("w2", lease_ttl=TTL)
    assert (lease.run_id, lease.attempt_no, lease.fencing_token) == (retried.run_id, 1, 1)
    lane.store.complete(lease)
    # Finished again (succeeded, this time): it may be retried again, from the newest.
    third = lane.retry(first.task_id)
    assert third.retry_of_run_id == retried.run_id
    assert lane.run(retried.run_id).retried_by_run_id == third.run_id
    assert lane.audit() == []


@pytest.mark.parametrize("state", ["QUEUED", "CLAIMED", "CANCEL_REQUESTED",
                                   "WAITING_CAPACITY"])
def test_a_task_on_its_way_is_not_retried_and_nothing_changes(lane: Runlane, db_url: str,
                                                               state: str) -> None:
    if state == "WAITING_CAPACITY":
        lane.store.apply_policy(parse_policy(
            "[tenants.acme]\nmax_queued = 0\n"), source="test")
    first = lane.submit("acme", REPO, "busy")
    if state in ("CLAIMED", "CANCEL_REQUESTED"):
        lane.store.claim("w1", lease_ttl=TTL)
    if state == "CANCEL_REQUESTED":
        lane.cancel(first.task_id)
    assert lane.run(first.run_id).status == state
    before = database_state(db_url)
    with pytest.raises(Conflict, match=f"is not finished: its run {first.run_id} is {state}"
                       ) as refused:
        lane.retry(first.task_id)
    assert refused.value.reason_code == "TASK_NOT_FINISHED"
    assert database_state(db_url) == before
    with pytest.raises(NotFound, match="no task"):
        lane.retry(new_id())
    assert database_state(db_url) == before


def test_racing_retries_make_one_run(lane: Runlane, db_url: str, clock: ManualClock) -> None:
    first = lane.submit("acme", REPO, "once")
    fail(lane, first.run_id)
    callers = 6
    start = threading.Barrier(callers)
    outcomes: list[Any] = []

    def retry() -> None:
        with Runlane(db_url, clock=clock) as mine:
            mine.check_schema()
            start.wait(timeout=30)
            try:
                outcomes.append(mine.retry(first.task_id))
            except Conflict as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=retry) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    made = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(outcomes) == callers and len(made) == 1, outcomes
    assert len(lane.task(first.task_id).runs) == 2
    assert lane.audit() == []


def test_the_database_admits_one_retry_per_run(lane: Runlane) -> None:
    """uq_runs_retry_of: whatever a caller read, a second run retrying the same run
    is refused by the database itself."""
    first = lane.submit("acme", REPO, "once")
    fail(lane, first.run_id)
    retried = lane.retry(first.task_id)
    with pytest.raises(IntegrityError), lane.store.engine.begin() as conn:
        row = dict(conn.execute(text("SELECT * FROM runs WHERE run_id = :r"),
                                {"r": retried.run_id}).one()._mapping)
        row["run_id"] = new_id()
        conn.execute(insert(runs), row)


def test_a_retry_is_admitted_under_the_policy_in_force(lane: Runlane) -> None:
    first = lane.submit("acme", REPO, "now denied")
    fail(lane, first.run_id)
    lane.store.apply_policy(parse_policy("allow_unknown_tenants = false\n[tenants.globex]\n"),
                            source="test")
    retried = lane.retry(first.task_id)
    assert (retried.status, retried.reason_code) == ("POLICY_DENIED", "TENANT_NOT_ALLOWED")
    run = lane.run(retried.run_id)
    assert run.policy_version == 1 and run.ended_at is not None
    assert (run.admission or {})["decision"] == "DENY"
    assert lane.audit() == []


def test_a_cancelled_task_runs_again_when_retried(lane: Runlane) -> None:
    first = lane.submit("acme", REPO, "changed my mind")
    lane.cancel(first.task_id)
    retried = lane.retry(first.task_id)
    assert lane.task(first.task_id).cancel_requested_at is None
    # Claimed, not cancelled on the way (a claim cancels the runs of a cancelled task).
    [lease] = lane.store.claim("w1", lease_ttl=TTL)
    assert lease.run_id == retried.run_id
    assert lane.run(retried.run_id).status == "CLAIMED"
    # A cancel after the retry cancels the new run.
    assert lane.cancel(first.task_id).runs[retried.run_id] == "CANCEL_REQUESTED"


def test_dependencies_stand_as_their_newest_run(lane: Runlane) -> None:
    a = lane.submit("acme", REPO, "a")
    b = lane.submit("acme", REPO, "b", depends_on=[a.task_id])
    assert b.status == "ADMITTED"
    fail(lane, a.run_id)
    assert lane.run(b.run_id).status == "CANCELLED"  # its dependency failed
    # Retried while the dependency is still failed: cancelled again, at once.
    b2 = lane.retry(b.task_id)
    assert (b2.status, lane.run(b2.run_id).reason_code) == ("CANCELLED", "DEPENDENCY_FAILED")
    a2 = lane.retry(a.task_id)
    b3 = lane.retry(b.task_id)
    assert b3.status == "ADMITTED"  # waits for the dependency's new run
    succeed(lane, a2.run_id)
    assert lane.run(b3.run_id).status == "QUEUED"
    # A new task naming it sees the newest run (succeeded), not the failed first one.
    c = lane.submit("acme", REPO, "c", depends_on=[a.task_id])
    assert c.status == "QUEUED"
    assert lane.audit() == []


def test_the_audit_flags_a_retry_of_an_unfinished_run(lane: Runlane) -> None:
    first = lane.submit("acme", REPO, "one")
    other = lane.submit("acme", REPO, "two")
    with lane.store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET retry_of_run_id = :o WHERE run_id = :r"),
                     {"o": first.run_id, "r": other.run_id})
    [found] = [v for v in lane.audit() if v.check == "retry_of_unfinished_run"]
    assert found.run_id == other.run_id and "QUEUED" in found.detail \
        and first.task_id in found.detail


def runlane(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=cli_env(tmp_path), timeout=60)


def test_the_cli_retries_and_shows_the_links(db_url: str, tmp_path: Path) -> None:
    lane = Runlane(db_url)  # the database's clock, as the CLI's
    first = lane.submit("acme", REPO, "cli")
    one_line_error(runlane(db_url, tmp_path, "retry", first.task_id), 2, "is not finished")
    one_line_error(runlane(db_url, tmp_path, "retry", new_id()), 3, "no task")
    lane.cancel(first.task_id)
    done = runlane(db_url, tmp_path, "retry", first.task_id, "--json")
    assert done.returncode == 0, done.stderr
    retried = json.loads(done.stdout)
    assert retried["retry_of_run_id"] == first.run_id and retried["status"] == "QUEUED"
    shown = json.loads(runlane(db_url, tmp_path, "runs", "show", first.run_id, "--json").stdout)
    assert shown["retried_by_run_id"] == retried["run_id"]
    task = json.loads(runlane(db_url, tmp_path, "tasks", "show", first.task_id,
                              "--json").stdout)
    assert [(r["run_id"], r["retry_of_run_id"]) for r in task["runs"]] == [
        (first.run_id, None), (retried["run_id"], first.run_id)]
    text_view = runlane(db_url, tmp_path, "tasks", "show", first.task_id)
    assert text_view.returncode == 0 and retried["run_id"] in text_view.stdout
    lane.close()
