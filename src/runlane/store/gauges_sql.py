"""The statement of a metrics scrape (store/gauges.py): every gauge runlane reads from the
database, in one statement and one round trip, for both dialects (``{now}`` as in
sql.py). docs/metrics.md records its plans.

Bounded whatever the number of runs: it reads the lanes (one row per queue, route,
priority and tenant, each with its count of queued runs), one index entry and its row
per lane with queued runs (the lane's head, by the dispatch index), the active leases
(their partial index), the live workers, and the day's spend of the tenants with a
budget (by primary key). No statement here counts runs.
"""

from __future__ import annotations

# Rows of (kind, label, value, age):
#   queue   queue name, SUM(lanes.queued_count), the age of its oldest ready lane head
#           (now - visible_at of the run the next claim of that lane takes; a lane
#           asleep until its runs' backoff ends has no ready head);
#   leases  -, active leases (ix_attempts_active_lease_expiry, partial: ACTIVE only);
#   worker  worker id, seconds since its last heartbeat (STARTING, READY, DRAINING);
#   spend   tenant, USD spent today (tenant_spend's primary key: tenant, day);
#   policy  -, the policy version in force (its budgets name the tenants above).
# The head of a lane is the dispatch walk's first step (sql._HEAD_RUN): the
# ix_runs_lane_dispatch entry (lane_id, created_at, run_id) of the lane's oldest
# QUEUED run that is visible; a CASE, so that lanes without queued runs read nothing.
GAUGES = """
WITH t AS (SELECT {now} AS now),
heads AS (
    SELECT l.queue, l.queued_count,
           CASE WHEN l.queued_count > 0 AND (l.wake_at IS NULL OR l.wake_at <= t.now)
                THEN (SELECT r.visible_at FROM runs r
                      WHERE r.lane_id = l.lane_id AND r.status = 'QUEUED'
                        AND r.visible_at <= t.now
                      ORDER BY r.created_at, r.run_id LIMIT 1) END AS ready_at
    FROM lanes l CROSS JOIN t)
SELECT 'queue' AS kind, h.queue AS label, SUM(h.queued_count) AS value,
       MAX(t.now - h.ready_at) AS age
FROM heads h CROSS JOIN t
GROUP BY h.queue
UNION ALL
SELECT 'leases', '', COUNT(*), NULL FROM attempts a WHERE a.lease_status = 'ACTIVE'
UNION ALL
SELECT 'worker', w.worker_id, t.now - w.heartbeat_at, NULL
FROM workers w CROSS JOIN t
WHERE w.status IN ('STARTING', 'READY', 'DRAINING')
UNION ALL
SELECT 'spend', s.tenant, s.usd, NULL FROM tenant_spend s
WHERE s.tenant IN :tenants AND s.day = :day
UNION ALL
SELECT 'policy', '', (SELECT MAX(version) FROM policy_versions), NULL
"""
