"""The facade's views (``Runlane`` inherits them): the runs listing with keyset pages,
workers and their remote drain, queues, tenants, limits, the policy in force and its
versions. The CLI and the HTTP API call these; each takes the caller's principal.

Who sees what (docs/operations.md, "Views and who sees what"):

* runs: a principal bound to a tenant lists that tenant's runs only; a ``tenant``
  filter naming another tenant lists nothing (an empty page, as for a tenant without
  runs: the answer tells nothing about the other tenant).
* workers are shared machines: a tenant's principal sees only the workers that hold a
  lease of one of its runs now, and of their leases only those; the fleet's size, its
  hosts and what it runs for other tenants stay hidden. Draining is the operator's
  (an admin principal not bound to a tenant): others get Forbidden.
* queues and tenants: a tenant's principal sees its own tenant, and the queues it has
  runs in, with its own counts only; where a limit counts other tenants' runs too
  (global, queue) its ``active`` is null.
* policy: its content names every tenant's terms, so only a principal not bound to a
  tenant reads it; a tenant's principal gets its own terms (weight, limits, budget) and
  the version numbers.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from runlane.api_common import _invalid, _on_the_database
from runlane.domain.access import OPERATOR, Principal, require_operator
from runlane.domain.policy import Policy
from runlane.domain.repos import canonical_repo
from runlane.domain.states import RunStatus
from runlane.domain.tasks import valid_name
from runlane.errors import NotFound
from runlane.models.fleet import (
    LeaseView,
    LimitView,
    PolicyVersionView,
    PolicyView,
    QueueView,
    TenantLimits,
    TenantView,
    WorkerView,
)
from runlane.models.listing import RunPage, RunSummary, timestamp
from runlane.store import views
from runlane.store.views import RunFilters

if TYPE_CHECKING:
    from runlane.settings import Settings
    from runlane.store.store import Store

F = TypeVar("F", bound=Callable[..., Any])

# The largest page of runs one call returns (the CLI's `runs list --limit` reads pages).
MAX_PAGE = 1000
# Scopes whose counter counts the runs of every tenant.
_SHARED_SCOPES = ("global", "queue:", "repo:", "risk:", "user:")


# --- cursors ----------------------------------------------------------------------------

_ORDER = {True: "n", False: "o"}  # newest first, oldest first


def encode_cursor(created_at: float, run_id: str, *, newest_first: bool) -> str:
    """Opaque to callers: the last run of a page, and the page's order. The time is
    written with ``repr`` (exact for a double), so the next page starts exactly after
    it, also among runs that share one ``created_at``."""
    raw = json.dumps([_ORDER[newest_first], repr(float(created_at)), run_id],
                     separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: Any, *, newest_first: bool) -> tuple[float, str]:
    bad = _invalid(f"cursor {cursor!r} is not the `next` of a page of this listing")
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 400:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        order, created, run_id = json.loads(raw)
        created_at = float(created)
    except (binascii.Error, ValueError, TypeError):
        raise bad from None
    if not (isinstance(order, str) and isinstance(created, str) and isinstance(run_id, str)
            and math.isfinite(created_at) and run_id and "\x00" not in run_id):
        raise bad
    if order != _ORDER[newest_first]:
        raise _invalid("cursor is of a page in the other order: give the same "
                       "newest_first as the page it came from")
    return created_at, run_id


# --- arguments --------------------------------------------------------------------------


def _epoch(name: str, value: Any) -> float | None:
    """A point in time given as a datetime (naive: UTC) or epoch seconds."""
    if value is None:
        return None
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        return moment.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise _invalid(f"{name} {value!r} is not a datetime or epoch seconds")
    return float(value)


def _name(kind: str, value: Any) -> str | None:
    if value is None:
        return None
    if not (isinstance(value, str) and valid_name(value)):
        raise _invalid(f"{kind} {value!r} is not a {kind} name")
    return value


def _status(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.upper() not in RunStatus.__members__:
        raise _invalid(f"status {value!r} is unknown; one of {', '.join(RunStatus)}")
    return value.upper()


def _repo(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise _invalid(f"repo {value!r} is not a repository")
    try:
        return canonical_repo(value)
    except ValueError as exc:
        raise _invalid(f"repo {value!r}: {exc}") from None


def _scoped_out(principal: Principal, tenant: str | None) -> bool:
    """Whether a ``tenant`` filter names a tenant the principal may not see."""
    return tenant is not None and not principal.sees(tenant)


def _age(now: float, at: float | None) -> float | None:
    return None if at is None else max(0.0, now - float(at))


def _limit_view(scope: str, max_active: int, active: int | None,
                principal: Principal) -> LimitView:
    shared = scope.startswith(_SHARED_SCOPES)
    return LimitView(scope=scope, max_active=max_active,
                     active=None if shared and principal.tenant is not None else active)


class ViewsMixin:
    """Listing and fleet views of the facade (``runlane.api.Runlane``)."""

    if TYPE_CHECKING:
        store: Store
        settings: Settings

        def task_id_of(self, some_id: str, *, principal: Principal = OPERATOR) -> str: ...

        def run_id_of(self, some_id: str, *, principal: Principal = OPERATOR) -> str: ...

    # --- runs -----------------------------------------------------------------------

    @_on_the_database
    def runs_page(self, *, principal: Principal = OPERATOR, status: str | None = None,
                  tenant: str | None = None, queue: str | None = None,
                  repo: str | None = None, created_after: datetime | float | None = None,
                  created_before: datetime | float | None = None,
                  cursor: str | None = None, limit: int = 50,
                  newest_first: bool = True, task_id: str | None = None) -> RunPage:
        """One page of runs, newest first (or oldest first), filtered; ``next`` is the
        cursor of the following page, None on the last. ``repo`` in any spelling (it is
        compared in its canonical form); ``created_after`` inclusive, ``created_before``
        exclusive; ``task_id`` (a task's or one of its runs' id): that task's runs. A
        page is a walk of an index from the cursor (store/views_sql.py)."""
        filters = RunFilters(
            tenant=_name("tenant", tenant), status=_status(status),
            queue=_name("queue", queue), repo=_repo(repo),
            created_after=_epoch("created_after", created_after),
            created_before=_epoch("created_before", created_before),
            task_id=None if task_id is None else self.task_id_of(task_id,
                                                                 principal=principal))
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise _invalid(f"limit {limit!r} is not an integer in 1..{MAX_PAGE}")
        if not isinstance(newest_first, bool):
            raise _invalid(f"newest_first {newest_first!r} is not a boolean")
        after = None if cursor is None else decode_cursor(cursor, newest_first=newest_first)
        if _scoped_out(principal, filters.tenant):
            return RunPage(items=[], next=None)
        if principal.tenant is not None:
            filters = RunFilters(**{**vars(filters), "tenant": principal.tenant})
        rows = views.runs_page(self.store, filters, limit=limit + 1,
                               newest_first=newest_first, after=after)
        items = [RunSummary.from_row(r) for r in rows[:limit]]
        last = rows[limit - 1] if len(rows) > limit else None
        return RunPage(items=items, next=None if last is None else encode_cursor(
            last["created_at"], last["run_id"], newest_first=newest_first))

    @_on_the_database
    def run_cursor(self, run_id: str, *, newest_first: bool,
                   principal: Principal = OPERATOR) -> str:
        """The cursor of a page that starts just past ``run_id`` (a task's id: its
        newest run) in the listing's order: `runs list --before/--after RUN_ID`."""
        run_id = self.run_id_of(run_id, principal=principal)
        position = views.run_position(self.store, run_id)
        if position is None:
            raise NotFound(f"no run {run_id!r}")
        return encode_cursor(position[0], position[1], newest_first=newest_first)

    # --- workers ----------------------------------------------------------------------

    @_on_the_database
    def workers(self, *, principal: Principal = OPERATOR,
                include_stopped: bool = False) -> list[WorkerView]:
        """Workers, newest first, each with the leases it holds now. Stopped workers
        only with ``include_stopped``. A tenant's principal: only the workers holding a
        lease of its runs, with only those leases (see the module docstring)."""
        return self._worker_views(principal, include_stopped=include_stopped)

    def _worker_views(self, principal: Principal, *, include_stopped: bool,
                      worker_id: str | None = None) -> list[WorkerView]:
        now, rows, leases = views.workers(self.store, include_stopped=include_stopped,
                                          worker_id=worker_id)
        held: dict[str, list[LeaseView]] = defaultdict(list)
        for lease in leases:
            if principal.sees(lease["tenant"]):
                held[lease["worker_id"]].append(LeaseView(
                    run_id=lease["run_id"], task_id=lease["task_id"],
                    tenant=lease["tenant"], queue=lease["queue"], status=lease["status"],
                    attempt_no=lease["attempt_no"], fencing_token=lease["fencing_token"],
                    started_at=timestamp(lease["started_at"]),
                    lease_expires_at=timestamp(lease["lease_expires_at"])))
        found = []
        for row in rows:
            if principal.tenant is not None and not held.get(row["worker_id"]):
                continue
            mine = held.get(row["worker_id"], [])
            found.append(WorkerView(
                worker_id=row["worker_id"], status=row["status"], version=row["version"],
                queues=list(row["queues"]), capabilities=dict(row["capabilities"]),
                started_at=timestamp(row["started_at"]),
                heartbeat_at=timestamp(row["heartbeat_at"]),
                heartbeat_age_seconds=_age(now, row["heartbeat_at"]) or 0.0,
                drain_requested_at=timestamp(row["drain_requested_at"]),
                leases_held=len(mine), leases=mine))
        return found

    @_on_the_database
    def drain_worker(self, worker_id: str, *, principal: Principal = OPERATOR) -> WorkerView:
        """Ask a worker to drain: it sees the request at its next heartbeat and drains
        as on SIGTERM (no new claims; its runs finish within the grace period, else
        their leases are given back for retry). Repeating it changes nothing."""
        require_operator(principal, "drain a worker")
        if not (isinstance(worker_id, str) and worker_id and "\x00" not in worker_id):
            raise NotFound(f"no worker {worker_id!r}")
        views.request_drain(self.store, worker_id)
        [found] = self._worker_views(principal, include_stopped=True, worker_id=worker_id)
        return found

    # --- queues, tenants, limits ------------------------------------------------------

    @_on_the_database
    def queues(self, *, principal: Principal = OPERATOR) -> list[QueueView]:
        """Every queue with runs (a tenant's principal: with its runs), by name: its
        backlog from the lanes' counters, the age of its oldest ready run, its active
        runs and its limits. The cost grows with lanes and running attempts, not runs."""
        occ = views.occupancy(self.store)
        _, policy = self.store.current_policy()
        queued: dict[str, int] = defaultdict(int)
        oldest: dict[str, float] = {}
        active: dict[str, int] = defaultdict(int)
        names: set[str] = set()
        for lane in occ.lanes:
            if not principal.sees(lane["tenant"]):
                continue
            names.add(lane["queue"])
            queued[lane["queue"]] += int(lane["queued_count"])
            at = lane["oldest_ready_at"]
            if at is not None:
                oldest[lane["queue"]] = min(float(at), oldest.get(lane["queue"], math.inf))
        for row in occ.active:
            if principal.sees(row["tenant"]):
                names.add(row["queue"])
                active[row["queue"]] += int(row["active"])
        if principal.tenant is None:
            names |= set(policy.concurrency.per_queue_max_active)
        found = []
        for queue in sorted(names):
            limits = []
            max_active = policy.concurrency.per_queue_max_active.get(queue)
            if max_active is not None:
                counted = occ.counters.get(f"queue:{queue}")
                limits.append(_limit_view(f"queue:{queue}", max_active,
                                          counted[0] if counted else active[queue], principal))
            found.append(QueueView(
                queue=queue, queued=queued[queue],
                oldest_ready_age_seconds=_age(occ.now, oldest.get(queue)),
                active=active[queue], limits=limits))
        return found

    @_on_the_database
    def tenants(self, *, principal: Principal = OPERATOR) -> list[TenantView]:
        """Every tenant with runs, spend today or terms in the policy (a tenant's
        principal: its own only), by name: backlog, oldest ready age, active runs
        against its limit, fair-share weight, spend today against its daily budget."""
        occ = views.occupancy(self.store)
        _, policy = self.store.current_policy()
        queued: dict[str, int] = defaultdict(int)
        oldest: dict[str, float] = {}
        active: dict[str, int] = defaultdict(int)
        for lane in occ.lanes:
            queued[lane["tenant"]] += int(lane["queued_count"])
            at = lane["oldest_ready_at"]
            if at is not None:
                oldest[lane["tenant"]] = min(float(at), oldest.get(lane["tenant"], math.inf))
        for row in occ.active:
            active[row["tenant"]] += int(row["active"])
        if principal.tenant is not None:
            names = {principal.tenant}
        else:
            names = set(queued) | set(active) | set(occ.spend_today) | set(policy.tenants)
        # Fair share: a tenant's weight over the weights of the tenants with a run ready
        # now (the free slots' sharing, docs/policy.md); null for a tenant's principal,
        # to whom it would tell the others' weights.
        total = sum(policy.tenant_weight(t) for t in oldest)
        return [self._tenant_view(t, policy, occ, queued[t], oldest.get(t), active[t],
                                  principal).model_copy(update={"fair_share": (
                                      policy.tenant_weight(t) / total
                                      if principal.tenant is None and t in oldest else None)})
                for t in sorted(names)]

    @staticmethod
    def _tenant_view(tenant: str, policy: Policy, occ: views.Occupancy, queued: int,
                     oldest: float | None, active: int, principal: Principal) -> TenantView:
        terms = policy.tenants.get(tenant)
        max_active = policy.tenant_max_active(tenant)
        limits = []
        if max_active is not None:
            counted = occ.counters.get(f"tenant:{tenant}")
            limits.append(_limit_view(f"tenant:{tenant}", max_active,
                                      counted[0] if counted else active, principal))
        return TenantView(
            tenant=tenant, queued=queued, oldest_ready_age_seconds=_age(occ.now, oldest),
            active=active, max_active=max_active,
            max_queued=terms.max_queued if terms else None,
            weight=policy.tenant_weight(tenant),
            spent_today_usd=occ.spend_today.get(tenant, 0.0),
            daily_budget_usd=terms.daily_model_budget_usd if terms else None,
            limits=limits)

    @_on_the_database
    def limits(self, *, principal: Principal = OPERATOR) -> list[LimitView]:
        """Every concurrency limit that counts runs now (one counter per limited scope
        a run has met) and the policy's named ones, with the runs each counts. A
        tenant's principal: its own tenant's limit only."""
        occ = views.occupancy(self.store)
        _, policy = self.store.current_policy()
        scopes = dict(occ.counters)
        named: dict[str, int | None] = {
            "global": policy.concurrency.global_max_active,
            **{f"queue:{q}": m for q, m in policy.concurrency.per_queue_max_active.items()},
            **{f"risk:{k}": m for k, m in policy.concurrency.per_risk_class_max_active.items()},
            **{f"tenant:{t}": policy.tenant_max_active(t) for t in policy.tenants}}
        for scope, max_active in named.items():
            if max_active is not None and scope not in scopes:
                scopes[scope] = (0, max_active)
        if principal.tenant is not None:
            mine = f"tenant:{principal.tenant}"
            max_active = policy.tenant_max_active(principal.tenant)
            if mine not in scopes and max_active is not None:
                scopes[mine] = (0, max_active)
            scopes = {s: v for s, v in scopes.items() if s == mine}
        return [_limit_view(scope, max_active, active, principal)
                for scope, (active, max_active) in sorted(scopes.items())]

    # --- policy -----------------------------------------------------------------------

    @_on_the_database
    def policy(self, *, principal: Principal = OPERATOR) -> PolicyView:
        """The policy in force: its document for a principal of no tenant; a tenant's
        principal gets the version and its own terms (the document names the others)."""
        record = self.store.policy_record()
        version = int(record["version"]) if record else 0
        created_at = timestamp(record["created_at"]) if record else None
        if principal.tenant is None:
            return PolicyView(
                version=version, created_at=created_at,
                digest=record["digest"] if record else None,
                source=record["source"] if record else None,
                document=record["policy"] if record else None)
        _, policy = self.store.current_policy()
        tenant = principal.tenant
        terms = policy.tenants.get(tenant)
        return PolicyView(version=version, created_at=created_at, tenant_limits=TenantLimits(
            tenant=tenant, known=terms is not None,
            admitted=terms is not None or policy.allow_unknown_tenants,
            weight=policy.tenant_weight(tenant), max_active=policy.tenant_max_active(tenant),
            max_queued=terms.max_queued if terms else None,
            daily_budget_usd=terms.daily_model_budget_usd if terms else None,
            allowed_risk_classes=(list(terms.allowed_risk_classes)
                                  if terms and terms.allowed_risk_classes is not None
                                  else None)))

    @_on_the_database
    def policy_versions(self, *, principal: Principal = OPERATOR) -> list[PolicyVersionView]:
        """Every stored version, newest first; digests and sources (file names on the
        operator's machine) for a principal of no tenant only."""
        rows = views.policy_versions(self.store)
        in_force = max((int(r["version"]) for r in rows), default=0)
        everything = principal.tenant is None
        return [PolicyVersionView(
            version=int(r["version"]), created_at=timestamp(r["created_at"]),
            in_force=int(r["version"]) == in_force,
            digest=r["digest"] if everything else None,
            source=r["source"] if everything else None,
            backlog_admitted_at=timestamp(r["backlog_admitted_at"]) if everything else None)
            for r in rows]
