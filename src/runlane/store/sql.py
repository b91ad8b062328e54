"""Every statement that matters, named, with the dialect differences side by side.

Statements are written once with two placeholders filled per dialect:

* ``{now}``: the pinned ``:now`` if the caller passed one, else the database clock;
* ``{lock}``: ``FOR UPDATE … SKIP LOCKED`` on PostgreSQL; nothing on SQLite, where
  every transaction is ``BEGIN IMMEDIATE`` and so already holds the write lock.

Status writes are compare-and-set: their ``status IN :sources`` guard is computed
from the transition table by the store, never written by hand.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from sqlalchemy import String, Table, TextClause, bindparam, text

NOW = {
    "postgresql": (
        "COALESCE(CAST(:now AS double precision), "
        "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision))"
    ),
    "sqlite": "COALESCE(:now, (julianday('now') - 2440587.5) * 86400.0)",
}
LOCK_SKIP = {"postgresql": "FOR UPDATE OF {alias} SKIP LOCKED", "sqlite": ""}
LOCK_SHARE_SKIP = {"postgresql": "FOR SHARE OF {alias} SKIP LOCKED", "sqlite": ""}
# Changes with every update of the row: PostgreSQL's xmin (the writing transaction);
# SQLite has one writer, whose transaction holds the file from BEGIN IMMEDIATE.
ROW_VERSION = {"postgresql": "CAST({alias}.xmin AS text)", "sqlite": "''"}
GREATEST = {"postgresql": "GREATEST", "sqlite": "MAX"}
LOCK_WAIT = {"postgresql": "FOR UPDATE OF {alias}", "sqlite": ""}
LOCK_SHARE = {"postgresql": "FOR SHARE OF {alias}", "sqlite": ""}
# The scopes of an ended attempt's slots that have a counter, NULL when none has: an
# attempt holds every scope of its run (domain.policy.run_scopes), and one without a
# counter is not limited, nothing to give back (a run under no limit ends in the one
# statement that ends it). A counter made after this statement's snapshot, which
# counted the attempt, keeps its slot until the reconciler's recount: one too many
# here. (A counter made while a claim commits can count one too few: the known gap of
# a policy that adds a limit, docs/architecture.md.)
# With no counter at all (no policy limits anything), not even the scopes are read:
# the uncorrelated EXISTS is evaluated once per statement.
COUNTED_SCOPES = {
    "postgresql": """CASE WHEN EXISTS (SELECT 1 FROM limit_counters) THEN (
        SELECT json_agg(s.scope) FROM json_array_elements_text({col}) AS s(scope)
        WHERE EXISTS (SELECT 1 FROM limit_counters c WHERE c.scope = s.scope)) END""",
    "sqlite": """CASE WHEN EXISTS (SELECT 1 FROM limit_counters) THEN (
        SELECT CASE WHEN COUNT(*) > 0 THEN json_group_array(s.value) END
        FROM json_each({col}) AS s
        WHERE EXISTS (SELECT 1 FROM limit_counters c WHERE c.scope = s.value)) END""",
}

# --- claim (the dispatch path) -------------------------------------------------------
#
# A claim is a few short statements in one transaction (``SchedulingMixin.claim``
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


# A provider paused until ``:until`` (now + its retry-after); a longer pause kept.
PROVIDER_PAUSE = """
INSERT INTO provider_pauses (provider, paused_until, run_id, updated_at)
VALUES (:provider, :until, :run_id, :now)
ON CONFLICT (provider) DO UPDATE
SET paused_until = excluded.paused_until, run_id = excluded.run_id,
    updated_at = excluded.updated_at
WHERE provider_pauses.paused_until < excluded.paused_until
"""
PAUSED_PROVIDERS = "SELECT provider FROM provider_pauses WHERE paused_until > :now"
# A provider's tokens per minute (``[providers.NAME] tokens_per_minute``), fed by its
# runs' cost reports: counted in a window of one clock minute (window_start) on the
# provider's one row; the report that brings the window to the budget pauses the
# provider until the window's end. Every SET reads the row as it was.
_TOKENS_IN_WINDOW = """CASE WHEN provider_pauses.window_start = excluded.window_start
        THEN provider_pauses.window_tokens + excluded.window_tokens
        ELSE excluded.window_tokens END"""
_PROVIDER_TOKENS = """
INSERT INTO provider_pauses (provider, paused_until, run_id, updated_at, window_start,
                             window_tokens)
VALUES (:provider,
        CASE WHEN CAST(:tokens AS bigint) >= CAST(:budget AS bigint)
             THEN CAST(:window_end AS double precision) ELSE 0 END,
        :run_id, :now, :window_start, :tokens)
ON CONFLICT (provider) DO UPDATE
SET window_tokens = """ + _TOKENS_IN_WINDOW + """,
    window_start = excluded.window_start,
    paused_until = CASE WHEN """ + _TOKENS_IN_WINDOW + """ >= CAST(:budget AS bigint)
                        THEN {greatest}(provider_pauses.paused_until,
                                        CAST(:window_end AS double precision))
                        ELSE provider_pauses.paused_until END,
    updated_at = excluded.updated_at
