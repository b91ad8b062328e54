"""The public Python API: one facade over the store, the same calls the CLI makes."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError

from runlane.agents.base import AttemptLimits
from runlane.api_activity import ActivityMixin
from runlane.api_approvals import ApprovalsMixin
from runlane.api_campaigns import CampaignsMixin
from runlane.api_common import InvalidArgument as InvalidArgument
from runlane.api_common import _first_line, _on_the_database
from runlane.api_common import shown_url as shown_url
from runlane.api_views import ViewsMixin
from runlane.clock import Clock
from runlane.codehost.base import CodeHost
from runlane.domain import tokens as secrets_
from runlane.domain.access import OPERATOR, Principal, Role, require_operator
from runlane.domain.policy import MAX_COUNT, parse_policy
from runlane.domain.routing import parse_requirements, requirements_to_mapping
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskInvalid, TaskSpec, parse_task, valid_name
from runlane.errors import (
    DatabaseUnavailable,
    Forbidden,
    NotFound,
    SchemaOutdated,
    Unauthenticated,
)
from runlane.models.events import EventPage, EventView
from runlane.models.fleet import PolicyApplied
from runlane.models.runs import RunDetail, Submission, TaskDetail, run_detail, task_detail
from runlane.models.tokens import CreatedToken, TokenInfo
from runlane.observability import metrics, tracing
from runlane.sandbox import Sandbox, SandboxConfig
from runlane.services.leader import MaintenanceLeader
from runlane.services.maintenance import (
    MaintenanceService,
    Reaper,
    ReaperConfig,
    Reconciler,
    ReconcilerConfig,
    worker_grace_seconds,
)
from runlane.services.retention import Pruner, RetentionConfig
from runlane.services.scheduler import Scheduler, SchedulerConfig
from runlane.settings import Settings, default_database_url, load_settings
from runlane.store import details, migrate, tokens
from runlane.store import events as events_store
from runlane.store.engine import build_engine, pooler_of
from runlane.store.engine import sqlite_file as _sqlite_file
from runlane.store.records import CancelResult, Violation
from runlane.store.records import Submission as StoreSubmission
from runlane.store.retry import retry_task
from runlane.store.store import Store
from runlane.store.wakeup import CLAIM_GATE_SUFFIX
from runlane.worker.attempt import AgentRunner, AttemptDriver, AttemptSettings, Judge
from runlane.worker.worker import Worker, WorkerConfig

# Attempts one worker process runs at once (threads): more is a typo.
MAX_CONCURRENCY = 1000
# Events one call of Runlane.events returns at most.
MAX_EVENTS_PAGE = 10_000

log = structlog.get_logger("runlane.api")


def _is_text(value: Any) -> bool:
    """Whether ``value`` is a string the database can be asked about: an argument that
    is not UTF-8 (``runlane runs show $'\\xff'``) reaches Python with surrogates, which
    no driver encodes; it names no run or task."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


