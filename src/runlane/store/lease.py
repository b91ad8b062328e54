"""A lease's writes, each fenced by its token: the heartbeat, the stages, completion
(one run or a batch), failure and release, cost reports, notes, the side-effect
ledger, and cancellation. The SQL is in ``lease_sql``."""

from __future__ import annotations

import functools
import itertools
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection

from runlane.domain.policy import Policy
from runlane.domain.reasons import Reason
from runlane.domain.retry import (
    MAX_FINALIZE_ONLY_ATTEMPTS,
    RetryDecision,
    RetryPolicy,
    RunBudget,
    decide,
    decide_finalize_only,
)
from runlane.domain.states import (
    LEASED,
    TERMINAL,
    WAITING,
    IllegalTransition,
    RunStatus,
    check_path,
)
from runlane.errors import (
    CancelRequested,
    CostLimitExceeded,
    LeaseLost,
    NotFound,
    TransitionRefused,
)
from runlane.observability import metrics
from runlane.store import history, lease_sql, policy_sql, providers_sql, transition_log
from runlane.store.core import CANCEL_CHANNEL, CANCELLING, RECOVERY_MARKERS, StoreCore
from runlane.store.evidence import Ledger
from runlane.store.records import (
    CancelResult,
    Completion,
    HeartbeatResult,
    Lease,
    SideEffect,
    _Snapshot,
)

log = structlog.get_logger("runlane.store")
S = RunStatus


def _count_completions(durations: list[float]) -> None:
    for seconds in durations:
        metrics.attempt_ended("SUCCEEDED")
        metrics.run_ended("SUCCEEDED", seconds)


