"""An index on the tasks a task names as its parent.

Retention keeps a finished task (and its run) while another task names it as its
parent, as it does while another depends on it (store/retention.py); each batch's
pick checks that per candidate run. Built ``CONCURRENTLY`` on a populated table
(online_index), partial: most tasks name no parent.

Revision ID: 0011
"""

from alembic import op

from runlane.store.online_index import IndexSpec, drop_index, ensure_index

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TASKS_PARENT = IndexSpec("ix_tasks_parent", "tasks", ("parent_task_id",),
                         "parent_task_id IS NOT NULL")


def upgrade() -> None:
    ensure_index(op, TASKS_PARENT)


def downgrade() -> None:
    drop_index(op, TASKS_PARENT.name)
