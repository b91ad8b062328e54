"""The event stream's order (store/events.py): every run transition delivered once, in
an order whose cursor only grows, on both engines; on PostgreSQL also when event ids
commit out of order (a transaction that took id 10 commits after the one that took 11).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from runlane.api import InvalidArgument, Runlane
from runlane.domain.access import OPERATOR, Principal, Role
from runlane.models.events import EventView
from runlane.store.events import parse_cursor
from runlane.store.wakeup import libpq_url

REPO = "/srv/git/app.git"


@pytest.fixture
def lane(db_url: str) -> Iterator[Runlane]:
    with Runlane(db_url) as lane:
        yield lane


def drain(lane: Runlane, after: str | None, principal: Principal = OPERATOR,
          limit: int = 500) -> list[EventView]:
    """Every event deliverable now after ``after``, page by page."""
    found: list[EventView] = []
    while True:
        page = lane.events(principal=principal, after=after, limit=limit)
        found += page
        if len(page) < limit:
            return found
        after = page[-1].cursor


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true. PostgreSQL delivers an event once
    every transaction older than its writer's has ended, cluster-wide: another session
    on the server may hold it back a moment."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def key(event: EventView) -> tuple[int, int]:
    cursor = parse_cursor(event.cursor)
    assert cursor is not None
    return cursor


def test_every_transition_once_in_growing_cursor_order_paged(lane: Runlane) -> None:
    subs = [lane.submit("acme", REPO, f"p{i}") for i in range(7)]
    lane.cancel(subs[0].task_id)
    every = wait_for(lambda: (found := drain(lane, None)) and len(found) >= 8 and found,
                     "the transitions")
    assert len({e.event_id for e in every}) == len(every)
    assert [key(e) for e in every] == sorted(key(e) for e in every)
    # Pages of 3 give the same events, each once.
    assert [e.event_id for e in drain(lane, None, limit=3)] == [e.event_id for e in every]
    # Resuming after any event gives exactly the rest.
    for i, event in enumerate(every):
        assert [e.event_id for e in drain(lane, event.cursor)] == \
            [e.event_id for e in every[i + 1:]]
    assert {e.run_id for e in every} == {s.run_id for s in subs}
    assert every[0].tenant == "acme" and every[0].to_status == "QUEUED"


def test_a_tenant_sees_only_its_own_runs_events(lane: Runlane) -> None:
    mine = lane.submit("acme", REPO, "mine")
    theirs = lane.submit("globex", REPO, "theirs")
    wait_for(lambda: len(drain(lane, None)) >= 2, "both submissions")
    acme = Principal(Role.READ, "acme")
    assert {e.run_id for e in drain(lane, None, acme)} == {mine.run_id}
    assert {e.run_id for e in drain(lane, None, Principal(Role.ADMIN, None))} == \
        {mine.run_id, theirs.run_id}
    assert drain(lane, None, Principal(Role.READ, "initech")) == []


def test_the_tail_starts_after_everything_deliverable(lane: Runlane) -> None:
    lane.submit("acme", REPO, "before")
    wait_for(lambda: drain(lane, None), "the first event")
    tail = lane.events_tail()
    assert drain(lane, tail) == []
    later = lane.submit("acme", REPO, "after")
    got = wait_for(lambda: drain(lane, tail), "the event after the tail")
    assert [e.run_id for e in got] == [later.run_id]


@pytest.mark.parametrize("after", ["x", "-1", "1-", "1-2-3", "9" * 20, "", "1e3"])
def test_a_malformed_cursor_is_refused(lane: Runlane, after: str) -> None:
    with pytest.raises(InvalidArgument):
        lane.events(after=after)


@pytest.mark.parametrize("limit", [0, 10_001, True, 1.5])
def test_a_bad_limit_is_refused(lane: Runlane, limit: Any) -> None:
    with pytest.raises(InvalidArgument):
        lane.events(limit=limit)


# --- PostgreSQL: ids committed out of order --------------------------------------------


def _insert_event(conn: psycopg.Connection[Any], run_id: str, note: str) -> int:
    row = conn.execute(
        "INSERT INTO run_events (run_id, at, actor, from_status, to_status, message) "
        "VALUES (%s, 1, 'test', 'QUEUED', 'QUEUED', %s) RETURNING event_id",
        (run_id, note)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def pg_lane(pg_url: str) -> Iterator[Runlane]:
    from .conftest import truncate_pg

    truncate_pg(pg_url)
    with Runlane(pg_url) as lane:
        yield lane


@pytest.mark.parametrize("first_xid", ["lower-id", "higher-id"])
def test_an_event_id_committed_late_is_neither_skipped_nor_repeated(
        pg_lane: Runlane, pg_url: str, first_xid: str) -> None:
    """Transaction A takes event id a, B takes b > a and commits first; A commits
    later. A reader that went past b before A committed would never see a with
    ``event_id > last``. Here nothing is delivered past a still-running writer: once
    both commit, each event comes exactly once and the cursor only grew. Both orders of
    their transaction ids (who wrote first) are tried."""
    lane = pg_lane
    run_id = lane.submit("acme", REPO, "x").run_id
    start = wait_for(lambda: drain(lane, None), "the submission")[-1].cursor
    with psycopg.connect(libpq_url(pg_url)) as a, psycopg.connect(libpq_url(pg_url)) as b:
        if first_xid == "higher-id":  # B's transaction id is older, its event id newer
            b.execute("SELECT pg_current_xact_id()")
        id_a = _insert_event(a, run_id, "A")
        id_b = _insert_event(b, run_id, "B")
        assert id_a < id_b
        if first_xid == "higher-id":
            a.commit()  # A ends first; B (older transaction) still runs
            seen_meanwhile = drain(lane, start)
            b.commit()
        else:
            b.commit()  # B ends first; A (older transaction, lower id) still runs
            seen_meanwhile = drain(lane, start)
            a.commit()
    # Nothing was delivered past the running writer.
    assert seen_meanwhile == []
    delivered: list[EventView] = []
    cursor = start

    def more() -> bool:
        nonlocal cursor
        page = drain(lane, cursor)
        delivered.extend(page)
        if page:
            cursor = page[-1].cursor
        return len(delivered) >= 2

    wait_for(more, "both events")
    assert sorted(e.event_id for e in delivered) == [id_a, id_b]
    assert [key(e) for e in delivered] == sorted(key(e) for e in delivered)
    assert drain(lane, cursor) == []


def test_a_naive_reader_would_have_skipped_it(pg_lane: Runlane, pg_url: str) -> None:
    """The scenario above is real: ``event_id > last`` read while A still runs returns
    B's event, and A's lower id is then behind it."""
    lane = pg_lane
    run_id = lane.submit("acme", REPO, "x").run_id
    with psycopg.connect(libpq_url(pg_url)) as a, psycopg.connect(libpq_url(pg_url)) as b, \
            psycopg.connect(libpq_url(pg_url), autocommit=True) as reader:
        id_a = _insert_event(a, run_id, "A")
        id_b = _insert_event(b, run_id, "B")
        b.commit()
        naive = [r[0] for r in reader.execute(
            "SELECT event_id FROM run_events WHERE event_id > %s ORDER BY event_id",
            (id_a - 1,))]
        assert naive == [id_b]  # a naive reader's last id is now id_b > id_a
        a.commit()


def test_tx_ids_are_set_by_the_trigger_whatever_the_insert(pg_lane: Runlane,
                                                           pg_url: str) -> None:
    pg_lane.submit_batch([{"tenant": "acme", "repo": REPO, "prompt": f"p{i}"}
                          for i in range(3)])
    with psycopg.connect(libpq_url(pg_url), autocommit=True) as conn:
        # A run admitted QUEUED records its creation on its row (migration 0028), with
        # its writer's transaction as the trigger would; a note is an event.
        tx_ids = {r[0] for r in conn.execute("SELECT created_tx FROM runs")}
        conn.execute("INSERT INTO run_events (run_id, at, actor, from_status, to_status) "
                     "SELECT run_id, 1, 'x', status, status FROM runs")
        tx_ids |= {r[0] for r in conn.execute(
            "SELECT tx_id FROM run_events")}
    assert len(tx_ids) == 2 and 0 not in tx_ids  # one transaction each wrote them all


def test_a_long_transaction_in_another_database_holds_nothing_back(
        pg_lane: Runlane, pg_url: str) -> None:
    """The horizon is this database's running transactions, not the server's: a
    transaction that holds an id in the database next door (another application on the
    same server) does not stop delivery."""
    from .conftest import ADMIN_URL, _libpq

    with psycopg.connect(_libpq(ADMIN_URL)) as elsewhere:
        elsewhere.execute("SELECT pg_current_xact_id()")  # an id, held open
        sub = pg_lane.submit("acme", REPO, "x")
        got = wait_for(lambda: drain(pg_lane, None), "the event", timeout=5.0)
        assert [e.run_id for e in got] == [sub.run_id]
        elsewhere.rollback()


def test_the_horizon_widens_32_bit_ids_across_an_epoch() -> None:
    from runlane.store.events import widen

    assert widen(5, 2**32 + 10) == 2**32 + 5
    assert widen(2**32 - 3, 2**32 + 10) == 2**32 - 3  # the epoch before
    assert widen(7, 2**32 - 2) == 2**32 + 7  # running, above xmax, the next epoch
    assert widen(100, 200) == 100


def test_a_tenants_next_cursor_moves_past_other_tenants_events(lane: Runlane) -> None:
    """A quiet tenant's reader is not left behind every other tenant's events (each
    look would scan them all again): a short page's ``next`` is past what it read."""
    acme = Principal(Role.READ, "acme")
    start = lane.events_page(principal=acme, after="0")
    for i in range(5):
        lane.submit("globex", REPO, f"g{i}")
    last_globex = wait_for(lambda: (found := drain(lane, None)) and len(found) >= 5
                           and found, "globex's events")[-1]
    page = wait_for(lambda: (p := lane.events_page(principal=acme, after=start.next))
                    and key_of(p.next) >= key(last_globex) and p, "acme's cursor to move")
    assert page.items == []
    mine = lane.submit("acme", REPO, "mine")
    later = wait_for(lambda: lane.events_page(principal=acme, after=page.next).items,
                     "acme's own event")
    assert [e.run_id for e in later] == [mine.run_id]


def key_of(cursor: str) -> tuple[int, int]:
    parsed = parse_cursor(cursor)
    assert parsed is not None
    return parsed
