"""``runlane top``'s activity: two indexes that keep its claim rate and its latest
failures bounded reads (store/activity_sql.py).

1. ``ix_attempts_started`` (started_at): the attempts started in the last minute (one per
   claim) are a walk of the index's newest entries, whatever the size of ``attempts``.
   One entry per attempt, written once by the claim's insert (``started_at`` never
   changes).
2. ``ix_run_events_failures`` (at, event_id) WHERE the event moved a run to
   FAILED_RETRYABLE, FAILED or POLICY_DENIED: the latest failures are the index's
   newest entries. Partial: only failure events have an entry, and events are never
   updated, so no other write pays for it.

Both are built ``CONCURRENTLY`` on a populated PostgreSQL table (online_index).

Revision ID: 0023
"""

from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

STARTED = IndexSpec("ix_attempts_started", "attempts", ("started_at",))
FAILURES = IndexSpec("ix_run_events_failures", "run_events", ("at", "event_id"),
                     where="to_status IN ('FAILED_RETRYABLE', 'FAILED', 'POLICY_DENIED')")


def upgrade() -> None:
    for spec in (STARTED, FAILURES):
        ensure_index(op, spec)


def downgrade() -> None:
    for spec in (FAILURES, STARTED):
        drop_index(op, spec.name)
