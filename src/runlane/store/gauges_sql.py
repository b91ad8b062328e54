"""The statement of a metrics scrape (store/gauges.py): every gauge runlane reads from the
database, in one statement and one round trip, for both dialects (``{now}`` as in
dialect_sql.py). docs/metrics.md records its plans.

Bounded whatever the number of runs: it reads the lanes (one row per queue, route,
priority and tenant, each with its count of queued runs), a fixed number of the runs
that have waited longest (an index walk), the active leases (their partial index), the
live workers, and the day's spend of the tenants with a budget (by primary key). No
statement here counts runs.
"""

from __future__ import annotations

# How many of the runs that have waited longest in the queue a scrape looks at.
OLDEST_QUEUED = 256

# Rows of (kind, label, value, age):
#   queue   queue name, SUM(lanes.queued_count), the age of its oldest ready run;
#   leases  -, active leases (uq_attempts_one_active_lease, partial: ACTIVE only);
#   worker  worker id, seconds since its last heartbeat (STARTING, READY, DRAINING);
#   spend   tenant, USD spent today (tenant_spend's primary key: tenant, day);
#   policy  -, the policy version in force (its budgets name the tenants above).
# The oldest ready run: a QUEUED run's updated_at is when it entered the queue (no
# statement updates a queued run but the one that moves it out), so the first
# :oldest entries of ix_runs_status_updated (status, updated_at) for QUEUED are the runs
# that have waited longest, all queues together; each read with its row (queue,
# visible_at). Of those ready now (visible: not in a retry's backoff), each queue's
# oldest is aged from when it became ready: the later of entering the queue and the end
# of its backoff. A queue none of whose runs is among them waits less than they do: no
# age (0). Its cost is one index walk of :oldest entries, whatever the number of runs,
# lanes or queues (docs/metrics.md has the plan).
_GAUGES = """
WITH t AS (SELECT {now} AS now),
waiting AS (
    SELECT r.queue, r.updated_at, r.visible_at FROM runs r
    WHERE r.status = 'QUEUED'
    ORDER BY r.updated_at
    LIMIT :oldest),
ready AS (
    SELECT w.queue, MAX(t.now - {greatest}(w.updated_at, w.visible_at)) AS age
    FROM waiting w CROSS JOIN t
    WHERE w.visible_at <= t.now
    GROUP BY w.queue),
depth AS (SELECT l.queue, SUM(l.queued_count) AS queued FROM lanes l GROUP BY l.queue)
SELECT 'queue' AS kind, d.queue AS label, d.queued AS value, y.age AS age
FROM depth d LEFT JOIN ready y ON y.queue = d.queue
UNION ALL
SELECT 'leases', '', COUNT(*), NULL FROM attempts a WHERE a.lease_status = 'ACTIVE'
UNION ALL
SELECT 'worker', w.worker_id, t.now - w.heartbeat_at, NULL
FROM workers w CROSS JOIN t
WHERE w.status IN ('STARTING', 'READY', 'DRAINING')
UNION ALL
SELECT 'spend', s.tenant, s.usd, NULL FROM tenant_spend s
WHERE {budgeted} AND s.day = :day
UNION ALL
SELECT 'policy', '', (SELECT MAX(version) FROM policy_versions), NULL
"""
# The budgeted tenants are one parameter, not one per tenant (an expanding IN of 100
# names cost 2 ms of the client's time per reading): an array, or SQLite's JSON.
GAUGES = {
    "postgresql": _GAUGES.replace("{budgeted}", "s.tenant = ANY(CAST(:tenants AS text[]))"),
    "sqlite": _GAUGES.replace("{budgeted}",
                              "s.tenant IN (SELECT value FROM json_each(:tenants))"),
}
