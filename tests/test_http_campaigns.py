"""Campaigns through the HTTP API (a real `runlane serve` process), on SQLite and
PostgreSQL: the same facade as the CLI; another tenant's token can neither see nor
change a campaign (404, nothing written); a read token changes nothing (403)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from .http_support import Served, make_token, serve

CAMPAIGN = """
name = "bump"
tenant = "acme"
prompt = "bump {repo}"
[[targets]]
repo = "/srv/git/a.git"
[[targets]]
repo = "/srv/git/b.git"
[rollout]
canary = 1
"""


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    with serve(db_url, tmp_path) as server:
        yield server


def campaigns_state(url: str) -> list[str]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            return sorted(str(tuple(r)) for table in ("campaigns", "campaign_targets")
                          for r in conn.execute(text(f"SELECT * FROM {table}")))
    finally:
        engine.dispose()


def test_campaigns_over_http_are_their_tenants_only(served: Served) -> None:
    db = served.database_url
    acme, globex = make_token(db, "submit", "acme"), make_token(db, "submit", "globex")
    reader = make_token(db, "read", "acme")
    with served.client(acme) as client:
        made = client.post("/v1/campaigns", json={"campaign": CAMPAIGN})
        assert made.status_code == 201, made.text
        assert (made.json()["created"], made.json()["targets"]) == (True, 2)
        again = client.post("/v1/campaigns", json={"campaign": CAMPAIGN})
        assert again.json()["created"] is False
        bad = client.post("/v1/campaigns", json={"campaign": CAMPAIGN + "[stop]\nwindow = 0\n"})
        assert bad.status_code == 422 and bad.json()["reason_code"] == "CAMPAIGN_INVALID"
        assert "request: stop.window:" in bad.json()["detail"]
        # A request never names a file of the server.
        sneaky = client.post("/v1/campaigns", json={"campaign": CAMPAIGN.replace(
            "[[targets]]\nrepo = \"/srv/git/a.git\"\n[[targets]]\nrepo = \"/srv/git/b.git\"\n",
            'targets_file = "/etc/passwd"\n')})
        assert sneaky.status_code == 422 and "targets_file" in sneaky.json()["detail"]
        assert [c["name"] for c in client.get("/v1/campaigns").json()] == ["bump"]
        shown = client.get("/v1/campaigns/bump").json()
        assert shown["by_state"]["PENDING"] == 2
        report = client.get("/v1/campaigns/bump/report")
        assert report.text.startswith("# Campaign bump (acme)")
    before = campaigns_state(db)
    with served.client(globex) as client:
        assert client.get("/v1/campaigns").json() == []
        for method, path in [("GET", "/v1/campaigns/bump"),
                             ("GET", "/v1/campaigns/bump?tenant=acme"),
                             ("GET", "/v1/campaigns/bump/report"),
                             ("POST", "/v1/campaigns/bump/pause"),
                             ("POST", "/v1/campaigns/bump/resume"),
                             ("POST", "/v1/campaigns/bump/stop"),
                             ("POST", "/v1/campaigns/bump/retry-failed?tenant=acme")]:
            response = client.request(method, path)
            assert response.status_code == 404, (method, path, response.text)
            assert response.json()["detail"] == "no campaign 'bump'"
        assert client.post("/v1/campaigns", json={"campaign": CAMPAIGN}).status_code == 403
    with served.client(reader) as client:
        assert client.get("/v1/campaigns/bump").status_code == 200
        for verb in ("pause", "resume", "stop", "retry-failed"):
            assert client.post(f"/v1/campaigns/bump/{verb}").status_code == 403
        assert client.post("/v1/campaigns", json={"campaign": CAMPAIGN}).status_code == 403
    assert campaigns_state(db) == before
    with served.client(acme) as client:
        assert client.post("/v1/campaigns/bump/pause").json()["status"] == "PAUSED"
        assert client.post("/v1/campaigns/bump/resume").json()["status"] == "ACTIVE"
        stopped = client.post("/v1/campaigns/bump/stop", params={"cancel_running": "true"})
        assert (stopped.json()["status"], stopped.json()["cancelled_running"]) == (
            "STOPPED", 0)
