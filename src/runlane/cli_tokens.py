"""``runlane tokens create|list|revoke``: the HTTP API's bearer tokens. The CLI holds
the database's own credentials, so it is the operator: it may make any token."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from runlane.api import KIND_NAMES
from runlane.cli_common import _lane, json_flag, out
from runlane.cli_output import Col, chosen_output, output_options, print_json, render
from runlane.domain.tasks import TaskInvalid
from runlane.domain.tokens import parse_expiry
from runlane.errors import NotFound


@click.group("tokens")
def tokens_group() -> None:
    """API tokens: a tenant's read, submit or approve token, or an admin token
    (docs/api-access.md)."""


@tokens_group.command("create")
@click.option("--tenant", help="The tenant the token sees and writes for (not for admin).")
@click.option("--role", required=True,
              type=click.Choice(["read", "submit", "approve", "admin"]),
              help="read: looks only; submit: also submits, cancels and retries; "
              "approve: also approves or rejects runs an approval gate holds; "
              "admin: the operator, every tenant.")
@click.option("--expires", "expires",
              help="A duration from now (30d, 12h, 45m) or an ISO date (2027-01-31); "
              "default: never.")
@click.option("--name", help="A label for `tokens list` (who or what holds it).")
@json_flag
def tokens_create(tenant: str | None, role: str, expires: str | None, name: str | None,
                  as_json: bool) -> None:
    """Create a token and print its secret, this once: only its hash is kept."""
    expires_at = None
    if expires is not None:
        try:
            expires_at = parse_expiry(expires, datetime.now(UTC))
        except ValueError as exc:
            raise TaskInvalid("--expires", str(exc)) from None
    if role == "admin" and tenant is not None:
        raise TaskInvalid("--tenant", "an admin token is for every tenant: give no --tenant")
    if role != "admin" and tenant is None:
        raise TaskInvalid("--tenant", f"is required for a {role} token")
    with _lane() as lane:
        created = lane.create_token(role=role, tenant=tenant, expires_at=expires_at,
                                    name=name)
    if as_json:
        print_json(created.model_dump(mode="json"))
        return
    info = created.info
    click.echo(created.token)
    click.echo(f"token {info.token_id}: {info.role} for "
               f"{info.tenant or 'every tenant'}"
               + (f", expires {_shown(info.expires_at)}" if info.expires_at else "")
               + " (shown once: store it now)", err=True)


@tokens_group.command("list")
@output_options
def tokens_list(output: str | None, as_json: bool) -> None:
    """Every token with its state (active, revoked, expired); never a secret."""
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        tokens = lane.tokens()
    columns = (
        Col("id", lambda t: t.token_id, ident=True, key="token_id"),
        Col("tenant", lambda t: t.tenant or "*"),
        Col("role", lambda t: t.role),
        Col("state", lambda t: t.state),
        Col("name", lambda t: t.name, drop=3),
        Col("created", lambda t: t.created_at, drop=2, key="created_at"),
        Col("expires", lambda t: t.expires_at, drop=1, key="expires_at"),
        Col("last used", lambda t: t.last_used_at, drop=4, key="last_used_at"),
    )
    render(tokens, columns, fmt, json_document=lambda: [t.model_dump(mode="json")
                                                        for t in tokens],
           empty="no tokens (`runlane tokens create` makes one)", console=out)


@tokens_group.command("revoke")
@click.argument("token_id")
@json_flag
def tokens_revoke(token_id: str, as_json: bool) -> None:
    """Revoke a token: its next request is refused (401)."""
    with _lane() as lane:
        try:
            info = lane.revoke_token(token_id)
        except NotFound as exc:
            found = lane.identify(token_id)  # a run's id, say: name what it is
            if found is None or found.kind == "token":
                raise
            raise NotFound(f"{exc}: it is {KIND_NAMES[found.kind]} id, not a token's"
                           ) from None
    if as_json:
        print_json(info.model_dump(mode="json"))
    else:
        out.print(f"token {info.token_id} revoked at {_shown(info.revoked_at)}")


def _shown(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).isoformat(timespec="seconds")
