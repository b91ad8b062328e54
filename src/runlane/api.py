"""The public Python API: one facade over the store, the same calls the CLI makes."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from runlane.agents.base import AttemptLimits
from runlane.clock import Clock
from runlane.codehost.base import CodeHost
from runlane.domain.tasks import TaskInvalid, TaskSpec, parse_task
from runlane.errors import DatabaseUnavailable, RunlaneError, SchemaOutdated
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


class Runlane:
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
            engine=build_engine(
                self.settings.database_url,
                idle_in_transaction_timeout=self.settings.idle_in_transaction_timeout_seconds),
        )

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Runlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- schema ---------------------------------------------------------------------

    def upgrade_schema(self) -> tuple[str | None, str | None]:
        return migrate.upgrade(self.store.engine)

    def check_schema(self) -> None:
        """Refuse to work on a database that is missing or behind, with the fix."""
        url = self.store.engine.url
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:") \
                and not Path(url.database).exists():
            raise SchemaOutdated(f"no database at {url.database}: run `runlane db upgrade`")
        try:
            current = migrate.current_revision(self.store.reads)
        except DBAPIError as exc:
            raise DatabaseUnavailable(
                f"cannot reach the database {self.store.engine.url!r}: "
                f"{str(exc.orig).strip().splitlines()[0]}"
            ) from None
        migrate.refuse_newer(current)
        if current != migrate.head_revision():
            raise SchemaOutdated(
                f"database schema is at {current or 'nothing'}, runlane needs "
                f"{migrate.head_revision()}: run `runlane db upgrade`"
            )

    # --- tasks and runs ------------------------------------------------------------

    def submit(self, tenant: str, repo: str, prompt: str, **fields: Any) -> Submission:
        raw = {"tenant": tenant, "repo": repo, "prompt": prompt,
               **{k: v for k, v in fields.items() if v is not None}}
        return self.store.submit([parse_task(raw)],
                                 default_max_attempts=self.settings.max_attempts)[0]

    def submit_batch(self, rows: Iterable[dict[str, Any]]) -> list[Submission]:
        """All or nothing: every row is validated before anything is written."""
        specs: list[TaskSpec] = []
        for number, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise TaskInvalid(f"line {number}", "is not a JSON object")
            specs.append(parse_task(row, where=f"line {number}: "))
        return self.store.submit(specs, default_max_attempts=self.settings.max_attempts)

    def cancel(self, task_id: str) -> CancelResult:
        return self.store.cancel(task_id)

    def runs(self, *, status: str | None = None, tenant: str | None = None,
             limit: int = 1000) -> list[dict[str, Any]]:
        return self.store.list_runs(status=status, tenant=tenant, limit=limit)

    def run(self, run_id: str) -> dict[str, Any]:
        return self.store.get_run(run_id)

    def audit(self) -> list[Violation]:
        return self.store.audit()

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

    def pull_requests(self) -> list[dict[str, Any]]:
        return self.store.pull_requests()

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

        s = self.settings
        if agent is None:
            if not agent_command:
                raise RunlaneError("a worker needs an agent command (--agent-command)")
            agent = CommandRunner(agent_command, term_grace_seconds=s.agent_term_grace_seconds)
        verifier = (CommandRunner(verify_command, term_grace_seconds=s.agent_term_grace_seconds)
                    if verify_command else None)
        driver = AttemptDriver(
            self.store, agent,
            AttemptSettings(workspace_root=s.workspace_dir, artifacts_root=s.artifacts_dir,
                            limits=limits or AttemptLimits(),
                            keep_failed_workspaces=keep_failed_workspaces),
            code_host_for=code_host_for or default_code_host_for, verifier=verifier,
            judge=judge)
        return Worker(self.store, driver, WorkerConfig(
            queues=queues or ["default"], concurrency=concurrency,
            capabilities=capabilities or {}, lease_ttl_seconds=s.lease_ttl_seconds,
            heartbeat_seconds=s.heartbeat_seconds, drain_grace_seconds=s.drain_grace_seconds,
            agent_term_grace_seconds=s.agent_term_grace_seconds,
            exit_when_idle=exit_when_idle))

    def maintain_once(self) -> dict[str, int]:
        pruner = self.pruner()
        return {**self.reaper().run_once(), **self.reconciler().run_once(),
                **self.scheduler().run_once(), **(pruner.run_once() if pruner else {})}