"""
PROVIDER_TOKENS = {dialect: _PROVIDER_TOKENS.format(greatest=greatest)
                   for dialect, greatest in GREATEST.items()}
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

# The writes of a claim. PostgreSQL: one statement. Its inputs are parallel arrays
# (one element per claimed run, per slot scope, per lane), so its text never changes.
# The counters were locked first (LOCK_SCOPES), so each slot's guard holds; the runs
# were locked by LANE_RUNS; lanes are the last lock of the order, taken here.
# A lane whose queued runs all wait for their backoff sleeps until the first is due:
# it leaves the pick index, so claims stop walking it (a claim that found none of its
# runs runnable asks). A lane that gains a run wakes (LANE_ENTER, LANE_UPSERT); a
# lane whose time came is woken before a claim goes on (PICK_LANES says so, and the
# claim wakes them in a transaction of its own, LANES_WAKE), rejoining its priority
# at the current virtual time. Both skip lanes another transaction holds: they are
# bookkeeping, never worth a wait (or a deadlock).
#
# A lane the claim found empty for another reason (its runs' repository is full) has a
# visible run near its head: the head walk (an ordered walk of the dispatch index,
# stopping at the first visible run) says so before the MIN, which reads every queued
# run of the lane (CASE: in order). Not as an EXISTS: with statistics that promise many
# queued runs per lane (before the ANALYZE after a drain) the planner made that a Seq
# Scan of every run (39 ms per claim that found a lane empty, seen).
_HEAD_RUN = """(
    SELECT r.run_id FROM runs r
    WHERE r.lane_id = lanes.lane_id AND r.status = 'QUEUED' AND r.visible_at <= {{now}}
    ORDER BY r.created_at, r.run_id LIMIT 1)"""
_LANES_SLEEP = """
UPDATE lanes
SET wake_at = (SELECT MIN(r.visible_at) FROM runs r
               WHERE r.lane_id = lanes.lane_id AND r.status = 'QUEUED')
WHERE lanes.lane_id IN (SELECT l.lane_id FROM lanes l
                        WHERE l.lane_id {in_lanes} AND l.wake_at IS NULL
                        ORDER BY l.lane_id {{lock_l_skip}})
  AND CASE WHEN """ + _HEAD_RUN + """ IS NOT NULL
           THEN false
           ELSE (SELECT MIN(r.visible_at) FROM runs r
                 WHERE r.lane_id = lanes.lane_id AND r.status = 'QUEUED') > {{now}} END
"""
LANES_SLEEP = {"postgresql": _LANES_SLEEP.format(in_lanes="= ANY(CAST(:lane_ids AS bigint[]))"),
               "sqlite": _LANES_SLEEP.format(in_lanes="IN :lane_ids")}
# A lane that gave nothing although runs of it are visible: every one of them is
# blocked by a full scope (its repository, user or risk class at its limit) or held by
# another claim. Its pass never moves while it gets nothing, so it would stay first in
# the fair order and every claim would walk its whole backlog (the scope filter reads
# each run's row): 13 ms per claim behind 20,000 such runs (bench/blocked_lane.py). It
# sleeps instead, with a ``lane_blocks`` row per blocking scope, and the release that
# gives one of those scopes room wakes it (WAKE_BLOCKED_LANES); ``:recheck`` seconds
# (BLOCKED_LANE_RECHECK_SECONDS) bound the sleep, a safety net.
#
# A lane sleeps only if none of its visible runs could run: a run another claim held
# during the walk, and whose scopes have room, keeps it awake (sleeping on the scopes
# of its other runs, it stayed asleep a whole recheck with that run runnable: the
# 8-process limit test ran out of patience). The full counters are share-locked,
# skipping those locked: a release that has taken a slot back (not yet committed) is
# skipped, so its scope counts as having room; a release that comes after the lock
# waits for this claim's commit, and its wake (the last statement of its transaction)
# then sees the blocks. LANES_SLEEP, just before, locked each empty lane it could (a
# submit to it waits for this claim, then wakes it); one another transaction held
# then can change after this read, so each lane comes with its row version as read,
# and the sleep (BLOCKED_LANES_SLEEP) is only for a lane not updated since (a queued
# count and pass compared instead were fooled by a cancel and a submit in between);
# it ends when the lane's next invisible run becomes visible, if that is sooner than
# the recheck. Reads the lanes' queued runs once, and the time once.
_LANE_BLOCKING_SCOPES = """
WITH t AS (SELECT {{now}} AS now),
queued AS (
    SELECT r.lane_id, r.visible_at, 'repo:' || r.repo AS repo_scope,
           'user:' || COALESCE(r.user_id, '') AS user_scope, 'risk:' || r.risk_class AS risk_scope
    FROM runs r
    WHERE r.lane_id {in_lanes} AND r.status = 'QUEUED'),
visible AS (SELECT * FROM queued WHERE visible_at <= (SELECT now FROM t)),
run_scopes AS (
    SELECT lane_id, repo_scope AS scope FROM visible
    UNION ALL SELECT lane_id, user_scope FROM visible
    UNION ALL SELECT lane_id, risk_scope FROM visible),
-- Each run's scopes looked up by the counters' primary key (a join ON scope IN (three
-- columns), or IN a CTE, was planned as a nested loop over every pair of run and full
-- scope: 2 s for 20,000 runs over 1,000 full repositories, inside the claim, with the
-- counters share-locked; the review of 2026-12-01). A counter is share-locked once
-- per run that has its scope (all but the first find it held already).
full_scopes AS (
    SELECT rs.lane_id, c.scope FROM run_scopes rs
    JOIN limit_counters c ON c.scope = rs.scope
    WHERE c.active >= c.max_active
    {{lock_c_share_skip}}),
runnable AS (
    SELECT lane_id FROM visible
    WHERE repo_scope NOT IN (SELECT scope FROM full_scopes)
      AND user_scope NOT IN (SELECT scope FROM full_scopes)
      AND risk_scope NOT IN (SELECT scope FROM full_scopes)),
blocked AS (SELECT DISTINCT lane_id, scope FROM full_scopes),
next_visible AS (
    SELECT lane_id, MIN(visible_at) AS visible_at FROM queued
    WHERE visible_at > (SELECT now FROM t) GROUP BY lane_id)
