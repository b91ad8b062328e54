"""Who is asking: a principal (a token's tenant and role, or the operator) and what it
may do. Pure: the facade checks every read and write against it; the HTTP API builds one
from a bearer token, the CLI (which holds the database's own credentials) is the operator.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from runlane.errors import Forbidden


class Role(StrEnum):
    """``read`` never writes; ``submit`` submits, cancels and retries its tenant's tasks;
    ``approve`` reads and approves or rejects its tenant's runs held by an approval
    gate (and submits nothing); ``admin`` is the operator: every tenant, the policy,
    workers and audit."""

    READ = "read"
    SUBMIT = "submit"
    APPROVE = "approve"
    ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    """A token's scope. ``tenant`` None means every tenant (an admin token, or the CLI)."""

    role: Role
    tenant: str | None = None
    token_id: str | None = None

    def sees(self, tenant: str) -> bool:
        """Whether this principal may know that a row of ``tenant`` exists (else: 404)."""
        return self.tenant is None or self.tenant == tenant

    @property
    def can_submit(self) -> bool:
        return self.role in (Role.SUBMIT, Role.ADMIN)

    @property
    def can_approve(self) -> bool:
        return self.role in (Role.APPROVE, Role.ADMIN)

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


# The CLI and the Python facade called without a principal: the database's own
# credentials, so every tenant and every operation.
OPERATOR = Principal(role=Role.ADMIN, tenant=None, token_id=None)


def require_operator(principal: Principal, what: str) -> None:
    """Refuse (Forbidden) unless ``principal`` is the operator: an admin of every tenant
    (tokens, policy apply, audit, draining workers)."""
    if not principal.is_admin or principal.tenant is not None:
        raise Forbidden(f"only an admin may {what}")
