"""API tokens: their secret's format, its hash, and when a token expires. Pure: the
store keeps the hash (never the secret), the facade compares.

A secret is ``rl_<token_id>_<random>``: the id finds the row in one index lookup
(no scan over hashes), the 32 random bytes are the secret. Only the SHA-256 of the
whole secret is stored; a secret is shown once, when the token is created.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from datetime import UTC, datetime, timedelta

from runlane.domain.access import Role

PREFIX = "rl"
_ID = re.compile(r"^[0-9a-f]{16}$")
_DURATION = re.compile(r"^(\d{1,6})([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# The one answer to every refused secret: which of unknown, revoked, expired or
# malformed it was would tell a guesser what to try next.
REFUSED = "invalid, revoked or expired token"


def new_token_id() -> str:
    """16 hex digits: short enough to type in ``tokens revoke``, never guessed twice."""
    return secrets.token_hex(8)


def new_secret(token_id: str) -> str:
    return f"{PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", errors="surrogatepass")).hexdigest()


def token_id_of(secret: str) -> str | None:
    """The id a secret claims, or None when it is not of the shape at all."""
    if not isinstance(secret, str):
        return None
    prefix, _, rest = secret.partition("_")
    token_id, _, random_part = rest.partition("_")
    if prefix != PREFIX or not _ID.match(token_id) or not random_part:
        return None
    return token_id


def hashes_match(secret: str, stored_hash: str) -> bool:
    """Constant time in the secret: a comparison that stops at the first different
    character tells a guesser how much of the hash it has right."""
    return hmac.compare_digest(secret_hash(secret), stored_hash)


def shown_id(token_id: str | None) -> str:
    """What a log line may say of a token id a caller claimed: its first 6 digits."""
    return (token_id or "")[:6]


def parse_role(value: str) -> Role:
    try:
        return Role(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"role {value!r} is not one of "
                         f"{', '.join(r.value for r in Role)}") from None


def parse_expiry(value: str, now: datetime) -> datetime:
    """``30d``, ``12h``, ``45m``, ``90s``, ``2w`` from ``now``; or an ISO 8601 date or
    time (``2027-01-31``: its start, UTC, unless the text names an offset). The
    result must lie in the future."""
    text = value.strip().lower()
    match = _DURATION.match(text)
    if match:
        seconds = int(match.group(1)) * _UNITS[match.group(2)]
        if seconds <= 0:
            raise ValueError(f"{value!r} is not in the future")
        return now + timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is neither a duration (30d, 12h, 45m) nor an ISO "
                         "date (2027-01-31)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when <= now:
        raise ValueError(f"{value!r} is not in the future")
    return when
