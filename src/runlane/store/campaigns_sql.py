"""The statements of campaigns (store/campaigns.py). Rendered like the ``*_sql``
(``Statements.render``: ``{now}``, ``{lock_for_update}``; ``IN :name`` lists are
expanding parameters on both dialects).

Lock order, kept by every writer of a campaign: a run's row (the writes that end a
run lock it first), then its campaign's row (``CAMPAIGN_LOCK``), then the campaign's
waiting runs (a stop or a pause: ``WAITING_RUNS``), then counters, then lanes (the
store's own order). The dispatch takes the campaign row and then writes new runs and
their lanes: no run row of another is waited for while the campaign row is held
except the campaign's own waiting runs, which no claimer holds while it waits for a
campaign.
"""

from __future__ import annotations

# --- create ---------------------------------------------------------------------------

# One campaign per (tenant, name): the second create of it inserts nothing and reads
# the first (uq_campaigns_tenant_name).
CAMPAIGN_INSERT = """
INSERT INTO campaigns (campaign_id, tenant, name, owner, status, digest, document, batches,
                       released_batch, released_at, active, finishes, recent,
                       stop_window, created_at, updated_at)
VALUES (:campaign_id, :tenant, :name, :owner, 'ACTIVE', :digest, :document, :batches,
        0, :released_at, 0, 0, '', :stop_window, {now}, {now})
ON CONFLICT (tenant, name) DO NOTHING
RETURNING campaign_id
"""
CAMPAIGN_BY_NAME = """
SELECT * FROM campaigns WHERE tenant = :tenant AND name = :name
"""
CAMPAIGN_BY_NAME_ANY_TENANT = """
SELECT * FROM campaigns WHERE name = :name ORDER BY tenant
"""
CAMPAIGN_LIST = """
SELECT * FROM campaigns ORDER BY created_at, campaign_id
"""
CAMPAIGN_LIST_TENANT = """
SELECT * FROM campaigns WHERE tenant = :tenant ORDER BY created_at, campaign_id
"""

# --- the campaign row --------------------------------------------------------------------

# The campaign's row, locked for the rest of the transaction (PostgreSQL; SQLite's
# transaction holds the file from BEGIN IMMEDIATE).
CAMPAIGN_LOCK = """
SELECT * FROM campaigns WHERE campaign_id = :campaign_id {lock_for_update}
"""
# The scheduler pass: a campaign another scheduler is releasing is left to it.
CAMPAIGN_LOCK_SKIP = {
    "postgresql": """
SELECT * FROM campaigns WHERE campaign_id = :campaign_id AND status = 'ACTIVE'
FOR UPDATE SKIP LOCKED
""",
    "sqlite": """
SELECT * FROM campaigns WHERE campaign_id = :campaign_id AND status = 'ACTIVE'
""",
}
ACTIVE_CAMPAIGNS = """
SELECT campaign_id FROM campaigns WHERE status = 'ACTIVE' ORDER BY campaign_id
"""
# A release: compare-and-set on the batch counter, so a batch is released once however
# many schedulers try.
CAMPAIGN_RELEASE = """
UPDATE campaigns SET released_batch = :next, released_at = :released_at, updated_at = {now}
WHERE campaign_id = :campaign_id AND released_batch = :current AND status = 'ACTIVE'
"""
CAMPAIGN_ACTIVE_ADD = """
UPDATE campaigns SET active = active + :n, updated_at = {now} WHERE campaign_id = :campaign_id
"""
CAMPAIGN_SET_STATUS = """
UPDATE campaigns SET status = :to_status, updated_at = {now},
    stop_reason = CASE WHEN CAST(:to_status AS VARCHAR(16)) = 'STOPPED'
                       THEN CAST(:stop_reason AS TEXT) ELSE stop_reason END,
    ended_at = CASE WHEN CAST(:to_status AS VARCHAR(16)) IN ('STOPPED', 'COMPLETED')
                    THEN {now} ELSE NULL END,
    recent = CASE WHEN :new_window = 1 THEN '' ELSE recent END
WHERE campaign_id = :campaign_id AND status IN :sources
"""

# --- targets ---------------------------------------------------------------------------

