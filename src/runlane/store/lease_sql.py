"""A lease's writes: the heartbeat, the fenced status writes, the end of an attempt,
batched completion, cost reports, the side-effect ledger and cancellation."""

from __future__ import annotations

from runlane.store.dialect_sql import COUNTED_SCOPES

# --- heartbeat ---------------------------------------------------------------------

# Extend every lease a worker still holds, in one statement: only where the lease is
# ACTIVE, not yet expired, still the run's newest (its token is the run's token), and
# the very lease the worker names (``lease_keys``: "run_id token"). Matching the run's
# token alone let a beat carrying a stale token extend the same worker's newer lease
# of the run (invariant 3). The run's status rides along as the control signal
# (CANCEL_REQUESTED). The leases are found by their runs (``uq_attempts_one_active_lease``);
# no index by worker (migration 0015): each beat rewrites an indexed column, so every
# index an ACTIVE lease is in gets an entry per lease per beat.
HEARTBEAT = """
UPDATE attempts
SET lease_expires_at = {now} + :ttl,
    heartbeat_at = {now}
WHERE attempts.worker_id = :worker_id
  AND attempts.run_id IN :run_ids
  AND attempts.run_id || ' ' || CAST(attempts.fencing_token AS TEXT) IN :lease_keys
  AND attempts.lease_status = 'ACTIVE'
  AND attempts.lease_expires_at > {now}
  AND attempts.fencing_token = (SELECT r.fencing_token FROM runs r
                                WHERE r.run_id = attempts.run_id)
RETURNING attempts.run_id, attempts.fencing_token, attempts.lease_expires_at,
          (SELECT r.status FROM runs r WHERE r.run_id = attempts.run_id) AS status
"""

# --- status writes -----------------------------------------------------------------

_SET_RUN_STATUS = """
UPDATE runs
SET status = :to_status,
    updated_at = {now},
    visible_at = COALESCE(:visible_at, visible_at),
    reason_code = COALESCE(:reason_code, reason_code),
    message = COALESCE(:message, message),
    outcome = COALESCE(:outcome, outcome),
    ended_at = COALESCE(ended_at, CASE WHEN CAST(:to_status AS VARCHAR(32)) IN
        ('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED') THEN {now} END)
WHERE run_id = :run_id
  AND status IN :sources
  AND fencing_token = :token
"""
_FENCE = """
  AND EXISTS (SELECT 1 FROM attempts a
              WHERE a.run_id = runs.run_id AND a.fencing_token = :token
                AND a.lease_status = 'ACTIVE' AND a.lease_expires_at > {now})
"""
# ``campaign_id``: the campaign whose target's run this is, or NULL (one probe of
# ix_campaign_targets_run): the store records the end of a campaign's run, and
# evaluates its stop rule, in this transaction.
_SET_RETURNING = """RETURNING status, lane_id, task_id, queue, created_at,
    EXISTS (SELECT 1 FROM task_dependencies d WHERE d.depends_on = runs.task_id)
      AS has_dependents,
    (SELECT MIN(ct.campaign_id) FROM campaign_targets ct WHERE ct.run_id = runs.run_id)
      AS campaign_id,
    {now} AS now
"""
SET_RUN_STATUS = _SET_RUN_STATUS + _SET_RETURNING
# A worker's write: also requires its lease to be the run's live lease (invariant 3).
SET_RUN_STATUS_FENCED = _SET_RUN_STATUS + _FENCE + _SET_RETURNING

