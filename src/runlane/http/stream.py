"""The live event stream: one wake-up source per server, shared by every open SSE
connection, and the stream of one connection.

Wake-ups: on PostgreSQL a ``LISTEN runlane_events`` thread (a trigger NOTIFYs at each
commit that adds events, migration 0021), on SQLite a look at the table's last id when
the change signal (store/wakeup.py: another connection committed) fires, and every
``poll_seconds``. On PostgreSQL every stream also looks again each
``poll_seconds`` without a notification: events that a still-running older transaction
held back (store/events.py) become deliverable when it ends, which may notify nothing,
and a notification sent while the listener reconnected is lost. Either way the
database is the truth and the wake-up only says when to look: a stream that wakes for
nothing finds nothing; one that was not woken finds it at its next look.

A connection's stream reads pages of ``Runlane.events`` after its cursor (in the
threadpool: the facade blocks), writes each event with ``id:`` = its cursor (so a
browser's EventSource resumes with ``Last-Event-ID``), and between pages waits on the
hub, writing a comment line every ``keepalive_seconds`` so that proxies and clients
see a live connection.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import structlog
from starlette.concurrency import run_in_threadpool

from runlane.api import Runlane
from runlane.domain.access import Principal
from runlane.errors import RunlaneError
from runlane.models.events import EventPage, EventView
from runlane.store.events import EVENTS_CHANNEL
from runlane.store.wakeup import Listener

log = structlog.get_logger("runlane.http.events")

PAGE = 500
RETRY_MS = 1000  # the client's reconnection delay (the SSE "retry:" field)


class EventHub:
    """Counts wake-ups; a stream waits for the count to move past what it saw."""

    def __init__(self, lane: Runlane, *, poll_seconds: float) -> None:
        self.lane = lane
        self.poll_seconds = poll_seconds
        self.generation = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        # Reads in flight or done since the count last moved: (tenant scope, cursor).
        self._reads: dict[tuple[str | None, str | None], asyncio.Future[EventPage]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._listener = Listener(lane.settings.database_url, channels=(EVENTS_CHANNEL,),
                                  change_poll_seconds=lane.settings.change_poll_seconds,
                                  listen_database_url=lane.settings.listen_database_url)

    @property
    def postgres(self) -> bool:
        return self._listener.enabled

    def start(self) -> None:
        """On the server's event loop (its lifespan)."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._listener.start()
        self._thread = threading.Thread(target=self._run, name="runlane-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._listener.poke()
        self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _bump(self) -> None:
        """On the loop: move the count on and wake every waiter."""
        self.generation += 1
        self._reads.clear()  # reads of an older count may miss what woke this one
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def page(self, who: Principal, cursor: str | None, seen: int) -> EventPage:
        """``Runlane.events_page`` after ``cursor`` in ``who``'s scope, read once for
        every stream at that cursor and scope since the count reached ``seen``: 100
        streams woken by one commit cost one read, not 100 (docs/benchmarks.md). A read
        started once the count was ``seen`` sees every commit that moved it there."""
        key = (who.tenant, cursor)
        if seen != self.generation:  # a newer wake-up: read for yourself, not shared
            return await run_in_threadpool(self.lane.events_page, principal=who,
                                           after=cursor, limit=PAGE)
        shared = self._reads.get(key)
        if shared is None:
            shared = asyncio.ensure_future(run_in_threadpool(
                self.lane.events_page, principal=who, after=cursor, limit=PAGE))
            self._reads[key] = shared
            shared.add_done_callback(self._forget_failed(key))
        return await asyncio.shield(shared)

    def _forget_failed(self, key: tuple[str | None, str | None]
                       ) -> Callable[[asyncio.Future[EventPage]], None]:
        def forget(done: asyncio.Future[EventPage]) -> None:
            if (done.cancelled() or done.exception() is not None) \
                    and self._reads.get(key) is done:
                del self._reads[key]  # the next stream reads again
        return forget

    async def wait(self, seen: int, timeout: float) -> bool:
        """Until the count moves past ``seen`` (True) or ``timeout`` passes (False)."""
        if self.generation != seen:
            return True
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return self.generation != seen
        return True

    def _run(self) -> None:
        from runlane.store.events import last_event_id

        last = -1
        while not self._stop.is_set():
            self._listener.wait(self.poll_seconds)
            if self._stop.is_set():
                return
            if not self.postgres:  # SQLite: a commit, or the poll; were events added?
                try:
                    now = last_event_id(self.lane.store.reads)
                except Exception as exc:  # a database away: look again at the next poll
                    log.warning("events_poll_failed", error=str(exc).splitlines()[0])
                    continue
                if now == last:
                    continue
                last = now
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._bump)
            except RuntimeError:  # the loop closed: the server is stopping
                return


def sse(event: EventView) -> str:
    return f"id: {event.cursor}\ndata: {event.model_dump_json()}\n\n"


async def event_stream(lane: Runlane, hub: EventHub, who: Principal, first: EventPage,
                       seen: int, *, keepalive_seconds: float) -> AsyncIterator[str]:
    """The text of one connection's stream, from ``first`` (a page read once the hub's
    count was ``seen``) on, until the client goes away (the server then cancels this
    generator). The count is always taken before the read, so a wake-up that comes
    while a page is read is never lost."""
    yield f"retry: {RETRY_MS}\n: connected\n\n"
    loop = asyncio.get_running_loop()
    page, last_write = first, loop.time()
    while True:
        for event in page.items:
            yield sse(event)
            last_write = loop.time()
        cursor = page.next
        if len(page.items) < PAGE:
            # A comment when nothing was written for keepalive_seconds, however often
            # the hub woke this stream for nothing.
            if loop.time() - last_write >= keepalive_seconds:
                yield ": keep-alive\n\n"
                last_write = loop.time()
            if not await hub.wait(seen, keepalive_seconds - (loop.time() - last_write)):
                page = EventPage(items=[], next=cursor)
                continue
        seen = hub.generation
        try:
            page = await hub.page(who, cursor, seen)
        except RunlaneError as exc:  # e.g. the database restarting: look again later
            log.warning("events_read_failed", error=str(exc))
            page = EventPage(items=[], next=cursor)
