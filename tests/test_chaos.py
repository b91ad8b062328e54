"""The fault harness (``runlane chaos``): its workload, its checks, its command line,
and real runs: the CI profile on PostgreSQL, eight processes on one SQLite file, and
two planted bugs it must catch. The runs are marked ``chaos``: ``make test`` runs
them after the main suite, alone, so their timing is their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.chaos.agent import FATAL, RETRYABLE, STAGES, Behaviour, parse_prompt, plan
from runlane.chaos.checks import replay_command
from runlane.chaos.profiles import PROFILES, build_config
from runlane.chaos.workload import CANCEL_POINTS, build_workload
from runlane.clock import ManualClock
from runlane.store.invariants import CHAOS_CHECKS, check_database
from runlane.store.store import Store

from .support import execute, submit

ROOT = Path(__file__).resolve().parent.parent


def chaos(*args: str, timeout: float, cwd: Path) -> tuple[int, dict[str, Any], str]:
    """``python -m runlane.chaos ARGS --json``: exit code, report, stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    proc = subprocess.run([sys.executable, "-m", "runlane.chaos", *args, "--json", "--quiet"],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    document = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, document, proc.stderr


def checks_of(report: dict[str, Any]) -> Counter[str]:
    return Counter(v["check"] for v in report["violations"])


# --- the workload ------------------------------------------------------------------------


def test_the_seed_fixes_the_workload() -> None:
    first = build_workload(7, 200, repos=4)
    assert first == build_workload(7, 200, repos=4)
    assert first != build_workload(8, 200, repos=4)
    # Switching faults off changes what the tasks do, never which seed draws what.
    calm = build_workload(7, 200, repos=4, agent_faults=False, cancels=False)
    assert all(p.cancel_at is None for p in calm)
    assert {p.behaviour.kind for p in calm} <= {"change", "nochange", "slow"}


def test_a_short_profile_workload_covers_every_reason_and_every_cancel_point() -> None:
    plans = build_workload(1, 300, repos=4)
    assert {p.cancel_at for p in plans} >= set(CANCEL_POINTS)
    reasons = {p.behaviour.reason for p in plans if p.behaviour.reason}
    assert reasons >= set(RETRYABLE) | set(FATAL)
    kinds = {p.behaviour.kind for p in plans}
    assert kinds >= {"hang", "hang_once", "stubborn", "verify_fail", "nochange", "exhaust"}
    assert {p.behaviour.dwell for p in plans} >= set(STAGES)
    assert len({p.key for p in plans}) == 300


def test_the_pr_crash_fault_plans_deaths_on_a_last_attempt_too() -> None:
    """The fault pr_crash (drill 4 in the harness): some plain change tasks name the
    attempt whose worker dies after the code host opened its pull request, some of
    them with a single attempt (the death is the last attempt's); drawn apart, so the
    rest of the seed's workload is the same without it."""
    plain = build_workload(7, 300, repos=4)
    plans = build_workload(7, 300, repos=4, pr_crashes=True)
    crashing = [p for p in plans if p.behaviour.crash]
    assert {p.behaviour.crash for p in crashing} == {1}
    assert {p.behaviour.kind for p in crashing} == {"change"}
    assert all(p.cancel_at is None and p.behaviour.dwell is None for p in crashing)
    assert any(p.max_attempts == 1 for p in crashing)
    assert any(p.max_attempts > 1 for p in crashing)
    unchanged = [(a, b) for a, b in zip(plain, plans, strict=True) if not b.behaviour.crash]
    assert unchanged and all(a == b for a, b in unchanged)
    b = crashing[0].behaviour
    assert parse_prompt(b.prompt()) == b and " crash=1" in b.prompt()
    assert " crash=" not in plain[0].behaviour.prompt()
    assert "pr_crash" in PROFILES["short"].faults


def test_a_pr_crash_run_must_end_with_its_pull_request_recorded() -> None:
    """The harness's expectation for the fault pr_crash: a run whose ledger holds its
    pull request ends SUCCEEDED through finalize-only attempts; one a harness fault
    took before it got that far, or whose finalize-only attempts the faults all took,
    is not held to it."""
    from types import SimpleNamespace as Row

    from runlane.chaos.checks import _expectations

    prompt = Behaviour(5, "change", crash=1).prompt()

    def run(status: str, outcome: str | None = None) -> Any:
        return Row(run_id="r", status=status, outcome=outcome, prompt=prompt,
                   reason_code="WORKER_LOST")

    def attempt(no: int, reason: str | None, status: str = "FAILED") -> Any:
        return Row(attempt_no=no, status=status, reason_code=reason, message="")

    died = [attempt(1, "WORKER_LOST")]
    found, _ = _expectations({"r": run("FAILED")}, {"r": died}, {"r"})
    assert [v["check"] for v in found] == ["pull_request_crash_not_finished"]
    assert _expectations({"r": run("FAILED")}, {"r": died}, set())[0] == []
    done = [*died, attempt(2, None, "SUCCEEDED")]
    assert _expectations({"r": run("SUCCEEDED", "pull_request")}, {"r": done}, {"r"})[0] == []
    lost = [*died, *(attempt(n, "WORKER_LOST") for n in (2, 3, 4))]
    assert _expectations({"r": run("FAILED")}, {"r": lost}, {"r"})[0] == []


def test_the_prompt_carries_the_behaviour_and_each_attempt_is_planned() -> None:
    b = Behaviour(number=17, kind="flaky", reason="PROVIDER_RATE_LIMIT", fails=2, sleep=0.3,
                  dwell="FINALIZING")
    assert parse_prompt(b.prompt()) == b
    assert parse_prompt("fix the flaky test") is None
    assert [plan(b, n).action for n in (1, 2, 3)] == ["fail", "fail", "change"]
    assert plan(b, 1).retry_after == 1.0
    assert plan(Behaviour(1, "fatal", "LEASE_RELEASED"), 1).recorded == "AGENT_FAILED"
    assert plan(Behaviour(1, "fatal", "AGENT_FAILED"), 3).action == "exit"
    assert plan(Behaviour(1, "hang_once"), 1).recorded == "TIMEOUT"
    assert plan(Behaviour(1, "hang_once"), 2).action == "change"
    assert plan(Behaviour(1, "verify_fail"), 1).recorded == "VERIFIER_FAILED"


def test_the_agent_runs_as_a_script_without_runlane(tmp_path: Path) -> None:
    """The agent is started for every attempt: it must not import runlane (1 s)."""
    from runlane.chaos import agent

    env = {"PATH": os.environ["PATH"], "RUNLANE_ATTEMPT": "1", "RUNLANE_RUN_ID": "r1",
           "RUNLANE_WORKSPACE": str(tmp_path), "RUNLANE_ARTIFACTS_DIR": str(tmp_path),
           "RUNLANE_PROMPT": Behaviour(3, "flaky", "SANDBOX_START_TIMEOUT", 1, 0.0).prompt()}
    failed = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime",
                             str(agent.__file__)], env=env, capture_output=True, text=True,
                            timeout=30)
    assert "runlane" not in failed.stderr and "sqlalchemy" not in failed.stderr
    assert failed.returncode == 1
    assert '"reason_code": "SANDBOX_START_TIMEOUT"' in failed.stdout
    env["RUNLANE_ATTEMPT"] = "2"
    changed = subprocess.run([sys.executable, "-I", "-S", str(agent.__file__)], env=env,
                             capture_output=True, text=True, timeout=30)
    assert changed.returncode == 0
    assert "task 3 run r1 attempt 2" in (tmp_path / "CHAOS.md").read_text()


