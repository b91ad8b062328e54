"""The live loop of ``runlane top``: a thread fetches a frame every interval while the
main thread draws it full screen (Rich ``Live``, the terminal's alternate screen) and
reads keys, so neither a slow database nor a key press holds up the other.

Keys are read in cbreak mode (each key at once, no echo; Ctrl-C still interrupts). The
terminal is given back as it was on every way out: ``q``, Ctrl-C, SIGTERM or SIGHUP
(turned into an exit that unwinds), and an error, which the CLI then prints as one line.
When the source stops answering the screen keeps the last figures under a red "stale
since" line and the thread keeps trying; a refusal (the token revoked) or an error
that trying again cannot mend ends the view with that error."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from types import FrameType
from typing import IO, Any

from rich.console import Console
from rich.live import Live

from runlane.errors import DatabaseUnavailable
from runlane.models.top import TopSnapshot
from runlane.tui.render import Stale, frame
from runlane.tui.snapshot import Source, SourceUnavailable

# How often the loop looks at the keys and for a new frame.
TICK_SECONDS = 0.1
# Errors a later fetch may not meet: the frame goes stale, not away.
PASSING = (DatabaseUnavailable, SourceUnavailable)


@dataclass
class _Latest:
    snapshot: TopSnapshot
    version: int = 0
    stale: Stale | None = None
    fatal: BaseException | None = None


class _Shared:
    """What the fetching thread hands the drawing one."""

    def __init__(self, first: TopSnapshot) -> None:
        self._lock = threading.Lock()
        self._latest = _Latest(first)
        self.stop = threading.Event()
        self.changed = threading.Event()

    def read(self) -> _Latest:
        with self._lock:
            return _Latest(**vars(self._latest))

    def fresh(self, snapshot: TopSnapshot) -> None:
        with self._lock:
            self._latest = _Latest(snapshot, self._latest.version + 1)
        self.changed.set()

    def failed(self, error: str) -> None:
        with self._lock:
            old = self._latest
            since = old.stale.since if old.stale else datetime.now(UTC)
            self._latest = _Latest(old.snapshot, old.version + 1, Stale(since, error))
        self.changed.set()

    def fatal(self, error: BaseException) -> None:
        with self._lock:
            self._latest.fatal = error
        self.changed.set()


def _fetch_loop(source: Source, interval: float, shared: _Shared) -> None:
    next_at = time.monotonic() + interval
    while not shared.stop.wait(max(0.0, next_at - time.monotonic())):
        started = time.monotonic()
        try:
            snapshot = source.fetch()
        except PASSING as exc:
            shared.failed(str(exc))
        except Exception as exc:  # handed to the main thread, which ends with it
            shared.fatal(exc)
            return
        else:
            shared.fresh(snapshot)
        next_at = started + interval


class Keys:
    """The keys typed at ``stream`` (a terminal), in cbreak mode while entered; the
    mode it had is restored on exit. Not a terminal: no keys, only the wait."""

    def __init__(self, stream: IO[str]) -> None:
        try:
            self.fd: int | None = stream.fileno() if stream.isatty() else None
        except (AttributeError, OSError, ValueError):
            self.fd = None
        self.saved: list[Any] | None = None

    def __enter__(self) -> Keys:
        if self.fd is not None:
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd, termios.TCSANOW)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self.saved is not None:
            # The terminal may be gone (SIGHUP): then there is nothing to restore.
            with contextlib.suppress(termios.error):
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def wait(self, timeout: float, wake: threading.Event) -> str:
        """The keys typed within ``timeout`` seconds ('' if none); without a terminal,
        returns early when ``wake`` is set."""
        if self.fd is None:
            wake.wait(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return ""
        typed = os.read(self.fd, 64)
        if not typed:  # end of input: no more keys, only the wait
            self.fd = None
        return typed.decode(errors="replace")


@contextmanager
def _signals_unwind(shared: _Shared) -> Iterator[None]:
    """SIGTERM and SIGHUP end the view as an exit that runs every ``finally`` (the
    terminal restored); SIGWINCH redraws at once at the new size."""

    def leave(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def resized(_signum: int, _frame: FrameType | None) -> None:
        shared.changed.set()

    handlers = {signal.SIGTERM: leave, signal.SIGHUP: leave, signal.SIGWINCH: resized}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_live(source: Source, first: TopSnapshot, *, interval: float,
             console: Console, stdin: IO[str] | None = None) -> None:
    """Show ``first``, then a new frame every ``interval`` seconds, until ``q``."""
    shared = _Shared(first)
    fetcher = threading.Thread(target=_fetch_loop, args=(source, interval, shared),
                               name="runlane-top-fetch", daemon=True)
    try:
        with _signals_unwind(shared), Keys(stdin or sys.stdin) as keys, \
                Live(console=console, screen=True, auto_refresh=False,
                     redirect_stdout=False, redirect_stderr=False) as live:
            fetcher.start()
            shown, redraw_at = -1, 0.0
            while True:
                latest = shared.read()
                if latest.fatal is not None:
                    raise latest.fatal
                resized = shared.changed.is_set()
                if latest.version != shown or resized or time.monotonic() >= redraw_at:
                    # Every second at least: the "stale since" age moves on.
                    shared.changed.clear()
                    live.update(frame(latest.snapshot, interval=interval,
                                      stale=latest.stale, now=datetime.now(UTC),
                                      width=console.size.width), refresh=True)
                    shown, redraw_at = latest.version, time.monotonic() + 1.0
                if "q" in keys.wait(TICK_SECONDS, shared.changed).lower():
                    return
    finally:
        shared.stop.set()
