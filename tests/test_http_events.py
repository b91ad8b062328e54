"""``GET /v1/events`` through real HTTP against a real `runlane serve`, both engines:
a client whose connection drops and that reconnects with Last-Event-ID gets every
transition exactly once, while transitions keep coming; a tenant's stream holds only
its tenant's runs; an idle stream sends keep-alive comments; a new stream starts now."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.api import Runlane
from runlane.store.events import parse_cursor

from .http_support import Served, SseReader, make_token, serve, wait_until

REPO = "/srv/git/app.git"


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    with serve(db_url, tmp_path, "--keepalive-seconds", "0.3") as server:
        yield server


def every_event_id(db: str) -> list[int]:
    with Runlane(db) as lane:
        found, after = [], "0"
        while page := lane.events(after=after):
            found += [e.event_id for e in page]
            after = page[-1].cursor
        return found


def test_a_dropped_stream_resumed_with_last_event_id_gets_every_event_once(
        served: Served) -> None:
    db = served.database_url
    token = make_token(db, "admin")
    stop = threading.Event()
    submitted: list[str] = []

    def keep_submitting() -> None:
        with Runlane(db) as lane:
            while not stop.is_set() and len(submitted) < 60:
                s = lane.submit("acme", REPO, f"p{len(submitted)}")
                submitted.append(s.task_id)
                if len(submitted) % 3 == 0:
                    lane.cancel(s.task_id)  # a second transition of some runs

    writer = threading.Thread(target=keep_submitting)
    got: list[tuple[str, int]] = []
    with served.client(token) as client:
        writer.start()
        try:
            # First connection: from the beginning; dropped after 15 events, mid-stream.
            with client.stream("GET", "/v1/events", params={"after": "0"}) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                reader = SseReader(response)
                while len(got) < 15:
                    event_id, data = reader.next_event()
                    assert event_id == data["cursor"]
                    got.append((event_id, data["event_id"]))
            # Second and third connections resume where the last one stopped.
            for _ in range(2):
                with client.stream("GET", "/v1/events",
                                   headers={"Last-Event-ID": got[-1][0]}) as response:
                    reader = SseReader(response)
                    for _ in range(20):
                        event_id, data = reader.next_event()
                        got.append((event_id, data["event_id"]))
        finally:
            writer.join()
        # Everything the writer wrote, read on a last connection until the end.
        expected = wait_until(lambda: (ids := every_event_id(db)) and len(ids) >= 80 and ids,
                              "the writer's transitions")
        with client.stream("GET", "/v1/events",
                           headers={"Last-Event-ID": got[-1][0]}) as response:
            reader = SseReader(response)
            while len(got) < len(expected):
                event_id, data = reader.next_event()
                got.append((event_id, data["event_id"]))
    ids = [event_id for _, event_id in got]
    assert len(ids) == len(set(ids)), "an event came twice"
    assert sorted(ids) == sorted(expected), "an event was missed"
    cursors = [parse_cursor(c) for c, _ in got]
    assert cursors == sorted(cursors)  # type: ignore[type-var]


def test_a_tenants_stream_holds_only_its_runs(served: Served) -> None:
    db = served.database_url
    token = make_token(db, "read", "acme")
    with Runlane(db) as lane, served.client(token) as client, \
            client.stream("GET", "/v1/events", params={"after": "0"}) as response:
        reader = SseReader(response)
        theirs = lane.submit("globex", REPO, "theirs")
        mine = lane.submit("acme", REPO, "mine")
        _, data = reader.next_event()
        assert (data["run_id"], data["tenant"]) == (mine.run_id, "acme") != (theirs.run_id,
                                                                                "globex")


def test_a_new_stream_starts_now_and_idles_with_keepalives(served: Served) -> None:
    db = served.database_url
    token = make_token(db, "read", "acme")
    with Runlane(db) as lane, served.client(token) as client:
        old = lane.submit("acme", REPO, "before the stream")
        wait_until(lambda: every_event_id(db), "the first event")
        with client.stream("GET", "/v1/events") as response:
            reader = SseReader(response)
            new = lane.submit("acme", REPO, "after")
            _, data = reader.next_event()
            assert data["run_id"] == new.run_id != old.run_id
    # An idle stream shows it is alive (--keepalive-seconds 0.3): else the read times out.
    with served.client(token) as client, client.stream("GET", "/v1/events") as response:
        assert any(line.startswith(": keep-alive") for line in response.iter_lines())


def test_a_bad_cursor_is_a_422_problem_not_a_stream(served: Served) -> None:
    token = make_token(served.database_url, "read", "acme")
    with served.client(token) as client:
        response = client.get("/v1/events", headers={"Last-Event-ID": "not-a-cursor"})
        assert response.status_code == 422
        assert response.headers["content-type"].startswith("application/problem+json")