class Runlane(ActivityMixin, ViewsMixin, CampaignsMixin, ApprovalsMixin):
    """Submit, cancel, inspect and audit runs.

    >>> lane = Runlane("sqlite:///runlane.db")          # doctest: +SKIP
    >>> lane.submit(tenant="acme", repo="/srv/git/app.git", prompt="fix the flaky test")
    """

    def __init__(self, database_url: str | None = None, *, settings: Settings | None = None,
                 clock: Clock | None = None, rng: random.Random | None = None,
                 connections: int | None = None) -> None:
        """``connections``: at most this many pooled PostgreSQL connections (a worker
        process: 1); None sizes the pool to the machine."""
        self.settings = settings or load_settings(database_url=database_url)
        metrics.set_enabled(self.settings.metrics)
        self._metrics_registry: CollectorRegistry | None = None
        self.store = Store(
            self.settings.database_url,
            clock=clock,
            retry_policy=self.settings.retry_policy(),
            payload_cap_bytes=self.settings.payload_cap_bytes,
            rng=rng,
            max_uncharged_releases=self.settings.max_uncharged_releases,
            engine=build_engine(
                self.settings.database_url, pool_size=connections,
                bounded=connections is not None,
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds),
            listen_url=self.settings.listen_database_url,
        )
        # Checked on first use (every call that reads or writes runs): a database never
        # upgraded otherwise fails with "no such table" deep in the first query.
        self._schema_checked = False

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Runlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema ---------------------------------------------------------------------

    def upgrade_schema(self) -> tuple[str | None, str | None]:
        url = self.store.engine.url
        path = _sqlite_file(url) if url.get_backend_name() == "sqlite" else None
        if path is not None and self.settings.database_url == default_database_url():
            # The default's directory (the user's state directory); a path given is
            # used as it is (a typo in it is refused, not created).
            path.parent.mkdir(parents=True, exist_ok=True)
        before_after = self._migrate_directly(migrate.upgrade)
        self._schema_checked = before_after[1] == migrate.head_revision()
        return before_after

    def _migrate_directly(self, run: Callable[[Engine], tuple[str | None, str | None]]
                          ) -> tuple[str | None, str | None]:
        """A migration holds a session-level lock and builds indexes outside a
        transaction: through a transaction pooler it runs on LISTEN_DATABASE_URL (the
        server itself), and without that is refused."""
        if pooler_of(self.settings.database_url) is None:
            return run(self.store.engine)
        direct = self.settings.listen_database_url
        if direct is None:
            raise InvalidArgument(
                "DATABASE_URL goes through a transaction pooler: a schema upgrade needs a "
                "session of its own; set LISTEN_DATABASE_URL (the server itself) or run "
                "`runlane db upgrade` with the server's URL")
        engine = build_engine(direct, pool_size=2, bounded=True)  # the lock, the work
        try:
            return run(engine)
        finally:
            engine.dispose()

    def check_schema(self) -> None:
        """Refuse to work on a database that is missing or behind, with the fix. Every
        other call runs it once itself; calling it up front fails earlier."""
        url = self.store.engine.url
        path = _sqlite_file(url) if url.get_backend_name() == "sqlite" else None
        if path is not None and not path.exists():
            raise SchemaOutdated(f"no database at {path}: run `runlane db upgrade`")
        try:
            current = migrate.current_revision(self.store.reads)
        except DBAPIError as exc:
            raise DatabaseUnavailable(
                f"cannot reach the database {shown_url(url)}: {_first_line(exc)}"
            ) from None
        migrate.refuse_newer(current)
        if current != migrate.head_revision():
            raise SchemaOutdated(
                f"database schema is at {current or 'nothing'}, runlane needs "
                f"{migrate.head_revision()}: run `runlane db upgrade`"
            )
        self._schema_checked = True

    # --- tasks and runs ------------------------------------------------------------

    @_on_the_database
    def submit(self, tenant: str, repo: str, prompt: str, *,
               principal: Principal = OPERATOR, **fields: Any) -> Submission:
        """Submit one task for ``tenant`` (a tenant token: its own only). The same
        tenant and idempotency key again returns the first task and run; with another
        request it raises Conflict and writes nothing."""
        _may_write(principal, "submit")
        _own_tenant(principal, tenant)
        raw = {"tenant": tenant, "repo": repo, "prompt": prompt,
               **{k: v for k, v in fields.items() if v is not None}}
        return self._submit([parse_task(raw)])[0]

    @_on_the_database
    def submit_batch(self, rows: Iterable[dict[str, Any]], *,
                     principal: Principal = OPERATOR) -> list[Submission]:
        """All or nothing: every row is validated (and, for a tenant token, of its
        tenant) before anything is written."""
        _may_write(principal, "submit")
        specs: list[TaskSpec] = []
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise TaskInvalid(f"line {number}", "is not a JSON object")
            where = f"line {number}: "
            specs.append(parse_task(_flag_names(row, where), where=where))
        for spec in specs:
            _own_tenant(principal, spec.tenant)
        return self._submit(specs)

    def _submit(self, specs: list[TaskSpec]) -> list[Submission]:
        """The store's submit inside one span per task (the start of its trace, kept on
        the task for its attempts: observability/tracing.py)."""
        with tracing.submit_spans(specs) as spans:
            done = self.store.submit(specs, default_max_attempts=self.settings.max_attempts,
                                     traceparents=spans.traceparents)
            spans.submitted(done)
        return [_submission(s) for s in done]

    @_on_the_database
    def cancel(self, task_id: str, *, principal: Principal = OPERATOR) -> CancelResult:
        """Cancel a task (given by its id or by one of its runs' ids)."""
        _may_write(principal, "cancel")
        return self.store.cancel(self.task_id_of(task_id, principal=principal))

    @_on_the_database
    def identify(self, some_id: str, *, principal: Principal = OPERATOR) -> Identified | None:
        """What ``some_id`` names: a task (with its newest run), a run (with its task),
        an API token or a worker; None if nothing the principal sees."""
        if not _is_text(some_id):
            return None
        found = details.identify(self.store, some_id)
        if found is None:
            return None
        if principal.tenant is not None and (found["kind"] not in ("task", "run")
                                             or not principal.sees(found["tenant"])):
            return None
        return Identified(kind=found["kind"], task_id=found["task_id"],
                          run_id=found["run_id"])

    def task_id_of(self, some_id: str, *, principal: Principal = OPERATOR) -> str:
        """The task ``some_id`` names: a task's id, or a run's (its task). NotFound
        says what else the id is, if anything."""
        found = self.identify(some_id, principal=principal)
        if found is None or found.task_id is None:
            raise NotFound(f"no task {some_id!r}"
                           + _other_kind(found, "a task's or a run's", "a run"))
        return found.task_id

    def run_id_of(self, some_id: str, *, principal: Principal = OPERATOR) -> str:
        """The run ``some_id`` names: a run's id, or a task's (its newest run)."""
        found = self.identify(some_id, principal=principal)
        if found is None or found.run_id is None:
            raise NotFound(f"no run {some_id!r}"
                           + _other_kind(found, "a run's or a task's", "a task"))
        return found.run_id

    @_on_the_database
    def retry(self, task_id: str, *, principal: Principal = OPERATOR) -> Submission:
        """A new run of a finished task (its newest run ended), linked to that run and
        admitted under the policy in force as a submit is. Conflict while the task's
        run is on its way."""
        _may_write(principal, "retry")
        task_id = self.task_id_of(task_id, principal=principal)
        return retry_task(self.store, task_id, tenant=principal.tenant,
                          default_max_attempts=self.settings.max_attempts)

    @_on_the_database
    def task(self, task_id: str, *, principal: Principal = OPERATOR) -> TaskDetail:
        """A task with its runs (oldest first), its parent and its children."""
        if not _is_text(task_id):
            raise NotFound(f"no task {task_id!r}")
        return task_detail(details.task_detail(self.store, task_id, principal.tenant))

    @_on_the_database
    def runs(self, *, status: str | None = None, tenant: str | None = None,
             limit: int = 1000) -> list[dict[str, Any]]:
        """Runs oldest first, at most ``limit`` (1..2**31-1); ``status`` in any case, as
        the CLI takes it. Bad arguments raise InvalidArgument (a ValueError)."""
        if status is not None:
            if not isinstance(status, str) or status.upper() not in RunStatus.__members__:
                raise InvalidArgument(f"status {status!r} is unknown; one of "
                                      f"{', '.join(RunStatus)}")
            status = status.upper()
        if tenant is not None and not (isinstance(tenant, str) and valid_name(tenant)):
            raise InvalidArgument(f"tenant {tenant!r} is not a tenant name")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_COUNT:
            raise InvalidArgument(f"limit {limit!r} is not an integer in 1..{MAX_COUNT}")
        return self.store.list_runs(status=status, tenant=tenant, limit=limit)

    @_on_the_database
    def run(self, run_id: str, *, principal: Principal = OPERATOR) -> RunDetail:
        """One run with its attempts (worker, lease, fencing token, stages, reason,
        cost), events, side effects, pull request and retry links."""
        if not _is_text(run_id):
            raise NotFound(f"no run {run_id!r}")
        return run_detail(details.run_detail(self.store, run_id, principal.tenant))

    # --- API tokens ------------------------------------------------------------------

    @_on_the_database
    def create_token(self, *, role: Role | str, tenant: str | None = None,
                     expires_at: datetime | None = None, name: str | None = None,
                     principal: Principal = OPERATOR) -> CreatedToken:
        """A new token; ``.token`` is its secret, returned this once (only its hash is
        stored). ``read`` and ``submit`` tokens are a tenant's; ``admin`` is every
        tenant's and takes none."""
        require_operator(principal, "create tokens")
        try:
            role = secrets_.parse_role(role)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if role is Role.ADMIN and tenant is not None:
            raise InvalidArgument("an admin token is for every tenant: give no tenant")
        if role is not Role.ADMIN and tenant is None:
            raise InvalidArgument(f"a {role.value} token is a tenant's: give its tenant")
        if tenant is not None and not (isinstance(tenant, str) and valid_name(tenant)):
            raise InvalidArgument(f"tenant {tenant!r} is not a tenant name")
        if name is not None and not (_is_text(name) and 0 < len(name) <= 255
                                     and name.isprintable()):
            raise InvalidArgument("name must be 1-255 printable characters")
        expires = None
        if expires_at is not None:
            if not isinstance(expires_at, datetime):
                raise InvalidArgument(f"expires_at {expires_at!r} is not a datetime")
            if expires_at.tzinfo is None:
                expires_at = expires_at.replace(tzinfo=UTC)
            expires = expires_at.timestamp()
            if expires <= (self.store.clock.now() or time.time()):
                raise InvalidArgument(f"expires_at {expires_at.isoformat()} is not in "
                                      "the future")
        token_id = secrets_.new_token_id()
        secret = secrets_.new_secret(token_id)
        row = tokens.insert_token(self.store, token_id=token_id, tenant=tenant,
                                  role=role.value, name=name,
                                  secret_sha256=secrets_.secret_hash(secret),
                                  expires_at=expires)
        log.info("token_created", token_id=token_id, tenant=tenant, role=role.value)
        return CreatedToken(token=secret, info=_token_info(row, row["created_at"]))

    @_on_the_database
    def tokens(self, *, principal: Principal = OPERATOR) -> list[TokenInfo]:
        """Every token, oldest first, with its state (never a secret)."""
        require_operator(principal, "list tokens")
        rows, now = tokens.list_tokens(self.store)
        return [_token_info(r, now) for r in rows]

    @_on_the_database
    def revoke_token(self, token_id: str, *, principal: Principal = OPERATOR) -> TokenInfo:
        """Revoke a token at once (its next request is refused); revoking again keeps
        the first time."""
        require_operator(principal, "revoke tokens")
        if not _is_text(token_id):
            raise NotFound(f"no token {token_id!r}")
        row = tokens.revoke_token_row(self.store, token_id)
        log.info("token_revoked", token_id=token_id)
        return _token_info(row, row["revoked_at"])

    @_on_the_database
    def authenticate(self, secret: str) -> Principal:
        """The principal of a bearer token, or Unauthenticated (one message whether it
        is unknown, revoked, expired or malformed). The hash comparison takes the same
        time however much of it matches; a failure is logged with at most the first
        digits of the id the secret claimed, never the secret."""
        token_id = secrets_.token_id_of(secret) if _is_text(secret) else None
        row = tokens.token_row(self.store, token_id) if token_id else None
        why = None
        if row is None:
            secrets_.hashes_match(str(secret), "0" * 64)  # as long as a real check
            why = "malformed" if token_id is None else "unknown"
        elif not secrets_.hashes_match(secret, row["secret_sha256"]):
            why = "mismatch"
        elif row["revoked_at"] is not None:
            why = "revoked"
        elif row["expires_at"] is not None and row["expires_at"] <= row["now"]:
            why = "expired"
        if why is not None or row is None:
            log.warning("authentication_failed", token_id_prefix=secrets_.shown_id(token_id),
                        reason=why)
            raise Unauthenticated(secrets_.REFUSED)
        tokens.token_used(self.store, row["token_id"], float(row["now"]))
        return Principal(role=Role(row["role"]), tenant=row["tenant"],
                         token_id=row["token_id"])

    @_on_the_database
    def audit(self, *, remote_checks: bool = False, limit: int = 1000,
              code_host_for: Callable[[str], CodeHost] | None = None,
              principal: Principal = OPERATOR) -> list[Violation]:
        """The invariants on the database; with ``remote_checks``, also the code host's
        side of pull-request evidence for at most ``limit`` runs that ended without
        success with a push or a pull request in their ledger
        (``services/evidence_audit.py``). The operator's only."""
        require_operator(principal, "run the audit")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_COUNT:
            raise InvalidArgument(f"limit {limit!r} is not an integer in 1..{MAX_COUNT}")
        found = self.store.audit()
        if remote_checks:
            from runlane.codehost.factory import code_host_for as default_code_host_for
            from runlane.services.evidence_audit import remote_audit

            found.extend(remote_audit(self.store, code_host_for or default_code_host_for,
                                      limit=limit).violations)
        return found

    @_on_the_database
    def apply_policy(self, text: str, *, source: str = "<api>",
                     principal: Principal = OPERATOR) -> PolicyApplied:
        """Validate the policy ``text`` (TOML) and store it as a new numbered version,
        none if it is unchanged. The operator's only; a bad policy raises PolicyInvalid
        naming the field and the problem, and nothing is stored."""
        require_operator(principal, "apply a policy")
        if not _is_text(text):
            raise InvalidArgument("the policy must be TOML text")
        applied = self.store.apply_policy(parse_policy(text, source), source=source)
        return PolicyApplied(version=applied.version, digest=applied.digest,
                             created=applied.created)

    # --- the event stream --------------------------------------------------------------

    @_on_the_database
    def events(self, *, principal: Principal = OPERATOR, after: str | None = None,
               limit: int = 500) -> list[EventView]:
        """Run transitions in commit order after the cursor ``after`` (None: from the
        first), at most ``limit`` (1..10000), of the principal's tenant only (every
        tenant for an admin). Each event's ``cursor`` resumes after it, with nothing
        missed and nothing twice (store/events.py says how on PostgreSQL)."""
        return self.events_page(principal=principal, after=after, limit=limit).items

    @_on_the_database
    def events_page(self, *, principal: Principal = OPERATOR, after: str | None = None,
                    limit: int = 500) -> EventPage:
        """``events`` with the cursor to go on from (``next``), which a tenant's reader
        should prefer to its last event's: it is past other tenants' events read."""
        if isinstance(limit, bool) or not isinstance(limit, int) \
                or not 1 <= limit <= MAX_EVENTS_PAGE:
            raise InvalidArgument(f"limit {limit!r} is not an integer in 1..{MAX_EVENTS_PAGE}")
        position = events_store.START
        if after is not None:
            parsed = events_store.parse_cursor(after) if _is_text(after) else None
            if parsed is None:
                raise InvalidArgument(f"after {after!r} is not an event cursor "
                                      "(the id of an event of this stream)")
            position = parsed
        rows, end = events_store.events_after(self.store.reads, position,
                                              tenant=principal.tenant, limit=limit)
        return EventPage(
            items=[EventView.from_row(r, events_store.format_cursor((r["tx_id"],
                                                                     r["event_id"])))
                   for r in rows],
            next=events_store.format_cursor(end))

    @_on_the_database
    def events_tail(self) -> str:
        """The cursor of "now": ``events(after=events_tail())`` gives only events not
        deliverable yet when it was taken (a live view's start)."""
        return events_store.format_cursor(events_store.events_tail(self.store.reads))

    # --- maintenance ------------------------------------------------------------------

    def reaper(self) -> Reaper:
        return Reaper(self.store, ReaperConfig(
            interval_seconds=self.settings.reaper_interval_seconds))

    def reconciler(self) -> Reconciler:
        s = self.settings
        return Reconciler(self.store, ReconcilerConfig(
            interval_seconds=max(s.reaper_interval_seconds, 10.0),
            worker_grace_seconds=worker_grace_seconds(s.heartbeat_seconds, s.lease_ttl_seconds),
            max_attempt_seconds=s.max_attempt_seconds))

    def scheduler(self) -> Scheduler:
        return Scheduler(self.store, SchedulerConfig(
            interval_seconds=self.settings.reaper_interval_seconds,
            default_max_attempts=self.settings.max_attempts))

    def pruner(self) -> Pruner | None:
        """The retention job, unless RETENTION_DAYS is 0 (keep finished runs forever)."""
        days = self.settings.retention_days
        return Pruner(self.store, RetentionConfig(keep_days=days)) if days > 0 else None

    def maintenance_services(self) -> list[MaintenanceService]:
        """Reaper, reconciler, scheduler (campaigns, notifications) and retention."""
        return [svc for svc in (self.reaper(), self.reconciler(), self.scheduler(),
                                self.pruner()) if svc is not None]

    def maintenance_leader(self) -> MaintenanceLeader:
        """The services above, run while this node is the database's maintenance leader
        (services/leader.py): one node of several runs them at a time."""
        from runlane.services.leader import retry_seconds
        from runlane.store.leadership import maintenance_lock

        every = retry_seconds(self.settings.lease_ttl_seconds)
        lock = maintenance_lock(self.store.url,
                                listen_database_url=self.settings.listen_database_url,
                                check_seconds=every)
        return MaintenanceLeader(lock,
                                 self.maintenance_services, retry_seconds=every)

    @_on_the_database
    def pull_requests(self) -> list[dict[str, Any]]:
        return self.store.pull_requests()

    @_on_the_database
    def worker(self, *, agent: AgentRunner | None = None, agent_command: str | None = None,
               verify_command: str | None = None, judge: Judge | None = None,
               queues: list[str] | None = None, concurrency: int = 1,
               capabilities: dict[str, Any] | None = None, exit_when_idle: bool = False,
               limits: AttemptLimits | None = None, keep_failed_workspaces: bool = False,
               code_host_for: Callable[[str], CodeHost] | None = None,
               sandbox_slots: int | None = None) -> Worker:
        """A worker over this database; ``agent`` (an in-process runner) or
        ``agent_command`` (the agent-command protocol) does the work. ``sandbox_slots``
        (else the setting): the sandboxes it may have at once; it claims no more runs
        than min(concurrency, sandbox_slots), one sandbox per attempt."""
        from runlane.agents.command import CommandRunner
        from runlane.codehost.factory import code_host_for as default_code_host_for
        from runlane.sandbox.guard import start as start_guard

        _check_worker_arguments(queues, concurrency)
        s = self.settings
        slots = sandbox_slots if sandbox_slots is not None else s.sandbox_slots
        if slots is not None:
            if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
                raise InvalidArgument(f"sandbox_slots {slots!r} is not an integer >= 1")
            concurrency = min(concurrency, slots)
        if agent is None and (not agent_command or not agent_command.strip()):
            raise InvalidArgument("a worker needs an agent command (--agent-command)")
        attempts = AttemptSettings(workspace_root=s.workspace_dir, artifacts_root=s.artifacts_dir,
                                   limits=limits or AttemptLimits(),
                                   keep_failed_workspaces=keep_failed_workspaces)
        attempts.check_directories()  # before the worker claims anything
        sandbox = self.sandbox(attempts.workspace_root, attempts.artifacts_root)
        if agent is None or verify_command:  # a command will run: it must be able to
            sandbox.check(workspace_root=attempts.workspace_root,
                          artifacts_root=attempts.artifacts_root)
            start_guard()
        if agent is None:
            assert agent_command is not None
            agent = CommandRunner(agent_command, sandbox=sandbox,
                                  term_grace_seconds=s.agent_term_grace_seconds)
        verifier = (CommandRunner(verify_command, sandbox=sandbox,
                                  term_grace_seconds=s.agent_term_grace_seconds)
                    if verify_command else None)
        driver = AttemptDriver(
            self.store, agent, attempts,
            code_host_for=code_host_for or default_code_host_for, verifier=verifier,
            judge=judge)
        return Worker(self.store, driver, WorkerConfig(
            queues=queues or ["default"], concurrency=concurrency,
            capabilities=capabilities or {}, lease_ttl_seconds=s.lease_ttl_seconds,
            heartbeat_seconds=s.heartbeat_seconds, drain_grace_seconds=s.drain_grace_seconds,
            agent_term_grace_seconds=s.agent_term_grace_seconds,
            exit_when_idle=exit_when_idle, change_poll_seconds=s.change_poll_seconds,
            idle_poll_max_seconds=s.idle_poll_max_seconds))

    @_on_the_database
    def unserved(self, *, queues: list[str], capabilities: dict[str, Any] | None = None
                 ) -> list[tuple[int, str]]:
        """Queued runs a worker on ``queues`` with ``capabilities`` cannot serve, as
        (count, why) per queue or requirement set: what `worker --exit-when-idle`
        leaves behind."""
        from runlane.domain.routing import parse_capabilities, requirements_from_canonical
        from runlane.domain.routing import unmet as unmet_requirements

        caps = parse_capabilities(capabilities or {})
        left: list[tuple[int, str]] = []
        other_queues: dict[str, int] = {}
        for queue, route_key, queued in self.store.queued_by_route():
            if queue not in queues:
                other_queues[queue] = other_queues.get(queue, 0) + queued
                continue
            why = unmet_requirements(requirements_from_canonical(route_key), caps)
            if why:
                left.append((queued, f"in queue {queue} needing {route_key} "
                                     f"(unmet: {'; '.join(why)})"))
        left += [(n, f"in queue {q}, which it does not serve (--queue {q})")
                 for q, n in sorted(other_queues.items())]
        return left

    def sandbox(self, workspace_root: Path | None = None,
                artifacts_root: Path | None = None) -> Sandbox:
        """The sandbox of this lane's agent and verify commands, from the settings
        (SANDBOX, SANDBOX_READ_ONLY_PATHS, SANDBOX_PASS_ENV). What the worker runs on is
        hidden from them wherever it lies: the SQLite file (and its -wal, -shm and
        -journal), the local forge, the workspace and artifacts roots (other runs'
        clones and logs); the home directory and runlane.toml always are."""
        from runlane.codehost.local_forge import default_forge_dir

        s = self.settings
        hidden = [str(default_forge_dir()),
                  str(Path(workspace_root or s.workspace_dir).expanduser().absolute()),
                  str(Path(artifacts_root or s.artifacts_dir).expanduser().absolute())]
        url = make_url(s.database_url)
        database = _sqlite_file(url) if url.get_backend_name() == "sqlite" else None
        if database is not None:
            hidden += [str(database.expanduser().absolute()) + suffix
                       for suffix in ("", "-wal", "-shm", "-journal", CLAIM_GATE_SUFFIX)]
        return Sandbox(SandboxConfig(
            mode=s.sandbox, read_only_paths=tuple(str(p) for p in s.sandbox_read_only_paths),
            pass_env=s.sandbox_pass_env, hidden_paths=tuple(hidden)))

    # --- metrics (docs/metrics.md) -----------------------------------------------------

    def metrics_registry(self, *, database_gauges: bool = True) -> CollectorRegistry:
        """What a scrape of this process shows: its counts (with ``up``'s workers', in
        multiprocess mode) and, unless ``database_gauges`` is false (a worker), the
        database's gauges, read at most once per METRICS_CACHE_SECONDS."""
        if not database_gauges:
            return metrics.registry()
        if self._metrics_registry is None:
            from runlane.observability.gauges import DatabaseGauges

            self._metrics_registry = metrics.registry(DatabaseGauges(
                self.store, cache_seconds=self.settings.metrics_cache_seconds))
        return self._metrics_registry

    def metrics(self, *, principal: Principal = OPERATOR) -> tuple[bytes, str]:
        """The text exposition of ``metrics_registry()`` and its content type. The
        operator's only (an admin token on the HTTP API): the figures are every
        tenant's."""
        require_operator(principal, "read the metrics")
        return metrics.render(self.metrics_registry())

    def serve_metrics(self, port: int, *, database_gauges: bool = True) -> Callable[[], None]:
        """``metrics_registry()`` on ``--metrics-port`` (METRICS_HOST), unauthenticated;
        returns the function that stops it."""
        return metrics.serve(self.metrics_registry(database_gauges=database_gauges),
                             self.settings.metrics_host, port)

    @_on_the_database
    def maintain_once(self) -> dict[str, int]:
        pruner = self.pruner()
        return {**self.reaper().run_once(), **self.reconciler().run_once(),
                **self.scheduler().run_once(), **(pruner.run_once() if pruner else {})}


