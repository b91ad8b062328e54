"""Reads for the CLI, the API and the worker's look before it claims; the worker
registry."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, insert, select, text

from runlane.domain.routing import parse_capabilities, requirements_from_canonical, satisfies
from runlane.errors import NotFound, redact_credentials
from runlane.store import history, reads_sql
from runlane.store.core import StoreCore
from runlane.store.evidence import PULL_REQUEST_EFFECT
from runlane.store.records import Look, SideEffect
from runlane.store.schema import runs, task_dependencies, tasks, workers


class ReadsMixin(StoreCore):
    """Reads, and the worker registry."""

    if TYPE_CHECKING:
        def _effect(self, conn: Connection, run_id: str, key: str) -> SideEffect: ...
        def _servable_routes(self, conn: Connection, capabilities: dict[str, Any] | None
                             ) -> frozenset[str]: ...

    def pull_requests(self) -> list[dict[str, Any]]:
        """Pull requests opened (or adopted) by runs, as recorded in the ledger. ``repo``
        is the run's repository identity (canonical, without credentials: what
        ``runs list`` shows), not the spelling the code host was called with."""
        opened = [e for e in self.side_effects()
                  if e.effect_key == PULL_REQUEST_EFFECT and e.status == "DONE"]
        with self.reads.connect() as conn:
            repos = {r.run_id: r.repo for r in conn.execute(text(
                "SELECT r.run_id, r.repo FROM side_effects s JOIN runs r ON r.run_id = s.run_id"
                " WHERE s.effect_key = :key AND s.status = 'DONE'"),
                {"key": PULL_REQUEST_EFFECT})}
        return [
            {"run_id": e.run_id,
             "repo": repos.get(e.run_id) or redact_credentials(str((e.result or {}).get("repo"))),
             "branch": (e.result or {}).get("head_branch"),
             "number": (e.result or {}).get("number"), "url": (e.result or {}).get("url"),
             "adopted": bool((e.result or {}).get("adopted"))}
            for e in opened
        ]

    def side_effects(self, run_id: str | None = None) -> list[SideEffect]:
        query = "SELECT run_id, effect_key FROM side_effects"
        params: dict[str, Any] = {}
        if run_id is not None:
            query += " WHERE run_id = :run_id"
            params["run_id"] = run_id
        with self.reads.connect() as conn:
            keys = conn.execute(text(query + " ORDER BY created_at, run_id, effect_key"),
                                params).all()
            return [self._effect(conn, r.run_id, r.effect_key) for r in keys]

    # --- workers ------------------------------------------------------------------

    def register_worker(self, worker_id: str, *, version: str, queues: Sequence[str],
                        capabilities: dict[str, Any] | None = None) -> None:
        def work(conn: Connection) -> None:
            now = self._now(conn)
            conn.execute(insert(workers), {
                "worker_id": worker_id, "version": version, "queues": list(queues),
                "capabilities": capabilities or {}, "status": "READY", "started_at": now,
                "heartbeat_at": now})

        self._transaction(work)

    def set_worker_status(self, worker_id: str, status: str) -> bool:
        """Record the worker's status and heartbeat; answer whether an operator asked it
        to drain (``runlane workers drain``, migration 0020): the worker's heartbeat loop
        reads the request here, one statement as before. A worker asked to drain is
        DRAINING from this write on, whatever it said."""
        def work(conn: Connection) -> bool:
            row = conn.execute(
                self._q("UPDATE workers SET status = CASE WHEN drain_requested_at IS NOT NULL "
                        "AND CAST(:status AS VARCHAR(16)) = 'READY' THEN 'DRAINING' "
                        "ELSE CAST(:status AS VARCHAR(16)) END, heartbeat_at = {now} "
                        "WHERE worker_id = :worker_id RETURNING drain_requested_at"),
                {"status": status, "worker_id": worker_id, "now": self.clock.now()}).first()
            return row is not None and row.drain_requested_at is not None

        return self._transaction(work)

    # --- reads --------------------------------------------------------------------

    def list_runs(self, *, status: str | None = None, tenant: str | None = None,
                  limit: int = 1000) -> list[dict[str, Any]]:
        query = select(runs).order_by(runs.c.created_at, runs.c.run_id).limit(limit)
        if status:
            query = query.where(runs.c.status == status)
        if tenant is not None:
            query = query.where(runs.c.tenant == tenant)
        with self.reads.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    def get_run(self, run_id: str) -> dict[str, Any]:
        with self.reads.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.run_id == run_id)).first()
            if row is None:
                raise NotFound(f"no run {run_id!r}")
            run = dict(row._mapping)
            task = conn.execute(select(tasks).where(tasks.c.task_id == run["task_id"])).one()
            run["task"] = dict(task._mapping)
            run["depends_on"] = [r.depends_on for r in conn.execute(
                select(task_dependencies.c.depends_on)
                .where(task_dependencies.c.task_id == run["task_id"])
                .order_by(task_dependencies.c.depends_on))]
            run["attempts"] = [
                dict(a._mapping) for a in conn.execute(
                    text("SELECT * FROM attempts WHERE run_id = :r ORDER BY attempt_no"),
                    {"r": run_id})
            ]
            run["events"] = [
                dict(e._mapping) for e in conn.execute(
                    text(history.RUN_HISTORY), {"run_id": run_id})
            ]
            return run

    def waiting_count(self, queues: Sequence[str],
                      capabilities: dict[str, Any] | None = None) -> int:
        """Runs queued in these queues that these capabilities may serve, visible now
        or later (backoff)."""
        with self.reads.connect() as conn:
            routes = sorted(self._servable_routes(conn, capabilities))
            return int(conn.execute(self._q(reads_sql.WAITING_IN_ROUTES, "queues", "routes"),
                                    {"queues": list(queues), "routes": routes}).scalar() or 0)

    def has_ready_work(self, queues: Sequence[str],
                       capabilities: dict[str, Any] | None = None) -> bool:
        """Whether a claim in these queues with these capabilities may find a run now
        (a read: a worker looks before it claims, reads_sql.READY_IN_ROUTES)."""
        with self.reads.connect() as conn:
            routes = sorted(self._servable_routes(conn, capabilities))
            return conn.execute(self._q(reads_sql.READY_IN_ROUTES, "queues", "routes"),
                                {"queues": list(queues), "routes": routes,
                                 "now": self.clock.now()}).first() is not None

    def look(self, queues: Sequence[str], capabilities: dict[str, Any] | None = None
             ) -> Look:
        """A worker's look before it claims, one statement (reads_sql.LOOK_IN_QUEUES): whether
        a claim in these queues with these capabilities may find a run now, and if not,
        how soon the earliest run it may serve stops waiting out a backoff."""
        with self.reads.connect() as conn:
            rows = conn.execute(self._q(reads_sql.LOOK_IN_QUEUES, "queues"),
                                {"queues": list(queues), "now": self.clock.now()}).all()
        caps = parse_capabilities(capabilities or {})
        key = json.dumps(capabilities or {}, sort_keys=True)
        ready, next_in = False, None
        for r in rows:
            served = self._route_served.get((key, r.route_key))
            if served is None:
                served = self._route_served[(key, r.route_key)] = not r.route_key or \
                    satisfies(requirements_from_canonical(r.route_key), caps)
            if not served:
                continue
            if not r.ready_in:
                ready = True
            elif next_in is None or float(r.ready_in) < next_in:
                next_in = float(r.ready_in)
        return Look(ready, None if ready else next_in)

    def cancels_among(self, run_ids: Sequence[str]) -> set[str]:
        """Those of these runs whose cancel was requested (reads_sql.CANCELS_AMONG)."""
        if not run_ids:
            return set()
        with self.reads.connect() as conn:
            return {r.run_id for r in conn.execute(self._q(reads_sql.CANCELS_AMONG, "run_ids"),
                                                   {"run_ids": list(run_ids)})}

    def get_task(self, task_id: str) -> dict[str, Any]:
        with self.reads.connect() as conn:
            row = conn.execute(select(tasks).where(tasks.c.task_id == task_id)).first()
            if row is None:
                raise NotFound(f"no task {task_id!r}")
            return dict(row._mapping)
