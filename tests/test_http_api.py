"""The HTTP API through real HTTP against a real `runlane serve` process, on SQLite and
PostgreSQL: authentication on every route, tenant scoping (another tenant's ids are
404 and change nothing), `read` never writes, idempotent submit and its 409, keyset
pagination with equal timestamps, problem+json errors, health probes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from runlane.api import Runlane

from .http_support import Served, make_token, serve, wait_until

REPO = "/srv/git/app.git"
PROBLEM = "application/problem+json"


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    with serve(db_url, tmp_path) as server:
        yield server


def v1_routes(server: Served) -> list[tuple[str, str]]:
    """Every (method, path) of /v1 in the OpenAPI document, path parameters as "x"."""
    doc = httpx.get(f"{server.url}/openapi.json").json()
    routes = []
    for path, item in doc["paths"].items():
        if path.startswith("/v1/"):
            for method in item:
                routes.append((method.upper(), re.sub(r"\{[^}]+\}", "x", path)))
    assert len(routes) >= 15
    return sorted(routes)


def snapshot(database_url: str) -> dict[str, Any]:
    """What the database holds, for "nothing changed": every row of the tables a
    request could write, as text."""
    engine = create_engine(database_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            return {table: sorted(str(tuple(r)) for r in conn.execute(text(
                f"SELECT * FROM {table}")))
                    for table in ("tasks", "runs", "attempts", "run_events", "workers")}
    finally:
        engine.dispose()


def assert_problem(response: httpx.Response, status: int, reason: str | None = None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM), response.headers
    body = response.json()
    assert body["status"] == status
    assert {"type", "title", "detail", "reason_code", "exit_code"} <= body.keys()
    if reason is not None:
        assert body["reason_code"] == reason, body


POLICY = "[tenants.acme]\nweight = 2\n"


def body_for(method: str, path: str) -> Any:
    if path == "/v1/tasks":
        return {"tenant": "acme", "repo": REPO, "prompt": "p"}
    if path == "/v1/tasks/batch":
        return [{"tenant": "acme", "repo": REPO, "prompt": "p"}]
    if path == "/v1/tokens":
        return {"role": "read", "tenant": "acme"}
    if path == "/v1/policy":
        return {"policy": POLICY}
    return None


# --- no token / bad tokens ------------------------------------------------------------


def test_health_needs_no_token_and_readyz_says_when_the_schema_is_behind(
        served: Served) -> None:
    assert httpx.get(f"{served.url}/healthz").json()["status"] == "ok"
    assert httpx.get(f"{served.url}/readyz").json()["status"] == "ready"
    engine = create_engine(served.database_url.replace("postgresql://",
                                                       "postgresql+psycopg://"))
    try:
        with engine.begin() as conn:
            head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            conn.execute(text("UPDATE alembic_version SET version_num = '0017'"))
        try:
            readyz = httpx.get(f"{served.url}/readyz")
            assert_problem(readyz, 503, "SCHEMA_OUTDATED")
            assert httpx.get(f"{served.url}/healthz").status_code == 200  # still alive
        finally:
            with engine.begin() as conn:
                conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
    finally:
        engine.dispose()
    assert httpx.get(f"{served.url}/readyz").status_code == 200


def test_openapi_and_docs_are_served(served: Served) -> None:
    doc = httpx.get(f"{served.url}/openapi.json").json()
    assert doc["info"]["title"] == "runlane"
    assert "/v1/runs" in doc["paths"] and "/v1/events" in doc["paths"]
    assert "HTTPBearer" in doc["components"]["securitySchemes"]
    docs = httpx.get(f"{served.url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_every_v1_route_refuses_a_request_without_a_token(served: Served) -> None:
    before = snapshot(served.database_url)
    with served.client() as client:
        for method, path in v1_routes(served):
            for headers in ({}, {"Authorization": "Basic YWRtaW46YWRtaW4="},
                            {"Authorization": "Bearer"}):
                response = client.request(method, path, json=body_for(method, path),
                                          headers=headers)
                assert_problem(response, 401, "UNAUTHENTICATED")
                assert response.headers["www-authenticate"] == "Bearer", (method, path)
    assert snapshot(served.database_url) == before


def test_every_v1_route_refuses_an_unknown_revoked_or_expired_token(served: Served) -> None:
    db = served.database_url
    with Runlane(db) as lane:
        revoked = lane.create_token(role="admin", name="to-revoke")
        lane.revoke_token(revoked.info.token_id)
        expiring = lane.create_token(
            role="admin", expires_at=datetime.now(UTC) + timedelta(seconds=2)).token
    with served.client(expiring) as client:  # valid until it expires
        assert client.get("/v1/runs").status_code == 200
        wait_until(lambda: client.get("/v1/runs").status_code == 401, "the token's expiry")
    before = snapshot(db)
    for token in ("rl_unknown_token_0000", revoked.token, expiring):
        with served.client(token) as client:
            for method, path in v1_routes(served):
                response = client.request(method, path, json=body_for(method, path))
                assert_problem(response, 401, "UNAUTHENTICATED")
                assert token not in response.text
    assert snapshot(db) == before
    assert revoked.token not in served.stderr()  # failures are logged without the token


# --- tenants ----------------------------------------------------------------------------


def test_another_tenants_ids_answer_404_and_change_nothing(served: Served) -> None:
    db = served.database_url
    with Runlane(db) as lane:
        theirs = lane.submit("acme", REPO, "acme's task")
    globex_admin_of_nothing = make_token(db, "submit", "globex")
    before = snapshot(db)
    with served.client(globex_admin_of_nothing) as client:
        for method, path in [("GET", f"/v1/tasks/{theirs.task_id}"),
                             ("GET", f"/v1/runs/{theirs.run_id}"),
                             ("POST", f"/v1/tasks/{theirs.task_id}/cancel"),
                             ("POST", f"/v1/tasks/{theirs.task_id}/retry")]:
            response = client.request(method, path)
            assert_problem(response, 404, "NOT_FOUND")
            # The same answer as an id that does not exist at all.
            missing = client.request(method, path.replace(theirs.task_id, "nope")
                                     .replace(theirs.run_id, "nope"))
            assert missing.json()["detail"].replace("nope", "ID") == \
                response.json()["detail"].replace(theirs.task_id, "ID") \
                .replace(theirs.run_id, "ID")
        listed = client.get("/v1/runs").json()["items"]
        assert theirs.run_id not in {r["run_id"] for r in listed}
        events = client.get("/v1/events/page").json()["items"]
        assert theirs.run_id not in {e["run_id"] for e in events}
        # Submitting into another tenant is refused too, and writes nothing.
        response = client.post("/v1/tasks", json={"tenant": "acme", "repo": REPO,
                                                  "prompt": "sneak"})
        assert response.status_code in (403, 404), response.text
    assert snapshot(db) == before


def test_a_read_token_writes_nothing_anywhere(served: Served) -> None:
    db = served.database_url
    with Runlane(db) as lane:
        mine = lane.submit("acme", REPO, "acme's task")
        lane.cancel(lane.submit("acme", REPO, "done").task_id)
    read = make_token(db, "read", "acme")
    writes = [(m, p) for m, p in v1_routes(served) if m != "GET"]
    assert writes
    before = snapshot(db)
    with served.client(read) as client:
        for method, path in writes:
            path = path.replace("/x", f"/{mine.task_id}")
            response = client.request(method, path, json=body_for(method, path))
            assert_problem(response, 403, "FORBIDDEN")
        assert client.get(f"/v1/runs/{mine.run_id}").status_code == 200  # reads work
    assert snapshot(db) == before


def test_only_an_admin_of_every_tenant_applies_a_policy(served: Served) -> None:
    db = served.database_url
    before = snapshot(db)
    for token in (make_token(db, "read", "acme"), make_token(db, "submit", "acme")):
        with served.client(token) as client:
            assert_problem(client.post("/v1/policy", json={"policy": POLICY}), 403,
                           "FORBIDDEN")
            assert_problem(client.get("/v1/audit"), 403, "FORBIDDEN")
    assert snapshot(db) == before
    with served.client(make_token(db, "admin")) as client:
        bad = client.post("/v1/policy", json={"policy": "[tenants.acme]\nweight = -1\n"})
        assert_problem(bad, 422, "POLICY_INVALID")
        assert "weight" in bad.json()["detail"]
        applied = client.post("/v1/policy", json={"policy": POLICY, "source": "ci.toml"})
        assert applied.status_code == 200 and applied.json()["created"], applied.text
        again = client.post("/v1/policy", json={"policy": POLICY}).json()
        assert (again["version"], again["created"]) == (applied.json()["version"], False)
        shown = client.get("/v1/policy").json()
        assert (shown["version"], shown["source"]) == (applied.json()["version"], "ci.toml")
    with Runlane(db) as lane:  # the CLI's path: the same facade call
        assert lane.policy().version == applied.json()["version"]


# --- submit -------------------------------------------------------------------------


def test_submit_is_idempotent_by_key_and_a_different_body_is_a_409(served: Served) -> None:
    token = make_token(served.database_url, "submit", "acme")
    task = {"repo": REPO, "prompt": "fix it", "idempotency_key": "k-1"}
    with served.client(token) as client:
        first = client.post("/v1/tasks", json=task)
        assert first.status_code == 201, first.text
        again = client.post("/v1/tasks", json=task)
        assert again.status_code == 200, again.text
        assert (again.json()["task_id"], again.json()["run_id"]) == \
            (first.json()["task_id"], first.json()["run_id"])
        before = snapshot(served.database_url)
        conflict = client.post("/v1/tasks", json={**task, "prompt": "something else"})
        assert_problem(conflict, 409, "IDEMPOTENCY_CONFLICT")
        assert "k-1" in conflict.json()["detail"]
        assert snapshot(served.database_url) == before
        batch = client.post("/v1/tasks/batch", json=[
            {"repo": REPO, "prompt": "b1"}, {"repo": REPO, "prompt": "b2"}])
        assert batch.status_code == 201 and len(batch.json()) == 2


def test_bad_input_is_a_422_problem_naming_the_field(served: Served) -> None:
    token = make_token(served.database_url, "admin")
    with served.client(token) as client:
        assert_problem(client.post("/v1/tasks", json={"repo": REPO}), 422, "INVALID_ARGUMENT")
        bad = client.post("/v1/tasks", json={"tenant": "acme", "repo": REPO, "prompt": "p",
                                             "max_attempts": 0})
        assert_problem(bad, 422)
        assert "max_attempts" in bad.json()["detail"]
        assert_problem(client.post("/v1/tasks", content=b"{not json",
                                   headers={"content-type": "application/json"}), 422)
        assert_problem(client.get("/v1/events/page", params={"after": "nonsense"}), 422,
                       "INVALID_ARGUMENT")
        assert_problem(client.get("/v1/runs/nope"), 404, "NOT_FOUND")
        assert_problem(client.get("/v1/no-such-route"), 404)


# --- listing --------------------------------------------------------------------------


@pytest.mark.parametrize("newest_first", [True, False])
def test_keyset_pages_with_equal_timestamps_skip_and_repeat_nothing(
        served: Served, newest_first: bool) -> None:
    db = served.database_url
    with Runlane(db) as lane:
        runs = {s.run_id for s in lane.submit_batch(
            [{"tenant": "acme", "repo": REPO, "prompt": f"p{i}"} for i in range(7)])}
    engine = create_engine(db.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:  # one timestamp for all: every boundary is inside a tie
        conn.execute(text("UPDATE runs SET created_at = 1800000000.0"))
    engine.dispose()
    token = make_token(db, "read", "acme")
    seen: list[str] = []
    with served.client(token) as client:
        params: dict[str, Any] = {"limit": 3, "newest_first": newest_first}
        while True:
            page = client.get("/v1/runs", params=params)
            assert page.status_code == 200, page.text
            seen += [r["run_id"] for r in page.json()["items"]]
            if not page.json()["next"]:
                break
            params["cursor"] = page.json()["next"]
    assert len(seen) == len(set(seen)) == 7
    assert set(seen) == runs
