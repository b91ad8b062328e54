"""The scheduler's half of the store: policy versions, admission records, lanes,
concurrency slots, routing, dependencies and budgets.

``Store`` inherits this mixin; every method here runs inside a transaction the
store opened (``conn``) except the public ones, which open their own. The SQL is
in ``sql.py`` under "claim" and "policy, admission, dependencies, budgets".
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from runlane.domain.admission import AdmissionRequest, Decision, TenantUsage, admit
from runlane.domain.fairness import LaneState, flows_of, share_slots
from runlane.domain.policy import (
    Policy,
    policy_digest,
    policy_document,
    policy_from_document,
    run_scopes,
)
from runlane.domain.reasons import Reason
from runlane.domain.routing import (
    CapabilityValue,
    parse_capabilities,
    requirements_from_canonical,
    satisfies,
    unmet,
)
from runlane.domain.states import RunStatus
from runlane.errors import PolicyDenied, TransitionRefused
from runlane.observability import metrics
from runlane.store import (
    approvals_sql,
    audit_sql,
    claim_sql,
    lanes_sql,
    policy_sql,
    providers_sql,
    reads_sql,
    recount_sql,
    slots_sql,
    submit_sql,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from runlane.clock import Clock

log = structlog.get_logger("runlane.store")
S = RunStatus
T = TypeVar("T")
ROUTES_TTL_SECONDS = 2.0
SCHEDULE_CHANNEL = "runlane_schedule"  # payload: the new policy version
LANE_PAGE = 16  # lanes read per page of a claim
# conn.info key: whether the claim's walk skipped paused providers' runs.
PAUSES_WALKED = "runlane_pauses_walked"
# A lane that gains work joins this far ahead of the head of its (queue, priority),
# far below one stride (1 / weight; weights are at most 1,000).
JOIN_AHEAD = 1e-6
# The longest a lane blocked by full scopes sleeps without a wake (sql.LANE_BLOCKING_
# SCOPES): a safety net, since every write that gives a scope room wakes the lanes
# blocked on it (a release, a policy, the reconciler's recount). While the scopes stay
# full, each recheck walks the lane again: at 1 s, 1,000 such lanes cut PostgreSQL
# claims from 64 to 9 per second (bench/blocked_lane.py --lanes 1000).
BLOCKED_LANE_RECHECK_SECONDS = 10.0
# The longest the after-commit wake of a lane a release had to skip waits for it.
SKIPPED_LANE_WAKE_WAIT_SECONDS = 1.0
# After a one-statement claim that had to fall back to the transaction, the store's
# next claims are transactions: 1, then 3, 7, ... at most this many after fallbacks in
# a row, until one succeeds. Under tight limits most one-statement claims find a
# counter without room for the batch (the 8-process limit test: 288 of 440 fell back),
# and each fallback cost a statement for nothing.
ONE_TRIP_MAX_SKIPS = 15
# Statements taking a list of run ids: an array on PostgreSQL, an IN list on SQLite.
RUN_IDS_EXPANDING: dict[str, tuple[str, ...]] = {"postgresql": (), "sqlite": ("run_ids",)}
# Queued runs read per page when a policy change has the scheduler pass admit the
# backlog again (policy_sql.QUEUED_PAGE): a short transaction each, whatever the queue's size.
QUEUED_SCAN = 1000
# conn.info key: the scopes a transaction's releases took below their limit; the
# lanes blocked on them are woken just before it commits (Store._transaction).
FREED_SCOPES = "runlane_freed_scopes"
# conn.info key: the lane moves of a transaction that changes several runs (a claim,
# a scheduler page), net per lane, written at its end in lane_id order
# (SchedulingMixin._lane_moves_in_order) instead of as each run meets them: a claim's
# denial wrote its lane before the claim's counters and lanes, and two claims
# deadlocked on two lanes.
LANE_MOVES = "runlane_lane_moves"
# conn.info key: inside such a block, the tenants whose lanes show again (0: a release
# took them below their limit) or hide (1: a claim found them at it), by tenant:
# marked with the block's lane moves, the lanes of both locked at once in lane_id
# order (a release marked them before it locked the runs waiting for its task, and
# deadlocked with a completion of another of their dependencies).
TENANT_MARKS = "runlane_tenant_marks"


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    digest: str
    created: bool


def utc_day(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d")


def has_budgets(policy: Policy) -> bool:
    return policy.has_budgets


def policy_needs_usage(policy: Policy) -> bool:
    """Whether admission needs the tenants' queued counts and spend at all."""
    return policy.needs_usage


def scope_limit(policy: Policy, scope: str) -> int | None:
    """The current maximum of one concurrency scope, from the one function that
    knows the policy's limits (``concurrency_limits_for``)."""
    kind, _, name = scope.partition(":")
    probe = {"tenant": "\0", "repo": "\0", "user": None, "risk_class": "\0", "queue": "\0"}
    key = {"tenant": "tenant", "repo": "repo", "user": "user", "risk": "risk_class",
           "queue": "queue"}.get(kind)
    if key is not None:
        probe[key] = name
    elif kind != "global":
        return None
    limits = policy.concurrency_limits_for(
        tenant=str(probe["tenant"]), repo=str(probe["repo"]), user=probe["user"],
        risk_class=str(probe["risk_class"]), queue=str(probe["queue"]))
    return limits.get(scope)


class PolicyChanged(Exception):
    """A policy was applied after the claim read its version: the claim starts again
    under the new one (its slots must follow the limits in force)."""


class LanesDue(Exception):
    """Sleeping lanes are due: the claim wakes them before it goes on, so a due lane's
    runs compete in this claim, by priority and pass, not one claim late."""


def first_policy_version(run: Any) -> int:
    """The version a run was first admitted under (its admission record keeps it when
    a scheduler pass admits the run again under a newer one)."""
    record = run.admission if isinstance(run.admission, dict) else json.loads(
        run.admission or "{}")
    return int(record.get("first_policy_version", run.policy_version))


def same_terms(run: Any, decision: Decision) -> bool:
    """Whether a decision keeps a queued run's terms, those it entered the queue with
    (its lane, its retries, its limits): only then does its record take the decision."""
    limits = run.limits if isinstance(run.limits, dict) else json.loads(run.limits or "{}")
    return (decision.queue, decision.priority, decision.max_attempts, decision.risk_class,
            decision.requires, dict(decision.limits)) == (
        run.queue, run.priority, run.max_attempts, run.risk_class, run.route_key or "",
        limits)


def rows_due(rows: Sequence[Any]) -> bool:
    return bool(rows) and bool(rows[0].lanes_due)


