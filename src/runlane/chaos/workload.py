"""The harness's workload: one plan per task, drawn from the seed alone, so the same
seed gives the same tasks, behaviours and cancellations whatever else changes."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from runlane.chaos.agent import FATAL, RETRYABLE, STAGES, Behaviour

TENANTS = ("acme", "globex", "initech")
# Where a cancellation lands: a stage the run is seen in, a retry's wait, a second
# cancel while the first is being delivered, or after the run ended (a no-op).
CANCEL_POINTS = ("QUEUED", "RETRY_WAIT", *STAGES[:2], "RUNNING", *STAGES[2:],
                 "CANCEL_REQUESTED", "TERMINAL")


@dataclass(frozen=True)
class TaskPlan:
    behaviour: Behaviour
    tenant: str
    repo: int  # index of the remote
    key: str  # idempotency key
    max_attempts: int
    priority: str
    cancel_at: str | None = None

    @property
    def number(self) -> int:
        return self.behaviour.number

    def submission(self, repo_path: str) -> dict[str, object]:
        return {"tenant": self.tenant, "repo": repo_path, "prompt": self.behaviour.prompt(),
                "idempotency_key": self.key, "max_attempts": self.max_attempts,
                "priority": self.priority}


_WITH_AGENT_FAULTS = {"change": 30, "nochange": 8, "slow": 10, "flaky": 14, "exhaust": 4,
                      "fatal": 12, "verify_fail": 4, "hang": 5, "hang_once": 3, "stubborn": 2,
                      "dwell": 8}
_WITHOUT = {"change": 70, "nochange": 15, "slow": 15, "dwell": 8}


# The share of plain "change" tasks whose worker dies after the code host opened the
# pull request, before the ledger recorded it (fault "pr_crash"); half of them have a
# single attempt, so the death is their last attempt's.
PR_CRASH_SHARE = 0.08


def build_workload(seed: int, runs: int, *, repos: int, agent_faults: bool = True,
                   cancels: bool = True, agent_sleep: float | None = None,
                   pr_crashes: bool = False) -> list[TaskPlan]:
    """``agent_sleep``: every agent works this long instead of a drawn time.
    ``pr_crashes``: the fault "pr_crash" (drawn apart, so the rest of a seed's workload
    is the same with or without it)."""
    rng = random.Random(f"{seed}:workload")
    weights = _WITH_AGENT_FAULTS if agent_faults else _WITHOUT
    kinds, counts = zip(*weights.items(), strict=True)
    plans: list[TaskPlan] = []
    turns: Counter[str] = Counter()

    def turn(what: str, choices: tuple[str, ...]) -> str:
        """Each in turn: every stage and every reason comes up, whatever the seed."""
        turns[what] += 1
        return choices[(turns[what] - 1) % len(choices)]

    crash_rng = random.Random(f"{seed}:pr_crash")
    for number in range(runs):
        kind = rng.choices(kinds, counts)[0]
        max_attempts = rng.choices((4, 3, 2), (70, 20, 10))[0]
        reason: str | None = None
        fails = 0
        dwell: str | None = None
        cancel: str | None = None
        sleep = rng.uniform(0.05, 0.6)
        if kind == "dwell":
            kind, dwell = "change", turn("dwell", STAGES)
            if rng.random() < 0.75:
                cancel = dwell
        elif kind == "slow":
            sleep = rng.uniform(1.0, 2.0)
            if rng.random() < 0.2:
                cancel = "RUNNING"
        elif kind == "flaky":
            reason = turn("flaky", RETRYABLE)
            fails = rng.randint(1, max(1, min(2, max_attempts - 1)))
            if rng.random() < 0.2:
                reason, cancel = "PROVIDER_RATE_LIMIT", "RETRY_WAIT"
        elif kind == "exhaust":
            reason = turn("exhaust", RETRYABLE)
        elif kind == "fatal":
            reason = turn("fatal", FATAL)
        elif kind in ("hang", "stubborn"):
            if kind == "stubborn" or rng.random() < 0.8:
                cancel = "CANCEL_REQUESTED" if rng.random() < 0.3 else "RUNNING"
        elif kind == "change":
            roll = rng.random()
            cancel = "QUEUED" if roll < 0.05 else "TERMINAL" if roll < 0.07 else None
        if kind in ("nochange", "flaky", "fatal", "exhaust"):
            sleep = rng.uniform(0.05, 0.3)
        crash = 0
        roll = crash_rng.random()
        if pr_crashes and kind == "change" and dwell is None and cancel is None and \
                roll < PR_CRASH_SHARE:
            crash = 1
            if roll < PR_CRASH_SHARE / 2:
                max_attempts = 1  # the last attempt dies after opening it
        plans.append(TaskPlan(
            behaviour=Behaviour(number=number, kind=kind, reason=reason, fails=fails,
                                sleep=round(sleep if agent_sleep is None else agent_sleep, 2),
                                dwell=dwell, crash=crash),
            tenant=rng.choice(TENANTS), repo=rng.randrange(repos),
            key=f"chaos-{seed}-{number}", max_attempts=max_attempts,
            priority=rng.choices(("normal", "high", "low"), (80, 10, 10))[0],
            cancel_at=cancel if cancels else None))
    return plans


# --- campaigns ----------------------------------------------------------------------------

# Behaviours a campaign target may take: each ends as planned whatever a fault does to
# its attempts (a lost worker is retried; no cancel, dwell or pull-request crash).
_SUCCEEDS = frozenset({"change", "nochange", "flaky"})
_FAILS = frozenset({"fatal", "verify_fail"})
CAMPAIGN_TENANT = "acme"
# Below this many runs the workload has no campaign (the planted-bug runs are 30).
CAMPAIGN_MIN_RUNS = 100


@dataclass(frozen=True)
class CampaignPlan:
    """A campaign the harness creates: its targets are plans taken out of the plain
    workload (the profile's run count stays the same), each target's behaviour carried
    in a variable its prompt template names."""

    name: str
    targets: tuple[TaskPlan, ...]
    canary: int
    steps: tuple[int | str, ...]
    max_active: int
    failure_rate: float
    window: int
    min_sample: int
    expect: str  # the end its planned failure mix gives: COMPLETED | STOPPED

    def document(self, repo_path: list[str]) -> dict[str, object]:
        """The campaign as its file would give it (``campaign_from_document``)."""
        return {
            "name": self.name, "tenant": CAMPAIGN_TENANT, "owner": "chaos-owner",
            "prompt": "{behaviour}",
            "targets": [{"repo": repo_path[p.repo], "vars": {"behaviour": p.behaviour.prompt()}}
                        for p in self.targets],
            "task": {"max_attempts": 4},
            "rollout": {"canary": self.canary, "steps": list(self.steps)},
            "concurrency": {"max_active": self.max_active,
                            "per_repository": self.max_active},
            "stop": {"failure_rate": self.failure_rate, "window": self.window,
                     "min_sample": self.min_sample},
        }


def split_campaigns(plans: list[TaskPlan]) -> tuple[list[TaskPlan], list[CampaignPlan]]:
    """Twenty of the workload's plans become the targets of two campaigns; the rest
    stay plain runs. ``rollout``: 12 targets, canary 3, ramp 3 -> all, 2 planned
    failures (last) under a 50% rule: it completes. ``stop``: 8 targets, canary 2
    (successes), then a batch of two fast failures, a slow success and one more, under
    a 25% rule with a sample of 4: it stops at its fourth counted finish, with a run
    still running and a target of that batch and the whole last batch never started.
    Too few plans of the right kinds (a small or fault-free workload): no campaign."""
    if len(plans) < CAMPAIGN_MIN_RUNS:
        return plans, []

    def calm(p: TaskPlan) -> bool:
        b = p.behaviour
        return p.cancel_at is None and b.dwell is None and not b.crash

    ok = [p for p in plans if calm(p) and p.behaviour.kind in _SUCCEEDS]
    slow = [p for p in plans if calm(p) and p.behaviour.kind == "slow"]
    bad = [p for p in plans if calm(p) and p.behaviour.kind in _FAILS]
    fast_bad = [p for p in bad if p.behaviour.kind == "fatal"]
    if len(ok) < 15 or len(slow) < 1 or len(bad) < 2 or len(fast_bad) < 2:
        return plans, []
    fast_bad = fast_bad[:2]
    bad = [p for p in bad if p not in fast_bad][:2]
    if len(bad) < 2:
        return plans, []
    rollout = CampaignPlan(name="chaos-rollout", targets=(*ok[:10], *bad), canary=3,
                           steps=(3, "all"), max_active=6, failure_rate=0.5, window=20,
                           min_sample=6, expect="COMPLETED")
    stop = CampaignPlan(name="chaos-stop",
                        targets=(ok[10], ok[11], *fast_bad, slow[0], ok[12], ok[13], ok[14]),
                        canary=2, steps=(4, "all"), max_active=3, failure_rate=0.25,
                        window=10, min_sample=4, expect="STOPPED")
    taken = {p.key for c in (rollout, stop) for p in c.targets}
    return [p for p in plans if p.key not in taken], [rollout, stop]
