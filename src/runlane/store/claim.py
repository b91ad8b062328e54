"""The claim: one algorithm per dialect (docs/architecture.md, "The scheduler").
PostgreSQL tries one statement first (``_claim_in_one_trip``), else pick, admit,
allot and write in a transaction; SQLite always runs the transaction. The SQL is in
``claim_sql``."""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection

from runlane.domain.admission import AdmissionRequest, Decision, TenantUsage, admit
from runlane.domain.fairness import LaneState, flows_of, share_slots
from runlane.domain.policy import Policy, run_scopes
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus, check_path
from runlane.errors import TransitionRefused
from runlane.observability import metrics
from runlane.store import claim_sql, history, lanes_sql, policy_sql, providers_sql, transition_log
from runlane.store.core import LANE_MOVES, TENANT_MARKS, StoreCore
from runlane.store.lanes import JOIN_AHEAD, PolicyChanged
from runlane.store.policy import has_budgets
from runlane.store.records import Lease, _lease

log = structlog.get_logger("runlane.store")
S = RunStatus

# Claims one call may make when a candidate got no slot (Store.claim).
CLAIM_ROUNDS = 3
LANE_PAGE = 16  # lanes read per page of a claim
# conn.info key: whether the claim's walk skipped paused providers' runs.
PAUSES_WALKED = "runlane_pauses_walked"
# After a one-statement claim that had to fall back to the transaction, the store's
# next claims are transactions: 1, then 3, 7, ... at most this many after fallbacks in
# a row, until one succeeds. Under tight limits most one-statement claims find a
# counter without room for the batch (the 8-process limit test: 288 of 440 fell back),
# and each fallback cost a statement for nothing.
ONE_TRIP_MAX_SKIPS = 15


class LanesDue(Exception):
    """Sleeping lanes are due: the claim wakes them before it goes on, so a due lane's
    runs compete in this claim, by priority and pass, not one claim late."""


def rows_due(rows: Sequence[Any]) -> bool:
    return bool(rows) and bool(rows[0].lanes_due)


class ClaimMixin(StoreCore):
    """The claim (``Store.claim``) and its steps."""

    if TYPE_CHECKING:
        @contextmanager
        def _lane_moves_in_order(self, conn: Connection) -> Iterator[Counter[int]]: ...
        def _lane_upkeep(self, conn: Connection, empty: set[int], *, wake: bool) -> int: ...
        def _lock_counters(self, conn: Connection, limits: dict[str, int], version: int
                           ) -> dict[str, list[int]]: ...
        def _note_providers(self, policy: Policy) -> None: ...
        def _policy(self, conn: Connection) -> tuple[int, Policy]: ...
        def _policy_version(self, conn: Connection, version: int) -> Policy: ...
        @staticmethod
        def _request_of(row: Any, *, gated: bool = False) -> AdmissionRequest: ...
        def _servable_routes(self, conn: Connection, capabilities: dict[str, Any] | None
                             ) -> frozenset[str]: ...
        def _tenant_usage(self, conn: Connection, tenants: Iterable[str], now: float
                          ) -> dict[str, TenantUsage]: ...

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
            # The attempt is the record of its claim: no event (store/history.py).
            first = history.reserve(conn, len(by_id)) if by_id else 0
            conn.execute(self._q(claim_sql.INSERT_ATTEMPT), [
                {"run_id": r.run_id, "attempt_no": r.attempt_count,
                 "fencing_token": r.fencing_token, "worker_id": worker_id,
                 "lease_expires_at": r.now + lease_ttl, "now": r.now,
                 "estimated_cost_usd": estimated[r.run_id], "limit_scopes": held[r.run_id],
                 "claim_seq": first + i}
                for i, r in enumerate(by_id.values())])
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
