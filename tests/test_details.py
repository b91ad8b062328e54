"""``Runlane.run`` and ``Runlane.task`` as typed models (issue 23): ``runs show --json``
prints every field it printed before (the document of 2026-12-02 is rebuilt here from
the store, the way the CLI built it) plus the new ones (stages of each attempt, side
effects, pull request, retry links, tokens); ``tasks show`` gives a task's runs,
parent and children; credentials in a ledger result or a task's repository are
masked. On both engines."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.access import Principal, Role
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.errors import NotFound

from .support import cli_env

S = RunStatus
REPO = "/srv/git/app.git"
TTL = 60.0

# The CLI's document of `runs show --json` before issue 23 (cli.py at b811b96).
RUN_FIELDS = ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
              "attempt_count", "max_attempts", "fencing_token", "visible_at", "created_at",
              "updated_at", "ended_at", "reason_code", "message", "outcome", "cost_usd",
              "estimated_cost_usd", "user_id", "risk_class", "route_key", "policy_version")
ATTEMPT_FIELDS = ("attempt_no", "status", "reason_code", "message", "worker_id",
                  "fencing_token", "lease_status", "lease_expires_at", "started_at", "ended_at",
                  "retry_after_seconds", "cost_usd", "estimated_cost_usd", "input_tokens",
                  "output_tokens", "late_cost_usd")


def _iso(value: Any) -> Any:
    if isinstance(value, float):
        return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds")
    return value


def _times(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (_iso(v) if k.endswith("_at") or k in ("at", "retry_after") else v)
            for k, v in row.items()}


def old_document(run: dict[str, Any]) -> dict[str, Any]:
    document = _times({k: run.get(k) for k in RUN_FIELDS})
    document["prompt"] = run["task"]["prompt"]
    document["idempotency_key"] = run["task"]["idempotency_key"]
    document["truncated_sections"] = run["task"]["truncated_sections"]
    document["parent_task_id"] = run["task"]["parent_task_id"]
    document["depends_on"] = run["depends_on"]
    document["admission"] = _times(run["admission"]) if run["admission"] else run["admission"]
    document["limits"] = run["limits"]
    document["attempts"] = [_times({k: a[k] for k in ATTEMPT_FIELDS}) for a in run["attempts"]]
    document["late_cost_usd"] = sum((float(a["late_cost_usd"]) for a in run["attempts"]), 0.0)
    document["events"] = [_times({k: v for k, v in e.items() if k != "run_id"})
                          for e in run["events"]]
    return json.loads(json.dumps(document, default=str))


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def a_full_run(lane: Runlane, clock: ManualClock, **fields: Any) -> tuple[str, str]:
    """A run that failed once (rate limited), then succeeded with cost, a push and a
    pull request: its (task id, run id)."""
    sub = lane.submit("acme", REPO, "fix the flaky test", idempotency_key="k",
                      context={"diff": "d" * 10}, **fields)
    [first] = lane.store.claim("w1", lease_ttl=TTL)
    lane.store.advance(first, S.PREPARING_SANDBOX)
    lane.store.fail(first, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=5)
    clock.advance(60)
    [second] = lane.store.claim("w2", lease_ttl=TTL)
    lane.store.advance(second, S.PREPARING_SANDBOX)
    lane.store.advance(second, S.RUNNING)
    lane.store.report_cost(second, 0.25, input_tokens=1200, output_tokens=300)
    lane.store.advance(second, S.FINALIZING)
    lane.store.effect_intent(second, "push_branch")
    lane.store.effect_done(second, "push_branch", {
        "remote": "https://bot:s3cret@git.example.com/acme/app.git", "sha": "abc"})
    lane.store.effect_intent(second, "pull_request")
    lane.store.effect_done(second, "pull_request", {
        "number": 7, "url": "https://git.example.com/acme/app/pull/7",
        "head_branch": f"agent/{sub.task_id}/{sub.run_id}"})
    lane.store.complete(second)
    return sub.task_id, sub.run_id


def test_runs_show_json_keeps_every_field_it_printed_and_adds_the_new_ones(
        lane: Runlane, clock: ManualClock, db_url: str, tmp_path: Path) -> None:
    task_id, run_id = a_full_run(lane, clock)
    before = old_document(lane.store.get_run(run_id))
    shown = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url,
                            "runs", "show", run_id, "--json"], capture_output=True,
                           text=True, cwd=tmp_path, env=cli_env(tmp_path), timeout=60)
    assert shown.returncode == 0, shown.stderr
    now = json.loads(shown.stdout)
    assert now == lane.run(run_id).model_dump(mode="json")
    for key, value in before.items():
        if key not in ("attempts", "events"):
            assert now[key] == value, key
    assert [{k: a[k] for k in ATTEMPT_FIELDS} for a in now["attempts"]] == before["attempts"]
    assert [{k: e[k] for k in before["events"][0]} for e in now["events"]] == before["events"]
    # What is new.
    first, second = now["attempts"]
    assert [s["status"] for s in first["stages"]] == ["CLAIMED", "PREPARING_SANDBOX",
                                                      "FAILED_RETRYABLE", "QUEUED"]
    assert first["reason_code"] == "PROVIDER_RATE_LIMIT" and first["worker_id"] == "w1"
    assert [s["status"] for s in second["stages"]][-1] == "SUCCEEDED"
    assert (second["fencing_token"], second["cost_usd"], now["cost_usd"]) == (2, 0.25, 0.25)
    assert (now["input_tokens"], now["output_tokens"]) == (1200, 300)
    assert now["pull_request"] == {"number": 7, "url": "https://git.example.com/acme/app/pull/7",
                                   "branch": f"agent/{task_id}/{run_id}", "adopted": False}
    assert sorted(e["effect_key"] for e in now["side_effects"]) == ["pull_request",
                                                                    "push_branch"]
    assert "s3cret" not in shown.stdout  # a ledger result's credentials are masked
    assert (now["retry_of_run_id"], now["retried_by_run_id"]) == (None, None)


def test_a_task_shows_its_runs_parent_and_children(lane: Runlane, clock: ManualClock,
                                                   tmp_path: Path, db_url: str) -> None:
    parent_id, parent_run = a_full_run(lane, clock)
    child = lane.submit("acme", "https://bot:s3cret@git.example.com/acme/app.git",
                        "follow up", parent_task_id=parent_id)
    lane.cancel(child.task_id)
    retried = lane.retry(child.task_id)
    task = lane.task(child.task_id)
    assert task.parent is not None and task.parent.task_id == parent_id
    assert (task.parent.latest_run_id, task.parent.latest_status) == (parent_run, "SUCCEEDED")
    assert [(r.run_id, r.status, r.retry_of_run_id) for r in task.runs] == [
        (child.run_id, "CANCELLED", None), (retried.run_id, "QUEUED", child.run_id)]
    assert "s3cret" not in task.repo and task.repo.endswith("@git.example.com/acme/app.git")
    parent = lane.task(parent_id)
    assert [(c.task_id, c.latest_run_id, c.latest_status) for c in parent.children] == [
        (child.task_id, retried.run_id, "QUEUED")]
    assert parent.parent is None and parent.idempotency_key == "k"
    # The same model as JSON from the CLI.
    shown = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url,
                            "tasks", "show", child.task_id, "--json"], capture_output=True,
                           text=True, cwd=tmp_path, env=cli_env(tmp_path), timeout=60)
    assert json.loads(shown.stdout) == task.model_dump(mode="json")
    assert "s3cret" not in shown.stdout


def test_the_models_read_as_the_dicts_they_replace(lane: Runlane, clock: ManualClock) -> None:
    """``lane.run(id)["attempts"][0]["worker_id"]`` kept working for scripts."""
    _, run_id = a_full_run(lane, clock)
    run = lane.run(run_id)
    assert run["status"] == "SUCCEEDED" and run["attempts"][0]["worker_id"] == "w1"
    with pytest.raises(KeyError):
        run["no_such_field"]


def test_a_read_principal_of_another_tenant_sees_no_detail(lane: Runlane,
                                                           clock: ManualClock) -> None:
    task_id, run_id = a_full_run(lane, clock)
    other = Principal(Role.READ, "globex")
    with pytest.raises(NotFound, match="no run"):
        lane.run(run_id, principal=other)
    with pytest.raises(NotFound, match="no task"):
        lane.task(task_id, principal=other)
