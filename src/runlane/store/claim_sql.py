"""The claim's statements, in the order a claim sends them: the lanes to serve
(PICK_LANES, PAGE_COMPANIONS), their runs (LANE_RUNS, or PICK_AND_WALK_PG for both
at once), and its writes (CLAIM_WRITE_PG; SQLite: ADD_SLOTS, CLAIM_RUNS, INSERT_ATTEMPT),
or all of it in one statement (CLAIM_ONE_TRIP_PG). Placeholders: ``dialect_sql``."""

from __future__ import annotations

import functools

# --- claim (the dispatch path) -------------------------------------------------------
#
# A claim is a few short statements in one transaction (``Store.claim``
# drives them), each one round trip whatever the batch size:
#
#   PICK_LANES   the lanes to serve, in fair order (one page); when the page is full,
#                PAGE_COMPANIONS: its flows' other lanes beyond its end;
#   LANE_RUNS    each chosen lane's oldest runnable runs, SKIP LOCKED, with the policy
#                version, the time and whether the run's task was cancelled
#                (PostgreSQL: all lanes at once, LATERAL; SQLite: lane by lane);
#   PICK_AND_WALK_PG  PostgreSQL: both at once for a page's first walk;
#   LOCK_SCOPES  the limit counters of the candidates, locked in scope order;
#   CLAIM_WRITE  the slots, the compare-and-set, the attempts, the events and the
#                lanes' counts (PostgreSQL: one statement of data-modifying CTEs that
#                locks and checks the counters itself, so LOCK_SCOPES runs only when
#                that check fails; SQLite: the same writes one after another).
#
# On PostgreSQL a claim is first tried as one autocommit statement, one round trip
# (CLAIM_ONE_TRIP_PG: the page, the shares dealt in SQL, each lane's share walked, and
# CLAIM_WRITE_PG's writes). It claims only when nothing needs Python: no run to prune
# or to decide again under a newer policy or a daily budget, no lane short of its
# share or due to wake, room in every counter. Otherwise it writes nothing and the
# claim runs as the transaction above.
#
# Rows that cannot run never fill a LIMIT: full tenants' lanes are hidden by
# ``tenant_at_limit``, lanes a worker cannot serve are filtered by route, full
# repositories/users/risk classes are excluded inside the lane scan, runs waiting for
# dependencies or capacity are not QUEUED at all.

# The scopes at their limit (a partial index holds only those rows).
FULL_SCOPES = """
SELECT scope FROM limit_counters WHERE active >= max_active
"""

# The lanes to serve, best first: priority, then the stride pass (weighted fair share
# among the tenants of one priority), then age of the lane. Paged with a keyset: a
# lane whose runs cannot run now (backoff, full repository) gives its turn to the next.
# Nothing at all when the whole queue (or everything) is at its limit.
#
# PostgreSQL walks each route the worker serves on its own (ix_lanes_route_pick,
# LATERAL) and keeps the best ``limit`` of them: lanes of routes nobody serves (a GPU
# with no GPU worker) never advance their pass, so they sort first, and a scan of the
# whole queue in pass order would read every one of them before a lane it can serve,
# on every claim. Rows read: at most ``limit`` per served route, whatever the
# unservable lanes. SQLite keeps the one ordered scan (no LATERAL; a small queue).
# The served routes are LIMITed to the array's own length (a no-op): a generic plan
# costs an array parameter at 10 elements, and the claim's pick, costed for 10 routes
# where a worker serves 1 or 2, stayed on custom plans, planned again on every claim
# (0.5-0.7 ms, more than its execution). Under the LIMIT the generic plan costs about
# as much as a custom one and PostgreSQL keeps it after five executions.
_PICK_PAGE_PG = """
SELECT l.lane_id, l.tenant, l.priority, l.weight, l.pass_, l.queued_count
FROM (SELECT route_key FROM unnest(CAST(:routes AS text[])) AS given(route_key)
      LIMIT cardinality(CAST(:routes AS text[]))) AS served
CROSS JOIN LATERAL (
    SELECT r.lane_id, r.tenant, r.priority, r.weight, r.pass AS pass_, r.queued_count
    FROM lanes r
    WHERE r.queue = :queue
      AND r.route_key = served.route_key
      AND r.queued_count > 0
      AND r.tenant_at_limit = 0
      AND r.wake_at IS NULL
      AND (r.priority, r.pass, r.lane_id) > (:after_priority, :after_pass, :after_lane)
    ORDER BY r.priority, r.pass, r.lane_id
    LIMIT :limit) l
WHERE NOT EXISTS (SELECT 1 FROM limit_counters c
                  WHERE c.scope IN ('global', 'queue:' || :queue)
                    AND c.active >= c.max_active)
ORDER BY l.priority, l.pass_, l.lane_id
LIMIT :limit
"""
_PICK_LANES_SQLITE = """
SELECT l.lane_id, l.tenant, l.priority, l.weight, l.pass AS pass_, l.queued_count,
       CASE WHEN (SELECT MIN(w.wake_at) FROM lanes w WHERE w.wake_at IS NOT NULL) <= {now}
            THEN 1 ELSE 0 END AS lanes_due
FROM lanes l
WHERE l.queue = :queue
  AND l.queued_count > 0
  AND l.tenant_at_limit = 0
  AND l.wake_at IS NULL
  AND l.route_key IN :routes
  AND (l.priority, l.pass, l.lane_id) > (:after_priority, :after_pass, :after_lane)
  AND NOT EXISTS (SELECT 1 FROM limit_counters c
                  WHERE c.scope IN ('global', 'queue:' || :queue)
                    AND c.active >= c.max_active)
ORDER BY l.priority, l.pass, l.lane_id
LIMIT :limit
"""
PICK_LANES = {
    # A PostgreSQL claim reads its page inside PICK_AND_WALK_PG (which also says
    # whether lanes are due); on its own it is what tests/test_dispatch_explain.py plans.
    "postgresql": _PICK_PAGE_PG,
    "sqlite": _PICK_LANES_SQLITE,
}

