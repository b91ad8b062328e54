"""Policy versions, admission records, dependencies and budgets."""

from __future__ import annotations

# --- policy, admission, dependencies, budgets ----------------------------------------

POLICY_LATEST = """
SELECT version, digest, document, source, created_at FROM policy_versions
ORDER BY version DESC LIMIT 1
"""
POLICY_VERSION = "SELECT MAX(version) FROM policy_versions"
POLICY_BY_VERSION = "SELECT document FROM policy_versions WHERE version = :version"
# A run's admission record, read when one of its attempts failed: the retry rules it
# was admitted with (``admission.retry``).
RUN_ADMISSION = "SELECT admission, provider FROM runs WHERE run_id = :run_id"
# PostgreSQL: a policy change first waits for every transaction that wrote attempts
# (claims in flight) and holds new ones until it commits (invariant 9). A claim under
# the old policy counts no slot in a scope the new one limits; the counter the next
# claim makes starts from the attempts its snapshot sees, and an uncommitted claim's
# runs were missed (3 live runs against a limit of 2). A claim queued on this lock
# takes its snapshot after it, so it reads the new version. Every writer of attempts
# takes the table's lock before any counter or lane, as this does. Self-conflicting:
# two changes queue, not collide on the next version number.
LOCK_CLAIMS_FOR_POLICY_PG = "LOCK TABLE attempts IN SHARE ROW EXCLUSIVE MODE"
# The transaction's claim (PostgreSQL): the lock its attempt insert takes anyway, taken
# first. It locks counters before that insert (ENSURE_COUNTER, _lock_counters), and a
# policy change holding the table and waiting for those counters was a deadlock; and
# its candidates are read in a snapshot taken after a policy change it waited for.
LOCK_ATTEMPTS_FOR_CLAIM_PG = "LOCK TABLE attempts IN ROW EXCLUSIVE MODE"
POLICY_INSERT = """
INSERT INTO policy_versions (version, digest, document, source, created_at)
VALUES (:version, :digest, :document, :source, :now)
"""
RUN_FOR_POLICY = """
SELECT run_id, tenant, repo, queue, priority, user_id, max_attempts, route_key, policy_version,
       provider
FROM runs WHERE run_id = :run_id
"""
TENANT_QUEUED = """
SELECT tenant, SUM(queued_count) AS queued FROM lanes WHERE tenant IN :tenants
GROUP BY tenant
"""
TENANT_SPEND = """
SELECT tenant, usd FROM tenant_spend WHERE day = :day AND tenant IN :tenants
"""
ADD_TENANT_SPEND = """
INSERT INTO tenant_spend (tenant, day, usd) VALUES (:tenant, :day, :usd)
ON CONFLICT (tenant, day) DO UPDATE SET usd = tenant_spend.usd + excluded.usd
"""
# The tasks a submit names (dependencies, parent) that have a run, with their tenant.
# PostgreSQL share-locks the runs (in run_id order, as every writer locks runs)
# until the submit commits: retention picks runs SKIP LOCKED, so it cannot delete a
# task between this check and the rows that name it (a dependency's foreign key, a
# dependent queued as if the failed task it waits for had never been).
NAMED_TASKS = """
SELECT t.task_id, t.tenant FROM tasks t JOIN runs r ON r.task_id = t.task_id
WHERE t.task_id IN :task_ids
ORDER BY r.run_id
{lock_r_share}
"""
# Runs waiting for a task that just ended.
DEPENDENT_RUNS = """
SELECT r.run_id, r.task_id, r.fencing_token FROM task_dependencies d
JOIN runs r ON r.task_id = d.task_id
WHERE d.depends_on = :task_id AND r.status = 'ADMITTED'
ORDER BY r.run_id
{lock_r}
"""
# How a task's dependencies stand: not yet succeeded, and ended without success.
DEPENDENCY_STATE = """
SELECT
  SUM(CASE WHEN r.status <> 'SUCCEEDED' THEN 1 ELSE 0 END) AS pending,
  SUM(CASE WHEN r.status IN ('FAILED', 'CANCELLED', 'POLICY_DENIED') THEN 1 ELSE 0 END)
    AS failed
FROM task_dependencies d JOIN runs r ON r.task_id = d.depends_on
WHERE d.task_id = :task_id
  -- A retried dependency stands as its newest run (no run retries it).
  AND NOT EXISTS (SELECT 1 FROM runs n WHERE n.retry_of_run_id = r.run_id)
"""
# The scheduler pass: waiting runs due for another look, paged by (created_at, id).
DUE_WAITING = """
SELECT r.run_id, r.task_id, r.status, r.fencing_token, r.tenant, r.repo, r.queue,
       r.priority, r.user_id, r.route_key, r.max_attempts, r.created_at, r.lane_id,
       r.policy_version, r.admission, r.estimated_cost_usd, r.provider
FROM runs r
WHERE r.status = :status
  AND r.visible_at <= {now}
  AND (r.created_at, r.run_id) > (:after_created, :after_id)
  -- A run its campaign's pause holds waits for the resume (store/campaigns.py), not
  -- for a pass (one after a policy change looks at every deferred run).
  AND (r.reason_code IS NULL OR r.reason_code <> 'CAMPAIGN_PAUSED')
ORDER BY r.created_at, r.run_id
LIMIT :limit
{lock_r_skip}
"""
SET_VISIBLE = """
UPDATE runs SET visible_at = :visible_at, reason_code = :reason_code, message = :message,
                updated_at = {now}
WHERE run_id = :run_id AND status = 'WAITING_CAPACITY'
"""
SET_ADMISSION = """
UPDATE runs SET admission = :admission, policy_version = :policy_version
WHERE run_id = :run_id
"""
# After a policy change, the scheduler pass admits the queued backlog again (runs
# admitted under an older version are what CLAIM_ONE_TRIP_PG leaves to the transaction,
# and a run the new policy denies should not wait for its claim to say so). A page is
# :scan entries of the dispatch index, in its order (lane, created_at, run_id), read
# without locks whatever their version: no statement reads the whole queue. The runs of
# the page admitted under another version are then locked, skipping those a claim holds
# (it admits them again itself).
QUEUED_PAGE = """
SELECT r.run_id, r.lane_id, r.created_at, r.policy_version
FROM runs r
WHERE r.status = 'QUEUED'
  AND (r.lane_id, r.created_at, r.run_id) > (:after_lane, :after_created, :after_id)
ORDER BY r.lane_id, r.created_at, r.run_id
LIMIT :scan
"""
_QUEUED_UNDER_OTHER_POLICY = """
SELECT r.run_id, r.task_id, r.fencing_token, r.tenant, r.repo, r.queue, r.priority,
       r.user_id, r.route_key, r.max_attempts, r.risk_class, r.limits, r.lane_id,
       r.policy_version, r.admission, r.provider,
       (SELECT CASE WHEN t.cancel_requested_at IS NULL THEN 0 ELSE 1 END
        FROM tasks t WHERE t.task_id = r.task_id) AS task_cancelled
FROM runs r
WHERE r.run_id {in_run_ids}
  AND r.status = 'QUEUED'
  AND r.policy_version <> :version
ORDER BY r.lane_id, r.created_at, r.run_id
{{lock_r_skip}}
"""
_IN_RUN_IDS = {  # an array of a page's ids, not a thousand placeholders
    "postgresql": "= ANY(CAST(:run_ids AS text[]))", "sqlite": "IN :run_ids"}
