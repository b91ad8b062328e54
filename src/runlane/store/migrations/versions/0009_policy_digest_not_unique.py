"""A policy document may come back: its digest is no longer unique.

`apply_policy` makes a new version when the document differs from the one in force
(compared by digest). Going back to an earlier document (a revert) is such a change,
but its digest is an earlier version's, and the unique constraint on the digest
refused the new version (a UniqueViolation to the caller). The constraint goes; the
rows stay as they are.

SQLite cannot drop a constraint: the table is rebuilt (Alembic's batch mode, with a
naming convention for the unnamed constraint, as in 0007).

Revision ID: 0009
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}
POSTGRES_NAME = "policy_versions_digest_key"  # PostgreSQL's name for 0004's constraint


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("policy_versions", recreate="always",
                                  naming_convention=NAMING) as batch:
            batch.drop_constraint("uq_policy_versions_digest", type_="unique")
    else:
        op.drop_constraint(POSTGRES_NAME, "policy_versions", type_="unique")


def downgrade() -> None:
    """Refused when a document was applied twice (the constraint would not hold)."""
    repeated = op.get_bind().exec_driver_sql(
        "SELECT digest FROM policy_versions GROUP BY digest HAVING COUNT(*) > 1").first()
    if repeated is not None:
        raise RuntimeError("a policy document was applied more than once (digest "
                           f"{repeated[0]}): the unique digest of 0008 cannot come back")
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table("policy_versions", recreate="always") as batch:
            batch.create_unique_constraint("uq_policy_versions_digest", ["digest"])
    else:
        op.create_unique_constraint(POSTGRES_NAME, "policy_versions", ["digest"])