SELECT b.lane_id, b.scope, {{row_version}} AS row_version, n.visible_at AS next_visible_at,
       (SELECT now FROM t) AS read_at
FROM blocked b JOIN lanes l ON l.lane_id = b.lane_id
LEFT JOIN next_visible n ON n.lane_id = b.lane_id
WHERE b.lane_id NOT IN (SELECT lane_id FROM runnable)
"""
LANE_BLOCKING_SCOPES = {
    "postgresql": _LANE_BLOCKING_SCOPES.format(in_lanes="= ANY(CAST(:lane_ids AS bigint[]))"),
    "sqlite": _LANE_BLOCKING_SCOPES.format(in_lanes="IN :lane_ids")}
# The lanes, each if still awake and as LANE_BLOCKING_SCOPES saw it (its row version);
# skipped if another transaction holds it (a submit, a claim, a wake: it is changing).
# Each sleeps until its next invisible run becomes visible or the recheck, the sooner.
# PostgreSQL: all in one statement (a claim can find a thousand blocked lanes at once;
# a statement per lane cost it a round trip each). SQLite: one lane per statement.
_BLOCKED_SLEEP_SET = """
SET wake_at = (SELECT CASE WHEN CAST({next_visible_at} AS double precision) < t.until
                           THEN CAST({next_visible_at} AS double precision) ELSE t.until END
               FROM (SELECT {{now}} + :recheck AS until) t)
"""
BLOCKED_LANES_SLEEP = {
    "postgresql": "UPDATE lanes" + _BLOCKED_SLEEP_SET.format(next_visible_at="seen.next_visible_at")
    + """FROM unnest(CAST(:lane_ids AS bigint[]), CAST(:row_versions AS text[]),
            CAST(:next_visible_ats AS double precision[]))
       AS seen(lane_id, row_version, next_visible_at)
WHERE lanes.lane_id = seen.lane_id
  AND lanes.lane_id IN (SELECT l.lane_id FROM lanes l
                        WHERE l.lane_id = ANY(CAST(:lane_ids AS bigint[]))
                          AND l.wake_at IS NULL
                        ORDER BY l.lane_id {lock_l_skip})
  AND {row_version_lanes} = seen.row_version
RETURNING lanes.lane_id
""",
    "sqlite": "UPDATE lanes" + _BLOCKED_SLEEP_SET.format(next_visible_at=":next_visible_at")
    + """WHERE lanes.lane_id = :lane_id AND lanes.wake_at IS NULL
RETURNING lane_id
""",
}
LANE_BLOCK_INSERT = """
INSERT INTO lane_blocks (scope, lane_id) VALUES (:scope, :lane_id)
ON CONFLICT (scope, lane_id) DO NOTHING
"""
# The virtual time of a (queue, priority): the lowest pass of the lanes that compete in
# it (queued runs, not hidden by a full tenant or a backoff sleep), where lanes join,
# wake and are shown again. Lanes of a route no live worker serves (``unserved``, set by
# the reconciler, SchedulingMixin._mark_unserved_lanes) are left out while any other
# lane competes: such a lane is never claimed, so its pass never moves, and a tenant
# that came later joined at it, far behind the lanes being served, and took the next
# claims one after another (banked credit). ``extra``: a further condition on ``v``.
def _virtual_time(queue: str, priority: str, extra: str = "") -> str:
    competing = f"""FROM lanes v
         WHERE v.queue = {queue} AND v.priority = {priority}
           AND v.queued_count > 0 AND v.tenant_at_limit = 0 AND v.wake_at IS NULL{extra}"""
    return f"""COALESCE((SELECT MIN(v.pass) {competing} AND v.unserved = 0),
         (SELECT MIN(v.pass) {competing}))"""


# The pass of a lane's flow (its tenant's other lanes of the queue and priority, one per
# route) while one of them competes: a lane that joins (gains work, wakes) takes it,
# whatever its own (a lane that woke kept a higher pass of its own, and the flow had
# two for good: a review), so the flow keeps one pass and one share; joining alone,
# it rejoins at its priority's virtual time. On ``ix_lanes_flow`` (migration 0012).
_FLOW_PASS = """(SELECT MIN(f.pass) FROM lanes f
         WHERE f.tenant = {tenant} AND f.queue = {queue} AND f.priority = {priority}
           AND f.lane_id <> {lane} AND f.queued_count > 0 AND f.tenant_at_limit = 0
           AND f.wake_at IS NULL)"""
_LANE_FLOW_PASS = _FLOW_PASS.format(tenant="lanes.tenant", queue="lanes.queue",
                                    priority="lanes.priority", lane="lanes.lane_id")
_WAKE_SET = """
SET wake_at = NULL,
    pass = COALESCE(""" + _LANE_FLOW_PASS + """, {greatest}(lanes.pass, COALESCE(
        """ + _virtual_time("lanes.queue", "lanes.priority") + """ - :ahead, lanes.pass)))
"""
_DUE_LANES = """
SELECT l.lane_id FROM lanes l WHERE l.wake_at IS NOT NULL AND l.wake_at <= {now}
ORDER BY l.wake_at LIMIT 100 {lock_l_skip}
"""
LANES_WAKE = "UPDATE lanes" + _WAKE_SET + "WHERE lanes.lane_id IN (" + _DUE_LANES + ")"
# The reconciler's repair of a lane asleep past both its next due run and the recheck
# that bounds a blocked lane's sleep (a wake_at no sleep sets; audit
# lane_asleep_past_its_runs): woken as a due lane is, skipping lanes others hold.
WAKE_OVERSLEPT_LANES = "UPDATE lanes" + _WAKE_SET + """WHERE lanes.lane_id IN (
    SELECT l.lane_id FROM lanes l
    WHERE l.wake_at > {now} + :recheck
      AND l.wake_at > (SELECT MIN(r.visible_at) FROM runs r
                       WHERE r.lane_id = l.lane_id AND r.status = 'QUEUED')
    ORDER BY l.lane_id {lock_l_skip})