# One lane's oldest runnable runs after a keyset cursor (a claim that comes back to a
# lane continues past the runs it already took; a row comparison, so it is an index
# bound, not a filter), skipping runs whose repository, user or risk class is full.
# The task's cancellation is read per returned run (a primary key lookup in the
# select list: as a filter it made PostgreSQL read and sort whole lanes).
_LANE_WALK = """
SELECT r.run_id, r.task_id, r.tenant, r.repo, r.queue, r.priority, r.user_id,
       r.risk_class, r.route_key, r.lane_id, r.created_at, r.max_attempts, r.limits,
       r.policy_version, r.estimated_cost_usd, r.fencing_token, r.provider,{extra}
       (SELECT CASE WHEN t.cancel_requested_at IS NULL THEN 0 ELSE 1 END
        FROM tasks t WHERE t.task_id = r.task_id) AS task_cancelled
FROM runs r
WHERE r.lane_id = {lane}
  AND r.status = 'QUEUED'
  AND r.visible_at <= (SELECT now FROM ctx)
  AND 'repo:' || r.repo NOT IN (SELECT scope FROM full_scopes)
  AND 'user:' || COALESCE(r.user_id, '') NOT IN (SELECT scope FROM full_scopes)
  AND 'risk:' || r.risk_class NOT IN (SELECT scope FROM full_scopes)
  AND 'provider:' || COALESCE(r.provider, '') NOT IN (SELECT scope FROM full_scopes)
  AND (r.created_at, r.run_id) > ({after_created}, {after_id})
ORDER BY r.created_at, r.run_id
LIMIT {limit}
{{lock_r_skip}}
"""
_FULL_SCOPES_CTE = "full_scopes AS (" + FULL_SCOPES + ")"
_CLAIM_CTX = """
WITH ctx AS (SELECT {now} AS now, (SELECT MAX(version) FROM policy_versions) AS version),
     """ + _FULL_SCOPES_CTE + """
"""
# Provider pauses (a provider that answered PROVIDER_RATE_LIMIT with a retry-after:
# one row per provider, store.provider_pauses): the claim's walk skips a paused
# provider's runs as it skips those of a full scope. Only when the policy in force
# declares providers (``[providers.NAME]``): otherwise the claim's statements are the
# ones above, unchanged.
_FULL_OR_PAUSED_CTE = "full_scopes AS (" + FULL_SCOPES + """    UNION ALL
    SELECT 'provider:' || provider FROM provider_pauses
    WHERE paused_until > (SELECT now FROM ctx))"""


@functools.cache
def with_provider_pauses(statement: str) -> str:
    """A claim statement (one with ``_CLAIM_CTX``) whose walk also skips the runs of
    paused providers."""
    assert _FULL_SCOPES_CTE in statement
    return statement.replace(_FULL_SCOPES_CTE, _FULL_OR_PAUSED_CTE)


