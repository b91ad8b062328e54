"""The statements of the read-only views (store/views.py): the runs listing, workers,
queues, tenants and the policy's versions. Named here, as every statement of the store
is; ``{now}`` as in dialect_sql.py.

The runs listing is one statement put together from the named filters a call gives
(``runs_page_sql``): one text per combination of filters, each planned for itself, so
that PostgreSQL walks the index that matches the filters (a statement with
``(:tenant IS NULL OR tenant = :tenant)`` gets one plan for every combination and
walks none of them). The page is a keyset: ``(created_at, run_id)`` beyond the cursor,
in that order, so runs that share one ``created_at`` are neither skipped nor repeated
at a page boundary, and no page is a sort. Indexes (migration 0020):

* tenant and status: ``ix_runs_listing_tenant_status`` (tenant, status, created_at,
  run_id), rows read bounded by the page (docs/benchmarks.md has the plan);
* tenant: ``ix_runs_listing_tenant``; none (the operator): ``ix_runs_listing``;
* status alone, queue, repository and the created range filter the walk of one of them.
"""

from __future__ import annotations

# The run object of the public contract, and what `runs list` always printed.
RUN_COLUMNS = ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
               "attempt_count", "max_attempts", "fencing_token", "visible_at", "created_at",
               "updated_at", "ended_at", "reason_code", "message", "outcome", "cost_usd",
               "estimated_cost_usd", "user_id", "risk_class", "route_key", "policy_version")

RUN_FILTERS = {
    "tenant": "tenant = :tenant",
    "status": "status = :status",
    "queue": "queue = :queue",
    "repo": "repo = :repo",
    "created_after": "created_at >= :created_after",
    "created_before": "created_at < :created_before",
    "task_id": "task_id = :task_id",
}
AFTER_CURSOR = {
    True: "(created_at, run_id) < (:cursor_created_at, :cursor_run_id)",
    False: "(created_at, run_id) > (:cursor_created_at, :cursor_run_id)",
}

# Where a run stands in the listing's order (`runs list --before/--after RUN_ID`).
RUN_POSITION = "SELECT created_at, run_id, tenant FROM runs WHERE run_id = :run_id"

RUNS_PAGE = """
SELECT {columns} FROM runs
{where}
ORDER BY created_at {direction}, run_id {direction}
LIMIT :limit
"""


def runs_page_sql(filters: tuple[str, ...], *, newest_first: bool, cursor: bool) -> str:
    """The page statement for ``filters`` (names of RUN_FILTERS, in that order)."""
    conditions = [RUN_FILTERS[name] for name in RUN_FILTERS if name in filters]
    if cursor:
        conditions.append(AFTER_CURSOR[newest_first])
    where = ("WHERE " + " AND ".join(conditions)) if conditions else ""
    return RUNS_PAGE.format(columns=", ".join(RUN_COLUMNS), where=where,
                            direction="DESC" if newest_first else "ASC")


# --- workers -------------------------------------------------------------------------

NOW = "SELECT {now} AS now"

WORKER_COLUMNS = """worker_id, version, queues, capabilities, status, started_at, heartbeat_at,
       drain_requested_at"""
# The registry keeps every worker that ever ran (STOPPED, DEAD): the live ones by default.
WORKERS_LIVE = f"""
SELECT {WORKER_COLUMNS} FROM workers WHERE status <> 'STOPPED'
ORDER BY started_at DESC, worker_id
"""
WORKERS_ALL = f"""
SELECT {WORKER_COLUMNS} FROM workers ORDER BY started_at DESC, worker_id
"""
WORKER = f"""
SELECT {WORKER_COLUMNS} FROM workers WHERE worker_id = :worker_id
"""
# Every live lease, with its run's tenant: as many rows as attempts running now (the
# partial index of active leases), whatever the size of ``runs``.
ACTIVE_LEASES = """
SELECT a.worker_id, a.run_id, a.attempt_no, a.fencing_token, a.lease_expires_at,
       a.started_at, r.tenant, r.task_id, r.queue, r.status
FROM attempts a JOIN runs r ON r.run_id = a.run_id
WHERE a.lease_status = 'ACTIVE'
ORDER BY a.worker_id, a.started_at, a.run_id
"""
# An operator's request that a worker drain; kept once set (a drain is not taken back:
# the worker stops, and a new process registers under a new id).
REQUEST_DRAIN = """
UPDATE workers SET drain_requested_at = COALESCE(drain_requested_at, {now})
WHERE worker_id = :worker_id
"""

# --- queues and tenants --------------------------------------------------------------

# The lanes' counters (store/lanes.py): one row per lane, as many as (queue,
# route, priority, tenant) combinations, never per run. The oldest ready run of each
# lane is the first entry of the dispatch index (lane_id, created_at, run_id) WHERE
# status = 'QUEUED' that is visible now: one probe per awake lane with queued runs
# (a lane asleep, ``wake_at`` set, has none visible).
LANE_COUNTS = """
SELECT l.queue, l.tenant, l.queued_count, l.weight,
       CASE WHEN l.queued_count > 0 AND l.wake_at IS NULL THEN
       (SELECT r.created_at FROM runs r
        WHERE r.lane_id = l.lane_id AND r.status = 'QUEUED' AND r.visible_at <= :now
        ORDER BY r.created_at, r.run_id LIMIT 1) END AS oldest_ready_at
FROM lanes l
"""
# Runs holding a lease now, by queue and tenant: as many rows as attempts running.
ACTIVE_BY_QUEUE_TENANT = """
SELECT r.queue, r.tenant, COUNT(*) AS active
FROM attempts a JOIN runs r ON r.run_id = a.run_id
WHERE a.lease_status = 'ACTIVE'
GROUP BY r.queue, r.tenant
"""
LIMIT_COUNTERS = "SELECT scope, active, max_active FROM limit_counters ORDER BY scope"
SPEND_ON_DAY = "SELECT tenant, usd FROM tenant_spend WHERE day = :day"

# --- policy ----------------------------------------------------------------------------

POLICY_VERSIONS = """
SELECT version, digest, source, created_at, backlog_admitted_at
FROM policy_versions ORDER BY version DESC
"""