"""
# A release gave room in ``:scopes``: wake the sleeping lanes blocked on any of them,
# then forget every block on those scopes. Sent last in the release's transaction
# (Store._transaction), after every lane write that may wait: it skips lanes others
# hold, so it never waits itself, and nothing waits after it. An awake lane with a
# stale block is not touched (its pass stays its own). The blocks of a woken lane on
# other scopes stay until those scopes free (an early wake at worst: the lane is
# walked, and sleeps again). The delete returns the lanes still asleep: the ones the
# wake skipped (a cancel, a policy's flags, another claim held them; not all of them
# wake lanes), woken one by one after the commit (LANE_WAKE_AFTER_RELEASE).
WAKE_BLOCKED_LANES = "UPDATE lanes" + _WAKE_SET + """WHERE lanes.lane_id IN (
    SELECT l.lane_id FROM lanes l
    WHERE l.lane_id IN (SELECT b.lane_id FROM lane_blocks b WHERE b.scope IN :scopes)
      AND l.wake_at IS NOT NULL
    ORDER BY l.lane_id {lock_l_skip})
"""
LANE_BLOCKS_DELETE = """
DELETE FROM lane_blocks WHERE scope IN :scopes
RETURNING lane_id,
          (SELECT l.wake_at FROM lanes l WHERE l.lane_id = lane_blocks.lane_id) IS NOT NULL
            AS still_asleep
"""
# One lane the release's wake skipped, in a transaction of its own after the release
# committed: it holds no other lock, so it may wait for the lane's holder (for at
# most LOCAL_LOCK_TIMEOUT; PostgreSQL only: SQLite's wake never skips a lane).
LOCAL_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', :timeout, true)"
LANE_WAKE_AFTER_RELEASE = "UPDATE lanes" + _WAKE_SET + """
WHERE lanes.lane_id = :lane_id AND lanes.wake_at IS NOT NULL
"""

# The writes of a claim, on PostgreSQL one statement of data-modifying CTEs over three
# inputs, defined before it: ``slot_deltas(scope, n, max_active)`` (the slots to take
# per scope and the policy's maximum), ``picked(run_id, estimated_cost_usd, scopes)``
# (the runs, each with its scopes as a JSON list) and ``lane_deltas(lane_id, n, gone)``
# (the runs claimed from each lane, and those that left it at claim without being
# claimed: denied, deferred or pruned, SchedulingMixin._admit_candidates); and
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
new_attempts AS (
    INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,
                          lease_status, lease_expires_at, heartbeat_at, started_at,
                          cost_usd, input_tokens, output_tokens, estimated_cost_usd,
                          limit_scopes)
    SELECT c.run_id, c.attempt_count, c.fencing_token, :worker_id, 'RUNNING', 'ACTIVE',
           t.now + :ttl, t.now, t.now, 0, 0, 0, p.estimated_cost_usd, CAST(p.scopes AS json)
    FROM claimed c JOIN picked p ON p.run_id = c.run_id, t),
events AS (
    INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                            fencing_token)
    SELECT run_id, attempt_count, t.now, :worker_id, 'QUEUED', 'CLAIMED', fencing_token
    FROM claimed, t),
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
# Around the transaction's CLAIM_WRITE_PG (SchedulingMixin._write_claim): a write that
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
# writes nothing and the claim runs as a transaction (``SchedulingMixin.claim``):
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

# Slots: make sure a limited scope has its counter row with the policy's maximum ...
# A new counter starts at the slots live attempts still hold in its scope (``:active``,
# from ACTIVE_SLOTS): a policy that removed the limit deleted the counter, and one that
# brings it back must count the attempts claimed under the first (at 0, a repository
# limited to 1 ran 2).
# Only under the policy in force: a claim that decided under an older version (a
# policy committed since its first statement) wrote that version's maximum back over
# the raise, and a scope full under the old limit then kept its runs out of every
# walk until a release. The claim finds the counter unchanged and starts again.
ENSURE_COUNTER = """
INSERT INTO limit_counters (scope, active, max_active)
SELECT :scope, :active, :max_active
WHERE (SELECT MAX(version) FROM policy_versions) = :version
ON CONFLICT (scope) DO UPDATE SET max_active = excluded.max_active
WHERE limit_counters.max_active <> excluded.max_active
"""
# ... lock them in one global order (a plain UPDATE locks in whatever order its scan
# meets the rows, and two claims, or a claim and a release, would deadlock) ...
LOCK_SCOPES = {
    # One primary-key probe per distinct scope, in scope order, whatever their number:
    # a subquery with FOR UPDATE is never pulled up, so the LATERAL one runs (and locks
    # its row) once per outer row, in the outer row's order: the distinct scopes,
    # sorted here by the database's own collation, as the reconciler's LOCK_COUNTERS
    # orders them (a Python sort may disagree with it). ``scope = ANY(:scopes) ORDER
    # BY scope FOR UPDATE`` was planned, at ~150 scopes, as a Seq Scan of every counter
    # and a Sort. Scopes without a counter return no row; duplicates one. The LIMIT
    # (a no-op) bounds the generic plan's estimate of the array: without it every
    # release of a limited run planned this statement again (custom plans only, seen
    # in pg_prepared_statements after 500 completions), as the pick did (_PICK_PAGE_PG).
    "postgresql": """