# --- the checks on the database ----------------------------------------------------------


def test_the_chaos_checks_pass_on_a_clean_history(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=30)
    store.complete(lease, outcome="no_changes")
    assert store.get_run(sub.run_id)["status"] == "SUCCEEDED"
    assert check_database(store) == []


def test_the_chaos_checks_find_planted_violations(store: Store, clock: ManualClock) -> None:
    stale, cancelled, waiting = submit(store, 3)
    [first] = store.claim("w1", lease_ttl=30, run_id=stale.run_id)
    clock.advance(60)
    assert store.reap_expired_leases() == 1
    clock.advance(600)
    [second] = store.claim("w2", lease_ttl=30, run_id=stale.run_id)
    assert second.fencing_token == first.fencing_token + 1
    event = ("INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status, "
             "reason_code, fencing_token, message) VALUES (:run_id, :attempt_no, :at, :actor, "
             ":from_status, :to_status, NULL, :token, NULL)")
    # The first worker writes after the second lease began: a fencing failure.
    execute(store, event, run_id=stale.run_id, attempt_no=1, at=clock.now() + 1, actor="w1",
            from_status="RUNNING", to_status="VERIFYING", token=first.fencing_token)
    # A cancelled run claimed again.
    store.cancel(cancelled.task_id)
    execute(store, event, run_id=cancelled.run_id, attempt_no=1, at=clock.now() + 2,
            actor="w3", from_status="QUEUED", to_status="CLAIMED", token=1)
    found = Counter(v.check for v in check_database(store))
    assert found["stale_token_write"] == 1
    assert found["claimed_after_cancel"] == 1
    assert found["run_not_terminal"] == 2  # the stale one (leased) and the waiting one
    assert waiting.run_id in {v.run_id for v in check_database(store)
                              if v.check == "run_not_terminal"}


