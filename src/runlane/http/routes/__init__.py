"""The /v1 routes, one module per resource. Each route is thin: it calls exactly one
facade method (``runlane.api.Runlane``) with the request's principal and returns its
result, so the HTTP API and the CLI share one code path."""

from __future__ import annotations

import typing
from typing import Any

from runlane.api import Runlane


def returns(method: str) -> Any:
    """The return type of ``Runlane.<method>``: a route's response model is whatever the
    facade returns (a pydantic model of runlane.models), never a second definition."""
    return typing.get_type_hints(getattr(Runlane, method))["return"]