SELECT scope, active, max_active
FROM (SELECT DISTINCT a.scope FROM unnest(CAST(:scopes AS text[])) AS a(scope)
      ORDER BY a.scope LIMIT cardinality(CAST(:scopes AS text[]))) s
CROSS JOIN LATERAL (SELECT c.active, c.max_active FROM limit_counters c
                    WHERE c.scope = s.scope FOR UPDATE) c
ORDER BY scope
""",
    "sqlite": """
SELECT scope, active, max_active FROM limit_counters WHERE scope IN :scopes ORDER BY scope
""",
}
# ... and give slots back (an attempt's end): SQLite one attempt's scopes at a time,
# PostgreSQL every ended attempt's at once (one statement, not one per attempt: a
# completed batch of 10 limited runs sent 10). Each scope returns whether the release
# took it below its limit from at or over it (``freed``: its blocked lanes wake, a
# tenant's lanes show again). The counters are locked (LOCK_SCOPES) before, so the
# values this statement reads are the ones it updates.
GIVE_SLOTS = """
UPDATE limit_counters SET active = active - 1
WHERE scope IN :scopes AND active > 0
RETURNING scope, active, max_active
"""
GIVE_SLOTS_MANY_PG = """
UPDATE limit_counters c
SET active = GREATEST(c.active - g.n, 0)
FROM (SELECT k.scope, k.active, d.n
      FROM unnest(CAST(:scopes AS text[]), CAST(:counts AS integer[])) AS d(scope, n)
      JOIN limit_counters k ON k.scope = d.scope) g
WHERE c.scope = g.scope AND c.active > 0
RETURNING c.scope, g.active >= c.max_active AND c.active < c.max_active AS freed
"""
CLEAR_ATTEMPT_SLOTS = """
UPDATE attempts SET limit_scopes = NULL WHERE run_id = :run_id AND fencing_token = :token
"""
# A tenant at its limit hides (or, below it again, shows) all its lanes, locked in
# lane_id order first, as every writer of several lanes locks them (their scan order
# is not lane_id order once a lane's row was written again: a release deadlocked with
# a submit holding a lower lane of the tenant).
# PostgreSQL: the lanes a transaction moves runs in and those of the tenants it shows
# again, locked at once in lane_id order before it writes them (the two writes would
# otherwise lock them in two passes, each in order, but not in one).
LOCK_LANES_TO_WRITE = """
SELECT l.lane_id FROM lanes l
WHERE l.lane_id = ANY(CAST(:lane_ids AS bigint[]))
   OR EXISTS (SELECT 1 FROM unnest(CAST(:tenants AS text[]), CAST(:flags AS integer[]))
                AS m(tenant, flag)
              WHERE m.tenant = l.tenant AND l.tenant_at_limit <> m.flag)
ORDER BY l.lane_id
FOR UPDATE
"""
# A lane shown again catches up with its (queue, priority): hidden, it kept the pass
# it had, and a tenant whose limit was raised took the next claims one after another
# ahead of a new tenant's first run (banked credit). It rejoins just behind the lowest
# pass (a new lane joins just ahead of it: the newcomer's first run still goes first).
# Other tenants' lanes only: SQLite's UPDATE sees the lanes of the tenant it already
# showed, and a tenant's second lane came back JOIN_AHEAD behind its first (a flow
# with two passes; PostgreSQL reads the statement's snapshot, where they are hidden).
_SHOWN_PASS = """{greatest}(pass, COALESCE(
        """ + _virtual_time("lanes.queue", "lanes.priority",
                            " AND v.tenant <> lanes.tenant") + """ + :ahead, pass))"""
MARK_TENANT_LANES = """
UPDATE lanes SET tenant_at_limit = :at_limit,
    pass = CASE WHEN CAST(:at_limit AS integer) = 0 THEN """ + _SHOWN_PASS + """ ELSE pass END
WHERE lane_id IN (SELECT l.lane_id FROM lanes l
                  WHERE l.tenant IN :tenants AND l.tenant_at_limit <> :at_limit
                  ORDER BY l.lane_id {lock_for_update})
"""

# Lane bookkeeping. A lane that gains work after being empty joins just ahead of the
# current virtual time of its (queue, priority), never further: an idle tenant cannot
# bank credit, and a new tenant's first run is the next one claimed in its priority.
LANE_VIRTUAL_TIME = "SELECT " + _virtual_time(":queue", ":priority")
_TENANT_FULL = """(SELECT COUNT(*) FROM limit_counters c
         WHERE c.scope = {scope} AND c.active >= c.max_active)"""
# The upsert of a lane runs are going into (SQLite: one per lane, in lane key order;
# PostgreSQL: all lanes of a submit in SUBMIT_WRITE_PG). A lane that gains work
# after being empty rejoins at ``pass`` (the head's virtual time), never behind
# its own.
_LANE_UPSERT_CONFLICT = """
ON CONFLICT (queue, route_key, priority, tenant) DO UPDATE
SET weight = excluded.weight,
    pass = CASE WHEN lanes.queued_count = 0 AND excluded.queued_count > 0
                THEN COALESCE(""" + _LANE_FLOW_PASS + """,
                              {greatest}(lanes.pass, excluded.pass))
                ELSE lanes.pass END,
    queued_count = lanes.queued_count + excluded.queued_count,
    wake_at = NULL
RETURNING lane_id, queue, route_key, priority, tenant
"""
LANE_UPSERT = """
INSERT INTO lanes (queue, route_key, priority, tenant, weight, queued_count, pass,
                   tenant_at_limit)
