"""API tokens (admin only, as `runlane tokens create|list|revoke`): a new token's secret
is in the creation's answer only; the database keeps its hash."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from runlane.http.auth import Lane, Who
from runlane.http.routes import returns

router = APIRouter(tags=["tokens"])


class TokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["read", "submit", "approve", "admin"]
    tenant: str | None = Field(None, description="The tenant of a read or submit token; "
                               "none for admin.")
    expires_at: datetime | None = None
    name: str | None = None


@router.post("/tokens", status_code=201, response_model=returns("create_token"))
def create_token(body: TokenRequest, lane: Lane, who: Who) -> Any:
    return lane.create_token(role=body.role, tenant=body.tenant, expires_at=body.expires_at,
                             name=body.name, principal=who)


@router.get("/tokens", response_model=returns("tokens"))
def tokens(lane: Lane, who: Who) -> Any:
    return lane.tokens(principal=who)


@router.post("/tokens/{token_id}/revoke", response_model=returns("revoke_token"))
def revoke_token(token_id: Annotated[str, Path(max_length=64)], lane: Lane, who: Who) -> Any:
    return lane.revoke_token(token_id, principal=who)
