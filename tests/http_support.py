"""A real ``runlane serve`` for the HTTP tests: a subprocess on a free port over a test
database, ready once ``/readyz`` answers 200, stopped (SIGTERM, then SIGKILL) after the
test; tokens made through the facade as an operator would; an SSE reader."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from runlane.api import Runlane

READY_SECONDS = 60.0  # a loaded machine (other test sessions beside this one)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    url: str
    database_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30.0, **kwargs)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def wait_until(check: Callable[[], Any], what: str, timeout: float = 30.0,
               interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@contextmanager
def serve(database_url: str, directory: Path, *args: str,
          env: dict[str, str] | None = None) -> Iterator[Served]:
    """``runlane serve`` over ``database_url`` (its log in ``directory``), ready."""
    for attempt in range(3):  # the free port may be taken before the server binds it
        port = free_port()
        log = directory / f"serve-{port}.log"
        command = [sys.executable, "-m", "runlane", "--database-url", database_url,
                   "--events-poll-seconds", "0.05", "--log-level", "INFO",
                   "serve", "--port", str(port), *args]
        with log.open("wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=directory,
                                       env={**os.environ, **(env or {})})
        served = Served(f"http://127.0.0.1:{port}", database_url, process, log)
        try:
            if _ready(served):
                break
        except BaseException:
            _stop(process)
            raise
        _stop(process)
        if attempt == 2:
            raise AssertionError(f"runlane serve did not start: {served.stderr()}")
    try:
        yield served
    finally:
        _stop(process)


def _ready(served: Served) -> bool:
    deadline = time.monotonic() + READY_SECONDS
    while time.monotonic() < deadline:
        if served.process.poll() is not None:
            return False
        try:
            if httpx.get(f"{served.url}/readyz", timeout=2.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"runlane serve not ready in {READY_SECONDS}s: {served.stderr()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def make_token(database_url: str, role: str, tenant: str | None = None,
               **kwargs: Any) -> str:
    """A token as `runlane tokens create` makes it (the facade's create_token)."""
    with Runlane(database_url) as lane:
        created = lane.create_token(role=role, tenant=tenant, **kwargs)
        return str(created.token)


class SseReader:
    """Reads a text/event-stream: events as (id, data), comments counted."""

    def __init__(self, response: httpx.Response, timeout: float = 30.0) -> None:
        self.response = response
        self.lines = response.iter_lines()
        self.comments = 0
        self.timeout = timeout

    def next_event(self) -> tuple[str | None, dict[str, Any]]:
        """The next event; an AssertionError after ``timeout`` seconds without one
        (keep-alive comments do not count: a stream that only idles fails the test)."""
        event_id: str | None = None
        data: list[str] = []
        deadline = time.monotonic() + self.timeout
        for line in self.lines:
            if time.monotonic() > deadline:
                raise AssertionError(f"no event in {self.timeout}s")
            if line == "":
                if data:
                    return event_id, json.loads("\n".join(data))
                continue
            if line.startswith(":"):
                self.comments += 1
            elif line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        raise EOFError("the stream ended")
