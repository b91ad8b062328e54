"""The statements of maintenance: the reaper's and the reconciler's listings, the late
cost of a lost lease, a run's uncharged releases and their audit check.

Each listing is one page of a keyset walk: rows past ``:after_at``/``:after_id`` (the
last key of the page before; ``FIRST_KEY`` to start), in key order, ``LIMIT :limit``.
A pass walks on until a page comes back short, so a row that cannot be repaired is
passed over instead of heading every page and every later pass (a fixed
``ORDER BY … LIMIT n`` listed it first forever, and the rows behind it never).
Rendered like the other ``*_sql`` statements (``Statements.render``); a dict holds the two
dialects of a statement that differs.
"""

from __future__ import annotations

# Whether the database answers at all (after a row's repair failed: the row's doing,
# or the database's?).
PING = "SELECT 1"

# Below every key: times are epoch seconds, run ids non-empty text.
FIRST_KEY: tuple[float, str] = (float("-inf"), "")

# --- reaper ------------------------------------------------------------------------

# Expired leases, oldest first, then by run (one ACTIVE lease per run: the key is
# unique); several reapers split the batch. Both the run and the attempt rows are
# locked, and with SKIP LOCKED: the reaper never waits on a row a worker holds (no
# deadlock with a worker ending the attempt), and a heartbeat that is extending the
# lease either finished first (the row is skipped, then no longer expired) or waits
# for the reaper and then finds the lease gone. Reads the active leases through
# uq_attempts_one_active_lease (its predicate is ACTIVE) and sorts those expired: no
# index on the expiry (migration 0027), so a heartbeat changes no indexed column (the
# ``>=`` bound starts the walk; the ``OR`` only breaks ties).
EXPIRED_LEASES = """
SELECT a.run_id, a.fencing_token, a.worker_id, a.lease_expires_at
FROM attempts a
JOIN runs r ON r.run_id = a.run_id
WHERE a.lease_status = 'ACTIVE'
  AND a.lease_expires_at <= {now}
  AND a.lease_expires_at >= :after_at
  AND (a.lease_expires_at > :after_at OR a.run_id > :after_id)
ORDER BY a.lease_expires_at, a.run_id
LIMIT :limit
{lock_ra_skip}
"""

# The reaper's lock on one expired lease's run and attempt (skipped when held).
REAP_LOCK = """
SELECT r.queue FROM runs r
JOIN attempts a ON a.run_id = r.run_id AND a.fencing_token = :token
WHERE r.run_id = :run_id
{lock_ra_skip}
"""

# --- reconciler (seed 000 §25) -----------------------------------------------------

# Admitted runs of tasks without dependencies (those wait in ADMITTED on purpose; the
# scheduler pass resolves them). Keyed (updated_at, run_id).
ADMITTED_NOT_QUEUED = """
SELECT r.run_id, r.updated_at FROM runs r
WHERE r.status = 'ADMITTED' AND r.updated_at <= {now} - :grace
  AND r.updated_at >= :after_at
  AND (r.updated_at > :after_at OR r.run_id > :after_id)
  AND NOT EXISTS (SELECT 1 FROM task_dependencies d WHERE d.task_id = r.task_id)
ORDER BY r.updated_at, r.run_id LIMIT :limit
{lock_r_skip}
"""
# Runs in a state that holds no lease (``:unleased``: terminal or waiting) with an
# ACTIVE lease: a terminal run's lease outlived it; a waiting run's poisons every claim
# of it (the one-ACTIVE-lease index refuses the new attempt, and the claim's whole
# batch with it). Keyed run_id (uq_attempts_one_active_lease).
UNLEASED_WITH_LEASE = """
SELECT a.run_id, a.fencing_token, r.status FROM attempts a JOIN runs r ON r.run_id = a.run_id
WHERE a.lease_status = 'ACTIVE' AND r.status IN :unleased AND a.run_id > :after_id
ORDER BY a.run_id
LIMIT :limit
{lock_a_skip}
"""
# Revoked only while the run is still in one of ``:unleased`` (compare-and-set).
REVOKE_LEASE = """
UPDATE attempts
SET lease_status = 'REVOKED', lease_ended_at = {now}, ended_at = COALESCE(ended_at, {now}),
    status = CASE WHEN status = 'RUNNING' THEN 'FAILED' ELSE status END,
    reason_code = COALESCE(reason_code, :reason_code)
WHERE run_id = :run_id AND fencing_token = :token AND lease_status = 'ACTIVE'
  AND (SELECT r.status FROM runs r WHERE r.run_id = attempts.run_id) IN :unleased
RETURNING {counted_limit_scopes} AS limit_scopes
"""
# Keyed run_id.
QUEUED_OF_CANCELLED_TASK = """
SELECT r.run_id FROM runs r JOIN tasks t ON t.task_id = r.task_id
WHERE r.status IN :waiting AND t.cancel_requested_at IS NOT NULL AND r.run_id > :after_id
ORDER BY r.run_id
LIMIT :limit
{lock_r_skip}
"""
# Keyed run_id.
ACTIVE_WITHOUT_LEASE = """
SELECT r.run_id, r.fencing_token FROM runs r
WHERE r.status IN :active
  AND r.updated_at <= {now} - :grace
  AND r.run_id > :after_id
  AND NOT EXISTS (SELECT 1 FROM attempts a
                  WHERE a.run_id = r.run_id AND a.lease_status = 'ACTIVE')
ORDER BY r.run_id
LIMIT :limit
{lock_r_skip}
"""
STALE_WORKERS = """
UPDATE workers SET status = 'DEAD'
WHERE status IN ('STARTING', 'READY', 'DRAINING') AND heartbeat_at <= {now} - :grace
RETURNING worker_id
"""

