"""Heartbeats write no index entry: ``ix_attempts_active_lease_expiry`` is dropped.

Every beat rewrites ``attempts.lease_expires_at``; with that column in an index no beat
could be a HOT update on PostgreSQL, so each beat of each lease wrote a new entry into
every index of ``attempts`` (four) and about 470 bytes of WAL. Its one reader was the
reaper's scan of expired leases, which now reads the active leases through
``uq_attempts_one_active_lease`` (same predicate, ``lease_status = 'ACTIVE'``) and
sorts them: 10,000 active leases are read in a few milliseconds, once per reaper
interval. At 10,000 active leases beating every 10 s the database's CPU for beats fell
to 0.27x (12.5% of a core to 3.4%) and the WAL per lease beat to 0.32x
(``bench/heartbeat.py``).

PostgreSQL drops it with ``DROP INDEX CONCURRENTLY`` (no lock that blocks writers).

Revision ID: 0027
"""

from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

EXPIRY = IndexSpec("ix_attempts_active_lease_expiry", "attempts", ("lease_expires_at",),
                   "lease_status = 'ACTIVE'")


def upgrade() -> None:
    drop_index(op, EXPIRY.name)


def downgrade() -> None:
    ensure_index(op, EXPIRY)
