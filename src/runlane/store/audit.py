"""The audit: runlane's invariants checked on a live database (``audit_sql``,
``maintenance_sql.AUDIT_CHECKS``)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from sqlalchemy import Connection, text

from runlane.domain.states import RunStatus, is_allowed
from runlane.store import audit_sql
from runlane.store import maintenance_sql as msql
from runlane.store.core import StoreCore
from runlane.store.lanes import BLOCKED_LANE_RECHECK_SECONDS
from runlane.store.records import Violation

S = RunStatus


class AuditMixin(StoreCore):
    """The audit (``Store.audit``)."""

    # --- audit --------------------------------------------------------------------

    def audit(self) -> list[Violation]:
        """Check runlane's invariants on the live database."""
        found: list[Violation] = []
        params = {"now": self.clock.now(), "recheck": BLOCKED_LANE_RECHECK_SECONDS,
                  "max_uncharged_releases": self.max_uncharged_releases}
        with self.reads.connect() as conn:
            for check, statement in {**audit_sql.AUDIT_CHECKS, **msql.AUDIT_CHECKS}.items():
                used = {k: v for k, v in params.items() if f":{k}" in statement
                        or (k == "now" and "{now}" in statement)}
                for r in conn.execute(self._q(statement), used):
                    found.append(Violation(check, r.run_id, r.detail,
                                           lane_id=r._mapping.get("lane_id")))
            found.extend(self._audit_slots(conn))
            for r in conn.execute(text(audit_sql.AUDIT_TRANSITIONS)):
                source = S(r.from_status) if r.from_status else None
                if not is_allowed(source, S(r.to_status)):
                    found.append(Violation(
                        "illegal_transition", r.run_id,
                        f"{r.from_status} -> {r.to_status} ({r.n} event(s))"))
        return found

    def _audit_slots(self, conn: Connection) -> list[Any]:
        """Each counter must equal the slots live attempts hold in its scope. (A scope
        without a counter is no longer limited: attempts claimed while it was may
        still hold it; a counter made for it again starts at what they hold.)"""
        from runlane.store.records import Violation

        counters: dict[str, int] = {}
        held: Counter[str] = Counter()
        for r in conn.execute(self._q(audit_sql.AUDIT_SLOTS)):
            if r.scope is not None:
                counters[r.scope] = int(r.active)
            else:
                held.update(json.loads(r.held))
        return [Violation("slot_count_drift", None,
                          f"counter {counters[scope]} but {held[scope]} held", scope=scope)
                for scope in sorted(counters) if counters[scope] != held[scope]]
