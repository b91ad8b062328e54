"""Campaigns end to end on SQLite and PostgreSQL: real workers (in-process agents in
real clones of real bare repositories, pull requests on the local forge), the
scheduler's campaign pass, the stop rule in the transaction that ends a run,
pause/resume, idempotent create, and tenant scoping."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.agents.python import AgentContext, AgentFailed, PythonAgentRunner
from runlane.api import Runlane
from runlane.codehost.local_forge import LocalForge
from runlane.domain.access import Principal, Role
from runlane.domain.campaigns import (
    CampaignInvalid,
    Rollout,
    StopRule,
    batch_sizes,
    parse_campaign,
)
from runlane.domain.states import RunStatus
from runlane.errors import Conflict, Forbidden, NotFound
from runlane.worker.worker import Worker

from .support import bare_remote, fast_lane


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    with fast_lane(db_url, tmp_path) as lane:
        yield lane


def remotes(tmp_path: Path, n: int) -> list[Path]:
    """``n`` bare repositories, each with one commit on main."""
    first = bare_remote(tmp_path)
    out = []
    for i in range(n):
        copy = tmp_path / "remotes" / f"r{i:03}.git"
        shutil.copytree(first, copy)
        out.append(copy)
    return out


def campaign_text(name: str, repos: list[Path], *, tenant: str = "acme", canary: int = 3,
                  steps: str = '[3, 10, "all"]', max_active: int = 4, extra: str = "",
                  stop: str = "", task: str = "") -> str:
    targets = "\n".join(f'[[targets]]\nrepo = "{r}"\nowner = "owner{i}"\nvars = {{n = "{i}"}}\n'
                        for i, r in enumerate(repos))
    return (f'name = "{name}"\ntenant = "{tenant}"\nowner = "platform"\n'
            f'prompt = "change {{repo}} number {{n}}"\n{extra}\n{targets}\n'
            f"[task]\nmax_attempts = 1\n{task}"
            f"[rollout]\ncanary = {canary}\nsteps = {steps}\n"
            f"[concurrency]\nmax_active = {max_active}\n"
            f"[stop]\n{stop or 'failure_rate = 0.9'}\n")


def start_worker(lane: Runlane, forge_dir: Path, agent: Callable[[AgentContext], None],
                 concurrency: int) -> tuple[Worker, threading.Thread]:
    worker = lane.worker(agent=PythonAgentRunner(agent), concurrency=concurrency,
                         code_host_for=lambda repo: LocalForge(forge_dir))
    worker.config.poll_seconds = 0.05
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return worker, thread


def drive(lane: Runlane, name: str, done: Callable[[dict[str, Any]], bool],
          timeout: float = 60.0) -> dict[str, Any]:
    """The scheduler's campaign pass, again and again, until ``done``."""
    deadline = time.monotonic() + timeout
    while True:
        lane.store.campaign_pass(default_max_attempts=1)
        found = lane.campaign(name)
        if done(found):
            return found
        if found["status"] in ("STOPPED", "COMPLETED") and not found["by_state"]["ACTIVE"]:
            raise AssertionError(f"ended otherwise: {found['status']} {found['by_state']}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {found['status']} {found['by_state']}")
        time.sleep(0.02)


def attempts_of_campaign(lane: Runlane, campaign_id: str) -> list[Any]:
    with lane.store.engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT t.position, t.batch, t.dispatched_at, a.started_at, a.ended_at, r.status,"
            " r.reason_code FROM campaign_targets t JOIN runs r ON r.run_id = t.run_id"
            " JOIN attempts a ON a.run_id = r.run_id WHERE t.campaign_id = :c"
            " ORDER BY a.started_at"), {"c": campaign_id}))


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals],
                   key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    return peak


# --- the file ---------------------------------------------------------------------------


