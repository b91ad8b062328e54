"""The one interface to the database, for SQLite and PostgreSQL alike.

Every method is one transaction. Status writes go through ``_set_status``, which
takes its compare-and-set guard from the transition table and records one event
per hop. Worker writes carry the lease's fencing token; when such a write
changes nothing the store says why (``LeaseLost`` or ``CancelRequested``).
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import structlog
from sqlalchemy import Connection, Engine, Table, event, insert, select, text
from sqlalchemy.dialects import postgresql as postgresql_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import DBAPIError, OperationalError

from runlane.clock import Clock, DatabaseClock
from runlane.domain.admission import (
    AdmissionRequest,
    Decision,
    TenantUsage,
    TimeNeeded,
    admit,
)
from runlane.domain.ids import new_id
from runlane.domain.policy import Policy
from runlane.domain.reasons import Reason
from runlane.domain.repos import canonical_repo
from runlane.domain.retry import (
    DEFAULT_MAX_UNCHARGED_RELEASES,
    MAX_FINALIZE_ONLY_ATTEMPTS,
    RetryDecision,
    RetryPolicy,
    RunBudget,
    decide,
    decide_finalize_only,
)
from runlane.domain.routing import (
    parse_capabilities,
    parse_requirements,
    requirements_from_canonical,
    satisfies,
)
from runlane.domain.states import (
    LEASED,
    TERMINAL,
    WAITING,
    IllegalTransition,
    RunStatus,
    check_path,
    is_allowed,
)
from runlane.domain.tasks import (
    DEFAULT_PAYLOAD_CAP_BYTES,
    PayloadReport,
    TaskInvalid,
    TaskSpec,
    differing_field,
    enforce_payload_cap,
    task_digest,
)
from runlane.errors import (
    CancelRequested,
    Conflict,
    CostLimitExceeded,
    LeaseLost,
    NotFound,
    TransitionRefused,
    redact_credentials,
)
from runlane.observability import metrics
from runlane.store import (
    audit_sql,
    dialect_sql,
    lease_sql,
    policy_sql,
    providers_sql,
    reads_sql,
    submit_sql,
    transition_log,
)
from runlane.store import maintenance_sql as msql
from runlane.store.campaigns import CampaignMixin
from runlane.store.engine import build_engine, dialect_of
from runlane.store.evidence import (
    ENDED_WITHOUT_SUCCESS,
    PULL_REQUEST_EFFECT,
    EvidenceMixin,
    Ledger,
)
from runlane.store.maintenance import WALL_CLOCK_MARGIN_SECONDS, MaintenanceMixin, ReapBatch
from runlane.store.scheduling import (
    BLOCKED_LANE_RECHECK_SECONDS,
    FREED_SCOPES,
    JOIN_AHEAD,
    LANE_MOVES,
    TENANT_MARKS,
    LanesDue,
    PolicyChanged,
    SchedulingMixin,
    policy_needs_usage,
)
from runlane.store.schema import run_events, runs, task_dependencies, tasks, workers

log = structlog.get_logger("runlane.store")
T = TypeVar("T")
S = RunStatus

WAKEUP_CHANNEL = "runlane_wakeup"  # payload: queue name
CANCEL_CHANNEL = "runlane_cancel"  # payload: run id
CANCELLING = frozenset({S.CANCEL_REQUESTED, S.CANCELLING})
# Markers a run only passes through inside one write: persisted, no service would
# ever move the run on, so the reconciler's repair 4 takes them on.
RECOVERY_MARKERS = frozenset({S.STALE_LEASE, S.FAILED_RETRYABLE})
# The states in which a run without a live lease is stuck (repair 4).
RECOVERABLE = LEASED | CANCELLING | RECOVERY_MARKERS
# The reaper's lock on one expired lease's run and attempt (skipped when held).
_REAP_LOCK = """
SELECT r.queue FROM runs r
JOIN attempts a ON a.run_id = r.run_id AND a.fencing_token = :token
WHERE r.run_id = :run_id
{lock_ra_skip}
"""


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


@dataclass
class Lease:
    """A worker's right to execute one attempt of a run."""

    run_id: str
    task_id: str
    attempt_no: int
    fencing_token: int
    worker_id: str
    expires_at: float
    tenant: str
    repo: str  # the run's canonical repository (its identity); the task's is cloned
    queue: str
    priority: int
    max_attempts: int
    limits: dict[str, Any] = field(default_factory=dict)  # the run's limits snapshot
    stage: RunStatus = S.CLAIMED

    @property
    def attempt_id(self) -> str:
        return f"{self.run_id}/{self.attempt_no}"


def _lease(claimed: Any, run: Any, worker_id: str, lease_ttl: float) -> Lease:
    """The lease of a claimed run: ``claimed`` is the claim's write (token, attempt,
    time), ``run`` the run as the claim read it."""
    limits = run.limits if isinstance(run.limits, dict) else json.loads(run.limits or "{}")
    return Lease(
        run_id=claimed.run_id, task_id=run.task_id, attempt_no=claimed.attempt_count,
        fencing_token=claimed.fencing_token, worker_id=worker_id,
        expires_at=claimed.now + lease_ttl, tenant=run.tenant, repo=run.repo,
        queue=run.queue, priority=run.priority, max_attempts=run.max_attempts,
        limits=limits or {})


@dataclass(frozen=True)
class Submission:
    task_id: str
    run_id: str
    status: str
    created: bool
    truncated_sections: tuple[str, ...] = ()
    payload_bytes: int = 0
    reason_code: str | None = None  # why a run was denied or deferred at admission


@dataclass(frozen=True)
class Look:
    """What a worker's look found (``Store.look``): ``ready``, a claim may find a run
    now; else ``next_in``, the seconds until the earliest run it may serve becomes
    claimable (by the database's clock), or None when it may serve none queued."""

    ready: bool
    next_in: float | None = None


