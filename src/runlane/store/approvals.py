"""The approval gates' half of the store: the runs waiting for approval, a person's
approve or reject, and the expiry of those nobody decided (docs/policy.md).

A run an approval gate holds waits in AWAITING_APPROVAL (admission decided
REQUIRE_APPROVAL). Approving it admits it again under the policy in force, past its
gates only (``AdmissionRequest.gated`` False): it is queued, waits for its
dependencies or for capacity, or is denied, as any run. Rejecting it, or its gate's
timeout passing, ends it POLICY_DENIED (APPROVAL_REJECTED, APPROVAL_EXPIRED): a
terminal state, so it can never start. Each decision is one ``run_approvals`` row,
written in the transaction that moves the run, with the run row locked first: two
approvers at once decide one after the other, the second finds the first's decision.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection

from runlane.domain.admission import TenantUsage, admit
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.errors import ApprovalRefused, NotFound
from runlane.observability import metrics
from runlane.store import approvals_sql as asql

if TYPE_CHECKING:
    from runlane.store.store import Store

log = structlog.get_logger("runlane.store")
S = RunStatus
APPROVED, REJECTED, EXPIRED = "APPROVED", "REJECTED", "EXPIRED"


@dataclass(frozen=True)
class ApprovalDecision:
    """A run's approval decision as recorded, and the run's status after it.
    ``repeated``: this request found the same decision already made (idempotent)."""

    run_id: str
    tenant: str
    decision: str
    actor: str
    note: str | None
    policy_version: int
    decided_at: float
    status: str
    repeated: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _record(row: Any, status: str, repeated: bool) -> ApprovalDecision:
    return ApprovalDecision(run_id=row.run_id, tenant=row.tenant, decision=row.decision,
                            actor=row.actor, note=row.note,
                            policy_version=int(row.policy_version),
                            decided_at=float(row.decided_at), status=status,
                            repeated=repeated)


def pending_approvals(store: Store, *, tenant: str | None = None,
                      limit: int = 500) -> list[dict[str, Any]]:
    """Runs waiting for approval, oldest first (``tenant``: only its own)."""
    statement = asql.PENDING_APPROVALS if tenant is None \
        else asql.PENDING_APPROVALS_OF_TENANT
    with store.reads.connect() as conn:
        rows = conn.execute(store._q(statement), {"tenant": tenant, "limit": limit}).all()
    return [{"run_id": r.run_id, "task_id": r.task_id, "tenant": r.tenant,
             "repo": r.repo, "queue": r.queue, "priority": r.priority,
             "user": r.user_id, "risk_class": r.risk_class,
             "estimated_cost_usd": r.estimated_cost_usd,
             "policy_version": r.policy_version, "created_at": r.created_at,
             "expires_at": r.expires_at, "message": r.message} for r in rows]


def approval_of(store: Store, run_id: str) -> dict[str, Any] | None:
    """The run's approval decision, or None (never held, or not yet decided)."""
    with store.reads.connect() as conn:
        row = conn.execute(store._q(asql.APPROVAL_OF), {"run_id": run_id}).first()
    if row is None:
        return None
    return {"decision": row.decision, "actor": row.actor, "note": row.note,
            "policy_version": int(row.policy_version),
            "decided_at": float(row.decided_at)}


def decide_approval(store: Store, run_id: str, *, approve: bool, actor: str,
                    note: str | None = None, tenant: str | None = None
                    ) -> ApprovalDecision:
    """Approve or reject a run waiting for approval. The same decision again is
    answered with the first (``repeated``); the other one, or a run that was never
    held or has moved on, is ApprovalRefused (a Conflict). ``tenant``: the caller's
    (an API token's): another tenant's run is NotFound."""
    wanted = APPROVED if approve else REJECTED

    def work(conn: Connection) -> ApprovalDecision:
        run = conn.execute(store._q(asql.RUN_FOR_APPROVAL), {
            "run_id": run_id, "now": store.clock.now()}).first()
        if run is None or (tenant is not None and run.tenant != tenant):
            raise NotFound(f"no run {run_id!r}")
        status = S(run.status)
        if status is not S.AWAITING_APPROVAL:
            found = conn.execute(store._q(asql.APPROVAL_OF), {"run_id": run_id}).first()
            if found is not None and found.decision == wanted:
                return _record(found, status.value, repeated=True)
            if found is not None:
                raise ApprovalRefused(f"run {run_id} was already {found.decision.lower()} "
                               f"by {found.actor}; it is {status.value}")
            raise ApprovalRefused(f"run {run_id} is {status.value}, not waiting for approval")
        now = float(run.now)
        version, policy = store._policy(conn)
        conn.execute(store._q(asql.INSERT_APPROVAL), {
            "run_id": run_id, "tenant": run.tenant, "decision": wanted, "actor": actor,
            "note": note, "policy_version": version, "decided_at": now})
        said = f" ({note})" if note else ""
        if not approve:
            target = S.POLICY_DENIED
            store._set_status(conn, run_id=run_id, source=status, path=[target],
                             run_token=int(run.fencing_token), actor=actor, now=now,
                             reason_code=Reason.APPROVAL_REJECTED,
                             message=f"rejected by {actor}{said}")
        else:
            target = _admit_approved(store, conn, run, version, policy, now, actor, said)
        found = conn.execute(store._q(asql.APPROVAL_OF), {"run_id": run_id}).one()
        return _record(found, target.value, repeated=False)

    result = store._transaction(work)
    log.info("approval_decided", run_id=run_id, decision=result.decision,
             actor=result.actor, status=result.status, repeated=result.repeated)
    return result


