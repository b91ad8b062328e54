"""The reaper and the reconciler's repairs (``Store.reap_expired_batch``,
``Store.reconcile``); the services that run them are in ``runlane.services``. The SQL
is in ``maintenance_sql`` and ``recount_sql``."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection, text

from runlane.domain.reasons import Reason
from runlane.domain.states import LEASED, TERMINAL, WAITING, RunStatus
from runlane.observability import metrics
from runlane.store import lanes_sql, recount_sql
from runlane.store import maintenance_sql as msql
from runlane.store.core import CANCELLING, FREED_SCOPES, RECOVERY_MARKERS, WAKEUP_CHANNEL, StoreCore
from runlane.store.lanes import BLOCKED_LANE_RECHECK_SECONDS, JOIN_AHEAD
from runlane.store.maintenance import WALL_CLOCK_MARGIN_SECONDS, ReapBatch
from runlane.store.records import _Snapshot

log = structlog.get_logger("runlane.store")
S = RunStatus

# The states in which a run without a live lease is stuck (repair 4).
RECOVERABLE = LEASED | CANCELLING | RECOVERY_MARKERS
class RepairsMixin(StoreCore):
    """The reaper and the reconciler."""

    if TYPE_CHECKING:
        def _end_attempt(self, conn: Connection, snap: _Snapshot, reason: str, *, actor: str,
                         lease_status: str, message: str | None = None,
                         retry_after: float | None = None) -> RunStatus: ...
        def _give_back_slots(self, conn: Connection, run_id: str, token: int, raw: Any, *,
                             cleared: bool = False) -> None: ...
        def _held_slots(self, conn: Connection) -> Counter[str]: ...
        def _isolated(self, service: str, row: Any, work: Callable[[Connection], bool]
                      ) -> bool | None: ...
        def _mark_unserved_lanes(self, conn: Connection) -> dict[str, int]: ...
        def _snapshot(self, conn: Connection, run_id: str, token: int, *, lock: bool = True
                      ) -> _Snapshot | None: ...

    # --- maintenance: reaper and reconciler -----------------------------------------

    def reap_expired_leases(self, *, limit: int = 100) -> int:
        """Expire up to ``limit`` leases past their expiry and recover their runs: how
        many this call recovered (:meth:`reap_expired_batch`)."""
        return self.reap_expired_batch(limit=limit).reaped

    def reap_expired_batch(self, *, limit: int = 100,
                           after: tuple[float, str] = msql.FIRST_KEY) -> ReapBatch:
        """Expire leases past their expiry (database clock) and recover their runs: one
        page of the reaper's walk, the leases past ``after`` (expiry, run id), oldest
        first. A batch listed full may have more behind it even when another reaper
        took all of it (reaped 0): the walk goes on from ``ReapBatch.last``.

        One short transaction lists the expired leases; then each is ended in its own
        transaction, which locks that run (and attempt) first, then its limit counters,
        then its lane: the order every writer keeps. Ending several in one transaction
        would lock lanes in expiry order and deadlock with claims and the reconciler.
        A run requeued here wakes an idle worker of its queue (NOTIFY), as a submit does.
        A lease whose run another transaction holds is left to the next pass.
        A lease whose recovery raises is logged with its run and token, counted
        (``failed``) and passed over (``_isolated``): the walk goes on past it, and the
        next pass, which starts from the oldest again, tries it again.
        """
        expired = self._transaction(lambda conn: conn.execute(
            self._q(msql.EXPIRED_LEASES), {"limit": limit, "now": self.clock.now(),
                                           "after_at": after[0], "after_id": after[1]}).all())

        def reap_one(conn: Connection, run_id: str, token: int, worker_id: str) -> bool:
            queue = conn.execute(self._q(msql.REAP_LOCK), {"run_id": run_id, "token": token}
                                 ).scalar()
            if queue is None:
                return False  # held by a claim, a heartbeat or another reaper: next pass
            snap = self._snapshot(conn, run_id, token)
            if snap is None or snap.lease_status != "ACTIVE" or \
                    snap.lease_expires_at > snap.now:
                return False  # extended or ended meanwhile
            status = self._end_attempt(conn, snap, Reason.WORKER_LOST, actor="reaper",
                                       lease_status="EXPIRED",
                                       message=f"lease of worker {worker_id} expired")
            self._on_commit(conn, functools.partial(metrics.leases_expired, 1))
            if status is S.QUEUED:
                self._notify(conn, WAKEUP_CHANNEL, queue)
            return True

        reaped = failed = 0
        for r in expired:
            done = self._isolated("reaper", r, functools.partial(
                reap_one, run_id=r.run_id, token=r.fencing_token, worker_id=r.worker_id))
            reaped += bool(done)
            failed += done is None
        last = (float(expired[-1].lease_expires_at), str(expired[-1].run_id)) if expired \
            else None
        return ReapBatch(len(expired), reaped, failed, last)

    def reconcile(self, *, admitted_grace: float = 60.0, active_grace: float = 60.0,
                  worker_grace: float = 180.0, max_attempt_seconds: float = 7200.0,
                  wall_clock_margin: float = WALL_CLOCK_MARGIN_SECONDS,
                  limit: int = 100, max_pages: int = 50) -> dict[str, int]:
        """The six conservative repairs of seed 000 §25, each recorded with a reason.

        The candidates are listed first (``SKIP LOCKED``: rows a worker holds are left
        for the next pass); then each repaired run is a transaction of its own, which
        takes that run's rows, its counters, then its lane, in the order every writer
        keeps, and checks again that the run still needs the repair (compare-and-set).
        In one transaction, a repaired run's lane came before the next run's counters
        and the recount's (repair 7): a wait cycle with a claim
        (``tests/test_lock_order.py``).

        Each repair's candidates are walked with a keyset (``maintenance_sql``),
        ``limit`` at a time and at most ``max_pages`` pages a pass: every repair's first
        page in one transaction, then the next page of each whose page came back full.
        A candidate whose repair raises is logged, counted (``rows_failed``) and passed
        over (``_isolated``); the next pass tries it again.

        Repair 6 bounds an attempt by its run's own wall-clock limit
        (``max_wall_clock_minutes`` in its limits snapshot) plus ``wall_clock_margin``,
        and by ``max_attempt_seconds`` only when the run has no such limit: a lease
        heartbeating within its run's limit is never revoked."""
        listings: dict[str, tuple[str, tuple[str, ...], dict[str, Any]]] = {
            "admitted": (msql.ADMITTED_NOT_QUEUED, (), {"grace": admitted_grace}),
            "unleased": (msql.UNLEASED_WITH_LEASE, ("unleased",),
                         {"unleased": [s.value for s in TERMINAL | WAITING]}),
            "cancelled": (msql.QUEUED_OF_CANCELLED_TASK, ("waiting",),
                          {"waiting": [s.value for s in WAITING]}),
            "active": (msql.ACTIVE_WITHOUT_LEASE, ("active",),
                       {"active": [s.value for s in RECOVERABLE], "grace": active_grace}),
            "overlong": (msql.OVERLONG_ATTEMPTS[self.dialect], (),
                         {"max_seconds": max_attempt_seconds, "margin": wall_clock_margin}),
        }

        def listed(conn: Connection, pending: dict[str, tuple[float, str]]
                   ) -> tuple[float, dict[str, list[Any]]]:
            now = self._now(conn)
            pages: dict[str, list[Any]] = {}
            for name, (after_at, after_id) in pending.items():
                statement, expanding, params = listings[name]
                pages[name] = list(conn.execute(self._q(statement, *expanding), {
                    **params, "now": now, "limit": limit, "after_at": after_at,
                    "after_id": after_id}))
            return now, pages

        # The time of the page being repaired (the repairs below read it when called).
        now = 0.0

        # 1. Runs admitted but never queued (a lost enqueue): queue them.
        def requeue(conn: Connection, run_id: str) -> bool:
            return self._set_status(conn, run_id=run_id, source=S.ADMITTED, path=[S.QUEUED],
                                    run_token=self._token(conn, run_id), actor="reconciler",
                                    now=now, reason_code=Reason.RECONCILED_ADMITTED_NOT_QUEUED)

        # 2. Terminal or waiting runs that still hold a live lease: revoke it (a waiting
        # run's would fail every claim of it). True only if this pass revoked it.
        def revoke(conn: Connection, run_id: str, token: int, status: str) -> bool:
            waiting = S(status) in WAITING
            revoked = conn.execute(self._q(msql.REVOKE_LEASE, "unleased"), {
                "now": now, "run_id": run_id, "token": token,
                "unleased": [s.value for s in (WAITING if waiting else TERMINAL)],
                "reason_code": Reason.RECONCILED_WAITING_LEASE if waiting
                else Reason.RECONCILED_TERMINAL_LEASE}).first()
            if revoked is None:
                return False
            self._give_back_slots(conn, run_id, token, revoked[0])
            return True

        # 3. Waiting runs of a cancelled task (the cancel write was lost): cancel them.
        def cancel(conn: Connection, run_id: str) -> bool:
            status = S(conn.execute(text("SELECT status FROM runs WHERE run_id = :r"),
                                    {"r": run_id}).scalar_one())
            return status in WAITING and self._set_status(
                conn, run_id=run_id, source=status, path=[S.CANCELLED],
                run_token=self._token(conn, run_id), actor="reconciler", now=now,
                reason_code=Reason.RECONCILED_CANCELLED_TASK)

        # 4. Runs in a leased, cancelling or recovery-marker state with no live lease
        # at all, and 6. attempts running longer than their bound: their attempt ends.
        # Checked again under the run's lock (a worker may have ended the attempt, or
        # another reconciler repaired the run, since the listing): True only if this
        # pass repaired it.
        def end(conn: Connection, run_id: str, token: int, reason: Reason,
                message: str) -> bool:
            snap = self._snapshot(conn, run_id, token)
            if snap is None:
                return False
            if reason is Reason.TIMEOUT:
                if snap.lease_status != "ACTIVE":
                    return False
            elif (snap.run_token != token or snap.lease_status == "ACTIVE"
                  or snap.status not in RECOVERABLE):
                return False
            self._end_attempt(conn, snap, reason, actor="reconciler",
                              lease_status="REVOKED", message=message)
            return True

        def overlong(r: Any) -> str:
            if r.wall_clock_minutes is None:
                return f"attempt ran over {r.bound_seconds:.0f}s (MAX_ATTEMPT_SECONDS)"
            return (f"attempt ran over {r.bound_seconds:.0f}s: its run's "
                    f"max_wall_clock_minutes {r.wall_clock_minutes:g} plus "
                    f"{wall_clock_margin:.0f}s for clone and finalize")

        # Each candidate: the count it adds to, and its repair.
        def repair_of(name: str, r: Any) -> tuple[str, Callable[[Connection], bool]]:
            if name == "admitted":
                return "admitted_requeued", functools.partial(requeue, run_id=r.run_id)
            if name == "unleased":
                return ("terminal_leases_revoked" if S(r.status) in TERMINAL
                        else "waiting_leases_revoked"), functools.partial(
                    revoke, run_id=r.run_id, token=r.fencing_token, status=r.status)
            if name == "cancelled":
                return "cancelled_task_runs_cancelled", functools.partial(
                    cancel, run_id=r.run_id)
            if name == "active":
                return "active_without_lease_recovered", functools.partial(
                    end, run_id=r.run_id, token=r.fencing_token, reason=Reason.WORKER_LOST,
                    message=Reason.RECONCILED_ACTIVE_WITHOUT_LEASE.value)
            return "overlong_attempts_timed_out", functools.partial(
                end, run_id=r.run_id, token=r.fencing_token, reason=Reason.TIMEOUT,
                message=overlong(r))

        counts: dict[str, int] = dict.fromkeys((
            "admitted_requeued", "terminal_leases_revoked", "waiting_leases_revoked",
            "cancelled_task_runs_cancelled", "active_without_lease_recovered",
            "workers_marked_dead", "overlong_attempts_timed_out"), 0)
        failed = 0
        pending = dict.fromkeys(listings, msql.FIRST_KEY)
        for _ in range(max_pages):
            now, pages = self._transaction(functools.partial(listed, pending=pending))
            for name, rows in pages.items():
                for r in rows:
                    count, work = repair_of(name, r)
                    done = self._isolated(f"reconciler:{name}", r, work)
                    counts[count] += bool(done)
                    failed += done is None
            pending = {name: (float(rows[-1].updated_at) if name == "admitted"
                              else msql.FIRST_KEY[0], str(rows[-1].run_id))
                       for name, rows in pages.items() if len(rows) >= limit}
            if not pending:
                break
        # 5. Workers whose heartbeat stopped: DEAD.
        counts["workers_marked_dead"] = self._transaction(lambda conn: len(conn.execute(
            self._q(msql.STALE_WORKERS), {"now": now, "grace": worker_grace}).all()))
        # 7. The scheduler's bookkeeping, recounted from the truth.
        counts.update(self._transaction(self._repair_scheduling_counts))
        # 8. Lanes of routes no live worker serves leave the virtual time.
        counts.update(self._transaction(self._mark_unserved_lanes))
        counts["rows_failed"] = failed
        if any(counts.values()):
            log.info("reconciled", **counts)
        return counts

    def _token(self, conn: Connection, run_id: str) -> int:
        return int(conn.execute(text("SELECT fencing_token FROM runs WHERE run_id = :r"),
                                {"r": run_id}).scalar_one())

    def _repair_scheduling_counts(self, conn: Connection) -> dict[str, int]:
        """Recount lanes' queued runs and counters' slots, and re-derive the tenant
        flags. Each locks what it recounts first, in the order every writer uses (run
        rows, counters, lanes), so no claim or release is half-way through; lanes
        another transaction holds are skipped (recounted next pass), so the recount
        never waits on a lane."""
        locked_counters = conn.execute(self._q(recount_sql.LOCK_COUNTERS)).all()
        counters = {r.scope: int(r.active) for r in locked_counters}
        maxima = {r.scope: int(r.max_active) for r in locked_counters}
        held = self._held_slots(conn)
        fixed = 0
        for scope, active in counters.items():
            if held[scope] != active:
                conn.execute(self._q(recount_sql.COUNTER_SET), {"scope": scope, "n": held[scope]})
                fixed += 1
                if active >= maxima[scope] > held[scope]:  # drift kept it full: wake
                    conn.info.setdefault(FREED_SCOPES, set()).add(scope)
        locked = set(conn.execute(self._q(recount_sql.LOCK_LANES)).scalars())
        drift = [r for r in conn.execute(self._q(recount_sql.LANE_COUNT_DRIFT))
                 if r.lane_id in locked]
        for r in drift:
            conn.execute(self._q(recount_sql.LANE_SET_COUNT), {"lane_id": r.lane_id, "n": r.actual})
        # Always, not only after a recount: a flag wrong on its own (a tenant shown as
        # full below its limit) hid the tenant's runs from every claim, for good. It
        # writes only the lanes whose flag is wrong.
        flags = conn.execute(self._q(recount_sql.RECOMPUTE_TENANT_FLAGS), {"ahead": JOIN_AHEAD}
                             ).rowcount
        # A lane asleep past its due runs and the recheck hid them from every claim.
        woken = conn.execute(self._q(lanes_sql.WAKE_OVERSLEPT_LANES), {
            "now": self.clock.now(), "recheck": BLOCKED_LANE_RECHECK_SECONDS,
            "ahead": JOIN_AHEAD}).rowcount
        if drift or fixed or flags or woken:
            log.warning("scheduling_counts_repaired", lanes=len(drift), counters=fixed,
                        tenant_flags=flags, lanes_woken=woken)
        return {"lane_counts_repaired": len(drift), "slot_counters_repaired": fixed,
                "tenant_flags_repaired": flags, "overslept_lanes_woken": woken}
