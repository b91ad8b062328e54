"""The dashboard's campaign pages in a real browser (Debian's chromium via Playwright,
a real ``runlane serve`` on each engine): progress, the pause/resume/stop buttons,
another tenant's and a read token's view, no horizontal scroll at 390 px."""

from __future__ import annotations

import re
from typing import Any

import pytest

from .test_dashboard_browser import (  # noqa: F401 - the fixtures, shared
    NARROW,
    Served,
    _shot,
    _sign_in,
    browser,
    open_page,
    served,
)

pytestmark = [pytest.mark.xdist_group("browser"), pytest.mark.slow]

CAMPAIGN = """
name = "bump-lib"
tenant = "acme"
prompt = "bump {repo}"
[[targets]]
repo = "https://git.example.com/acme/a-rather-long-repository-name-for-a-phone.git"
[[targets]]
repo = "https://git.example.com/acme/b.git"
[rollout]
canary = 1
"""


def _status(page: Any) -> str:
    return str(page.locator("#campaign-status").inner_text())


def test_campaign_page_progress_and_buttons(open_page: Any, served: Served) -> None:  # noqa: F811
    served.lane.create_campaign(text=CAMPAIGN)
    served.lane.store.campaign_pass()
    page = open_page(NARROW)
    _sign_in(page, served.tokens["acme"])
    page.goto("/campaigns")
    page.click("text=bump-lib")
    page.wait_for_url(re.compile(r".*/campaigns/acme/bump-lib$"))
    assert _status(page) == "ACTIVE"
    assert page.locator("#batch-0").inner_text().split()[:2] == ["canary", "1"]
    width, client = page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert width <= client, f"the campaign page scrolls sideways: {width} > {client}"
    _shot(page, "campaign-390", served)
    page.click("#campaign-pause")
    page.wait_for_url(re.compile(r".*\?notice=pause$"))
    assert _status(page) == "PAUSED"
    assert served.lane.campaign("bump-lib")["status"] == "PAUSED"
    page.click("#campaign-resume")
    page.wait_for_url(re.compile(r".*\?notice=resume$"))
    assert _status(page) == "ACTIVE"

    other = open_page()
    _sign_in(other, served.tokens["globex"])
    other.goto("/campaigns")
    assert "bump-lib" not in other.content()
    answer = other.goto("/campaigns/acme/bump-lib")
    assert answer is not None and answer.status == 404
    reader = open_page()
    _sign_in(reader, served.tokens["acme-read"])
    reader.goto("/campaigns/acme/bump-lib")
    assert _status(reader) == "ACTIVE"
    assert reader.locator("form[action$='/action']").count() == 0  # no buttons

    page.click("#campaign-stop")
    page.wait_for_url(re.compile(r".*\?notice=stop$"))
    assert _status(page) == "STOPPED"
    assert served.lane.campaign("bump-lib")["by_state"]["CANCELLED"] == 2
    _shot(page, "campaign-stopped-390", served)
