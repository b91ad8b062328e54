"""The store's core, under every mixin of ``Store``: the engine, the rendered
statements, the transaction (retries, after-commit records, the lane wakes of freed
scopes), and the status write every transition goes through (``_set_status``)."""

from __future__ import annotations

import functools
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog
from sqlalchemy import Connection, Engine, Table, event, insert, text
from sqlalchemy.dialects import postgresql as postgresql_dialect
from sqlalchemy.exc import DBAPIError, OperationalError

from runlane.clock import Clock, DatabaseClock
from runlane.domain.policy import Policy
from runlane.domain.reasons import Reason
from runlane.domain.retry import DEFAULT_MAX_UNCHARGED_RELEASES, RetryPolicy
from runlane.domain.states import TERMINAL, RunStatus, check_path
from runlane.domain.tasks import DEFAULT_PAYLOAD_CAP_BYTES
from runlane.observability import metrics
from runlane.store import dialect_sql, history, lease_sql, transition_log
from runlane.store.engine import build_engine, dialect_of
from runlane.store.evidence import ENDED_WITHOUT_SUCCESS
from runlane.store.schema import run_events

log = structlog.get_logger("runlane.store")
S = RunStatus
T = TypeVar("T")

WAKEUP_CHANNEL = "runlane_wakeup"  # payload: queue name
CANCEL_CHANNEL = "runlane_cancel"  # payload: run id
CANCELLING = frozenset({S.CANCEL_REQUESTED, S.CANCELLING})
# Markers a run only passes through inside one write: persisted, no service would
# ever move the run on, so the reconciler's repair 4 takes them on.
RECOVERY_MARKERS = frozenset({S.STALE_LEASE, S.FAILED_RETRYABLE})


_SENT = "runlane_statement_sent"  # conn.info key: [True] once a statement went through
ON_COMMIT = "runlane_on_commit"  # conn.info key: what to record once it commits
# PostgreSQL statements rendered with $n placeholders, for psycopg's RawCursor
# (Store._driver_rows).
_NUMBERED_PG = postgresql_dialect.psycopg.dialect(  # type: ignore[no-untyped-call]
    paramstyle="numeric_dollar")


def _statement_sent(conn: Connection, *_: Any) -> None:
    sent = conn.info.get(_SENT)
    if sent is not None:
        sent[0] = True


# conn.info key: the scopes a transaction's releases took below their limit; the
# lanes blocked on them are woken just before it commits (Store._transaction).
FREED_SCOPES = "runlane_freed_scopes"
# conn.info key: the lane moves of a transaction that changes several runs (a claim,
# a scheduler page), net per lane, written at its end in lane_id order
# (LanesMixin._lane_moves_in_order) instead of as each run meets them: a claim's
# denial wrote its lane before the claim's counters and lanes, and two claims
# deadlocked on two lanes.
LANE_MOVES = "runlane_lane_moves"
# conn.info key: inside such a block, the tenants whose lanes show again (0: a release
# took them below their limit) or hide (1: a claim found them at it), by tenant:
# marked with the block's lane moves, the lanes of both locked at once in lane_id
# order (a release marked them before it locked the runs waiting for its task, and
# deadlocked with a completion of another of their dependencies).
TENANT_MARKS = "runlane_tenant_marks"


