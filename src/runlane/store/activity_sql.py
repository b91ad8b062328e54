"""The statements of ``runlane top``'s activity (store/activity.py): the claim rate per
queue and the latest failures. Each reads a bounded number of entries of a partial index
of ``run_events`` (migration 0023), whatever the size of the table; the plans are in
docs/benchmarks.md ("runlane top's reads"). Lock nothing. ``{now}`` as in dialect_sql.py."""

from __future__ import annotations

NOW = "SELECT {now} AS now"

# Claims in the window: the newest ``:cap`` claim events (QUEUED -> CLAIMED, one per
# claim, written in the claim's transaction) at or after ``:since``, walked backwards on
# the partial index ix_run_events_claims, each joined to its run by the primary key for
# its queue and tenant. At most ``:cap`` entries read: above ``:cap`` claims in the
# window the caller measures the rate over the span they cover.
CLAIMS_SINCE = """
SELECT r.queue, r.tenant, COUNT(*) AS claims, MIN(e.at) AS oldest
FROM (SELECT run_id, at FROM run_events
      WHERE to_status = 'CLAIMED' AND at >= :since
      ORDER BY at DESC
      LIMIT :cap) e
JOIN runs r ON r.run_id = e.run_id
GROUP BY r.queue, r.tenant
"""

_FAILURE_COLUMNS = """e.event_id, e.run_id, e.attempt_no, e.at, e.to_status, e.reason_code,
       e.message, r.task_id, r.tenant, r.repo, r.queue"""
_NEWEST_FAILURES = """
    SELECT event_id, run_id, attempt_no, at, to_status, reason_code, message
    FROM run_events
    WHERE to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED')
    ORDER BY at DESC, event_id DESC
    LIMIT :scan"""

# The latest failures of every tenant: the newest ``:limit`` entries of the partial
# index ix_run_events_failures (an event moving a run to FAILED_RETRYABLE, FAILED or
# POLICY_DENIED: an attempt that failed, retried or not, or a run denied), each joined
# to its run by the primary key.
FAILURES = f"""
SELECT {_FAILURE_COLUMNS}
FROM ({_NEWEST_FAILURES}) e
JOIN runs r ON r.run_id = e.run_id
ORDER BY e.at DESC, e.event_id DESC
"""
# One tenant's: among the newest ``:scan`` failures of every tenant (the index has no
# tenant; a bound that does not grow with the table), those of ``:tenant``, newest
# ``:limit``.
TENANT_FAILURES = f"""
SELECT {_FAILURE_COLUMNS}
FROM ({_NEWEST_FAILURES}) e
JOIN runs r ON r.run_id = e.run_id
WHERE r.tenant = :tenant
ORDER BY e.at DESC, e.event_id DESC
LIMIT :limit
"""
