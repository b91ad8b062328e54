"""API tokens: created with their secret shown once, stored as a hash, refused with one
message when unknown, revoked, expired or tampered with, logged without the secret;
the CLI's `tokens create|list|revoke`. On both engines."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from structlog.testing import capture_logs

from runlane.api import InvalidArgument, Runlane
from runlane.clock import ManualClock
from runlane.domain.access import Principal, Role
from runlane.domain.tokens import REFUSED, parse_expiry, token_id_of
from runlane.errors import Forbidden, NotFound, RunlaneError, Unauthenticated

from .conftest import T0
from .support import cli_env, database_state, one_line_error


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def rows(lane: Runlane) -> list[Any]:
    with lane.store.engine.connect() as conn:
        return list(conn.execute(text("SELECT * FROM api_tokens")))


def test_a_token_authenticates_as_its_tenant_and_role_and_only_its_hash_is_stored(
        lane: Runlane, clock: ManualClock) -> None:
    created = lane.create_token(role="submit", tenant="acme", name="ci")
    secret = created.token
    assert secret.startswith(f"rl_{created.info.token_id}_") and len(secret) > 50
    assert (created.info.tenant, created.info.role, created.info.name, created.info.state) \
        == ("acme", "submit", "ci", "active")
    principal = lane.authenticate(secret)
    assert principal == Principal(role=Role.SUBMIT, tenant="acme",
                                  token_id=created.info.token_id)
    clock.advance(1)  # listed oldest first
    admin = lane.create_token(role="admin")
    assert lane.authenticate(admin.token) == Principal(role=Role.ADMIN, tenant=None,
                                                       token_id=admin.info.token_id)
    # Nowhere in the database: neither the secret nor its random part.
    random_part = secret.split("_", 2)[2]
    for row in rows(lane):
        assert not any(isinstance(v, str) and (random_part in v or v == secret) for v in row)
    assert all(len(r.secret_sha256) == 64 for r in rows(lane))
    listed = lane.tokens()
    assert [t.token_id for t in listed] == [created.info.token_id, admin.info.token_id]
    assert "token" not in listed[0].model_dump()


@pytest.mark.parametrize("spoil", ["unknown", "tampered", "malformed", "empty", "revoked",
                                   "expired", "not_text"])
def test_every_refused_token_gets_the_same_answer_and_a_log_line_without_it(
        lane: Runlane, clock: ManualClock, spoil: str) -> None:
    created = lane.create_token(role="read", tenant="acme",
                                expires_at=datetime.fromtimestamp(T0 + 3600, UTC))
    secret = created.token
    token_id = created.info.token_id
    presented: Any = {
        "unknown": f"rl_{'0' * 16}_{secret.split('_', 2)[2]}",
        "tampered": secret[:-1] + ("A" if secret[-1] != "A" else "B"),
        "malformed": "Bearer " + secret,
        "empty": "",
        "revoked": secret,
        "expired": secret,
        "not_text": secret + "\udcff",
    }[spoil]
    if spoil == "revoked":
        assert lane.revoke_token(token_id).state == "revoked"
    if spoil == "expired":
        assert lane.authenticate(secret).tenant == "acme"  # until it expires
        clock.advance(3600)
    with capture_logs() as logs, pytest.raises(Unauthenticated) as refused:
        lane.authenticate(presented)
    assert str(refused.value) == REFUSED
    assert isinstance(refused.value, RunlaneError) and refused.value.exit_code == 2
    [line] = [e for e in logs if e["event"] == "authentication_failed"]
    assert line["log_level"] == "warning"
    assert len(line["token_id_prefix"]) <= 6
    logged = repr(logs)
    assert secret.split("_", 2)[2][:8] not in logged and token_id not in logged


def test_a_revoked_token_stays_revoked_and_an_unknown_one_is_not_found(lane: Runlane,
                                                                       clock: ManualClock
                                                                       ) -> None:
    created = lane.create_token(role="submit", tenant="acme")
    first = lane.revoke_token(created.info.token_id)
    clock.advance(10)
    again = lane.revoke_token(created.info.token_id)
    assert first.revoked_at == again.revoked_at  # revoking twice keeps the first time
    with pytest.raises(NotFound, match="no token"):
        lane.revoke_token("0" * 16)


def test_use_is_recorded_at_most_once_a_minute(lane: Runlane, clock: ManualClock) -> None:
    created = lane.create_token(role="read", tenant="acme")
    assert created.info.last_used_at is None
    lane.authenticate(created.token)
    [used] = lane.tokens()
    assert used.last_used_at == datetime.fromtimestamp(T0, UTC)
    clock.advance(30)
    lane.authenticate(created.token)
    assert lane.tokens()[0].last_used_at == used.last_used_at
    clock.advance(31)
    lane.authenticate(created.token)
    assert lane.tokens()[0].last_used_at == datetime.fromtimestamp(T0 + 61, UTC)


@pytest.mark.parametrize("arguments, says", [
    ({"role": "admin", "tenant": "acme"}, "no tenant"),
    ({"role": "submit"}, "give its tenant"),
    ({"role": "read"}, "give its tenant"),
    ({"role": "owner", "tenant": "acme"}, "not one of"),
    ({"role": "read", "tenant": "no spaces"}, "not a tenant name"),
    ({"role": "read", "tenant": "acme", "name": ""}, "printable"),
    ({"role": "read", "tenant": "acme", "expires_at": datetime.fromtimestamp(T0 - 1, UTC)},
     "not in the future"),
])
def test_bad_token_requests_are_refused_and_write_nothing(lane: Runlane, db_url: str,
                                                          arguments: dict[str, Any],
                                                          says: str) -> None:
    before = database_state(db_url)
    with pytest.raises(InvalidArgument, match=says):
        lane.create_token(**arguments)
    assert database_state(db_url) == before


@pytest.mark.parametrize("principal", [Principal(Role.SUBMIT, "acme"), Principal(Role.READ, "acme"),
                                       Principal(Role.ADMIN, "acme")])
def test_only_an_admin_manages_tokens(lane: Runlane, db_url: str,
                                      principal: Principal) -> None:
    created = lane.create_token(role="read", tenant="acme")
    before = database_state(db_url)
    with pytest.raises(Forbidden):
        lane.create_token(role="admin", principal=principal)
    with pytest.raises(Forbidden):
        lane.tokens(principal=principal)
    with pytest.raises(Forbidden):
        lane.revoke_token(created.info.token_id, principal=principal)
    assert database_state(db_url) == before


def test_expiry_takes_a_duration_or_an_iso_date() -> None:
    now = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
    assert parse_expiry("30d", now) == now + timedelta(days=30)
    assert parse_expiry("12h", now) == now + timedelta(hours=12)
    assert parse_expiry("2027-01-31", now) == datetime(2027, 1, 31, tzinfo=UTC)
    assert parse_expiry("2027-01-31T08:00:00+02:00", now) == datetime(2027, 1, 31, 6,
                                                                       tzinfo=UTC)
    for bad in ("0d", "yesterday", "2020-01-01", "-5d", "30 days"):
        with pytest.raises(ValueError):
            parse_expiry(bad, now)
    assert token_id_of("rl_0123456789abcdef_x_y") == "0123456789abcdef"
    assert token_id_of("rl_0123456789ABCDEF_x") is None


def runlane(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=cli_env(tmp_path), timeout=60)


def test_the_cli_creates_lists_and_revokes_tokens(db_url: str, tmp_path: Path) -> None:
    made = runlane(db_url, tmp_path, "tokens", "create", "--tenant", "acme", "--role",
                   "submit", "--expires", "30d", "--name", "ci")
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()  # the secret alone on stdout, the rest on stderr
    assert token_id_of(secret) is not None and "shown once" in made.stderr
    as_json = runlane(db_url, tmp_path, "tokens", "create", "--role", "admin", "--json")
    assert as_json.returncode == 0, as_json.stderr
    admin = json.loads(as_json.stdout)
    assert admin["info"]["tenant"] is None and admin["token"].startswith("rl_")
    listed = runlane(db_url, tmp_path, "tokens", "list", "--json")
    tokens = json.loads(listed.stdout)
    assert [t["role"] for t in tokens] == ["submit", "admin"]
    assert secret not in listed.stdout and admin["token"] not in listed.stdout
    assert tokens[0]["expires_at"] is not None and tokens[0]["state"] == "active"
    revoked = runlane(db_url, tmp_path, "tokens", "revoke", token_id_of(secret) or "",
                      "--json")
    assert json.loads(revoked.stdout)["state"] == "revoked"
    with Runlane(db_url) as lane, pytest.raises(Unauthenticated):
        lane.authenticate(secret)
    one_line_error(runlane(db_url, tmp_path, "tokens", "revoke", "0" * 16), 3, "no token")


@pytest.mark.parametrize("args, says", [
    (("--role", "admin", "--tenant", "acme"), "no --tenant"),
    (("--role", "read"), "--tenant: is required"),
    (("--role", "read", "--tenant", "acme", "--expires", "soon"), "--expires"),
    (("--role", "read", "--tenant", "acme", "--expires", "2001-01-01"), "not in the future"),
])
def test_the_cli_refuses_bad_token_requests_in_one_line(db_url: str, tmp_path: Path,
                                                        args: tuple[str, ...],
                                                        says: str) -> None:
    before = database_state(db_url)
    one_line_error(runlane(db_url, tmp_path, "tokens", "create", *args), 2, says)
    assert database_state(db_url) == before
