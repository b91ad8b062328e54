"""The public Python API: one facade over the store, the same calls the CLI makes."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, unquote, urlsplit

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from runlane.agents.base import AttemptLimits
from runlane.api_views import ViewsMixin
from runlane.clock import Clock
from runlane.codehost.base import CodeHost
from runlane.domain.policy import MAX_COUNT
from runlane.domain.routing import parse_requirements, requirements_to_mapping
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskInvalid, TaskSpec, parse_task, valid_name
from runlane.errors import DatabaseUnavailable, NotFound, RunlaneError, SchemaOutdated
from runlane.sandbox import Sandbox, SandboxConfig
from runlane.services.maintenance import (
    Reaper,
    ReaperConfig,
    Reconciler,
    ReconcilerConfig,
    worker_grace_seconds,
)
from runlane.services.retention import Pruner, RetentionConfig
from runlane.services.scheduler import Scheduler, SchedulerConfig
from runlane.settings import Settings, load_settings
from runlane.store import migrate
from runlane.store.engine import build_engine
from runlane.store.store import CancelResult, Store, Submission, Violation
from runlane.worker.attempt import AgentRunner, AttemptDriver, AttemptSettings, Judge
from runlane.worker.worker import Worker, WorkerConfig

# Attempts one worker process runs at once (threads): more is a typo.
MAX_CONCURRENCY = 1000

F = TypeVar("F", bound=Callable[..., Any])


class InvalidArgument(RunlaneError, ValueError):
    """A call's argument that the CLI would refuse as bad input (exit 2)."""

    exit_code = 2


def _first_line(exc: DBAPIError) -> str:
    return (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0]


def _sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL, or None for an in-memory database. A URI filename
    (``sqlite:///file:/srv/runlane.db?mode=ro&uri=true``, SQLAlchemy's documented way to
    open the file read-only) names its file in the URI's path."""
    database = url.database
    if url.query.get("uri") in ("true", "1") and database and database.startswith("file:"):
        parts = urlsplit(database)
        if parse_qs(parts.query).get("mode") == ["memory"] \
                or url.query.get("mode") == "memory":
            return None
        database = unquote(parts.path)
    if database in (None, "", ":memory:"):
        return None
    return Path(database)


