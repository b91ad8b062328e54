"""Live attempts record every scope of their run, as attempts claimed since do.

An attempt holds a slot in every concurrency scope of its run (``attempts.limit_scopes``,
``domain.policy.run_scopes``), so that a limit applied while it runs counts it: a new
counter starts at the attempts that hold its scope. Attempts claimed by an older
runlane list only the scopes limited at their claim; a limit applied after the upgrade
would not count them until they end. This adds the run's other scopes to every live
attempt (a scope already listed stays; the list is the run's scopes, sorted). Counters
are not touched: the ending statements give back only the scopes that have a counter,
and the reconciler's recount (``_repair_scheduling_counts``) counts from these lists.

Revision ID: 0014
"""

import json

import sqlalchemy as sa
from alembic import op

from runlane.domain.policy import run_scopes

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

LIVE_ATTEMPTS = sa.text("""
SELECT a.run_id, a.fencing_token, a.limit_scopes, r.tenant, r.repo, r.user_id,
       r.risk_class, r.queue
FROM attempts a JOIN runs r ON r.run_id = a.run_id
WHERE a.lease_status = 'ACTIVE'
""")
SET_SCOPES = sa.text("""
UPDATE attempts SET limit_scopes = :scopes
WHERE run_id = :run_id AND fencing_token = :token AND lease_status = 'ACTIVE'
""").bindparams(sa.bindparam("scopes", type_=sa.JSON))


def upgrade() -> None:
    conn = op.get_bind()
    updates = []
    for row in conn.execute(LIVE_ATTEMPTS):
        listed = row.limit_scopes
        if isinstance(listed, str):
            listed = json.loads(listed)
        scopes = sorted(set(listed or ()) | set(run_scopes(
            row.tenant, row.repo, row.user_id, row.risk_class or "", row.queue)))
        if scopes != listed:
            updates.append({"scopes": scopes, "run_id": row.run_id,
                            "token": row.fencing_token})
    for start in range(0, len(updates), 1000):
        conn.execute(SET_SCOPES, updates[start:start + 1000])


def downgrade() -> None:
    """Nothing to undo: the code of revision 0013 already records every scope."""
