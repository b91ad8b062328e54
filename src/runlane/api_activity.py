"""The facade's recent activity (``Runlane`` inherits it): claims per queue in a recent
window and the latest failures, for ``runlane top`` and ``GET /v1/claim-rates``,
``GET /v1/failures``. Each is one bounded read (store/activity_sql.py: a walk of the
newest entries of an index of migration 0023), so a refresh every second costs the
same at a thousand runs as at millions.

Who sees what: a tenant's principal counts the claims of its own runs only (in the
queues it has runs in) and sees its own failures only, found among the newest
``FAILURE_SCAN`` failures of every tenant (the index holds no tenant)."""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from runlane.api_common import _invalid, _on_the_database
from runlane.domain.access import OPERATOR, Principal
from runlane.errors import redact_credentials
from runlane.models.top import ClaimRates, FailureView, QueueClaims
from runlane.store import activity

if TYPE_CHECKING:
    from runlane.store.store import Store

CLAIM_WINDOW_SECONDS = 60.0
MAX_CLAIM_WINDOW_SECONDS = 3600.0
# Claims one read counts at most; past it the rate is measured over the newest ones.
CLAIM_SAMPLE = 5000
MAX_FAILURES = 100
# The newest failures of every tenant among which a tenant's own are looked for.
FAILURE_SCAN = 1000
# A failure's message is cut to this many characters (the run's page has it whole).
MESSAGE_CHARS = 300


def _window(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not (math.isfinite(value) and 0 < value <= MAX_CLAIM_WINDOW_SECONDS):
        raise _invalid(f"window_seconds {value!r} is not a number of seconds in "
                       f"(0, {MAX_CLAIM_WINDOW_SECONDS:g}]")
    return float(value)


class ActivityMixin:
    """Claim rates and latest failures of the facade (``runlane.api.Runlane``)."""

    if TYPE_CHECKING:
        store: Store

    @_on_the_database
    def claim_rates(self, *, principal: Principal = OPERATOR,
                    window_seconds: float = CLAIM_WINDOW_SECONDS) -> ClaimRates:
        """Claims (QUEUED -> CLAIMED events) per queue over the last ``window_seconds``,
        or over the newest ``CLAIM_SAMPLE`` claims when more were made in the window."""
        window = _window(window_seconds)
        found = activity.claims(self.store, window_seconds=window, cap=CLAIM_SAMPLE)
        span = window
        oldest = found.oldest
        if found.total >= CLAIM_SAMPLE and oldest is not None:
            span = min(window, max(found.now - oldest, 1e-3))
        per_queue: dict[str, int] = defaultdict(int)
        for row in found.rows:
            if principal.sees(row["tenant"]):
                per_queue[row["queue"]] += int(row["claims"])
        return ClaimRates(window_seconds=window, span_seconds=span, queues=[
            QueueClaims(queue=q, claims=n, per_minute=n * 60.0 / span)
            for q, n in sorted(per_queue.items())])

    @_on_the_database
    def failures(self, *, principal: Principal = OPERATOR,
                 limit: int = 10) -> list[FailureView]:
        """The latest failures, newest first: attempts that failed (retried or not) and
        runs the policy denied, each with its reason code."""
        if isinstance(limit, bool) or not isinstance(limit, int) \
                or not 1 <= limit <= MAX_FAILURES:
            raise _invalid(f"limit {limit!r} is not an integer in 1..{MAX_FAILURES}")
        rows = activity.failures(self.store, limit=limit, tenant=principal.tenant,
                                 scan=FAILURE_SCAN)
        return [FailureView(
            run_id=r["run_id"], task_id=r["task_id"], tenant=r["tenant"],
            repo=redact_credentials(r["repo"]), queue=r["queue"],
            attempt_no=r["attempt_no"], status=r["to_status"], reason_code=r["reason_code"],
            message=(redact_credentials(r["message"])[:MESSAGE_CHARS]
                     if r["message"] else None),
            at=datetime.fromtimestamp(float(r["at"]), UTC)) for r in rows]
