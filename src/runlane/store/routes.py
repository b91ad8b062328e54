"""Routing: which lanes' routes a worker serves, and the runs no live worker can
serve. The SQL is in ``reads_sql`` and ``lanes_sql``."""

from __future__ import annotations

import json
import time
from typing import Any

import structlog
from sqlalchemy import Connection

from runlane.domain.routing import (
    CapabilityValue,
    parse_capabilities,
    requirements_from_canonical,
    satisfies,
    unmet,
)
from runlane.store import lanes_sql, reads_sql, submit_sql
from runlane.store.core import StoreCore
from runlane.store.lanes import JOIN_AHEAD

log = structlog.get_logger("runlane.store")

ROUTES_TTL_SECONDS = 2.0


class RoutesMixin(StoreCore):
    """Routing: routes served, unroutable runs, unserved lanes."""

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
