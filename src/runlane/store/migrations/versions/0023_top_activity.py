"""``runlane top``'s activity: two indexes that keep its claim rate and its latest
failures bounded reads (store/activity_sql.py).

1. ``ix_run_events_claims`` (at) WHERE the event is a claim (to CLAIMED): the claims of
   the last minute are a walk of the index's newest entries, whatever the size of
   ``run_events``. One entry per claim, written by the claim's event insert; events are
   never updated. (An index on ``attempts.started_at`` would be read the same way, but
   every update of an attempt, its heartbeats included, is not HOT and would write an
   entry too.)
2. ``ix_run_events_failures`` (at, event_id) WHERE the event moved a run to
   FAILED_RETRYABLE, FAILED or POLICY_DENIED: the latest failures are the index's
   newest entries; only failure events have an entry.

Both are built ``CONCURRENTLY`` on a populated PostgreSQL table (online_index).

Revision ID: 0023
"""

from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

CLAIMS = IndexSpec("ix_run_events_claims", "run_events", ("at",),
                   where="to_status = 'CLAIMED'")
FAILURES = IndexSpec("ix_run_events_failures", "run_events", ("at", "event_id"),
                     where="to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED')")


def upgrade() -> None:
    for spec in (CLAIMS, FAILURES):
        ensure_index(op, spec)


def downgrade() -> None:
    for spec in (FAILURES, CLAIMS):
        drop_index(op, spec.name)