LANE_RUNS = {
    # Every lane of the page in one statement: (lane, share, cursor) arrays, each lane
    # walked by the same index scan.
    "postgresql": _CLAIM_CTX + """
SELECT w.*, ctx.version, ctx.now
FROM ctx,
     unnest(CAST(:lane_ids AS bigint[]), CAST(:shares AS integer[]),
            CAST(:after_created AS double precision[]), CAST(:after_ids AS text[]))
       AS q(lane_id, share, after_created, after_id)
CROSS JOIN LATERAL (""" + _LANE_WALK.format(
        lane="q.lane_id", after_created="q.after_created", after_id="q.after_id",
        limit="q.share", extra="") + """) w
""",
    # One lane per statement (no LATERAL; a statement is a function call here).
    "sqlite": _CLAIM_CTX + """
SELECT w.*, ctx.version, ctx.now FROM ctx, (""" + _LANE_WALK.format(
        lane=":lane_id", after_created=":after_created", after_id=":after_id",
        limit=":share", extra="") + """) w
""",
}

# The last lane of a full page (``pick``): no turn due after it is dealt (a later turn
# may belong to a lane of the next page), and a page's flows also take their lanes
# beyond it (``companions``). None when the page is not full: it holds every lane left.
PAGE_END = """
     page_end AS (
       SELECT priority, pass_, lane_id FROM pick
       WHERE (SELECT COUNT(*) FROM pick) >= :limit  -- a full page: the next may hold more
       ORDER BY priority DESC, pass_ DESC, lane_id DESC LIMIT 1)"""

# A flow's lanes (one per route) may fall on two pages: lanes of many tenants at one
# pass, ordered by lane_id, can put a flow's plain lane on one page and its git lane on
# the next, and the flow would serve the first page's newer runs before the other
# lane's older ones. So a full page also brings the other served lanes of its flows
# that lie beyond its last lane (they cannot lie before it: the page holds every served
# lane up to its end). Only flows at the last lane's priority can have such lanes (a
# lane beyond the end has its priority or a later one). Each flow is one probe of
# ``ix_lanes_flow`` (tenant, queue, priority), reading that flow's lanes (one per route
# its tenant used at that queue and priority): bounded by the page, never by the queue,
# the tenants or the lanes. A companion never lowers its flow's pass (it lies after the
# flow's lanes on the page), so the turns are dealt as before; it adds its queued runs
# and its walk: the flow's oldest runs, whatever their route.
PAGE_COMPANIONS = {
    "postgresql": """
     companions AS (
       SELECT c.lane_id, c.tenant, c.priority, c.weight, c.pass_, c.queued_count
       FROM page_end e
       CROSS JOIN LATERAL (SELECT DISTINCT p.tenant FROM pick p
                           WHERE p.priority = e.priority) f
       CROSS JOIN LATERAL (
         SELECT l.lane_id, l.tenant, l.priority, l.weight, l.pass AS pass_, l.queued_count
         FROM lanes l
         WHERE l.tenant = f.tenant AND l.queue = :queue AND l.priority = e.priority
           AND l.route_key = ANY(CAST(:routes AS text[]))
           AND l.queued_count > 0 AND l.tenant_at_limit = 0 AND l.wake_at IS NULL
           AND (l.pass, l.lane_id) > (e.pass_, e.lane_id)) c)""",
    # The page's tenants at its last lane's priority (an expanding list), its last lane.
    "sqlite": """
SELECT l.lane_id, l.tenant, l.priority, l.weight, l.pass AS pass_, l.queued_count
FROM lanes l
WHERE l.tenant IN :tenants AND l.queue = :queue AND l.priority = :end_priority
  AND l.route_key IN :routes
  AND l.queued_count > 0 AND l.tenant_at_limit = 0 AND l.wake_at IS NULL
  AND (l.pass, l.lane_id) > (:end_pass, :end_lane)
""",
}

# A page's flows: its lanes (and their companions) merged per (priority, tenant) (a
# tenant's lanes of one priority, one per route, share one pass and one share:
# fairness.flows_of, the same merge in Python). Each flow is named by its lowest
# lane_id and ranked in fair order; the shares are dealt to flows, and each lane of a
# flow is walked for the flow's whole share, its oldest runs taken whatever their route.
FLOWS = """
     flows AS (
       SELECT f.*, row_number() OVER (ORDER BY f.priority, f.pass_, f.lane_id) AS rank
       FROM (SELECT MIN(p.lane_id) AS lane_id, p.priority, p.tenant,
                    MIN(p.weight) AS weight, MIN(p.pass_) AS pass_,
                    SUM(p.queued_count) AS queued_count
             FROM page p GROUP BY p.priority, p.tenant) f)"""

