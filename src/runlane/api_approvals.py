"""The facade's approval gates (``Runlane`` inherits it): the runs waiting for
approval, approve and reject. The CLI (cli_approvals.py) and the HTTP API
(http/routes/approvals.py) call these.

Who may do what: an ``approve`` or ``admin`` principal decides; a tenant's principal
sees and decides its own tenant's runs only (another tenant's run is answered as one
that does not exist); ``read`` and ``submit`` principals may list, never decide (a
submitter does not approve its own work).
"""

from __future__ import annotations

import getpass
from typing import TYPE_CHECKING

from runlane.api_common import InvalidArgument, _on_the_database
from runlane.domain.access import OPERATOR, Principal
from runlane.domain.tasks import valid_name
from runlane.errors import Forbidden, NotFound
from runlane.models.approvals import ApprovalResult, PendingApproval
from runlane.models.runs import timestamp
from runlane.store import approvals

if TYPE_CHECKING:
    from runlane.store.store import Store

MAX_NOTE = 2000


def _actor(principal: Principal, by: str | None) -> str:
    """Who decided: an API token by its id; the CLI by ``--by`` or the login name."""
    if principal.token_id is not None:
        return f"token:{principal.token_id}"
    if by is not None:
        return by
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no login name (a container's uid without a passwd entry)
        return "cli"


class ApprovalsMixin:
    """Approval gates of the facade (``runlane.api.Runlane``)."""

    if TYPE_CHECKING:
        store: Store

    @_on_the_database
    def approvals(self, *, tenant: str | None = None, limit: int = 500,
                  principal: Principal = OPERATOR) -> list[PendingApproval]:
        """Runs waiting for approval, oldest first; a tenant's principal sees its own."""
        if tenant is not None and not (isinstance(tenant, str) and valid_name(tenant)):
            raise InvalidArgument(f"tenant {tenant!r} is not a tenant name")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
            raise InvalidArgument(f"limit {limit!r} is not an integer in 1..10000")
        if principal.tenant is not None:
            if tenant is not None and tenant != principal.tenant:
                return []
            tenant = principal.tenant
        rows = approvals.pending_approvals(self.store, tenant=tenant, limit=limit)
        return [PendingApproval.model_validate(
            {**r, "created_at": timestamp(r["created_at"]),
             "expires_at": timestamp(r["expires_at"])}) for r in rows]

    def approve(self, run_id: str, *, note: str | None = None, by: str | None = None,
                principal: Principal = OPERATOR) -> ApprovalResult:
        """Approve a run waiting for approval: it is admitted again under the policy in
        force (queued, deferred or denied). Approving it again changes nothing."""
        return self._decide(run_id, True, note, by, principal)

    def reject(self, run_id: str, *, note: str | None = None, by: str | None = None,
               principal: Principal = OPERATOR) -> ApprovalResult:
        """Reject a run waiting for approval: it ends POLICY_DENIED (APPROVAL_REJECTED)
        and never starts. Rejecting it again changes nothing."""
        return self._decide(run_id, False, note, by, principal)

    @_on_the_database
    def _decide(self, run_id: str, approve: bool, note: str | None, by: str | None,
                principal: Principal) -> ApprovalResult:
        verb = "approve" if approve else "reject"
        if not isinstance(run_id, str) or not run_id or len(run_id) > 64:
            raise NotFound(f"no run {run_id!r}")
        if note is not None and not (isinstance(note, str) and len(note) <= MAX_NOTE):
            raise InvalidArgument(f"note must be text of at most {MAX_NOTE} characters")
        if by is not None and not (isinstance(by, str) and 0 < len(by) <= 255
                                   and by.isprintable()):
            raise InvalidArgument("by must be 1-255 printable characters")
        if not principal.can_approve:  # refused before any lookup: it tells nothing
            raise Forbidden(f"a {principal.role.value} token may not {verb} runs")
        done = approvals.decide_approval(self.store, run_id, approve=approve,
                                         actor=_actor(principal, by), note=note or None,
                                         tenant=principal.tenant)
        return ApprovalResult.model_validate(
            {**done.to_json(), "decided_at": timestamp(done.decided_at)})