class LeaseMixin(StoreCore):
    """Heartbeat, completion and the other fenced writes of a lease; cancellation."""

    if TYPE_CHECKING:
        def _add_late_cost(self, conn: Connection, lease: Lease, usd: float) -> bool: ...
        def _add_tenant_spend(self, conn: Connection, tenant: str, usd: float, now: float
                              ) -> None: ...
        def _campaign_ends_written(self, conn: Connection, rows: Sequence[Any],
                                   outcome: str | None) -> None: ...
        def _campaign_runs_ended(
                self, conn: Connection,
                ended: Sequence[tuple[str, str, RunStatus, str | None, str | None]],
                now: float) -> None: ...
        def _check_policy_before_effect(self, conn: Connection, run_id: str, effect: str
                                        ) -> None: ...
        def _finalize_attempts(self, conn: Connection, run_id: str, after: int) -> int: ...
        def _give_back_slots(self, conn: Connection, run_id: str, token: int, raw: Any, *,
                             cleared: bool = False) -> None: ...
        def _give_back_slots_many(self, conn: Connection,
                                  ended: Sequence[tuple[str, int, Any]], *,
                                  cleared: bool = False) -> None: ...
        def _grant_finalize_only(self, conn: Connection, run_id: str, attempt_no: int) -> None: ...
        def _lane_moved(self, conn: Connection, lane_id: int | None, source: RunStatus,
                        target: RunStatus) -> None: ...
        @contextmanager
        def _lane_moves_in_order(self, conn: Connection) -> Iterator[Counter[int]]: ...
        def _ledger(self, conn: Connection, run_id: str) -> Ledger: ...
        def _note(self, conn: Connection, *, run_id: str, status: RunStatus, attempt_no: int,
                  token: int, actor: str, now: float, reason_code: str, message: str) -> None: ...
        def _policy(self, conn: Connection) -> tuple[int, Policy]: ...
        def _release_charge(self, conn: Connection, snap: _Snapshot, message: str | None
                            ) -> tuple[str, str | None]: ...
        def _resolve_dependents(self, conn: Connection, task_id: str, now: float | None
                                ) -> None: ...

    # --- heartbeat ----------------------------------------------------------------

    def heartbeat(self, worker_id: str, leases: Iterable[Lease], *,
                  lease_ttl: float = 60.0) -> HeartbeatResult:
        """Extend all of a worker's leases in one statement; report the lost ones (the
        worker warns: it knows which of them its own attempts have just ended)."""
        held = {lease.run_id: lease for lease in leases}
        if not held:
            return HeartbeatResult()

        def work(conn: Connection) -> HeartbeatResult:
            rows = conn.execute(
                self._q(lease_sql.HEARTBEAT, "run_ids", "lease_keys"),
                {"worker_id": worker_id, "run_ids": list(held),
                 "lease_keys": [f"{lease.run_id} {lease.fencing_token}"
                                for lease in held.values()],
                 "ttl": lease_ttl, "now": self.clock.now()},
            ).all()
            extended: dict[str, float] = {}
            cancel: set[str] = set()
            for r in rows:
                if held[r.run_id].fencing_token != r.fencing_token:
                    continue
                extended[r.run_id] = r.lease_expires_at
                held[r.run_id].expires_at = r.lease_expires_at
                if r.status in CANCELLING:
                    cancel.add(r.run_id)
            lost = frozenset(set(held) - set(extended))
            return HeartbeatResult(extended, frozenset(cancel), lost)

        return self._transaction(work)

    # --- fenced worker writes -----------------------------------------------------

    def _snapshot(self, conn: Connection, run_id: str, token: int, *, lock: bool = True
                  ) -> _Snapshot | None:
        """The run and its attempt of ``token``; the run's row locked unless ``lock``
        is false."""
        statement = lease_sql.RUN_WITH_ATTEMPT if lock else lease_sql.RUN_WITH_ATTEMPT_READ
        row = conn.execute(self._q(statement),
                           {"run_id": run_id, "token": token, "now": self.clock.now()}).first()
        if row is None:
            return None
        return _Snapshot(
            run_id=row.run_id, task_id=row.task_id, status=S(row.status),
            run_token=row.run_token,
            attempt_count=row.attempt_count, charged_attempts=row.charged_attempts,
            max_attempts=row.max_attempts,
            created_at=row.created_at, cost_usd=row.cost_usd, attempt_no=row.attempt_no,
            fencing_token=row.fencing_token, lease_status=row.lease_status,
            lease_expires_at=row.lease_expires_at, now=row.now,
            finalize_only_after=row.finalize_only_after, worker_id=row.worker_id,
        )

    def _refusal(self, conn: Connection, lease: Lease, wanted: RunStatus) -> Exception:
        """Why a fenced write changed nothing: the lease, a cancel, or the state. Read
        without a lock: the write already lost; this only names why."""
        try:
            snap = self._live_snapshot(conn, lease, lock=False)
        except (LeaseLost, CancelRequested) as exc:
            return exc
        return TransitionRefused(f"run {lease.run_id} is {snap.status}; cannot move to {wanted}")

    def advance(self, lease: Lease, stage: RunStatus) -> None:
        """Move the run to a later stage; raises LeaseLost/CancelRequested when refused."""
        self._fenced_path(lease, [stage])

    def complete(self, lease: Lease, *, outcome: str = "succeeded") -> None:
        """The one door to SUCCEEDED: FINALIZING -> SUCCEEDED, lease released. Raises
        why when refused (``LeaseLost``, ``CancelRequested``, ...): ``complete_many``
        of this one lease."""
        done = self.complete_many([lease], outcome=outcome)
        if done.refused:
            raise done.refused[0][1]

    def complete_many(self, leases: Iterable[Lease], *, outcome: str = "succeeded"
                      ) -> Completion:
        """Complete many leases in one transaction, with set-based fenced statements.

        Each run moves from its lease's stage to SUCCEEDED (through FINALIZING unless
        it is there; every path checked against the transition table), compare-and-set
        on its fencing token and on its lease being the run's live one; one event per
        stage hop; its attempt ended (the record of its last hop) and its lease
        released; its concurrency slots given back; runs waiting on its task released.
        A stale, lost or cancelled lease is refused and changes nothing; it never stops
        the others. Returns both lists.
        """
        batch = list(leases)
        refused: dict[int, Exception] = {}
        moves: dict[str, tuple[int, Lease, list[RunStatus]]] = {}
        for i, lease in enumerate(batch):
            path = [S.SUCCEEDED] if lease.stage is S.FINALIZING else [S.FINALIZING, S.SUCCEEDED]
            try:
                check_path([lease.stage], path)
            except IllegalTransition as exc:
                refused[i] = exc
                continue
            if lease.run_id in moves:
                refused[i] = TransitionRefused(
                    f"run {lease.run_id} appears twice in one completion batch")
                continue
            moves[lease.run_id] = (i, lease, path)

        def work(conn: Connection) -> tuple[set[str], dict[int, Exception]]:
            if not moves:
                return set(), {}
            ordered = [moves[run_id][1:] for run_id in sorted(moves)]
            won = {r.run_id: r for r in self._write_completion(conn, ordered, S.SUCCEEDED,
                                                                   outcome)}
            if won and metrics.enabled():
                self._on_commit(conn, functools.partial(_count_completions, [
                    float(r.now) - float(r.created_at) for r in won.values()]))
            # Why the others lost: read, not locked (a run row locked here, after the
            # counters below, deadlocked with a reaper or a cancel ending its attempt).
            lost = {i: self._refusal(conn, lease, path[-1])
                    for run_id, (i, lease, path) in moves.items() if run_id not in won}
            # The lock order: the dependents' run rows, then the counters by scope,
            # then every lane (the runs' own, the dependents', the tenants shown again)
            # at the block's end in lane_id order.
            with self._lane_moves_in_order(conn):
                ours = sorted((r.campaign_id, run_id) for run_id, r in won.items()
                              if r.campaign_id)
                if ours and self.is_postgres:  # recorded by COMPLETE_WRITE_PG: the rule
                    self._campaign_ends_written(conn, [won[run_id] for _, run_id in ours],
                                                outcome)
                elif ours:  # campaigns' runs: their stop rules, in this transaction
                    self._campaign_runs_ended(conn, [
                        (run_id, campaign_id, S.SUCCEEDED, None, outcome)
                        for campaign_id, run_id in ours], float(won[ours[0][1]].now))
                for run_id, row in sorted(won.items()):
                    _, lease, path = moves[run_id]
                    self._lane_moved(conn, row.lane_id, lease.stage, path[-1])
                for _, row in sorted(won.items()):
                    if row.has_dependents:
                        self._resolve_dependents(conn, row.task_id, row.now)
                self._give_back_slots_many(conn, [
                    (run_id, moves[run_id][1].fencing_token, row.limit_scopes)
                    for run_id, row in sorted(won.items())], cleared=self.is_postgres)
            return set(won), lost

        completed_ids, lost = self._transaction(work)
        refused.update(lost)
        completed = [moves[run_id][1] for run_id in sorted(
            completed_ids, key=lambda run_id: moves[run_id][0])]
        transition_log.log_completed([(lease, lease.stage, moves[lease.run_id][2])
                                      for lease in completed])
        for lease in completed:
            lease.stage = S.SUCCEEDED
        return Completion(tuple(completed),
                          tuple((batch[i], refused[i]) for i in sorted(refused)))

    def _write_completion(self, conn: Connection,
                          moves: Sequence[tuple[Lease, Sequence[RunStatus]]],
                          target: RunStatus, outcome: str) -> list[Any]:
        """The fenced compare-and-set of every lease's run along its path (checked
        already, ending at ``target``), one event per stage hop of the won runs, their
        attempts ended with their last hop (FINALIZING -> target, store/history.py) and
        leases released: one statement on PostgreSQL
        (COMPLETE_WRITE_PG), three on SQLite. Returns ``(run_id, lane_id, task_id,
        created_at, has_dependents, limit_scopes, now)`` per won run; a lost lease
        changed nothing."""
        leases = [lease for lease, _ in moves]
        params = {**self._lease_batch(leases), "to_status": target.value,
                  "outcome": outcome, "now": self.clock.now()}
        if self.is_postgres:  # the last hop, FINALIZING -> target, on the attempt's row
            hops = [(lease.run_id, a.value, b.value) for lease, path in moves
                    for a, b in itertools.pairwise([lease.stage, *path[:-1]])]
            rows = self._driver_rows(conn, lease_sql.COMPLETE_WRITE_PG, {
                **params, "hop_run_ids": [h[0] for h in hops],
                "hop_from": [h[1] for h in hops], "hop_to": [h[2] for h in hops]})
            # Cannot happen: a won run's lease was its ACTIVE one, and the run is locked.
            if rows and rows[0].attempts_ended != len(rows):
                raise TransitionRefused("a completed run's attempt was not live")
            return rows
        rows = list(conn.execute(self._q(lease_sql.SET_RUN_STATUS_FENCED_MANY), params))
        paths = {lease.run_id: (lease, path) for lease, path in moves}
        won = [(paths[r.run_id], r.now) for r in sorted(rows, key=lambda r: r.run_id)]
        self._record(conn, [
            event for (lease, path), now in won for event in self._hop_events(
                lease.run_id, lease.stage, path[:-1], at=now, actor=lease.worker_id,
                attempt_no=lease.attempt_no, token=lease.fencing_token)])
        if won:
            conn.execute(self._q(lease_sql.END_ATTEMPTS), [
                {"status": "SUCCEEDED", "reason_code": None, "message": None,
                 "retry_after_seconds": None, "lease_status": "RELEASED", "now": now,
                 "run_id": lease.run_id, "token": lease.fencing_token}
                for (lease, _), now in won])
            first = history.reserve(conn, len(won))  # after the hops' events: later ids
            conn.execute(self._q(history.END_HOP["sqlite"]), [
                {"run_id": lease.run_id, "token": lease.fencing_token, "seq": first + i,
                 "from_status": S.FINALIZING.value, "to_status": target.value,
                 "actor": lease.worker_id, "reason_code": None, "message": None}
                for i, ((lease, _), _now) in enumerate(won)])
        return rows

    def _lease_batch(self, leases: Sequence[Lease]) -> dict[str, Any]:
        """The parameters of ``dialect_sql.LEASE_BATCH``: PostgreSQL arrays, SQLite JSON."""
        if self.is_postgres:
            return {"run_ids": [lease.run_id for lease in leases],
                    "tokens": [lease.fencing_token for lease in leases],
                    "sources": [lease.stage.value for lease in leases],
                    "attempt_nos": [lease.attempt_no for lease in leases],
                    "actors": [lease.worker_id for lease in leases]}
        return {"leases": json.dumps([[lease.run_id, lease.fencing_token, lease.stage.value,
                                       lease.attempt_no, lease.worker_id]
                                      for lease in leases])}

    def _fenced_path(self, lease: Lease, path: list[RunStatus]) -> None:
        self._fenced_path_from(lease, lease.stage, path)

    def report_cost(self, lease: Lease, usd: float, *, input_tokens: int = 0,
                    output_tokens: int = 0) -> None:
        """Add an agent's cost to its attempt, its run and its tenant's day. Once the
        lease is no longer live the money was spent all the same: it is recorded as
        the attempt's late cost (``report_late_cost``), and LeaseLost is raised."""
        def work(conn: Connection) -> float | None:
            params = {"run_id": lease.run_id, "token": lease.fencing_token, "usd": usd,
                      "input_tokens": input_tokens, "output_tokens": output_tokens,
                      "now": self.clock.now()}
            if conn.execute(self._q(lease_sql.ADD_ATTEMPT_COST), params).rowcount != 1:
                self._add_late_cost(conn, lease, usd)
                return None
            row = conn.execute(self._q(lease_sql.ADD_RUN_COST), params).one()
            self._add_tenant_spend(conn, lease.tenant, usd, float(row.now))
            if maximum is not None and float(row.cost_usd) > float(maximum):
                self._mark_cost_exceeded(conn, lease, float(row.now))
            budget = self._token_budgets.get(row.provider) if row.provider else None
            if budget is not None and input_tokens + output_tokens > 0:
                self._count_provider_tokens(conn, lease, row.provider, budget,
                                            input_tokens + output_tokens, float(row.now))
            return float(row.cost_usd)

        maximum = lease.limits.get("max_cost_usd")
        total = self._transaction(work)
        if total is None:
            raise LeaseLost(f"run {lease.run_id}: lease with token {lease.fencing_token} "
                            "is no longer live; its cost was recorded as late cost")
        if maximum is not None and total > float(maximum):
            raise CostLimitExceeded(
                f"max_cost_usd {maximum} exceeded: run {lease.run_id} has cost ${total:.4f}")
        self._check_token_limits(lease)

    def _mark_cost_exceeded(self, conn: Connection, lease: Lease, now: float | None) -> None:
        """``cost_exceeded_at`` on the run and on this attempt: the first crossing, one
        time for both (read first when unknown: the database clock moves between two
        statements)."""
        params = {"run_id": lease.run_id, "token": lease.fencing_token,
                  "now": self._now(conn) if now is None else now}
        conn.execute(self._q(lease_sql.MARK_COST_EXCEEDED_RUN), params)
        conn.execute(self._q(lease_sql.MARK_COST_EXCEEDED_ATTEMPT), params)
    def _count_provider_tokens(self, conn: Connection, lease: Lease, provider: str,
                               budget: int, tokens: int, now: float) -> None:
        """Count a report's tokens in its provider's minute; the report that reaches the
        provider's tokens per minute pauses it until that minute ends (claims skip its
        runs, every tenant's: claim_sql.with_provider_pauses)."""
        window = float(int(now // 60) * 60)
        conn.execute(self._q(providers_sql.PROVIDER_TOKENS[self.dialect]), {
            "provider": provider, "tokens": tokens, "budget": budget, "now": now,
            "window_start": window, "window_end": window + 60.0, "run_id": lease.run_id})

    def _check_token_limits(self, lease: Lease) -> None:
        """The run's model tokens against its limits: like its cost, summed over all its
        attempts (a retry does not start the count again). Raises CostLimitExceeded."""
        limits = {kind: lease.limits.get(f"max_model_{kind}_tokens")
                  for kind in ("input", "output")}
        if all(v is None for v in limits.values()):
            return
        used = self._transaction(lambda conn: conn.execute(
            self._q(lease_sql.RUN_TOKENS), {"run_id": lease.run_id}).one(), autocommit=True)
        for kind, maximum in limits.items():
            total = int(getattr(used, f"{kind}_tokens"))
            if maximum is not None and total > int(maximum):
                self._transaction(lambda conn: self._mark_cost_exceeded(
                    conn, lease, self.clock.now()))
                raise CostLimitExceeded(f"max_model_{kind}_tokens {maximum} exceeded: run "
                                        f"{lease.run_id} has used {total} {kind} tokens")

    def fail(self, lease: Lease, reason: str, *, message: str | None = None,
             retry_after_seconds: float | None = None) -> RunStatus:
        """End the attempt with a reason; requeue with backoff or fail the run."""
        return self._end_own_attempt(lease, reason, message, retry_after_seconds)

    def release(self, lease: Lease, *, message: str = "released by a draining worker"
                ) -> RunStatus:
        """Give a lease back without blame (drain): the run is requeued at once."""
        return self._end_own_attempt(lease, Reason.LEASE_RELEASED, message, None)

    def _end_own_attempt(self, lease: Lease, reason: str, message: str | None,
                         retry_after: float | None) -> RunStatus:
        def work(conn: Connection) -> RunStatus:
            snap = self._snapshot(conn, lease.run_id, lease.fencing_token)
            if snap is None or not snap.lease_live:
                raise LeaseLost(f"run {lease.run_id}: lease with token "
                                f"{lease.fencing_token} is no longer live")
            reason_, message_ = reason, message
            if reason == Reason.LEASE_RELEASED:
                reason_, message_ = self._release_charge(conn, snap, message)
            return self._end_attempt(conn, snap, reason_, actor=lease.worker_id,
                                     lease_status="RELEASED", message=message_,
                                     retry_after=retry_after)

        status = self._transaction(work)
        lease.stage = status
        return status

    def acknowledge_cancel(self, lease: Lease) -> None:
        """The worker has seen CANCEL_REQUESTED and is stopping: CANCELLING."""
        self._fenced_path_from(lease, S.CANCEL_REQUESTED, [S.CANCELLING])

    def finish_cancel(self, lease: Lease) -> None:
        """The worker has stopped: CANCELLED, its attempt ended, its lease released."""
        def work(conn: Connection) -> None:
            snap = self._snapshot(conn, lease.run_id, lease.fencing_token)
            if snap is None or not snap.lease_live:
                raise LeaseLost(f"run {lease.run_id}: lease no longer live")
            if snap.status not in CANCELLING:
                raise TransitionRefused(f"run {lease.run_id} is {snap.status}, not cancelling")
            self._end_attempt(conn, snap, Reason.CANCELLED_BY_USER, actor=lease.worker_id,
                              lease_status="RELEASED", message="cancelled by user")

        self._transaction(work)
        lease.stage = S.CANCELLED

    def _fenced_path_from(self, lease: Lease, source: RunStatus, path: list[RunStatus]) -> None:
        def work(conn: Connection) -> None:
            won = self._set_status(
                conn, run_id=lease.run_id, source=source, path=path,
                run_token=lease.fencing_token, actor=lease.worker_id, now=self.clock.now(),
                fenced=True, attempt_no=lease.attempt_no, worker_id=lease.worker_id,
            )
            if not won:
                raise self._refusal(conn, lease, path[-1])

        self._transaction(work)
        lease.stage = path[-1]

    def _end_attempt(self, conn: Connection, snap: _Snapshot, reason: str, *, actor: str,
                     lease_status: str, message: str | None = None,
                     retry_after: float | None = None) -> RunStatus:
        """End one attempt and decide its run's next state. The single code path for
        worker failures, drains, the reaper and the reconciler's repairs."""
        now = snap.now
        status = snap.status
        current_lease = snap.run_token == snap.fencing_token
        attempt_status = "FAILED"
        path: list[RunStatus] = []
        run_reason: str | None = reason
        run_message = message
        outcome: str | None = None
        visible_at: float | None = None
        ledger: Ledger | None = None  # the run's push and pull request, when they matter
        if current_lease and reason != Reason.POLICY_DENIED and (
                status in LEASED or status in RECOVERY_MARKERS):
            ledger = self._ledger(conn, snap.run_id)
        recorded_pr = ledger.recorded_pull_request if ledger and status in LEASED else None
        if not current_lease or status in TERMINAL or status in WAITING:
            path = []  # an old lease of a run that has moved on: only the lease ends
        elif status in CANCELLING:
            path, attempt_status, run_reason = [S.CANCELLED], "CANCELLED", Reason.CANCELLED_BY_USER
        elif reason == Reason.POLICY_DENIED and status in LEASED:
            path = [S.POLICY_DENIED]  # the policy now forbids this run: never retried
        elif recorded_pr is not None:
            # The run's pull request is recorded: all that is left is the completion
            # write (what Finalizer.resume would do, with no agent and no attempt).
            # Completed here, never failed nor retried, whatever the budget: a run whose
            # pull request is open must not end FAILED, nor open a second one. The
            # run's reason_code stays that of its last failure (this attempt's), the
            # event's message says why it succeeded anyway.
            path = [S.SUCCEEDED] if status is S.FINALIZING else [S.FINALIZING, S.SUCCEEDED]
            outcome = "pull_request"
            run_message = (f"completed from the recorded pull request "
                           f"{recorded_pr.get('url') or recorded_pr.get('number')}: attempt "
                           f"{snap.attempt_no} ended {reason} after it was recorded"
                           f"{f' ({message})' if message else ''}")
        elif status in LEASED or status in RECOVERY_MARKERS:
            # A run left in a marker state (a write applied halfway, a manual fix) is
            # taken on from where it stands: from FAILED_RETRYABLE the next hop.
            recovered = lease_status in ("EXPIRED", "REVOKED") and status in LEASED
            prefix = [S.STALE_LEASE] if recovered else []
            retry_policy, provider = self._run_retry_policy(conn, snap.run_id)
            if (reason == Reason.PROVIDER_RATE_LIMIT and retry_after is not None
                    and provider is not None):
                # One pause for the provider, not one per run: every tenant's runs of
                # it wait (claims skip them) until the retry-after is over.
                conn.execute(self._q(providers_sql.PROVIDER_PAUSE), {
                    "provider": provider, "until": now + float(retry_after),
                    "run_id": snap.run_id, "now": now})
            decision = None if snap.finalize_only_after is not None else decide(
                reason,
                RunBudget(snap.charged_attempts, snap.max_attempts, now - snap.created_at,
                          snap.cost_usd),
                retry_policy, retry_after, self.rng,
            )
            if decision is None or (not decision.retry and ledger is not None
                                    and ledger.begun):
                decision, note = self._finalize_only_decision(conn, snap, reason,
                                                              retry_policy, retry_after)
                run_message = note + (f" ({message})" if message else "")
            if decision.retry:
                path = [*prefix, S.FAILED_RETRYABLE, S.QUEUED]
                if status is S.FAILED_RETRYABLE:
                    path = [S.QUEUED]
                visible_at = now + decision.delay_seconds
            else:
                path = [*prefix, S.FAILED]
                run_reason = decision.final_reason or reason
        ended = conn.execute(
            self._q(lease_sql.END_ATTEMPT[self.dialect]),
            {"status": attempt_status, "reason_code": reason, "message": message,
             "retry_after_seconds": retry_after, "lease_status": lease_status, "now": now,
             "run_id": snap.run_id, "token": snap.fencing_token},
        ).first()
        if ended is not None:  # this write ended the attempt
            self._on_commit(conn, functools.partial(metrics.attempt_ended, reason))
        cleared = self.is_postgres
        if ended is None and snap.lease_status == "ACTIVE":
            # The attempt row was ended without its lease: end the lease, or the run
            # moves on with it still ACTIVE.
            ended, cleared = conn.execute(self._q(lease_sql.END_LEASE), {
                "lease_status": lease_status, "now": now, "run_id": snap.run_id,
                "token": snap.fencing_token}).first(), False
        held = ended[0] if ended is not None else None
        if path and path[-1] is S.QUEUED:  # another attempt of the run: a retry
            self._on_commit(conn, functools.partial(metrics.retried, reason))
        # The lock order: the run (locked by the caller's snapshot) and, when it ends,
        # the runs waiting for its task; then its counters; then the lanes (its own, the
        # dependents', its tenant's shown again) at the block's end in lane_id order.
        # Counters first marked the tenant's lanes before the dependents were locked.
        with self._lane_moves_in_order(conn):
            won = not path or self._set_status(
                conn, run_id=snap.run_id, source=status, path=path, run_token=snap.run_token,
                actor=actor, now=now, attempt_no=snap.attempt_no, reason_code=run_reason,
                message=run_message, outcome=outcome, visible_at=visible_at,
                worker_id=snap.worker_id, ends_attempt=True,
            )
            self._give_back_slots(conn, snap.run_id, snap.fencing_token, held,
                                  cleared=cleared)
        if path:
            if not won:  # cannot happen under the row lock; refuse loudly rather than guess
                raise TransitionRefused(f"run {snap.run_id} changed while locked")
            log.info("attempt_ended", task_id=snap.task_id, run_id=snap.run_id,
                     attempt_id=f"{snap.run_id}/{snap.attempt_no}",
                     fencing_token=snap.fencing_token, worker_id=actor, reason_code=reason,
                     status=path[-1].value)
            return path[-1]
        return status

    def _run_retry_policy(self, conn: Connection, run_id: str
                          ) -> tuple[RetryPolicy, str | None]:
        """The settings' retry policy with the run's recorded retry rules over it (the
        policy's ``[retry]`` layers for its tenant and queue, as admitted), and the
        run's provider. A run admitted before rules were recorded: the policy in
        force's ``[retry]``."""
        row = conn.execute(self._q(policy_sql.RUN_ADMISSION), {"run_id": run_id}).one()
        record = json.loads(row.admission) if isinstance(row.admission, str) \
            else row.admission
        if isinstance(record, dict) and isinstance(record.get("retry"), dict):
            return self.retry_policy.with_rules(record["retry"]), row.provider
        _, policy = self._policy(conn)
        return policy.retry_policy(self.retry_policy), row.provider

    def _finalize_only_decision(self, conn: Connection, snap: _Snapshot, reason: str,
                                policy: RetryPolicy, retry_after: float | None
                                ) -> tuple[RetryDecision, str]:
        """The decision for the last attempt of a run whose push or pull request was
        begun (or for a finalize-only attempt): another finalize-only attempt, outside
        the attempt budget and at most MAX_FINALIZE_ONLY_ATTEMPTS of them, or the end.
        Returns it with the note the run's events carry (store/evidence.py)."""
        first = snap.finalize_only_after is None
        ended = 0 if first else self._finalize_attempts(
            conn, snap.run_id, int(snap.finalize_only_after or 0))
        decision = decide_finalize_only(reason, ended, policy, retry_after, self.rng)
        cap = MAX_FINALIZE_ONLY_ATTEMPTS
        if decision.retry:
            if first:
                self._grant_finalize_only(conn, snap.run_id, snap.attempt_no)
            why = ("given back by a draining worker" if reason == Reason.LEASE_RELEASED
                   else f"{ended + 1} of at most {cap}")
            return decision, (
                f"finalize-only attempt {snap.attempt_count + 1} ({why}), outside the "
                f"attempt budget: attempt {snap.attempt_no} ended {reason} after the run's "
                "push or pull request was begun; it records them and never runs the agent")
        if reason == Reason.NOTHING_TO_FINALIZE:
            return decision, (f"finalize-only attempt {snap.attempt_no} found neither the "
                              "run's branch nor its pull request: nothing to record")
        return decision, (f"{ended} finalize-only attempt(s) ended without recording the "
                          f"run's pull request (at most {cap}); a worker closes it if it "
                          "is open and records what it finds")

    # --- side-effect ledger -----------------------------------------------------------

    def _live_snapshot(self, conn: Connection, lease: Lease, *, lock: bool = True
                       ) -> _Snapshot:
        snap = self._snapshot(conn, lease.run_id, lease.fencing_token, lock=lock)
        if snap is None or not snap.lease_live:
            raise LeaseLost(f"run {lease.run_id}: lease with token {lease.fencing_token} "
                            "is no longer live")
        if snap.status in CANCELLING:
            raise CancelRequested(f"run {lease.run_id} is {snap.status}")
        return snap

    def check_lease(self, lease: Lease) -> None:
        """Raise LeaseLost or CancelRequested unless the lease is live and the run is not
        being cancelled: the check before every irreversible step."""
        self._transaction(lambda conn: self._live_snapshot(conn, lease))

    def lease_remaining(self, lease: Lease) -> float:
        """``check_lease``, and the seconds the lease has left by the database's clock:
        what a call that touches the world may take at most."""
        snap = self._transaction(lambda conn: self._live_snapshot(conn, lease))
        return float(snap.lease_expires_at - snap.now)

    def note(self, lease: Lease, reason_code: str, message: str) -> None:
        """Record a note on the lease's run: an event from its status to the same status
        (``STALE_PUSH_REPLACED``), written only while the lease is live."""
        def work(conn: Connection) -> None:
            snap = self._snapshot(conn, lease.run_id, lease.fencing_token)
            if snap is None or not snap.lease_live:
                raise LeaseLost(f"run {lease.run_id}: note refused, lease not live")
            self._note(conn, run_id=lease.run_id, status=snap.status,
                       attempt_no=lease.attempt_no, token=lease.fencing_token,
                       actor=lease.worker_id, now=snap.now, reason_code=reason_code,
                       message=message)

        self._transaction(work)

    def effect_intent(self, lease: Lease, key: str, *,
                      intent: dict[str, Any] | None = None) -> SideEffect:
        """Record the intent to perform effect ``key`` under this lease, or return the
        effect as already recorded (DONE by any lease). Refused when the lease is not
        live or the run is being cancelled: no new side effect after a cancel.

        ``intent``: what is about to be done (the push's commit), kept in the INTENT
        row's ``result`` until the result replaces it; a newer lease taking the intent
        over without one keeps the earlier lease's."""
        def work(conn: Connection) -> SideEffect:
            snap = self._live_snapshot(conn, lease)
            self._check_policy_before_effect(conn, lease.run_id, key)
            params = {"run_id": lease.run_id, "effect_key": key, "token": lease.fencing_token,
                      "attempt_no": lease.attempt_no, "now": snap.now,
                      "intent": json.dumps(intent) if intent is not None else None}
            conn.execute(self._q(lease_sql.EFFECT_INTENT_INSERT), params)
            return self._effect(conn, lease.run_id, key)

        return self._transaction(work)

    def effect_done(self, lease: Lease, key: str, result: dict[str, Any]) -> None:
        """Record an effect's result; only the lease that holds the intent may."""
        def work(conn: Connection) -> None:
            snap = self._snapshot(conn, lease.run_id, lease.fencing_token)
            if snap is None or not snap.lease_live:
                raise LeaseLost(f"run {lease.run_id}: effect {key} done after losing the lease")
            done = conn.execute(self._q(lease_sql.EFFECT_DONE), {
                "run_id": lease.run_id, "effect_key": key, "token": lease.fencing_token,
                "result": json.dumps(result), "now": snap.now}).rowcount
            if done != 1:
                raise LeaseLost(f"run {lease.run_id}: effect {key} is not this lease's intent")
            log.info("side_effect_done", run_id=lease.run_id, attempt_id=lease.attempt_id,
                     fencing_token=lease.fencing_token, worker_id=lease.worker_id,
                     effect=key, result=result)

        self._transaction(work)

    def _effect(self, conn: Connection, run_id: str, key: str) -> SideEffect:
        row = conn.execute(self._q(lease_sql.EFFECT_GET),
                           {"run_id": run_id, "effect_key": key}).one()
        result = row.result
        if isinstance(result, str):
            result = json.loads(result)
        return SideEffect(row.run_id, row.effect_key, row.status, row.attempt_no,
                          row.fencing_token, result)

    # --- cancellation -------------------------------------------------------------

    def cancel(self, task_id: str, *, actor: str = "user",
               reason_code: Reason = Reason.CANCELLED_BY_USER,
               message: str = "cancelled by user") -> CancelResult:
        """Cancel a task: waiting runs end CANCELLED now; leased runs get
        CANCEL_REQUESTED, delivered to their worker by NOTIFY and the next heartbeat.

        The lanes its runs leave are written last (``_lane_moves_in_order``): after the
        rows of the runs waiting for the task, which a cancelled dependency cancels too.
        Written at once, a lane came before those rows: a wait cycle with a completion
        of another of their dependencies (``tests/test_lock_order.py``)."""
        def work(conn: Connection) -> CancelResult:
            if conn.execute(self._q(lease_sql.MARK_TASK_CANCELLED),
                            {"task_id": task_id, "now": self.clock.now()}).first() is None:
                raise NotFound(f"no task {task_id!r}")
            with self._lane_moves_in_order(conn):
                return cancel_runs(conn)

        def cancel_runs(conn: Connection) -> CancelResult:
            outcome: dict[str, str] = {}
            for r in conn.execute(self._q(lease_sql.RUNS_OF_TASK),
                                  {"task_id": task_id, "now": self.clock.now()}).all():
                status = S(r.status)
                target: RunStatus | None = None
                if status in WAITING:
                    target = S.CANCELLED
                elif status in LEASED:
                    target = S.CANCEL_REQUESTED
                if target is not None and self._set_status(
                    conn, run_id=r.run_id, source=status, path=[target],
                    run_token=r.fencing_token, actor=actor, now=r.now,
                    reason_code=reason_code, message=message,
                ):
                    status = target
                    if target is S.CANCEL_REQUESTED:
                        self._notify(conn, CANCEL_CHANNEL, r.run_id)
                outcome[r.run_id] = status.value
            return CancelResult(task_id, outcome)

        result = self._transaction(work)
        log.info("cancel_requested", task_id=task_id, runs=result.runs)
        return result