QUEUED_UNDER_OTHER_POLICY = {
    dialect: _QUEUED_UNDER_OTHER_POLICY.format(in_run_ids=in_run_ids)
    for dialect, in_run_ids in _IN_RUN_IDS.items()}
# A pass that admitted every queued run again under a version stamps it, once; a
# scheduler's first pass skips the backlog of a version so stamped.
BACKLOG_ADMITTED = "SELECT backlog_admitted_at FROM policy_versions WHERE version = :version"
MARK_BACKLOG_ADMITTED = """
UPDATE policy_versions SET backlog_admitted_at = {now}
WHERE version = :version AND backlog_admitted_at IS NULL
"""
# Those of them still queued under another version (the pass could not lock them).
COUNT_QUEUED_UNDER_OTHER_POLICY = {
    dialect: "SELECT COUNT(*) FROM runs r WHERE r.run_id " + in_run_ids
             + " AND r.status = 'QUEUED'"
             " AND r.policy_version <> (SELECT COALESCE(MAX(version), 0) FROM policy_versions)"
    for dialect, in_run_ids in _IN_RUN_IDS.items()}
# The new decisions of a page of runs, admitted again: one statement on PostgreSQL;
# SQLite sends SET_ADMISSION row by row (in process, no round trips).
SET_ADMISSIONS_PG = """
UPDATE runs r SET admission = CAST(u.admission AS json), policy_version = :policy_version
FROM unnest(CAST(:run_ids AS text[]), CAST(:admissions AS text[])) AS u(run_id, admission)
WHERE r.run_id = u.run_id
"""
