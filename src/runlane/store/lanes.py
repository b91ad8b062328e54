"""Lanes and limit counters: the bookkeeping claims and releases share (lane moves,
sleeps and wakes, counters locked in scope order, slots given back). The SQL is in
``lanes_sql`` and ``slots_sql``."""

from __future__ import annotations

import functools
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import structlog
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from runlane.domain.states import RunStatus
from runlane.observability import metrics
from runlane.store import lanes_sql, recount_sql, slots_sql
from runlane.store.core import FREED_SCOPES, LANE_MOVES, TENANT_MARKS, StoreCore

log = structlog.get_logger("runlane.store")
S = RunStatus

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


class PolicyChanged(Exception):
    """A policy was applied after the claim read its version: the claim starts again
    under the new one (its slots must follow the limits in force)."""


class LanesMixin(StoreCore):
    """Lanes and limit counters."""

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