@dataclass(frozen=True)
class Identified:
    """What an id names (``Runlane.identify``): ``kind`` task, run, token or worker;
    for a task, ``run_id`` is its newest run; for a run, ``task_id`` its task."""

    kind: str
    task_id: str | None = None
    run_id: str | None = None


KIND_NAMES = {"task": "a task's", "run": "a run's", "token": "an API token's",
              "worker": "a worker's"}


def _other_kind(found: Identified | None, wanted: str, other: str) -> str:
    """The end of a NotFound: an id of another kind says what it is."""
    if found is None:
        return f" (nor {other} of that id)"
    return f": it is {KIND_NAMES[found.kind]} id, not {wanted}"


def _submission(s: StoreSubmission) -> Submission:
    return Submission(task_id=s.task_id, run_id=s.run_id, status=s.status, created=s.created,
                      reason_code=s.reason_code, truncated_sections=s.truncated_sections,
                      payload_bytes=s.payload_bytes)


def _may_write(principal: Principal, what: str) -> None:
    """A ``read`` principal never writes (HTTP 403)."""
    if not principal.can_submit:
        raise Forbidden(f"a {principal.role.value} token may not {what}")


def _own_tenant(principal: Principal, tenant: Any) -> None:
    """A tenant's token writes for its own tenant only (HTTP 403)."""
    if principal.tenant is not None and tenant != principal.tenant:
        raise Forbidden(f"this token is tenant {principal.tenant!r}'s: it may not write "
                        f"for tenant {tenant!r}")


