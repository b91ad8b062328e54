"""Policy versions, admission records and budgets. The SQL is in ``policy_sql``."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy import Connection

from runlane.domain.admission import AdmissionRequest, Decision, TenantUsage, admit
from runlane.domain.policy import Policy, policy_digest, policy_document, policy_from_document
from runlane.domain.reasons import Reason
from runlane.domain.routing import requirements_from_canonical
from runlane.errors import PolicyDenied
from runlane.observability import metrics
from runlane.store import policy_sql, recount_sql
from runlane.store.core import FREED_SCOPES, StoreCore
from runlane.store.lanes import JOIN_AHEAD

log = structlog.get_logger("runlane.store")

SCHEDULE_CHANNEL = "runlane_schedule"  # payload: the new policy version


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    digest: str
    created: bool


def utc_day(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d")


def has_budgets(policy: Policy) -> bool:
    return policy.has_budgets


def policy_needs_usage(policy: Policy) -> bool:
    """Whether admission needs the tenants' queued counts and spend at all."""
    return policy.needs_usage


def scope_limit(policy: Policy, scope: str) -> int | None:
    """The current maximum of one concurrency scope, from the one function that
    knows the policy's limits (``concurrency_limits_for``)."""
    kind, _, name = scope.partition(":")
    probe = {"tenant": "\0", "repo": "\0", "user": None, "risk_class": "\0", "queue": "\0"}
    key = {"tenant": "tenant", "repo": "repo", "user": "user", "risk": "risk_class",
           "queue": "queue"}.get(kind)
    if key is not None:
        probe[key] = name
    elif kind != "global":
        return None
    limits = policy.concurrency_limits_for(
        tenant=str(probe["tenant"]), repo=str(probe["repo"]), user=probe["user"],
        risk_class=str(probe["risk_class"]), queue=str(probe["queue"]))
    return limits.get(scope)


def first_policy_version(run: Any) -> int:
    """The version a run was first admitted under (its admission record keeps it when
    a scheduler pass admits the run again under a newer one)."""
    record = run.admission if isinstance(run.admission, dict) else json.loads(
        run.admission or "{}")
    return int(record.get("first_policy_version", run.policy_version))


def same_terms(run: Any, decision: Decision) -> bool:
    """Whether a decision keeps a queued run's terms, those it entered the queue with
    (its lane, its retries, its limits): only then does its record take the decision."""
    limits = run.limits if isinstance(run.limits, dict) else json.loads(run.limits or "{}")
    return (decision.queue, decision.priority, decision.max_attempts, decision.risk_class,
            decision.requires, dict(decision.limits)) == (
        run.queue, run.priority, run.max_attempts, run.risk_class, run.route_key or "",
        limits)


