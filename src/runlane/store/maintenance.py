"""The store's maintenance helpers (a mixin of ``Store``): every row of a maintenance
pass in a transaction of its own, told apart from a database that is gone; the late
cost of a lost lease; the charge of a release past the run's cap. Their statements are
in ``maintenance_sql``; the passes themselves are ``Store.reap_expired_batch`` and
``Store.reconcile``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from runlane.clock import Clock
from runlane.domain.reasons import Reason
from runlane.store import maintenance_sql as msql

if TYPE_CHECKING:
    from runlane.store.records import Lease, _Snapshot

log = structlog.get_logger("runlane.store")
T = TypeVar("T")

# What an attempt of a run with a wall-clock limit may take beyond it before the
# reconciler times it out: the limit covers the agent and verify, not the clone,
# commit, push and pull request around them (each bounded by its own timeout, up to
# 300 s). A run without a limit is bounded by MAX_ATTEMPT_SECONDS alone.
WALL_CLOCK_MARGIN_SECONDS = 1800.0


def session_lost(exc: BaseException) -> bool:
    """``exc`` says the database session itself went away (the server restarted, the
    backend was terminated, the connection broke): SQLAlchemy invalidated the
    connection. Never the fault of the row being worked on."""
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


@dataclass(frozen=True)
class ReapBatch:
    """One page of the reaper's walk over expired leases."""

    listed: int
    reaped: int
    failed: int  # leases whose recovery raised: logged, passed over, tried next pass
    last: tuple[float, str] | None  # (expiry, run id) of the last listed: walk on after it


class MaintenanceMixin:
    if TYPE_CHECKING:
        clock: Clock
        max_uncharged_releases: int

        def _q(self, statement: str, *expanding: str) -> Any: ...
        def _transaction(self, work: Callable[[Connection], T], *,
                         autocommit: bool = False) -> T: ...
        def _add_tenant_spend(self, conn: Connection, tenant: str, usd: float,
                              now: float) -> None: ...

    # --- one row at a time ------------------------------------------------------------

    def _isolated(self, service: str, row: Any, work: Callable[[Connection], bool]
                  ) -> bool | None:
        """``work`` on one maintenance row, in a transaction of its own: what it returns,
        or None when it raised (rolled back; logged with the row's run and token). A
        row that cannot be processed (a status this runlane does not know, a value its
        statement cannot read, a bug) must not stop the rest of a pass. When the
        database itself is gone (a ping fails too), or the row's session was (a
        PostgreSQL restart, ``pg_terminate_backend``: SQLAlchemy saw the connection
        drop, see :func:`session_lost`), that is not the row's doing: the error is
        raised, it ends the pass, and the next pass tries again. (Without a dropped
        connection the error's class cannot tell: SQLite reports malformed JSON in a
        row as an OperationalError, as it does a locked file.)"""
        try:
            return self._transaction(work)
        except Exception as exc:
            if session_lost(exc) or (isinstance(exc, DBAPIError)
                                     and not self._database_answers()):
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            log.error("maintenance_row_failed", service=service, run_id=row.run_id,
                      fencing_token=getattr(row, "fencing_token", None),
                      error=f"{type(exc).__name__}: {first}")
            return None

    def _database_answers(self) -> bool:
        try:
            self._transaction(lambda conn: conn.execute(self._q(msql.PING)).scalar())
        except DBAPIError:
            return False
        return True

    # --- late cost --------------------------------------------------------------------

    def report_late_cost(self, lease: Lease, usd: float) -> bool:
        """Cost reported after the lease was lost (the agent ran on until it was
        stopped): added to the attempt's ``late_cost_usd`` (the attempt of the lease's
        fencing token) and to the tenant's spend of the day, which admission checks
        against its daily budget. Nothing about the run changes (its status, lease and
        ``cost_usd`` are its live attempts'). One transaction, one statement and the
        spend's upsert. False when the run has no such attempt (pruned)."""
        return self._transaction(lambda conn: self._add_late_cost(conn, lease, usd))

    def _add_late_cost(self, conn: Connection, lease: Lease, usd: float) -> bool:
        if not usd:
            return True
        row = conn.execute(self._q(msql.ADD_ATTEMPT_LATE_COST), {
            "run_id": lease.run_id, "token": lease.fencing_token, "usd": usd,
            "now": self.clock.now()}).first()
        if row is None:
            log.warning("late_cost_without_attempt", run_id=lease.run_id,
                        fencing_token=lease.fencing_token, usd=usd)
            return False
        self._add_tenant_spend(conn, lease.tenant, usd, float(row.now))
        log.info("late_cost_recorded", run_id=lease.run_id, tenant=lease.tenant,
                 fencing_token=lease.fencing_token, usd=usd)
        return True

    # --- uncharged releases -----------------------------------------------------------

    def _release_charge(self, conn: Connection, snap: _Snapshot, message: str | None
                        ) -> tuple[str, str | None]:
        """How a release ends its attempt: uncharged (LEASE_RELEASED) while the run has
        been released fewer than ``max_uncharged_releases`` times without charge, else
        charged (LEASE_RELEASED_OVER_CAP), so that a run re-claimed and given back again
        and again (seed 004's pickup count) ends within its attempts. Counted under
        the run's lock (the caller's snapshot)."""
        released = int(conn.execute(self._q(msql.UNCHARGED_RELEASES),
                                    {"run_id": snap.run_id}).scalar_one())
        if released < self.max_uncharged_releases:
            return Reason.LEASE_RELEASED, message
        log.warning("release_charged", run_id=snap.run_id, attempt_no=snap.attempt_no,
                    uncharged_releases=released, cap=self.max_uncharged_releases)
        return Reason.LEASE_RELEASED_OVER_CAP, (
            f"{message or 'released'}; charged: the run was already released {released} "
            f"time(s) without charge (MAX_UNCHARGED_RELEASES {self.max_uncharged_releases})")
