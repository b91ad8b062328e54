"""Reads without a lock: what a worker looks at before it claims, and the queued
runs by queue and route."""

from __future__ import annotations

LIVE_WORKERS = """
SELECT worker_id, queues, capabilities FROM workers WHERE status IN ('STARTING', 'READY')
"""
WAITING_IN_ROUTES = """
SELECT SUM(queued_count) FROM lanes WHERE queue IN :queues AND route_key IN :routes
"""
# Queued runs by queue and route (a worker's --exit-when-idle says which it left).
QUEUED_BY_ROUTE = """
SELECT queue, route_key, SUM(queued_count) AS queued FROM lanes WHERE queued_count > 0
GROUP BY queue, route_key ORDER BY queue, route_key
"""
WAITING_ROUTES = """
SELECT DISTINCT queue, route_key FROM lanes WHERE queued_count > 0
"""
# A worker's look before it claims (Worker._claim_if_ready): is any lane of its queues
# and routes holding a run that is not waiting out a backoff? One read of lanes, no
# lock; a lane it shows may still be all-blocked (limits): then the claim says so.
READY_IN_ROUTES = """
SELECT 1 FROM lanes
WHERE queue IN :queues AND route_key IN :routes AND queued_count > 0
  AND (wake_at IS NULL OR wake_at <= {now})
LIMIT 1
"""
# A worker's look (Store.look): for each route with queued runs in its queues, 0 when a
# run may be claimed now, else the seconds until the earliest one's backoff ends. The
# worker matches the routes to its capabilities itself (no read of the route table), and
# an idle worker sleeps until that time, not past it. One read of lanes, no lock.
LOOK_IN_QUEUES = """
SELECT route_key,
       MIN(CASE WHEN wake_at IS NULL OR wake_at <= {now} THEN 0 ELSE wake_at - {now} END)
         AS ready_in
FROM lanes
WHERE queue IN :queues AND queued_count > 0
GROUP BY route_key
"""
# Which of a worker's leased runs have a cancel requested (SQLite's change signal: the
# worker beats at once for them, and the beat delivers the cancel).
CANCELS_AMONG = """
SELECT run_id FROM runs
WHERE run_id IN :run_ids AND status IN ('CANCEL_REQUESTED', 'CANCELLING')
"""
QUEUED_IN_ROUTE = """
SELECT r.* FROM runs r JOIN lanes l ON l.lane_id = r.lane_id
WHERE l.queue = :queue AND l.route_key = :route_key AND r.status = 'QUEUED'
  AND (CAST(:tenant AS VARCHAR(128)) IS NULL OR r.tenant = :tenant)
ORDER BY r.created_at, r.run_id
LIMIT :limit
"""
