"""The dashboard's campaign pages: the list, and one campaign's progress (by state and
by batch, the stop rule's window, failed runs) with its pause, resume, stop and
retry-failed buttons. Through the facade with the session's principal, as the API."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import Form, Request
from starlette.responses import Response

from runlane.domain.access import Principal
from runlane.errors import NotFound
from runlane.http.dashboard.pages import NOTICES, _context, _form, _lane, _view, router
from runlane.http.dashboard.render import page

ACTIONS = ("pause", "resume", "stop", "retry-failed")
NOTICES.update({
    "pause": "Campaign paused: nothing more is dispatched; its queued runs are held.",
    "resume": "Campaign resumed.",
    "stop": "Campaign stopped: its queued runs are cancelled; running runs finish.",
    "retry-failed": "Failed targets will run again.",
})


def campaign_url(tenant: str, name: str) -> str:
    return f"/campaigns/{quote(tenant, safe='')}/{quote(name, safe='/')}"


@router.get("/campaigns")
def campaigns(request: Request) -> Response:
    def build(who: Principal, token: str) -> Response:
        found = _lane(request).campaigns(principal=who)
        for c in found:
            c["url"] = campaign_url(c["tenant"], c["name"])
        return page("campaigns.html", **_context(request, who, token, campaigns=found))
    return _view(request, build)


@router.get("/campaigns/{tenant}/{name:path}")
def campaign(request: Request, tenant: str, name: str) -> Response:
    def build(who: Principal, token: str) -> Response:
        shown = _lane(request).campaign(name, tenant=tenant, principal=who)
        status = shown["status"]
        can = who.can_submit
        buttons = [a for a, ok in (("pause", status == "ACTIVE"), ("resume", status == "PAUSED"),
                                   ("stop", status in ("ACTIVE", "PAUSED")),
                                   ("retry-failed", bool(shown["by_state"]["FAILED"])))
                   if can and ok]
        return page("campaign.html", **_context(
            request, who, token, c=shown, buttons=buttons,
            action_url=f"/campaigns/{quote(tenant, safe='')}/-/action"))
    return _view(request, build)


@router.post("/campaigns/{tenant}/-/action")
def campaign_action(request: Request, tenant: str,
                    name: Annotated[str, Form(max_length=128)] = "",
                    action: Annotated[str, Form(max_length=20)] = "",
                    csrf: Annotated[str | None, Form(max_length=200)] = None) -> Response:
    def act(who: Principal) -> str:
        if action not in ACTIONS:
            raise NotFound(f"no campaign action {action!r}")
        lane = _lane(request)
        getattr(lane, f"{action.replace('-', '_')}_campaign")(name, tenant=tenant,
                                                               principal=who)
        return f"{campaign_url(tenant, name)}?notice={action}"
    return _form(request, csrf, act)
