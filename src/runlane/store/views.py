"""Reads for the operator's views (the runs listing, workers, queues, tenants, policy
versions) and the remote drain: functions taking the store, their statements in
store/views_sql.py. Plain rows out; the facade (api_views.py) scopes them to a principal
and makes the models."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runlane.errors import NotFound
from runlane.store import views_sql as vsql

if TYPE_CHECKING:
    from runlane.store.store import Store


@dataclass(frozen=True)
class RunFilters:
    """What a page of runs is restricted to; None: not restricted."""

    tenant: str | None = None
    status: str | None = None
    queue: str | None = None
    repo: str | None = None  # canonical
    created_after: float | None = None  # inclusive
    created_before: float | None = None  # exclusive
    task_id: str | None = None  # a task's runs (ix_runs_task_id)

    def given(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items() if value is not None}


def run_position(store: Store, run_id: str) -> tuple[float, str, str] | None:
    """(created_at exactly as stored, run_id, tenant) of a run, or None."""
    with store.reads.connect() as conn:
        row = conn.execute(store._q(vsql.RUN_POSITION), {"run_id": run_id}).first()
    return None if row is None else (float(row.created_at), row.run_id, row.tenant)


def runs_page(store: Store, filters: RunFilters, *, limit: int, newest_first: bool,
              after: tuple[float, str] | None) -> list[dict[str, Any]]:
    """Up to ``limit`` runs matching ``filters``, past ``after`` (created_at, run_id) in
    the listing's order."""
    params = filters.given()
    statement = vsql.runs_page_sql(tuple(params), newest_first=newest_first,
                                   cursor=after is not None)
    if after is not None:
        params["cursor_created_at"], params["cursor_run_id"] = after
    params["limit"] = limit
    with store.reads.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(store._q(statement), params)]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _worker_row(row: Any) -> dict[str, Any]:
    found = dict(row._mapping)
    found["queues"] = _json(found["queues"]) or []
    found["capabilities"] = _json(found["capabilities"]) or {}
    return found


def workers(store: Store, *, include_stopped: bool = False, worker_id: str | None = None
            ) -> tuple[float, list[dict[str, Any]], list[dict[str, Any]]]:
    """(the database's now, the workers not stopped (or every one, or the one named),
    every live lease with its run's tenant)."""
    if worker_id is not None:
        statement, params = vsql.WORKER, {"worker_id": worker_id}
    else:
        statement, params = (vsql.WORKERS_ALL if include_stopped else vsql.WORKERS_LIVE), {}
    with store.reads.connect() as conn:
        now = float(conn.execute(store._q(vsql.NOW), {"now": store.clock.now()}).scalar_one())
        found = [_worker_row(r) for r in conn.execute(store._q(statement), params)]
        leases = [dict(r._mapping) for r in conn.execute(store._q(vsql.ACTIVE_LEASES))]
    return now, found, leases


def request_drain(store: Store, worker_id: str) -> None:
    """Mark the worker to drain at its next heartbeat (store.set_worker_status answers
    it); NotFound for an unknown worker."""
    def work(conn: Any) -> None:
        done = conn.execute(store._q(vsql.REQUEST_DRAIN),
                            {"worker_id": worker_id, "now": store.clock.now()})
        if done.rowcount == 0:
            raise NotFound(f"no worker {worker_id!r}")

    store._transaction(work)


@dataclass(frozen=True)
class Occupancy:
    """What the queues and tenants views are made of: counters, never runs."""

    now: float
    lanes: list[dict[str, Any]]  # queue, tenant, queued_count, weight, oldest_ready_at
    active: list[dict[str, Any]]  # queue, tenant, active
    counters: dict[str, tuple[int, int]]  # scope -> (active, max_active)
    spend_today: dict[str, float]  # tenant -> usd


def occupancy(store: Store) -> Occupancy:
    from runlane.store.policy import utc_day

    with store.reads.connect() as conn:
        now = float(conn.execute(store._q(vsql.NOW), {"now": store.clock.now()}).scalar_one())
        lanes = [dict(r._mapping) for r in conn.execute(store._q(vsql.LANE_COUNTS),
                                                         {"now": now})]
        active = [dict(r._mapping) for r in conn.execute(store._q(vsql.ACTIVE_BY_QUEUE_TENANT))]
        counters = {r.scope: (int(r.active), int(r.max_active))
                    for r in conn.execute(store._q(vsql.LIMIT_COUNTERS))}
        spend = {r.tenant: float(r.usd) for r in conn.execute(
            store._q(vsql.SPEND_ON_DAY), {"day": utc_day(now)})}
    return Occupancy(now, lanes, active, counters, spend)


def policy_versions(store: Store) -> list[dict[str, Any]]:
    with store.reads.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(store._q(vsql.POLICY_VERSIONS))]
