"""A submit's statements: its context, its writes (SUBMIT_WRITE_PG; SQLite: one
after another), and what an idempotency key already taken answers."""

from __future__ import annotations

from runlane.store.lanes_sql import _FLOW_PASS, _LANE_UPSERT_CONFLICT, _TENANT_FULL, _virtual_time

ROUTE_INSERT = """
INSERT INTO routes (route_key, created_at) VALUES (:route_key, :now)
ON CONFLICT (route_key) DO NOTHING
"""

# --- submit ---------------------------------------------------------------------------
#
# After SUBMIT_CONTEXT (the time and the policy version), the writes of a submit.
# PostgreSQL: one statement of data-modifying CTEs whose inputs are three JSON
# documents (so its text never changes): ``:tasks`` (task rows), ``:decisions`` (each
# distinct admission decision of the batch once: its terms, its record, the event
# message) and ``:runs`` (one row per run, naming its decision by position). Only the
# runs of tasks really inserted (an idempotency key already taken inserts nothing)
# are inserted, are counted into their lanes and wake their queues. SQLite: the same
# writes one after another (the task insert, ROUTE_INSERT, LANE_VIRTUAL_TIME and
# LANE_UPSERT per lane, the runs, the events).
#
# Lock order (as everywhere: run rows, then counters, then lanes by lane_id): a
# submit locks no run or counter another transaction can see, and the lanes it
# already finds are locked in lane_id order before the upsert touches them; new
# lanes are inserted in lane key order, so two submits creating the same lanes queue
# on the first one. (A lane another submit commits between this statement's
# snapshot and its upsert is locked by the upsert, out of order: a rare race.)
# Tasks are inserted in (tenant, idempotency key) order: two submits whose batches
# share keys wait on the first shared key instead of each holding one the other
# needs (an insert waits for another transaction's uncommitted row of its key).
#
# Policy: ``:version`` is the version the batch was decided under (SUBMIT_CONTEXT).
# The write reads a snapshot of its own (every statement does, under READ COMMITTED):
# if a newer version is in force by then, it inserts nothing (every other write
# follows the inserted tasks) and returns the newest version, and the submit decides
# again. One row always: the version in force, the inserted task ids.
#
# Time: rows are stamped with ``:now``, the batch's time (SUBMIT_CONTEXT's). A batch
# decided without reading the time (Store._plan_submission: nothing to read, no
# decision that depends on it) sends the clock's value instead, NULL in production:
# the database clock, read once for the whole statement; its runs and tasks carry no
# time of their own (visible_at only for a DEFER, ended_at for none).
# The submit's task rows from its items, those with an idempotency key or those
# without (``{keyed}``: NOT NULL, NULL), under the policy version it was decided by.
_TASKS_FROM_ITEMS = """
    INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, idempotency_key,
                       max_attempts, context, truncated_sections, payload_bytes,
                       cancel_requested_at, created_at, user_id, requires, parent_task_id,
                       estimated_cost_usd, request_digest, traceparent)
    SELECT task_id, tenant, repo, prompt, queue, priority, idempotency_key, max_attempts,
           COALESCE(context, CAST('{{{{}}}}' AS json)),
           COALESCE(truncated_sections, CAST('[]' AS json)), payload_bytes, NULL,
           (SELECT now FROM clock), user_id, requires, parent_task_id, estimated_cost_usd,
           request_digest, traceparent
    FROM items
    WHERE idempotency_key IS {keyed}
      AND (SELECT version FROM policy) = CAST(:version AS integer)  -- see "Policy" above"""
# A run created QUEUED by an admission (its event would say only that, store/history.py):
# the run row is the record of its creation, no event.
CREATED_IN_ROW = ("r.status = 'QUEUED' AND r.reason_code IS NULL "
                  "AND r.event_message = 'admitted under policy v' "
                  "|| CAST(r.policy_version AS TEXT)")
