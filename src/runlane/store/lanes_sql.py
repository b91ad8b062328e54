"""The lanes' bookkeeping: a lane's sleep and wake, its pass and virtual time, the
flags that hide a full tenant's lanes or an unserved route's, and the upserts of a lane
runs go into."""

from __future__ import annotations

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
# the reconciler, RoutesMixin._mark_unserved_lanes) are left out while any other
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