def _finish_all(store: Store, clock: ManualClock) -> int:
    """Claim and complete (no changes) every claimable run; how many."""
    done = 0
    while leases := store.claim("w1", lease_ttl=30, limit=10):
        for lease in leases:
            store.complete(lease, outcome="no_changes")
            done += 1
        clock.advance(1)
    return done


def test_the_campaign_checks_hold_on_a_clean_rollout_and_find_planted_breaks(
        store: Store, clock: ManualClock) -> None:
    """A campaign of 4 (canary 2, then the rest) run to completion passes every check;
    then each campaign check finds the break planted in the rows it reads."""
    from runlane.chaos.workload import CampaignPlan
    from runlane.domain.campaigns import campaign_from_document

    plans = build_workload(3, 4, repos=1, agent_faults=False, cancels=False)
    plan = CampaignPlan(name="c1", targets=tuple(plans), canary=2, steps=("all",),
                        max_active=4, failure_rate=0.5, window=10, min_sample=2,
                        expect="COMPLETED")
    store.create_campaign(campaign_from_document(plan.document(["/srv/git/app.git"])))
    for _ in range(2):  # the canary, then the rest once it ended
        clock.advance(1)
        assert store.campaign_pass()["campaign_runs_dispatched"] == 2
        clock.advance(1)
        assert _finish_all(store, clock) == 2
    assert [c.status for c in store.list_campaigns("acme")] == ["COMPLETED"]
    assert check_database(store) == []

    def broken(statement: str, **params: Any) -> Counter[str]:
        execute(store, statement, **params)
        return Counter(v.check for v in check_database(store))

    assert broken("UPDATE campaigns SET active = 1")["campaign_active_count_wrong"] == 1
    execute(store, "UPDATE campaigns SET active = 0")
    # A batch-1 target dispatched before its batch's release.
    found = broken("UPDATE campaign_targets SET dispatched_at = dispatched_at - 100 "
                   "WHERE batch = 1")
    assert found["campaign_run_before_release"] == 2
    execute(store, "UPDATE campaign_targets SET dispatched_at = dispatched_at + 100 "
                   "WHERE batch = 1")
    # The stop recorded before the last dispatch: it dispatched after its stop.
    found = broken("UPDATE campaigns SET status = 'STOPPED', ended_at = :at",
                   at=clock.now() - 2.5)
    assert found["campaign_dispatch_after_stop"] == 2
    found = broken("UPDATE campaigns SET status = 'ACTIVE', ended_at = NULL")
    assert found["campaign_not_ended"] == 1
    execute(store, "UPDATE campaigns SET status = 'COMPLETED'")
    # A target that says FAILED while its run succeeded, counted as a success.
    found = broken("UPDATE campaign_targets SET state = 'FAILED' WHERE position = 0")
    assert found["campaign_target_disagrees_with_run"] == 1
    assert found["campaign_outcome_wrong"] == 1
    execute(store, "UPDATE campaign_targets SET state = 'SUCCEEDED' WHERE position = 0")
    found = broken("DELETE FROM campaign_outcomes WHERE seq = 4")
    assert found["campaign_finishes_wrong"] == 1 and found["campaign_outcome_wrong"] == 1
    # A dispatch that wrote the task but not the target; a second task for one dispatch.
    found = broken("UPDATE campaign_targets SET task_id = NULL WHERE position = 1")
    assert found["campaign_task_not_its_targets"] == 1
    with store.engine.connect() as conn:
        key = conn.execute(text("SELECT target_key FROM campaign_targets "
                                "WHERE position = 2")).scalar_one()
    submit(store, idempotency_key=f"campaign:c1:{key}:retry1")
    assert Counter(v.check for v in check_database(store))["campaign_target_tasks"] == 1