@dataclass(frozen=True)
class HeartbeatResult:
    extended: dict[str, float] = field(default_factory=dict)  # run_id -> new expiry
    cancel_requested: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Completion:
    """What ``complete_many`` did: the leases whose runs it completed, and why each
    other lease was refused (``LeaseLost``, ``CancelRequested``, ``TransitionRefused``
    or ``IllegalTransition``); a refused lease changed nothing."""

    completed: tuple[Lease, ...] = ()
    refused: tuple[tuple[Lease, Exception], ...] = ()


@dataclass(frozen=True)
class CancelResult:
    task_id: str
    runs: dict[str, str]  # run_id -> status after the request


@dataclass(frozen=True)
class SideEffect:
    run_id: str
    effect_key: str
    status: str  # INTENT or DONE
    attempt_no: int
    fencing_token: int
    result: dict[str, Any] | None


@dataclass(frozen=True)
class Violation:
    """One broken invariant, about a run (``run_id``), a lane (``lane_id``) or a limit
    scope (``scope``)."""

    check: str
    run_id: str | None
    detail: str
    lane_id: int | None = None
    scope: str | None = None

    @property
    def subject(self) -> str:
        """What the violation is about, for a reader: "run r-1", "lane 3", "scope x"."""
        if self.lane_id is not None:
            return f"lane {self.lane_id}"
        if self.scope is not None:
            return f"scope {self.scope}"
        return f"run {self.run_id}"


@dataclass(frozen=True)
class _Snapshot:
    """A run and one of its attempts, read under the run's row lock."""

    run_id: str
    task_id: str
    status: RunStatus
    run_token: int
    attempt_count: int
    charged_attempts: int  # attempts that count against max_attempts (not drained ones)
    max_attempts: int
    created_at: float
    cost_usd: float
    attempt_no: int
    fencing_token: int
    lease_status: str
    lease_expires_at: float
    now: float
    # Attempts numbered above it are finalize-only (store/evidence.py); None: none yet.
    finalize_only_after: int | None = None
    worker_id: str | None = None  # the attempt's

    @property
    def lease_live(self) -> bool:
        return (
            self.lease_status == "ACTIVE"
            and self.run_token == self.fencing_token
            and self.lease_expires_at > self.now
        )


# The run columns a submit takes from its plan (the rest are the batch's or zero).
_RUN_COLUMNS = ("run_id", "task_id", "tenant", "repo", "queue", "priority", "status",
                "max_attempts", "visible_at", "ended_at", "reason_code", "message",
                "user_id", "risk_class", "route_key", "policy_version", "admission",
                "limits", "estimated_cost_usd", "provider")


def _count_completions(durations: list[float]) -> None:
    for seconds in durations:
        metrics.attempt_ended("SUCCEEDED")
        metrics.run_ended("SUCCEEDED", seconds)


def _admission_request_key(spec: TaskSpec, repo: str) -> tuple[Any, ...] | None:
    """What admission reads of a task (``repo``: its canonical repository), as a key;
    None when its requirements are not plain JSON (a set from the Python API): such a
    task is decided on its own."""
    try:
        requires = json.dumps(spec.requires, sort_keys=True) if spec.requires else ""
    except (TypeError, ValueError):
        return None
    return (spec.tenant, repo, spec.queue, spec.priority, spec.user, spec.max_attempts,
            requires, spec.estimated_cost_usd, spec.provider)


def _key_conflict(spec: TaskSpec, task_id: str | None, field: str | None) -> Conflict:
    """The same tenant and idempotency key, another request: nothing is written. The
    message names the first field that differs, when the stored task tells."""
    where = f" by task {task_id}" if task_id else " earlier in this batch"
    what = (f"the field {field!r} differs" if field else
            "repository, prompt, queue, priority, requirements or other fields differ")
    conflict = Conflict(f"idempotency key {spec.idempotency_key!r} of tenant "
                        f"{spec.tenant!r} was used{where} for a different request ({what}); "
                        "nothing was written")
    conflict.field = field
    return conflict


# The statuses a new run's visible_at is its decision's retry_after in.
_VISIBLE_LATER = frozenset({S.WAITING_CAPACITY, S.AWAITING_APPROVAL})

# Claims one call may make when a candidate got no slot (Store.claim).
CLAIM_ROUNDS = 3