class SchedulingMixin:
    if TYPE_CHECKING:
        engine: Engine
        reads: Engine
        clock: Clock
        dialect: str
        _policy_cache: dict[int, Policy]
        _routes_cache: dict[str, tuple[float, frozenset[str]]]
        _one_trip_policy: tuple[int, bool] | None
        _one_trip_skips: tuple[int, int]
        _walk_pauses: bool
        _token_budgets: dict[str, int]

        def _q(self, statement: str, *expanding: str) -> Any: ...
        def _driver_rows(self, conn: Connection, statement: str,
                         params: dict[str, Any]) -> list[Any]: ...
        def _notify(self, conn: Connection, channel: str, payload: str) -> None: ...
        def _now(self, conn: Connection) -> float: ...
        def _transaction(self, work: Callable[[Connection], T], *,
                         autocommit: bool = False) -> T: ...
        def _record(self, conn: Connection, events: list[dict[str, Any]]) -> None: ...
        def _on_commit(self, conn: Connection, record: Callable[[], None]) -> None: ...
        def _set_status(self, conn: Connection, *, run_id: str, source: RunStatus,
                        path: Sequence[RunStatus], run_token: int, actor: str,
                        now: float | None, fenced: bool = False,
                        attempt_no: int | None = None, reason_code: str | None = None,
                        message: str | None = None, outcome: str | None = None,
                        visible_at: float | None = None) -> bool: ...

    # --- policy -------------------------------------------------------------------

    def _policy(self, conn: Connection) -> tuple[int, Policy]:
        """The policy in force now (version 0 is the empty default)."""
        version = int(conn.execute(self._q(policy_sql.POLICY_VERSION)).scalar() or 0)
        return version, self._policy_version(conn, version)

    def _policy_version(self, conn: Connection, version: int) -> Policy:
        """One version of the policy, parsed once per store (the empty default too:
        building it validates a model tree, and every claim and submit asks)."""
        policy = self._policy_cache.get(version)
        if policy is None:
            if version == 0:
                policy = Policy.default()
            else:
                row = conn.execute(self._q(policy_sql.POLICY_BY_VERSION),
                                   {"version": version}).one()
                document = row.document if isinstance(row.document, dict) else json.loads(
                    row.document)
                policy = policy_from_document(document, source=f"policy v{version}")
            self._policy_cache[version] = policy
            metrics.name_tenants(policy.tenants)  # the tenants a metric may name
        return policy

    def apply_policy(self, policy: Policy, *, source: str) -> PolicyVersion:
        """Store ``policy`` as a new numbered version unless it is unchanged, then
        bring every concurrency counter to the new maxima."""
        digest = policy_digest(policy)

        def work(conn: Connection) -> PolicyVersion:
            if self.dialect == "postgresql":  # SQLite's writers are serialized already
                conn.execute(self._q(policy_sql.LOCK_CLAIMS_FOR_POLICY_PG))
            current = conn.execute(self._q(policy_sql.POLICY_LATEST)).first()
            if current is not None and current.digest == digest:
                return PolicyVersion(int(current.version), digest, False)
            version = (int(current.version) if current is not None else 0) + 1
            conn.execute(self._q(policy_sql.POLICY_INSERT), {
                "version": version, "digest": digest,
                "document": json.dumps(policy_document(policy)), "source": source,
                "now": self._now(conn)})
            freed: set[str] = set()
            # Locked first, in scope order, as every claim and release locks them: in
            # the order the scan met them, an update here deadlocked with a claim.
            for row in conn.execute(self._q(recount_sql.LOCK_COUNTERS)).all():
                limit = scope_limit(policy, row.scope)
                if limit is None:
                    conn.execute(self._q(recount_sql.COUNTER_DELETE), {"scope": row.scope})
                elif limit != row.max_active:
                    conn.execute(self._q(recount_sql.COUNTER_SET_MAX),
                                 {"scope": row.scope, "max_active": limit})
                # Every raised or removed limit: this read of ``active`` is not locked,
                # and a claim may fill the scope and a lane sleep on it before commit.
                if limit is None or limit > row.max_active:
                    freed.add(row.scope)
            if freed:  # lanes blocked on a limit the policy raised: woken before commit
                conn.info.setdefault(FREED_SCOPES, set()).update(freed)
            conn.execute(self._q(recount_sql.RECOMPUTE_LANES_FOR_POLICY[self.dialect]), {
                "ahead": JOIN_AHEAD,
                "weights": json.dumps({t: p.weight for t, p in policy.tenants.items()})})
            self._policy_cache[version] = policy
            metrics.name_tenants(policy.tenants)
            self._notify(conn, SCHEDULE_CHANNEL, str(version))
            return PolicyVersion(version, digest, True)

        applied = self._transaction(work)
        log.info("policy_applied", version=applied.version, created=applied.created,
                 source=source)
        return applied

    def current_policy(self) -> tuple[int, Policy]:
        with self.reads.connect() as conn:
            return self._policy(conn)

    def policy_record(self) -> dict[str, Any] | None:
        with self.reads.connect() as conn:
            row = conn.execute(self._q(policy_sql.POLICY_LATEST)).first()
        if row is None:
            return None
        document = row.document if isinstance(row.document, dict) else json.loads(row.document)
        return {"version": row.version, "digest": row.digest, "source": row.source,
                "created_at": row.created_at, "policy": document}

    # --- admission ----------------------------------------------------------------

    def _tenant_usage(self, conn: Connection, tenants: Iterable[str], now: float
                      ) -> dict[str, TenantUsage]:
        names = sorted(set(tenants))
        if not names:
            return {}
        queued = {r.tenant: int(r.queued or 0) for r in conn.execute(
            self._q(policy_sql.TENANT_QUEUED, "tenants"), {"tenants": names})}
        spent = {r.tenant: float(r.usd) for r in conn.execute(
            self._q(policy_sql.TENANT_SPEND, "tenants"), {"tenants": names, "day": utc_day(now)})}
        return {t: TenantUsage(queued_runs=queued.get(t, 0), spent_today_usd=spent.get(t, 0.0))
                for t in names}

    @staticmethod
    def _request_of(row: Any, *, gated: bool = False) -> AdmissionRequest:
        """A stored run as admission reads it. ``gated``: approval gates may hold it
        (a deferred run not yet approved); a queued or running run is past them."""
        return AdmissionRequest(
            tenant=row.tenant, repo=row.repo, queue=row.queue, priority=row.priority,
            user=row.user_id, max_attempts=row.max_attempts,
            requires=requirements_from_canonical(row.route_key or ""),
            estimated_cost_usd=getattr(row, "estimated_cost_usd", None), gated=gated,
            provider=row.provider)

    # --- lanes --------------------------------------------------------------------

    def _lane_ids(self, conn: Connection, lanes: dict[tuple[str, str, int, str],
                                                       tuple[int, float]]) -> dict[
                                                           tuple[str, str, int, str], int]:
        """Create or update the lanes runs are going into; ``lanes`` maps a lane key
        (queue, route, priority, tenant) to (runs entering QUEUED, weight)."""
        ids: dict[tuple[str, str, int, str], int] = {}
        vtimes: dict[tuple[str, int], float] = {}
        for key, (entering, weight) in sorted(lanes.items()):
            queue, route_key, priority, tenant = key
            if (queue, priority) not in vtimes:
                head = conn.execute(self._q(lanes_sql.LANE_VIRTUAL_TIME),
                                    {"queue": queue, "priority": priority}).scalar()
                vtimes[(queue, priority)] = 0.0 if head is None else float(head) - JOIN_AHEAD
            row = conn.execute(self._q(lanes_sql.LANE_UPSERT), {
                "queue": queue, "route_key": route_key, "priority": priority,
                "tenant": tenant, "weight": weight, "queued": entering,
                "vtime": vtimes[(queue, priority)], "tenant_scope": f"tenant:{tenant}",
            }).one()
            ids[key] = int(row.lane_id)
        return ids

    def _lane_moved(self, conn: Connection, lane_id: int | None, source: RunStatus,
                    target: RunStatus) -> None:
        """Keep a lane's queued count in step with a run's status change."""
        if lane_id is None or (source is S.QUEUED) == (target is S.QUEUED):
            return
        moves: Counter[int] | None = conn.info.get(LANE_MOVES)
        if moves is not None:  # written at the transaction's end (LANE_MOVES)
            moves[lane_id] += 1 if target is S.QUEUED else -1
            return
        if target is S.QUEUED:
            conn.execute(self._q(lanes_sql.LANE_ENTER),
                         {"lane_id": lane_id, "n": 1, "ahead": JOIN_AHEAD})
        else:
            conn.execute(self._q(lanes_sql.LANE_LEAVE), {"lane_id": lane_id, "n": 1})

    # --- routing ------------------------------------------------------------------

    def queued_by_route(self) -> list[tuple[str, str, int]]:
        """(queue, route key, queued runs) of every lane with queued runs."""
        with self.reads.connect() as conn:
            return [(r.queue, r.route_key, int(r.queued or 0))
                    for r in conn.execute(self._q(reads_sql.QUEUED_BY_ROUTE))]

    def _servable_routes(self, conn: Connection, capabilities: dict[str, Any] | None
                         ) -> frozenset[str]:
        """Route keys whose requirements these capabilities satisfy (cached briefly:
        new requirement sets are rare)."""
        cache_key = json.dumps(capabilities or {}, sort_keys=True)
        cached = self._routes_cache.get(cache_key)
        if cached is not None and time.monotonic() - cached[0] < ROUTES_TTL_SECONDS:
            return cached[1]
        caps = parse_capabilities(capabilities or {})
        keys = frozenset(
            r.route_key for r in conn.execute(self._q(submit_sql.ROUTES))
            if satisfies(requirements_from_canonical(r.route_key), caps)) | {""}
        self._routes_cache[cache_key] = (time.monotonic(), keys)
        return keys

    def _live_workers(self, conn: Connection) -> list[tuple[set[str], dict[str, CapabilityValue]]]:
        """The queues and capabilities of every live worker."""
        return [(set(w.queues if isinstance(w.queues, list) else json.loads(w.queues)),
                 parse_capabilities(w.capabilities if isinstance(w.capabilities, dict)
                                    else json.loads(w.capabilities)))
                for w in conn.execute(self._q(reads_sql.LIVE_WORKERS))]

    @staticmethod
    def _unserved_because(queue: str, route_key: str,
                          live: list[tuple[set[str], dict[str, CapabilityValue]]]) -> str | None:
        """Why no live worker serves runs of ``route_key`` in ``queue`` (None: one does)."""
        serving = [caps for queues, caps in live if queue in queues]
        if not serving:
            return f"no live worker claims from queue {queue!r}"
        reqs = requirements_from_canonical(route_key)
        if any(satisfies(reqs, caps) for caps in serving):
            return None
        closest = min((unmet(reqs, caps) for caps in serving), key=len)
        return "no live worker has " + "; ".join(closest)

    def unroutable_runs(self, *, tenant: str | None = None, limit: int = 1000
                        ) -> list[dict[str, Any]]:
        """Queued runs that no live worker can serve: none claims from their queue, or
        none has the capabilities they require. Each says why."""
        with self.reads.connect() as conn:
            live = self._live_workers(conn)
            why: dict[tuple[str, str], str] = {}
            for lane in conn.execute(self._q(reads_sql.WAITING_ROUTES)).all():
                reason = self._unserved_because(lane.queue, lane.route_key, live)
                if reason is not None:
                    why[(lane.queue, lane.route_key)] = reason
            # The oldest ``limit`` of each route, then the oldest ``limit`` of them all:
            # oldest first across routes, as every list is (not route by route).
            found: list[dict[str, Any]] = []
            for (queue, route_key), reason in sorted(why.items()):
                found += [{**dict(r._mapping), "unroutable_because": reason}
                          for r in conn.execute(self._q(reads_sql.QUEUED_IN_ROUTE),
                                                {"queue": queue, "route_key": route_key,
                                                 "tenant": tenant, "limit": limit})]
            found.sort(key=lambda run: (run["created_at"], run["run_id"]))
            return found[:limit]

    def _mark_unserved_lanes(self, conn: Connection) -> dict[str, int]:
        """Mark the queued lanes of routes no live worker serves, and clear the mark of
        those served again (lanes_sql._virtual_time: an unserved lane's pass never moves, and
        lanes joining at it got credit to spend ahead of the lanes being served). With
        no live worker at all nothing is served and nothing competes: no lane is
        marked (all are cleared)."""
        live = self._live_workers(conn)
        unserved: dict[tuple[str, str], bool] = {}
        mark: list[str] = []
        clear: list[str] = []
        for lane in conn.execute(self._q(lanes_sql.LANES_BY_ROUTE)).all():
            key = (lane.queue, lane.route_key)
            if key not in unserved:
                unserved[key] = bool(live) and self._unserved_because(*key, live) is not None
            if unserved[key] and not lane.unserved:
                mark.append(str(lane.lane_id))
            elif lane.unserved and not unserved[key]:
                clear.append(str(lane.lane_id))
        marked = conn.execute(self._q(lanes_sql.MARK_LANES_UNSERVED, "lane_ids"),
                              {"lane_ids": mark}).rowcount if mark else 0
        cleared = conn.execute(self._q(lanes_sql.MARK_LANES_SERVED, "lane_ids"),
                               {"lane_ids": clear, "ahead": JOIN_AHEAD}).rowcount if clear else 0
        if marked or cleared:
            log.info("unserved_lanes_marked", marked=marked, served_again=cleared)
        return {"lanes_marked_unserved": marked, "lanes_served_again": cleared}

    # --- slots (concurrency limits) ----------------------------------------------

    def _lock_counters(self, conn: Connection, limits: dict[str, int], version: int
                       ) -> dict[str, list[int]]:
        """Lock the counter of every scope a claim may take a slot in, in one global
        order (by scope), before it takes any: two claims whose runs share scopes then
        queue on the first shared one instead of deadlocking. Returns each scope's
        ``[active, max_active]``. A scope without a counter yet, or whose maximum the
        policy changed, is upserted (in scope order) and the set locked again; raises
        PolicyChanged when ``version`` (the claim's) is no longer in force."""
        if not limits:
            return {}
        scopes = sorted(limits)
        counters = {r.scope: [int(r.active), int(r.max_active)]
                    for r in self._lock_scopes(conn, scopes)}
        stale = [s for s in scopes if s not in counters or counters[s][1] != limits[s]]
        if stale:
            held = self._held_slots(conn) if any(s not in counters for s in stale) \
                else Counter()
            conn.execute(self._q(slots_sql.ENSURE_COUNTER), [
                {"scope": s, "active": held[s], "max_active": limits[s], "version": version}
                for s in stale])
            before = counters
            counters = {r.scope: [int(r.active), int(r.max_active)]
                        for r in self._lock_scopes(conn, scopes)}
            if any(s not in counters or counters[s][1] != limits[s] for s in stale):
                raise PolicyChanged(version)
            freed = {s for s in stale if s in before
                     and before[s][1] <= before[s][0] < limits[s]}
            if freed:  # a full scope the claim raised to the policy's limit
                conn.info.setdefault(FREED_SCOPES, set()).update(freed)
        return counters

    def _held_slots(self, conn: Connection) -> Counter[str]:
        """The slots live attempts hold, per scope (ACTIVE_SLOTS: one row per running
        attempt of a limited run)."""
        held: Counter[str] = Counter()
        for r in conn.execute(self._q(recount_sql.ACTIVE_SLOTS)):
            held.update(r.limit_scopes if isinstance(r.limit_scopes, list)
                        else json.loads(r.limit_scopes))
        return held

    def _lock_scopes(self, conn: Connection, scopes: list[str]) -> list[Any]:
        """LOCK_SCOPES: the counters of ``scopes`` (sorted), locked in that order."""
        if self.dialect == "postgresql":
            return list(conn.execute(self._q(slots_sql.LOCK_SCOPES["postgresql"]),
                                     {"scopes": scopes}))
        return list(conn.execute(self._q(slots_sql.LOCK_SCOPES["sqlite"], "scopes"),
                                 {"scopes": scopes}))

    def _give_back_slots(self, conn: Connection, run_id: str, token: int, raw: Any, *,
                         cleared: bool = False) -> None:
        """An attempt ended (``raw``: the scopes its row held, as the ending statement
        returned them; ``cleared``: that statement also cleared them): free its slots,
        once."""
        self._give_back_slots_many(conn, [(run_id, token, raw)], cleared=cleared)

    def _give_back_slots_many(self, conn: Connection,
                              ended: Sequence[tuple[str, int, Any]], *,
                              cleared: bool = False) -> None:
        """Attempts ended (``(run_id, token, raw)`` each, ``raw`` as above): free their
        slots, once (their attempts forget them: ``cleared`` when the ending statement
        did it, COMPLETE_WRITE_PG). The counters of all of them are locked first, in
        scope order, as a claim locks them: run by run, one run's scopes would be
        locked before a lower scope of the next (a deadlock with a claim holding that
        one)."""
        held = [(run_id, token, raw if isinstance(raw, list) else json.loads(raw))
                for run_id, token, raw in ended if raw is not None]
        if not held:
            return
        if not cleared:
            conn.execute(self._q(slots_sql.CLEAR_ATTEMPT_SLOTS),
                         [{"run_id": run_id, "token": token} for run_id, token, _ in held])
        slots = Counter(scope for _, _, run_scopes in held for scope in run_scopes)
        if not slots:
            return
        scopes = sorted(slots)
        self._lock_scopes(conn, scopes)
        below: set[str] = set()  # scopes this release took below their limit
        if self.dialect == "postgresql":
            below.update(r.scope for r in conn.execute(self._q(slots_sql.GIVE_SLOTS_MANY_PG), {
                "scopes": scopes, "counts": [slots[s] for s in scopes]}) if r.freed)
        else:
            for _, _, run_scopes in held:
                if not run_scopes:
                    continue
                below.update(r.scope for r in conn.execute(
                    self._q(slots_sql.GIVE_SLOTS, "scopes"), {"scopes": sorted(run_scopes)})
                    if r.active == r.max_active - 1)  # it was full: something may wait
        # Every tenant it took below its limit shows its lanes again: one statement,
        # all their lanes in lane_id order (tenant by tenant, a release of two tenants
        # locked the second's lower lane after the first's higher one).
        # Inside a block that collects lane moves, marked with them at its end.
        shown = sorted(s.removeprefix("tenant:") for s in below if s.startswith("tenant:"))
        if shown and conn.info.get(LANE_MOVES) is not None:
            conn.info.setdefault(TENANT_MARKS, {}).update(dict.fromkeys(shown, 0))
        elif shown:
            conn.execute(self._q(lanes_sql.MARK_TENANT_LANES, "tenants"),
                         {"tenants": shown, "at_limit": 0, "ahead": JOIN_AHEAD})
        freed = {s for s in below if not s.startswith("tenant:")}
        if freed:  # woken last in the transaction: Store._transaction
            conn.info.setdefault(FREED_SCOPES, set()).update(freed)

    def _wake_blocked_lanes(self, conn: Connection, freed: set[str]) -> set[int]:
        """Scopes that were full have room again: the lanes asleep on them wake. The
        last lane write of a transaction (lanes_sql.WAKE_BLOCKED_LANES). Returns the lanes
        it had to skip, still asleep: the caller wakes them after its commit
        (``_wake_skipped_lanes``)."""
        params = {"scopes": sorted(freed), "ahead": JOIN_AHEAD}
        conn.execute(self._q(lanes_sql.WAKE_BLOCKED_LANES, "scopes"), params)
        return {r.lane_id for r in conn.execute(self._q(lanes_sql.LANE_BLOCKS_DELETE, "scopes"),
                                                 params) if r.still_asleep}

    def _wake_skipped_lanes(self, lane_ids: set[int]) -> None:
        """After the release committed, each lane its wake skipped, one transaction
        each: holding nothing else, it can wait for the lane's holder and be in no
        deadlock cycle. A lane asleep on its blocks would otherwise sleep a whole
        recheck interval with room for its runs (a cancel in it, or a policy's
        flags, held it during the wake)."""
        def wake(conn: Connection, lane_id: int) -> None:
            # Briefly: the caller's work has committed, and its caller should not wait
            # on a lane for long (the recheck bounds the sleep if this gives up).
            conn.execute(self._q(lanes_sql.LOCAL_LOCK_TIMEOUT),
                         {"timeout": f"{int(SKIPPED_LANE_WAKE_WAIT_SECONDS * 1000)}ms"})
            conn.execute(self._q(lanes_sql.LANE_WAKE_AFTER_RELEASE),
                         {"lane_id": lane_id, "ahead": JOIN_AHEAD})

        for lane_id in sorted(lane_ids):
            try:
                self._transaction(functools.partial(wake, lane_id=lane_id))
            except DBAPIError as exc:  # never an error for work that committed
                log.warning("blocked_lane_wake_failed", lane_id=lane_id,
                            error=str(exc.orig)[:200])

    def _audit_slots(self, conn: Connection) -> list[Any]:
        """Each counter must equal the slots live attempts hold in its scope. (A scope
        without a counter is no longer limited: attempts claimed while it was may
        still hold it; a counter made for it again starts at what they hold.)"""
        from runlane.store.store import Violation

        counters: dict[str, int] = {}
        held: Counter[str] = Counter()
        for r in conn.execute(self._q(audit_sql.AUDIT_SLOTS)):
            if r.scope is not None:
                counters[r.scope] = int(r.active)
            else:
                held.update(json.loads(r.held))
        return [Violation("slot_count_drift", None,
                          f"counter {counters[scope]} but {held[scope]} held", scope=scope)
                for scope in sorted(counters) if counters[scope] != held[scope]]

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

    # --- the claim ------------------------------------------------------------------

    def _note_providers(self, policy: Policy) -> None:
        """What the claims (pauses) and cost reports (token budgets) of this store need
        of the policy's providers, from the version a claim just read."""
        self._walk_pauses = bool(policy.providers)
        self._token_budgets = policy.provider_token_budgets

    def _walk(self, statement: str) -> str:
        """A claim statement, made to skip paused providers' runs when the policy in
        force (as this store last read it) declares providers; else as it is."""
        return claim_sql.with_provider_pauses(statement) if self._walk_pauses else statement

    def _claim_candidates(self, conn: Connection, queue: str, limit: int,
                          capabilities: dict[str, Any] | None, run_id: str | None, *,
                          check_due: bool = True) -> tuple[list[Any], set[int]]:
        """The runs a claim may take, fairest first: lanes picked a page at a time by
        priority and stride pass, the free slots shared among their flows by weight
        (a tenant's lanes of one priority, one per route, are one flow: one share, its
        oldest runs first whatever their route; a full page brings its flows' lanes
        beyond its end, so a flow is dealt with whole whatever page its lanes fall on),
        each flow's share read from the heads of its lanes (all lanes in one statement
        on PostgreSQL). A lane that comes up
        short (runs in backoff, full repository) drops out and its flow's share goes
        round again, then to the next page. Also returns the lanes that gave nothing
        at all (candidates to sleep: ``_lane_upkeep``)."""
        now = self.clock.now()
        empty: set[int] = set()
        # Whether this walk skips paused providers' runs (_admit_candidates checks).
        conn.info[PAUSES_WALKED] = self._walk_pauses
        if run_id is not None:
            return list(conn.execute(self._q(self._walk(claim_sql.RUN_CANDIDATE)),
                                     {"run_id": run_id, "now": now})), empty
        routes = sorted(self._servable_routes(conn, capabilities))
        candidates: list[Any] = []
        cursors: dict[int, tuple[float, str]] = {}
        wanted = limit
        after: tuple[int, float, int] = (-(2**31), float("-inf"), -1)
        carried: list[LaneState] = []  # earlier pages' lanes still in play
        seen: set[int] = set()
        advanced: Counter[tuple[int, str]] = Counter()  # runs this claim gave each flow
        while wanted > 0:
            size = max(wanted, LANE_PAGE)
            picked, companions, walked, due = self._pick_lanes(conn, queue, routes, wanted,
                                                               size, after, now)
            if check_due and due:
                raise LanesDue  # wake them first, in a transaction of their own
            if picked:
                after = (picked[-1].priority, picked[-1].pass_, picked[-1].lane_id)
            # A full page may have lanes beyond it: deal no turn due after its last lane
            # (such a turn may belong to a lane of the next page), then read that page.
            # Its flows' lanes beyond it came with it (companions): a flow is dealt
            # with whole, whatever page its lanes fall on.
            more = len(picked) == size
            until = after if more else None
            fresh = [*picked, *companions]
            # Each page is a statement of its own: a lane an earlier page brought can
            # come again (it was a companion there, or another claim moved its pass
            # meanwhile). This claim already dealt with it (carried, or it came up
            # short), and its walk from the head would return runs already taken.
            # (Only for a claim that needs a second page: the page's walk is then not
            # used, its bounds counted the lanes dropped here.)
            if any(lane.lane_id in seen for lane in fresh):
                fresh = [lane for lane in fresh if lane.lane_id not in seen]
                walked = None
            seen.update(lane.lane_id for lane in fresh)
            # A lane whose flow this claim already served comes at the flow's pass.
            fresh = [replace(lane, pass_=lane.pass_ + advanced[lane.flow] / lane.weight)
                     if advanced[lane.flow] else lane for lane in fresh]
            page = sorted([*carried, *fresh], key=lambda lane: (lane.priority, lane.pass_,
                                                                 lane.lane_id))
            new_lanes = {lane.lane_id for lane in fresh}
            while wanted > 0 and page:
                flows, members = flows_of(page)
                shares = share_slots(flows, wanted, until=until)
                if not shares:
                    break
                # Each lane of a flow is walked for the flow's whole share; the flow
                # takes the oldest of what comes back.
                wants = [(lane, share) for flow, share in shares for lane in members[flow]]
                if walked is not None:  # the page's first walk came with the pick
                    got = {lane: walked.get(lane, [])[:share] for lane, share in wants
                           if lane in new_lanes}
                    rest = [(lane, share) for lane, share in wants if lane not in new_lanes]
                    if rest:
                        got.update(self._lane_runs(conn, rest, cursors, now))
                    walked = None
                else:
                    got = self._lane_runs(conn, wants, cursors, now)
                short: set[int] = set()
                for lane_id, share in wants:
                    rows = got.get(lane_id, [])
                    if len(rows) < share:  # the lane has no more runnable runs
                        short.add(lane_id)
                        if not rows and lane_id not in cursors:
                            empty.add(lane_id)
                taken: Counter[int] = Counter()
                for flow, share in shares:
                    rows = sorted((row for lane_id in members[flow]
                                   for row in got.get(lane_id, [])),
                                  key=lambda r: (r.created_at, r.run_id))[:share]
                    for row in rows:
                        cursors[row.lane_id] = (row.created_at, row.run_id)
                        taken[row.lane_id] += 1
                    candidates.extend(rows)
                    wanted -= len(rows)
                by_flow: Counter[tuple[int, str]] = Counter()
                for lane in page:
                    by_flow[lane.flow] += taken[lane.lane_id]
                advanced.update(by_flow)
                page = [replace(lane, queued=lane.queued - taken[lane.lane_id],
                                pass_=lane.pass_ + by_flow[lane.flow] / lane.weight)
                        for lane in page if lane.lane_id not in short]
            if not more:
                break
            carried = page
        return candidates, empty

    def _claim_in_one_trip(self, queue: str, limit: int,
                           capabilities: dict[str, Any] | None, *, worker_id: str,
                           lease_ttl: float) -> list[Any] | None:
        """PostgreSQL: the whole claim as one autocommit statement, one round trip
        (claim_sql.CLAIM_ONE_TRIP_PG), while the policy in force is the one this store last
        saw and it sets no daily budgets: admission at claim then repeats the decision
        recorded at admission (a pure function of the same inputs), which the statement
        reads from the run. Returns the claimed runs (each row has what its lease
        needs); ``[]`` when nothing is queued for this claimer; None when the claim
        must run as a transaction (the statement wrote nothing, or it is not tried:
        after fallbacks in a row, ONE_TRIP_MAX_SKIPS)."""
        left, streak = self._one_trip_skips
        if left > 0:
            self._one_trip_skips = (left - 1, streak)
            return None

        def work(conn: Connection) -> list[Any] | None:
            if self._one_trip_policy is None:  # once per store and policy change
                version, policy = self._policy(conn)
                self._one_trip_policy = (version, not has_budgets(policy))
                self._note_providers(policy)
            version, one_trip = self._one_trip_policy
            if not one_trip:
                return None
            routes = sorted(self._servable_routes(conn, capabilities))
            # The pauses walked are those of the policy of ``version``: the statement
            # claims nothing under another.
            rows = self._driver_rows(conn, self._walk(claim_sql.CLAIM_ONE_TRIP_PG), {
                "queue": queue, "routes": routes, "limit": max(limit, LANE_PAGE),
                "wanted": limit, "after_priority": -(2**31), "after_pass": float("-inf"),
                "after_lane": -1, "version": version, "worker_id": worker_id,
                "ttl": lease_ttl, "now": self.clock.now()})
            if rows[0].run_id is None and rows[0].policy_version != version:
                self._one_trip_policy = None  # a new policy: read it before the next claim
            return rows

        rows = self._transaction(work, autocommit=True)
        if rows is None:
            return None
        if rows[0].run_id is not None:
            self._one_trip_skips = (0, 0)
            return rows
        if rows[0].page_lanes == 0 and not rows[0].lanes_due:
            return []  # nothing queued: the transaction would find nothing either
        self._one_trip_skips = (min(2 ** (streak + 1) - 1, ONE_TRIP_MAX_SKIPS), streak + 1)
        return None

    @contextmanager
    def _lane_moves_in_order(self, conn: Connection) -> Iterator[Counter[int]]:
        """Collect the lane moves of the runs this block changes (net per lane) and
        write them when it ends, in lane_id order, as every writer of several lanes
        locks them; with them, the lanes of the tenants its releases showed again
        (TENANT_MARKS; both sets locked first in one lane_id order). A claim folds its
        admission's moves into its own lane write (``_write_claim``'s ``gone``) and
        leaves the rest here."""
        info = conn.info  # not read again on the way out: after a dead session, reading
        outer: Counter[int] | None = info.get(LANE_MOVES)  # it raises PendingRollbackError
        if outer is not None:  # nested: the outermost block writes them all
            yield outer
            return
        moves: Counter[int] = Counter()
        info[LANE_MOVES] = moves
        try:
            yield moves
        finally:
            info.pop(LANE_MOVES, None)
            marks: dict[str, int] = info.pop(TENANT_MARKS, {})
        moved = sorted(lane_id for lane_id in moves if moves[lane_id])
        if moved and marks and self.dialect == "postgresql":  # both sets, one order
            conn.execute(self._q(lanes_sql.LOCK_LANES_TO_WRITE), {
                "lane_ids": moved, "tenants": sorted(marks),
                "flags": [marks[tenant] for tenant in sorted(marks)]})
        for lane_id in moved:
            if moves[lane_id] > 0:
                conn.execute(self._q(lanes_sql.LANE_ENTER),
                             {"lane_id": lane_id, "n": moves[lane_id], "ahead": JOIN_AHEAD})
            else:
                conn.execute(self._q(lanes_sql.LANE_LEAVE),
                             {"lane_id": lane_id, "n": -moves[lane_id]})
        for at_limit in (0, 1):
            tenants = sorted(t for t, flag in marks.items() if flag == at_limit)
            if tenants:
                conn.execute(self._q(lanes_sql.MARK_TENANT_LANES, "tenants"),
                             {"tenants": tenants, "at_limit": at_limit, "ahead": JOIN_AHEAD})

    def _sleep_blocked_lanes(self, conn: Connection, empty: set[int]) -> None:
        """Lanes that gave nothing although runs of them are visible, every one blocked
        by full scopes, sleep on those scopes (lanes_sql.LANE_BLOCKING_SCOPES)."""
        expanding = () if self.dialect == "postgresql" else ("lane_ids",)
        blocks = conn.execute(self._q(lanes_sql.LANE_BLOCKING_SCOPES[self.dialect], *expanding),
                              {"lane_ids": sorted(empty), "now": self.clock.now()}).all()
        if not blocks:
            return
        seen = sorted({b.lane_id: b for b in blocks}.items())
        common = {"now": blocks[0].read_at,  # the read's time, not a second one
                  "recheck": BLOCKED_LANE_RECHECK_SECONDS}
        sleep = self._q(lanes_sql.BLOCKED_LANES_SLEEP[self.dialect])
        asleep: set[int] = set()
        if self.dialect == "postgresql":
            asleep.update(conn.execute(sleep, {
                **common, "lane_ids": [lane_id for lane_id, _ in seen],
                "row_versions": [b.row_version for _, b in seen],
                "next_visible_ats": [b.next_visible_at for _, b in seen]}).scalars())
        else:  # one writer: the lanes are as read
            for lane_id, b in seen:
                asleep.update(conn.execute(sleep, {
                    **common, "lane_id": lane_id,
                    "next_visible_at": b.next_visible_at}).scalars())
        rows = [{"scope": b.scope, "lane_id": b.lane_id} for b in blocks if b.lane_id in asleep]
        if rows:
            conn.execute(self._q(lanes_sql.LANE_BLOCK_INSERT), rows)
            for row in rows:  # a lane held back by a full scope, until it has room
                self._on_commit(conn, functools.partial(
                    metrics.capacity_denied, metrics.dimension_of(row["scope"])))

    def _lane_upkeep(self, conn: Connection, empty: set[int], *, wake: bool) -> int:
        """Last in a claim, or in a transaction of its own (lanes are last in the lock
        order; its statements skip lanes others hold): put to sleep the lanes that
        gave nothing, until their first run's backoff ends or, when full scopes block
        their visible runs, until a release gives one of those scopes room; and wake
        the lanes whose time came. Returns the lanes woken."""
        if empty:
            sleep = self._q(lanes_sql.LANES_SLEEP["postgresql"]) if self.dialect == "postgresql" \
                else self._q(lanes_sql.LANES_SLEEP["sqlite"], "lane_ids")
            conn.execute(sleep, {"lane_ids": sorted(empty), "now": self.clock.now()})
            self._sleep_blocked_lanes(conn, empty)
        if not wake:
            return 0
        woken = conn.execute(self._q(lanes_sql.LANES_WAKE),
                             {"now": self.clock.now(), "ahead": JOIN_AHEAD}).rowcount
        return int(woken or 0)

    def _pick_lanes(self, conn: Connection, queue: str, routes: list[str], wanted: int,
                    size: int, after: tuple[int, float, int], now: float | None
                    ) -> tuple[list[LaneState], list[LaneState], dict[int, list[Any]] | None,
                               bool]:
        """One page of ``size`` lanes in fair order after ``after``; when the page is
        full, the other served lanes of its flows that lie beyond its last lane (its
        companions: a flow's lanes may fall on two pages, claim_sql.PAGE_COMPANIONS); and
        whether sleeping lanes are due. PostgreSQL also walks, in the same statement,
        each lane that can get a share of ``wanted`` (its flow's) for as many runs as
        that share can be at most (``PICK_AND_WALK_PG``; lanes of earlier pages
        competing for the same slots can only make a share smaller): those runs come
        back per lane, oldest first."""
        def order(lanes: Iterable[LaneState]) -> list[LaneState]:
            return sorted(lanes, key=lambda lane: (lane.priority, lane.pass_, lane.lane_id))

        params = {"queue": queue, "routes": routes, "limit": size,
                  "after_priority": after[0], "after_pass": after[1],
                  "after_lane": after[2], "now": now}
        if self.dialect != "postgresql":
            rows = list(conn.execute(self._q(claim_sql.PICK_LANES["sqlite"], "routes"), params))
            page = [LaneState(r.lane_id, r.priority, r.weight, r.pass_, r.queued_count,
                              r.tenant) for r in rows]
            companions: list[LaneState] = []
            if len(page) == size:
                end = page[-1]
                companions = order(LaneState(
                    r.lane_id, r.priority, r.weight, r.pass_, r.queued_count, r.tenant)
                    for r in conn.execute(
                        self._q(claim_sql.PAGE_COMPANIONS["sqlite"], "tenants", "routes"), {
                            "tenants": sorted({lane.tenant for lane in page
                                               if lane.priority == end.priority}),
                            "queue": queue, "routes": routes, "end_priority": end.priority,
                            "end_pass": end.pass_, "end_lane": end.lane_id}))
            return page, companions, None, rows_due(rows)
        lanes: dict[int, tuple[LaneState, bool]] = {}
        walked: dict[int, list[Any]] = {}
        due = False
        for r in conn.execute(self._q(self._walk(claim_sql.PICK_AND_WALK_PG)),
                              {**params, "wanted": wanted}):
            due = due or bool(r.lanes_due)
            lanes[r.page_lane_id] = (LaneState(r.page_lane_id, r.page_priority, r.weight,
                                               r.pass_, r.queued_count, r.page_tenant),
                                     bool(r.companion))
            if r.run_id is not None:
                walked.setdefault(r.page_lane_id, []).append(r)
        for lane_rows in walked.values():
            lane_rows.sort(key=lambda r: (r.created_at, r.run_id))
        return (order(lane for lane, companion in lanes.values() if not companion),
                order(lane for lane, companion in lanes.values() if companion), walked, due)

    def _lane_runs(self, conn: Connection, shares: list[tuple[int, int]],
                   cursors: dict[int, tuple[float, str]], now: float | None
                   ) -> dict[int, list[Any]]:
        """Each lane's next ``share`` runnable runs after its cursor, SKIP LOCKED."""
        start = (float("-inf"), "")
        if self.dialect == "postgresql":
            rows = conn.execute(self._q(self._walk(claim_sql.LANE_RUNS["postgresql"])), {
                "lane_ids": [lane for lane, _ in shares],
                "shares": [n for _, n in shares],
                "after_created": [cursors.get(lane, start)[0] for lane, _ in shares],
                "after_ids": [cursors.get(lane, start)[1] for lane, _ in shares],
                "now": now}).all()
        else:
            rows = [row for lane, n in shares for row in conn.execute(
                self._q(self._walk(claim_sql.LANE_RUNS["sqlite"])),
                {"lane_id": lane, "share": n, "after_created": cursors.get(lane, start)[0],
                 "after_id": cursors.get(lane, start)[1], "now": now})]
        by_lane: dict[int, list[Any]] = {}
        for row in rows:
            by_lane.setdefault(row.lane_id, []).append(row)
        for lane_rows in by_lane.values():
            lane_rows.sort(key=lambda r: (r.created_at, r.run_id))
        return by_lane

    def _admit_candidates(self, conn: Connection, candidates: list[Any], *, actor: str
                          ) -> list[tuple[Any, Decision]]:
        """Cancellation (invariant 1) and policy at claim (invariant 7): a candidate of
        a cancelled task is pruned; each other one is re-admitted under the policy in
        force now; a denied run ends POLICY_DENIED, a deferred one waits for capacity.
        Returns the admitted runs with their decisions (their slots come next)."""
        version, now = int(candidates[0].version or 0), float(candidates[0].now)
        candidates = self._prune_cancelled(conn, candidates, now=now, actor=actor,
                                           where="at claim")
        if not candidates:
            return []
        policy = self._policy_version(conn, version)
        self._one_trip_policy = (version, not has_budgets(policy))  # _claim_in_one_trip
        self._note_providers(policy)
        if policy.providers and not conn.info.get(PAUSES_WALKED):
            # Walked before this store knew the policy declares providers (its first
            # claim since): the paused providers' runs are left out here instead.
            paused = set(conn.execute(self._q(providers_sql.PAUSED_PROVIDERS),
                                      {"now": now}).scalars())
            candidates = [c for c in candidates if c.provider not in paused]
            if not candidates:
                return []
        return [(c, d) for c, d in self._admit_queued_again(
            conn, candidates, version, policy, now, actor=actor, where="at claim")
            if d.decision == "ADMIT"]

    def _prune_cancelled(self, conn: Connection, queued: Sequence[Any], *, now: float,
                         actor: str, where: str) -> list[Any]:
        """Queued runs (locked) of tasks whose cancel was requested end CANCELLED
        (invariant 1: the queue is not the truth); returns the others."""
        for c in queued:
            if c.task_cancelled:
                self._set_status(
                    conn, run_id=c.run_id, source=S.QUEUED, path=[S.CANCELLED],
                    run_token=c.fencing_token, actor=actor, now=now,
                    reason_code=Reason.CANCELLED_BY_USER,
                    message=f"its task was cancelled; pruned {where}")
        return [c for c in queued if not c.task_cancelled]

    def _admit_queued_again(self, conn: Connection, queued: Sequence[Any], version: int,
                            policy: Policy, now: float, *, actor: str, where: str
                            ) -> list[tuple[Any, Decision]]:
        """Queued runs (locked) admitted again under ``policy``, version ``version``: a
        denied run ends POLICY_DENIED, its message naming both versions (drill 6), a
        deferred one waits for capacity. Returns each run with its decision. The run is
        already queued: the tenant's queue length does not count against it."""
        usage = self._tenant_usage(conn, {c.tenant for c in queued}, now) \
            if has_budgets(policy) else {}
        decisions: dict[tuple[Any, ...], Decision] = {}
        decided = []
        for c in queued:
            spent = usage.get(c.tenant)
            spent_usd = spent.spent_today_usd if spent else 0.0
            key = (c.tenant, c.repo, c.queue, c.priority, c.user_id, c.max_attempts,
                   c.route_key, spent_usd, c.provider)
            if key not in decisions:  # runs of one tenant, repo, user... decide alike
                decisions[key] = admit(self._request_of(c), policy, version,
                                       TenantUsage(0, spent_usd), now)
            decision = decisions[key]
            if decision.decision != "ADMIT":  # an ADMIT at claim confirms, decides nothing
                self._on_commit(conn, functools.partial(
                    metrics.policy_decision, "claim" if where == "at claim" else "scheduler",
                    decision.decision, decision.reason_code))
            if decision.decision == "DENY":
                self._set_status(
                    conn, run_id=c.run_id, source=S.QUEUED, path=[S.POLICY_DENIED],
                    run_token=c.fencing_token, actor=actor, now=now,
                    reason_code=decision.reason_code,
                    message=(f"denied {where} by policy v{version} (admitted under "
                             f"v{c.policy_version}): {decision.message}"))
            elif decision.decision == "DEFER":
                self._set_status(
                    conn, run_id=c.run_id, source=S.QUEUED, path=[S.WAITING_CAPACITY],
                    run_token=c.fencing_token, actor=actor, now=now,
                    reason_code=decision.reason_code, message=decision.message,
                    visible_at=decision.retry_after)
            decided.append((c, decision))
        return decided

    def _allot_slots(self, conn: Connection, admitted: list[tuple[Any, Decision]]
                     ) -> tuple[list[tuple[Any, Decision]], set[str]]:
        """Slots (invariant 9): lock the counters of every scope the admitted runs
        need, in scope order, and give each run, fairest first, one slot in every
        scope or none (a run without one stays queued). Returns the runs that got
        their slots and the tenants they bring to their limit."""
        # Lock order, everywhere: run rows, then counters (by scope), then lanes.
        counters = self._lock_counters(conn, {
            scope: limit for _, d in admitted for scope, limit in d.concurrency.items()},
            admitted[0][1].policy_version)
        passed: list[tuple[Any, Decision]] = []
        slots: Counter[str] = Counter()
        for c, decision in admitted:
            if all(counters[s][0] < counters[s][1] for s in decision.concurrency):
                for s in decision.concurrency:  # one slot in every scope, or none
                    counters[s][0] += 1
                    slots[s] += 1
                passed.append((c, decision))
            else:  # held back: counted under the first full scope's dimension
                full = next(s for s in sorted(decision.concurrency)
                            if counters[s][0] >= counters[s][1])
                self._on_commit(conn, functools.partial(
                    metrics.capacity_denied, metrics.dimension_of(full)))
        # Every tenant at its limit, not only those this claim filled: a tenant paused
        # with max_active = 0 takes no slot ever, and its lanes, never hidden, kept
        # the lowest pass and came first in every claim of 1, which then took nothing.
        full_tenants = {s.removeprefix("tenant:") for s in counters
                        if s.startswith("tenant:") and counters[s][0] >= counters[s][1]}
        return passed, full_tenants

    def _write_claim(self, conn: Connection, passed: list[tuple[Any, Decision]],
                     full_tenants: set[str] | None, *, worker_id: str,
                     lease_ttl: float, gone: Counter[int] | None = None) -> list[Any] | None:
        """Take the slots (one in every scope of each run), compare-and-set the runs
        QUEUED -> CLAIMED with their next fencing token, open their attempts (the
        leases), record the events and move the lanes: one statement on PostgreSQL.
        Returns ``(run_id, fencing_token, attempt_count, now)`` per claimed run.

        PostgreSQL checks the counters itself (locked in scope order: each exists, has
        the policy's maximum and room for all the slots), so a claim may write before
        it ever read them (``full_tenants`` None: the statement says which tenants it
        filled). When a check fails nothing is written and this returns None: the
        claim then allots the slots run by run (``_allot_slots``) and writes again.
        ``gone`` (PostgreSQL): the lane moves of the claim's admission (runs denied,
        deferred or pruned: each lane's count falls), written with the claimed runs'
        lanes in the same lane_id-ordered write and taken out of ``gone`` when it is."""
        slots = Counter(s for _, d in passed for s in d.concurrency)
        maxima = {s: limit for _, d in passed for s, limit in d.concurrency.items()}
        run_ids = [c.run_id for c, _ in passed]
        scopes = [json.dumps(run_scopes(c.tenant, c.repo, c.user_id, c.risk_class, c.queue,
                                        c.provider))
                  for c, _ in passed]  # every scope: a limit applied later counts it
        per_lane = Counter(c.lane_id for c, _ in passed)
        left = Counter({lane: -n for lane, n in (gone or {}).items()
                        if n < 0 and self.dialect == "postgresql"})
        lanes = sorted(set(per_lane) | set(left))
        now = self.clock.now()
        if self.dialect == "postgresql":
            # A write that fails its checks has locked the counters that exist; the
            # claim then makes the missing ones and locks them all in scope order
            # (_allot_slots). Still holding the first ones, it would lock a new, lower
            # scope after higher ones: a deadlock with the claim that made it (a
            # review, reproduced every time). Rolled back to here, it holds none.
            conn.exec_driver_sql(claim_sql.CLAIM_SAVEPOINT)
            rows: list[Any] = self._driver_rows(conn, claim_sql.CLAIM_WRITE_PG, {
                "slot_scopes": sorted(slots), "slot_counts": [slots[s] for s in sorted(slots)],
                "slot_max": [maxima[s] for s in sorted(slots)],
                "run_ids": run_ids, "estimated": [c.estimated_cost_usd for c, _ in passed],
                "scopes": scopes, "worker_id": worker_id, "ttl": lease_ttl,
                "lane_ids": lanes, "lane_counts": [per_lane[lane] for lane in lanes],
                "lane_gone": [left[lane] for lane in lanes], "ahead": JOIN_AHEAD, "now": now,
                "also_full": sorted(full_tenants or ())})
            if not rows:  # a counter was missing, stale or short of room
                conn.exec_driver_sql(claim_sql.CLAIM_ROLLBACK_TO_SAVEPOINT)  # its locks go
                return None
            if gone is not None:
                for lane in left:  # written: nothing left to move for them
                    del gone[lane]
            slots_taken = int(rows[0].slots_taken)
            full_tenants = set(rows[0].full_tenants)
        else:
            slots_taken = sum(conn.execute(self._q(claim_sql.ADD_SLOTS), {"scope": s, "n": n})
                              .rowcount for s, n in sorted(slots.items()))
            rows = list(conn.execute(self._q(claim_sql.CLAIM_RUNS, "run_ids"),
                                     {"run_ids": run_ids, "now": now}))
            by_id = {r.run_id: r for r in rows}
            estimated = {c.run_id: c.estimated_cost_usd for c, _ in passed}
            held = dict(zip(run_ids, scopes, strict=True))
            conn.execute(self._q(claim_sql.INSERT_ATTEMPT), [
                {"run_id": r.run_id, "attempt_no": r.attempt_count,
                 "fencing_token": r.fencing_token, "worker_id": worker_id,
                 "lease_expires_at": r.now + lease_ttl, "now": r.now,
                 "estimated_cost_usd": estimated[r.run_id], "limit_scopes": held[r.run_id]}
                for r in by_id.values()])
            self._record(conn, [
                {"run_id": r.run_id, "attempt_no": r.attempt_count, "at": r.now,
                 "actor": worker_id, "from_status": S.QUEUED.value,
                 "to_status": S.CLAIMED.value, "reason_code": None,
                 "fencing_token": r.fencing_token, "message": None}
                for r in by_id.values()])
            conn.execute(self._q(lanes_sql.LANE_LEAVE),
                         [{"lane_id": lane, "n": per_lane[lane]} for lane in lanes])
            per_flow = Counter((c.queue, c.priority, c.tenant) for c, _ in passed)
            conn.execute(self._q(lanes_sql.FLOW_CLAIMED), [
                {"queue": queue, "priority": priority, "tenant": tenant, "n": n}
                for (queue, priority, tenant), n in sorted(per_flow.items())])
        # Cannot happen: the runs and the counters are locked.
        if len(rows) != len(passed) or slots_taken != len(slots):
            raise TransitionRefused("claimed runs or their slots changed while locked")
        if self.dialect != "postgresql" and full_tenants:  # PostgreSQL's statement hid them
            conn.execute(self._q(lanes_sql.MARK_TENANT_LANES, "tenants"),
                         {"tenants": sorted(full_tenants), "at_limit": 1, "ahead": JOIN_AHEAD})
        return rows

    def _check_policy_before_effect(self, conn: Connection, run_id: str, effect: str) -> None:
        """Invariant 7, third check: a side effect is refused when the policy in force
        now denies the run, whatever the policy it was admitted under."""
        version, policy = self._policy(conn)
        row = conn.execute(self._q(policy_sql.RUN_FOR_POLICY), {"run_id": run_id}).one()
        if version == row.policy_version and version == 0:
            return
        decision = admit(self._request_of(row), policy, version, TenantUsage(), self._now(conn))
        if decision.decision == "DENY":  # rolled back with the effect's intent: count now
            metrics.policy_decision("side_effect", "deny", decision.reason_code)
            raise PolicyDenied(
                f"{effect} refused: policy v{version} denies run {run_id} (admitted under "
                f"v{row.policy_version}): {decision.reason_code}: {decision.message}",
                reason_code=decision.reason_code or Reason.POLICY_DENIED)

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

    # --- budgets ------------------------------------------------------------------

    def _add_tenant_spend(self, conn: Connection, tenant: str, usd: float, now: float) -> None:
        if usd:
            conn.execute(self._q(policy_sql.ADD_TENANT_SPEND),
                         {"tenant": tenant, "day": utc_day(now), "usd": usd})
            self._on_commit(conn, functools.partial(metrics.cost, tenant, usd))
