"""Wake-ups: LISTEN/NOTIFY on PostgreSQL, a poll interval everywhere.

A listener thread holds one dedicated connection. When that connection dies
(a restart, ``pg_terminate_backend``) it reconnects with backoff and then wakes
its waiters once, because notifications sent while it was away are lost: the
waiter polls the database, which is the truth, and misses nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import structlog
from sqlalchemy.engine import make_url

from runlane.extras import require
from runlane.store.engine import dialect_of, normalize_url
from runlane.store.store import CANCEL_CHANNEL, WAKEUP_CHANNEL

log = structlog.get_logger("runlane.wakeup")

RECONNECTED = "__reconnected__"


@dataclass(frozen=True)
class Wakeup:
    channel: str
    payload: str


def libpq_url(url: str) -> str:
    return make_url(normalize_url(url)).set(drivername="postgresql").render_as_string(
        hide_password=False
    )


class Listener:
    """Blocks a caller until a notification arrives or a timeout passes."""

    def __init__(self, url: str, channels: tuple[str, ...] = (WAKEUP_CHANNEL, CANCEL_CHANNEL),
                 reconnect_seconds: float = 0.2) -> None:
        self.url = url
        self.channels = channels
        self.reconnect_seconds = reconnect_seconds
        self.enabled = dialect_of(url) == "postgresql"
        # A SimpleQueue: its put() is reentrant, so poke() is safe from a signal handler
        # (the worker's SIGTERM drain) that runs while this thread is inside wait():
        # queue.Queue.put would block forever on the mutex its own thread holds.
        self._inbox: queue.SimpleQueue[Wakeup] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self.backend_pid: int | None = None
        self.reconnects = 0
        self._thread: threading.Thread | None = None

    def start(self) -> Listener:
        if self.enabled and self._thread is None:
            require("psycopg", "A PostgreSQL DATABASE_URL")  # refused here, not in the thread
            self._thread = threading.Thread(target=self._run, name="runlane-listener",
                                            daemon=True)
            self._thread.start()
        return self

    def wait_connected(self, timeout: float = 5.0) -> bool:
        return not self.enabled or self._connected.wait(timeout)

    def poke(self, channel: str = "local", payload: str = "") -> None:
        """Wake the waiter from inside the process (a slot freed, a drain began)."""
        self._inbox.put(Wakeup(channel, payload))

    def wait(self, timeout: float) -> list[Wakeup]:
        """Everything that arrived, or [] after ``timeout`` seconds (the poll)."""
        try:
            first = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return []
        woken = [first]
        while True:
            try:
                woken.append(self._inbox.get_nowait())
            except queue.Empty:
                return woken

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Listener:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        import psycopg  # the `postgres` extra (runlane.extras): start() checked it is here

        delay = self.reconnect_seconds
        first = True
        while not self._stop.is_set():
            try:
                with psycopg.connect(libpq_url(self.url), autocommit=True) as conn:
                    for channel in self.channels:
                        conn.execute(f"LISTEN {channel}")
                    self.backend_pid = conn.info.backend_pid
                    self._connected.set()
                    if not first:
                        self.reconnects += 1
                        log.info("listener_reconnected", backend_pid=self.backend_pid)
                        self._inbox.put(Wakeup(RECONNECTED, ""))
                    first = False
                    delay = self.reconnect_seconds
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._inbox.put(Wakeup(note.channel, note.payload))
            except psycopg.Error as exc:
                self._connected.clear()
                if self._stop.is_set():
                    return
                log.warning("listener_disconnected", error=str(exc).strip().splitlines()[0],
                            retry_in=delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
