"""API tokens in the database: create, list, revoke, and find one by id for a request.

Only a secret's SHA-256 is stored (domain/tokens.py). The time of every check is the
store's clock (the database's, unless a test pins it), as for leases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from runlane.errors import NotFound

if TYPE_CHECKING:
    from runlane.store.store import Store

TOKEN_COLUMNS = ("token_id, tenant, role, name, secret_sha256, created_at, expires_at, "
                 "revoked_at, last_used_at")
TOKEN_INSERT = """
INSERT INTO api_tokens (token_id, tenant, role, name, secret_sha256, created_at,
                        expires_at, revoked_at, last_used_at)
VALUES (:token_id, :tenant, :role, :name, :secret_sha256, {now}, :expires_at, NULL, NULL)
RETURNING """ + TOKEN_COLUMNS
TOKENS_ALL = "SELECT " + TOKEN_COLUMNS + " FROM api_tokens ORDER BY created_at, token_id"
# One token by its primary key, with the time to judge its expiry by.
TOKEN_BY_ID = ("SELECT " + TOKEN_COLUMNS
               + ", {now} AS now FROM api_tokens WHERE token_id = :token_id")
# Revoking twice keeps the first time.
TOKEN_REVOKE = """
UPDATE api_tokens SET revoked_at = COALESCE(revoked_at, {now}) WHERE token_id = :token_id
RETURNING """ + TOKEN_COLUMNS
# At most one write per token per minute: a request is a read, not a write on the
# token's row (which SQLite would serialise with every submit).
TOKEN_USED = """
UPDATE api_tokens SET last_used_at = :now
WHERE token_id = :token_id AND (last_used_at IS NULL OR last_used_at < :now - 60)
"""



def insert_token(store: Store, *, token_id: str, tenant: str | None, role: str,
                 name: str | None, secret_sha256: str,
                 expires_at: float | None) -> dict[str, Any]:
    def work(conn: Connection) -> dict[str, Any]:
        return dict(conn.execute(store._q(TOKEN_INSERT), {
            "token_id": token_id, "tenant": tenant, "role": role, "name": name,
            "secret_sha256": secret_sha256, "expires_at": expires_at,
            "now": store.clock.now()}).one()._mapping)

    return store._transaction(work)


def list_tokens(store: Store) -> tuple[list[dict[str, Any]], float]:
    """Every token, oldest first, and the time now (to say which have expired)."""
    with store.reads.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(store._q(TOKENS_ALL))]
        now = float(conn.execute(store._q("SELECT {now} AS now"),
                                 {"now": store.clock.now()}).scalar_one())
        return rows, now


def token_row(store: Store, token_id: str) -> dict[str, Any] | None:
    """The token and ``now`` (the time to judge it by), or None."""
    with store.reads.connect() as conn:
        row = conn.execute(store._q(TOKEN_BY_ID),
                           {"token_id": token_id, "now": store.clock.now()}).first()
        return None if row is None else dict(row._mapping)


def revoke_token_row(store: Store, token_id: str) -> dict[str, Any]:
    def work(conn: Connection) -> dict[str, Any]:
        row = conn.execute(store._q(TOKEN_REVOKE),
                           {"token_id": token_id, "now": store.clock.now()}).first()
        if row is None:
            raise NotFound(f"no token {token_id!r}")
        return dict(row._mapping)

    return store._transaction(work)


def token_used(store: Store, token_id: str, now: float) -> None:
    def work(conn: Connection) -> None:
        conn.execute(store._q(TOKEN_USED), {"token_id": token_id, "now": now})

    store._transaction(work, autocommit=True)
