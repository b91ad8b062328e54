"""Named statements of approval gates (store/approvals.py, docs/policy.md).

A run held by an approval gate is in AWAITING_APPROVAL: no lane counts it (its lane's
queued_count is only of QUEUED runs), no claim sees it (the dispatch index is of
QUEUED runs) and no slot is taken for it (slots are taken at claim). Its
``visible_at`` is the gate's expiry. Its decision, once made, is one row of
``run_approvals`` (primary key run_id).
"""

from __future__ import annotations

# The run and what admission reads of it, locked (PostgreSQL: FOR UPDATE; SQLite: the
# transaction's write lock) so that two approvers decide one after the other.
RUN_FOR_APPROVAL = """
SELECT r.run_id, r.task_id, r.tenant, r.repo, r.queue, r.priority, r.user_id,
       r.max_attempts, r.route_key, r.estimated_cost_usd, r.provider, r.status,
       r.fencing_token,
       r.policy_version, r.admission, r.visible_at, {now} AS now
FROM runs r
WHERE r.run_id = :run_id
{lock_r}
"""

APPROVAL_OF = """
SELECT run_id, tenant, decision, actor, note, policy_version, decided_at
FROM run_approvals WHERE run_id = :run_id
"""

# One decision per run: a second one (a race the run lock already orders) is a no-op.
INSERT_APPROVAL = """
INSERT INTO run_approvals (run_id, tenant, decision, actor, note, policy_version,
                           decided_at)
VALUES (:run_id, :tenant, :decision, :actor, :note, :policy_version, :decided_at)
ON CONFLICT (run_id) DO NOTHING
"""

# Runs waiting for approval, oldest first (ix_runs_listing_tenant_status for a tenant,
# ix_runs_status_updated otherwise).
_PENDING = """
SELECT r.run_id, r.task_id, r.tenant, r.repo, r.queue, r.priority, r.user_id,
       r.risk_class, r.estimated_cost_usd, r.policy_version, r.created_at,
       r.visible_at AS expires_at, r.message
FROM runs r
WHERE r.status = 'AWAITING_APPROVAL' {tenant}
ORDER BY r.created_at, r.run_id
LIMIT :limit
"""
PENDING_APPROVALS = _PENDING.replace("{tenant}", "")
PENDING_APPROVALS_OF_TENANT = _PENDING.replace("{tenant}", "AND r.tenant = :tenant")

# Held runs whose gate's timeout passed, a keyset page at a time (SKIP LOCKED: a run
# an approver holds is decided by the approver).
DUE_APPROVALS = """
SELECT r.run_id, r.task_id, r.tenant, r.fencing_token, r.created_at, r.policy_version
FROM runs r
WHERE r.status = 'AWAITING_APPROVAL'
  AND r.visible_at <= {now}
  AND (r.created_at, r.run_id) > (:after_created, :after_id)
ORDER BY r.created_at, r.run_id
LIMIT :limit
{lock_r_skip}
"""

# Whether each run of a scheduler page was approved (a deferred run past its gate).
APPROVED_AMONG = """
SELECT run_id FROM run_approvals WHERE run_id IN :run_ids AND decision = 'APPROVED'
"""