def test_the_file_names_file_field_and_problem(tmp_path: Path) -> None:
    base = 'name = "c"\ntenant = "acme"\nprompt = "x {repo}"\n[[targets]]\nrepo = "/a"\n'
    for extra, field, says in [
        ("[rollout]\nsteps = [\"all\", 3]\n", "rollout.steps", '"all" can only be the last'),
        ("[stop]\nfailure_reasons = [\"NOPE\"]\n", "stop.failure_reasons", "'NOPE' is not"),
        ("[stop]\nwindow = 5\nmin_sample = 9\n", "stop", "larger than window"),
        ("[task]\npriority = \"urgent\"\n", "task.priority", "'urgent' is not"),
        ("[concurrency]\nmax_active = 0\n", "concurrency.max_active", "greater than"),
        ("colour = 1\n", "colour", "unknown field"),
    ]:
        with pytest.raises(CampaignInvalid) as caught:
            parse_campaign(base.replace("[[targets]]", extra + "[[targets]]")
                           if not extra.startswith("colour") else extra + base, "c.toml")
        assert caught.value.source == "c.toml"
        assert caught.value.field == field, caught.value
        assert says in caught.value.problem, caught.value
    with pytest.raises(CampaignInvalid, match=r"c.toml: targets\[1\]: .*repeats targets\[0\]"):
        parse_campaign(base + '[[targets]]\nrepo = "/a"\n', "c.toml")
    with pytest.raises(CampaignInvalid, match=r"targets\[0\]: /a has no variable 'team'"):
        parse_campaign(base.replace("x {repo}", "x {repo} {team}"), "c.toml")
    (tmp_path / "targets.txt").write_text('/a\n# a comment\n{"repo": "/b", "owner": "bo"}\n')
    (tmp_path / "c.toml").write_text('name = "c"\ntenant = "acme"\nprompt = "x"\n'
                                     'targets_file = "targets.txt"\n')
    from runlane.domain.campaigns import load_campaign
    loaded = load_campaign(tmp_path / "c.toml")
    assert [(t.repo, t.owner) for t in loaded.targets] == [("/a", None), ("/b", "bo")]
    assert loaded.task.priority == 200  # campaign runs: the batch class by default


def test_batches_and_the_stop_rule() -> None:
    assert batch_sizes(24, Rollout(canary=3, steps=(3, 10, "all"))) == [3, 3, 10, 8]
    assert batch_sizes(5, Rollout(canary=3, steps=(3, 10, "all"))) == [3, 2]
    assert batch_sizes(10, Rollout(canary=2, steps=(3,))) == [2, 3, 3, 2]
    rule = StopRule(failure_rate=0.15, window=10, min_sample=4)
    assert not rule.crossed([True, True, True])  # below the minimum sample
    assert rule.crossed([True, False, False, False])  # 25% > 15%
    assert not rule.crossed([True] + [False] * 9)  # 10% of the window
    assert not rule.counts("CANCELLED_BY_USER", False)
    assert rule.counts("VERIFIER_FAILED", False) and rule.is_failure("VERIFIER_FAILED", False)
    only = StopRule(failure_reasons=("VERIFIER_FAILED",))
    assert only.counts("AGENT_FAILED", False) and not only.is_failure("AGENT_FAILED", False)


# --- the rollout, with real workers ----------------------------------------------------------