@dataclass
class _SubmitBatch:
    """The rows one submit writes: one item per task and its run, and the distinct
    admission decisions the items name by number (a decision shared by many runs is
    serialised once, and so is all that the task and run take from it: queue,
    priority, attempts, route, the run's status).

    An item holds what is the task's own (ids, tenant, repo, prompt, ...), and only
    the keys that are set: a missing key is NULL (or the column's empty value) to
    SUBMIT_WRITE_PG, which fills in the rest from the item's decision and the time.
    SQLite writes the full rows (``task_rows``, ``run_rows``). ``repo`` is the
    repository as written (the task's, cloned); ``repo_key`` its canonical form (the
    run's identity, domain/repos.py), set only where the two differ."""

    now: float | None  # None: decided without the time; the write stamps its own
    actor: str
    policy_version: int  # the version the batch was decided under
    items: list[dict[str, Any]] = field(default_factory=list)
    run_statuses: list[RunStatus] = field(default_factory=list)  # each item's new run's
    decisions: list[Decision] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[RunStatus] = field(default_factory=list)  # a decision's new run's

    def add_decision(self, d: Decision) -> int:
        status = {"DENY": S.POLICY_DENIED, "DEFER": S.WAITING_CAPACITY,
                  "REQUIRE_APPROVAL": S.AWAITING_APPROVAL}.get(d.decision, S.QUEUED)
        assert is_allowed(None, status) and is_allowed(None, S.ADMITTED)
        self.statuses.append(status)
        self.decisions.append(d)
        self.records.append({
            "queue": d.queue, "priority": d.priority, "max_attempts": d.max_attempts,
            "risk_class": d.risk_class, "route_key": d.requires,
            "policy_version": d.policy_version, "reason_code": d.reason_code,
            "message": d.message, "weight": d.weight, "admission": d.to_json(),
            "limits": d.limits, "status": status.value, "provider": d.provider,
            # A DEFER's retry-after; an approval's expiry (Store.expire_approvals).
            "visible_at": d.retry_after if status in _VISIBLE_LATER else None,
            "event_message": f"admitted under policy v{d.policy_version}"
            if d.decision == "ADMIT"
            else f"{d.decision} under policy v{d.policy_version}: {d.message}"})
        return len(self.decisions) - 1

    def add(self, spec: TaskSpec, report: PayloadReport, number: int, repo_key: str) -> None:
        """One task and its run, under decision ``number``; ``repo_key``: the canonical
        form of its repository."""
        status = self.statuses[number]
        item = {"task_id": new_id(), "run_id": new_id(), "tenant": spec.tenant,
                "repo": spec.repo, "prompt": spec.prompt,
                "payload_bytes": report.size_bytes, "decision_no": number}
        if repo_key != spec.repo:
            item["repo_key"] = repo_key
        if spec.idempotency_key is not None:
            item["idempotency_key"] = spec.idempotency_key
        if spec.context:
            item["context"] = spec.context
        if report.truncated_sections:
            item["truncated_sections"] = list(report.truncated_sections)
        if spec.user is not None:
            item["user_id"] = spec.user
        if spec.parent_task_id is not None:
            item["parent_task_id"] = spec.parent_task_id
        if spec.estimated_cost_usd is not None:
            item["estimated_cost_usd"] = spec.estimated_cost_usd
        if status is S.QUEUED and spec.depends_on:
            status = S.ADMITTED  # released (or cancelled) when they end
            item["status"] = status.value
        self.items.append(item)
        self.run_statuses.append(status)

    def task_rows(self) -> list[dict[str, Any]]:
        """Every column of each item's task (SQLite)."""
        rows = []
        for item in self.items:
            d = self.decisions[item["decision_no"]]
            rows.append({
                "task_id": item["task_id"], "tenant": item["tenant"], "repo": item["repo"],
                "prompt": item["prompt"], "queue": d.queue, "priority": d.priority,
                "idempotency_key": item.get("idempotency_key"),
                "max_attempts": d.max_attempts, "context": item.get("context", {}),
                "truncated_sections": item.get("truncated_sections", []),
                "payload_bytes": item["payload_bytes"], "cancel_requested_at": None,
                "created_at": self.now, "user_id": item.get("user_id"),
                "requires": d.requires, "parent_task_id": item.get("parent_task_id"),
                "estimated_cost_usd": item.get("estimated_cost_usd"),
                "request_digest": item.get("request_digest"),
                "traceparent": item.get("traceparent")})
        return rows

    def run_rows(self, inserted: set[str]) -> list[dict[str, Any]]:
        """Each inserted task's run: its decision's record, then its own columns
        (SQLite)."""
        rows = []
        for item, status in zip(self.items, self.run_statuses, strict=True):
            if item["task_id"] not in inserted:
                continue
            record = self.records[item["decision_no"]]
            rows.append({
                **record, "run_id": item["run_id"], "task_id": item["task_id"],
                "tenant": item["tenant"], "repo": item.get("repo_key", item["repo"]),
                "user_id": item.get("user_id"), "status": status.value,
                "visible_at": record["visible_at"] if status in _VISIBLE_LATER
                and record["visible_at"] is not None else self.now,
                "ended_at": self.now if status is S.POLICY_DENIED else None,
                "estimated_cost_usd": item.get("estimated_cost_usd")})
        return rows


