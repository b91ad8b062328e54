"""Reads of what happened lately, for ``runlane top`` (the facade's ``claim_rates`` and
``failures``, api_activity.py): claims per queue and tenant in a recent window, and the
newest failure events. Plain rows out; the facade scopes them to a principal. The
statements are in store/activity_sql.py; each reads a bounded number of index entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runlane.store import activity_sql as asql

if TYPE_CHECKING:
    from runlane.store.store import Store


@dataclass(frozen=True)
class Claims:
    """Claims counted in ``[now - window, now]``, at most ``cap`` of them (``rows``: one
    per queue and tenant)."""

    now: float
    rows: list[dict[str, Any]]  # queue, tenant, claims, oldest

    @property
    def total(self) -> int:
        return sum(int(r["claims"]) for r in self.rows)

    @property
    def oldest(self) -> float | None:
        return min((float(r["oldest"]) for r in self.rows), default=None)


def claims(store: Store, *, window_seconds: float, cap: int) -> Claims:
    with store.reads.connect() as conn:
        now = float(conn.execute(store._q(asql.NOW), {"now": store.clock.now()}).scalar_one())
        rows = [dict(r._mapping) for r in conn.execute(
            store._q(asql.CLAIMS_SINCE), {"since": now - window_seconds, "cap": cap})]
    return Claims(now, rows)


def failures(store: Store, *, limit: int, tenant: str | None, scan: int
             ) -> list[dict[str, Any]]:
    """The newest ``limit`` failure events (of ``tenant`` only: among the newest ``scan``
    of every tenant), newest first, each with its run's task, tenant, repo and queue."""
    with store.reads.connect() as conn:
        if tenant is None:
            found = conn.execute(store._q(asql.FAILURES), {"scan": limit})
        else:
            found = conn.execute(store._q(asql.TENANT_FAILURES),
                                 {"scan": scan, "limit": limit, "tenant": tenant})
        return [dict(r._mapping) for r in found]