def test_rollout_releases_canary_then_each_step_within_its_concurrency(
        lane: Runlane, tmp_path: Path) -> None:
    repos = remotes(tmp_path, 60)
    made = lane.create_campaign(text=campaign_text("ramp", repos, max_active=6))
    assert (made["created"], made["batch_sizes"]) == (True, [3, 3, 10, 44])

    def agent(ctx: AgentContext) -> None:
        (ctx.workspace / "CHANGE.md").write_text(ctx.prompt)

    worker, thread = start_worker(lane, tmp_path / "forge", agent, concurrency=8)
    try:
        found = drive(lane, "ramp", lambda c: c["status"] == "COMPLETED")
    finally:
        worker.request_drain()
        thread.join(30)
    assert found["by_state"]["SUCCEEDED"] == 60
    assert found["succeeded_with_pull_request"] == 60
    rows = attempts_of_campaign(lane, made["campaign_id"])
    assert len(rows) == 60  # one attempt per target: nothing ran twice
    by_batch: dict[int, list[Any]] = {}
    for r in rows:
        by_batch.setdefault(int(r.batch), []).append(r)
    assert [len(by_batch[b]) for b in sorted(by_batch)] == [3, 3, 10, 44]
    # Reconstructed from the claims: no run of a batch started before every run of the
    # batch before it had ended.
    for b in range(1, 4):
        assert min(r.started_at for r in by_batch[b]) >= max(
            r.ended_at for r in by_batch[b - 1]), f"batch {b} started early"
    # The campaign's concurrency held (the worker had room for 8).
    assert max_overlap([(r.started_at, r.ended_at) for r in rows]) <= 6
    # The pull request names the campaign.
    pr = LocalForge(tmp_path / "forge").list_pull_requests(str(repos[0]))[0]
    assert "campaign `ramp`" in pr.body


def test_the_stop_rule_stops_in_the_transaction_that_crosses_it(
        lane: Runlane, tmp_path: Path) -> None:
    repos = remotes(tmp_path, 30)
    failing = {i for i in range(30) if i % 5 in (1, 3)}  # 40% of the targets
    made = lane.create_campaign(text=campaign_text(
        "risky", repos, canary=5, steps='[5, 10, "all"]', max_active=5,
        stop="failure_rate = 0.3\nwindow = 10\nmin_sample = 8"))

    def agent(ctx: AgentContext) -> None:
        number = int(ctx.prompt.rsplit(" ", 1)[1])
        if number in failing:
            raise AgentFailed("VERIFIER_FAILED", f"target {number} fails")
        (ctx.workspace / "CHANGE.md").write_text(ctx.prompt)

    # One run at a time: when the threshold is crossed (the 8th finish, 3 of 8 failed),
    # the rest of batch 1 waits in the queue.
    worker, thread = start_worker(lane, tmp_path / "forge", agent, concurrency=1)
    try:
        found = drive(lane, "risky", lambda c: c["status"] == "STOPPED"
                      and c["by_state"]["ACTIVE"] == 0, timeout=60)
    finally:
        worker.request_drain()
        thread.join(30)
    assert "stop rule" in found["stop_reason"]
    campaign_id = made["campaign_id"]
    with lane.store.engine.connect() as conn:
        outcomes = list(conn.execute(text(
            "SELECT seq, failed, at FROM campaign_outcomes WHERE campaign_id = :c ORDER BY seq"),
            {"c": campaign_id}))
        stopped_at = conn.execute(text("SELECT ended_at FROM campaigns WHERE campaign_id = :c"),
                                  {"c": campaign_id}).scalar_one()
        targets = list(conn.execute(text(
            "SELECT t.position, t.batch, t.state, t.run_id, t.dispatched_at, t.reason_code,"
            " r.status FROM campaign_targets t LEFT JOIN runs r ON r.run_id = t.run_id"
            " WHERE t.campaign_id = :c ORDER BY t.position"), {"c": campaign_id}))
    rule = StopRule(failure_rate=0.3, window=10, min_sample=8)
    crossing = next(o for o in outcomes if rule.crossed(
        [bool(x.failed) for x in reversed(outcomes[:o.seq])]))
    # The stop was written by the transaction that recorded the crossing finish: the
    # same time, to the microsecond (a pass after it would be later).
    assert stopped_at == pytest.approx(crossing.at, abs=1e-6)
    # Nothing was dispatched after it; the targets never dispatched were cancelled.
    dispatched = [t for t in targets if t.run_id is not None]
    assert all(t.dispatched_at <= stopped_at for t in dispatched)
    assert any(t.run_id is None and t.state == "CANCELLED"
               and t.reason_code == "CAMPAIGN_STOPPED" for t in targets)
    # The runs queued at the stop were cancelled with CAMPAIGN_STOPPED, never claimed;
    # the count of started runs is within one batch of the threshold point.
    started = [r for r in attempts_of_campaign(lane, campaign_id)]
    stopped_queued = [t for t in dispatched if t.reason_code == "CAMPAIGN_STOPPED"]
    assert stopped_queued and all(t.status == "CANCELLED" for t in stopped_queued)
    assert len(started) <= crossing.seq + 5
    assert len(started) + len(stopped_queued) == len(dispatched)
    assert max(t.batch for t in dispatched) <= max(
        t.batch for t in targets if t.run_id is not None and t.status != "CANCELLED")