# Read a run together with one of its attempts before deciding how that attempt
# ends; locks the run row so the decision and the write see the same state.
RUN_WITH_ATTEMPT = """
SELECT r.run_id, r.task_id, r.status, r.fencing_token AS run_token, r.attempt_count,
       (SELECT COUNT(*) FROM attempts x WHERE x.run_id = r.run_id
          AND (x.reason_code IS NULL OR x.reason_code <> 'LEASE_RELEASED')) AS charged_attempts,
       r.max_attempts, r.created_at, r.cost_usd, r.finalize_only_after,
       a.attempt_no, a.fencing_token, a.lease_status, a.lease_expires_at, a.worker_id,
       {now} AS now
FROM runs r
JOIN attempts a ON a.run_id = r.run_id AND a.fencing_token = :token
WHERE r.run_id = :run_id
{lock_r}
"""
# The same, read without a lock: why a fenced write lost (Store._refusal).
RUN_WITH_ATTEMPT_READ = RUN_WITH_ATTEMPT.replace("{lock_r}", "")

# Close an attempt once: its outcome, and its lease if that is still ACTIVE.
_END_ATTEMPT = """
UPDATE attempts
SET status = :status,
    reason_code = :reason_code,
    message = :message,
    retry_after_seconds = :retry_after_seconds,
    lease_status = CASE WHEN lease_status = 'ACTIVE' THEN :lease_status ELSE lease_status END,
    lease_ended_at = COALESCE(lease_ended_at, :now),
    ended_at = :now
WHERE run_id = :run_id
  AND fencing_token = :token
  AND ended_at IS NULL
"""
# Returns the scopes whose slots the attempt held, once: PostgreSQL clears them in
# the same statement and returns the old value (the row locked first, so the value is
# the one this update replaces); SQLite's RETURNING sees only the new row, so the
# release clears them after (CLEAR_ATTEMPT_SLOTS, in process; on PostgreSQL it was
# one more round trip per failed or reaped run).
END_ATTEMPT = {
    "postgresql": """
UPDATE attempts a
SET status = :status,
    reason_code = :reason_code,
    message = :message,
    retry_after_seconds = :retry_after_seconds,
    lease_status = CASE WHEN a.lease_status = 'ACTIVE' THEN :lease_status
                        ELSE a.lease_status END,
    lease_ended_at = COALESCE(a.lease_ended_at, :now),
    ended_at = :now,
    limit_scopes = NULL
FROM (SELECT o.run_id, o.fencing_token, o.limit_scopes FROM attempts o
      WHERE o.run_id = :run_id AND o.fencing_token = :token AND o.ended_at IS NULL
      FOR UPDATE) old
WHERE a.run_id = old.run_id AND a.fencing_token = old.fencing_token
RETURNING """ + COUNTED_SCOPES["postgresql"].format(col="old.limit_scopes") + """ AS limit_scopes
""",
    "sqlite": _END_ATTEMPT + "RETURNING " + COUNTED_SCOPES["sqlite"].format(
        col="limit_scopes") + " AS limit_scopes\n",
}
# An attempt whose row was ended but whose lease was left ACTIVE (END_ATTEMPT matches
# it no more): end the lease alone, keeping the outcome the row records. Without it
# the run moved on (the reaper requeued it) with the lease still ACTIVE, which every
# later claim of the run then hit on the one-ACTIVE-lease index. Returns the scopes
# the attempt still holds; the caller clears them (CLEAR_ATTEMPT_SLOTS).
END_LEASE = """
UPDATE attempts
SET lease_status = :lease_status,
    lease_ended_at = COALESCE(lease_ended_at, :now)
WHERE run_id = :run_id
  AND fencing_token = :token
  AND lease_status = 'ACTIVE'
RETURNING {counted_limit_scopes} AS limit_scopes
"""
# The fenced compare-and-set of SET_RUN_STATUS_FENCED for many leases at once: each
# row moves only from its lease's status, with its lease's token, while that lease is
# the run's ACTIVE, unexpired one (invariant 3). A stale or lost lease matches no row
# and changes nothing; the others still move. The store checks every lease's path
# against the transition table before it sends a row. SQLite; PostgreSQL sends the
# same compare-and-set as the ``won`` CTE of COMPLETE_WRITE_PG.
SET_RUN_STATUS_FENCED_MANY = """
UPDATE runs
SET status = :to_status,
    updated_at = {now},
    outcome = COALESCE(:outcome, outcome),
    ended_at = COALESCE(ended_at, CASE WHEN CAST(:to_status AS VARCHAR(32)) IN
        ('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED') THEN {now} END)
FROM {lease_batch}
WHERE runs.run_id = b.run_id
  AND runs.status = b.source
  AND runs.fencing_token = b.token
  AND EXISTS (SELECT 1 FROM attempts a
              WHERE a.run_id = runs.run_id AND a.fencing_token = b.token
                AND a.lease_status = 'ACTIVE' AND a.lease_expires_at > {now})
RETURNING runs.run_id, runs.lane_id, runs.task_id, runs.created_at,
    EXISTS (SELECT 1 FROM task_dependencies d WHERE d.depends_on = runs.task_id)
      AS has_dependents,
    (SELECT MIN(ct.campaign_id) FROM campaign_targets ct WHERE ct.run_id = runs.run_id)
      AS campaign_id,
    (SELECT """ + COUNTED_SCOPES["sqlite"].format(col="a.limit_scopes") + """ FROM attempts a
     WHERE a.run_id = runs.run_id AND a.fencing_token = runs.fencing_token) AS limit_scopes,
    {now} AS now
"""
# PostgreSQL: the whole common path of a batched completion in one statement of
# data-modifying CTEs (SQLite sends the same writes one after another:
# SET_RUN_STATUS_FENCED_MANY, the events, END_ATTEMPTS). ``won`` is the fenced
# compare-and-set above; the events (``:hop_*``, one row per hop of each lease's path,
# in order, the paths checked against the transition table by the store) are written
# for the won runs only, in hop order (ORDINALITY: event ids follow the hops); the won
# runs' attempts end and their leases are released. ``won`` reads each attempt's
# limit scopes as the fenced move found them (all CTEs see one snapshot): the store
# gives those slots back, and releases dependents, in statements of their own, only for
# the rows that need it. Every CTE uses one ``t.now``. ``ended`` looks the attempts up
# among the ACTIVE leases (a won run's lease is its ACTIVE one, checked by ``won`` and
# held by the run's row lock): a partial index that stays as small as the leases held,
# where a join on the whole table got a generic plan, prepared while ``attempts`` was
# nearly empty, that scans it sequentially (0.43 ms per batch at 6,000 attempts, and
# on). The store checks that every won run ended its attempt.
COMPLETE_WRITE_PG = """
WITH t AS (SELECT {now} AS now),
b AS (SELECT * FROM {lease_batch}),
won AS (
    UPDATE runs
    SET status = :to_status,
        updated_at = t.now,
        outcome = COALESCE(:outcome, runs.outcome),
        ended_at = COALESCE(runs.ended_at, CASE WHEN CAST(:to_status AS VARCHAR(32)) IN
            ('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED') THEN t.now END)
    FROM b, t
    WHERE runs.run_id = b.run_id
      AND runs.status = b.source
      AND runs.fencing_token = b.token
      AND EXISTS (SELECT 1 FROM attempts a
                  WHERE a.run_id = runs.run_id AND a.fencing_token = b.token
                    AND a.lease_status = 'ACTIVE' AND a.lease_expires_at > t.now)
    RETURNING runs.run_id, runs.lane_id, runs.task_id, runs.fencing_token, runs.created_at,
        EXISTS (SELECT 1 FROM task_dependencies d WHERE d.depends_on = runs.task_id)
          AS has_dependents,
        (SELECT MIN(ct.campaign_id) FROM campaign_targets ct WHERE ct.run_id = runs.run_id)
          AS campaign_id,
        (SELECT """ + COUNTED_SCOPES["postgresql"].format(col="a.limit_scopes") + """
         FROM attempts a
         WHERE a.run_id = runs.run_id AND a.fencing_token = runs.fencing_token)
          AS limit_scopes),
events AS (
    INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                            fencing_token)
    SELECT h.run_id, b.attempt_no, t.now, b.actor, h.from_status, h.to_status, b.token
    FROM unnest(CAST(:hop_run_ids AS text[]), CAST(:hop_from AS text[]),
                CAST(:hop_to AS text[]))
      WITH ORDINALITY AS h(run_id, from_status, to_status, n)
    JOIN b ON b.run_id = h.run_id
    JOIN won ON won.run_id = h.run_id
    CROSS JOIN t
    ORDER BY h.n
    RETURNING 1),
-- The attempt is the record of its end (FINALIZING -> SUCCEEDED, store/history.py),
-- placed after the stage hops above (``events`` read first: their ids come first).
ended AS (
    UPDATE attempts
    SET status = 'SUCCEEDED',
        lease_status = 'RELEASED',
        lease_ended_at = t.now,
        ended_at = t.now,
        limit_scopes = NULL,  -- given back by this transaction (won returned them), once
        end_tx = CAST(CAST(pg_current_xact_id() AS text) AS bigint),
        end_seq = nextval('run_events_event_id_seq'),
        end_from_status = 'FINALIZING',
        end_to_status = :to_status
    FROM won, t
    WHERE attempts.run_id = won.run_id
      AND attempts.fencing_token = won.fencing_token
      AND attempts.lease_status = 'ACTIVE'
      AND attempts.ended_at IS NULL
      AND (SELECT COUNT(*) FROM events) >= 0
    RETURNING attempts.run_id),
-- Campaigns' runs among the won (docs/campaigns.md): each target's end, its campaign's
-- counts and stop-rule window (a success counts, as a "0"), the numbered finishes; the
-- campaigns' rows locked in campaign_id order first (``cl``), after the runs' rows, as
-- every end of a campaign's run locks them. No row at all for a batch of no campaign.
ct AS (
    UPDATE campaign_targets g
    SET state = 'SUCCEEDED', ended_at = t.now, run_status = 'SUCCEEDED', reason_code = NULL,
        outcome = :outcome
    FROM won, t
    WHERE won.campaign_id IS NOT NULL AND g.campaign_id = won.campaign_id
      AND g.run_id = won.run_id AND g.state = 'ACTIVE'
    RETURNING g.campaign_id, g.position, g.batch, g.run_id, g.repo, g.owner),
cl AS MATERIALIZED (
    SELECT c.campaign_id FROM campaigns c
    WHERE c.campaign_id IN (SELECT campaign_id FROM won)
    ORDER BY c.campaign_id FOR UPDATE OF c),
cg AS (SELECT campaign_id, COUNT(*) AS n FROM ct GROUP BY campaign_id),
cc AS (
    UPDATE campaigns k
    SET active = active - cg.n, finishes = finishes + cg.n, updated_at = t.now,
        recent = substr(repeat('0', CAST(cg.n AS integer)) || recent, 1, stop_window)
    FROM cg, cl, t
    WHERE k.campaign_id = cg.campaign_id AND cl.campaign_id = cg.campaign_id
    RETURNING k.campaign_id, k.finishes, k.active, k.status, k.recent),
co AS (
    INSERT INTO campaign_outcomes (campaign_id, seq, position, run_id, batch, failed,
                                   reason_code, at)
    SELECT ct.campaign_id,
           cc.finishes - cg.n + ROW_NUMBER() OVER (PARTITION BY ct.campaign_id
                                                   ORDER BY ct.run_id),
           ct.position, ct.run_id, ct.batch, 0, NULL, t.now
    FROM ct JOIN cg USING (campaign_id) JOIN cc USING (campaign_id) CROSS JOIN t)
SELECT won.run_id, won.lane_id, won.task_id, won.created_at, won.has_dependents,
       won.campaign_id, won.limit_scopes, t.now, (SELECT COUNT(*) FROM ended) AS attempts_ended,
       ct.position AS target_position, ct.batch AS target_batch, ct.repo AS target_repo,
       ct.owner AS target_owner, cc.active AS campaign_active, cc.status AS campaign_status,
       cc.recent AS campaign_recent
FROM won CROSS JOIN t
LEFT JOIN ct ON ct.run_id = won.run_id
LEFT JOIN cc ON cc.campaign_id = ct.campaign_id
"""
# SQLite: the won leases' attempts end with END_ATTEMPT row by row, sent as one
# executemany. (It was PostgreSQL's too, before COMPLETE_WRITE_PG: a set-based UPDATE
# joined to the batch on the whole of ``attempts`` got a generic plan that scans it
# sequentially, 0.16 ms per batch at 50 attempts, 0.85 ms at 5,000, and on.)
END_ATTEMPTS = _END_ATTEMPT

