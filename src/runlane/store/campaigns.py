"""The campaigns' half of the store: create, the rollout's release and dispatch, the
stop rule at each run's end, pause/resume/stop/retry-failed, and the summary.

Design (docs/campaigns.md): a target gets its task only when the rollout dispatches
it. Creating a campaign writes its row and one row per target, nothing in the queue;
the scheduler pass (``campaign_pass``) releases batches (a compare-and-set on the
campaign's batch counter) and dispatches pending targets of released batches as the
campaign's concurrency allows, submitting their tasks (idempotency key derived from
campaign and target) in the transaction that marks them dispatched. Every run's end
(``_campaign_runs_ended``, called by the store's two terminal writes) records the
target's outcome and evaluates the stop rule in the transaction of that end.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import structlog
from sqlalchemy import Connection

from runlane.domain.campaigns import (
    BatchProgress,
    Campaign,
    CampaignStatus,
    Concurrency,
    Notify,
    Rollout,
    StopRule,
    Target,
    TargetState,
    TaskFields,
    next_batch_due,
    render_prompt,
)
from runlane.domain.ids import new_id
from runlane.domain.reasons import Reason
from runlane.domain.repos import canonical_repo
from runlane.domain.states import LEASED, RunStatus
from runlane.domain.tasks import TaskSpec, enforce_payload_cap, task_digest
from runlane.errors import Conflict, NotFound
from runlane.faults import crash_point
from runlane.store import campaigns_sql as csql

if TYPE_CHECKING:
    from collections import Counter
    from contextlib import AbstractContextManager

    from runlane.clock import Clock
    from runlane.store.records import CancelResult, Submission

log = structlog.get_logger("runlane.store")
S = RunStatus
C = CampaignStatus
T = TypeVar("T")
# A run held by its campaign's pause waits in WAITING_CAPACITY with this visible_at (no
# scheduler pass re-admits it: policy_sql.DUE_WAITING skips CAMPAIGN_PAUSED); the resume queues it.
PAUSE_HOLD_AT = 32503680000.0  # 3000-01-01
# Targets read per dispatch for each free slot (some may wait for their repository).
DISPATCH_SCAN = 4
NOTIFY_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class CampaignConfig:
    """A stored campaign's terms (its document: the file without its targets)."""

    name: str
    tenant: str
    owner: str | None
    prompt: str
    task: TaskFields
    rollout: Rollout
    concurrency: Concurrency
    stop: StopRule
    notify: Notify

    @staticmethod
    def of(document: Any) -> CampaignConfig:
        doc = json.loads(document) if isinstance(document, str) else document
        return CampaignConfig(
            name=doc["name"], tenant=doc["tenant"], owner=doc.get("owner"),
            prompt=doc["prompt"], task=TaskFields.model_validate(doc["task"]),
            rollout=Rollout.model_validate(doc["rollout"]),
            concurrency=Concurrency.model_validate(doc["concurrency"]),
            stop=StopRule.model_validate(doc["stop"]), notify=Notify.model_validate(doc["notify"]))

    @property
    def notifies(self) -> bool:
        return bool(self.notify.webhook_url or self.notify.log_file)


@dataclass(frozen=True)
class _Ended:
    """A target's end as SQLite's statements return it (TARGET_END_PG's row's fields)."""

    position: int
    batch: int
    repo: str
    owner: str | None
    task_id: str
    status: str
    active: int
    recent: str


@dataclass(frozen=True)
class CampaignCreated:
    campaign_id: str
    created: bool
    targets: int


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def target_state(status: RunStatus) -> TargetState:
    if status is S.SUCCEEDED:
        return TargetState.SUCCEEDED
    if status is S.CANCELLED:
        return TargetState.CANCELLED
    return TargetState.FAILED