# PostgreSQL: PICK_LANES and the first LANE_RUNS of a page in one statement. Each
# lane (a companion too) is walked only as far as its flow's share can reach
# (``fairness.share_bounds`` over the page's flows, the same bound, property-tested
# against ``share_slots``): every run walked is locked, and a run locked but not taken
# is one other claimers skip. Stride sharing hands ``wanted`` slots only to the page's
# first ``wanted`` flows (each has its first turn before any later flow's); when the
# page has that many, a flow's k-th extra turn comes at pass + k / weight, never past
# the pass of the wanted-th flow (the edge) at the same priority: the flow's cap. The
# turns the caps allow, in fair order (at most ``wanted`` per flow, generated, no table
# read): the wanted-th of them is as late as the last turn dealt can be, and no lane
# is walked past it. (Without it, 8
# lanes and a claim of 10 walked and locked 80 runs; with it, 16.) The 1e-6 is
# fairness.TURN_SLACK. The claim deals the shares from what came back and walks
# again (LANE_RUNS) only for a lane that came up short. No ORDER BY (a Sort node):
# the claim orders the page and each lane's runs itself.
# The page of lanes (``pick``, its last lane when full, the companions of its flows:
# ``page`` is both, ``companion`` says which), its flows (ranked in fair order) and
# whether sleeping lanes are due: the start of both PICK_AND_WALK_PG and
# CLAIM_ONE_TRIP_PG.
_PAGE_PG = _CLAIM_CTX + """,
     pick AS (""" + _PICK_PAGE_PG + """),
""" + PAGE_END + """,
""" + PAGE_COMPANIONS["postgresql"] + """,
     page AS (SELECT p.*, 0 AS companion FROM pick p
              UNION ALL SELECT c.*, 1 AS companion FROM companions c),
""" + FLOWS + """,
     due AS (SELECT CASE WHEN MIN(w.wake_at) <= (SELECT now FROM ctx) THEN 1 ELSE 0 END
                      AS lanes_due
             FROM lanes w WHERE w.wake_at IS NOT NULL)
"""
_PICK_AND_REACH_PG = _PAGE_PG + """,
     edge AS (SELECT priority, pass_ FROM flows WHERE rank = :wanted),
     capped AS (
       SELECT p.lane_id, p.priority, p.pass_, p.weight,
              GREATEST(0, LEAST(:wanted, p.queued_count,
                  CASE WHEN e.priority IS NULL OR p.priority < e.priority THEN :wanted
                       ELSE 1 + CAST(floor((e.pass_ - p.pass_) * p.weight + 1e-6)
                                     AS integer) END)) AS cap
       FROM flows p LEFT JOIN edge e ON true
       WHERE p.rank <= :wanted),
     last_turn AS (
       SELECT c.priority, c.pass_ + k / c.weight AS at
       FROM capped c CROSS JOIN LATERAL generate_series(0, c.cap - 1) AS k
       ORDER BY 1, 2 OFFSET :wanted - 1 LIMIT 1),
     reach AS (
       SELECT c.lane_id,
              CASE WHEN t.priority IS NULL OR c.priority < t.priority THEN c.cap
                   WHEN c.priority > t.priority THEN 0
                   ELSE GREATEST(0, LEAST(c.cap, 1 + CAST(
                            floor((t.at - c.pass_) * c.weight + 1e-6) AS integer))) END
                AS runs
       FROM capped c LEFT JOIN last_turn t ON true)
"""
PICK_AND_WALK_PG = _PICK_AND_REACH_PG + """
SELECT p.lane_id AS page_lane_id, p.priority AS page_priority, p.tenant AS page_tenant,
       p.weight, p.pass_, p.queued_count, p.companion, due.lanes_due, w.*, ctx.version,
       ctx.now
FROM page p LEFT JOIN flows f ON f.priority = p.priority AND f.tenant = p.tenant
LEFT JOIN reach s ON s.lane_id = f.lane_id CROSS JOIN ctx CROSS JOIN due
LEFT JOIN LATERAL (""" + _LANE_WALK.format(
    lane="p.lane_id", after_created="CAST('-Infinity' AS double precision)",
    after_id="''", limit="COALESCE(s.runs, 0)", extra="") + """) w ON true
"""