def _token_info(row: dict[str, Any], now: float) -> TokenInfo:
    state = "active"
    if row["revoked_at"] is not None:
        state = "revoked"
    elif row["expires_at"] is not None and row["expires_at"] <= now:
        state = "expired"
    return TokenInfo.model_validate({
        **{k: row[k] for k in ("token_id", "tenant", "role", "name")},
        **{k: None if row[k] is None else datetime.fromtimestamp(row[k], UTC)
           for k in ("created_at", "expires_at", "revoked_at", "last_used_at")},
        "state": state})


# A batch line may also use the names of `runlane submit`'s flags (the documented rule: "the
# same fields as the flags, snake_case"): `require` is a list of the flag's KEY=VALUE
# strings, the others take the field's value.
FLAG_NAMES = {"require": "requires", "estimated_cost": "estimated_cost_usd",
              "parent": "parent_task_id"}


def _flag_names(row: dict[str, Any], where: str) -> dict[str, Any]:
    """``row`` with the flags' names of fields replaced by the fields' own names."""
    if not FLAG_NAMES.keys() & row.keys():
        return row
    row = dict(row)
    for flag, field in FLAG_NAMES.items():
        if flag not in row:
            continue
        if field in row:
            raise TaskInvalid(f"{where}{flag}", f"is {field} by another name: give one")
        value = row.pop(flag)
        if flag == "require":
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise TaskInvalid(f"{where}require", "is a list of KEY=VALUE strings")
            try:
                value = requirements_to_mapping(parse_requirements(values))
            except ValueError as exc:
                raise TaskInvalid(f"{where}require", str(exc)) from None
        row[field] = value
    return row


def _check_worker_arguments(queues: Any, concurrency: Any) -> None:
    """What `runlane worker` refuses as bad input: a worker on no queue, a malformed
    queue name or no slot would serve nothing, silently (``queues="default"`` is seven
    one-letter queues)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) \
            or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise InvalidArgument(f"concurrency {concurrency!r} is not an integer in "
                              f"1..{MAX_CONCURRENCY}")
    if queues is None:
        return
    if isinstance(queues, str) or not isinstance(queues, (list, tuple)):
        raise InvalidArgument(f"queues must be a list of queue names, not {queues!r}")
    if not queues:
        raise InvalidArgument("queues is empty: give at least one queue, or None for "
                              "'default'")
    for queue in queues:
        if not (isinstance(queue, str) and valid_name(queue)):
            raise InvalidArgument(f"{queue!r} is not a queue name (1-128 characters of "
                                  "letters, digits and ._:@/-)")
