"""Repairs (reconciler): the counts the claim relies on, recomputed from the truth;
and the lanes' flags and weights again after a policy change."""

from __future__ import annotations

from runlane.store.lanes_sql import _SHOWN_PASS

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