class StoreCore:
    """The engine, the transaction and the status write the store's mixins share."""

    if TYPE_CHECKING:
        def _campaign_runs_ended(
                self, conn: Connection,
                ended: Sequence[tuple[str, str, RunStatus, str | None, str | None]],
                now: float) -> None: ...
        def _lane_moved(self, conn: Connection, lane_id: int | None, source: RunStatus,
                        target: RunStatus) -> None: ...
        def _resolve_dependents(self, conn: Connection, task_id: str, now: float | None
                                ) -> None: ...
        def _schedule_close(self, conn: Connection, run_id: str, now: float | None) -> None: ...
        def _wake_blocked_lanes(self, conn: Connection, freed: set[str]) -> set[int]: ...
        def _wake_skipped_lanes(self, lane_ids: set[int]) -> None: ...

    def __init__(
        self,
        url: str,
        *,
        clock: Clock | None = None,
        retry_policy: RetryPolicy | None = None,
        payload_cap_bytes: int = DEFAULT_PAYLOAD_CAP_BYTES,
        engine: Engine | None = None,
        rng: random.Random | None = None,
        max_uncharged_releases: int = DEFAULT_MAX_UNCHARGED_RELEASES,
        listen_url: str | None = None,
    ) -> None:
        if max_uncharged_releases < 0:
            raise ValueError(f"max_uncharged_releases must be >= 0, not {max_uncharged_releases}")
        self.url = url
        # Where this store's processes LISTEN (LISTEN_DATABASE_URL; None: the
        # database's URL, unless that is a transaction pooler's: store/wakeup.py).
        self.listen_url = listen_url
        self.max_uncharged_releases = max_uncharged_releases
        self.dialect = dialect_of(url)
        self.engine = engine or build_engine(url)
        self.clock: Clock = clock or DatabaseClock()
        self.retry_policy = retry_policy or RetryPolicy()
        self.payload_cap_bytes = payload_cap_bytes
        self.rng = rng or random.Random()
        self._sql = dialect_sql.Statements(self.dialect)
        self._cache: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._driver_cache: dict[str, tuple[str, tuple[str, ...]]] = {}
        self._policy_cache: dict[int, Policy] = {}
        self._routes_cache: dict[str, tuple[float, frozenset[str]]] = {}
        # Store.look: whether capabilities (as JSON) serve a route key; both are few.
        self._route_served: dict[tuple[str, str], bool] = {}
        # The policy version in force as this store's claims last saw it, and whether a
        # claim may then be one statement (PostgreSQL: ClaimMixin._claim_in_one_trip).
        self._one_trip_policy: tuple[int, bool] | None = None
        # Whether claims skip paused providers' runs: the policy in force, as this store
        # last read it, declares providers (ClaimMixin._walk).
        self._walk_pauses = False
        # The providers' tokens per minute, as the last claim read them (report_cost).
        self._token_budgets: dict[str, int] = {}
        # (claims left to run as transactions, one-statement claims fallen back in a row)
        self._one_trip_skips: tuple[int, int] = (0, 0)
        # The policy version in force at this store's last submit write (PostgreSQL):
        # the next submit may decide under it without reading it first.
        self._submit_policy_seen: int | None = None
        if isinstance(self.engine, Engine) and \
                not event.contains(self.engine, "after_cursor_execute", _statement_sent):
            event.listen(self.engine, "after_cursor_execute", _statement_sent)
        # The same pool; a connection checked out through it runs in autocommit, and the
        # pool restores the engine's isolation level when it comes back. An engine
        # stand-in (a test's savepoints) keeps its own transactions.
        # For reads only: on SQLite their transactions begin DEFERRED (no lock up
        # front: in WAL a reader never waits for a writer); elsewhere the engine itself.
        self.reads: Engine = (self.engine.execution_options(sqlite_begin="DEFERRED")
                              if isinstance(self.engine, Engine) else self.engine)
        self._autocommit_engine: Engine = (
            self.engine.execution_options(isolation_level="AUTOCOMMIT")
            if isinstance(self.engine, Engine) and self.is_postgres else self.engine)

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    def close(self) -> None:
        self.engine.dispose()

    # --- plumbing -----------------------------------------------------------------

    def _q(self, statement: str, *expanding: str) -> Any:
        key = (statement, expanding)
        clause = self._cache.get(key)
        if clause is None:
            clause = self._cache[key] = self._sql.render(statement, *expanding)
        return clause

    def _driver_rows(self, conn: Connection, statement: str,
                     params: dict[str, Any]) -> list[Any]:
        """The rows of one of PostgreSQL's hottest statements (a claim, a submit, a
        completion), run on psycopg's own cursor inside ``conn``'s transaction.

        Through ``conn.execute`` each run of a textual statement builds its result
        metadata again, and psycopg parses the 5-7 KB text for its placeholders (it
        caches that only up to 4 KB): 0.3-0.4 ms of a 2 ms claim, measured
        (docs/benchmarks.md). Here the text is rendered once with ``$n`` placeholders
        and sent as is (a RawCursor); rows are named tuples. The engine's cursor events
        fire as for ``conn.execute`` (tests and benchmarks watch statements), and a
        failure is handled by SQLAlchemy as its own: wrapped, and a dead session
        invalidated (``_transaction`` retries a stale pooled one)."""
        rendered = self._driver_cache.get(statement)
        if rendered is None:
            compiled = self._q(statement).compile(dialect=_NUMBERED_PG)
            rendered = self._driver_cache[statement] = (
                compiled.string, tuple(compiled.positiontup or ()))
        query, names = rendered
        values = [params[name] for name in names]
        dispatch = conn.dispatch
        import psycopg  # here, not at the top: the `postgres` extra (runlane.extras)
        from psycopg.rows import namedtuple_row

        driver: psycopg.Connection[Any] = cast(Any, conn.connection.driver_connection)
        cursor = psycopg.RawCursor(driver, row_factory=namedtuple_row)
        try:
            for before in dispatch.before_cursor_execute:
                before(conn, cursor, query, values, None, False)
            try:
                cursor.execute(query, values)
                rows = cursor.fetchall()
            except psycopg.Error as exc:
                conn._handle_dbapi_exception(exc, query, values, cast(Any, cursor), None)
            for after in dispatch.after_cursor_execute:
                after(conn, cursor, query, values, None, False)
            return rows
        finally:
            cursor.close()

    def _transaction(self, work: Callable[[Connection], T], *,
                     autocommit: bool = False) -> T:
        """Run ``work`` in one transaction; on SQLite, retry if the file stayed locked
        past the busy timeout, so that "database is locked" never reaches a caller.

        PostgreSQL: the pool does not ping a connection at checkout (a round trip per
        transaction); a pooled session that died meanwhile (server restart, terminated
        backend) fails on the transaction's first statement, before anything reached
        the server, and the transaction is run again once on a fresh connection.
        A failure after a statement went through is raised, as before.

        ``autocommit`` (PostgreSQL; ignored on SQLite): for work whose writes are one
        statement, atomic by itself, and whose reads gain nothing from a transaction
        under READ COMMITTED (each statement reads its own snapshot either way).
        Every statement commits as it ends: psycopg sends no BEGIN and no COMMIT, two
        round trips fewer."""
        engine = self._autocommit_engine if autocommit else self.engine
        attempt = 0
        while True:
            sent = [False]
            skipped: set[int] = set()
            moves = None
            committed: list[Callable[[], None]] | None = None
            try:
                with engine.begin() as conn:
                    info = conn.info
                    info[_SENT] = sent
                    try:
                        result = work(conn)
                        # Lanes blocked on scopes the work's releases freed: last, so
                        # that no lane write waits after these locks (see lanes_sql.py).
                        freed = info.pop(FREED_SCOPES, None)
                        if freed:
                            skipped = self._wake_blocked_lanes(conn, freed)
                    finally:
                        info.pop(_SENT, None)
                        info.pop(FREED_SCOPES, None)
                        moves = info.pop(transition_log.MOVES, None)
                        committed = info.pop(ON_COMMIT, None)
                if skipped:  # committed: the lanes its wake could not take
                    self._wake_skipped_lanes(skipped)
                if moves:  # committed: announced (never a move rolled back)
                    transition_log.log_moves(moves)
                for record in committed or ():  # metrics of what the commit made true
                    record()
                return result
            except DBAPIError as exc:
                attempt += 1
                if exc.connection_invalidated and not sent[0] and attempt == 1:
                    log.warning("stale_connection_retry", error=str(exc.orig)[:200])
                    continue
                if not isinstance(exc, OperationalError) or self.dialect != "sqlite" \
                        or "locked" not in str(exc) or attempt >= 20:
                    raise
                log.warning("sqlite_busy_retry", attempt=attempt)
                time.sleep(min(0.05 * attempt, 1.0) * (1 + self.rng.random()))

    @staticmethod
    def _on_commit(conn: Connection, record: Callable[[], None]) -> None:
        """Run ``record`` (a metric) once the transaction of ``conn`` has committed;
        never when it rolls back (a retried transaction counts once)."""
        if metrics.enabled():
            conn.info.setdefault(ON_COMMIT, []).append(record)

    def _now(self, conn: Connection) -> float:
        return float(conn.execute(self._q("SELECT {now} AS now"), {"now": self.clock.now()})
                     .scalar_one())

    def _notify(self, conn: Connection, channel: str, payload: str) -> None:
        if self.is_postgres:
            conn.execute(text("SELECT pg_notify(:channel, :payload)"),
                         {"channel": channel, "payload": payload})

    def _bulk_insert(self, conn: Connection, table: Table, rows: list[dict[str, Any]],
                     suffix: str = "") -> Any:
        """Insert many rows in one statement. PostgreSQL: one ``INSERT … SELECT FROM
        json_populate_recordset(:rows)``, a short statement however many rows (a
        multi-row VALUES text costs more to build and parse than to run); SQLite:
        executemany."""
        if not self.is_postgres:
            statement = insert(table)
            if suffix:
                raise ValueError("suffix is PostgreSQL-only")
            return conn.execute(statement, rows)
        statement = self._q(dialect_sql.bulk_insert_json(table, list(rows[0]), suffix))
        return conn.execute(statement, {"rows": json.dumps(rows)})

    def _record(self, conn: Connection, events: list[dict[str, Any]]) -> None:
        if events:
            self._bulk_insert(conn, run_events, events)

    def _set_status(
        self,
        conn: Connection,
        *,
        run_id: str,
        source: RunStatus,
        path: Sequence[RunStatus],
        run_token: int,
        actor: str,
        now: float | None,
        fenced: bool = False,
        attempt_no: int | None = None,
        reason_code: str | None = None,
        message: str | None = None,
        outcome: str | None = None,
        visible_at: float | None = None,
        worker_id: str | None = None,
        ends_attempt: bool = False,
    ) -> bool:
        """Compare-and-set a run from ``source`` along ``path``; True when it won.

        ``path`` may have several hops (``[FAILED_RETRYABLE, QUEUED]``): one UPDATE,
        one event per hop, every hop checked against the transition table. With
        ``ends_attempt`` (the attempt of ``run_token`` ends by this move) the hop that
        ends it is recorded on the attempt's row instead (history.record_end).
        """
        check_path([source], path)
        target = path[-1]
        statement = lease_sql.SET_RUN_STATUS_FENCED if fenced else lease_sql.SET_RUN_STATUS
        row = conn.execute(
            self._q(statement, "sources"),
            {
                "run_id": run_id,
                "sources": [source.value],
                "to_status": target.value,
                "now": now,
                "token": run_token,
                "visible_at": visible_at,
                "reason_code": reason_code,
                "message": message,
                "outcome": outcome,
            },
        ).first()
        if row is None:
            return False
        if target in TERMINAL and row.campaign_id:  # its stop rule, in this transaction
            self._campaign_runs_ended(conn, [(run_id, row.campaign_id, target, reason_code,
                                              outcome)],
                                      float(now if now is not None else row.now))
        self._lane_moved(conn, row.lane_id, source, target)
        hops = self._hop_events(
            run_id, source, path, at=now if now is not None else row.now, actor=actor,
            attempt_no=attempt_no, token=run_token, reason_code=reason_code,
            message=message)
        if ends_attempt:
            history.record_end(self, conn, hops, history.end_index(source, path))
        else:
            self._record(conn, hops)
        transition_log.note(conn, run_id, row.task_id, row.queue, source, path,
                            token=run_token, attempt_no=attempt_no, worker_id=worker_id,
                            actor=actor, reason_code=reason_code)
        if target in TERMINAL:
            self._count_run_end(conn, row, target, reason_code)
        if target in TERMINAL and row.has_dependents:
            self._resolve_dependents(conn, row.task_id, now)
        if target in ENDED_WITHOUT_SUCCESS:  # a pull request it may have left open
            self._schedule_close(conn, run_id, now)
        return True

    def _count_run_end(self, conn: Connection, row: Any, target: RunStatus,
                       reason_code: str | None) -> None:
        """A run's end, as metrics: its duration, and a user's cancel its latency (from
        the task's cancel request; read only then, and only with metrics on)."""
        if not metrics.enabled():
            return
        ended = float(row.now)
        self._on_commit(conn, functools.partial(
            metrics.run_ended, target.value, ended - float(row.created_at)))
        if target is S.CANCELLED and reason_code == Reason.CANCELLED_BY_USER:
            asked = conn.execute(self._q(lease_sql.CANCEL_REQUESTED_AT),
                                 {"task_id": row.task_id}).scalar()
            if asked is not None:
                self._on_commit(conn, functools.partial(metrics.cancelled,
                                                        ended - float(asked)))

    @staticmethod
    def _hop_events(run_id: str, source: RunStatus, path: Sequence[RunStatus], *, at: float,
                    actor: str, attempt_no: int | None, token: int,
                    reason_code: str | None = None, message: str | None = None
                    ) -> list[dict[str, Any]]:
        """One run event per hop of a status move (the path already checked)."""
        return [
            {"run_id": run_id, "attempt_no": attempt_no, "at": at, "actor": actor,
             "from_status": a.value, "to_status": b.value, "reason_code": reason_code,
             "fencing_token": token, "message": message}
            for a, b in itertools.pairwise([source, *path])
        ]