# --- pause, resume, idempotent create ---------------------------------------------------------


def test_pause_holds_queued_runs_and_resume_queues_them(lane: Runlane, tmp_path: Path) -> None:
    repos = [tmp_path / f"p{i}.git" for i in range(6)]
    lane.create_campaign(text=campaign_text("hold", repos, canary=3, steps='["all"]',
                                            max_active=3))
    lane.store.campaign_pass()
    assert lane.campaign("hold")["by_state"]["ACTIVE"] == 3
    assert lane.pause_campaign("hold")["status"] == "PAUSED"
    assert lane.store.claim("w", limit=10) == []  # held: not claimable
    # Neither a pass (dispatch) nor a pass after a policy change (which looks at every
    # deferred run) lets them out.
    lane.apply_policy('[defaults]\nqueue = "default"\n')
    lane.scheduler().run_once()
    assert lane.store.claim("w", limit=10) == []
    runs = lane.runs(tenant="acme")
    assert {(r["status"], r["reason_code"]) for r in runs} == {
        ("WAITING_CAPACITY", "CAMPAIGN_PAUSED")}
    assert lane.resume_campaign("hold")["status"] == "ACTIVE"
    leases = lane.store.claim("w", limit=10)
    assert len(leases) == 3
    for lease in leases:
        lane.store.fail(lease, "AGENT_FAILED")
    lane.store.campaign_pass()
    assert lane.campaign("hold")["by_state"]["ACTIVE"] == 3  # the rest dispatched


def test_creating_a_campaign_twice_creates_each_task_once(lane: Runlane, tmp_path: Path) -> None:
    repos = [tmp_path / f"i{i}.git" for i in range(8)]
    body = campaign_text("twice", repos, canary=8, steps='["all"]', max_active=8)
    first = lane.create_campaign(text=body)
    again = lane.create_campaign(text=body)
    assert (first["created"], again["created"]) == (True, False)
    assert first["campaign_id"] == again["campaign_id"]
    with pytest.raises(Conflict, match="exists with other terms"):
        lane.create_campaign(text=body.replace("number", "no."))
    for _ in range(3):
        lane.store.campaign_pass()
    with lane.store.engine.connect() as conn:
        keys = conn.execute(text("SELECT idempotency_key, COUNT(*) FROM tasks"
                                 " GROUP BY idempotency_key")).all()
        targets = conn.execute(text("SELECT COUNT(*) FROM campaign_targets")).scalar_one()
    assert targets == 8
    assert len(keys) == 8 and all(n == 1 for _, n in keys)
    assert all(k.startswith("campaign:twice:") for k, _ in keys)


def test_retry_failed_makes_new_runs_for_the_failed_targets(lane: Runlane,
                                                           tmp_path: Path) -> None:
    repos = [tmp_path / f"f{i}.git" for i in range(4)]
    lane.create_campaign(text=campaign_text("again", repos, canary=4, steps='["all"]'))
    lane.store.campaign_pass()
    leases = lane.store.claim("w", limit=10)
    for lease in leases[:2]:
        lane.store.fail(lease, "VERIFIER_FAILED")
    for lease in leases[2:]:
        lane.store.advance(lease, RunStatus.RUNNING)
        lane.store.complete(lease, outcome="no_changes")
    shown = lane.campaign("again")
    assert shown["status"] == "COMPLETED"
    assert shown["failed_by_reason"] == {"VERIFIER_FAILED": 2}
    assert shown["no_changes"] == 2
    assert lane.retry_failed_campaign("again")["retried"] == 2
    lane.store.campaign_pass()
    assert len(lane.store.claim("w", limit=10)) == 2  # new runs, of new tasks
    report = lane.campaign_report("again")
    assert "| 4 | 0 | 2 | 0 | 0 | 0 | 2 |" in report