class Store(SchedulingMixin, MaintenanceMixin, EvidenceMixin, CampaignMixin):
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
        # claim may then be one statement (PostgreSQL: SchedulingMixin._claim_in_one_trip).
        self._one_trip_policy: tuple[int, bool] | None = None
        # Whether claims skip paused providers' runs: the policy in force, as this store
        # last read it, declares providers (SchedulingMixin._walk).
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
    ) -> bool:
        """Compare-and-set a run from ``source`` along ``path``; True when it won.

        ``path`` may have several hops (``[FAILED_RETRYABLE, QUEUED]``): one UPDATE,
        one event per hop, every hop checked against the transition table.
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
        self._record(conn, self._hop_events(
            run_id, source, path, at=now if now is not None else row.now, actor=actor,
            attempt_no=attempt_no, token=run_token, reason_code=reason_code,
            message=message))
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

    # --- submit -------------------------------------------------------------------

    def submit(self, specs: Sequence[TaskSpec], *, default_max_attempts: int = 3,
               actor: str = "api", traceparents: Sequence[str | None] | None = None
               ) -> list[Submission]:
        """Admit and create a task and its run for each spec, all or nothing.

        Every run gets an admission decision under the policy in force (recorded on
        the run with the policy version): ADMIT queues it (or leaves it ADMITTED
        while its dependencies run), DENY ends it POLICY_DENIED, DEFER parks it in
        WAITING_CAPACITY until the decision's retry-after. The same (tenant,
        idempotency key) again with the same request returns the existing task and its
        first run; with another request it raises Conflict and writes nothing.
        ``traceparents``: each spec's submit span (observability/tracing.py), kept on
        its new task for the task's attempts to join.
        """
        # What each keyed task was asked as, before any truncation: the same key with
        # another request is a conflict, refused before anything is written.
        digests = [task_digest(spec) if spec.idempotency_key is not None else None
                   for spec in specs]
        fitted = [enforce_payload_cap(spec, self.payload_cap_bytes) for spec in specs]
        # The identity of each repository (its runs' scope, what the policy matches):
        # here, before any transaction, as it may read the file system (a local path).
        repo_keys = {spec.repo: canonical_repo(spec.repo) for spec, _ in fitted}
        # PostgreSQL writes a submit in one statement (SUBMIT_WRITE_PG), atomic by itself,
        # unless a task names others: their dependency rows, and the release of a run
        # whose dependencies already ended, are more writes, and the named tasks' runs
        # stay share-locked until the commit (NAMED_TASKS: retention must not
        # delete them meanwhile). Any other submit needs no BEGIN and no COMMIT (see
        # _transaction): one or two round trips where it was four. A keyed task may
        # meet its key taken by another request (a Conflict found after the write,
        # which must then write nothing): a transaction, rolled back.
        one_write = self.is_postgres and not any(
            spec.depends_on or spec.parent_task_id or spec.idempotency_key is not None
            for spec, _ in fitted)

        def work(conn: Connection) -> list[Submission]:
            return self._submit_in(conn, fitted, digests, repo_keys,
                                   default_max_attempts=default_max_attempts, actor=actor,
                                   traceparents=traceparents)

        submissions = self._transaction(work, autocommit=one_write)
        metrics.submitted((s.status, s.reason_code) for s in submissions if s.created)
        created = sum(1 for s in submissions if s.created)
        log.info("submitted", tasks=len(submissions), created=created)
        return submissions

    def _submit_in(self, conn: Connection, fitted: list[tuple[TaskSpec, PayloadReport]],
                   digests: list[str | None], repo_keys: dict[str, str], *,
                   default_max_attempts: int, actor: str,
                   traceparents: Sequence[str | None] | None = None) -> list[Submission]:
        """The writes of ``submit`` inside the caller's transaction (a campaign's
        dispatch submits its targets' tasks in the transaction that marks them)."""
        presumed = self._submit_policy_seen if self.is_postgres else None
        while True:
            batch, planned, aliases = self._plan_submission(
                conn, fitted, repo_keys, default_max_attempts=default_max_attempts,
                actor=actor, presumed=presumed)
            for i, first in aliases.items():  # a key repeated inside the batch
                if digests[i] != digests[first]:
                    raise _key_conflict(fitted[i][0], None, differing_field(
                        fitted[i][0], fitted[first][0]))
            for i, item in zip(planned, batch.items, strict=True):
                if digests[i] is not None:
                    item["request_digest"] = digests[i]
                if traceparents is not None and traceparents[i] is not None:
                    item["traceparent"] = traceparents[i]
            skipped = self._write_submission(conn, batch) if planned else set()
            if skipped is not None:
                break
            # A newer policy version is in force than the one decided under: nothing
            # was written; decide again under it, so the runs record the version in
            # force.
            log.info("submit_policy_changed", decided_under=batch.policy_version)
            presumed = None
        results: list[Submission | None] = [None] * len(fitted)
        dependencies = [{"task_id": item["task_id"], "depends_on": dep}
                        for i, item in zip(planned, batch.items, strict=True)
                        if fitted[i][0].depends_on and item["task_id"] not in skipped
                        for dep in fitted[i][0].depends_on]
        if dependencies:
            conn.execute(insert(task_dependencies), dependencies)
        with self._lane_moves_in_order(conn):  # released runs' lanes: lane_id order
            for i, item, status in zip(planned, batch.items, batch.run_statuses,
                                       strict=True):
                report = fitted[i][1]
                task_id = item["task_id"]
                if task_id in skipped:  # the key was taken before
                    existing = conn.execute(self._q(submit_sql.EXISTING_RUN), {
                        "tenant": item["tenant"],
                        "key": item.get("idempotency_key")}).first()
                    if existing is None:
                        # A task an earlier retention kept without its run (it
                        # now keeps both while another task names it), or one
                        # deleted since the insert met its key.
                        raise TaskInvalid("idempotency_key", (
                            f"{item.get('idempotency_key')!r} names a task whose run "
                            "retention deleted; submit with another key"))
                    # Tasks written before migration 0019 have no digest: taken as
                    # matching (what they were asked with is not known).
                    if existing.request_digest is not None \
                            and existing.request_digest != digests[i]:
                        stored = conn.execute(self._q(submit_sql.TASK_AS_ASKED), {
                            "task_id": existing.task_id}).first()
                        raise _key_conflict(fitted[i][0], existing.task_id, None
                                            if stored is None else differing_field(
                                                fitted[i][0], dict(stored._mapping)))
                    # A replay answers as the first submit did (its size too).
                    truncated = existing.truncated_sections or []
                    results[i] = Submission(
                        existing.task_id, existing.run_id, existing.status, False,
                        tuple(json.loads(truncated) if isinstance(truncated, str)
                              else truncated), int(existing.payload_bytes or 0))
                    continue
                if status is S.ADMITTED:  # dependencies may all have ended already
                    outcome = self._dependency_outcome(conn, task_id)
                    if outcome is not S.ADMITTED:
                        self._set_status(
                            conn, run_id=item["run_id"], source=S.ADMITTED, path=[outcome],
                            run_token=0, actor=actor, now=batch.now,
                            reason_code=(Reason.DEPENDENCY_FAILED
                                         if outcome is S.CANCELLED else None),
                            message=("a dependency ended without success"
                                     if outcome is S.CANCELLED else "dependencies succeeded"))
                        status = outcome
                results[i] = Submission(task_id, item["run_id"], status.value, True,
                                        report.truncated_sections, report.size_bytes,
                                        batch.decisions[item["decision_no"]].reason_code)
        for i, first in aliases.items():  # a repeat inside the batch creates nothing
            original = results[first]
            assert original is not None
            results[i] = replace(original, created=False)
        return [r for r in results if r is not None]

    def _plan_submission(self, conn: Connection, fitted: list[tuple[TaskSpec, PayloadReport]],
                         repo_keys: dict[str, str], *, default_max_attempts: int, actor: str,
                         presumed: int | None
                         ) -> tuple[_SubmitBatch, list[int], dict[int, int]]:
        """Read the time and the policy in force, check the tasks the specs name and
        decide admission: the batch to write, the spec of each planned task and run,
        and the specs that repeat an earlier key of the batch (spec -> its first).

        ``presumed``: the version in force at this store's last write. When its policy
        needs no usage and no spec names another task, there is nothing to read: the
        batch is decided under it without the time (ADMIT and DENY do not depend on
        it), SUBMIT_WRITE_PG checks the version and stamps the rows with the database
        clock (or the test's pinned one), and the submit is one round trip. A
        decision that needs the time (a DEFER) reads it first, as every other case."""
        referenced = sorted({t for spec, _ in fitted
                             for t in [*spec.depends_on, spec.parent_task_id] if t})
        policy = self._policy_cache.get(presumed) \
            if presumed is not None and not referenced else None
        if policy is not None and not policy_needs_usage(policy):
            assert presumed is not None
            try:
                return self._decide_submission(
                    fitted, repo_keys, policy, presumed, None, {}, {},
                    default_max_attempts=default_max_attempts, actor=actor)
            except TimeNeeded:
                pass
        context = conn.execute(self._q(submit_sql.SUBMIT_CONTEXT),
                               {"now": self.clock.now()}).one()
        now, version = float(context.now), int(context.version or 0)
        policy = self._policy_version(conn, version)
        usage = self._tenant_usage(conn, {spec.tenant for spec, _ in fitted}, now) \
            if policy_needs_usage(policy) else {}
        known = {r.task_id: r.tenant for r in conn.execute(
            self._q(policy_sql.NAMED_TASKS, "task_ids"), {"task_ids": referenced})
        } if referenced else {}
        return self._decide_submission(fitted, repo_keys, policy, version, now, usage, known,
                                       default_max_attempts=default_max_attempts, actor=actor)

    @staticmethod
    def _decide_submission(fitted: list[tuple[TaskSpec, PayloadReport]],
                           repo_keys: dict[str, str], policy: Policy,
                           version: int, now: float | None, usage: dict[str, TenantUsage],
                           known: dict[str, str], *, default_max_attempts: int,
                           actor: str) -> tuple[_SubmitBatch, list[int], dict[int, int]]:
        """Admission for each spec under ``policy``, with what was read for it; each run
        is decided on its repository's canonical form (``repo_keys``), never a spelling."""
        needs_usage = policy_needs_usage(policy)
        batch = _SubmitBatch(now=now, actor=actor, policy_version=version)
        first_of_key: dict[tuple[str, str], int] = {}
        planned: list[int] = []  # the spec of each planned task and run
        aliases: dict[int, int] = {}
        decided: dict[tuple[Any, ...], int] = {}  # request key -> decision number
        for i, (spec, report) in enumerate(fitted):
            for field_name, task_id in [*(("depends_on", t) for t in spec.depends_on),
                                        ("parent_task_id", spec.parent_task_id)
                                        ] if spec.depends_on or spec.parent_task_id else ():
                # Another tenant's task is answered as one that does not exist: a
                # tenant neither learns of it nor ties its runs to it (a cancel of
                # theirs would cancel ours).
                if task_id and known.get(task_id) != spec.tenant:
                    raise TaskInvalid(field_name, f"no task {task_id!r}")
            if spec.idempotency_key is not None:
                key = (spec.tenant, spec.idempotency_key)
                if key in first_of_key:
                    aliases[i] = first_of_key[key]
                    continue
                first_of_key[key] = i
            # Without usage, admission is a function of the request alone (the
            # policy, version and time are the batch's): decide each distinct one
            # once. With usage, every admitted run changes the next decision.
            repo = repo_keys[spec.repo]
            request = None if needs_usage else _admission_request_key(spec, repo)
            number = None if request is None else decided.get(request)
            if number is None:
                tenant_usage = usage.get(spec.tenant, TenantUsage())
                decision = admit(
                    AdmissionRequest(
                        tenant=spec.tenant, repo=repo, queue=spec.queue,
                        priority=spec.priority, user=spec.user,
                        max_attempts=spec.max_attempts,
                        requires=parse_requirements(spec.requires),
                        estimated_cost_usd=spec.estimated_cost_usd, provider=spec.provider),
                    policy, version, tenant_usage, now,
                    default_max_attempts=default_max_attempts)
                if needs_usage and decision.decision == "ADMIT":
                    usage[spec.tenant] = replace(
                        tenant_usage, queued_runs=tenant_usage.queued_runs + 1)
                number = batch.add_decision(decision)
                if request is not None:
                    decided[request] = number
            batch.add(spec, report, number, repo)
            planned.append(i)
        return batch, planned, aliases

    def _write_submission(self, conn: Connection, batch: _SubmitBatch) -> set[str] | None:
        """Insert the batch's tasks; for those really inserted (an idempotency key
        already taken inserts nothing), their routes, lanes, runs and admission events,
        and wake the queues that got QUEUED runs. Returns the ids of the tasks not
        inserted (their key was taken before).
        PostgreSQL: one statement (SUBMIT_WRITE_PG), which writes nothing and returns
        None when the newest policy version is no longer the batch's (the submit
        decides again); SQLite: one per table, in a transaction that began with the
        write lock (BEGIN IMMEDIATE), so the policy cannot change meanwhile."""
        if self.is_postgres:
            [row] = self._driver_rows(conn, submit_sql.SUBMIT_WRITE_PG, {
                "items": json.dumps(batch.items), "decisions": json.dumps(batch.records),
                "decision_queues": [d.queue for d in batch.decisions],
                "decision_priorities": [d.priority for d in batch.decisions],
                "decision_max_attempts": [d.max_attempts for d in batch.decisions],
                "decision_requires": [d.requires for d in batch.decisions],
                "now": self.clock.now() if batch.now is None else batch.now,
                "actor": batch.actor, "ahead": JOIN_AHEAD, "channel": WAKEUP_CHANNEL,
                "version": batch.policy_version,
            })
            self._submit_policy_seen = row.policy_version
            return set(row.skipped_task_ids) \
                if row.policy_version == batch.policy_version else None
        assert batch.now is not None  # SQLite always reads the time first (no presumed version)
        insert_task = sqlite_dialect.insert(tasks).on_conflict_do_nothing(
            index_elements=["tenant", "idempotency_key"],
            index_where=tasks.c.idempotency_key.is_not(None)).returning(tasks.c.task_id)
        inserted = set(conn.execute(insert_task, batch.task_rows()).scalars().all())
        created = batch.run_rows(inserted)
        skipped = {item["task_id"] for item in batch.items} - inserted
        if not created:
            return skipped
        lane_plan: dict[tuple[str, str, int, str], tuple[int, float]] = {}
        for run in created:
            key = (run["queue"], run["route_key"], run["priority"], run["tenant"])
            entering, _ = lane_plan.get(key, (0, run["weight"]))
            lane_plan[key] = (entering + (run["status"] == S.QUEUED.value), run["weight"])
        conn.execute(self._q(submit_sql.ROUTE_INSERT), [{"route_key": k, "now": batch.now}
                                                 for k in sorted({k[1] for k in lane_plan})])
        lane_ids = self._lane_ids(conn, lane_plan)
        self._bulk_insert(conn, runs, [
            {column: run[column] for column in _RUN_COLUMNS}
            | {"attempt_count": 0, "fencing_token": 0, "cost_usd": 0.0,
               "created_at": batch.now, "updated_at": batch.now,
               "lane_id": lane_ids[(run["queue"], run["route_key"], run["priority"],
                                    run["tenant"])]}
            for run in created])
        self._record(conn, [
            {"run_id": run["run_id"], "attempt_no": None, "at": batch.now,
             "actor": batch.actor, "from_status": None, "to_status": run["status"],
             "reason_code": run["reason_code"], "fencing_token": None,
             "message": run["event_message"]}
            for run in created])
        return skipped

    # --- claim --------------------------------------------------------------------

    def claim(self, worker_id: str, queue: str = "default", *, limit: int = 1,
              lease_ttl: float = 60.0, run_id: str | None = None,
              capabilities: dict[str, Any] | None = None) -> list[Lease]:
        """Claim up to ``limit`` runs in one transaction.

        Lanes are served by priority, then weighted fair share; inside a lane the
        oldest runnable run first. Each candidate is re-admitted under the policy in
        force and must get a slot in every limited scope; then each run is CAS'd
        QUEUED -> CLAIMED with the next fencing token and gets the attempt that
        carries its lease. ``capabilities`` are the worker's: it is only given runs
        whose requirements they satisfy.
        """
        check_path([S.QUEUED], [S.CLAIMED])
        started = time.perf_counter()
        if run_id is None and self.is_postgres:
            one_trip = self._claim_in_one_trip(queue, limit, capabilities,
                                               worker_id=worker_id, lease_ttl=lease_ttl)
            if one_trip is not None:
                return self._claimed(worker_id, queue, started, [
                    _lease(r, r, worker_id, lease_ttl)
                    for r in sorted(one_trip, key=lambda r: (r.priority, r.created_at,
                                                             r.run_id))])

        short = [False]  # a candidate got no slot: its place may go to another run

        def work(conn: Connection, check_due: bool, limit: int) -> list[Lease] | None:
            hid = False  # full tenants found by this claim, their lanes hidden
            if self.is_postgres:  # before any counter: see LOCK_ATTEMPTS_FOR_CLAIM_PG
                conn.execute(self._q(policy_sql.LOCK_ATTEMPTS_FOR_CLAIM_PG))
            candidates, empty = self._claim_candidates(conn, queue, limit, capabilities,
                                                       run_id, check_due=check_due)
            # The lanes of runs that admission denies, defers or prunes move after the
            # claim's counters, with its own lanes (PostgreSQL: in its one write), in
            # lane_id order; a denial's lane written first deadlocked two claims.
            with self._lane_moves_in_order(conn) as gone:
                admitted = self._admit_candidates(conn, candidates, actor=worker_id) \
                    if candidates else []
                conn.info.pop(LANE_MOVES, None)  # collected: the writes below are the claim's
                passed, rows = admitted, None
                if admitted and self.is_postgres:  # the write checks the slots itself
                    rows = self._write_claim(conn, admitted, None, worker_id=worker_id,
                                             lease_ttl=lease_ttl, gone=gone)
                if admitted and rows is None:  # lock the counters, allot slots run by run
                    passed, full_tenants = self._allot_slots(conn, admitted)
                    short[0] = len(passed) < len(admitted)
                    rows = self._write_claim(conn, passed, full_tenants,
                                             worker_id=worker_id, lease_ttl=lease_ttl,
                                             gone=gone) if passed else []
                    if not passed and full_tenants:  # hidden with the block's lanes
                        conn.info.setdefault(TENANT_MARKS, {}).update(
                            dict.fromkeys(full_tenants, 1))
                        hid = True
                    if rows is None:  # cannot happen: the counters are locked and checked
                        raise TransitionRefused(
                            "slots changed while their counters were locked")
            rows = rows or []
            woken = self._lane_upkeep(conn, empty, wake=not rows)
            if not rows:  # None: lanes woke or full tenants hid, look once more
                return [] if not (woken or hid) else None
            by_id = {c.run_id: c for c, _ in passed}
            return [_lease(r, by_id[r.run_id], worker_id, lease_ttl)
                    for r in sorted(rows, key=lambda r: (by_id[r.run_id].priority,
                                                         by_id[r.run_id].created_at,
                                                         r.run_id))]

        def one_claim(limit: int) -> list[Lease]:
            """Due lanes are woken first, in a transaction of their own (taking lane
            locks before the counters would break the lock order); a claim that found
            nothing but woke lanes looks again. Either way the woken lanes are
            pickable once that transaction committed."""
            leases: list[Lease] | None = None
            check_due = True
            for attempt in range(3):
                try:
                    leases = self._transaction(functools.partial(
                        work, check_due=check_due, limit=limit))
                except LanesDue:
                    woken = self._transaction(
                        lambda conn: self._lane_upkeep(conn, set(), wake=True))
                    # Due lanes held elsewhere cannot be woken now: go on without them.
                    check_due = woken > 0 and attempt < 1
                    continue
                except PolicyChanged as changed:  # rolled back: again, under the new one
                    log.info("claim_restarted_policy_changed", read_version=changed.args[0])
                    continue
                if leases is not None:
                    break
            return leases or []

        # A claim deals its candidates before it allots their slots: one that got none
        # (its repository filled by an earlier candidate of the same claim) leaves the
        # claim short while runnable runs wait. Such a claim claims again for what it
        # lacks: the scopes it filled are full now, so the next deal passes over them.
        taken: list[Lease] = []
        for _ in range(CLAIM_ROUNDS):
            short[0] = False
            taken += one_claim(limit - len(taken))
            if not short[0] or len(taken) >= limit or run_id is not None:
                break
        return self._claimed(worker_id, queue, started, taken)

    @staticmethod
    def _claimed(worker_id: str, queue: str, started: float, leases: list[Lease]
                 ) -> list[Lease]:
        metrics.claimed(queue, len(leases), time.perf_counter() - started)
        transition_log.log_claimed(leases)  # committed
        return leases

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
        hop; its attempt ended and its lease released; its concurrency slots given back;
        runs waiting on its task released. A stale, lost or cancelled lease is refused
        and changes nothing; it never stops the others. Returns both lists.
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
        already, ending at ``target``), one event per hop of the won runs, their
        attempts ended and leases released: one statement on PostgreSQL
        (COMPLETE_WRITE_PG), three on SQLite. Returns ``(run_id, lane_id, task_id,
        created_at, has_dependents, limit_scopes, now)`` per won run; a lost lease
        changed nothing."""
        leases = [lease for lease, _ in moves]
        params = {**self._lease_batch(leases), "to_status": target.value,
                  "outcome": outcome, "now": self.clock.now()}
        if self.is_postgres:
            hops = [(lease.run_id, a.value, b.value) for lease, path in moves
                    for a, b in itertools.pairwise([lease.stage, *path])]
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
                lease.run_id, lease.stage, path, at=now, actor=lease.worker_id,
                attempt_no=lease.attempt_no, token=lease.fencing_token)])
        if won:
            conn.execute(self._q(lease_sql.END_ATTEMPTS), [
                {"status": "SUCCEEDED", "reason_code": None, "message": None,
                 "retry_after_seconds": None, "lease_status": "RELEASED", "now": now,
                 "run_id": lease.run_id, "token": lease.fencing_token}
                for (lease, _), now in won])
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
        def work(conn: Connection) -> None:
            won = self._set_status(
                conn, run_id=lease.run_id, source=lease.stage, path=path,
                run_token=lease.fencing_token, actor=lease.worker_id, now=self.clock.now(),
                fenced=True, attempt_no=lease.attempt_no, worker_id=lease.worker_id,
            )
            if not won:
                raise self._refusal(conn, lease, path[-1])

        self._transaction(work)
        lease.stage = path[-1]

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
                worker_id=snap.worker_id,
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

    def pull_requests(self) -> list[dict[str, Any]]:
        """Pull requests opened (or adopted) by runs, as recorded in the ledger. ``repo``
        is the run's repository identity (canonical, without credentials: what
        ``runs list`` shows), not the spelling the code host was called with."""
        opened = [e for e in self.side_effects()
                  if e.effect_key == PULL_REQUEST_EFFECT and e.status == "DONE"]
        with self.reads.connect() as conn:
            repos = {r.run_id: r.repo for r in conn.execute(text(
                "SELECT r.run_id, r.repo FROM side_effects s JOIN runs r ON r.run_id = s.run_id"
                " WHERE s.effect_key = :key AND s.status = 'DONE'"),
                {"key": PULL_REQUEST_EFFECT})}
        return [
            {"run_id": e.run_id,
             "repo": repos.get(e.run_id) or redact_credentials(str((e.result or {}).get("repo"))),
             "branch": (e.result or {}).get("head_branch"),
             "number": (e.result or {}).get("number"), "url": (e.result or {}).get("url"),
             "adopted": bool((e.result or {}).get("adopted"))}
            for e in opened
        ]

    def side_effects(self, run_id: str | None = None) -> list[SideEffect]:
        query = "SELECT run_id, effect_key FROM side_effects"
        params: dict[str, Any] = {}
        if run_id is not None:
            query += " WHERE run_id = :run_id"
            params["run_id"] = run_id
        with self.reads.connect() as conn:
            keys = conn.execute(text(query + " ORDER BY created_at, run_id, effect_key"),
                                params).all()
            return [self._effect(conn, r.run_id, r.effect_key) for r in keys]

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
            queue = conn.execute(self._q(_REAP_LOCK), {"run_id": run_id, "token": token}
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

    # --- workers ------------------------------------------------------------------

    def register_worker(self, worker_id: str, *, version: str, queues: Sequence[str],
                        capabilities: dict[str, Any] | None = None) -> None:
        def work(conn: Connection) -> None:
            now = self._now(conn)
            conn.execute(insert(workers), {
                "worker_id": worker_id, "version": version, "queues": list(queues),
                "capabilities": capabilities or {}, "status": "READY", "started_at": now,
                "heartbeat_at": now})

        self._transaction(work)

    def set_worker_status(self, worker_id: str, status: str) -> bool:
        """Record the worker's status and heartbeat; answer whether an operator asked it
        to drain (``runlane workers drain``, migration 0020): the worker's heartbeat loop
        reads the request here, one statement as before. A worker asked to drain is
        DRAINING from this write on, whatever it said."""
        def work(conn: Connection) -> bool:
            row = conn.execute(
                self._q("UPDATE workers SET status = CASE WHEN drain_requested_at IS NOT NULL "
                        "AND CAST(:status AS VARCHAR(16)) = 'READY' THEN 'DRAINING' "
                        "ELSE CAST(:status AS VARCHAR(16)) END, heartbeat_at = {now} "
                        "WHERE worker_id = :worker_id RETURNING drain_requested_at"),
                {"status": status, "worker_id": worker_id, "now": self.clock.now()}).first()
            return row is not None and row.drain_requested_at is not None

        return self._transaction(work)

    # --- reads --------------------------------------------------------------------

    def list_runs(self, *, status: str | None = None, tenant: str | None = None,
                  limit: int = 1000) -> list[dict[str, Any]]:
        query = select(runs).order_by(runs.c.created_at, runs.c.run_id).limit(limit)
        if status:
            query = query.where(runs.c.status == status)
        if tenant is not None:
            query = query.where(runs.c.tenant == tenant)
        with self.reads.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    def get_run(self, run_id: str) -> dict[str, Any]:
        with self.reads.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.run_id == run_id)).first()
            if row is None:
                raise NotFound(f"no run {run_id!r}")
            run = dict(row._mapping)
            task = conn.execute(select(tasks).where(tasks.c.task_id == run["task_id"])).one()
            run["task"] = dict(task._mapping)
            run["depends_on"] = [r.depends_on for r in conn.execute(
                select(task_dependencies.c.depends_on)
                .where(task_dependencies.c.task_id == run["task_id"])
                .order_by(task_dependencies.c.depends_on))]
            run["attempts"] = [
                dict(a._mapping) for a in conn.execute(
                    text("SELECT * FROM attempts WHERE run_id = :r ORDER BY attempt_no"),
                    {"r": run_id})
            ]
            run["events"] = [
                dict(e._mapping) for e in conn.execute(
                    select(run_events).where(run_events.c.run_id == run_id)
                    .order_by(run_events.c.event_id))
            ]
            return run

    def waiting_count(self, queues: Sequence[str],
                      capabilities: dict[str, Any] | None = None) -> int:
        """Runs queued in these queues that these capabilities may serve, visible now
        or later (backoff)."""
        with self.reads.connect() as conn:
            routes = sorted(self._servable_routes(conn, capabilities))
            return int(conn.execute(self._q(reads_sql.WAITING_IN_ROUTES, "queues", "routes"),
                                    {"queues": list(queues), "routes": routes}).scalar() or 0)

    def has_ready_work(self, queues: Sequence[str],
                       capabilities: dict[str, Any] | None = None) -> bool:
        """Whether a claim in these queues with these capabilities may find a run now
        (a read: a worker looks before it claims, reads_sql.READY_IN_ROUTES)."""
        with self.reads.connect() as conn:
            routes = sorted(self._servable_routes(conn, capabilities))
            return conn.execute(self._q(reads_sql.READY_IN_ROUTES, "queues", "routes"),
                                {"queues": list(queues), "routes": routes,
                                 "now": self.clock.now()}).first() is not None

    def look(self, queues: Sequence[str], capabilities: dict[str, Any] | None = None
             ) -> Look:
        """A worker's look before it claims, one statement (reads_sql.LOOK_IN_QUEUES): whether
        a claim in these queues with these capabilities may find a run now, and if not,
        how soon the earliest run it may serve stops waiting out a backoff."""
        with self.reads.connect() as conn:
            rows = conn.execute(self._q(reads_sql.LOOK_IN_QUEUES, "queues"),
                                {"queues": list(queues), "now": self.clock.now()}).all()
        caps = parse_capabilities(capabilities or {})
        key = json.dumps(capabilities or {}, sort_keys=True)
        ready, next_in = False, None
        for r in rows:
            served = self._route_served.get((key, r.route_key))
            if served is None:
                served = self._route_served[(key, r.route_key)] = not r.route_key or \
                    satisfies(requirements_from_canonical(r.route_key), caps)
            if not served:
                continue
            if not r.ready_in:
                ready = True
            elif next_in is None or float(r.ready_in) < next_in:
                next_in = float(r.ready_in)
        return Look(ready, None if ready else next_in)

    def cancels_among(self, run_ids: Sequence[str]) -> set[str]:
        """Those of these runs whose cancel was requested (reads_sql.CANCELS_AMONG)."""
        if not run_ids:
            return set()
        with self.reads.connect() as conn:
            return {r.run_id for r in conn.execute(self._q(reads_sql.CANCELS_AMONG, "run_ids"),
                                                   {"run_ids": list(run_ids)})}

    def get_task(self, task_id: str) -> dict[str, Any]:
        with self.reads.connect() as conn:
            row = conn.execute(select(tasks).where(tasks.c.task_id == task_id)).first()
            if row is None:
                raise NotFound(f"no task {task_id!r}")
            return dict(row._mapping)

    # --- audit --------------------------------------------------------------------

    def audit(self) -> list[Violation]:
        """Check runlane's invariants on the live database."""
        found: list[Violation] = []
        params = {"now": self.clock.now(), "recheck": BLOCKED_LANE_RECHECK_SECONDS,
                  "max_uncharged_releases": self.max_uncharged_releases}
        with self.reads.connect() as conn:
            for check, statement in {**audit_sql.AUDIT_CHECKS, **msql.AUDIT_CHECKS}.items():
                used = {k: v for k, v in params.items() if f":{k}" in statement
                        or (k == "now" and "{now}" in statement)}
                for r in conn.execute(self._q(statement), used):
                    found.append(Violation(check, r.run_id, r.detail,
                                           lane_id=r._mapping.get("lane_id")))
            found.extend(self._audit_slots(conn))
            for r in conn.execute(text(audit_sql.AUDIT_TRANSITIONS)):
                source = S(r.from_status) if r.from_status else None
                if not is_allowed(source, S(r.to_status)):
                    found.append(Violation(
                        "illegal_transition", r.run_id,
                        f"{r.from_status} -> {r.to_status} ({r.n} event(s))"))
        return found