def test_twenty_of_a_profiles_runs_are_two_campaigns() -> None:
    """The campaigns replace plain runs (the profile's time stays the same); the stop
    campaign's canary succeeds and its next batch starts with two fast failures."""
    from runlane.chaos.workload import split_campaigns

    plans = build_workload(int(SHORT_SEED), 300, repos=4)
    plain, campaigns = split_campaigns(plans)
    assert [(c.name, len(c.targets), c.expect) for c in campaigns] == [
        ("chaos-rollout", 12, "COMPLETED"), ("chaos-stop", 8, "STOPPED")]
    assert len(plain) == 280
    assert {p.key for p in plain}.isdisjoint(p.key for c in campaigns for p in c.targets)
    stop = campaigns[1].targets
    assert [p.behaviour.kind for p in stop[2:4]] == ["fatal", "fatal"]
    assert all(p.cancel_at is None and not p.behaviour.crash for c in campaigns
               for p in c.targets)
    assert split_campaigns(plans[:30]) == (plans[:30], [])


def test_every_check_is_named_sql_returning_run_and_detail() -> None:
    for name, statement in CHAOS_CHECKS.items():
        assert name.islower() and " AS detail" in statement, name


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--faults", "kill,fire"], "unknown fault 'fire'"),
    (["--engine", "sqlite", "--faults", "restart"], "need PostgreSQL"),
    (["--database-url", "postgresql://nobody@127.0.0.1:1/x", "--faults", "restart"],
     "restarts only its private cluster"),
    (["--profile", "medium"], "medium"),
    (["--engine", "sqlite", "--pgbouncer"], "--pgbouncer needs PostgreSQL"),
])
def test_bad_options_are_one_line_errors(tmp_path: Path, args: list[str], message: str) -> None:
    code, document, err = chaos(*args, timeout=60, cwd=tmp_path)
    assert code == 2 and document == {}
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_replay_command_names_what_differs_from_the_profile() -> None:
    config = build_config("short", seed=42, runs=50, faults="kill,stop", plant="no_fencing")
    assert replay_command(config) == ("runlane chaos --profile short --seed 42 --runs 50 "
                                      "--faults kill,stop --plant no_fencing")
    assert replay_command(build_config("long", seed=3)) == "runlane chaos --profile long --seed 3"
    assert replay_command(build_config("short", seed=3, pgbouncer=True)) == (
        "runlane chaos --profile short --seed 3 --pgbouncer")
    given = build_config("short", seed=1, database_url="postgresql://x@127.0.0.1/y")
    assert "restart" not in given.faults and given.notes


