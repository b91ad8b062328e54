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
