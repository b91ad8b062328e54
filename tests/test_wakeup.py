"""LISTEN/NOTIFY wake-ups on PostgreSQL, and the listener surviving a killed session."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest

from runlane.domain.states import RunStatus
from runlane.store.core import CANCEL_CHANNEL, WAKEUP_CHANNEL
from runlane.store.store import Store
from runlane.store.wakeup import RECONNECTED, Listener, libpq_url

from .conftest import truncate_pg
from .support import spec


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    truncate_pg(pg_url)
    store = Store(pg_url)
    yield store
    store.close()


def wait_for(listener: Listener, channel: str, timeout: float = 5.0) -> tuple[str, float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        for wake in listener.wait(0.1):
            if wake.channel == channel:
                return wake.payload, time.monotonic() - started
    raise AssertionError(f"no {channel} wake-up within {timeout}s")


def test_submit_wakes_a_waiting_worker_within_milliseconds(pg_store: Store, pg_url: str) -> None:
    with Listener(pg_url) as listener:
        assert listener.wait_connected()
        sent = time.monotonic()
        pg_store.submit([spec(queue="java")])
        payload, _ = wait_for(listener, WAKEUP_CHANNEL)
        latency = time.monotonic() - sent
    assert payload == "java"
    assert latency < 0.5
    assert [lease.queue for lease in pg_store.claim("w1", queue="java")] == ["java"]


def test_cancel_reaches_the_worker_without_waiting_for_a_heartbeat(pg_store: Store,
                                                                    pg_url: str) -> None:
    [sub] = pg_store.submit([spec()])
    [lease] = pg_store.claim("w1")
    pg_store.advance(lease, RunStatus.RUNNING)
    with Listener(pg_url) as listener:
        assert listener.wait_connected()
        pg_store.cancel(sub.task_id)
        payload, _ = wait_for(listener, CANCEL_CHANNEL)
    assert payload == sub.run_id


def test_listener_reconnects_after_its_session_is_terminated(pg_store: Store,
                                                             pg_url: str) -> None:
    with Listener(pg_url) as listener:
        assert listener.wait_connected()
        first_pid = listener.backend_pid
        with psycopg.connect(libpq_url(pg_url), autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (first_pid,)).fetchone() == (
                True,)
        wait_for(listener, RECONNECTED)  # woken to poll: notifications may have been lost
        assert listener.backend_pid != first_pid and listener.reconnects == 1
        pg_store.submit([spec()])
        payload, _ = wait_for(listener, WAKEUP_CHANNEL)
    assert payload == "default"
    assert len(pg_store.claim("w1")) == 1


def test_on_sqlite_the_listener_is_a_poll_interval() -> None:
    listener = Listener("sqlite:///unused.db").start()
    started = time.monotonic()
    assert listener.wait(0.2) == []
    assert time.monotonic() - started >= 0.19
    listener.close()