# --- real runs -------------------------------------------------------------------------------

SHORT_SEED = "20261130"


def assert_campaigns(report: dict[str, Any], plain: int) -> None:
    """The workload's two campaigns ended as their planned failure mix says, under
    every fault (their invariants are the ``campaign_*`` checks, all clean): the
    rollout completed, every target run; the stop campaign stopped at its fourth
    counted finish, its last batch (two targets) never dispatched. Whether the second
    batch's last target was dispatched before the stop (a slot freed by a fast failure)
    depends on timing: it may have run, been cancelled, or never started."""
    rollout, stop = report["campaigns"]["chaos-rollout"], report["campaigns"]["chaos-stop"]
    assert rollout["status"] == "COMPLETED" and rollout["batches_released"] == 3, rollout
    assert rollout["by_state"] == {"SUCCEEDED+run": 10, "FAILED+run": 2}, rollout
    assert stop["status"] == "STOPPED" and stop["batches_released"] == 2, stop
    assert stop["by_state"]["FAILED+run"] == 2 and stop["by_state"]["CANCELLED"] >= 2, stop
    assert report["faults"]["duplicate_campaign"] > 0
    dispatched = sum(n for c in (rollout, stop) for k, n in c["by_state"].items()
                     if k.endswith("+run"))
    assert report["runs"] == plain + dispatched


