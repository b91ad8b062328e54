"""The named SQL of the fault harness (``runlane chaos``): the after-run checks that
``Store.audit()`` does not already make, the reads its report is built from, and the
few statements it injects faults with. Every check returns ``run_id`` and ``detail``
rows, like ``audit_sql.AUDIT_CHECKS``; :func:`check_database` runs both sets."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from runlane.store import history
from runlane.store.records import Violation
from runlane.store.store import Store

TERMINAL = "('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED')"

# Times are transaction start times: a write that began just before a cancel took
# the run's row lock may carry a slightly later time than the cancel.
CANCEL_TOLERANCE_SECONDS = 0.5

# A target's idempotency key (store/campaigns.py ``_target_spec``), its first dispatch's.
_TARGET_KEY = "'campaign:' || c.name || ':' || t.target_key"

CHAOS_CHECKS: dict[str, str] = {
    # Nothing lost, nothing stuck: once the harness is done, every run has ended.
    "run_not_terminal": f"""
        SELECT run_id, 'still ' || status || ' after ' || CAST(attempt_count AS TEXT)
               || ' attempt(s)' AS detail
        FROM runs WHERE status NOT IN {TERMINAL}""",
    "task_without_run": """
        SELECT NULL AS run_id, 'task ' || t.task_id || ' has no run' AS detail
        FROM tasks t WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.task_id = t.task_id)""",
    "failed_run_without_reason": """
        SELECT run_id, 'run ' || status || ' without a reason code' AS detail
        FROM runs WHERE status IN ('FAILED', 'CANCELLED') AND reason_code IS NULL""",
    # An ended run started no attempt after it ended. (An attempt or lease left open,
    # a stale token's write, a claim after a cancel and a task's second run are
    # checked by ``runlane audit``: audit_sql.AUDIT_CHECKS.)
    "attempt_after_end": """
        SELECT a.run_id, 'attempt ' || CAST(a.attempt_no AS TEXT)
               || ' started after the run ended' AS detail
        FROM attempts a JOIN runs r ON r.run_id = a.run_id
        WHERE r.ended_at IS NOT NULL AND a.started_at > r.ended_at""",
    # Cancellation is monotonic: a cancelled run never starts a side effect after the
    # cancel (its withdrawal, which closes what it left, is made after it ended by
    # design), and ends CANCELLED.
    "effect_after_cancel": """
        SELECT s.run_id, 'effect ' || s.effect_key || ' begun after the cancel' AS detail
        FROM side_effects s
        WHERE s.effect_key <> 'close_pull_request'
          AND s.created_at > (SELECT MIN(c.at) FROM """ + history.ALL + """ c
                              WHERE c.run_id = s.run_id
                                AND c.to_status IN ('CANCEL_REQUESTED', 'CANCELLED'))
                             + :tolerance""",
    "cancel_not_honoured": """
        SELECT r.run_id, 'cancel requested, but the run ended ' || r.status AS detail
        FROM runs r
        WHERE r.status <> 'CANCELLED' AND EXISTS (
            SELECT 1 FROM run_events c WHERE c.run_id = r.run_id
              AND c.to_status = 'CANCEL_REQUESTED')""",
    # The ledger agrees with the run's outcome.
    "succeeded_without_pull_request": """
        SELECT r.run_id, 'outcome pull_request but no pull request recorded' AS detail
        FROM runs r
        WHERE r.status = 'SUCCEEDED' AND r.outcome = 'pull_request' AND NOT EXISTS (
            SELECT 1 FROM side_effects s WHERE s.run_id = r.run_id
              AND s.effect_key = 'pull_request' AND s.status = 'DONE')""",
    # Pull-request evidence: every withdrawal a run was due was done (or given up,
    # which ``runlane audit`` reports) by the time the harness stops.
    "withdrawal_not_done": """
        SELECT run_id, 'ended ' || status || ', its withdrawal still due' AS detail
        FROM runs WHERE close_due_at IS NOT NULL""",
    "no_changes_with_effects": """
        SELECT r.run_id, 'outcome no_changes but effect ' || MIN(s.effect_key)
               || ' recorded' AS detail
        FROM runs r JOIN side_effects s ON s.run_id = r.run_id
        WHERE r.status = 'SUCCEEDED' AND r.outcome = 'no_changes'
        GROUP BY r.run_id""",
    # --- campaigns (docs/campaigns.md) ---
    # Each target has at most one task per dispatch (generation), and the task its key
    # names is the one the target records: a dispatch wrote both or neither.
    "campaign_target_tasks": f"""
        SELECT t.run_id, 'campaign ' || c.name || ' target ' || CAST(t.position AS TEXT)
               || ': ' || CAST(COUNT(k.task_id) AS TEXT) || ' task(s) for '
               || CAST(t.generation + 1 AS TEXT) || ' dispatch(es)' AS detail
        FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
        JOIN tasks k ON k.tenant = c.tenant
         AND (k.idempotency_key = {_TARGET_KEY}
              OR k.idempotency_key LIKE {_TARGET_KEY} || '\\:retry%')
        GROUP BY c.name, t.position, t.generation, t.run_id
        HAVING COUNT(k.task_id) > t.generation + 1""",
    "campaign_task_not_its_targets": f"""
        SELECT t.run_id, 'campaign ' || c.name || ' target '
               || CAST(t.position AS TEXT) || ' (' || t.state || ') records task '
               || COALESCE(t.task_id, 'none') || ', its key names task ' || k.task_id
               AS detail
        FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
        JOIN tasks k ON k.tenant = c.tenant AND k.idempotency_key = {_TARGET_KEY}
        WHERE t.generation = 0 AND (t.task_id IS NULL OR t.task_id <> k.task_id)""",
    # Nothing of a batch is dispatched, nor claimed, before the batch was released.
    "campaign_run_before_release": """
        SELECT t.run_id, 'campaign ' || c.name || ' batch ' || CAST(t.batch AS TEXT)
               || ' (released: ' || CAST(c.released_batch AS TEXT)
               || '): dispatched or claimed before its release' AS detail
        FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
        WHERE t.dispatched_at IS NOT NULL AND (
            t.batch > c.released_batch
            OR t.dispatched_at < {released_at}
            OR (SELECT MIN(a.started_at) FROM attempts a WHERE a.run_id = t.run_id)
               < {released_at})""",
    # The campaign's counters agree with its targets: active runs, counted finishes,
    # the stop rule's window (the newest counted finishes, "1" a failure).
    "campaign_active_count_wrong": """
        SELECT NULL AS run_id, 'campaign ' || c.name || ' counts '
               || CAST(c.active AS TEXT) || ' active, its targets '
               || CAST((SELECT COUNT(*) FROM campaign_targets t
                        WHERE t.campaign_id = c.campaign_id AND t.state = 'ACTIVE') AS TEXT)
               AS detail
        FROM campaigns c
        WHERE c.active <> (SELECT COUNT(*) FROM campaign_targets t
                           WHERE t.campaign_id = c.campaign_id AND t.state = 'ACTIVE')""",
    "campaign_finishes_wrong": """
        SELECT NULL AS run_id, 'campaign ' || c.name || ' counts '
               || CAST(c.finishes AS TEXT) || ' finishes, window ' || c.recent
               || ' (' || CAST(LENGTH(c.recent) - LENGTH(REPLACE(c.recent, '1', '')) AS TEXT)
               || ' failed), outcomes ' || CAST(COUNT(o.seq) AS TEXT) || ' ('
               || CAST(COALESCE(SUM(CASE WHEN o.seq > c.finishes - c.stop_window
                                         THEN o.failed ELSE 0 END), 0) AS TEXT)
               || ' failed in the window)' AS detail
        FROM campaigns c LEFT JOIN campaign_outcomes o ON o.campaign_id = c.campaign_id
        GROUP BY c.campaign_id, c.name, c.finishes, c.recent, c.stop_window
        HAVING c.finishes <> COUNT(o.seq) OR c.finishes <> COALESCE(MAX(o.seq), 0)
            OR LENGTH(c.recent) <> CASE WHEN c.finishes < c.stop_window THEN c.finishes
                                        ELSE c.stop_window END
            OR LENGTH(c.recent) - LENGTH(REPLACE(c.recent, '1', ''))
               <> COALESCE(SUM(CASE WHEN o.seq > c.finishes - c.stop_window
                                    THEN o.failed ELSE 0 END), 0)""",
    # Each target's state is its run's end; each ended run is counted once, as a
    # failure when it did not succeed, unless its reason is one the default rule
    # ignores (the harness's campaigns keep the default ``ignore_reasons``).
    "campaign_target_disagrees_with_run": f"""
        SELECT t.run_id, 'campaign ' || c.name || ' target ' || CAST(t.position AS TEXT)
               || ' is ' || t.state || ', its run ' || r.status AS detail
        FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
        JOIN runs r ON r.run_id = t.run_id
        WHERE NOT ((t.state = 'SUCCEEDED' AND r.status = 'SUCCEEDED')
                OR (t.state = 'FAILED' AND r.status IN ('FAILED', 'POLICY_DENIED'))
                OR (t.state = 'CANCELLED' AND r.status = 'CANCELLED')
                OR (t.state = 'ACTIVE' AND r.status NOT IN {TERMINAL}))""",
    "campaign_outcome_wrong": """
        SELECT t.run_id, 'campaign ' || c.name || ' target ' || CAST(t.position AS TEXT)
               || ' ended ' || t.state || ' ' || COALESCE(t.reason_code, '') || ': '
               || CAST(COUNT(o.seq) AS TEXT) || ' counted finish(es), '
               || CAST(COALESCE(SUM(o.failed), 0) AS TEXT) || ' failed' AS detail
        FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
        LEFT JOIN campaign_outcomes o ON o.campaign_id = t.campaign_id
                                     AND o.run_id = t.run_id
        WHERE t.run_id IS NOT NULL AND t.state IN ('SUCCEEDED', 'FAILED', 'CANCELLED')
        GROUP BY c.name, t.position, t.run_id, t.state, t.reason_code
        HAVING COUNT(o.seq) <> CASE WHEN t.state = 'SUCCEEDED' OR COALESCE(t.reason_code, '')
                                         NOT IN ('CANCELLED_BY_USER', 'CAMPAIGN_STOPPED')
                                    THEN 1 ELSE 0 END
            OR COALESCE(SUM(o.failed), 0) <> CASE WHEN t.state = 'SUCCEEDED' THEN 0
                                                  ELSE COUNT(o.seq) END""",
    # A stopped campaign dispatched nothing after its stop, and none of its runs was
    # claimed for the first time after it (its waiting runs were cancelled).
    "campaign_dispatch_after_stop": """
        SELECT t.run_id, 'campaign ' || c.name || ' stopped; target '
               || CAST(t.position AS TEXT) || ' dispatched or first claimed after' AS detail
        FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
        WHERE c.status = 'STOPPED' AND t.dispatched_at IS NOT NULL AND (
            t.dispatched_at > c.ended_at + :tolerance
            OR (SELECT MIN(a.started_at) FROM attempts a WHERE a.run_id = t.run_id)
               > c.ended_at + :tolerance)""",
    # None stuck: once the harness is done, every campaign completed or stopped with
    # no target left pending or active.
    "campaign_not_ended": """
        SELECT NULL AS run_id, 'campaign ' || c.name || ' is ' || c.status || ' with '
               || CAST(SUM(CASE WHEN t.state = 'PENDING' THEN 1 ELSE 0 END) AS TEXT)
               || ' pending and '
               || CAST(SUM(CASE WHEN t.state = 'ACTIVE' THEN 1 ELSE 0 END) AS TEXT)
               || ' active target(s)' AS detail
        FROM campaigns c JOIN campaign_targets t ON t.campaign_id = c.campaign_id
        GROUP BY c.campaign_id, c.name, c.status
        HAVING c.status NOT IN ('COMPLETED', 'STOPPED')
            OR SUM(CASE WHEN t.state = 'PENDING' THEN 1 ELSE 0 END) > 0
            OR SUM(CASE WHEN t.state = 'ACTIVE' THEN 1 ELSE 0 END) > 0""",
}
# When a target's batch was released (``campaigns.released_at``: a JSON list, one
# time per released batch), per dialect.
RELEASED_AT = {
    "postgresql": "CAST(c.released_at ->> t.batch AS DOUBLE PRECISION)",
    "sqlite": "json_extract(c.released_at, '$[' || t.batch || ']')",
}

# --- reads for the report -------------------------------------------------------------

RUN_STATUSES = "SELECT run_id, task_id, status, attempt_count FROM runs"
STATUS_COUNTS = "SELECT status, COUNT(*) AS n FROM runs GROUP BY status"
LAST_EVENT = history.LAST_WRITTEN
WITHDRAWALS_PENDING = "SELECT COUNT(*) FROM runs WHERE close_due_at IS NOT NULL"
# Runs whose ledger holds a pull request, begun or done.
PULL_REQUESTS_BEGUN = "SELECT DISTINCT run_id FROM side_effects WHERE effect_key = 'pull_request'"
RUNS_WITH_TASKS = """
SELECT r.run_id, r.task_id, r.tenant, r.repo, r.status, r.outcome, r.reason_code,
       r.attempt_count, r.max_attempts, t.prompt, t.idempotency_key