# A named run (a delivery that names its run): the same re-validation.
RUN_CANDIDATE = _CLAIM_CTX + """
SELECT r.run_id, r.task_id, r.tenant, r.repo, r.queue, r.priority, r.user_id,
       r.risk_class, r.route_key, r.lane_id, r.created_at, r.max_attempts, r.limits,
       r.policy_version, r.estimated_cost_usd, r.fencing_token, r.provider,
       (SELECT CASE WHEN t.cancel_requested_at IS NULL THEN 0 ELSE 1 END
        FROM tasks t WHERE t.task_id = r.task_id) AS task_cancelled,
       ctx.version, ctx.now
FROM ctx, runs r
WHERE r.run_id = :run_id
  AND r.status = 'QUEUED'
  AND r.visible_at <= ctx.now
{lock_r_skip}
"""

# The writes of a claim, on PostgreSQL one statement of data-modifying CTEs over three
# inputs, defined before it: ``slot_deltas(scope, n, max_active)`` (the slots to take
# per scope and the policy's maximum), ``picked(run_id, estimated_cost_usd, scopes)``
# (the runs, each with its scopes as a JSON list) and ``lane_deltas(lane_id, n, gone)``
# (the runs claimed from each lane, and those that left it at claim without being
# claimed: denied, deferred or pruned, ClaimMixin._admit_candidates); and
# ``t(now)``. CLAIM_WRITE_PG gives them as parallel arrays (the claim decided in
# Python), CLAIM_ONE_TRIP_PG computes them from its own pick.
#
# The counters, locked in scope order, must all exist, carry the policy's maximum and
# have room for every slot; else nothing is written (CLAIM_WRITE_PG: the claim then
# allots the slots run by run, LOCK_SCOPES; CLAIM_ONE_TRIP_PG: the claim starts again
# as a transaction). Every write below waits for this check, so the counters are locked
# before the lanes, in scope order. Not LOCK_SCOPES' LATERAL probe per scope: in this
# statement it cost every claim 0.4 ms more (a woken claim's write 0.41 -> 0.83 ms,
# measured 2026-11-30). ``scope = ANY(array)`` reads the counters by one primary-key
# scan of the scopes; at the default random_page_cost a claim of ~150 scopes got a Seq
# Scan of every counter instead (engine.PLANNER_OPTIONS, tests/test_dispatch_explain.py).
#
# ``t`` (the claim's time, the attempts' start) is first read by ``claimed``, after the
# counters were locked: a claim that waited there for a release's commit starts its
# attempts after that release ended its lease, never before (read first, as when the
# final SELECT joined ``t``, it could be older than the release: the 8-process test
# reconstructs the lease intervals and saw one scope over its limit).
#
# ``slots`` has no guard on ``active``: it would test it on the statement's snapshot,
# older than the locked rows ``room`` checked (a slot given back since would be
# missed); the update itself applies to the latest, locked version.
#
# Lanes come last: the claimed lanes, every lane of their flows (a flow's lanes, one
# per route, advance their shared pass together) and, when a slot fills a tenant's
# limit, every lane of that tenant (hidden by ``tenant_at_limit``), all locked in
# lane_id order first: an UPDATE locks rows in whatever order its scan meets them (physical order
# moves with every update), and two claims of the same lanes would deadlock; so would
# a claim that marked its tenant's lanes after locking the one it claimed from (a
# submit holding another lane of that tenant, waiting for it).
_CLAIM_WRITES_PG = """
counter_locks AS (
    SELECT c.scope, c.active, c.max_active FROM limit_counters c
    WHERE c.scope = ANY({slot_scopes}) AND {gate}
    ORDER BY c.scope FOR UPDATE),
room AS (
    SELECT {gate} AND COUNT(*) = cardinality({slot_scopes})
           AND COALESCE(bool_and(k.active + d.n <= k.max_active
                                 AND k.max_active = d.max_active), true) AS ok
    FROM counter_locks k JOIN slot_deltas d ON d.scope = k.scope),
slots AS (
    UPDATE limit_counters c
    SET active = c.active + (SELECT d.n FROM slot_deltas d WHERE d.scope = c.scope)
    WHERE c.scope = ANY({slot_scopes})
      AND (SELECT ok FROM room)
    RETURNING c.scope, c.active >= c.max_active AS at_limit),
claimed AS (
    UPDATE runs
    SET status = 'CLAIMED',
        fencing_token = runs.fencing_token + 1,
        attempt_count = runs.attempt_count + 1,
        updated_at = (SELECT now FROM t)
    WHERE runs.run_id = ANY({run_ids}) AND runs.status = 'QUEUED'
      AND (SELECT ok FROM room)
    RETURNING runs.run_id, runs.fencing_token, runs.attempt_count),
new_attempts AS (  -- the record of the claim too: no event (store/history.py)
    INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,
                          lease_status, lease_expires_at, heartbeat_at, started_at,
                          cost_usd, input_tokens, output_tokens, estimated_cost_usd,
                          limit_scopes, claim_tx, claim_seq)
    SELECT c.run_id, c.attempt_count, c.fencing_token, :worker_id, 'RUNNING', 'ACTIVE',
           t.now + :ttl, t.now, t.now, 0, 0, 0, p.estimated_cost_usd, CAST(p.scopes AS json),
           CAST(CAST(pg_current_xact_id() AS text) AS bigint),
           nextval('run_events_event_id_seq')
    FROM claimed c JOIN picked p ON p.run_id = c.run_id, t),
full_tenants AS (
    SELECT substr(scope, 8) AS tenant FROM slots WHERE at_limit AND scope LIKE 'tenant:%'
    UNION SELECT unnest({also_full})),
claimed_flows AS (
    SELECT l.tenant, l.queue, l.priority, x.n
    FROM lane_deltas x JOIN lanes l ON l.lane_id = x.lane_id WHERE x.n > 0),
lane_locks AS (
    SELECT l.lane_id FROM lanes l
    WHERE l.lane_id = ANY(ARRAY(  -- UNION ALL: a duplicate is harmless, a Sort is not
            SELECT x.lane_id FROM lane_deltas x
            UNION ALL
            SELECT m.lane_id FROM claimed_flows f
            JOIN lanes m ON m.tenant = f.tenant AND m.queue = f.queue
                        AND m.priority = f.priority
            UNION ALL
            SELECT m.lane_id FROM lanes m
            WHERE m.tenant = ANY(ARRAY(SELECT tenant FROM full_tenants))
              AND m.tenant_at_limit = 0))
      AND (SELECT ok FROM room)
    ORDER BY l.lane_id FOR UPDATE),
lane_counts AS (
    UPDATE lanes
    SET queued_count = lanes.queued_count - COALESCE(
            (SELECT x.n + x.gone FROM lane_deltas x WHERE x.lane_id = lanes.lane_id), 0),
        -- A lane of a claimed flow: the flow's pass (the highest of its lanes, in
        -- this snapshot; the lane's own as locked, which a claim that committed
        -- meanwhile advanced) and the turns taken. A lane that joined the flow while
        -- a claim of it committed took the pass before that claim (the claim never
        -- saw the new lane): it is one turn behind until here, not for good.
        pass = COALESCE({greatest}(lanes.pass,
                   (SELECT MAX(m.pass) FROM lanes m
                    WHERE m.tenant = lanes.tenant AND m.queue = lanes.queue
                      AND m.priority = lanes.priority))
               + CAST((SELECT SUM(f.n) FROM claimed_flows f
                       WHERE f.tenant = lanes.tenant AND f.queue = lanes.queue
                         AND f.priority = lanes.priority) AS double precision) / lanes.weight,
               lanes.pass),
        tenant_at_limit = CASE WHEN lanes.tenant IN (SELECT tenant FROM full_tenants)
                               THEN 1 ELSE lanes.tenant_at_limit END
    WHERE lanes.lane_id = ANY(ARRAY(SELECT lane_id FROM lane_locks)))
"""
# Around the transaction's CLAIM_WRITE_PG (ClaimMixin._write_claim): a write that
# fails its checks gives back the counter locks it took (PostgreSQL releases the row
# locks of a subtransaction rolled back). Never released: the commit ends it.
CLAIM_SAVEPOINT = "SAVEPOINT claim_write"
CLAIM_ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT claim_write"
CLAIM_WRITE_PG = """
WITH t AS (SELECT {now} AS now),
slot_deltas AS (
    SELECT * FROM unnest(CAST(:slot_scopes AS text[]), CAST(:slot_counts AS integer[]),
                         CAST(:slot_max AS integer[]))
      AS d(scope, n, max_active)),
picked AS (
    SELECT * FROM unnest(CAST(:run_ids AS text[]), CAST(:estimated AS double precision[]),
                         CAST(:scopes AS text[])) AS p(run_id, estimated_cost_usd, scopes)),
lane_deltas AS (
    SELECT * FROM unnest(CAST(:lane_ids AS bigint[]), CAST(:lane_counts AS integer[]),
                         CAST(:lane_gone AS integer[]))
      AS x(lane_id, n, gone)),
""" + _CLAIM_WRITES_PG.replace("{slot_scopes}", "CAST(:slot_scopes AS text[])").replace(
    "{run_ids}", "CAST(:run_ids AS text[])").replace("{gate}", "true").replace(
    "{also_full}", "CAST(:also_full AS text[])") + """
SELECT claimed.run_id, claimed.fencing_token, claimed.attempt_count,
       (SELECT now FROM t) AS now, (SELECT COUNT(*) FROM slots) AS slots_taken,
       ARRAY(SELECT tenant FROM full_tenants ORDER BY tenant) AS full_tenants
FROM claimed
"""

