"""The audit: runlane's invariants, checked on a live database."""

from __future__ import annotations

from runlane.store import history

# --- audit (runlane's invariants, checked on a live database) ----------------------

AUDIT_CHECKS: dict[str, str] = {
    "two_active_leases": """
        SELECT run_id, 'active leases: ' || CAST(COUNT(*) AS TEXT) AS detail
        FROM attempts WHERE lease_status = 'ACTIVE'
        GROUP BY run_id HAVING COUNT(*) > 1""",
    "overlapping_leases": """
        SELECT b.run_id, 'attempt ' || CAST(b.attempt_no AS TEXT)
               || ' leased before attempt ' || CAST(a.attempt_no AS TEXT)
               || '''s lease ended' AS detail
        FROM attempts a JOIN attempts b
          ON b.run_id = a.run_id AND b.attempt_no > a.attempt_no
        WHERE b.started_at < CASE
            WHEN a.lease_ended_at IS NOT NULL AND a.lease_ended_at < a.lease_expires_at
            THEN a.lease_ended_at ELSE a.lease_expires_at END""",
    "terminal_run_with_live_lease": """
        SELECT r.run_id, 'status ' || r.status || ' with an ACTIVE lease' AS detail
        FROM runs r JOIN attempts a ON a.run_id = r.run_id AND a.lease_status = 'ACTIVE'
        WHERE r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED')""",
    "waiting_run_with_live_lease": """
        SELECT r.run_id, 'status ' || r.status || ' with an ACTIVE lease' AS detail
        FROM runs r JOIN attempts a ON a.run_id = r.run_id AND a.lease_status = 'ACTIVE'
        WHERE r.status IN ('ADMITTED', 'WAITING_CAPACITY', 'QUEUED')""",
    # A leased or cancelling run whose lease ended without the run moving on: no reaper
    # lists it (no ACTIVE lease); the reconciler's repair 4 recovers it.
    "leased_run_without_live_lease": """
        SELECT r.run_id, 'status ' || r.status || ' with no ACTIVE lease' AS detail
        FROM runs r
        WHERE r.status IN ('CLAIMED', 'PREPARING_SANDBOX', 'RUNNING', 'VERIFYING',
                           'JUDGING', 'FINALIZING', 'CANCEL_REQUESTED', 'CANCELLING')
          AND NOT EXISTS (SELECT 1 FROM attempts a
                          WHERE a.run_id = r.run_id AND a.lease_status = 'ACTIVE')""",
    # Markers a run passes through inside one write: persisted, nothing but the
    # reconciler's repair 4 would ever move the run on.
    "run_in_recovery_marker_state": """
        SELECT run_id, 'left in ' || status || ', a state runs only pass through' AS detail
        FROM runs WHERE status IN ('STALE_LEASE', 'FAILED_RETRYABLE')""",
    # An ended run keeps no attempt open (one with its lease still live is reported
    # as terminal_run_with_live_lease).
    "attempt_left_open": """
        SELECT a.run_id, 'attempt ' || CAST(a.attempt_no AS TEXT) || ' ' || a.status
               || ', lease ' || a.lease_status || ', in a ' || r.status || ' run' AS detail
        FROM attempts a JOIN runs r ON r.run_id = a.run_id
        WHERE r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED')
          AND a.lease_status <> 'ACTIVE'
          AND (a.ended_at IS NULL OR a.status = 'RUNNING')""",
    # Invariant 3: a worker wrote about a run with its token after a newer lease of the
    # run had begun (events by the reaper, the reconciler or a user are not a worker's;
    # nor is the note of an effect recorded late, which is the stale lease's own report
    # and changes nothing: store/evidence.py).
    "stale_token_write": """
        SELECT e.run_id, e.actor || ' wrote ' || COALESCE(e.from_status, '-') || ' -> '
               || e.to_status || ' with token ' || CAST(e.fencing_token AS TEXT)
               || ' after the lease with token ' || CAST(MIN(b.fencing_token) AS TEXT)
               || ' began' AS detail
        FROM """ + history.ALL + """ e
        JOIN attempts a ON a.run_id = e.run_id AND a.fencing_token = e.fencing_token
                       AND a.worker_id = e.actor
        JOIN attempts b ON b.run_id = e.run_id AND b.fencing_token > e.fencing_token
                       AND b.started_at < e.at
        WHERE e.reason_code IS NULL OR e.reason_code <> 'LATE_EFFECT_RECORDED'
        GROUP BY e.event_id, e.run_id, e.actor, e.from_status, e.to_status, e.fencing_token""",
    # Invariant 5: a run cancelled (or being cancelled) is never claimed again.
    "claimed_after_cancel": """
        SELECT c.run_id, 'claimed again (attempt ' || CAST(MIN(x.attempt_no) AS TEXT)
               || ') after ' || c.to_status AS detail
        FROM """ + history.ALL + """ c
        JOIN """ + history.ALL + """ x ON x.run_id = c.run_id AND x.event_id > c.event_id
                         AND x.to_status = 'CLAIMED'
        WHERE c.to_status IN ('CANCEL_REQUESTED', 'CANCELLED')
        GROUP BY c.event_id, c.run_id, c.to_status""",
    # A task executes through one run: a second one would execute it twice. Every
    # further run is a retry (`runlane retry`) linked to a finished run of the task.
    "task_with_two_runs": """
        SELECT MIN(run_id) AS run_id, 'task ' || task_id || ' has '
               || CAST(COUNT(*) AS TEXT) || ' runs that retry none' AS detail
        FROM runs WHERE retry_of_run_id IS NULL
        GROUP BY task_id HAVING COUNT(*) > 1""",
    # A retry follows a finished run of its own task: never one still on its way (the
    # task would run twice at once), never another task's.
    "retry_of_unfinished_run": """
        SELECT n.run_id, 'retries run ' || n.retry_of_run_id || ', which is '
               || COALESCE(o.status, 'missing') || CASE WHEN o.task_id <> n.task_id
               THEN ' and of task ' || o.task_id ELSE '' END AS detail
        FROM runs n JOIN runs o ON o.run_id = n.retry_of_run_id
        WHERE n.retry_of_run_id IS NOT NULL
          AND (o.status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'POLICY_DENIED')
               OR o.task_id <> n.task_id)""",
    # Every status change is a compare-and-set recorded as one transition per hop (an
    # event, or on the run's or attempt's row: store/history.py): each starts where
    # the run's previous one ended. A status overwritten without
    # its event (a run taken out of a terminal state, say) breaks the chain.
    "event_chain_broken": """
        SELECT run_id, 'event ' || CAST(event_id AS TEXT) || ' ' || COALESCE(from_status, '-')
               || ' -> ' || to_status || ' follows one that ended ' || prev_status AS detail
        FROM (SELECT e.run_id, e.event_id, e.from_status, e.to_status,
                     LAG(e.to_status) OVER (PARTITION BY e.run_id ORDER BY e.event_id)
                       AS prev_status
              FROM """ + history.ALL + """ e) c
        WHERE prev_status IS NOT NULL
          AND (from_status IS NULL OR from_status <> prev_status)""",
    "fencing_token_not_increasing": """
        SELECT b.run_id, 'attempt ' || CAST(b.attempt_no AS TEXT) || ' token '
               || CAST(b.fencing_token AS TEXT) || ' <= attempt '
               || CAST(a.attempt_no AS TEXT) || ' token '
               || CAST(a.fencing_token AS TEXT) AS detail
        FROM attempts a JOIN attempts b
          ON b.run_id = a.run_id AND b.attempt_no = a.attempt_no + 1
        WHERE b.fencing_token <= a.fencing_token
        UNION ALL
        SELECT r.run_id, 'run token ' || CAST(r.fencing_token AS TEXT)
               || ' behind its attempts' AS detail
        FROM runs r JOIN attempts a ON a.run_id = r.run_id
        GROUP BY r.run_id, r.fencing_token HAVING MAX(a.fencing_token) > r.fencing_token""",
    "attempts_not_contiguous": """
        SELECT r.run_id, 'attempt_count ' || CAST(r.attempt_count AS TEXT) || ' but '
               || CAST(COUNT(a.attempt_no) AS TEXT) || ' attempts numbered up to '
               || CAST(COALESCE(MAX(a.attempt_no), 0) AS TEXT) AS detail
        FROM runs r LEFT JOIN attempts a ON a.run_id = r.run_id
        GROUP BY r.run_id, r.attempt_count
        HAVING COUNT(a.attempt_no) <> r.attempt_count
            OR COALESCE(MAX(a.attempt_no), 0) <> r.attempt_count
            OR COALESCE(MIN(a.attempt_no), 1) <> 1""",
    # Finalize-only attempts (above runs.finalize_only_after) are outside the budget.
    "attempts_over_budget": """
        SELECT r.run_id, CAST(COUNT(*) AS TEXT) || ' charged attempts, max '
               || CAST(r.max_attempts AS TEXT) AS detail
        FROM runs r JOIN attempts a ON a.run_id = r.run_id
        WHERE (a.reason_code IS NULL OR a.reason_code <> 'LEASE_RELEASED')
          AND (r.finalize_only_after IS NULL OR a.attempt_no <= r.finalize_only_after)
        GROUP BY r.run_id, r.max_attempts HAVING COUNT(*) > r.max_attempts""",
    # A withdrawal (close_pull_request) is recorded after its run ended, under no
    # lease (store/evidence.py).
    "side_effect_with_stale_token": """
        SELECT e.run_id, 'effect ' || e.effect_key || ' completed with token '
               || CAST(e.fencing_token AS TEXT) || ' outside that lease' AS detail
        FROM side_effects e
        WHERE e.status = 'DONE' AND e.effect_key <> 'close_pull_request' AND NOT EXISTS (
            SELECT 1 FROM attempts a
            WHERE a.run_id = e.run_id AND a.fencing_token = e.fencing_token
              AND a.started_at <= e.completed_at
              AND e.completed_at <= CASE
                  WHEN a.lease_ended_at IS NOT NULL AND a.lease_ended_at < a.lease_expires_at
                  THEN a.lease_ended_at ELSE a.lease_expires_at END)""",
    # Rows about a lane name it in ``lane_id`` (``run_id`` is NULL).
    "lane_count_drift": """
        SELECT CAST(NULL AS TEXT) AS run_id, l.lane_id,
               'queued_count ' || CAST(l.queued_count AS TEXT) || ' but '
               || CAST(COUNT(r.run_id) AS TEXT) || ' queued runs' AS detail
        FROM lanes l LEFT JOIN runs r ON r.lane_id = l.lane_id AND r.status = 'QUEUED'
        GROUP BY l.lane_id, l.queued_count HAVING COUNT(r.run_id) <> l.queued_count""",
    "queued_run_without_lane": """
        SELECT r.run_id, CASE WHEN r.lane_id IS NULL THEN 'QUEUED with no lane'
                              ELSE 'QUEUED in lane ' || CAST(r.lane_id AS TEXT)
                                   || ', which does not exist' END
               || ': no claim can reach it' AS detail
        FROM runs r
        WHERE r.status = 'QUEUED'
          AND (r.lane_id IS NULL
               OR NOT EXISTS (SELECT 1 FROM lanes l WHERE l.lane_id = r.lane_id))""",
    # Lanes hidden from every claim (out of ix_lanes_pick) while their runs could run:
    # flagged full although the tenant is below its limit (the reconciler re-derives
    # the flags), or asleep past both their next due run and the recheck that bounds
    # a blocked lane's sleep (:recheck, BLOCKED_LANE_RECHECK_SECONDS).
    "lane_hidden_below_tenant_limit": """
        SELECT CAST(NULL AS TEXT) AS run_id, l.lane_id,
               'hidden by tenant_at_limit, but the counter of tenant ' || l.tenant
               || ' is below its limit (or there is none)' AS detail
        FROM lanes l
        WHERE l.tenant_at_limit <> 0
          AND NOT EXISTS (SELECT 1 FROM limit_counters c
                          WHERE c.scope = 'tenant:' || l.tenant
                            AND c.active >= c.max_active)""",
    "lane_asleep_past_its_runs": """
        SELECT CAST(NULL AS TEXT) AS run_id, l.lane_id,
               'asleep until ' || CAST(l.wake_at AS TEXT) || ', its first queued run due at '
               || CAST(q.due AS TEXT) AS detail
        FROM lanes l
        JOIN (SELECT r.lane_id, MIN(r.visible_at) AS due FROM runs r
              WHERE r.status = 'QUEUED' GROUP BY r.lane_id) q ON q.lane_id = l.lane_id
        WHERE l.wake_at > q.due AND l.wake_at > {now} + :recheck""",
    "failed_attempt_without_reason": """
        SELECT run_id, 'attempt ' || CAST(attempt_no AS TEXT) || ' ' || status
               || ' without a reason code' AS detail
        FROM attempts WHERE status IN ('FAILED', 'CANCELLED') AND reason_code IS NULL""",
    # The hot tables carry no foreign keys (schema.py, migration 0007): the store
    # writes every child with its parent, and this is where a slip would show.
    "run_without_task": """
        SELECT r.run_id, 'task ' || r.task_id || ' does not exist' AS detail
        FROM runs r WHERE NOT EXISTS (SELECT 1 FROM tasks t WHERE t.task_id = r.task_id)""",
    "attempt_without_run": """
        SELECT a.run_id, 'attempt ' || CAST(a.attempt_no AS TEXT)
               || ' of a run that does not exist' AS detail
        FROM attempts a WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = a.run_id)""",
    "event_without_run": """
        SELECT e.run_id, CAST(COUNT(*) AS TEXT) || ' event(s) of a run that does not exist'
               AS detail
        FROM run_events e
        WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = e.run_id)
        GROUP BY e.run_id""",
    # Pull-request evidence (store/evidence.py): a run that ended without success with
    # a push or a pull request in its ledger has its withdrawal due or recorded;
    # otherwise its branch or pull request may be on the code host, open and not
    # recorded (``runlane audit --remote-checks`` asks the code host).
    "pull_request_evidence_unsettled": """
        SELECT r.run_id, 'ended ' || r.status || ' with ' || MIN(s.effect_key)
               || ' in its ledger, and no withdrawal recorded or due (the code host '
               || 'may hold its branch or an open pull request)' AS detail
        FROM runs r JOIN side_effects s ON s.run_id = r.run_id
                   AND s.effect_key IN ('push_branch', 'pull_request')
        WHERE r.status IN ('FAILED', 'CANCELLED', 'POLICY_DENIED') AND r.close_due_at IS NULL
          AND NOT EXISTS (SELECT 1 FROM side_effects c WHERE c.run_id = r.run_id
                          AND c.effect_key = 'close_pull_request' AND c.status = 'DONE')
        GROUP BY r.run_id, r.status""",
}
# Slot counters against the slots live attempts hold: one statement, one snapshot.
AUDIT_SLOTS = """
SELECT scope, active, CAST(NULL AS TEXT) AS held FROM limit_counters
UNION ALL
SELECT NULL, NULL, CAST(limit_scopes AS TEXT) FROM attempts
WHERE lease_status = 'ACTIVE' AND limit_scopes IS NOT NULL
"""
# Transitions are checked in Python against the one table.
AUDIT_TRANSITIONS = """
SELECT from_status, to_status, MIN(run_id) AS run_id, COUNT(*) AS n
FROM """ + history.ALL + """ e
WHERE from_status IS NULL OR from_status <> to_status
   OR reason_code IS NULL
   OR reason_code NOT IN ('STALE_PUSH_REPLACED', 'LATE_EFFECT_RECORDED')
GROUP BY from_status, to_status
"""