def test_campaign_runs_take_a_lower_class_and_other_tenants_their_turn(
        lane: Runlane, tmp_path: Path) -> None:
    repos = [tmp_path / f"q{i}.git" for i in range(20)]
    lane.create_campaign(text=campaign_text("fleet", repos, canary=20, steps='["all"]',
                                            max_active=20))
    lane.store.campaign_pass()
    mine = lane.submit("acme", str(tmp_path / "mine.git"), "interactive")
    lane.create_campaign(text=campaign_text(
        "fleet2", [tmp_path / f"o{i}.git" for i in range(20)], tenant="globex", canary=20,
        steps='["all"]', max_active=20))
    lane.store.campaign_pass()
    # The tenant's own interactive run first (normal beats the campaigns' batch class) ...
    [first] = lane.store.claim("w", limit=1)
    assert first.run_id == mine.run_id
    # ... then the two tenants' campaigns share the claims (stride fairness, weight 1).
    claimed = [lane.store.get_run(lease.run_id)["tenant"] for lease in
               [lease for _ in range(10) for lease in lane.store.claim("w", limit=1)]]
    assert claimed.count("globex") >= 4 and claimed.count("acme") >= 4, claimed


# --- who may see and change a campaign ------------------------------------------------------------


def test_another_tenants_token_cannot_see_or_change_a_campaign(lane: Runlane,
                                                               tmp_path: Path) -> None:
    body = campaign_text("mine", [tmp_path / "a.git"], canary=1, steps='["all"]')
    acme = Principal(Role.SUBMIT, "acme")
    globex = Principal(Role.SUBMIT, "globex")
    with pytest.raises(Forbidden):
        lane.create_campaign(text=body, principal=globex)
    lane.create_campaign(text=body, principal=acme)
    assert [c["name"] for c in lane.campaigns(principal=acme)] == ["mine"]
    assert lane.campaigns(principal=globex) == []
    for call in (lane.campaign, lane.campaign_report, lane.pause_campaign,
                 lane.stop_campaign, lane.resume_campaign, lane.retry_failed_campaign):
        with pytest.raises(NotFound):
            call("mine", principal=globex)
        with pytest.raises(NotFound):
            call("mine", tenant="acme", principal=globex)
    with pytest.raises(Forbidden):
        lane.pause_campaign("mine", principal=Principal(Role.READ, "acme"))
    assert lane.campaign("mine", principal=Principal(Role.READ, "acme"))["status"] == "ACTIVE"
    assert lane.pause_campaign("mine", principal=acme)["status"] == "PAUSED"


# --- several schedulers at once --------------------------------------------------------------

SCHEDULER = """
import sys, time
from runlane.store.store import Store
store = Store(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    store.campaign_pass(default_max_attempts=1)
"""