# How the newest released batch stands (the release rule's input).
BATCH_PROGRESS = """
SELECT COUNT(*) AS size,
       SUM(CASE WHEN state IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN 1 ELSE 0 END)
         AS finished,
       SUM(CASE WHEN state = 'SUCCEEDED' THEN 1 ELSE 0 END) AS succeeded,
       MAX(ended_at) AS last_finished_at
FROM campaign_targets WHERE campaign_id = :campaign_id AND batch = :batch
"""
ACTIVE_BY_REPO = """
SELECT repo, COUNT(*) AS n FROM campaign_targets
WHERE campaign_id = :campaign_id AND state = 'ACTIVE'
GROUP BY repo
"""
# Pending targets of released batches, in rollout order (ix_campaign_targets_state).
PENDING_TARGETS = """
SELECT position, target_key, repo, vars, owner, batch, generation FROM campaign_targets
WHERE campaign_id = :campaign_id AND state = 'PENDING' AND batch <= :released
ORDER BY batch, position
LIMIT :limit
"""
TARGET_DISPATCHED = """
UPDATE campaign_targets
SET state = 'ACTIVE', task_id = :task_id, run_id = :run_id, dispatched_at = :now,
    ended_at = NULL, run_status = NULL, reason_code = NULL, outcome = NULL
WHERE campaign_id = :campaign_id AND position = :position AND state = 'PENDING'
"""
# A campaign's run ended (its campaign found by the run's own write: lease_sql._SET_RETURNING):
# on PostgreSQL one statement does the rest. ``t``: the target, if this run is still its
# current one (ix_campaign_targets_run); ``c``: the campaign's counts and the stop
# rule's window (``recent``: "1"/"0" per counted finish, newest first, cut to
# ``:window``), written on the row's newest version under its lock, whatever this
# statement's snapshot (so two runs of one campaign ending at once both count, in
# order); ``o``: the numbered finish (the report's history). Returns nothing when the
# target had moved on. SQLite runs the same three writes one by one (TARGET_END,
# CAMPAIGN_END, OUTCOME_INSERT: no writes inside WITH there).
TARGET_END_PG = """
WITH t AS (
    UPDATE campaign_targets
    SET state = :state, ended_at = :now, run_status = :run_status,
        reason_code = :reason_code, outcome = :outcome
    WHERE run_id = :run_id AND campaign_id = :campaign_id AND state = 'ACTIVE'
    RETURNING campaign_id, position, batch, repo, owner, task_id),
c AS (
    UPDATE campaigns
    SET active = active - 1, finishes = finishes + CAST(:counted AS integer),
        recent = CASE WHEN CAST(:counted AS integer) = 1
                      THEN substr(CAST(:flag AS text) || recent, 1, CAST(:window AS integer))
                      ELSE recent END,
        updated_at = :now
    FROM t WHERE campaigns.campaign_id = t.campaign_id
    RETURNING campaigns.status, campaigns.active, campaigns.finishes, campaigns.recent),
o AS (
    INSERT INTO campaign_outcomes (campaign_id, seq, position, run_id, batch, failed,
                                   reason_code, at)
    SELECT t.campaign_id, c.finishes, t.position, :run_id, t.batch,
           CAST(:failed AS integer), :reason_code, :now
    FROM t, c WHERE CAST(:counted AS integer) = 1)
SELECT t.position, t.batch, t.repo, t.owner, t.task_id, c.status, c.active, c.finishes,
       c.recent
FROM t, c
"""
TARGET_END = """
UPDATE campaign_targets
SET state = :state, ended_at = :now, run_status = :run_status, reason_code = :reason_code,
    outcome = :outcome
WHERE run_id = :run_id AND campaign_id = :campaign_id AND state = 'ACTIVE'
RETURNING position, batch, repo, owner, task_id
"""
CAMPAIGN_END = """
UPDATE campaigns
SET active = active - 1, finishes = finishes + :counted,
    recent = CASE WHEN :counted = 1 THEN substr(:flag || recent, 1, :window) ELSE recent END,
    updated_at = :now
WHERE campaign_id = :campaign_id
RETURNING status, active, finishes, recent
"""
OUTCOME_INSERT = """
INSERT INTO campaign_outcomes (campaign_id, seq, position, run_id, batch, failed,
                               reason_code, at)
VALUES (:campaign_id, :seq, :position, :run_id, :batch, :failed, :reason_code, :now)
"""
CAMPAIGN_DOCUMENT = """
SELECT campaign_id, digest, document FROM campaigns WHERE campaign_id = :campaign_id
"""
# A stopped campaign's targets never dispatched: cancelled without a run.
PENDING_CANCELLED = """
UPDATE campaign_targets SET state = 'CANCELLED', ended_at = :now,
                            reason_code = 'CAMPAIGN_STOPPED'
WHERE campaign_id = :campaign_id AND state = 'PENDING'
"""
# The campaign's runs that wait to be claimed (or held by its pause), rows locked in
# run_id order: a stop cancels them, a pause holds them, a resume queues them again.
# Waits for a claimer holding one: the claim commits first, and the run, claimed
# then, is no longer waiting here.
WAITING_RUNS = """
SELECT r.run_id, r.status, r.fencing_token, r.reason_code FROM campaign_targets t
JOIN runs r ON r.run_id = t.run_id
WHERE t.campaign_id = :campaign_id AND t.state = 'ACTIVE' AND r.status IN :statuses
ORDER BY r.run_id
{lock_r}
"""
# The tasks of a campaign's runs that hold a lease and have no cancel yet (a stop that
# cancels running runs cancels these, each in a transaction of its own: no run is
# waited for while the campaign row is held).
RUNNING_TASKS = """
SELECT t.task_id FROM campaign_targets t
JOIN runs r ON r.run_id = t.run_id
WHERE t.campaign_id = :campaign_id AND t.state = 'ACTIVE' AND r.status IN :statuses
ORDER BY t.task_id
"""
# Stopped campaigns with runs still active (the pass cancels them when the stop says so).
STOPPED_WITH_ACTIVE = """
SELECT campaign_id FROM campaigns WHERE status = 'STOPPED' AND active > 0
ORDER BY campaign_id
"""
FAILED_RETRIED = """
UPDATE campaign_targets
SET state = 'PENDING', generation = generation + 1, task_id = NULL, run_id = NULL
WHERE campaign_id = :campaign_id AND state = 'FAILED'
"""
# Retry-failed of a stopped campaign: the targets its stop cancelled before they started.
STOP_CANCELLED_RETRIED = """
UPDATE campaign_targets SET state = 'PENDING', generation = generation + 1, ended_at = NULL,
                            reason_code = NULL
WHERE campaign_id = :campaign_id AND state = 'CANCELLED' AND run_id IS NULL
  AND reason_code = 'CAMPAIGN_STOPPED'
"""
UNFINISHED_TARGETS = """
SELECT COUNT(*) FROM campaign_targets
WHERE campaign_id = :campaign_id AND state IN ('PENDING', 'ACTIVE')
"""

