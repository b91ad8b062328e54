"""Campaigns (as `runlane campaign ...`): create from the file's TOML text, list, show,
the Markdown report, pause, resume, stop, retry-failed. A tenant's token sees and
changes its own tenant's campaigns only; another tenant's is a 404."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from runlane.http.auth import Lane, Who

router = APIRouter(tags=["campaigns"])
Name = Annotated[str, Path(max_length=128)]
Tenant = Annotated[str | None, Query(max_length=128, description="The campaign's tenant "
                                     "(for an admin token, when two tenants use the name).")]


class CampaignRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    campaign: str = Field(max_length=8_000_000, description="The campaign file's TOML text, "
                          "its targets inline (no targets_file).")


@router.post("/campaigns", status_code=201)
def create_campaign(lane: Lane, who: Who, body: CampaignRequest | None = None
                    ) -> dict[str, Any]:
    return lane.create_campaign(text=None if body is None else body.campaign,
                                source="request", principal=who)


@router.get("/campaigns")
def campaigns(lane: Lane, who: Who) -> list[dict[str, Any]]:
    return lane.campaigns(principal=who)


@router.get("/campaigns/{name}")
def campaign(name: Name, lane: Lane, who: Who, tenant: Tenant = None) -> dict[str, Any]:
    return lane.campaign(name, tenant=tenant, principal=who)


@router.get("/campaigns/{name}/report", response_class=PlainTextResponse)
def campaign_report(name: Name, lane: Lane, who: Who, tenant: Tenant = None) -> str:
    return lane.campaign_report(name, tenant=tenant, principal=who)


@router.post("/campaigns/{name}/pause")
def pause_campaign(name: Name, lane: Lane, who: Who, tenant: Tenant = None) -> dict[str, Any]:
    return lane.pause_campaign(name, tenant=tenant, principal=who)


@router.post("/campaigns/{name}/resume")
def resume_campaign(name: Name, lane: Lane, who: Who, tenant: Tenant = None) -> dict[str, Any]:
    return lane.resume_campaign(name, tenant=tenant, principal=who)


@router.post("/campaigns/{name}/stop")
def stop_campaign(name: Name, lane: Lane, who: Who, tenant: Tenant = None,
                  cancel_running: bool = False) -> dict[str, Any]:
    """Stop; with ``cancel_running=true`` its running runs are cancelled too."""
    return lane.stop_campaign(name, tenant=tenant, cancel_running=cancel_running,
                              principal=who)


@router.post("/campaigns/{name}/retry-failed")
def retry_failed_campaign(name: Name, lane: Lane, who: Who, tenant: Tenant = None
                          ) -> dict[str, Any]:
    return lane.retry_failed_campaign(name, tenant=tenant, principal=who)
