"""The scheduler pass: runs waiting for capacity, dependencies or a newer policy
admitted again, page by page. The SQL is in ``policy_sql``."""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from runlane.domain.admission import AdmissionRequest, Decision, TenantUsage, admit
from runlane.domain.policy import Policy
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.observability import metrics
from runlane.store import approvals_sql, policy_sql
from runlane.store.core import StoreCore
from runlane.store.policy import first_policy_version, same_terms

S = RunStatus

# Statements taking a list of run ids: an array on PostgreSQL, an IN list on SQLite.
RUN_IDS_EXPANDING: dict[str, tuple[str, ...]] = {"postgresql": (), "sqlite": ("run_ids",)}
# Queued runs read per page when a policy change has the scheduler pass admit the
# backlog again (policy_sql.QUEUED_PAGE): a short transaction each, whatever the queue's size.
QUEUED_SCAN = 1000


class SchedulingMixin(StoreCore):
    """The scheduler pass and dependencies."""

    if TYPE_CHECKING:
        def _admit_queued_again(self, conn: Connection, queued: Sequence[Any], version: int,
                                policy: Policy, now: float, *, actor: str, where: str
                                ) -> list[tuple[Any, Decision]]: ...
        @contextmanager
        def _lane_moves_in_order(self, conn: Connection) -> Iterator[Counter[int]]: ...
        def _policy(self, conn: Connection) -> tuple[int, Policy]: ...
        def _prune_cancelled(self, conn: Connection, queued: Sequence[Any], *, now: float,
                             actor: str, where: str) -> list[Any]: ...
        @staticmethod
        def _request_of(row: Any, *, gated: bool = False) -> AdmissionRequest: ...
        def _tenant_usage(self, conn: Connection, tenants: Iterable[str], now: float
                          ) -> dict[str, TenantUsage]: ...

    # --- dependencies -------------------------------------------------------------

    def _dependency_outcome(self, conn: Connection, task_id: str) -> RunStatus:
        """QUEUED when every dependency succeeded, CANCELLED when one ended without
        success, ADMITTED while any is still on its way."""
        row = conn.execute(self._q(policy_sql.DEPENDENCY_STATE), {"task_id": task_id}).one()
        if row.failed:
            return S.CANCELLED
        return S.ADMITTED if row.pending else S.QUEUED

    def _resolve_dependents(self, conn: Connection, task_id: str, now: float | None) -> None:
        """A task's run just ended: release or cancel the runs waiting for it (their
        rows locked in run_id order; the lanes they enter written at the end, in
        lane_id order: dependents of several lanes took them in query order)."""
        with self._lane_moves_in_order(conn):
            for r in conn.execute(self._q(policy_sql.DEPENDENT_RUNS), {"task_id": task_id}).all():
                outcome = self._dependency_outcome(conn, r.task_id)
                if outcome is S.ADMITTED:
                    continue
                self._set_status(
                    conn, run_id=r.run_id, source=S.ADMITTED, path=[outcome],
                    run_token=r.fencing_token, actor="scheduler", now=now,
                    reason_code=Reason.DEPENDENCY_FAILED if outcome is S.CANCELLED else None,
                    message=(f"dependency {task_id} ended without success"
                             if outcome is S.CANCELLED else "dependencies succeeded"))

    # --- the scheduler pass --------------------------------------------------------

    def schedule_pass(self, *, page_size: int = 200, not_yet_due: bool = False,
                      queued_under_older: bool = False) -> dict[str, int]:
        """One pass over waiting runs, each page its own short transaction.

        Deferred runs whose retry-after passed are re-admitted under the policy in
        force (queued, denied, or deferred again); admitted runs whose dependencies
        all ended are released or cancelled (a repair: that normally happens in the
        transaction that ends the dependency). Pages are keyset-paged on
        (created_at, run_id), so a pass neither skips nor repeats a run however many
        share a timestamp, and rows are taken with SKIP LOCKED, so several schedulers
        never wait on each other. ``not_yet_due`` looks at every deferred run (after a
        policy change: a raised budget or a lifted rule admits them now).
        ``queued_under_older`` (after a policy change) also admits again every queued
        run admitted under another version than the one in force
        (``_admit_queued_backlog``; ``queued_skipped`` counts those it could not
        reach, held by claims to the end: the caller passes again).
        """
        counts = {"readmitted": 0, "denied": 0, "deferred": 0, "dependencies_resolved": 0,
                  "held_for_approval": 0, "queued_readmitted": 0, "queued_terms_changed": 0,
                  "queued_skipped": 0}
        for status in (S.WAITING_CAPACITY, S.ADMITTED):
            cursor: tuple[float, str] = (float("-inf"), "")
            while True:
                def page(conn: Connection, s: RunStatus = status, c: tuple[float, str] = cursor
                         ) -> tuple[tuple[float, str], dict[str, int], int]:
                    return self._schedule_page(conn, s, c, page_size, not_yet_due)

                cursor, page_counts, seen = self._transaction(page)
                for key, n in page_counts.items():
                    counts[key] += n
                if seen < page_size:
                    break
        # Last: a run deferred again here is not decided a second time above, and the
        # deferred runs admitted above were admitted under the version in force.
        if queued_under_older:
            for key, n in self._admit_queued_backlog(scan=max(page_size, QUEUED_SCAN)).items():
                counts[key] += n
        return counts

    def _schedule_page(self, conn: Connection, status: RunStatus, after: tuple[float, str],
                       page_size: int, not_yet_due: bool
                       ) -> tuple[tuple[float, str], dict[str, int], int]:
        now = self._now(conn)
        rows = conn.execute(self._q(policy_sql.DUE_WAITING), {
            "status": status.value, "now": float("inf") if not_yet_due else now,
            "after_created": after[0],
            "after_id": after[1], "limit": page_size}).all()
        counts = {"readmitted": 0, "denied": 0, "deferred": 0, "dependencies_resolved": 0,
                  "held_for_approval": 0}
        if not rows:
            return after, counts, 0
        with self._lane_moves_in_order(conn):  # runs of many lanes: lane_id order
            if status is S.ADMITTED:
                for r in rows:
                    outcome = self._dependency_outcome(conn, r.task_id)
                    if outcome is not S.ADMITTED and self._set_status(
                            conn, run_id=r.run_id, source=S.ADMITTED, path=[outcome],
                            run_token=r.fencing_token, actor="scheduler", now=now,
                            reason_code=(Reason.DEPENDENCY_FAILED
                                         if outcome is S.CANCELLED else None),
                            message="dependencies ended (scheduler pass)"):
                        counts["dependencies_resolved"] += 1
                return (rows[-1].created_at, rows[-1].run_id), counts, len(rows)
            version, policy = self._policy(conn)
            usage = self._tenant_usage(conn, {r.tenant for r in rows}, now)
            # Approval gates hold a deferred run too, unless it was approved already
            # (deferred after its approval): asked only of a policy that has gates.
            approved = {a.run_id for a in conn.execute(
                self._q(approvals_sql.APPROVED_AMONG, "run_ids"),
                {"run_ids": [r.run_id for r in rows]})} if policy.approvals else set()
            for r in rows:
                decision = admit(self._request_of(r, gated=r.run_id not in approved),
                                 policy, version, usage.get(r.tenant, TenantUsage()), now)
                self._on_commit(conn, functools.partial(
                    metrics.policy_decision, "scheduler", decision.decision,
                    decision.reason_code))
                conn.execute(self._q(policy_sql.SET_ADMISSION), {
                    "run_id": r.run_id, "policy_version": version,
                    "admission": json.dumps({**decision.to_json(),
                                             "first_policy_version": first_policy_version(r)})})
                if decision.decision == "DEFER":
                    conn.execute(self._q(policy_sql.SET_VISIBLE), {
                        "run_id": r.run_id, "visible_at": decision.retry_after,
                        "reason_code": decision.reason_code, "message": decision.message,
                        "now": now})
                    counts["deferred"] += 1
                    continue
                if decision.decision == "REQUIRE_APPROVAL":
                    counts["held_for_approval"] += self._set_status(
                        conn, run_id=r.run_id, source=S.WAITING_CAPACITY,
                        path=[S.AWAITING_APPROVAL], run_token=r.fencing_token,
                        actor="scheduler", now=now, reason_code=decision.reason_code,
                        message=decision.message, visible_at=decision.retry_after)
                    continue
                if decision.decision == "DENY":
                    target, key = S.POLICY_DENIED, "denied"
                else:
                    target, key = self._dependency_outcome(conn, r.task_id), "readmitted"
                # Admitted before its retry-after (a policy change): visible now, not then.
                if self._set_status(conn, run_id=r.run_id, source=S.WAITING_CAPACITY, path=[target],
                                    run_token=r.fencing_token, actor="scheduler", now=now,
                                    reason_code=(Reason.DEPENDENCY_FAILED if target is S.CANCELLED
                                                 else decision.reason_code),
                                    message=(f"denied by the scheduler pass by policy "
                                             f"v{version} (deferred under "
                                             f"v{r.policy_version}): {decision.message}"
                                             if decision.decision == "DENY" else
                                             f"{decision.decision} under policy v{version}"),
                                    visible_at=now if target in (S.QUEUED, S.ADMITTED) else None):
                    counts[key] += 1
                    if target is S.QUEUED:
                        current = usage.get(r.tenant, TenantUsage())
                        usage[r.tenant] = TenantUsage(current.queued_runs + 1,
                                                      current.spent_today_usd)
        return (rows[-1].created_at, rows[-1].run_id), counts, len(rows)

    def _admit_queued_backlog(self, *, scan: int) -> dict[str, int]:
        """After a policy change: every queued run admitted under another version is
        admitted again under the version in force, a page of the dispatch index at a
        time, each page its own short transaction (policy_sql.QUEUED_PAGE). A denied or
        deferred run leaves the queue now rather than at its claim; a run of a
        cancelled task is pruned. An admitted run whose terms are unchanged (queue,
        priority, maximum attempts, risk class, requirements, limits: the run keeps
        those it entered the queue with) records the new decision, which names the
        version it was first admitted under (``first_policy_version``), and can then be
        claimed in one statement (CLAIM_ONE_TRIP_PG takes only runs admitted under the
        version in force). One whose terms changed keeps its record, true to the run,
        and is admitted again at its claim (``queued_terms_changed``).

        Runs a claim holds are skipped (SKIP LOCKED) and tried once more at the end;
        those still held (and still queued under another version) are counted in
        ``queued_skipped``."""
        counts: Counter[str] = Counter({
            "queued_readmitted": 0, "queued_terms_changed": 0, "denied": 0, "deferred": 0,
            "queued_skipped": 0})

        # Each function below is one transaction's work and returns what it did; the
        # counts are added once it committed (a transaction may be run again).
        def admit_again(conn: Connection, run_ids: list[str]
                        ) -> tuple[set[str], Counter[str], int]:
            """Admit these runs again (those still queued under another version, and
            not held): the ids it locked, what became of them, the version."""
            version, policy = self._policy(conn)
            rows = conn.execute(self._q(
                policy_sql.QUEUED_UNDER_OTHER_POLICY[self.dialect],
                *RUN_IDS_EXPANDING[self.dialect]), {
                "run_ids": run_ids, "version": version}).all()
            if not rows:
                return set(), Counter(), version
            now = self._now(conn)
            with self._lane_moves_in_order(conn):
                queued = self._prune_cancelled(conn, rows, now=now, actor="scheduler",
                                               where="by the scheduler pass")
                decided = self._admit_queued_again(conn, queued, version, policy, now,
                                                   actor="scheduler",
                                                   where="by the scheduler pass")
            admitted = {c.run_id: json.dumps({
                **decision.to_json(), "first_policy_version": first_policy_version(c)})
                for c, decision in decided
                if decision.decision == "ADMIT" and same_terms(c, decision)}
            if admitted and self.dialect == "postgresql":
                conn.execute(self._q(policy_sql.SET_ADMISSIONS_PG), {
                    "run_ids": list(admitted), "admissions": list(admitted.values()),
                    "policy_version": version})
            elif admitted:
                conn.execute(self._q(policy_sql.SET_ADMISSION), [
                    {"run_id": run_id, "admission": admission, "policy_version": version}
                    for run_id, admission in admitted.items()])
            kinds = Counter(decision.decision for _, decision in decided)
            return {r.run_id for r in rows}, Counter({
                "queued_readmitted": len(admitted),
                "queued_terms_changed": kinds["ADMIT"] - len(admitted),
                "denied": kinds["DENY"], "deferred": kinds["DEFER"]}), version

        def page(conn: Connection, after: tuple[int, float, str]
                 ) -> tuple[tuple[int, float, str], int, list[str], Counter[str], set[int]]:
            """One page of the queue: its last key, its size, the runs it had to skip,
            what became of the others, the versions it decided under."""
            version = int(conn.execute(self._q(policy_sql.POLICY_VERSION)).scalar() or 0)
            keys = conn.execute(self._q(policy_sql.QUEUED_PAGE), {
                "after_lane": after[0], "after_created": after[1], "after_id": after[2],
                "scan": scan}).all()
            if not keys:
                return after, 0, [], Counter(), {version}
            other = [k.run_id for k in keys if k.policy_version != version]
            locked, done, decided_under = admit_again(conn, other) if other else (
                set(), Counter(), version)
            last = keys[-1]
            return ((last.lane_id, last.created_at, last.run_id), len(keys),
                    [run_id for run_id in other if run_id not in locked], done,
                    {version, decided_under})

        def still_under_other_policy(conn: Connection, run_ids: list[str]) -> int:
            return int(conn.execute(self._q(
                policy_sql.COUNT_QUEUED_UNDER_OTHER_POLICY[self.dialect],
                *RUN_IDS_EXPANDING[self.dialect]),
                {"run_ids": run_ids}).scalar() or 0)

        cursor: tuple[int, float, str] = (-(2**31), float("-inf"), "")
        skipped: list[str] = []
        versions: set[int] = set()
        while True:
            cursor, seen, held, done, under = self._transaction(
                functools.partial(page, after=cursor))
            skipped.extend(held)
            counts.update(done)
            versions |= under
            if seen < scan:
                break
        # The claims that held runs have long ended (or claimed them): once more.
        for start in range(0, len(skipped), scan):
            chunk = skipped[start:start + scan]
            locked, done, decided_under = self._transaction(
                functools.partial(admit_again, run_ids=chunk))
            counts.update(done)
            versions.add(decided_under)
            left = [run_id for run_id in chunk if run_id not in locked]
            if left:
                counts["queued_skipped"] += self._transaction(
                    functools.partial(still_under_other_policy, run_ids=left))
        if counts["queued_skipped"] == 0 and len(versions) == 1:
            # Every queued run was decided under this one version: a scheduler's first
            # pass need not read the queue again for it (``backlog_admitted``). A run
            # that a claim took under an older record and a retry queues again keeps
            # that record; its claims admit it again, as before any pass.
            self._transaction(lambda conn: conn.execute(
                self._q(policy_sql.MARK_BACKLOG_ADMITTED), {"version": versions.pop(),
                                                     "now": self.clock.now()}))
        return dict(counts)

    def backlog_admitted(self, version: int) -> bool:
        """Whether a scheduler pass has admitted every queued run again under policy
        ``version`` (migration 0010): a scheduler's first pass then skips the backlog.
        Version 0 (no policy applied) has nothing to admit again."""
        if version == 0:
            return True
        with self.reads.connect() as conn:
            return conn.execute(self._q(policy_sql.BACKLOG_ADMITTED),
                                {"version": version}).scalar() is not None