# --- views -----------------------------------------------------------------------------

TARGETS_BY_STATE = """
SELECT batch, state, COUNT(*) AS n FROM campaign_targets WHERE campaign_id = :campaign_id
GROUP BY batch, state ORDER BY batch, state
"""
FAILED_TARGETS = """
SELECT t.position, t.repo, t.owner, t.batch, t.run_id, t.task_id, t.run_status,
       t.reason_code, r.message
FROM campaign_targets t LEFT JOIN runs r ON r.run_id = t.run_id
WHERE t.campaign_id = :campaign_id AND t.state = 'FAILED'
ORDER BY t.position
"""
SUCCEEDED_TARGETS = """
SELECT t.position, t.repo, t.run_id, t.outcome, s.result
FROM campaign_targets t
LEFT JOIN side_effects s ON s.run_id = t.run_id AND s.effect_key = 'pull_request'
                          AND s.status = 'DONE'
WHERE t.campaign_id = :campaign_id AND t.state = 'SUCCEEDED'
ORDER BY t.position
"""
CAMPAIGN_COST = """
SELECT COALESCE(SUM(r.cost_usd), 0) FROM campaign_targets t
JOIN runs r ON r.task_id = t.task_id
WHERE t.campaign_id = :campaign_id
"""
OUTCOMES_BY_BATCH = """
SELECT batch, COUNT(*) AS finished, SUM(failed) AS failed, MIN(at) AS first_at,
       MAX(at) AS last_at
FROM campaign_outcomes WHERE campaign_id = :campaign_id
GROUP BY batch ORDER BY batch
"""
FAILURES_BY_REASON = """
SELECT COALESCE(reason_code, '') AS reason_code, COUNT(*) AS n FROM campaign_targets
WHERE campaign_id = :campaign_id AND state = 'FAILED'
GROUP BY reason_code ORDER BY n DESC, reason_code
"""
CANCELLED_BY_REASON = """
SELECT COALESCE(reason_code, '') AS reason_code, COUNT(*) AS n FROM campaign_targets
WHERE campaign_id = :campaign_id AND state = 'CANCELLED'
GROUP BY reason_code ORDER BY n DESC, reason_code
"""

# --- notifications ---------------------------------------------------------------------

NOTIFICATION_INSERT = """
INSERT INTO campaign_notifications (notification_id, campaign_id, kind, recipient, payload,
                                    created_at, attempts, next_at)
VALUES (:notification_id, :campaign_id, :kind, :recipient, :payload, {now}, 0, {now})
"""
# Due notifications, oldest first; each taken by pushing its next_at past the send's
# timeout (a compare-and-set on next_at), so two senders never send one at once.
NOTIFICATIONS_DUE = """
SELECT n.notification_id, n.campaign_id, n.kind, n.recipient, n.payload, n.attempts,
       n.next_at, c.document
FROM campaign_notifications n JOIN campaigns c ON c.campaign_id = n.campaign_id
WHERE n.delivered_at IS NULL AND n.next_at <= {now}
ORDER BY n.next_at, n.notification_id
LIMIT :limit
"""
NOTIFICATION_TAKE = """
UPDATE campaign_notifications SET next_at = :until, attempts = attempts + 1
WHERE notification_id = :notification_id AND next_at = :next_at AND delivered_at IS NULL
"""
NOTIFICATION_DELIVERED = """
UPDATE campaign_notifications SET delivered_at = {now}, last_error = NULL
WHERE notification_id = :notification_id
"""
NOTIFICATION_FAILED = """
UPDATE campaign_notifications SET next_at = {now} + :delay, last_error = :error
WHERE notification_id = :notification_id AND delivered_at IS NULL
"""
NOTIFICATIONS_OF = """
SELECT notification_id, kind, recipient, attempts, delivered_at, last_error, created_at
FROM campaign_notifications WHERE campaign_id = :campaign_id
ORDER BY created_at, notification_id
"""

# The campaign a run is the current run of a target of (ix_campaign_targets_run): its
# pull request's body names it.
CAMPAIGN_OF_RUN = """
SELECT c.name FROM campaign_targets t JOIN campaigns c ON c.campaign_id = t.campaign_id
WHERE t.run_id = :run_id
"""
