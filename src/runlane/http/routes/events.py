"""``GET /v1/events``: run transitions as Server-Sent Events; ``GET /v1/events/page``:
the same as JSON pages, for clients that poll."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from runlane.http.auth import Lane, Who
from runlane.http.stream import PAGE, EventHub, event_stream
from runlane.models.events import EventPage

router = APIRouter(tags=["events"])

AFTER = ("Resume after this cursor (an event's `id`/`cursor`); `0` replays from the "
         "first event kept. Without it (and without Last-Event-ID) the stream starts now.")


@router.get("/events", response_class=StreamingResponse, responses={
    200: {"description": "A text/event-stream of run transitions; each event's `id` is "
          "its cursor and its `data` an EventView.",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}})
async def events(request: Request, lane: Lane, who: Who,
                 after: Annotated[str | None, Query(max_length=64, description=AFTER)] = None,
                 last_event_id: Annotated[str | None, Header(max_length=64)] = None,
                 ) -> StreamingResponse:
    """Live run transitions of the token's scope. Reconnect with `Last-Event-ID` (a
    browser's EventSource does) to get every event after it exactly once."""
    hub: EventHub = request.app.state.events_hub
    start = last_event_id or after
    if start is None:
        start = await run_in_threadpool(lane.events_tail)
    seen = hub.generation
    first = await run_in_threadpool(lane.events_page, principal=who, after=start, limit=PAGE)
    return StreamingResponse(
        event_stream(lane, hub, who, first, seen,
                     keepalive_seconds=request.app.state.keepalive_seconds),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.get("/events/page")
def events_page(lane: Lane, who: Who,
                after: Annotated[str, Query(max_length=64, description=AFTER)] = "0",
                limit: Annotated[int, Query(ge=1, le=PAGE)] = 100) -> EventPage:
    """At most `limit` transitions after `after`, in the stream's order; pass `next`
    as `after` for the next page."""
    return lane.events_page(principal=who, after=after, limit=limit)
