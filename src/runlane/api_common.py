"""What the facade (api.py) and its parts (api_views.py, api_activity.py,
api_campaigns.py, api_approvals.py) share: the error of a bad argument, the check every
database call goes through, and how a database URL is shown. Below all of them, so the
parts never import api.py."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast
from urllib.parse import unquote

from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from runlane.errors import DatabaseUnavailable, RunlaneError

if TYPE_CHECKING:
    from runlane.store.store import Store

F = TypeVar("F", bound=Callable[..., Any])


class InvalidArgument(RunlaneError, ValueError):
    """A call's argument that the CLI would refuse as bad input (exit 2)."""

    exit_code = 2


def _invalid(message: str) -> RunlaneError:
    return InvalidArgument(message)


class _Lane(Protocol):
    """What ``_on_the_database`` needs of the facade (``runlane.api.Runlane``)."""

    _schema_checked: bool
    store: Store

    def check_schema(self) -> None: ...


def _first_line(exc: DBAPIError) -> str:
    return (str(exc.orig).strip().splitlines() or [type(exc.orig).__name__])[0]


def _on_the_database(method: F) -> F:
    """Check the schema on a lane's first use, and report a database that is down or
    unusable as runlane's DatabaseUnavailable (as the CLI does), not a driver error
    with the SQL in it. Errors of the data itself (a constraint, a bad value) pass."""

    @functools.wraps(method)
    def wrapper(self: _Lane, *args: Any, **kwargs: Any) -> Any:
        if not self._schema_checked:
            self.check_schema()
        try:
            return method(self, *args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            raise DatabaseUnavailable(
                f"database {shown_url(self.store.engine.url)}: {_first_line(exc)}") from exc

    return cast(F, wrapper)


def shown_url(url: URL) -> str:
    """The URL as the user wrote it, password hidden: SQLAlchemy's rendering
    percent-encodes the database part (``sqlite:///file%3A/...`` for ``file:/...``)."""
    return unquote(url.render_as_string(hide_password=True))
