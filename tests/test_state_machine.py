"""A stateful property test of the store, on SQLite and on PostgreSQL.

Hypothesis drives random interleavings of every store operation a scheduler,
a worker, the reaper, the reconciler and a user perform (submit, claim,
heartbeat, advance a stage, complete, fail, cancel, acknowledge and finish a
cancellation, reap, reconcile) against a pinned clock that moves in jumps.

Next to the database the test keeps its own model: every run's status, fencing
token, attempt count and visibility, and every lease a worker holds with the
expiry it believes in. Each operation's answer is predicted from the model and
checked; every worker write made with a lease the model knows is no longer live
must raise ``LeaseLost`` and change nothing at all. After every step the audit
of DESIGN.md must be empty, the database must agree with the model, and the
model-level invariants hold: no run leaves a terminal state, fencing tokens
only grow, attempts stay within budget, a cancelled run is never claimed again.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import pytest
from hypothesis import HealthCheck, event
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.domain.reasons import DEFAULT_RETRYABLE, Reason
from runlane.domain.states import LEASED, STAGES, TERMINAL, RunStatus
from runlane.errors import CancelRequested, Conflict, LeaseLost, NotFound, TransitionRefused
from runlane.store import submit as submit_module
from runlane.store.engine import build_engine
from runlane.store.migrate import upgrade
from runlane.store.records import Lease
from runlane.store.store import Store

from .conftest import POLICY, RUN_TAG, T0, TABLES, migrated_pg_database
from .support import spec

S = RunStatus
CANCELLING = frozenset({S.CANCEL_REQUESTED, S.CANCELLING})
WORKERS = ("w1", "w2", "w3")
LEASE_TTL = 30.0
TENANTS = ("acme", "globex")
KEYS = (None, None, "k1", "k2", "k3")  # None twice: most tasks carry no key
RETRYABLE_REASONS = sorted(DEFAULT_RETRYABLE)
FATAL_REASONS = [Reason.AGENT_FAILED, Reason.VERIFIER_FAILED, Reason.JUDGE_REJECTED,
                 Reason.TASK_CONTRACT_INVALID, Reason.POLICY_DENIED, Reason.LIMIT_EXCEEDED]
EPS = 1e-3  # seconds; epoch floats near 1.8e9 carry ~2e-7 s of rounding
# Uncharged releases a run may have (MAX_UNCHARGED_RELEASES): small, so that examples
# reach the charged release past it.
RELEASE_CAP = 1

Submitted = tuple[str, str | None, int, int | None]  # tenant, key, priority, max attempts
BATCHES = st.lists(
    st.tuples(st.sampled_from(TENANTS), st.sampled_from(KEYS),
              st.sampled_from([0, 100, 100, 200]), st.sampled_from([None, 1, 2, 3, 4])),
    min_size=1, max_size=3)

WorkerRefusal = (LeaseLost, CancelRequested, TransitionRefused)


@dataclass
class ModelTask:
    task_id: str
    run_id: str
    cancelled: bool = False


@dataclass
class ModelRun:
    run_id: str
    task_id: str
    priority: int
    max_attempts: int
    visible_at: float
    tenant: str = ""
    created_at: float = 0.0
    status: RunStatus = S.QUEUED
    fencing_token: int = 0
    attempt_count: int = 0
    charged: int = 0  # attempts that count against max_attempts (drained ones do not)
    released: int = 0  # attempts ended LEASE_RELEASED (uncharged), at most RELEASE_CAP
    cost_usd: float = 0.0
    token_at_cancel: int | None = None  # set once its task is cancelled


@dataclass
class Held:
    """A lease a worker holds, and what the test believes about it."""

    lease: Lease
    started_at: float
    expires_at: float
    ended: bool = False  # released, failed, completed, reaped or revoked
    cancel_seen: bool = False  # a heartbeat reported its run cancelling

    def live(self, now: float) -> bool:
        return not self.ended and now < self.expires_at

    def __repr__(self) -> str:  # short, for Hypothesis's report of a failing example
        lease = self.lease
        return (f"Held(run #{uuid.UUID(lease.run_id).int}, token {lease.fencing_token}, "
                f"{lease.worker_id}, {lease.stage}, expires T0+{self.expires_at - T0:g}"
                f"{', ended' if self.ended else ''}{', cancel seen' if self.cancel_seen else ''})")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis's printer
        printer.text(repr(self))


@dataclass
class Observed:
    """What the invariant saw of a run at previous steps."""

    statuses: list[RunStatus] = field(default_factory=list)
    max_token: int = 0


class SequentialIds:
    """Stands in for ``new_id`` inside the store: ids in creation order.

    Claims break ties by run id; with random ids the same example would claim
    different runs on replay and Hypothesis could neither replay nor shrink it.
    """

    def __init__(self) -> None:
        self.issued = 0

    def __call__(self) -> str:
        self.issued += 1
        return str(uuid.UUID(int=self.issued))


class SeededJitter(random.Random):
    """The store's rng: seeded per example, and the same jitter fraction on every call.

    The store draws a backoff jitter per requeued run in the order it happens to visit
    them (the reaper breaks expiry ties however the database likes), so a plain
    ``random.Random(seed)`` could hand two runs each other's delays when Hypothesis
    replays an example, and the replay would diverge. One fraction per example keeps
    replays exact while examples still cover the whole jitter range.
    """

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.fraction = self.random()

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.fraction


class StoreMachine(RuleBasedStateMachine):
    """The engine-independent machine; subclasses open and close the database."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(T0)
        self.store = Store(self.open_database(), clock=self.clock, retry_policy=POLICY,
                           max_uncharged_releases=RELEASE_CAP,
                           rng=SeededJitter(0))
        try:
            self.prepare_database()
        except BaseException:
            self.teardown_database()
            raise
        self.ids = mock.patch.object(submit_module, "new_id", SequentialIds())
        self.ids.start()
        self.tasks: dict[str, ModelTask] = {}
        self.keys: dict[tuple[str, str], str] = {}  # (tenant, key) -> task id
        # (tenant, key) -> the request that took it (priority, max attempts): the same
        # key with another request is a conflict that writes nothing (issue 23).
        self.key_requests: dict[tuple[str, str], tuple[int, int | None]] = {}
        self.runs: dict[str, ModelRun] = {}
        self.held: list[Held] = []
        self.dead_workers: set[str] = set()
        self.observed: dict[str, Observed] = {}

    # --- database lifecycle (per engine) -----------------------------------------------

    def open_database(self) -> str:
        raise NotImplementedError

    def prepare_database(self) -> None:
        pass

    def close_database(self) -> None:
        pass

    def teardown_database(self) -> None:
        self.store.close()
        self.close_database()

    def teardown(self) -> None:
        self.ids.stop()
        self.teardown_database()

    # --- helpers ----------------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now()

    def live(self) -> list[Held]:
        return [h for h in self.held if h.live(self.now())]

    def pick(self, data: st.DataObject, candidates: list[Held]) -> Held:
        """A lease to write with: often a live one, else any (live or stale)."""
        live = [h for h in candidates if h.live(self.now())]
        prefer_live = bool(live) and data.draw(st.booleans(), label="prefer live")
        if prefer_live:
            candidates = live
        return data.draw(st.sampled_from(candidates), label="lease")

    def row_state(self, run_id: str) -> tuple[Any, ...]:
        """Everything a refused worker write must leave untouched (a refused cost
        report records the money as its attempt's late cost, checked apart)."""
        with self.store.engine.connect() as conn:
            run = conn.execute(text("SELECT * FROM runs WHERE run_id = :r"), {"r": run_id}).one()
            attempts = conn.execute(
                text("SELECT * FROM attempts WHERE run_id = :r ORDER BY attempt_no"),
                {"r": run_id}).all()
            events = conn.execute(text("SELECT COUNT(*) FROM run_events WHERE run_id = :r"),
                                  {"r": run_id}).scalar_one()
        return tuple(run), tuple(tuple(v for k, v in a._mapping.items()
                                       if k != "late_cost_usd") for a in attempts), events

    def expect_refusal(self, h: Held, expected: type[Exception], write: Any) -> None:
        """``write()`` must raise exactly ``expected`` and change nothing."""
        before = self.row_state(h.lease.run_id)
        lease_before = (h.lease.stage, h.lease.expires_at, h.lease.fencing_token)
        with pytest.raises(WorkerRefusal) as caught:
            write()
        assert type(caught.value) is expected, (
            f"expected {expected.__name__}, got {type(caught.value).__name__}: {caught.value}")
        assert self.row_state(h.lease.run_id) == before, "a refused write changed the run"
        assert (h.lease.stage, h.lease.expires_at, h.lease.fencing_token) == lease_before
        event(f"refused with {expected.__name__}")

    def attempts(self, run_id: str) -> list[Any]:
        with self.store.engine.connect() as conn:
            return list(conn.execute(text("SELECT * FROM attempts WHERE run_id = :r "
                                          "ORDER BY attempt_no"), {"r": run_id}))

    def late_cost(self, h: Held) -> float:
        [attempt] = [a for a in self.attempts(h.lease.run_id)
                     if a.fencing_token == h.lease.fencing_token]
        return float(attempt.late_cost_usd)

    def visible_at(self, run_id: str) -> float:
        with self.store.engine.connect() as conn:
            return float(conn.execute(text("SELECT visible_at FROM runs WHERE run_id = :r"),
                                      {"r": run_id}).scalar_one())

    def attempt_ended(self, h: Held, reason: str, retry_after: float | None) -> RunStatus:
        """Apply to the model what ``Store._end_attempt`` must do; return the run's status."""
        now = self.now()
        h.ended = True
        run = self.runs[h.lease.run_id]
        if run.status in CANCELLING:
            run.status = S.CANCELLED
        elif run.status in LEASED and reason == Reason.POLICY_DENIED:
            run.status = S.POLICY_DENIED  # denied under the lease: never retried
        elif run.status in LEASED:
            released = reason == Reason.LEASE_RELEASED
            if reason in POLICY.retryable and (released or run.charged < run.max_attempts):
                run.status = S.QUEUED
                if released:
                    low = high = 0.0
                    run.charged -= 1
                else:
                    capped = min(POLICY.base_seconds * 2 ** (run.charged - 1),
                                 POLICY.max_seconds)
                    low, high = capped, capped * 1.25
                if retry_after is not None:
                    low, high = max(low, retry_after), max(high, retry_after)
                visible = self.visible_at(run.run_id)
                assert now + low - EPS <= visible <= now + high + EPS, (
                    f"requeued after attempt {run.attempt_count} with delay {visible - now}, "
                    f"expected within [{low}, {high}]")
                run.visible_at = visible
            else:
                run.status = S.FAILED
        else:  # pragma: no cover - the model never holds a live lease of another state
            raise AssertionError(f"lease ended while its run was {run.status}")
        return run.status

    # --- rules ------------------------------------------------------------------------

    @initialize(seed=st.integers(0, 2**32 - 1), batch=BATCHES)
    def start(self, seed: int, batch: list[Submitted]) -> None:
        # Tasks from the start: Hypothesis disables a random subset of the rules in each
        # example (swarm testing), and without runs most rules would have nothing to do.
        self.store.rng = SeededJitter(seed)
        for worker in WORKERS:
            self.store.register_worker(worker, version="sm", queues=["default"])
        self.submit(batch)

    @rule(batch=BATCHES)
    def submit(self, batch: list[Submitted]) -> None:
        specs = [spec(tenant=tenant, idempotency_key=key, priority=priority,
                      max_attempts=max_attempts)
                 for tenant, key, priority, max_attempts in batch]
        requests = dict(self.key_requests)
        conflict = False
        for tenant, key, priority, max_attempts in batch:
            if key is not None:
                taken = requests.setdefault((tenant, key), (priority, max_attempts))
                conflict = conflict or taken != (priority, max_attempts)
        if conflict:  # the whole batch is refused; the model does not change
            with pytest.raises(Conflict):
                self.store.submit(specs)
            event("submit: key taken by another request")
            return
        self.key_requests = requests
        submissions = self.store.submit(specs)
        assert len(submissions) == len(specs)
        first_in_batch: dict[tuple[str, str], int] = {}
        for i, ((tenant, key, priority, max_attempts), sub) in enumerate(
                zip(batch, submissions, strict=True)):
            if key is not None and (tenant, key) in first_in_batch:
                first = submissions[first_in_batch[(tenant, key)]]
                # Not ``created``: the store repeats the first one's flag (see the report).
                assert (sub.task_id, sub.run_id, sub.status) == (
                    first.task_id, first.run_id, first.status)
                event("submit: key repeated within a batch")
                continue
            if key is not None:
                first_in_batch[(tenant, key)] = i
            if key is not None and (tenant, key) in self.keys:
                task = self.tasks[self.keys[(tenant, key)]]
                assert not sub.created
                assert (sub.task_id, sub.run_id) == (task.task_id, task.run_id)
                assert sub.status == self.runs[task.run_id].status.value
                event(f"submit: key repeated, run {sub.status}")
                continue
            assert sub.created and sub.status == S.QUEUED.value
            assert sub.task_id not in self.tasks and sub.run_id not in self.runs
            self.tasks[sub.task_id] = ModelTask(sub.task_id, sub.run_id)
            if key is not None:
                self.keys[(tenant, key)] = sub.task_id
            self.runs[sub.run_id] = ModelRun(sub.run_id, sub.task_id, priority,
                                             max_attempts or 3, visible_at=self.now(),
                                             tenant=tenant, created_at=self.now())

    @precondition(lambda self: any(r.status is S.QUEUED for r in self.runs.values()))
    @rule(worker=st.sampled_from(WORKERS), limit=st.integers(1, 3))
    def claim(self, worker: str, limit: int) -> None:
        now = self.now()
        runnable = sorted(
            (r for r in self.runs.values()
             if r.status is S.QUEUED and r.visible_at <= now
             and not self.tasks[r.task_id].cancelled),
            key=lambda r: (r.priority, r.created_at, r.run_id))
        leases = self.store.claim(worker, limit=limit, lease_ttl=LEASE_TTL)
        claimed = {lease.run_id for lease in leases}
        # Which runs a claim takes: only runnable ones, as many as it may; priority
        # before everything; inside a lane (tenant, priority) the oldest first. Among
        # the tenants of one priority the order is the fair share's (stride), which
        # tests/test_scheduler.py checks on its own.
        assert claimed <= {r.run_id for r in runnable}, "claimed a run that is not runnable"
        assert len(claimed) == min(limit, len(runnable)), "claimed too few runs"
        left = [r for r in runnable if r.run_id not in claimed]
        for run_id in claimed:
            taken = self.runs[run_id]
            for other in left:
                assert other.priority >= taken.priority, "a better priority was left"
                if (other.tenant, other.priority) == (taken.tenant, taken.priority):
                    assert (other.created_at, other.run_id) > (taken.created_at, taken.run_id), \
                        "an older run of the same lane was left"
        for lease in sorted(leases, key=lambda lease: lease.run_id):
            run = self.runs[lease.run_id]
            assert not self.tasks[run.task_id].cancelled, "claimed a run of a cancelled task"
            run.status = S.CLAIMED
            run.fencing_token += 1
            run.attempt_count += 1
            run.charged += 1
            assert (lease.fencing_token, lease.attempt_no) == (run.fencing_token,
                                                                run.attempt_count)
            assert lease.expires_at == now + LEASE_TTL and lease.worker_id == worker
            assert lease.max_attempts == run.max_attempts and lease.stage is S.CLAIMED
            self.held.append(Held(lease, started_at=now, expires_at=lease.expires_at))
            if lease.attempt_no > 1:
                event("claim: a retry attempt")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        # Often a worker with something to hear: a cancellation, else a live lease.
        holders = (sorted({h.lease.worker_id for h in self.live()
                           if self.runs[h.lease.run_id].status in CANCELLING})
                   or sorted({h.lease.worker_id for h in self.live()}))
        informed = bool(holders) and data.draw(st.booleans(), label="a worker with news")
        worker = data.draw(st.sampled_from(holders if informed else WORKERS), label="worker")
        newest: dict[str, Held] = {}  # a worker heartbeats one lease per run: its newest
        for h in self.held:
            if h.lease.worker_id == worker:
                newest[h.lease.run_id] = h
        now = self.now()
        live = {run_id for run_id, h in newest.items() if h.live(now)}
        result = self.store.heartbeat(worker, [h.lease for h in newest.values()],
                                      lease_ttl=LEASE_TTL)
        assert set(result.extended) == live, "heartbeat extended the wrong leases"
        assert result.lost == set(newest) - live
        cancelling = {r for r in live if self.runs[r].status in CANCELLING}
        assert result.cancel_requested == cancelling
        for run_id in live:
            h = newest[run_id]
            h.expires_at = now + LEASE_TTL
            assert result.extended[run_id] == h.expires_at == h.lease.expires_at
            h.cancel_seen = h.cancel_seen or run_id in cancelling
        if cancelling:
            event("heartbeat reported cancel")
        if result.lost:
            event("heartbeat reported lost leases")

    @rule(seconds=st.one_of(
        st.sampled_from([0.0, 1.0, 5.0, 10.0, 12.5, 20.0, 29.0, LEASE_TTL]),  # within a lease
        st.integers(0, 40).map(float),
        st.integers(0, 120).map(float),
        st.floats(0, 120)))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @precondition(lambda self: any(not h.ended and h.expires_at <= self.now()
                                   for h in self.held))
    @rule()
    def reap(self) -> None:
        now = self.now()
        expired = [h for h in self.held if not h.ended and h.expires_at <= now]
        assert self.store.reap_expired_leases() == len(expired)
        for h in expired:
            event(f"reap: {self.attempt_ended(h, Reason.WORKER_LOST, None)}")

    @precondition(lambda self: any(r.status not in TERMINAL for r in self.runs.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 9), label="unknown task") == 0:
            with pytest.raises(NotFound):
                self.store.cancel(str(uuid.uuid4()))
            return
        candidates = sorted(self.tasks)  # terminal ones too: cancelling them changes nothing
        leased = [t for t in candidates if self.runs[self.tasks[t].run_id].status in LEASED]
        prefer_leased = bool(leased) and data.draw(st.booleans(), label="a leased run")
        if prefer_leased:
            candidates = leased
        task = self.tasks[data.draw(st.sampled_from(candidates), label="task")]
        run = self.runs[task.run_id]
        task.cancelled = True
        if run.token_at_cancel is None:
            run.token_at_cancel = run.fencing_token
        if run.status is S.QUEUED:
            run.status = S.CANCELLED
        elif run.status in LEASED:
            run.status = S.CANCEL_REQUESTED
        result = self.store.cancel(task.task_id)
        assert result.runs == {run.run_id: run.status.value}
        event(f"cancel: {run.status}")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(),
          reason=st.sampled_from([*RETRYABLE_REASONS, *FATAL_REASONS]),
          retry_after=st.one_of(st.none(), st.sampled_from([5.0, 60.0, 120.0])))
    def fail(self, data: st.DataObject, reason: str, retry_after: float | None) -> None:
        h = self.pick(data, self.held)
        if not h.live(self.now()):
            self.expect_refusal(h, LeaseLost, lambda: self.store.fail(
                h.lease, reason, retry_after_seconds=retry_after))
            return
        run = self.runs[h.lease.run_id]
        before = run.status
        status = self.store.fail(h.lease, reason, retry_after_seconds=retry_after)
        if reason == Reason.LEASE_RELEASED:  # uncharged up to the cap, charged past it
            if run.released < RELEASE_CAP:
                run.released += 1
            else:
                reason = Reason.LEASE_RELEASED_OVER_CAP
                event("fail: a release past the cap, charged")
            [attempt] = [a for a in self.attempts(run.run_id)
                         if a.fencing_token == h.lease.fencing_token]
            assert attempt.reason_code == reason
        predicted = self.attempt_ended(h, reason, retry_after)
        assert status is predicted, f"fail from {before}: store says {status}"
        event(f"fail: {before} -> {status}")

    @precondition(lambda self: any(h.lease.stage in STAGES for h in self.held))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        h = self.pick(data, [h for h in self.held if h.lease.stage in STAGES])
        run = self.runs[h.lease.run_id]
        if not h.live(self.now()):
            self.expect_refusal(h, LeaseLost, lambda: self.store.complete(h.lease))
        elif run.status in CANCELLING:
            self.expect_refusal(h, CancelRequested, lambda: self.store.complete(h.lease))
        else:
            assert run.status is h.lease.stage
            self.store.complete(h.lease)
            run.status = S.SUCCEEDED
            h.ended = True
            event("complete: SUCCEEDED")
            assert h.lease.stage is S.SUCCEEDED

    @precondition(lambda self: any(h.lease.stage in STAGES[:-1] for h in self.held))
    @rule(data=st.data())
    def advance_stage(self, data: st.DataObject) -> None:
        h = self.pick(data, [h for h in self.held if h.lease.stage in STAGES[:-1]])
        later = STAGES[STAGES.index(h.lease.stage) + 1:]
        stage = data.draw(st.sampled_from(later), label="stage")
        run = self.runs[h.lease.run_id]
        if not h.live(self.now()):
            self.expect_refusal(h, LeaseLost, lambda: self.store.advance(h.lease, stage))
        elif run.status in CANCELLING:
            self.expect_refusal(h, CancelRequested, lambda: self.store.advance(h.lease, stage))
        else:
            assert run.status is h.lease.stage
            self.store.advance(h.lease, stage)
            run.status = stage
            assert h.lease.stage is stage
            event(f"advance_stage: {stage}")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), usd=st.sampled_from([0.25, 0.5, 1.0]))
    def report_cost(self, data: st.DataObject, usd: float) -> None:
        h = self.pick(data, self.held)
        if not h.live(self.now()):
            late = self.late_cost(h)
            self.expect_refusal(h, LeaseLost, lambda: self.store.report_cost(h.lease, usd))
            # Spent all the same: the attempt's late cost, not the run's (checked above).
            assert self.late_cost(h) == pytest.approx(late + usd)
        else:
            self.store.report_cost(h.lease, usd, input_tokens=10, output_tokens=5)
            self.runs[h.lease.run_id].cost_usd += usd

    def cancel_candidates(self, data: st.DataObject) -> list[Held]:
        """Mostly leases whose cancellation a heartbeat reported; sometimes any lease the
        worker has not heard about (out of turn: refused, or stale)."""
        seen = [h for h in self.held if h.cancel_seen]
        if seen and data.draw(st.integers(0, 3), label="out of turn") > 0:
            return seen
        unheard = [h for h in self.held if h.cancel_seen
                   or self.runs[h.lease.run_id].status not in CANCELLING]
        return unheard or self.held

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def acknowledge_cancel(self, data: st.DataObject) -> None:
        h = self.pick(data, self.cancel_candidates(data))
        run = self.runs[h.lease.run_id]
        if not h.live(self.now()):
            self.expect_refusal(h, LeaseLost, lambda: self.store.acknowledge_cancel(h.lease))
        elif run.status is S.CANCELLING:
            self.expect_refusal(h, CancelRequested,
                                lambda: self.store.acknowledge_cancel(h.lease))
        elif run.status is not S.CANCEL_REQUESTED:
            self.expect_refusal(h, TransitionRefused,
                                lambda: self.store.acknowledge_cancel(h.lease))
        else:
            self.store.acknowledge_cancel(h.lease)
            run.status = S.CANCELLING
            assert h.lease.stage is S.CANCELLING
            event("acknowledge_cancel: CANCELLING")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def finish_cancel(self, data: st.DataObject) -> None:
        h = self.pick(data, self.cancel_candidates(data))
        run = self.runs[h.lease.run_id]
        if not h.live(self.now()):
            self.expect_refusal(h, LeaseLost, lambda: self.store.finish_cancel(h.lease))
        elif run.status not in CANCELLING:
            self.expect_refusal(h, TransitionRefused, lambda: self.store.finish_cancel(h.lease))
        else:
            self.store.finish_cancel(h.lease)
            run.status = S.CANCELLED
            h.ended = True
            assert h.lease.stage is S.CANCELLED
            event("finish_cancel: CANCELLED")

    @rule(admitted_grace=st.integers(0, 60), active_grace=st.integers(0, 60),
          worker_grace=st.integers(0, 600), max_attempt_seconds=st.integers(30, 300))
    def reconcile(self, admitted_grace: int, active_grace: int, worker_grace: int,
                  max_attempt_seconds: int) -> None:
        now = self.now()
        dead = {w for w in WORKERS if w not in self.dead_workers and now - worker_grace >= T0}
        overlong = [h for h in self.held
                    if not h.ended and h.started_at <= now - max_attempt_seconds]
        counts = self.store.reconcile(
            admitted_grace=admitted_grace, active_grace=active_grace,
            worker_grace=worker_grace, max_attempt_seconds=max_attempt_seconds)
        self.dead_workers |= dead
        assert counts == {
            "admitted_requeued": 0,
            "terminal_leases_revoked": 0,
            "waiting_leases_revoked": 0,
            "cancelled_task_runs_cancelled": 0,
            "active_without_lease_recovered": 0,
            "workers_marked_dead": len(dead),
            "overlong_attempts_timed_out": len(overlong),
            # The store keeps its lanes and slot counters exact: nothing to repair.
            "lane_counts_repaired": 0,
            "slot_counters_repaired": 0,
            "tenant_flags_repaired": 0,
            "overslept_lanes_woken": 0,
            # Every run needs nothing a worker lacks: no lane is ever unserved.
            "lanes_marked_unserved": 0,
            "lanes_served_again": 0,
            "rows_failed": 0,
        }
        for h in overlong:
            event(f"reconcile timeout: {self.attempt_ended(h, Reason.TIMEOUT, None)}")
        if dead:
            event("reconcile: workers marked dead")

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def audit_is_clean(self) -> None:
        assert self.store.audit() == []

    @invariant()
    def database_agrees_with_model(self) -> None:
        with self.store.engine.connect() as conn:
            db_runs = {r.run_id: r for r in conn.execute(text(
                "SELECT run_id, status, fencing_token, attempt_count, max_attempts, visible_at, "
                "cost_usd FROM runs"))}
            active = {(r.run_id, r.fencing_token): r.lease_expires_at for r in conn.execute(
                text("SELECT run_id, fencing_token, lease_expires_at FROM attempts "
                     "WHERE lease_status = 'ACTIVE'"))}
            n_tasks = conn.execute(text("SELECT COUNT(*) FROM tasks")).scalar_one()
        assert n_tasks == len(self.tasks)
        assert set(db_runs) == set(self.runs)
        for run_id, row in db_runs.items():
            model = self.runs[run_id]
            status = S(row.status)
            assert (status, row.fencing_token, row.attempt_count, row.max_attempts) == (
                model.status, model.fencing_token, model.attempt_count, model.max_attempts
            ), f"run {run_id}: database {tuple(row)} but model {model}"
            if status is S.QUEUED:
                assert row.visible_at == model.visible_at
            assert row.cost_usd == model.cost_usd
            # Model-independent invariants, from what the database said over time.
            seen = self.observed.setdefault(run_id, Observed())
            if seen.statuses and seen.statuses[-1] in TERMINAL:
                assert status is seen.statuses[-1], (
                    f"run {run_id} left terminal {seen.statuses[-1]} for {status}")
            assert row.fencing_token >= seen.max_token, f"run {run_id}: fencing token went back"
            assert model.charged <= row.max_attempts
            if model.token_at_cancel is not None:
                assert row.fencing_token == model.token_at_cancel, (
                    f"run {run_id} was claimed after its task was cancelled")
            if not seen.statuses or seen.statuses[-1] is not status:
                seen.statuses.append(status)
            seen.max_token = row.fencing_token
        believed = {(h.lease.run_id, h.lease.fencing_token): h.expires_at
                    for h in self.held if not h.ended}
        assert active == believed, "the ACTIVE leases differ from the leases workers hold"