SUBMIT_WRITE_PG = """
WITH policy AS MATERIALIZED (
    SELECT COALESCE(MAX(version), 0) AS version FROM policy_versions),
clock AS MATERIALIZED (SELECT {now} AS now),  -- see "Time" above
-- One item per task and its run: what is the task's own, only the keys that are set
-- (a missing key reads NULL); the rest is its decision's (_SubmitBatch). What the task
-- row takes of its decision comes as four short arrays indexed by decision number
-- (before the decisions' records: this statement's first 1 kB, all that
-- pg_stat_activity shows of it, names new_tasks).
items AS MATERIALIZED (
    SELECT i.*, d.queue, d.priority, d.max_attempts, d.requires
    FROM json_to_recordset(CAST(:items AS json)) AS i(
        task_id text, run_id text, tenant text, repo text, repo_key text, prompt text,
        idempotency_key text, context json, truncated_sections json,
        payload_bytes integer, user_id text, parent_task_id text,
        estimated_cost_usd double precision, decision_no integer, status text,
        request_digest text, traceparent text)
    JOIN unnest(CAST(:decision_queues AS text[]), CAST(:decision_priorities AS integer[]),
                CAST(:decision_max_attempts AS integer[]),
                CAST(:decision_requires AS text[]))
         WITH ORDINALITY AS d(queue, priority, max_attempts, requires, n)
      ON d.n = i.decision_no + 1),
new_tasks AS (  -- the tasks with an idempotency key (the others: unkeyed_tasks)
""" + _TASKS_FROM_ITEMS.format(keyed="NOT NULL") + """
    ORDER BY tenant, idempotency_key  -- the key order: see "Lock order" above
    ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING task_id),
-- Without a key a task cannot conflict: a plain insert (no speculative insertion, no
-- look into the key's index first, no confirmation record in the WAL).
unkeyed_tasks AS (
""" + _TASKS_FROM_ITEMS.format(keyed="NULL") + """
    RETURNING task_id),
inserted_tasks AS (
    SELECT task_id FROM new_tasks UNION ALL SELECT task_id FROM unkeyed_tasks),
-- Materialized: each decision's record is read from the JSON once, not once per run.
decisions AS MATERIALIZED (
    SELECT CAST(d.n AS integer) - 1 AS decision_no,
           x.queue, x.priority, x.max_attempts, x.risk_class, x.route_key,
           x.policy_version, x.reason_code, x.message, x.weight, x.event_message,
           x.status, x.visible_at, x.provider,
           d.value -> 'admission' AS admission, d.value -> 'limits' AS limits
    FROM json_array_elements(CAST(:decisions AS json)) WITH ORDINALITY AS d(value, n)
    CROSS JOIN LATERAL json_to_record(d.value) AS x(
        queue text, priority integer, max_attempts integer, risk_class text,
        route_key text, policy_version integer, reason_code text, message text,
        weight double precision, event_message text, status text,
        visible_at double precision, provider text)),
new_runs AS (
    -- The run's repository is its canonical form (domain/repos.py), the task's as
    -- written (it is cloned): the item has repo_key only where the two differ.
    SELECT i.run_id, i.task_id, i.tenant, COALESCE(i.repo_key, i.repo) AS repo, i.user_id,
           COALESCE(i.status, d.status) AS status,
           d.visible_at,  -- a DEFER's retry-after; else the time (below)
           CAST(NULL AS double precision) AS ended_at,  -- a DENY's: the time (below)
           i.estimated_cost_usd, d.decision_no, d.queue, d.priority, d.max_attempts,
           d.risk_class, d.route_key, d.policy_version, d.reason_code, d.message,
           d.weight, d.event_message, d.admission, d.limits, d.provider
    FROM items i
    JOIN inserted_tasks t ON t.task_id = i.task_id
    JOIN decisions d ON d.decision_no = i.decision_no),
lane_plan AS (
    SELECT queue, route_key, priority, tenant, MAX(weight) AS weight,
           COUNT(*) FILTER (WHERE status = 'QUEUED') AS entering
    FROM new_runs GROUP BY queue, route_key, priority, tenant),
new_routes AS (
    INSERT INTO routes (route_key, created_at)
    SELECT DISTINCT route_key, (SELECT now FROM clock) FROM lane_plan
    ORDER BY route_key
    ON CONFLICT (route_key) DO NOTHING),
lane_locks AS (
    SELECT l.lane_id FROM lanes l
    JOIN lane_plan p ON l.queue = p.queue AND l.route_key = p.route_key
                    AND l.priority = p.priority AND l.tenant = p.tenant
    ORDER BY l.lane_id FOR UPDATE OF l),
lane_ids AS (
    INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                       tenant_at_limit)
    SELECT p.queue, p.route_key, p.priority, p.tenant, p.weight, p.entering,
           COALESCE(""" + _FLOW_PASS.format(tenant="p.tenant", queue="p.queue",
                                            priority="p.priority", lane="-1") + """,
                    """ + _virtual_time("p.queue", "p.priority") + """
                    - CAST(:ahead AS double precision), 0.0),
           """ + _TENANT_FULL.format(scope="'tenant:' || p.tenant") + """
    FROM lane_plan p
    WHERE (SELECT COUNT(*) FROM lane_locks) >= 0  -- a one-time filter: locks first
    ORDER BY p.queue, p.route_key, p.priority, p.tenant""" + _LANE_UPSERT_CONFLICT + """),
inserted_runs AS (
    INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                      attempt_count, max_attempts, fencing_token, visible_at, created_at,
                      updated_at, ended_at, reason_code, message, cost_usd, user_id,
                      risk_class, route_key, lane_id, policy_version, admission, limits,
                      estimated_cost_usd, provider, created_by, created_tx, created_seq)
    SELECT r.run_id, r.task_id, r.tenant, r.repo, r.queue, r.priority, r.status,
           0, r.max_attempts, 0, COALESCE(r.visible_at, c.now), c.now, c.now,
           COALESCE(r.ended_at, CASE WHEN r.status = 'POLICY_DENIED' THEN c.now END),
           r.reason_code, r.message, 0,
           r.user_id, r.risk_class, r.route_key, l.lane_id, r.policy_version,
           r.admission, r.limits, r.estimated_cost_usd, r.provider,
           -- a run admitted QUEUED records its creation itself (store/history.py)
           CASE WHEN """ + CREATED_IN_ROW + """ THEN :actor END,
           CASE WHEN """ + CREATED_IN_ROW + """
                THEN CAST(CAST(pg_current_xact_id() AS text) AS bigint) END,
           CASE WHEN """ + CREATED_IN_ROW + """ THEN nextval('run_events_event_id_seq') END
    FROM new_runs r CROSS JOIN clock c
    JOIN lane_ids l ON l.queue = r.queue AND l.route_key = r.route_key
                   AND l.priority = r.priority AND l.tenant = r.tenant
    RETURNING run_id, queue, status),
events AS (
    INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                            reason_code, fencing_token, message)
    SELECT r.run_id, NULL, (SELECT now FROM clock), :actor, NULL, r.status,
           r.reason_code, NULL, r.event_message
    FROM new_runs r JOIN inserted_runs i ON i.run_id = r.run_id
    WHERE NOT (""" + CREATED_IN_ROW + """)),
-- The queues that got QUEUED runs: every run of new_runs is inserted (its lane is
-- upserted above), so lane_plan names them without reading the inserted runs again.
woken AS (
    SELECT pg_notify(:channel, q.queue)
    FROM (SELECT DISTINCT queue FROM lane_plan WHERE entering > 0 ORDER BY queue) q)
SELECT (SELECT version FROM policy) AS policy_version,
       -- the tasks not inserted (a key taken before): usually none, so the answer is
       -- short however large the batch
       ARRAY(SELECT i.task_id FROM items i
             WHERE NOT EXISTS (SELECT 1 FROM inserted_tasks t
                               WHERE t.task_id = i.task_id)) AS skipped_task_ids,
       (SELECT COUNT(*) FROM inserted_runs) AS runs_inserted,
       (SELECT COUNT(*) FROM woken) AS queues_woken
"""
# An idempotency key already taken: the task, the digest of the request that took
# it (NULL before migration 0019), and the task's first run (a retried task has more:
# a replay answers as the first submit did).
# What a task was asked with, to name the field a reused idempotency key's request
# differs in (Store.submit's Conflict).
TASK_AS_ASKED = """
SELECT repo, prompt, queue, priority, max_attempts, context, truncated_sections, user_id,
       requires, parent_task_id, estimated_cost_usd
FROM tasks WHERE task_id = :task_id
"""
EXISTING_RUN = """
SELECT t.task_id, r.run_id, r.status, t.payload_bytes, t.truncated_sections,
       t.request_digest
FROM tasks t JOIN runs r ON r.task_id = t.task_id
WHERE t.tenant = :tenant AND t.idempotency_key = :key
ORDER BY r.created_at, r.run_id
LIMIT 1
"""
ROUTES = "SELECT route_key FROM routes"
# What a submit needs first, in one round trip: the time and the policy version in force.
SUBMIT_CONTEXT = "SELECT {now} AS now, (SELECT MAX(version) FROM policy_versions) AS version"