# Every concurrency scope of a run (domain.policy.run_scopes, the same list sorted the
# same way: "C" is code point order, as Python sorts): an attempt holds a slot in each.
RUN_SCOPES = """(
    SELECT CAST(json_agg(s.scope ORDER BY s.scope COLLATE "C") AS text)
    FROM unnest(ARRAY['global', 'tenant:' || {run}.tenant, 'repo:' || {run}.repo,
                      'risk:' || {run}.risk_class, 'queue:' || {run}.queue,
                      'user:' || {run}.user_id, 'provider:' || {run}.provider]) AS s(scope)
    WHERE s.scope IS NOT NULL)"""

# PostgreSQL: a whole claim in one statement and one round trip, autocommit (issue 5's
# "one round trip claims up to N"). PICK_AND_WALK_PG's pick and walk; the shares of
# the page dealt in SQL (SHARE_TURNS: fairness.share_slots, tested against it); then
# the writes above. It claims only when the claim needs nothing else, and otherwise
# writes nothing and the claim runs as a transaction (``Store.claim``):
#   * every run it would take was admitted under the policy in force, which the
#     claimer has read and which sets no daily budgets (``:version``): the check at
#     claim (invariant 7) is then admission again on the same inputs, a pure function
#     (domain/admission.py), so the decision recorded in ``runs.admission``, with its
#     concurrency limits, is the one it would make;
#   * no run's task was cancelled (the transaction prunes those), no lane came up
#     short of its share (it would walk on, or put the lane to sleep), no sleeping lane
#     is due (it would wake it first);
#   * every counter exists, with the policy's maximum and room for every slot.
# The last row tells the claimer, when nothing was claimed, whether the page was empty
# and no lane due: then the transaction would find nothing either.
#
# The shares: each flow of the page has a turn at pass + k / weight for k = 0, 1, ...
# (up to its queued runs); the first ``:wanted`` turns in fair order are dealt. None of
# them comes after the page's last lane (a turn that may belong to a lane of the next
# page; ``page_end``, of the page without its companions). A full page of one lane per
# flow holds at least ``:wanted`` first turns no later than that; when a tenant has
# several lanes in it, it may hold fewer, and the statement claims only when it dealt
# them all (``fast``). The
# result is share_slots(page, wanted, until=the last lane), tests/test_fairness.py.
# Only the page's first ``:wanted`` lanes can get a turn (each lane's first turn comes
# before any later lane's), which also keeps the planner's estimate of the lanes walked
# small: with a GROUP BY of the turns, the generic plan was costed at 67 lanes and
# PostgreSQL planned the statement again at every claim (1.2-1.8 ms).
SHARE_TURNS = """
turns AS MATERIALIZED (
    SELECT p.lane_id FROM flows p
    CROSS JOIN LATERAL generate_series(0, LEAST(p.queued_count, :wanted) - 1) AS k
    WHERE p.weight > 0
      AND NOT EXISTS (SELECT 1 FROM page_end e
                      WHERE (p.priority, p.pass_ + k / p.weight, p.lane_id)
                            > (e.priority, e.pass_, e.lane_id))
    ORDER BY p.priority, p.pass_ + k / p.weight, p.lane_id
    LIMIT :wanted),
shares AS (
    SELECT p.lane_id, p.priority, p.tenant,
           (SELECT COUNT(*) FROM turns t WHERE t.lane_id = p.lane_id) AS share
    FROM flows p WHERE p.rank <= :wanted)
"""
CLAIM_ONE_TRIP_PG = _PAGE_PG + """,
""" + SHARE_TURNS + """,
walked AS (
    SELECT s.lane_id AS flow_id, s.share, w.*,
           row_number() OVER (PARTITION BY s.lane_id ORDER BY w.created_at, w.run_id) AS nth
    FROM shares s JOIN page p ON p.priority = s.priority AND p.tenant = s.tenant
    CROSS JOIN LATERAL (""" + _LANE_WALK.format(
    lane="p.lane_id", after_created="CAST('-Infinity' AS double precision)",
    after_id="''", limit="s.share", extra=" r.admission,") + """) w),
chosen AS (SELECT * FROM walked WHERE nth <= share),
fast AS (
    SELECT (SELECT lanes_due FROM due) = 0
       AND COALESCE((SELECT version FROM ctx), 0) = CAST(:version AS integer)
       AND EXISTS (SELECT 1 FROM chosen)
       -- fewer flows than lanes: a full page may deal fewer turns than wanted (none
       -- after its last lane); the transaction reads the next page
       AND ((SELECT COUNT(*) FROM chosen) = :wanted OR NOT EXISTS (SELECT 1 FROM page_end))
       AND NOT EXISTS (SELECT 1 FROM shares s
                       WHERE s.share > (SELECT COUNT(*) FROM chosen c
                                        WHERE c.flow_id = s.lane_id))
       AND NOT EXISTS (SELECT 1 FROM chosen c
                       WHERE c.task_cancelled <> 0 OR c.policy_version <> CAST(:version AS integer)
                          OR (c.admission ->> 'decision') IS DISTINCT FROM 'ADMIT')
         AS ok),
-- The claim's time, read again: ``t`` is first read by ``claimed``, after the counters
-- were locked (a wait for a release's commit comes before it, as in CLAIM_WRITE_PG):
-- an attempt starts when its slots are taken, never before the release that freed them.
t AS (SELECT {now} AS now),
slot_deltas AS (
    SELECT s.key AS scope, CAST(COUNT(*) AS integer) AS n,
           MIN(CAST(s.value AS integer)) AS max_active
    FROM chosen c CROSS JOIN LATERAL json_each_text(c.admission -> 'concurrency') s
    GROUP BY s.key),
picked AS (
    SELECT c.run_id, c.estimated_cost_usd, """ + RUN_SCOPES.format(run="c") + """ AS scopes
    FROM chosen c),
lane_deltas AS (
    SELECT lane_id, CAST(COUNT(*) AS integer) AS n, 0 AS gone FROM chosen GROUP BY lane_id),
""" + _CLAIM_WRITES_PG.replace(
    "{slot_scopes}", "ARRAY(SELECT scope FROM slot_deltas)").replace(
    "{run_ids}", "ARRAY(SELECT run_id FROM chosen)").replace(
    "{gate}", "(SELECT ok FROM fast)").replace("{also_full}", "CAST(ARRAY[] AS text[])") + """
SELECT c.run_id, c.fencing_token, c.attempt_count, (SELECT now FROM t) AS now,
       w.task_id, w.tenant, w.repo, w.queue, w.priority, w.max_attempts, w.limits,
       w.created_at, (SELECT COUNT(*) FROM pick) AS page_lanes, due.lanes_due,
       COALESCE((SELECT version FROM ctx), 0) AS policy_version
FROM due LEFT JOIN (claimed c JOIN chosen w ON w.run_id = c.run_id) ON true
"""