# max_examples comes from the profile conftest loads (ci: 300, dev: 60). Database steps
# are slow by Hypothesis's standards, and preconditions reject many drawn rules.
SETTINGS = hsettings(stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class SQLiteStoreMachine(StoreMachine):
    template: ClassVar[Path | None] = None  # a migrated database, copied per example

    def open_database(self) -> str:
        assert self.template is not None, "the sm_sqlite_template fixture did not run"
        fd, name = tempfile.mkstemp(suffix=".db", dir=self.template.parent)
        os.close(fd)
        self.path = Path(name)
        shutil.copyfile(self.template, self.path)
        return f"sqlite:///{self.path}"

    def close_database(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)


class PostgresStoreMachine(StoreMachine):
    database_url: ClassVar[str | None] = None  # created and migrated once per session

    def open_database(self) -> str:
        assert self.database_url is not None, "the sm_postgres_url fixture did not run"
        return self.database_url

    def prepare_database(self) -> None:
        # Empty the tables of the previous example. DELETE, not TRUNCATE: on tables of
        # a few dozen rows TRUNCATE costs 15-130 ms here (new files for every table and
        # index), DELETE under a millisecond; TABLES lists children before parents.
        with self.store.engine.begin() as conn:
            for table in TABLES.split(", "):
                conn.execute(text(f"DELETE FROM {table}"))


@pytest.fixture(scope="session")
def sm_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("state_machine") / "template.db"
    engine = build_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    assert not Path(f"{path}-wal").exists()  # checkpointed: the file alone is the database
    return path


@pytest.fixture(scope="session")
def sm_postgres_url() -> Iterator[str]:
    yield from migrated_pg_database(f"runlane_sm_{RUN_TAG}")


@pytest.mark.xdist_group("state-machine")
class TestStoreStateMachineSQLite(SQLiteStoreMachine.TestCase):  # type: ignore[misc,valid-type]
    settings = SETTINGS

    @pytest.fixture(autouse=True)
    def _database(self, sm_sqlite_template: Path) -> None:
        SQLiteStoreMachine.template = sm_sqlite_template


@pytest.mark.xdist_group("state-machine")
class TestStoreStateMachinePostgres(PostgresStoreMachine.TestCase):  # type: ignore[misc,valid-type]
    settings = SETTINGS

    @pytest.fixture(autouse=True)
    def _database(self, sm_postgres_url: str) -> None:
        PostgresStoreMachine.database_url = sm_postgres_url