FROM runs r JOIN tasks t ON t.task_id = r.task_id
"""
ATTEMPTS = """
SELECT run_id, attempt_no, worker_id, status, reason_code, message, lease_status,
       fencing_token, started_at, ended_at, lease_ended_at, lease_expires_at
FROM attempts ORDER BY run_id, attempt_no
"""
# Cancels a user (the harness) made, with the status each one found the run in.
USER_CANCELS = """
SELECT run_id, from_status, to_status, at FROM """ + history.ALL + """ h
WHERE actor = 'user' AND to_status IN ('CANCEL_REQUESTED', 'CANCELLED')
"""
# When maintenance took a lost lease back (the run left its stage for STALE_LEASE).
RECOVERIES = """
SELECT run_id, attempt_no, MIN(at) AS at FROM """ + history.ALL + """ h
WHERE to_status = 'STALE_LEASE' GROUP BY run_id, attempt_no
"""
WORKERS = "SELECT worker_id, started_at FROM workers"
CAMPAIGN_STATUSES = "SELECT name, status FROM campaigns"
# The harness's campaigns as they ended, for the report.
CAMPAIGN_SUMMARY = """
SELECT c.name, c.status, c.released_batch, c.finishes, c.stop_reason, t.state,
       CASE WHEN t.run_id IS NULL THEN 0 ELSE 1 END AS has_run, COUNT(*) AS n