VALUES (:queue, :route_key, :priority, :tenant, :weight, :queued,
        COALESCE(""" + _FLOW_PASS.format(
    tenant=":tenant", queue=":queue", priority=":priority", lane="-1") + """, :vtime),
        """ + _TENANT_FULL.format(scope=":tenant_scope") + ")" + _LANE_UPSERT_CONFLICT
LANE_ENTER = """
UPDATE lanes
SET pass = CASE WHEN queued_count = 0 THEN COALESCE(""" + _LANE_FLOW_PASS + """,
        {greatest}(pass, COALESCE(
        """ + _virtual_time("lanes.queue", "lanes.priority") + """ - :ahead, pass)))
           ELSE pass END,
    queued_count = queued_count + :n,
    wake_at = NULL
WHERE lane_id = :lane_id
"""
LANE_LEAVE = """
UPDATE lanes SET queued_count = queued_count - :n WHERE lane_id = :lane_id
"""
# SQLite's claim: the runs leave their lanes (LANE_LEAVE), and every lane of each flow
# they came from advances its shared pass.
FLOW_CLAIMED = """
UPDATE lanes SET pass = pass + :n / weight
WHERE tenant = :tenant AND queue = :queue AND priority = :priority
"""
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
                      estimated_cost_usd, provider)
    SELECT r.run_id, r.task_id, r.tenant, r.repo, r.queue, r.priority, r.status,
           0, r.max_attempts, 0, COALESCE(r.visible_at, c.now), c.now, c.now,
           COALESCE(r.ended_at, CASE WHEN r.status = 'POLICY_DENIED' THEN c.now END),
           r.reason_code, r.message, 0,
           r.user_id, r.risk_class, r.route_key, l.lane_id, r.policy_version,
           r.admission, r.limits, r.estimated_cost_usd, r.provider
    FROM new_runs r CROSS JOIN clock c
    JOIN lane_ids l ON l.queue = r.queue AND l.route_key = r.route_key
                   AND l.priority = r.priority AND l.tenant = r.tenant
    RETURNING run_id, queue, status),
events AS (
    INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                            reason_code, fencing_token, message)
    SELECT r.run_id, NULL, (SELECT now FROM clock), :actor, NULL, r.status,
           r.reason_code, NULL, r.event_message
    FROM new_runs r JOIN inserted_runs i ON i.run_id = r.run_id),
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
# The reconciler's marks of lanes whose route no live worker serves (they leave the
# virtual time, _virtual_time) and of those served again, which rejoin just behind the
# lanes that compete (as a tenant's lanes shown again do, _SHOWN_PASS): a lane that
# waited for a worker has no credit to spend. Lanes another transaction holds are
# skipped (it never waits on a lane) and marked at the next pass. ``:lane_ids`` as
# text (expanding lists bind as strings): a scan of the lanes, once a reconciler pass.
_LANES_TO_MARK = """lanes.lane_id IN (SELECT l.lane_id FROM lanes l
    WHERE CAST(l.lane_id AS VARCHAR(20)) IN :lane_ids ORDER BY l.lane_id {lock_l_skip})"""
MARK_LANES_UNSERVED = "UPDATE lanes SET unserved = 1 WHERE " + _LANES_TO_MARK
MARK_LANES_SERVED = ("UPDATE lanes SET unserved = 0, pass = " + _SHOWN_PASS
                     + " WHERE " + _LANES_TO_MARK)
# Queued lanes and the marked ones: what the marks are decided on.
LANES_BY_ROUTE = """
SELECT lane_id, queue, route_key, unserved FROM lanes
WHERE queued_count > 0 OR unserved <> 0
"""
LIVE_WORKERS = """
SELECT worker_id, queues, capabilities FROM workers WHERE status IN ('STARTING', 'READY')
"""
WAITING_IN_ROUTES = """
SELECT SUM(queued_count) FROM lanes WHERE queue IN :queues AND route_key IN :routes
"""
# Queued runs by queue and route (a worker's --exit-when-idle says which it left).
QUEUED_BY_ROUTE = """
SELECT queue, route_key, SUM(queued_count) AS queued FROM lanes WHERE queued_count > 0
GROUP BY queue, route_key ORDER BY queue, route_key
"""
WAITING_ROUTES = """
SELECT DISTINCT queue, route_key FROM lanes WHERE queued_count > 0
"""
# A worker's look before it claims (Worker._claim_if_ready): is any lane of its queues
# and routes holding a run that is not waiting out a backoff? One read of lanes, no
# lock; a lane it shows may still be all-blocked (limits): then the claim says so.
READY_IN_ROUTES = """
SELECT 1 FROM lanes
WHERE queue IN :queues AND route_key IN :routes AND queued_count > 0
  AND (wake_at IS NULL OR wake_at <= {now})
LIMIT 1
"""
# A worker's look (Store.look): for each route with queued runs in its queues, 0 when a
# run may be claimed now, else the seconds until the earliest one's backoff ends. The
# worker matches the routes to its capabilities itself (no read of the route table), and
# an idle worker sleeps until that time, not past it. One read of lanes, no lock.
LOOK_IN_QUEUES = """
SELECT route_key,
       MIN(CASE WHEN wake_at IS NULL OR wake_at <= {now} THEN 0 ELSE wake_at - {now} END)
         AS ready_in
FROM lanes
WHERE queue IN :queues AND queued_count > 0
GROUP BY route_key
"""
# Which of a worker's leased runs have a cancel requested (SQLite's change signal: the
# worker beats at once for them, and the beat delivers the cancel).
CANCELS_AMONG = """
SELECT run_id FROM runs
WHERE run_id IN :run_ids AND status IN ('CANCEL_REQUESTED', 'CANCELLING')
"""
QUEUED_IN_ROUTE = """
SELECT r.* FROM runs r JOIN lanes l ON l.lane_id = r.lane_id
WHERE l.queue = :queue AND l.route_key = :route_key AND r.status = 'QUEUED'
  AND (CAST(:tenant AS VARCHAR(128)) IS NULL OR r.tenant = :tenant)
ORDER BY r.created_at, r.run_id
LIMIT :limit
"""

# Repairs (reconciler): the counts the claim relies on, recomputed from the truth.
LANE_COUNT_DRIFT = """
SELECT l.lane_id, l.queued_count,
       (SELECT COUNT(*) FROM runs r WHERE r.lane_id = l.lane_id AND r.status = 'QUEUED')
         AS actual
FROM lanes l
WHERE l.queued_count <> (SELECT COUNT(*) FROM runs r
                         WHERE r.lane_id = l.lane_id AND r.status = 'QUEUED')
"""
LANE_SET_COUNT = "UPDATE lanes SET queued_count = :n WHERE lane_id = :lane_id"
# Slots held by live attempts (the truth the counters must match).
ACTIVE_SLOTS = """
SELECT limit_scopes FROM attempts WHERE lease_status = 'ACTIVE' AND limit_scopes IS NOT NULL
"""
# The repairs lock what they recount first, so that no claim or release is half-way.
LOCK_COUNTERS = ("SELECT scope, active, max_active FROM limit_counters ORDER BY scope "
                 "{lock_for_update}")
# The reconciler recounts the lanes no one else holds (it never waits on a lane, so it
# is in no deadlock cycle; a lane held now is recounted at its next pass).
LOCK_LANES = "SELECT l.lane_id FROM lanes l ORDER BY l.lane_id {lock_l_skip}"
COUNTER_SET = "UPDATE limit_counters SET active = :n WHERE scope = :scope"
COUNTER_SET_MAX = "UPDATE limit_counters SET max_active = :max_active WHERE scope = :scope"
COUNTER_DELETE = "DELETE FROM limit_counters WHERE scope = :scope"
# Only the lanes whose flag is wrong, locked in lane_id order first: an UPDATE of every
# lane locked them in scan order and deadlocked with a claim or a submit holding a
# lower lane (a review's reproduction, tests/test_lock_order.py).
_TENANT_FULL_FLAG = """CASE WHEN EXISTS (
    SELECT 1 FROM limit_counters c
    WHERE c.scope = 'tenant:' || {alias}.tenant AND c.active >= c.max_active) THEN 1 ELSE 0 END"""
_SHOWN_AGAIN = ("lanes.tenant_at_limit <> 0 AND "
                + _TENANT_FULL_FLAG.format(alias="lanes") + " = 0")
RECOMPUTE_TENANT_FLAGS = """
UPDATE lanes SET tenant_at_limit = """ + _TENANT_FULL_FLAG.format(alias="lanes") + """,
    pass = CASE WHEN """ + _SHOWN_AGAIN + """ THEN """ + _SHOWN_PASS + """ ELSE pass END
WHERE lanes.lane_id IN (SELECT l.lane_id FROM lanes l
                        WHERE l.tenant_at_limit <> """ + _TENANT_FULL_FLAG.format(alias="l") + """
                        ORDER BY l.lane_id {lock_for_update})
"""
# A policy change: the same, and each lane's weight that of its tenant in the policy
# (``:weights``, a JSON object; 1.0 for a tenant it does not name), in one statement
# that locks the lanes in lane_id order. Weights were written only when a run
# entered a lane: a weight changed by policy did not apply to runs already queued.
_TENANT_WEIGHT = {
    "postgresql": ("COALESCE((SELECT CAST(w.value AS double precision) FROM "
                   "json_each_text(CAST(:weights AS json)) w WHERE w.key = {alias}.tenant), 1.0)"),
    "sqlite": ("COALESCE((SELECT CAST(w.value AS REAL) FROM json_each(:weights) w "
               "WHERE w.key = {alias}.tenant), 1.0)"),
}
RECOMPUTE_LANES_FOR_POLICY = {dialect: """
UPDATE lanes SET tenant_at_limit = """ + _TENANT_FULL_FLAG.format(alias="lanes") + """,
    pass = CASE WHEN """ + _SHOWN_AGAIN + """ THEN """ + _SHOWN_PASS + """ ELSE pass END,
    weight = """ + weight.replace("{alias}", "lanes") + """
WHERE lanes.lane_id IN (SELECT l.lane_id FROM lanes l
                        WHERE l.tenant_at_limit <> """ + _TENANT_FULL_FLAG.format(alias="l") + """
                           OR l.weight <> """ + weight.replace("{alias}", "l") + """
                        ORDER BY l.lane_id {lock_for_update})
""" for dialect, weight in _TENANT_WEIGHT.items()}

# --- policy, admission, dependencies, budgets ----------------------------------------

POLICY_LATEST = """
SELECT version, digest, document, source, created_at FROM policy_versions
ORDER BY version DESC LIMIT 1
"""
POLICY_VERSION = "SELECT MAX(version) FROM policy_versions"
# What a submit needs first, in one round trip: the time and the policy version in force.
SUBMIT_CONTEXT = "SELECT {now} AS now, (SELECT MAX(version) FROM policy_versions) AS version"
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

INSERT_ATTEMPT = """
INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status, lease_status,
                      lease_expires_at, heartbeat_at, started_at,
                      cost_usd, input_tokens, output_tokens, estimated_cost_usd, limit_scopes)