def test_two_scheduler_processes_release_each_batch_once(lane: Runlane, tmp_path: Path,
                                                         db_url: str) -> None:
    import subprocess
    import sys

    repos = [tmp_path / f"s{i}.git" for i in range(16)]
    made = lane.create_campaign(text=campaign_text("race", repos, canary=2, steps="[2]",
                                                   max_active=2))
    procs = [subprocess.Popen([sys.executable, "-c", SCHEDULER, db_url, "20"])
             for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while lane.campaign("race")["status"] != "COMPLETED":
            assert time.monotonic() < deadline, lane.campaign("race")["by_state"]
            for lease in lane.store.claim("w", limit=4):
                lane.store.advance(lease, RunStatus.RUNNING)
                lane.store.complete(lease, outcome="no_changes")
            time.sleep(0.01)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    with lane.store.engine.connect() as conn:
        row = conn.execute(text("SELECT released_batch, released_at FROM campaigns"
                                " WHERE campaign_id = :c"), {"c": made["campaign_id"]}).one()
        per_key = conn.execute(text("SELECT COUNT(*) FROM tasks GROUP BY idempotency_key")).all()
        runs = conn.execute(text("SELECT COUNT(*) FROM runs")).scalar_one()
    released_at = row.released_at if isinstance(row.released_at, list) else __import__(
        "json").loads(row.released_at)
    assert row.released_batch == 7 and len(released_at) == 8  # 8 batches, each released once
    assert released_at == sorted(released_at)
    assert len(per_key) == 16 and {n for (n,) in per_key} == {1} and runs == 16


def test_a_scheduler_killed_mid_dispatch_creates_nothing_twice(lane: Runlane, tmp_path: Path,
                                                               db_url: str) -> None:
    import os
    import signal
    import subprocess
    import sys

    repos = [tmp_path / f"k{i}.git" for i in range(6)]
    lane.create_campaign(text=campaign_text("killed", repos, canary=6, steps='["all"]',
                                            max_active=6))
    crashed = subprocess.run(
        [sys.executable, "-c", SCHEDULER, db_url, "0.5"],
        env={**os.environ, "RUNLANE_FAULT_CRASH_AT": "campaign_dispatch_submitted"},
        capture_output=True, check=False)
    assert crashed.returncode == -signal.SIGKILL
    with lane.store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM tasks")).scalar_one() == 0
    lane.store.campaign_pass()
    lane.store.campaign_pass()
    with lane.store.engine.connect() as conn:
        per_key = conn.execute(text("SELECT COUNT(*) FROM tasks GROUP BY idempotency_key")).all()
    assert len(per_key) == 6 and {n for (n,) in per_key} == {1}
    assert lane.campaign("killed")["by_state"]["ACTIVE"] == 6


def test_a_success_that_completes_the_minimum_sample_can_stop_the_campaign(
        lane: Runlane, tmp_path: Path) -> None:
    """Two failures wait for the minimum sample (3); the success that completes it
    leaves 2 of 3 failed, over 50%: the completion's own transaction stops the campaign
    (on PostgreSQL its statement wrote the window; Python read it and stopped)."""
    repos = [tmp_path / f"m{i}.git" for i in range(6)]
    lane.create_campaign(text=campaign_text(
        "sample", repos, canary=3, steps='["all"]', max_active=3,
        stop="failure_rate = 0.5\nwindow = 3\nmin_sample = 3"))
    lane.store.campaign_pass()
    leases = lane.store.claim("w", limit=3)
    lane.store.fail(leases[0], "VERIFIER_FAILED")
    lane.store.fail(leases[1], "VERIFIER_FAILED")
    assert lane.campaign("sample")["status"] == "ACTIVE"
    lane.store.advance(leases[2], RunStatus.RUNNING)
    lane.store.complete(leases[2])
    shown = lane.campaign("sample")
    assert shown["status"] == "STOPPED", shown["failure_rate"]
    assert shown["stop_reason"].startswith("stop rule: 2 of the last 3")
    assert shown["by_state"] == {"PENDING": 0, "ACTIVE": 0, "SUCCEEDED": 1, "FAILED": 2,
                                 "CANCELLED": 3}


def test_a_500_target_campaign_leaves_another_tenant_its_turn(lane: Runlane,
                                                              tmp_path: Path) -> None:
    """500 targets dispatched at once, in the same priority class as another tenant's
    runs submitted after them: the claims alternate between the tenants (equal
    weights), the campaign's backlog notwithstanding."""
    repos = [tmp_path / f"big{i}.git" for i in range(500)]
    lane.create_campaign(text=campaign_text("big", repos, canary=500, steps='["all"]',
                                            max_active=500, task='priority = "normal"\n'))
    assert lane.store.campaign_pass()["campaign_runs_dispatched"] == 500
    theirs = {lane.submit("globex", str(tmp_path / f"g{i}.git"), "theirs").run_id
              for i in range(10)}
    claimed = [lease.run_id for _ in range(20) for lease in lane.store.claim("w", limit=1)]
    assert len(claimed) == 20
    assert sum(run_id in theirs for run_id in claimed) >= 9, claimed


def test_a_stop_lets_running_runs_finish_unless_it_cancels_them(lane: Runlane,
                                                                tmp_path: Path) -> None:
    """`campaign stop` lets the runs already running finish; `--cancel-running` (the
    facade's ``cancel_running``) cancels them as `runlane cancel` would, with
    CAMPAIGN_STOPPED, and their workers are told (CANCEL_REQUESTED)."""
    for name in ("finish", "cancel"):
        repos = [tmp_path / f"{name}{i}.git" for i in range(4)]
        lane.create_campaign(text=campaign_text(name, repos, canary=2, steps='["all"]',
                                                max_active=2))
    lane.store.campaign_pass()
    leases = {lease.run_id: lease for lease in lane.store.claim("w", limit=4)}
    assert len(leases) == 4
    for lease in leases.values():
        lane.store.advance(lease, RunStatus.RUNNING)

    kept = lane.stop_campaign("finish")
    assert (kept["status"], kept["cancelled_running"]) == ("STOPPED", 0)
    cancelled = lane.stop_campaign("cancel", cancel_running=True)
    assert (cancelled["status"], cancelled["cancelled_running"]) == ("STOPPED", 2)
    by_campaign = {name: lane.store.find_campaign(name, "acme").campaign_id
                   for name in ("finish", "cancel")}
    with lane.store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT t.campaign_id, r.status, r.reason_code FROM campaign_targets t"
            " JOIN runs r ON r.run_id = t.run_id")).all()
    got = {(c, s, rc) for c, s, rc in rows}
    assert got == {(by_campaign["finish"], "RUNNING", None),
                   (by_campaign["cancel"], "CANCEL_REQUESTED", "CAMPAIGN_STOPPED")}
    # The heartbeat delivers the cancel to the worker holding each of them.
    beat = lane.store.heartbeat("w", list(leases.values()), lease_ttl=30)
    assert len(beat.cancel_requested) == 2