FROM campaigns c JOIN campaign_targets t ON t.campaign_id = c.campaign_id
GROUP BY c.name, c.status, c.released_batch, c.finishes, c.stop_reason, t.state,
         CASE WHEN t.run_id IS NULL THEN 0 ELSE 1 END
"""
# Workers that hold a live lease now (the victims worth killing).
LEASE_HOLDERS = "SELECT DISTINCT worker_id FROM attempts WHERE lease_status = 'ACTIVE'"

# --- fault injection (PostgreSQL) -------------------------------------------------------

# Sessions of this database other than the caller's and the harness's own.
SESSIONS = """
SELECT pid, COALESCE(application_name, '') AS application_name FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend' AND COALESCE(application_name, '') <> :own
"""
TERMINATE = "SELECT pg_terminate_backend(:pid)"
NOTIFY = "SELECT pg_notify(:channel, :payload)"


def check_database(store: Store) -> list[Violation]:
    """Every invariant the database can show: ``Store.audit()`` and ``CHAOS_CHECKS``."""
    found = store.audit()
    with store.reads.connect() as conn:
        found.extend(run_checks(conn))
    return found


def run_checks(conn: Connection, params: dict[str, Any] | None = None) -> list[Violation]:
    values = {"tolerance": CANCEL_TOLERANCE_SECONDS, **(params or {})}
    found: list[Violation] = []
    released_at = RELEASED_AT["postgresql" if conn.dialect.name == "postgresql" else "sqlite"]
    for name, statement in CHAOS_CHECKS.items():
        statement = statement.replace("{released_at}", released_at)
        clause = text(statement)
        used = {k: v for k, v in values.items() if f":{k}" in statement}
        for r in conn.execute(clause, used):
            found.append(Violation(name, r.run_id, str(r.detail)))
    return found