VALUES (:run_id, :attempt_no, :fencing_token, :worker_id, 'RUNNING', 'ACTIVE',
        :lease_expires_at, :now, :now, 0, 0, 0, :estimated_cost_usd, :limit_scopes)
"""

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

# --- batched completion ---------------------------------------------------------------
#
# A batch of leases as rows ``b(run_id, token, source, attempt_no, actor)``: the same
# statement text for any batch size (one prepared statement). ``source`` is the status
# each lease last moved its run to. PostgreSQL: ``unnest`` of five arrays (``:run_ids``,
# ``:tokens``, ``:sources``, ``:attempt_nos``, ``:actors``), whose row estimate is the
# arrays' length (``json_to_recordset`` is estimated at 100 rows and made the planner
# hash-join a sequential scan of runs and attempts); SQLite: one JSON array of
# [run_id, token, source, attempt_no, actor] (``:leases``).
LEASE_BATCH = {
    "postgresql": ("unnest(CAST(:run_ids AS text[]), CAST(:tokens AS bigint[]), "
                   "CAST(:sources AS text[]), CAST(:attempt_nos AS integer[]), "
                   "CAST(:actors AS text[])) AS b(run_id, token, source, attempt_no, actor)"),
    "sqlite": ("(SELECT json_extract(value, '$[0]') AS run_id, "
               "json_extract(value, '$[1]') AS token, "
               "json_extract(value, '$[2]') AS source, "
               "json_extract(value, '$[3]') AS attempt_no, "
               "json_extract(value, '$[4]') AS actor FROM json_each(:leases)) AS b"),
}
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
    ORDER BY h.n),
ended AS (
    UPDATE attempts
    SET status = 'SUCCEEDED',
        lease_status = 'RELEASED',
        lease_ended_at = t.now,
        ended_at = t.now,
        limit_scopes = NULL  -- given back by this transaction (won returned them), once
    FROM won, t
    WHERE attempts.run_id = won.run_id
      AND attempts.fencing_token = won.fencing_token
      AND attempts.lease_status = 'ACTIVE'
      AND attempts.ended_at IS NULL
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

# --- reaper and reconciler: store/maintenance_sql.py ---------------------------

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
        FROM run_events e
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
        FROM run_events c
        JOIN run_events x ON x.run_id = c.run_id AND x.event_id > c.event_id
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
    # Every status change is a compare-and-set recorded as one event per hop: each
    # event starts where the run's previous one ended. A status overwritten without
    # its event (a run taken out of a terminal state, say) breaks the chain.
    "event_chain_broken": """
        SELECT run_id, 'event ' || CAST(event_id AS TEXT) || ' ' || COALESCE(from_status, '-')
               || ' -> ' || to_status || ' follows one that ended ' || prev_status AS detail
        FROM (SELECT e.run_id, e.event_id, e.from_status, e.to_status,
                     LAG(e.to_status) OVER (PARTITION BY e.run_id ORDER BY e.event_id)
                       AS prev_status
              FROM run_events e) c
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
FROM run_events
WHERE from_status IS NULL OR from_status <> to_status
   OR reason_code IS NULL
   OR reason_code NOT IN ('STALE_PUSH_REPLACED', 'LATE_EFFECT_RECORDED')
