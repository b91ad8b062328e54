"""Wake-ups: LISTEN/NOTIFY on PostgreSQL, ``PRAGMA data_version`` on SQLite, and a
poll interval everywhere.

PostgreSQL: a listener thread holds one dedicated connection, to ``LISTEN_DATABASE_URL``
when given, else to the database's URL. A transaction pooler (``?pooler=transaction``)
hands each transaction to any server session, so a LISTEN through it hears nothing: with
such a URL and no ``LISTEN_DATABASE_URL`` there is no listener, the waiter polls, and
the process logs one warning (``listen_unavailable``). When that connection
dies (a restart, ``pg_terminate_backend``) it reconnects with backoff and then wakes
its waiters once, because notifications sent while it was away are lost: the waiter
polls the database, which is the truth, and misses nothing.

SQLite has no NOTIFY. A watcher thread reads ``PRAGMA data_version`` on a connection
of its own every CHANGE_POLL_SECONDS: the number moves when another connection (of any
process) has committed, and reading it writes nothing and reads no table, only the
WAL's shared-memory header. When it moved, the waiter is woken with ``CHANGED`` and
runs the real query (new work for its queues, cancels of the leases it holds); when it
did not, nothing else runs. What a commit did is not said: the waiter looks.

``ClaimGate``: workers on one SQLite file all see the same change at once; the gate, a
lock file beside the database, lets one of them look and claim at a time, so one
submit costs one claim, not one per idle worker (the others' look then finds the run
taken). SQLite's workers share a machine (the file), so a file lock reaches them all.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import structlog
from sqlalchemy.engine import make_url

from runlane.extras import require
from runlane.store.core import CANCEL_CHANNEL, WAKEUP_CHANNEL
from runlane.store.engine import dialect_of, normalize_url, pooler_of, sqlite_file

log = structlog.get_logger("runlane.wakeup")

# The application_name of a listener's session (the pool's are "runlane"): what
# pg_stat_activity shows for the one LISTEN connection of each process.
LISTEN_APPLICATION = "runlane-listen"
RECONNECTED = "__reconnected__"
CHANGED = "__changed__"  # SQLite: another connection committed (PRAGMA data_version)

# How often a SQLite watcher reads PRAGMA data_version (setting CHANGE_POLL_SECONDS).
CHANGE_POLL_SECONDS = 0.05
# The claim gate's lock file: the database file's name with this suffix.
CLAIM_GATE_SUFFIX = "-claim.lock"
# A gate held longer than this (its holder stopped, SIGSTOP) is passed by: the gate only
# spares empty claims, correctness never rests on it.
CLAIM_GATE_WAIT_SECONDS = 0.5


@dataclass(frozen=True)
class Wakeup:
    channel: str
    payload: str


def libpq_url(url: str) -> str:
    return make_url(normalize_url(url)).set(drivername="postgresql").render_as_string(
        hide_password=False
    )


_warned_unavailable = False


def listen_url(url: str, listen_database_url: str | None = None) -> str | None:
    """Where a process LISTENs for a database at ``url``: ``listen_database_url`` if
    given, else ``url`` itself unless a transaction pooler stands in front of it
    (None: no LISTEN, poll). Not PostgreSQL: None."""
    if dialect_of(url) != "postgresql":
        return None
    if listen_database_url:
        return listen_database_url
    return None if pooler_of(url) == "transaction" else url


def _warn_unavailable() -> None:
    """Once per process: each listener without a LISTEN would say the same."""
    global _warned_unavailable
    if not _warned_unavailable:
        _warned_unavailable = True
        log.warning("listen_unavailable",
                    message="DATABASE_URL goes through a transaction pooler and "
                            "LISTEN_DATABASE_URL is not set: no LISTEN/NOTIFY, polling")


class Listener:
    """Blocks a caller until a notification arrives or a timeout passes."""

    def __init__(self, url: str, channels: tuple[str, ...] = (WAKEUP_CHANNEL, CANCEL_CHANNEL),
                 reconnect_seconds: float = 0.2,
                 change_poll_seconds: float = CHANGE_POLL_SECONDS,
                 listen_database_url: str | None = None) -> None:
        self.channels = channels
        self.reconnect_seconds = reconnect_seconds
        self.change_poll_seconds = change_poll_seconds
        dialect = dialect_of(url)
        target = listen_url(url, listen_database_url)
        # Where LISTEN connects (the pooler's URL is never it).
        self.url = target or url
        self.enabled = target is not None  # LISTEN/NOTIFY
        if dialect == "postgresql" and not self.enabled:
            _warn_unavailable()
        # SQLite: the file whose commits the watcher notices (None: in memory).
        self.database_file = sqlite_file(url) if dialect == "sqlite" else None
        self.changes_seen = 0
        # A SimpleQueue: its put() is reentrant, so poke() is safe from a signal handler
        # (the worker's SIGTERM drain) that runs while this thread is inside wait():
        # queue.Queue.put would block forever on the mutex its own thread holds.
        self._inbox: queue.SimpleQueue[Wakeup] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._failing = False  # SQLite: the watcher's last read failed
        self.backend_pid: int | None = None
        self.reconnects = 0
        self._thread: threading.Thread | None = None

    @property
    def watches_changes(self) -> bool:
        """Whether commits wake the waiter (LISTEN, or SQLite's data_version watcher)."""
        return self.enabled or self.database_file is not None

    @property
    def healthy(self) -> bool:
        """Whether commits wake the waiter right now (LISTEN connected, or the SQLite
        watcher reading): an idle worker may then poll less often."""
        return self.watches_changes and self._connected.is_set() and not self._failing

    def start(self) -> Listener:
        if self._thread is None and self.watches_changes:
            if self.enabled:  # refused here, not in the thread
                require("psycopg", "A PostgreSQL DATABASE_URL")
            target = self._run if self.enabled else self._watch
            self._thread = threading.Thread(target=target, name="runlane-listener",
                                            daemon=True)
            self._thread.start()
        return self

    def wait_connected(self, timeout: float = 5.0) -> bool:
        return not self.watches_changes or self._connected.wait(timeout)

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
                with psycopg.connect(libpq_url(self.url), autocommit=True,
                                     application_name=LISTEN_APPLICATION) as conn:
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

    def _watch(self) -> None:
        """SQLite: wake the waiter when PRAGMA data_version moved since the last read."""
        assert self.database_file is not None
        uri = f"file:{quote(str(self.database_file.expanduser().absolute()))}?mode=rw"
        conn: sqlite3.Connection | None = None
        last: int | None = None
        warned = False
        while not self._stop.is_set():
            try:
                if conn is None:
                    # mode=rw: never create the file; autocommit: never hold a read
                    # transaction (it would keep the WAL from being checkpointed).
                    conn = sqlite3.connect(uri, uri=True, isolation_level=None,
                                           check_same_thread=False)
                    last = None
                version = int(conn.execute("PRAGMA data_version").fetchone()[0])
            except sqlite3.Error as exc:
                self._failing = True
                if conn is not None:
                    conn.close()
                    conn = None
                if not warned:
                    log.warning("change_watch_failed", error=str(exc), retry_in=1.0)
                    warned = True
                self._stop.wait(1.0)
                continue
            self._failing = False
            if last is None:  # a new connection: what happened before it is unknown
                if self._connected.is_set():
                    self._inbox.put(Wakeup(CHANGED, ""))
                self._connected.set()
                warned = False
            elif version != last:
                self.changes_seen += 1
                self._inbox.put(Wakeup(CHANGED, ""))
            last = version
            self._stop.wait(self.change_poll_seconds)
        if conn is not None:
            conn.close()


class ClaimGate:
    """One worker at a time looks for work and claims it on one SQLite file (module
    docstring). Without a file (PostgreSQL, a database in memory) it admits everyone."""

    def __init__(self, url: str, wait_seconds: float = CLAIM_GATE_WAIT_SECONDS) -> None:
        database = sqlite_file(url) if dialect_of(url) == "sqlite" else None
        self.path: Path | None = (
            Path(str(database.expanduser().absolute()) + CLAIM_GATE_SUFFIX)
            if database is not None else None)
        self.wait_seconds = wait_seconds
        self._fd: int | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[bool]:
        """Hold the gate for the block; yields whether it is held (False: passed by
        after ``wait_seconds``, or no gate)."""
        fd = self._open()
        if fd is None:
            yield False
            return
        deadline = time.monotonic() + self.wait_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.002)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _open(self) -> int | None:
        if self._fd is None and self.path is not None:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:  # a read-only directory: claims go ungated
                log.warning("claim_gate_unavailable", path=str(self.path), error=str(exc))
                self.path = None
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