# The run's own wall-clock limit (``max_wall_clock_minutes`` of its limits snapshot),
# NULL when it has none or the snapshot does not hold a number there. Never an error:
# one run's odd snapshot must not fail the listing of every run (SQLite's json_extract
# raises on malformed JSON, PostgreSQL's cast on a non-number).
_WALL_CLOCK_MINUTES = {
    "postgresql": """CASE WHEN json_typeof(r.limits -> 'max_wall_clock_minutes') = 'number'
        THEN CAST(r.limits ->> 'max_wall_clock_minutes' AS double precision) END""",
    "sqlite": """CASE WHEN json_valid(r.limits) THEN
        CASE WHEN json_type(r.limits, '$.max_wall_clock_minutes') IN ('integer', 'real')
        THEN json_extract(r.limits, '$.max_wall_clock_minutes') END END""",
}
# How long an attempt may hold its lease: its run's wall-clock limit plus ``:margin``
# (the stages the limit does not cover: clone, commit, push, pull request), else
# ``:max_seconds`` (MAX_ATTEMPT_SECONDS) for a run without one.
_ATTEMPT_BOUND = "COALESCE(({wall}) * 60 + :margin, :max_seconds)"
# Attempts holding their lease past that bound, however well they heartbeat. Keyed
# run_id (uq_attempts_one_active_lease, which the walk reads in order).
_OVERLONG_ATTEMPTS = """
SELECT a.run_id, a.fencing_token, {bound} AS bound_seconds, {wall} AS wall_clock_minutes
FROM attempts a JOIN runs r ON r.run_id = a.run_id
WHERE a.lease_status = 'ACTIVE' AND a.run_id > :after_id
  AND a.started_at <= {now} - {bound}
ORDER BY a.run_id
LIMIT :limit
{lock_ra_skip}
"""
OVERLONG_ATTEMPTS = {
    dialect: _OVERLONG_ATTEMPTS.replace("{bound}", _ATTEMPT_BOUND).replace("{wall}", wall)
    for dialect, wall in _WALL_CLOCK_MINUTES.items()
}

# --- late cost ---------------------------------------------------------------------

# Cost a worker reports after its lease was lost (the agent ran on until it was
# stopped): money spent all the same. Recorded on the attempt of the lease's fencing
# token, apart from what it reported while it held the lease; the run's row is not
# touched (a stale token changes nothing about the run, invariant 3).
ADD_ATTEMPT_LATE_COST = """
UPDATE attempts SET late_cost_usd = late_cost_usd + :usd
WHERE run_id = :run_id AND fencing_token = :token
RETURNING {now} AS now
"""

# --- uncharged releases ------------------------------------------------------------

# A run's releases that did not count against its attempts (attempts' primary key).
UNCHARGED_RELEASES = """
SELECT COUNT(*) FROM attempts WHERE run_id = :run_id AND reason_code = 'LEASE_RELEASED'
"""

# Checks of ``runlane audit`` (``Store.audit``, beside ``audit_sql.AUDIT_CHECKS``).
AUDIT_CHECKS: dict[str, str] = {
    # A run re-claimed and released without charge past MAX_UNCHARGED_RELEASES: the
    # release after the cap is charged (LEASE_RELEASED_OVER_CAP), so none is left.
    "uncharged_releases_over_cap": """
        SELECT run_id, CAST(COUNT(*) AS TEXT) || ' releases without charge, over the cap of '
               || CAST(:max_uncharged_releases AS TEXT) AS detail
        FROM attempts WHERE reason_code = 'LEASE_RELEASED'
        GROUP BY run_id HAVING COUNT(*) > :max_uncharged_releases""",
}