GROUP BY from_status, to_status
"""


# --- bulk inserts (PostgreSQL) -------------------------------------------------------


def bulk_insert_json(table: Table, columns: list[str], suffix: str = "") -> str:
    """``INSERT INTO t (cols) SELECT cols FROM json_populate_recordset(NULL::t, :rows)``:
    the rows as one JSON parameter, the same short text for any number of rows. The
    client's cost is one ``json.dumps`` (C) instead of dumping and quoting one array
    per column (psycopg's text array dumper ran a regex per element: a third of a
    1,000-run submit); the server maps keys to columns by name, with their types."""
    names = ", ".join(columns)
    return (f"INSERT INTO {table.name} ({names}) SELECT {names} "
            f"FROM json_populate_recordset(NULL::{table.name}, CAST(:rows AS json)) {suffix}")


# A "-- " comment: a whole line, or the end of one where no quote follows (so never
# inside a literal).
_COMMENT = re.compile(r"^\s*--\s[^\n]*$|\s+--\s[^'\n]*$", re.M)


def compact(sql: str) -> str:
    """The statement as sent: without its comments and indentation. psycopg caches
    its parsing of a statement only up to 4,096 characters; the comments are for the
    reader of this file."""
    lines = (line.strip() for line in _COMMENT.sub("", sql).splitlines())
    return "\n".join(line for line in lines if line)


@dataclass(frozen=True)
class Statements:
    """The statements above, rendered for one dialect."""

    dialect: str

    def render(self, sql: str, *expanding: str) -> TextClause:
        rendered = compact(sql).format(
            now=NOW[self.dialect],
            lock_r=LOCK_WAIT[self.dialect].format(alias="r"),
            lock_r_skip=LOCK_SKIP[self.dialect].format(alias="r"),
            lock_r_share=LOCK_SHARE[self.dialect].format(alias="r"),
            lock_a_skip=LOCK_SKIP[self.dialect].format(alias="a"),
            lock_l_skip=LOCK_SKIP[self.dialect].format(alias="l"),
            lock_c_share_skip=LOCK_SHARE_SKIP[self.dialect].format(alias="c"),
            row_version=ROW_VERSION[self.dialect].format(alias="l"),
            row_version_lanes=ROW_VERSION[self.dialect].format(alias="lanes"),
            lock_ra_skip=LOCK_SKIP[self.dialect].format(alias="r, a"),
            greatest=GREATEST[self.dialect],
            lease_batch=LEASE_BATCH[self.dialect],
            counted_limit_scopes=COUNTED_SCOPES[self.dialect].format(col="limit_scopes"),
            lock_for_update="FOR UPDATE" if self.dialect == "postgresql" else "",
        )
        clause = text(rendered)
        if expanding:
            clause = clause.bindparams(*(bindparam(name, expanding=True, type_=String())
                                         for name in expanding))
        return clause