def _admit_approved(store: Store, conn: Connection, run: Any, version: int, policy: Any,
                    now: float, actor: str, said: str) -> RunStatus:
    """An approved run admitted again under the policy in force, past its gates:
    queued (or waiting for dependencies), deferred or denied. Returns its status."""
    from runlane.store import policy_sql
    from runlane.store.core import WAKEUP_CHANNEL
    from runlane.store.policy import first_policy_version

    usage = store._tenant_usage(conn, {run.tenant}, now).get(run.tenant, TenantUsage()) \
        if policy.needs_usage else TenantUsage()
    decision = admit(store._request_of(run, gated=False), policy, version, usage, now)
    store._on_commit(conn, lambda: metrics.policy_decision(
        "approval", decision.decision, decision.reason_code))
    conn.execute(store._q(policy_sql.SET_ADMISSION), {
        "run_id": run.run_id, "policy_version": version,
        "admission": json.dumps({**decision.to_json(),
                                 "first_policy_version": first_policy_version(run)})})
    visible_at: float | None = now
    if decision.decision == "DENY":
        target, code = S.POLICY_DENIED, decision.reason_code
        message = (f"approved by {actor}{said}, then denied by policy v{version}: "
                   f"{decision.message}")
    elif decision.decision == "DEFER":
        target, code, visible_at = S.WAITING_CAPACITY, decision.reason_code, \
            decision.retry_after
        message = f"approved by {actor}{said}; {decision.message}"
    else:
        target, code = store._dependency_outcome(conn, run.task_id), None
        if target is S.CANCELLED:
            code = Reason.DEPENDENCY_FAILED
        message = f"approved by {actor}{said}; admitted under policy v{version}"
    store._set_status(conn, run_id=run.run_id, source=S.AWAITING_APPROVAL, path=[target],
                     run_token=int(run.fencing_token), actor=actor, now=now,
                     reason_code=code, message=message, visible_at=visible_at)
    if target is S.QUEUED:
        store._notify(conn, WAKEUP_CHANNEL, run.queue)
    return target


def expire_approvals(store: Store, *, page_size: int = 200) -> dict[str, int]:
    """End every held run whose gate's timeout passed (by the store's clock):
    POLICY_DENIED with APPROVAL_EXPIRED. A page per short transaction."""
    cursor: tuple[float, str] = (float("-inf"), "")
    expired = 0

    def page(conn: Connection) -> tuple[tuple[float, str], int, int]:
        now = store._now(conn)
        rows = conn.execute(store._q(asql.DUE_APPROVALS), {
            "now": now, "after_created": cursor[0], "after_id": cursor[1],
            "limit": page_size}).all()
        if not rows:
            return cursor, 0, 0
        version = store._policy(conn)[0]
        ended = 0
        for r in rows:
            conn.execute(store._q(asql.INSERT_APPROVAL), {
                "run_id": r.run_id, "tenant": r.tenant, "decision": EXPIRED,
                "actor": "scheduler", "note": None, "policy_version": version,
                "decided_at": now})
            ended += store._set_status(
                conn, run_id=r.run_id, source=S.AWAITING_APPROVAL, path=[S.POLICY_DENIED],
                run_token=int(r.fencing_token), actor="scheduler", now=now,
                reason_code=Reason.APPROVAL_EXPIRED,
                message="nobody approved or rejected it before its approval gate's "
                        "timeout")
        return (rows[-1].created_at, rows[-1].run_id), ended, len(rows)

    while True:
        cursor, ended, seen = store._transaction(page)
        expired += ended
        if seen < page_size:
            break
    if expired:
        log.info("approvals_expired", runs=expired)
    return {"approvals_expired": expired}
