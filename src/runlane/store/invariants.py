"""The named SQL of the fault harness (``runlane chaos``): the after-run checks that
``Store.audit()`` does not already make, the reads its report is built from, and the
few statements it injects faults with. Every check returns ``run_id`` and ``detail``
rows, like ``sql.AUDIT_CHECKS``; :func:`check_database` runs both sets."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, text

from runlane.store.store import Store, Violation

TERMINAL = "('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED')"

# Times are transaction start times: a write that began just before a cancel took
# the run's row lock may carry a slightly later time than the cancel.
CANCEL_TOLERANCE_SECONDS = 0.5

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
    # checked by ``runlane audit``: sql.AUDIT_CHECKS.)
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
          AND s.created_at > (SELECT MIN(c.at) FROM run_events c
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
}

# --- reads for the report -------------------------------------------------------------

RUN_STATUSES = "SELECT run_id, task_id, status, attempt_count FROM runs"
STATUS_COUNTS = "SELECT status, COUNT(*) AS n FROM runs GROUP BY status"
LAST_EVENT = "SELECT COALESCE(MAX(event_id), 0) FROM run_events"
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
SELECT run_id, from_status, to_status, at FROM run_events
WHERE actor = 'user' AND to_status IN ('CANCEL_REQUESTED', 'CANCELLED')
"""
# When maintenance took a lost lease back (the run left its stage for STALE_LEASE).
RECOVERIES = """
SELECT run_id, attempt_no, MIN(at) AS at FROM run_events
WHERE to_status = 'STALE_LEASE' GROUP BY run_id, attempt_no
"""
WORKERS = "SELECT worker_id, started_at FROM workers"
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
    for name, statement in CHAOS_CHECKS.items():
        clause = text(statement)
        used = {k: v for k, v in values.items() if f":{k}" in statement}
        for r in conn.execute(clause, used):
            found.append(Violation(name, r.run_id, str(r.detail)))
    return found
