"""The counters of limited scopes, locked on PostgreSQL by LOCK_SCOPES and by
CLAIM_WRITE_PG's ``counter_locks``: one primary-key probe per scope (the plans are in
``test_dispatch_explain.py``), taken in scope order whatever the order of the array
(every transaction locks counters in that one order: deadlock freedom, invariant 9),
one row per distinct scope that has a counter."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Connection, Engine, text

from runlane.store import claim_sql, dialect_sql, slots_sql
from runlane.store.engine import build_engine
from runlane.store.wakeup import libpq_url

from .conftest import truncate_pg
from .support import assert_planned_once, wait_for_a_lock_wait

PG = dialect_sql.Statements("postgresql")
COUNTERS = {"global": 10, "repo:a": 2, "repo:m": 2, "repo:z": 2, "tenant:acme": 3}


@pytest.fixture
def pg(pg_url: str) -> Iterator[Engine]:
    truncate_pg(pg_url)
    engine = build_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO limit_counters (scope, active, max_active) "
                          "VALUES (:scope, 0, :max_active)"),
                     [{"scope": s, "max_active": m} for s, m in COUNTERS.items()])
    yield engine
    engine.dispose()


def lock_scopes(conn: Connection, scopes: list[str]) -> list[tuple[str, int, int]]:
    return [tuple(r) for r in conn.execute(PG.render(slots_sql.LOCK_SCOPES["postgresql"]),
                                           {"scopes": scopes})]


def claim_write(conn: Connection, scopes: list[str], n: int = 0) -> list[Any]:
    """CLAIM_WRITE_PG for no run, taking ``n`` slots in each of ``scopes``: only its
    counter locks, its room check and its slots have anything to do."""
    return list(conn.execute(PG.render(claim_sql.CLAIM_WRITE_PG), {
        "now": None, "slot_scopes": scopes, "slot_counts": [n] * len(scopes),
        "slot_max": [COUNTERS.get(s, 1) for s in scopes], "run_ids": [], "estimated": [],
        "scopes": [], "worker_id": "w", "ttl": 30.0, "lane_ids": [], "lane_counts": [],
        "lane_gone": [], "also_full": []}))


def active(conn: Connection) -> dict[str, int]:
    return {r.scope: r.active for r in conn.execute(
        text("SELECT scope, active FROM limit_counters"))}


def lockable(url: str, scope: str) -> bool:
    """Whether another transaction could lock ``scope``'s counter right now."""
    with psycopg.connect(libpq_url(url)) as probe:
        row = probe.execute("SELECT scope FROM limit_counters WHERE scope = %s "
                            "FOR UPDATE SKIP LOCKED", (scope,)).fetchone()
        probe.rollback()
    return row is not None


LOCKERS: dict[str, Callable[[Connection, list[str]], Any]] = {
    "LOCK_SCOPES": lock_scopes, "CLAIM_WRITE_PG": claim_write}


@pytest.mark.parametrize("statement", LOCKERS)
def test_counters_are_locked_in_scope_order_whatever_the_array_order(
        pg: Engine, pg_url: str, statement: str) -> None:
    """Another transaction holds repo:m. A locker of z, m, a (reversed) must hold a,
    wait on m and not yet hold z: the order the claim, the completion and the
    reconciler all lock in. In the array's order it would hold z while it waits: a
    deadlock with a transaction that holds a and waits for z."""
    locker = LOCKERS[statement]
    done: dict[str, Any] = {}
    with pg.connect() as holder:
        holder.execute(text("SELECT scope FROM limit_counters WHERE scope = 'repo:m' "
                            "FOR UPDATE"))

        def lock() -> None:
            with pg.connect() as conn:
                done["result"] = locker(conn, ["repo:z", "repo:m", "repo:a"])
                conn.rollback()

        thread = threading.Thread(target=lock)
        thread.start()
        try:
            wait_for_a_lock_wait(pg_url, "limit_counters", "a counter")
            held = {s: not lockable(pg_url, s) for s in ("repo:a", "repo:z")}
        finally:
            holder.rollback()
            thread.join(timeout=30)
    assert held == {"repo:a": True, "repo:z": False}
    assert "result" in done


def test_lock_scopes_returns_each_existing_scope_once_in_scope_order(pg: Engine) -> None:
    with pg.connect() as conn:
        rows = lock_scopes(conn, ["repo:z", "repo:nothing", "global", "repo:z", "repo:a"])
        conn.rollback()
    assert rows == [("global", 0, 10), ("repo:a", 0, 2), ("repo:z", 0, 2)]


def test_claim_write_takes_slots_only_when_every_scope_has_a_counter(pg: Engine) -> None:
    """``room`` counts the locked counters against the scopes asked for: a scope without
    a counter (one row short) writes nothing; with every counter, each takes its
    slots."""
    with pg.connect() as conn:
        claim_write(conn, ["global", "repo:a", "repo:new"], n=1)
        assert set(active(conn).values()) == {0}
        claim_write(conn, ["global", "repo:a", "tenant:acme"], n=2)
        assert active(conn) == {"global": 2, "repo:a": 2, "repo:m": 0, "repo:z": 0,
                                "tenant:acme": 2}
        claim_write(conn, ["global", "repo:a"], n=1)  # repo:a has no room: nothing
        assert active(conn)["global"] == 2
        conn.rollback()


def test_lock_scopes_is_planned_once_per_session_not_per_release(pg: Engine) -> None:
    """Every release of a limited run locks its counters with LOCK_SCOPES. PostgreSQL
    kept it on custom plans (planned at every execution, 500 of 500 after a benchmark's
    completions) while the generic plan's estimate of the array looked dearer; with the
    array's own length as a LIMIT the generic plan wins after the first custom ones."""
    with pg.connect() as conn:
        for _ in range(12):
            lock_scopes(conn, ["global", "repo:a", "tenant:acme"])
            conn.commit()
        assert_planned_once(conn, "DISTINCT a.scope")