@pytest.mark.chaos
def test_short_profile_every_fault_on_postgresql(tmp_path: Path) -> None:
    """The CI profile: 300 runs, 4 worker processes, every fault, within 3 minutes."""
    started = time.monotonic()
    code, report, err = chaos("--profile", "short", "--seed", SHORT_SEED, timeout=240,
                              cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert report["violations"] == [], (report["violations"][:20], err[-2000:])
    assert code == 0
    assert (report["planned"], report["workers"], report["engine"]) == (300, 4, "postgresql")
    assert report["summary"] == {"lost": 0, "doubled": 0, "stuck": 0, "other": 0}
    assert_campaigns(report, plain=280)
    for fault in ("kill", "stop", "terminate", "restart", "duplicate_submit",
                  "duplicate_wakeup", "duplicate_delivery", "cancel", "pr_crash"):
        assert report["faults"].get(fault, 0) > 0, fault
    assert set(report["cancels_by_stage"]) >= {"QUEUED", "CLAIMED", "PREPARING_SANDBOX",
                                               "RUNNING", "VERIFYING", "FINALIZING"}
    reasons = set(report["attempts_by_reason"])
    assert reasons >= {"WORKER_LOST", "CANCELLED_BY_USER", "TIMEOUT", "AGENT_FAILED",
                       "VERIFIER_FAILED", *RETRYABLE, *(set(FATAL) - {"malformed",
                                                                      "LEASE_RELEASED"})}
    # Leases held at a SIGKILL or SIGSTOP: 9 to 29 in the runs seen (fewer on a quiet
    # machine, where the run is shorter and so sees fewer kills). With few samples the
    # p99 is the maximum, a stricter check.
    reclaim = report["reclaim"]
    assert reclaim["samples"] >= 5 and reclaim["p99"] <= reclaim["budget"]
    # Every run that succeeded with a change has its pull request (the checks above
    # hold "exactly one" per such run and "at most one" per run); a run cancelled
    # between opening its pull request and completing keeps the one it opened.
    assert report["pull_requests"] >= report["outcomes"]["pull_request"]
    assert elapsed < 180, f"the CI profile took {elapsed:.0f}s"


# The PgBouncer variant: the short profile's faults with fewer runs (CI time: the whole
# profile through PgBouncer took about as long as the direct one, and CI runs both).
PGBOUNCER_RUNS = "150"


@pytest.mark.chaos
def test_short_profile_through_pgbouncer_in_transaction_pooling_mode(tmp_path: Path) -> None:
    """The workers and maintenance reach PostgreSQL through PgBouncer (transaction
    pooling; LISTEN directly): every fault, every invariant."""
    code, report, err = chaos("--profile", "short", "--seed", SHORT_SEED, "--pgbouncer",
                              "--runs", PGBOUNCER_RUNS, timeout=240, cwd=tmp_path)
    assert report["violations"] == [], (report["violations"][:20], err[-2000:])
    assert code == 0
    assert "PgBouncer" in report["database"]
    assert report["summary"] == {"lost": 0, "doubled": 0, "stuck": 0, "other": 0}
    for fault in ("kill", "stop", "terminate", "restart", "duplicate_submit", "cancel"):
        assert report["faults"].get(fault, 0) > 0, fault
    assert "WORKER_LOST" in report["attempts_by_reason"]
    reclaim = report["reclaim"]
    assert reclaim["samples"] >= 3 and reclaim["p99"] <= reclaim["budget"]


@pytest.mark.chaos
def test_sqlite_profile_eight_processes_on_one_file(tmp_path: Path) -> None:
    code, report, err = chaos("--profile", "sqlite", "--seed", SHORT_SEED, timeout=330,
                              cwd=tmp_path)
    assert report["violations"] == [], (report["violations"][:20], err[-2000:])
    assert code == 0
    assert (report["engine"], report["workers"], report["planned"]) == ("sqlite", 8, 200)
    assert_campaigns(report, plain=180)
    assert report["faults"]["kill"] > 0 and report["faults"]["stop"] > 0
    assert "database_locked" not in checks_of(report)
    assert report["reclaim"]["samples"] >= 5


# A small run with the two faults the planted bugs need: a paused worker's agent (4 s)
# is still working when its run is taken back, and finishes while the new attempt
# runs; a killed worker's runs must be taken back. The same run without a plant is the
# control: it must be clean, so the violations are the plant's.
PLANT_RUN = ["--profile", "short", "--seed", "7", "--runs", "30", "--workers", "6",
             "--concurrency", "2", "--faults", "kill,stop", "--kill-every", "5",
             "--stop-every", "3.5", "--agent-sleep", "4", "--stall-seconds", "10"]


@pytest.mark.chaos
@pytest.mark.parametrize("plant", ["no_fencing", "no_lease_expiry"])
def test_the_harness_catches_a_planted_bug(tmp_path: Path, plant: str) -> None:
    code, report, err = chaos(*PLANT_RUN, "--plant", plant, timeout=180, cwd=tmp_path)
    assert code == 1, err[-2000:]
    found = checks_of(report)
    if plant == "no_fencing":  # a paused worker wakes up and writes as if it still held
        assert found["stale_token_write"] + found["side_effect_with_stale_token"] > 0, found
    else:  # a killed worker's runs are never taken back
        assert found["never_reclaimed"] > 0 and found["run_not_terminal"] > 0, found
    # The plant, not a broken process (a plant that failed to apply exits 70), is what
    # the checks found.
    crashes = [v for v in report["violations"] if v["check"] == "uncaught_exception"
               or (v["check"] == "process_exited" and "exited with 70" in v["detail"])]
    assert crashes == [] and "maintenance_failed" not in report["log_errors"], (
        crashes, report["log_errors"])


@pytest.mark.chaos
def test_the_planted_bug_runs_are_clean_without_the_plant(tmp_path: Path) -> None:
    code, report, err = chaos(*PLANT_RUN, timeout=180, cwd=tmp_path)
    assert report["violations"] == [], (report["violations"][:10], err[-2000:])
    assert code == 0
    assert report["faults"]["kill"] > 0 and report["faults"]["stop"] > 0