# SQLite: the same writes, one after another (ADD_SLOTS, CLAIM_RUNS, INSERT_ATTEMPT,
# the events, LANE_LEAVE and FLOW_CLAIMED).
ADD_SLOTS = """
UPDATE limit_counters SET active = active + :n
WHERE scope = :scope AND active + :n <= max_active
"""
# The compare-and-set of a claim: QUEUED -> CLAIMED with the next fencing token.
CLAIM_RUNS = """
UPDATE runs
SET status = 'CLAIMED',
    fencing_token = runs.fencing_token + 1,
    attempt_count = runs.attempt_count + 1,
    updated_at = {now}
WHERE runs.run_id IN :run_ids
  AND runs.status = 'QUEUED'
RETURNING runs.run_id, runs.fencing_token, runs.attempt_count, {now} AS now
"""

INSERT_ATTEMPT = """
INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status, lease_status,
                      lease_expires_at, heartbeat_at, started_at,
                      cost_usd, input_tokens, output_tokens, estimated_cost_usd, limit_scopes,
                      claim_tx, claim_seq)
VALUES (:run_id, :attempt_no, :fencing_token, :worker_id, 'RUNNING', 'ACTIVE',
        :lease_expires_at, :now, :now, 0, 0, 0, :estimated_cost_usd, :limit_scopes,
        0, :claim_seq)
"""