def _on_the_database(method: F) -> F:
    """Check the schema on a lane's first use, and report a database that is down or
    unusable as runlane's DatabaseUnavailable (as the CLI does), not a driver error
    with the SQL in it. Errors of the data itself (a constraint, a bad value) pass."""

    @functools.wraps(method)
    def wrapper(self: Runlane, *args: Any, **kwargs: Any) -> Any:
        if not self._schema_checked:
            self.check_schema()
        try:
            return method(self, *args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            raise DatabaseUnavailable(
                f"database {shown_url(self.store.engine.url)}: {_first_line(exc)}") from exc

    return cast(F, wrapper)


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


def shown_url(url: URL) -> str:
    """The URL as the user wrote it, password hidden: SQLAlchemy's rendering
    percent-encodes the database part (``sqlite:///file%3A/...`` for ``file:/...``)."""
    return unquote(url.render_as_string(hide_password=True))


class Runlane(ViewsMixin):
    """Submit, cancel, inspect and audit runs.

    >>> lane = Runlane("sqlite:///runlane.db")          # doctest: +SKIP
    >>> lane.submit(tenant="acme", repo="/srv/git/app.git", prompt="fix the flaky test")
    """

    def __init__(self, database_url: str | None = None, *, settings: Settings | None = None,
                 clock: Clock | None = None, rng: random.Random | None = None) -> None:
        self.settings = settings or load_settings(database_url=database_url)
        self.store = Store(
            self.settings.database_url,
            clock=clock,
            retry_policy=self.settings.retry_policy(),
            payload_cap_bytes=self.settings.payload_cap_bytes,
            rng=rng,
            max_uncharged_releases=self.settings.max_uncharged_releases,
            engine=build_engine(
                self.settings.database_url,
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds),
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
        before_after = migrate.upgrade(self.store.engine)
        self._schema_checked = before_after[1] == migrate.head_revision()
        return before_after

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
    def submit(self, tenant: str, repo: str, prompt: str, **fields: Any) -> Submission:
        raw = {"tenant": tenant, "repo": repo, "prompt": prompt,
               **{k: v for k, v in fields.items() if v is not None}}
        return self.store.submit([parse_task(raw)],
                                 default_max_attempts=self.settings.max_attempts)[0]

    @_on_the_database
    def submit_batch(self, rows: Iterable[dict[str, Any]]) -> list[Submission]:
        """All or nothing: every row is validated before anything is written."""
        specs: list[TaskSpec] = []
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise TaskInvalid(f"line {number}", "is not a JSON object")
            where = f"line {number}: "
            specs.append(parse_task(_flag_names(row, where), where=where))
        return self.store.submit(specs, default_max_attempts=self.settings.max_attempts)

    @_on_the_database
    def cancel(self, task_id: str) -> CancelResult:
        if not _is_text(task_id):
            raise NotFound(f"no task {task_id!r}")
        return self.store.cancel(task_id)

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
    def run(self, run_id: str) -> dict[str, Any]:
        if not _is_text(run_id):
            raise NotFound(f"no run {run_id!r}")
        return self.store.get_run(run_id)

    @_on_the_database
    def audit(self, *, remote_checks: bool = False, limit: int = 1000,
              code_host_for: Callable[[str], CodeHost] | None = None) -> list[Violation]:
        """The invariants on the database; with ``remote_checks``, also the code host's
        side of pull-request evidence for at most ``limit`` runs that ended without
        success with a push or a pull request in their ledger
        (``services/evidence_audit.py``)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_COUNT:
            raise InvalidArgument(f"limit {limit!r} is not an integer in 1..{MAX_COUNT}")
        found = self.store.audit()
        if remote_checks:
            from runlane.codehost.factory import code_host_for as default_code_host_for
            from runlane.services.evidence_audit import remote_audit

            found.extend(remote_audit(self.store, code_host_for or default_code_host_for,
                                      limit=limit).violations)
        return found

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
            interval_seconds=self.settings.reaper_interval_seconds))

    def pruner(self) -> Pruner | None:
        """The retention job, unless RETENTION_DAYS is 0 (keep finished runs forever)."""
        days = self.settings.retention_days
        return Pruner(self.store, RetentionConfig(keep_days=days)) if days > 0 else None

    @_on_the_database
    def pull_requests(self) -> list[dict[str, Any]]:
        return self.store.pull_requests()

    @_on_the_database
    def worker(self, *, agent: AgentRunner | None = None, agent_command: str | None = None,
               verify_command: str | None = None, judge: Judge | None = None,
               queues: list[str] | None = None, concurrency: int = 1,
               capabilities: dict[str, Any] | None = None, exit_when_idle: bool = False,
               limits: AttemptLimits | None = None, keep_failed_workspaces: bool = False,
               code_host_for: Callable[[str], CodeHost] | None = None) -> Worker:
        """A worker over this database; ``agent`` (an in-process runner) or
        ``agent_command`` (the CONTRACT.md protocol) does the work."""
        from runlane.agents.command import CommandRunner
        from runlane.codehost.factory import code_host_for as default_code_host_for
        from runlane.sandbox.guard import start as start_guard

        _check_worker_arguments(queues, concurrency)
        s = self.settings
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
            exit_when_idle=exit_when_idle))

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
                       for suffix in ("", "-wal", "-shm", "-journal")]
        return Sandbox(SandboxConfig(
            mode=s.sandbox, read_only_paths=tuple(str(p) for p in s.sandbox_read_only_paths),
            pass_env=s.sandbox_pass_env, hidden_paths=tuple(hidden)))

    @_on_the_database
    def maintain_once(self) -> dict[str, int]:
        pruner = self.pruner()
        return {**self.reaper().run_once(), **self.reconciler().run_once(),
                **self.scheduler().run_once(), **(pruner.run_once() if pruner else {})}


# A batch line may also use the names of `runlane submit`'s flags (CONTRACT.md: "the
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
