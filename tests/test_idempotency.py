"""An idempotency key names one request (issue 23): the same tenant and key with the
same task replays the first answer; with a different task it is a Conflict naming the
key, and nothing at all is written, on both engines, for a single submit and for a
batch (where other rows would be new), and from the CLI (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.tasks import task_digest
from runlane.errors import Conflict, RunlaneError

from .support import cli_env, database_state, one_line_error, spec

REPO = "/srv/git/app.git"
FIRST: dict[str, Any] = {"tenant": "acme", "repo": REPO, "prompt": "bump the SDK",
                         "idempotency_key": "sdk-1", "queue": "default", "priority": "high",
                         "requires": {"jdk": ">=21", "tools": ["git", "maven"]},
                         "context": {"diff": "d"}, "max_attempts": 2}


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def submit(lane: Runlane, **changes: Any) -> Any:
    row = {**FIRST, **changes}
    return lane.submit(row.pop("tenant"), row.pop("repo"), row.pop("prompt"), **row)


@pytest.mark.parametrize("change", [
    {"repo": "/srv/git/other.git"}, {"prompt": "bump the SDK twice"}, {"queue": "java"},
    {"priority": "low"}, {"requires": {"jdk": ">=17", "tools": ["git", "maven"]}},
    {"max_attempts": 3}, {"context": {"diff": "e"}}, {"user": "ana"},
    {"estimated_cost_usd": 1.5}, {"queue": None},
], ids=lambda c: next(iter(c)))
def test_the_same_key_with_another_request_is_a_conflict_that_writes_nothing(
        lane: Runlane, db_url: str, change: dict[str, Any]) -> None:
    first = submit(lane)
    before = database_state(db_url)
    with pytest.raises(Conflict, match="idempotency key 'sdk-1'") as refused:
        submit(lane, **change)
    assert isinstance(refused.value, RunlaneError) and refused.value.exit_code == 2
    assert first.task_id in str(refused.value)
    assert database_state(db_url) == before


def test_the_same_request_replays_whatever_its_spelling(lane: Runlane, db_url: str) -> None:
    first = submit(lane)
    before = database_state(db_url)
    for same in ({}, {"priority": 50}, {"priority": " HIGH "},
                 {"requires": {"tools": ["maven", "git"], "jdk": ">=21"}},
                 {"prompt": "  bump the SDK "}):  # stripped, as every submit is
        again = submit(lane, **same)
        assert (again.task_id, again.run_id, again.created) == (first.task_id, first.run_id,
                                                                 False)
    # Another tenant's key of the same name is another request, not a conflict.
    assert submit(lane, tenant="globex", prompt="other").created
    assert database_state(db_url) != before


def test_a_batch_with_one_conflicting_key_writes_none_of_its_rows(lane: Runlane,
                                                                  db_url: str) -> None:
    submit(lane)
    before = database_state(db_url)
    rows = [{"tenant": "acme", "repo": REPO, "prompt": "new one"},
            {"tenant": "acme", "repo": REPO, "prompt": "new keyed", "idempotency_key": "k2"},
            {**FIRST, "prompt": "not what sdk-1 asked"}]
    with pytest.raises(Conflict, match="'sdk-1'"):
        lane.submit_batch(rows)
    assert database_state(db_url) == before
    # A key repeated inside one batch with two requests: the same.
    with pytest.raises(Conflict, match=r"'k3'.*earlier in this batch"):
        lane.submit_batch([{"tenant": "acme", "repo": REPO, "prompt": "a",
                            "idempotency_key": "k3"},
                           {"tenant": "acme", "repo": REPO, "prompt": "b",
                            "idempotency_key": "k3"}])
    assert database_state(db_url) == before
    same = lane.submit_batch([{"tenant": "acme", "repo": REPO, "prompt": "a",
                               "idempotency_key": "k3"}] * 2)
    assert [s.created for s in same] == [True, False]


def test_a_key_taken_before_digests_existed_replays(lane: Runlane, db_url: str) -> None:
    """Tasks written before migration 0019 have no digest: what they were asked with
    is unknown, so a replay is answered as before (never a conflict)."""
    first = submit(lane)
    with lane.store.engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET request_digest = NULL"))
    again = submit(lane, prompt="something else")
    assert (again.task_id, again.created) == (first.task_id, False)


def test_the_replay_of_a_retried_task_answers_with_its_first_run(lane: Runlane) -> None:
    first = submit(lane)
    lane.cancel(first.task_id)
    retried = lane.retry(first.task_id)
    again = submit(lane)
    assert (again.run_id, again.status, again.created) == (first.run_id, "CANCELLED", False)
    assert retried.run_id != first.run_id


def test_the_digest_is_of_the_request_not_of_its_spelling() -> None:
    assert task_digest(spec(priority="normal")) == task_digest(spec(priority=100))
    assert task_digest(spec(requires={"tools": {"git", "maven"}})) \
        == task_digest(spec(requires={"tools": ["maven", "git"]}))
    assert task_digest(spec()) != task_digest(spec(queue="default"))  # unset: policy's


def test_the_cli_refuses_a_conflicting_submit_in_one_line(db_url: str,
                                                          tmp_path: Path) -> None:
    def runlane(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url,
                               "submit", "--no-repo-check", "--tenant", "acme", "--repo", REPO,
                               "--idempotency-key", "cli-1", *args], capture_output=True,
                              text=True, cwd=tmp_path, env=cli_env(tmp_path), timeout=60)

    assert runlane("--prompt", "one").returncode == 0
    assert runlane("--prompt", "one").returncode == 0  # a replay
    before = database_state(db_url)
    one_line_error(runlane("--prompt", "two"), 2, "idempotency key 'cli-1'")
    assert database_state(db_url) == before