ADD_ATTEMPT_COST = """
UPDATE attempts
SET cost_usd = cost_usd + :usd,
    input_tokens = input_tokens + :input_tokens,
    output_tokens = output_tokens + :output_tokens
WHERE run_id = :run_id
  AND fencing_token = :token
  AND lease_status = 'ACTIVE'
  AND lease_expires_at > {now}
"""
ADD_RUN_COST = """
UPDATE runs SET cost_usd = cost_usd + :usd, updated_at = {now}
WHERE run_id = :run_id AND fencing_token = :token
RETURNING cost_usd, {now} AS now, provider
"""
# A run's cost limit (max_cost_usd, or a model-token limit) was crossed: when, on the
# run and on the attempt that crossed it; the first crossing stays (issue 29).
MARK_COST_EXCEEDED_RUN = """
UPDATE runs SET cost_exceeded_at = COALESCE(cost_exceeded_at, {now}) WHERE run_id = :run_id
"""
MARK_COST_EXCEEDED_ATTEMPT = """
UPDATE attempts SET cost_exceeded_at = COALESCE(cost_exceeded_at, {now})
WHERE run_id = :run_id AND fencing_token = :token
"""
# The model tokens of a run, all its attempts (its token limits count them like cost).
RUN_TOKENS = """
SELECT COALESCE(SUM(input_tokens), 0) AS input_tokens,
       COALESCE(SUM(output_tokens), 0) AS output_tokens
FROM attempts WHERE run_id = :run_id
"""

