"""The limit counters (concurrency slots): made, locked in scope order, given back."""

from __future__ import annotations

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