def test_a_stop_rule_that_cancels_running_runs_has_the_pass_cancel_them(
        lane: Runlane, tmp_path: Path) -> None:
    """The rule stops the campaign in a run's finishing transaction; the runs still
    running are cancelled by the next scheduler pass (the file's stop.cancel_running),
    not in that transaction (it would wait for their rows holding the campaign's)."""
    repos = [tmp_path / f"rule{i}.git" for i in range(6)]
    lane.create_campaign(text=campaign_text(
        "rule", repos, canary=3, steps='["all"]', max_active=3,
        stop="failure_rate = 0.5\nwindow = 2\nmin_sample = 2\ncancel_running = true"))
    lane.store.campaign_pass()
    leases = lane.store.claim("w", limit=3)
    lane.store.advance(leases[2], RunStatus.RUNNING)
    lane.store.fail(leases[0], "VERIFIER_FAILED")
    lane.store.fail(leases[1], "VERIFIER_FAILED")
    assert lane.campaign("rule")["status"] == "STOPPED"
    assert lane.store.get_run(leases[2].run_id)["status"] == "RUNNING"
    assert lane.store.campaign_pass()["campaign_runs_cancelled"] == 1
    run = lane.store.get_run(leases[2].run_id)
    assert (run["status"], run["reason_code"]) == ("CANCEL_REQUESTED", "CAMPAIGN_STOPPED")
    assert lane.store.campaign_pass()["campaign_runs_cancelled"] == 0  # once