# --- side-effect ledger -------------------------------------------------------------

# Record (or take over) the intent to perform an effect. A DONE row is never touched;
# an INTENT left by an older lease is taken over by the newer one.
EFFECT_INTENT_INSERT = """
INSERT INTO side_effects (run_id, effect_key, status, attempt_no, fencing_token, result,
                          created_at, completed_at)
VALUES (:run_id, :effect_key, 'INTENT', :attempt_no, :token, :intent, :now, NULL)
ON CONFLICT (run_id, effect_key) DO UPDATE
SET fencing_token = excluded.fencing_token, attempt_no = excluded.attempt_no,
    result = COALESCE(excluded.result, side_effects.result)
WHERE side_effects.status = 'INTENT' AND side_effects.fencing_token < excluded.fencing_token
"""
EFFECT_GET = """
SELECT run_id, effect_key, status, attempt_no, fencing_token, result, created_at, completed_at
FROM side_effects WHERE run_id = :run_id AND effect_key = :effect_key
"""
EFFECT_DONE = """
UPDATE side_effects SET status = 'DONE', result = :result, completed_at = :now
WHERE run_id = :run_id AND effect_key = :effect_key AND status = 'INTENT'
  AND fencing_token = :token
"""

# --- cancellation ------------------------------------------------------------------

MARK_TASK_CANCELLED = """
UPDATE tasks SET cancel_requested_at = COALESCE(cancel_requested_at, {now})
WHERE task_id = :task_id
RETURNING task_id
"""
# When the task of a run just CANCELLED was asked to cancel (its latency, a metric).
CANCEL_REQUESTED_AT = "SELECT cancel_requested_at FROM tasks WHERE task_id = :task_id"
RUNS_OF_TASK = """
SELECT r.run_id, r.status, r.fencing_token, {now} AS now
FROM runs r WHERE r.task_id = :task_id
{lock_r}
"""
