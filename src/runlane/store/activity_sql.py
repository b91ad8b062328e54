"""The statements of ``runlane top``'s activity (store/activity.py): the claim rate per
queue and the latest failures. Each reads a bounded number of entries of partial indexes
of ``attempts`` and ``run_events`` (migrations 0023, 0028), whatever their size; the plans are in
docs/benchmarks.md ("runlane top's reads"). Lock nothing. ``{now}`` as in dialect_sql.py."""

from __future__ import annotations

NOW = "SELECT {now} AS now"

# Claims in the window. A claim is its attempt's row (migration 0028, store/history.py):
# the newest ``:cap`` claims in the order they were written, walked backwards on
# ix_attempts_claim_feed, those at or after ``:since`` kept; with the claim events of
# attempts older than 0028 (the newest ``:cap`` on the partial index
# ix_run_events_claims), newest ``:cap`` of both. Each joined to its run by the primary
# key for its queue and tenant. At most ``2 * :cap`` entries read: above ``:cap``
# claims in the window the caller measures the rate over the span they cover.
CLAIMS_SINCE = """
SELECT r.queue, r.tenant, COUNT(*) AS claims, MIN(e.at) AS oldest
FROM (SELECT run_id, at FROM (
          SELECT run_id, started_at AS at FROM attempts
          WHERE claim_seq IS NOT NULL
          ORDER BY claim_tx DESC, claim_seq DESC
          LIMIT :cap) n
      WHERE at >= :since
      UNION ALL
      SELECT run_id, at FROM (
          SELECT run_id, at FROM run_events
          WHERE to_status = 'CLAIMED' AND at >= :since
          ORDER BY at DESC
          LIMIT :cap) o
      ORDER BY at DESC
      LIMIT :cap) e
JOIN runs r ON r.run_id = e.run_id
GROUP BY r.queue, r.tenant
"""

_FAILURE_COLUMNS = """e.event_id, e.run_id, e.attempt_no, e.at, e.to_status, e.reason_code,
       e.message, r.task_id, r.tenant, r.repo, r.queue"""
# The newest ``:scan`` failures: attempts whose end moved their run to FAILED_RETRYABLE
# or FAILED (the partial index ix_attempts_failed_ends, 0028), and events that moved a
# run to a failure status (a denial, or an attempt's end before 0028: the partial index
# ix_run_events_failures). ``event_id``: the transition's position (store/history.py).
_NEWEST_FAILURES = """
    SELECT event_id, run_id, attempt_no, at, to_status, reason_code, message FROM (
        SELECT end_seq AS event_id, run_id, attempt_no, ended_at AS at,
               end_to_status AS to_status, end_reason_code AS reason_code,
               end_message AS message
        FROM attempts
        WHERE end_to_status IN ('FAILED_RETRYABLE', 'FAILED')
        ORDER BY ended_at DESC, end_seq DESC
        LIMIT :scan) a
    UNION ALL
    SELECT event_id, run_id, attempt_no, at, to_status, reason_code, message FROM (
        SELECT event_id, run_id, attempt_no, at, to_status, reason_code, message
        FROM run_events
        WHERE to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED')
        ORDER BY at DESC, event_id DESC
        LIMIT :scan) v
    ORDER BY at DESC, event_id DESC
    LIMIT :scan"""

# The latest failures of every tenant: the newest ``:scan`` (= the limit) of the two
# partial indexes above, each joined to its run by the primary key.
FAILURES = f"""
SELECT {_FAILURE_COLUMNS}
FROM ({_NEWEST_FAILURES}) e
JOIN runs r ON r.run_id = e.run_id
ORDER BY e.at DESC, e.event_id DESC
"""
# One tenant's: among the newest ``:scan`` failures of every tenant (the indexes have
# no tenant; a bound that does not grow with the table), those of ``:tenant``, newest
# ``:limit``.
TENANT_FAILURES = f"""
SELECT {_FAILURE_COLUMNS}
FROM ({_NEWEST_FAILURES}) e
JOIN runs r ON r.run_id = e.run_id
WHERE r.tenant = :tenant
ORDER BY e.at DESC, e.event_id DESC
LIMIT :limit
"""
