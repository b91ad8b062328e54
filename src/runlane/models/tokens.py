"""API tokens as the facade returns them (``Runlane.create_token``, ``tokens``,
``revoke_token``): never the secret, except once in ``CreatedToken.token``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from runlane.models.runs import Timestamp


class TokenInfo(BaseModel):
    """A token as stored: who it is for and whether it still works."""

    model_config = ConfigDict(frozen=True)

    token_id: str
    tenant: str | None  # None: every tenant (an admin token)
    role: Literal["read", "submit", "approve", "admin"]
    name: str | None
    created_at: Timestamp
    expires_at: Timestamp | None
    revoked_at: Timestamp | None
    last_used_at: Timestamp | None
    state: Literal["active", "revoked", "expired"]


class CreatedToken(BaseModel):
    """A new token: ``token`` is the secret, shown this once; only its hash is kept."""

    model_config = ConfigDict(frozen=True)

    token: str
    info: TokenInfo
