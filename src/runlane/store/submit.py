"""Submits: a batch of tasks decided, admitted and written in one transaction.
The SQL is in ``submit_sql``."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection, insert
from sqlalchemy.dialects import sqlite as sqlite_dialect

from runlane.domain.admission import AdmissionRequest, Decision, TenantUsage, TimeNeeded, admit
from runlane.domain.ids import new_id
from runlane.domain.policy import Policy
from runlane.domain.reasons import Reason
from runlane.domain.repos import canonical_repo
from runlane.domain.routing import parse_requirements
from runlane.domain.states import RunStatus, is_allowed
from runlane.domain.tasks import (
    PayloadReport,
    TaskInvalid,
    TaskSpec,
    differing_field,
    enforce_payload_cap,
    task_digest,
)
from runlane.errors import Conflict
from runlane.observability import metrics
from runlane.store import history, policy_sql, submit_sql
from runlane.store.core import WAKEUP_CHANNEL, StoreCore
from runlane.store.lanes import JOIN_AHEAD
from runlane.store.policy import policy_needs_usage
from runlane.store.records import Submission
from runlane.store.schema import runs, task_dependencies, tasks

log = structlog.get_logger("runlane.store")
S = RunStatus

# The run columns a submit takes from its plan (the rest are the batch's or zero).
_RUN_COLUMNS = ("run_id", "task_id", "tenant", "repo", "queue", "priority", "status",
                "max_attempts", "visible_at", "ended_at", "reason_code", "message",
                "user_id", "risk_class", "route_key", "policy_version", "admission",
                "limits", "estimated_cost_usd", "provider")


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


class SubmitMixin(StoreCore):
    """Submits (``Store.submit``)."""

    if TYPE_CHECKING:
        def _dependency_outcome(self, conn: Connection, task_id: str) -> RunStatus: ...
        def _lane_ids(self, conn: Connection, lanes: dict[tuple[str, str, int, str],
                                                           tuple[int, float]]) -> dict[
                                                               tuple[str, str, int, str], int]: ...
        @contextmanager
        def _lane_moves_in_order(self, conn: Connection) -> Iterator[Counter[int]]: ...
        def _policy_version(self, conn: Connection, version: int) -> Policy: ...
        def _tenant_usage(self, conn: Connection, tenants: Iterable[str], now: float
                          ) -> dict[str, TenantUsage]: ...

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
        # A run admitted QUEUED records its creation itself (store/history.py).
        in_row = [history.created_in_row(run) for run in created]
        seqs = itertools.count(history.reserve(conn, sum(in_row)) if any(in_row) else 0)
        self._bulk_insert(conn, runs, [
            {column: run[column] for column in _RUN_COLUMNS}
            | {"attempt_count": 0, "fencing_token": 0, "cost_usd": 0.0,
               "created_at": batch.now, "updated_at": batch.now,
               "lane_id": lane_ids[(run["queue"], run["route_key"], run["priority"],
                                    run["tenant"])]}
            | ({"created_by": batch.actor, "created_tx": 0, "created_seq": next(seqs)}
               if row else {"created_by": None, "created_tx": None, "created_seq": None})
            for run, row in zip(created, in_row, strict=True)])
        self._record(conn, [
            {"run_id": run["run_id"], "attempt_no": None, "at": batch.now,
             "actor": batch.actor, "from_status": None, "to_status": run["status"],
             "reason_code": run["reason_code"], "fencing_token": None,
             "message": run["event_message"]}
            for run, row in zip(created, in_row, strict=True) if not row])
        return skipped
