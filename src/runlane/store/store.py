"""The one interface to the database, for SQLite and PostgreSQL alike.

Every method is one transaction. Status writes go through ``_set_status``, which
takes its compare-and-set guard from the transition table and records one event
per hop. Worker writes carry the lease's fencing token; when such a write
changes nothing the store says why (``LeaseLost`` or ``CancelRequested``).

``Store`` is this facade only: each concern is a mixin of its own module, each above
``core.StoreCore`` (the engine, the transaction, the status write) and
``records`` (what the store takes and returns):

* ``submit``: submits; ``claim``: the claim; ``lease``: heartbeat, completion and
  the other fenced writes of a lease, cancellation;
* ``lanes``: lanes and limit counters; ``routes``: routing; ``policy``: policy
  versions, admission records, budgets; ``scheduling``: the scheduler pass and
  dependencies;
* ``repairs``: the reaper and the reconciler; ``reads``: reads; ``audit``: the audit;
* ``maintenance``, ``evidence``, ``campaigns``: as before.
"""

from __future__ import annotations

from runlane.store.audit import AuditMixin
from runlane.store.campaigns import CampaignMixin
from runlane.store.claim import ClaimMixin
from runlane.store.evidence import EvidenceMixin
from runlane.store.lanes import LanesMixin
from runlane.store.lease import LeaseMixin
from runlane.store.maintenance import MaintenanceMixin
from runlane.store.policy import PolicyMixin
from runlane.store.reads import ReadsMixin
from runlane.store.repairs import RepairsMixin
from runlane.store.routes import RoutesMixin
from runlane.store.scheduling import SchedulingMixin
from runlane.store.submit import SubmitMixin


class Store(SubmitMixin, ClaimMixin, LeaseMixin, RepairsMixin, ReadsMixin, AuditMixin,
            SchedulingMixin, PolicyMixin, RoutesMixin, LanesMixin, MaintenanceMixin,
            EvidenceMixin, CampaignMixin):
    """The store: every operation on the database (see the module's docstring)."""
