"""``GET /metrics``: the Prometheus text exposition of this process and the database's
gauges (docs/metrics.md). An admin token's only: the figures are every tenant's (queues,
spend), so a tenant's token is refused (403) and a request without one is 401. A
Prometheus job sends the token with ``authorization: {credentials_file: ...}``."""

from __future__ import annotations

from fastapi import APIRouter, Response

from runlane.http import problems
from runlane.http.auth import Lane, Who

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={
    **{code: problems.COMMON[code] for code in (401, 403)},
    200: {"description": "The Prometheus text format (version 0.0.4).",
          "content": {"text/plain": {"schema": {"type": "string"}}}}})
def metrics(lane: Lane, who: Who) -> Response:
    body, content_type = lane.metrics(principal=who)
    return Response(body, media_type=content_type)