class PolicyMixin(StoreCore):
    """Policy versions, admission and budgets."""

    # --- policy -------------------------------------------------------------------

    def _policy(self, conn: Connection) -> tuple[int, Policy]:
        """The policy in force now (version 0 is the empty default)."""
        version = int(conn.execute(self._q(policy_sql.POLICY_VERSION)).scalar() or 0)
        return version, self._policy_version(conn, version)

    def _policy_version(self, conn: Connection, version: int) -> Policy:
        """One version of the policy, parsed once per store (the empty default too:
        building it validates a model tree, and every claim and submit asks)."""
        policy = self._policy_cache.get(version)
        if policy is None:
            if version == 0:
                policy = Policy.default()
            else:
                row = conn.execute(self._q(policy_sql.POLICY_BY_VERSION),
                                   {"version": version}).one()
                document = row.document if isinstance(row.document, dict) else json.loads(
                    row.document)
                policy = policy_from_document(document, source=f"policy v{version}")
            self._policy_cache[version] = policy
            metrics.name_tenants(policy.tenants)  # the tenants a metric may name
        return policy

    def apply_policy(self, policy: Policy, *, source: str) -> PolicyVersion:
        """Store ``policy`` as a new numbered version unless it is unchanged, then
        bring every concurrency counter to the new maxima."""
        digest = policy_digest(policy)

        def work(conn: Connection) -> PolicyVersion:
            if self.dialect == "postgresql":  # SQLite's writers are serialized already
                conn.execute(self._q(policy_sql.LOCK_CLAIMS_FOR_POLICY_PG))
            current = conn.execute(self._q(policy_sql.POLICY_LATEST)).first()
            if current is not None and current.digest == digest:
                return PolicyVersion(int(current.version), digest, False)
            version = (int(current.version) if current is not None else 0) + 1
            conn.execute(self._q(policy_sql.POLICY_INSERT), {
                "version": version, "digest": digest,
                "document": json.dumps(policy_document(policy)), "source": source,
                "now": self._now(conn)})
            freed: set[str] = set()
            # Locked first, in scope order, as every claim and release locks them: in
            # the order the scan met them, an update here deadlocked with a claim.
            for row in conn.execute(self._q(recount_sql.LOCK_COUNTERS)).all():
                limit = scope_limit(policy, row.scope)
                if limit is None:
                    conn.execute(self._q(recount_sql.COUNTER_DELETE), {"scope": row.scope})
                elif limit != row.max_active:
                    conn.execute(self._q(recount_sql.COUNTER_SET_MAX),
                                 {"scope": row.scope, "max_active": limit})
                # Every raised or removed limit: this read of ``active`` is not locked,
                # and a claim may fill the scope and a lane sleep on it before commit.
                if limit is None or limit > row.max_active:
                    freed.add(row.scope)
            if freed:  # lanes blocked on a limit the policy raised: woken before commit
                conn.info.setdefault(FREED_SCOPES, set()).update(freed)
            conn.execute(self._q(recount_sql.RECOMPUTE_LANES_FOR_POLICY[self.dialect]), {
                "ahead": JOIN_AHEAD,
                "weights": json.dumps({t: p.weight for t, p in policy.tenants.items()})})
            self._policy_cache[version] = policy
            metrics.name_tenants(policy.tenants)
            self._notify(conn, SCHEDULE_CHANNEL, str(version))
            return PolicyVersion(version, digest, True)

        applied = self._transaction(work)
        log.info("policy_applied", version=applied.version, created=applied.created,
                 source=source)
        return applied

    def current_policy(self) -> tuple[int, Policy]:
        with self.reads.connect() as conn:
            return self._policy(conn)

    def policy_record(self) -> dict[str, Any] | None:
        with self.reads.connect() as conn:
            row = conn.execute(self._q(policy_sql.POLICY_LATEST)).first()
        if row is None:
            return None
        document = row.document if isinstance(row.document, dict) else json.loads(row.document)
        return {"version": row.version, "digest": row.digest, "source": row.source,
                "created_at": row.created_at, "policy": document}

    # --- admission ----------------------------------------------------------------

    def _tenant_usage(self, conn: Connection, tenants: Iterable[str], now: float
                      ) -> dict[str, TenantUsage]:
        names = sorted(set(tenants))
        if not names:
            return {}
        queued = {r.tenant: int(r.queued or 0) for r in conn.execute(
            self._q(policy_sql.TENANT_QUEUED, "tenants"), {"tenants": names})}
        spent = {r.tenant: float(r.usd) for r in conn.execute(
            self._q(policy_sql.TENANT_SPEND, "tenants"), {"tenants": names, "day": utc_day(now)})}
        return {t: TenantUsage(queued_runs=queued.get(t, 0), spent_today_usd=spent.get(t, 0.0))
                for t in names}

    @staticmethod
    def _request_of(row: Any, *, gated: bool = False) -> AdmissionRequest:
        """A stored run as admission reads it. ``gated``: approval gates may hold it
        (a deferred run not yet approved); a queued or running run is past them."""
        return AdmissionRequest(
            tenant=row.tenant, repo=row.repo, queue=row.queue, priority=row.priority,
            user=row.user_id, max_attempts=row.max_attempts,
            requires=requirements_from_canonical(row.route_key or ""),
            estimated_cost_usd=getattr(row, "estimated_cost_usd", None), gated=gated,
            provider=row.provider)

    # --- the claim ------------------------------------------------------------------

    def _note_providers(self, policy: Policy) -> None:
        """What the claims (pauses) and cost reports (token budgets) of this store need
        of the policy's providers, from the version a claim just read."""
        self._walk_pauses = bool(policy.providers)
        self._token_budgets = policy.provider_token_budgets

    def _check_policy_before_effect(self, conn: Connection, run_id: str, effect: str) -> None:
        """Invariant 7, third check: a side effect is refused when the policy in force
        now denies the run, whatever the policy it was admitted under."""
        version, policy = self._policy(conn)
        row = conn.execute(self._q(policy_sql.RUN_FOR_POLICY), {"run_id": run_id}).one()
        if version == row.policy_version and version == 0:
            return
        decision = admit(self._request_of(row), policy, version, TenantUsage(), self._now(conn))
        if decision.decision == "DENY":  # rolled back with the effect's intent: count now
            metrics.policy_decision("side_effect", "deny", decision.reason_code)
            raise PolicyDenied(
                f"{effect} refused: policy v{version} denies run {run_id} (admitted under "
                f"v{row.policy_version}): {decision.reason_code}: {decision.message}",
                reason_code=decision.reason_code or Reason.POLICY_DENIED)

    # --- budgets ------------------------------------------------------------------

    def _add_tenant_spend(self, conn: Connection, tenant: str, usd: float, now: float) -> None:
        if usd:
            conn.execute(self._q(policy_sql.ADD_TENANT_SPEND),
                         {"tenant": tenant, "day": utc_day(now), "usd": usd})
            self._on_commit(conn, functools.partial(metrics.cost, tenant, usd))