class CampaignMixin:
    if TYPE_CHECKING:
        clock: Clock
        dialect: str
        payload_cap_bytes: int

        def _q(self, statement: str, *expanding: str) -> Any: ...
        def _transaction(self, work: Callable[[Connection], T], *,
                         autocommit: bool = False) -> T: ...
        def _bulk_insert(self, conn: Connection, table: Any, rows: list[dict[str, Any]],
                         suffix: str = "") -> Any: ...
        def _set_status(self, conn: Connection, *, run_id: str, source: RunStatus,
                        path: Sequence[RunStatus], run_token: int, actor: str,
                        now: float | None, fenced: bool = False,
                        attempt_no: int | None = None, reason_code: str | None = None,
                        message: str | None = None, outcome: str | None = None,
                        visible_at: float | None = None, worker_id: str | None = None
                        ) -> bool: ...
        def _lane_moves_in_order(self, conn: Connection
                                 ) -> AbstractContextManager[Counter[int]]: ...
        def _submit_in(self, conn: Connection, fitted: list[Any], digests: list[str | None],
                       repo_keys: dict[str, str], *, default_max_attempts: int, actor: str,
                       traceparents: Sequence[str | None] | None = None
                       ) -> list[Submission]: ...
        def _now(self, conn: Connection) -> float: ...
        def cancel(self, task_id: str, *, actor: str = "user",
                   reason_code: Reason = Reason.CANCELLED_BY_USER,
                   message: str = "cancelled by user") -> CancelResult: ...
        reads: Any

    _campaign_configs: dict[str, CampaignConfig]

    def _campaign_config(self, row: Any) -> CampaignConfig:
        """A campaign's terms from its row (cached: a campaign's terms never change)."""
        cache = self.__dict__.setdefault("_campaign_configs", {})
        found: CampaignConfig | None = cache.get(row.campaign_id)
        if found is None:
            found = cache[row.campaign_id] = CampaignConfig.of(row.document)
        return found

    # --- create ----------------------------------------------------------------------

    def create_campaign(self, campaign: Campaign) -> CampaignCreated:
        """The campaign and its targets, once per (tenant, name): the same file again
        creates nothing; another file under a taken name is a Conflict. No task yet:
        the scheduler pass dispatches the canary."""
        from runlane.store.schema import campaign_targets

        digest = campaign.digest()
        document = campaign.model_dump(mode="json", exclude={"targets"})
        batch_of = campaign.batch_of()
        campaign_id = new_id()

        def work(conn: Connection) -> CampaignCreated:
            now = self._now(conn)
            inserted = conn.execute(self._q(csql.CAMPAIGN_INSERT), {
                "campaign_id": campaign_id, "tenant": campaign.tenant, "name": campaign.name,
                "owner": campaign.owner, "digest": digest, "document": json.dumps(document),
                "batches": json.dumps(campaign.batches()), "released_at": json.dumps([now]),
                "stop_window": campaign.stop.window,
                "now": now}).first()
            if inserted is None:
                row = conn.execute(self._q(csql.CAMPAIGN_BY_NAME), {
                    "tenant": campaign.tenant, "name": campaign.name}).one()
                if row.digest != digest:
                    raise Conflict(f"campaign {campaign.name!r} of tenant {campaign.tenant!r} "
                                   "exists with other terms; give the new one another name")
                return CampaignCreated(row.campaign_id, False, len(campaign.targets))
            self._bulk_insert(conn, campaign_targets, [
                {"campaign_id": campaign_id, "position": i, "target_key": t.key,
                 "repo": t.repo, "vars": t.vars, "owner": t.owner, "batch": batch_of[i],
                 "state": TargetState.PENDING.value, "generation": 0}
                for i, t in enumerate(campaign.targets)])
            return CampaignCreated(campaign_id, True, len(campaign.targets))

        created = self._transaction(work)
        log.info("campaign_created", campaign=campaign.name, tenant=campaign.tenant,
                 created=created.created, targets=created.targets)
        return created

    # --- the scheduler pass ----------------------------------------------------------

    def campaign_pass(self, *, default_max_attempts: int = 3) -> dict[str, int]:
        """Release and dispatch for every active campaign, one transaction each."""
        counts = {"campaign_batches_released": 0, "campaign_runs_dispatched": 0}
        with self.reads.connect() as conn:
            ids = [r.campaign_id for r in conn.execute(self._q(csql.ACTIVE_CAMPAIGNS))]
        for campaign_id in ids:
            released, dispatched = self._transaction(functools.partial(
                self._advance, campaign_id=campaign_id,
                default_max_attempts=default_max_attempts))
            counts["campaign_batches_released"] += released
            counts["campaign_runs_dispatched"] += dispatched
        counts["campaign_runs_cancelled"] = self._cancel_running_of_stopped()
        return counts

    def _cancel_running_of_stopped(self) -> int:
        """The running runs of stopped campaigns whose stop rule says to cancel them (a
        stop in a run's finishing transaction cannot: it would wait for those runs'
        rows while holding the campaign's, which their own ends take)."""
        with self.reads.connect() as conn:
            rows = [conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": r.campaign_id})
                    .one() for r in conn.execute(self._q(csql.STOPPED_WITH_ACTIVE))]
        return sum(self.cancel_campaign_running(row.campaign_id, actor="scheduler")
                   for row in rows if self._campaign_config(row).stop.cancel_running)

    def cancel_campaign_running(self, campaign_id: str, *, actor: str = "user") -> int:
        """Cancel the campaign's runs that hold a lease (CANCEL_REQUESTED, reason
        CAMPAIGN_STOPPED, delivered to their workers as any cancel): how many."""
        with self.reads.connect() as conn:
            tasks = [r.task_id for r in conn.execute(
                self._q(csql.RUNNING_TASKS, "statuses"),
                {"campaign_id": campaign_id, "statuses": sorted(s.value for s in LEASED)})]
        cancelled = 0
        for task_id in tasks:
            result = self.cancel(task_id, actor=actor, reason_code=Reason.CAMPAIGN_STOPPED,
                                 message="its campaign was stopped")
            cancelled += sum(s == RunStatus.CANCEL_REQUESTED.value
                             for s in result.runs.values())
        return cancelled

    def _advance(self, conn: Connection, campaign_id: str, default_max_attempts: int
                 ) -> tuple[int, int]:
        row = conn.execute(self._q(csql.CAMPAIGN_LOCK_SKIP[self.dialect]),
                           {"campaign_id": campaign_id}).first()
        if row is None:  # another scheduler has it, or it is no longer active
            return 0, 0
        cfg = self._campaign_config(row)
        now = self._now(conn)
        batches = _json(row.batches)
        released = 0
        current = int(row.released_batch)
        p = conn.execute(self._q(csql.BATCH_PROGRESS),
                         {"campaign_id": campaign_id, "batch": current}).one()
        progress = BatchProgress(current, int(p.size or 0), int(p.finished or 0),
                                 int(p.succeeded or 0),
                                 None if p.last_finished_at is None else float(p.last_finished_at))
        if next_batch_due(cfg.rollout, progress, len(batches), now):
            times = [*_json(row.released_at), now]
            if conn.execute(self._q(csql.CAMPAIGN_RELEASE), {
                    "campaign_id": campaign_id, "current": current, "next": current + 1,
                    "released_at": json.dumps(times), "now": now}).rowcount == 1:
                current += 1
                released = 1
                log.info("campaign_batch_released", campaign=cfg.name, batch=current)
        dispatched = self._dispatch(conn, row, cfg, current, now, default_max_attempts)
        if not dispatched:
            self._maybe_complete(conn, campaign_id, now)
        return released, dispatched

    def _dispatch(self, conn: Connection, row: Any, cfg: CampaignConfig, released: int,
                  now: float, default_max_attempts: int) -> int:
        """Submit the tasks of pending targets of released batches, at most the
        campaign's free slots, at most ``per_repository`` active per repository."""
        room = cfg.concurrency.max_active - int(row.active)
        if room <= 0:
            return 0
        campaign_id = row.campaign_id
        per_repo = {r.repo: int(r.n) for r in conn.execute(
            self._q(csql.ACTIVE_BY_REPO), {"campaign_id": campaign_id})}
        picked: list[Any] = []
        for t in conn.execute(self._q(csql.PENDING_TARGETS), {
                "campaign_id": campaign_id, "released": released,
                "limit": room * DISPATCH_SCAN}):
            if per_repo.get(t.repo, 0) >= cfg.concurrency.per_repository:
                continue
            per_repo[t.repo] = per_repo.get(t.repo, 0) + 1
            picked.append(t)
            if len(picked) == room:
                break
        if not picked:
            return 0
        specs = [self._target_spec(cfg, t) for t in picked]
        fitted = [enforce_payload_cap(spec, self.payload_cap_bytes) for spec in specs]
        digests: list[str | None] = [task_digest(spec) for spec in specs]
        repo_keys = {spec.repo: canonical_repo(spec.repo) for spec in specs}
        submissions = self._submit_in(conn, fitted, digests, repo_keys,
                                      default_max_attempts=default_max_attempts,
                                      actor=f"campaign:{cfg.name}")
        crash_point("campaign_dispatch_submitted")  # the drill: a scheduler killed here
        conn.execute(self._q(csql.TARGET_DISPATCHED), [
            {"campaign_id": campaign_id, "position": t.position, "task_id": s.task_id,
             "run_id": s.run_id, "now": now} for t, s in zip(picked, submissions, strict=True)])
        conn.execute(self._q(csql.CAMPAIGN_ACTIVE_ADD),
                     {"campaign_id": campaign_id, "n": len(picked), "now": now})
        # Runs that ended at admission (a policy denies them), or a key met again whose
        # run already ended: their targets end now.
        ended = [(s.run_id, campaign_id, S(s.status), s.reason_code or s.status, None)
                 for s in submissions if S(s.status) in (S.SUCCEEDED, S.FAILED, S.CANCELLED,
                                                         S.POLICY_DENIED)]
        if ended:
            self._campaign_runs_ended(conn, ended, now)
        log.info("campaign_dispatched", campaign=cfg.name, runs=len(picked))
        return len(picked)

    @staticmethod
    def _target_spec(cfg: CampaignConfig, t: Any) -> TaskSpec:
        target = Target(repo=t.repo, vars=_json(t.vars) or {}, owner=t.owner)
        key = f"campaign:{cfg.name}:{t.target_key}"
        if t.generation:
            key += f":retry{t.generation}"
        return TaskSpec(
            tenant=cfg.tenant, repo=t.repo, prompt=render_prompt(cfg.prompt, target),
            queue=cfg.task.queue, priority=cfg.task.priority, idempotency_key=key,
            max_attempts=cfg.task.max_attempts, requires=dict(cfg.task.requires),
            user=cfg.task.user, estimated_cost_usd=cfg.task.estimated_cost_usd)

    # --- a run's end -----------------------------------------------------------------

    def _campaign_runs_ended(
            self, conn: Connection,
            ended: Sequence[tuple[str, str, RunStatus, str | None, str | None]],
            now: float) -> None:
        """Campaigns' runs just ended in this transaction: (run_id, campaign_id, status,
        reason, outcome), the campaign found by the run's own write. Each: the target's
        outcome, the campaign's counts and the stop rule's window (one statement on
        PostgreSQL), then the rule: a crossed threshold stops the campaign here, so no
        later run of it is dispatched or claimed; notifications; completion."""
        for run_id, campaign_id, status, reason, outcome in ended:
            cfg = self._campaign_config_of(conn, campaign_id)
            if status is S.CANCELLED and reason is None:
                reason = Reason.CANCELLED_BY_USER.value
            succeeded = status is S.SUCCEEDED
            counts = cfg.stop.counts(reason, succeeded)
            failed = cfg.stop.is_failure(reason, succeeded)
            params = {
                "campaign_id": campaign_id, "run_id": run_id,
                "state": target_state(status).value, "now": now, "run_status": status.value,
                "reason_code": None if succeeded else reason, "outcome": outcome,
                "counted": int(counts), "failed": int(failed), "flag": "1" if failed else "0",
                "window": cfg.stop.window}
            t = self._record_target_end(conn, params)
            if t is None:  # not the target's current run any more
                continue
            if cfg.notifies:
                self._campaign_notify(conn, campaign_id, "run_finished", t.owner or cfg.owner, {
                    "campaign": cfg.name, "tenant": cfg.tenant, "repo": t.repo,
                    "target": t.position, "batch": t.batch, "run_id": run_id,
                    "task_id": t.task_id, "status": status.value,
                    "reason_code": None if succeeded else reason, "outcome": outcome,
                    "at": now})
            self._after_end(conn, campaign_id, cfg, counts, t.status,
                            [c == "1" for c in t.recent], int(t.active), now)

    def _campaign_ends_written(self, conn: Connection, rows: Sequence[Any],
                               outcome: str | None) -> None:
        """Successes whose targets' ends COMPLETE_WRITE_PG wrote (PostgreSQL): what is
        left is Python's, in this transaction: notifications, then each campaign's stop
        rule on its window after the batch (a success can complete a minimum sample
        whose failures are over the threshold) or its completion."""
        last: dict[str, Any] = {}
        for r in rows:
            if r.target_position is None:  # not the target's current run
                continue
            cfg = self._campaign_config_of(conn, r.campaign_id)
            if cfg.notifies:
                self._campaign_notify(conn, r.campaign_id, "run_finished",
                                      r.target_owner or cfg.owner, {
                    "campaign": cfg.name, "tenant": cfg.tenant, "repo": r.target_repo,
                    "target": r.target_position, "batch": r.target_batch, "run_id": r.run_id,
                    "task_id": r.task_id, "status": S.SUCCEEDED.value, "reason_code": None,
                    "outcome": outcome, "at": float(r.now)})
            last[r.campaign_id] = r
        for campaign_id, r in sorted(last.items()):
            cfg = self._campaign_config_of(conn, campaign_id)
            self._after_end(conn, campaign_id, cfg, True, r.campaign_status,
                            [c == "1" for c in r.campaign_recent], int(r.campaign_active),
                            float(r.now))

    def _after_end(self, conn: Connection, campaign_id: str, cfg: CampaignConfig,
                   counted: bool, status: str, window: list[bool], active: int,
                   now: float) -> None:
        """The stop rule after a counted end (the campaign stopped here when crossed),
        else the campaign's completion once its last active run ended."""
        if counted and status in (C.ACTIVE.value, C.PAUSED.value) and cfg.stop.crossed(window):
            self._stop_campaign(conn, campaign_id, cfg, now, actor="campaign-stop-rule",
                                reason=(f"stop rule: {sum(window)} of the last "
                                        f"{len(window)} finished runs failed "
                                        f"({sum(window) / len(window):.0%} > "
                                        f"{cfg.stop.failure_rate:.0%})"))
        elif active == 0:  # the campaign's last active run: more to do?
            self._maybe_complete(conn, campaign_id, now)

    def _record_target_end(self, conn: Connection, params: dict[str, Any]) -> Any:
        """The target's row, the campaign's counts and window, the numbered finish;
        returns the target and the campaign as they are after it (None: the target's
        current run is another)."""
        if self.dialect == "postgresql":
            return conn.execute(self._q(csql.TARGET_END_PG), params).first()
        t = conn.execute(self._q(csql.TARGET_END), params).first()
        if t is None:
            return None
        c = conn.execute(self._q(csql.CAMPAIGN_END), params).one()
        if params["counted"]:
            conn.execute(self._q(csql.OUTCOME_INSERT), {
                **params, "seq": c.finishes, "position": t.position, "batch": t.batch})
        return _Ended(t.position, t.batch, t.repo, t.owner, t.task_id, c.status, c.active,
                      c.recent)

    def _campaign_config_of(self, conn: Connection, campaign_id: str) -> CampaignConfig:
        """A campaign's terms, which never change once created: read once per process."""
        found = self.__dict__.setdefault("_campaign_configs", {}).get(campaign_id)
        if found is not None:
            return cast(CampaignConfig, found)
        row = conn.execute(self._q(csql.CAMPAIGN_DOCUMENT), {"campaign_id": campaign_id}).one()
        return self._campaign_config(row)

    def _maybe_complete(self, conn: Connection, campaign_id: str, now: float) -> None:
        row = conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": campaign_id}).one()
        if row.status != C.ACTIVE.value \
                or int(row.released_batch) < len(_json(row.batches)) - 1:
            return
        if conn.execute(self._q(csql.UNFINISHED_TARGETS),
                        {"campaign_id": campaign_id}).scalar_one():
            return
        if self._campaign_status(conn, campaign_id, C.COMPLETED, [C.ACTIVE], now):
            cfg = self._campaign_config(row)
            log.info("campaign_completed", campaign=cfg.name)
            self._notify_owner(conn, row, cfg, "completed", now)

    def _campaign_status(self, conn: Connection, campaign_id: str, to: CampaignStatus,
                         sources: Sequence[CampaignStatus], now: float, *,
                         stop_reason: str | None = None, new_window: bool = False) -> bool:
        return bool(conn.execute(self._q(csql.CAMPAIGN_SET_STATUS, "sources"), {
            "campaign_id": campaign_id, "to_status": to.value,
            "sources": [s.value for s in sources], "stop_reason": stop_reason,
            "new_window": int(new_window), "now": now}).rowcount)

    def _stop_campaign(self, conn: Connection, campaign_id: str, cfg: CampaignConfig,
                       now: float, *, actor: str, reason: str) -> bool:
        """STOPPED; targets never dispatched cancelled; waiting runs cancelled with
        CAMPAIGN_STOPPED (through the transition table); running runs finish."""
        if not self._campaign_status(conn, campaign_id, C.STOPPED, [C.ACTIVE, C.PAUSED], now,
                                     stop_reason=reason):
            return False
        conn.execute(self._q(csql.PENDING_CANCELLED), {"campaign_id": campaign_id, "now": now})
        with self._lane_moves_in_order(conn):
            for r in conn.execute(self._q(csql.WAITING_RUNS, "statuses"), {
                    "campaign_id": campaign_id,
                    "statuses": [S.QUEUED.value, S.WAITING_CAPACITY.value,
                                 S.ADMITTED.value, S.AWAITING_APPROVAL.value]}).all():
                self._set_status(conn, run_id=r.run_id, source=S(r.status), path=[S.CANCELLED],
                                 run_token=int(r.fencing_token), actor=actor, now=now,
                                 reason_code=Reason.CAMPAIGN_STOPPED.value,
                                 message=f"campaign {cfg.name} stopped: {reason}")
        log.warning("campaign_stopped", campaign=cfg.name, reason=reason)
        row = conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": campaign_id}).one()
        self._notify_owner(conn, row, cfg, "stopped", now, reason=reason)
        return True

    # --- notifications (the outbox) --------------------------------------------------

    def _campaign_notify(self, conn: Connection, campaign_id: str, kind: str, recipient: str | None,
                payload: dict[str, Any]) -> None:
        notification_id = new_id()
        conn.execute(self._q(csql.NOTIFICATION_INSERT), {
            "notification_id": notification_id, "campaign_id": campaign_id, "kind": kind,
            "recipient": recipient, "now": payload.get("at"),
            "payload": json.dumps({"id": notification_id, "kind": kind,
                                   "recipient": recipient, **payload})})

    def _notify_owner(self, conn: Connection, row: Any, cfg: CampaignConfig, kind: str,
                      now: float, **extra: Any) -> None:
        if not cfg.notifies:
            return
        self._campaign_notify(conn, row.campaign_id, kind, cfg.owner, {
            "campaign": cfg.name, "tenant": cfg.tenant, "status": row.status,
            "active": int(row.active), "finishes": int(row.finishes), "at": now, **extra})

    def due_notifications(self, *, limit: int = 50, timeout: float = NOTIFY_TIMEOUT_SECONDS
                          ) -> list[dict[str, Any]]:
        """Take due notifications for sending: each is pushed ``timeout`` ahead first
        (compare-and-set), so no other sender takes it meanwhile."""
        def work(conn: Connection) -> list[dict[str, Any]]:
            now = self._now(conn)
            taken = []
            for r in conn.execute(self._q(csql.NOTIFICATIONS_DUE), {"limit": limit,
                                                                    "now": now}).all():
                if conn.execute(self._q(csql.NOTIFICATION_TAKE), {
                        "notification_id": r.notification_id, "next_at": r.next_at,
                        "until": now + timeout}).rowcount:
                    taken.append({"notification_id": r.notification_id, "kind": r.kind,
                                  "payload": _json(r.payload), "attempts": int(r.attempts) + 1,
                                  "notify": _json(r.document).get("notify") or {}})
            return taken
        return self._transaction(work)

    def notification_sent(self, notification_id: str) -> None:
        self._transaction(lambda conn: conn.execute(self._q(csql.NOTIFICATION_DELIVERED), {
            "notification_id": notification_id, "now": self.clock.now()}))

    def notification_failed(self, notification_id: str, error: str, delay: float) -> None:
        self._transaction(lambda conn: conn.execute(self._q(csql.NOTIFICATION_FAILED), {
            "notification_id": notification_id, "error": error[:500], "delay": delay,
            "now": self.clock.now()}))

    # --- operator moves --------------------------------------------------------------

    def find_campaign(self, name: str, tenant: str | None) -> Any:
        """The campaign named ``name`` (of ``tenant`` when given); NotFound otherwise,
        also when it is another tenant's, or when the name is ambiguous without one."""
        with self.reads.connect() as conn:
            if tenant is not None:
                rows = conn.execute(self._q(csql.CAMPAIGN_BY_NAME),
                                    {"tenant": tenant, "name": name}).all()
            else:
                rows = conn.execute(self._q(csql.CAMPAIGN_BY_NAME_ANY_TENANT),
                                    {"name": name}).all()
        if not rows:
            raise NotFound(f"no campaign {name!r}")
        if len(rows) > 1:
            raise NotFound(f"campaign {name!r} exists for several tenants "
                           f"({', '.join(r.tenant for r in rows)}): name the tenant")
        return rows[0]

    def list_campaigns(self, tenant: str | None) -> list[Any]:
        with self.reads.connect() as conn:
            if tenant is None:
                return list(conn.execute(self._q(csql.CAMPAIGN_LIST)))
            return list(conn.execute(self._q(csql.CAMPAIGN_LIST_TENANT), {"tenant": tenant}))

    def pause_campaign(self, campaign_id: str, *, actor: str = "user") -> bool:
        """PAUSED: no dispatch; its queued runs held (WAITING_CAPACITY, CAMPAIGN_PAUSED,
        not claimable) until the resume. False when it was not ACTIVE."""
        def work(conn: Connection) -> bool:
            row = conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": campaign_id}).one()
            now = self._now(conn)
            if not self._campaign_status(conn, campaign_id, C.PAUSED, [C.ACTIVE], now):
                return False
            cfg = self._campaign_config(row)
            with self._lane_moves_in_order(conn):
                for r in conn.execute(self._q(csql.WAITING_RUNS, "statuses"), {
                        "campaign_id": campaign_id, "statuses": [S.QUEUED.value]}).all():
                    self._set_status(conn, run_id=r.run_id, source=S.QUEUED,
                                     path=[S.WAITING_CAPACITY], run_token=int(r.fencing_token),
                                     actor=actor, now=now, visible_at=PAUSE_HOLD_AT,
                                     reason_code=Reason.CAMPAIGN_PAUSED.value,
                                     message=f"campaign {cfg.name} paused")
            self._notify_owner(conn, row, cfg, "paused", now)
            return True
        return self._transaction(work)

    def resume_campaign(self, campaign_id: str, *, actor: str = "user") -> bool:
        """ACTIVE again: the runs its pause held are queued. False unless PAUSED."""
        def work(conn: Connection) -> bool:
            row = conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": campaign_id}).one()
            now = self._now(conn)
            if not self._campaign_status(conn, campaign_id, C.ACTIVE, [C.PAUSED], now):
                return False
            cfg = self._campaign_config(row)
            with self._lane_moves_in_order(conn):
                for r in conn.execute(self._q(csql.WAITING_RUNS, "statuses"), {
                        "campaign_id": campaign_id,
                        "statuses": [S.WAITING_CAPACITY.value]}).all():
                    if r.reason_code != Reason.CAMPAIGN_PAUSED.value:
                        continue  # deferred by admission: the scheduler pass decides
                    self._set_status(conn, run_id=r.run_id, source=S.WAITING_CAPACITY,
                                     path=[S.QUEUED], run_token=int(r.fencing_token),
                                     actor=actor, now=now, visible_at=now,
                                     message=f"campaign {cfg.name} resumed")
            self._notify_owner(conn, row, cfg, "resumed", now)
            return True
        return self._transaction(work)

    def stop_campaign(self, campaign_id: str, *, actor: str = "user") -> bool:
        def work(conn: Connection) -> bool:
            row = conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": campaign_id}).one()
            return self._stop_campaign(conn, campaign_id, self._campaign_config(row),
                                       self._now(conn), actor=actor, reason=f"stopped by {actor}")
        return self._transaction(work)

    def retry_failed_campaign(self, campaign_id: str) -> int:
        """Failed targets (and, of a stopped campaign, the targets its stop cancelled
        before they started) pending again, each to get a new task; the campaign
        ACTIVE with a new stop-rule window. Returns how many."""
        def work(conn: Connection) -> int:
            row = conn.execute(self._q(csql.CAMPAIGN_LOCK), {"campaign_id": campaign_id}).one()
            now = self._now(conn)
            n = conn.execute(self._q(csql.FAILED_RETRIED), {"campaign_id": campaign_id}).rowcount
            if row.status == C.STOPPED.value:
                n += conn.execute(self._q(csql.STOP_CANCELLED_RETRIED),
                                  {"campaign_id": campaign_id}).rowcount
            if n:
                self._campaign_status(conn, campaign_id, C.ACTIVE,
                                      [C.ACTIVE, C.STOPPED, C.COMPLETED], now, new_window=True)
            return int(n)
        return self._transaction(work)

    # --- views -----------------------------------------------------------------------

    def campaign_of_run(self, run_id: str) -> str | None:
        """The name of the campaign ``run_id`` is the current run of a target of (its
        pull request's body names it), or None."""
        with self.reads.connect() as conn:
            found = conn.execute(self._q(csql.CAMPAIGN_OF_RUN), {"run_id": run_id}).scalar()
        return None if found is None else str(found)

    def campaign_summary(self, campaign_id: str) -> dict[str, Any]:
        """Everything ``campaign show`` and the report print, read in one snapshot."""
        with self.reads.begin() as conn:
            row = conn.execute(self._q(csql.CAMPAIGN_LOCK.replace("{lock_for_update}", "")),
                               {"campaign_id": campaign_id}).one()
            cfg = self._campaign_config(row)
            by_batch = conn.execute(self._q(csql.TARGETS_BY_STATE),
                                    {"campaign_id": campaign_id}).all()
            failed = conn.execute(self._q(csql.FAILED_TARGETS),
                                  {"campaign_id": campaign_id}).all()
            succeeded = conn.execute(self._q(csql.SUCCEEDED_TARGETS),
                                     {"campaign_id": campaign_id}).all()
            cost = float(conn.execute(self._q(csql.CAMPAIGN_COST),
                                      {"campaign_id": campaign_id}).scalar_one() or 0)
            outcomes = conn.execute(self._q(csql.OUTCOMES_BY_BATCH),
                                    {"campaign_id": campaign_id}).all()
            failures = conn.execute(self._q(csql.FAILURES_BY_REASON),
                                    {"campaign_id": campaign_id}).all()
            cancels = conn.execute(self._q(csql.CANCELLED_BY_REASON),
                                   {"campaign_id": campaign_id}).all()
            window = [c == "1" for c in row.recent]
            notifications = conn.execute(self._q(csql.NOTIFICATIONS_OF),
                                         {"campaign_id": campaign_id}).all()
        return {"row": row, "config": cfg, "by_batch": by_batch, "failed": failed,
                "succeeded": succeeded, "cost_usd": cost, "outcomes": outcomes,
                "failures_by_reason": failures, "cancelled_by_reason": cancels,
                "window": window, "notifications": notifications}
