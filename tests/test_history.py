"""Leaner rows per run (migration 0028, store/history.py): a run's creation, its attempts'
claims and ends are recorded on their rows, not as events; every reader composes the
history from the three tables, once per transition, in the order it was written; and the
audit still finds each violation it found when they were events."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from runlane.clock import ManualClock
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.store import details, history
from runlane.store.events import events_after, format_cursor, parse_cursor
from runlane.store.store import Store

from .conftest import T0
from .support import attempts_of, events_of, execute, submit

S = RunStatus
TTL = 30.0
DONE = [(None, "QUEUED"), ("QUEUED", "CLAIMED"), ("CLAIMED", "FINALIZING"),
        ("FINALIZING", "SUCCEEDED")]


def stored_events(store: Store, run_id: str) -> list[tuple[str | None, str]]:
    with store.engine.connect() as conn:
        return [(r.from_status, r.to_status) for r in conn.execute(text(
            "SELECT from_status, to_status FROM run_events WHERE run_id = :r "
            "ORDER BY event_id"), {"r": run_id})]


def done_run(store: Store) -> str:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.complete(lease)
    return sub.run_id


def test_a_finished_run_writes_one_event_and_shows_its_whole_history(store: Store) -> None:
    """Submit, claim, complete (the no-op path): the stage hop is the only event; the
    composed history has all four transitions in order, with the claim's and the end's
    worker and token, and ``runs show`` reads the same."""
    run_id = done_run(store)
    assert stored_events(store, run_id) == [("CLAIMED", "FINALIZING")]
    assert events_of(store, run_id) == DONE
    got = details.run_detail(store, run_id, None)["events"]
    assert got == store.get_run(run_id)["events"]
    assert [(e["from_status"], e["to_status"]) for e in got] == DONE
    assert [e["actor"] for e in got] == ["api", "w1", "w1", "w1"]
    assert [e["fencing_token"] for e in got] == [None, 1, 1, 1]
    assert got[0]["message"].startswith("admitted under policy v")
    positions = [e["event_id"] for e in got]
    assert positions == sorted(positions) and len(set(positions)) == 4


def test_a_retried_attempt_ends_on_its_row_and_its_requeue_is_an_event(
        store: Store, clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    store.fail(lease, Reason.PROVIDER_RATE_LIMIT)
    clock.advance(200)
    [lease] = store.claim("w2", lease_ttl=TTL)
    store.complete(lease)
    assert stored_events(store, sub.run_id) == [
        ("CLAIMED", "RUNNING"), ("FAILED_RETRYABLE", "QUEUED"), ("CLAIMED", "FINALIZING")]
    assert events_of(store, sub.run_id) == [
        (None, "QUEUED"), ("QUEUED", "CLAIMED"), ("CLAIMED", "RUNNING"),
        ("RUNNING", "FAILED_RETRYABLE"), ("FAILED_RETRYABLE", "QUEUED"),
        ("QUEUED", "CLAIMED"), ("CLAIMED", "FINALIZING"), ("FINALIZING", "SUCCEEDED")]
    first = attempts_of(store, sub.run_id)[0]
    assert (first.end_to_status, first.end_reason_code) == ("FAILED_RETRYABLE",
                                                           Reason.PROVIDER_RATE_LIMIT)
    assert store.audit() == []


def test_the_reaper_records_the_lost_attempt_on_its_row(store: Store, clock: ManualClock
                                                        ) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w-dead", lease_ttl=TTL)
    store.advance(lease, S.RUNNING)
    clock.advance(TTL + 1)
    assert store.reap_expired_leases() == 1
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.end_from_status, attempt.end_to_status) == ("RUNNING", "STALE_LEASE")
    assert attempt.end_actor not in (None, "w-dead")  # the reaper's, not the worker's
    assert events_of(store, sub.run_id)[3:] == [
        ("RUNNING", "STALE_LEASE"), ("STALE_LEASE", "FAILED_RETRYABLE"),
        ("FAILED_RETRYABLE", "QUEUED")]
    assert store.audit() == []


def _as_old_rows(store: Store, run_id: str) -> None:
    """Rewrite a run as a runlane before 0028 wrote it: every transition an event (in
    the same order), no positions on the run and attempt rows."""
    with store.engine.begin() as conn:
        rows = list(conn.execute(text(
            f"SELECT * FROM {history.ALL} h WHERE run_id = :r ORDER BY event_id"),
            {"r": run_id}).mappings())
        conn.execute(text("DELETE FROM run_events WHERE run_id = :r"), {"r": run_id})
        conn.execute(text("UPDATE runs SET created_seq = NULL, created_tx = NULL "
                          "WHERE run_id = :r"), {"r": run_id})
        conn.execute(text("UPDATE attempts SET claim_seq = NULL, claim_tx = NULL, "
                          "end_seq = NULL, end_tx = NULL WHERE run_id = :r"), {"r": run_id})
        for row in rows:
            conn.execute(text(
                "INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, "
                "to_status, reason_code, fencing_token, message) VALUES (:run_id, "
                ":attempt_no, :at, :actor, :from_status, :to_status, :reason_code, "
                ":fencing_token, :message)"), dict(row))


def test_runs_written_before_0028_show_each_transition_once(store: Store,
                                                              clock: ManualClock) -> None:
    """A database populated by the old code path: its runs keep their claim and end
    events and have no positions; the composed history (and the stream) shows each
    transition once, and the audit stays quiet across old and new runs."""
    old = done_run(store)
    _as_old_rows(store, old)
    assert stored_events(store, old) == DONE
    assert events_of(store, old) == DONE
    new = done_run(store)
    assert events_of(store, new) == DONE
    rows, _ = events_after(store.engine, (0, 0), tenant=None, limit=100)
    assert [(r["from_status"], r["to_status"]) for r in rows
            if r["run_id"] == old] == DONE
    assert [(r["from_status"], r["to_status"]) for r in rows
            if r["run_id"] == new] == DONE
    assert store.audit() == []


def test_the_stream_delivers_claims_and_ends_in_order_and_resumes_from_any_cursor(
        store: Store) -> None:
    """The stream merges the events, the runs' creations and the attempts' claims and
    ends under one cursor: read one at a time from each cursor handed out (a
    reconnect after every event), it delivers what one read delivers, no duplicate, no
    gap; a cursor written before 0028 ("17" on SQLite, "tx-17") still parses."""
    a = done_run(store)
    b = done_run(store)
    everything, _ = events_after(store.engine, (0, 0), tenant=None, limit=100)
    assert [(r["run_id"], r["from_status"], r["to_status"]) for r in everything] == [
        (run, f, t) for run in (a, b) for f, t in DONE]
    one_by_one: list[dict[str, Any]] = []
    cursor = (0, 0)
    while True:
        page, cursor = events_after(store.engine, parse_cursor(format_cursor(cursor))
                                    or (0, 0), tenant=None, limit=1)
        if not page:
            break
        one_by_one.extend(page)
    assert one_by_one == everything
    assert parse_cursor("17") == (0, 17) and parse_cursor("812345-17") == (812345, 17)


def test_failures_and_claims_of_runlane_top_read_the_attempt_rows(store: Store,
                                                                   clock: ManualClock) -> None:
    from runlane.store import activity

    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.fail(lease, Reason.AGENT_FAILED)
    [failure, *_] = activity.failures(store, limit=5, tenant=None, scan=50)
    assert (failure["run_id"], failure["to_status"], failure["reason_code"]) == (
        sub.run_id, "FAILED", Reason.AGENT_FAILED)  # not retryable
    claims = activity.claims(store, window_seconds=3600, cap=100)
    assert claims.total == 1


# --- the audit: each violation planted in the rows that now record it ----------------


def _stale_end(store: Store, clock: ManualClock) -> str:
    """The dead worker's end of attempt 1, written after lease 2 began (invariant 3)."""
    [sub] = submit(store)
    store.claim("w-dead", lease_ttl=TTL)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    clock.advance(100)
    store.claim("w2", lease_ttl=TTL)
    [_, second] = attempts_of(store, sub.run_id)
    execute(store, "UPDATE attempts SET end_actor = NULL, ended_at = :at "
            "WHERE run_id = :r AND attempt_no = 1", r=sub.run_id, at=second.started_at + 1)
    return sub.run_id


def _claim_after_cancel(store: Store, clock: ManualClock) -> str:
    """A claim, on an attempt row, after the run was cancelled (invariant 5)."""
    [sub] = submit(store)
    store.cancel(sub.task_id)
    execute(store, "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, "
            "status, lease_status, lease_expires_at, heartbeat_at, started_at, claim_tx, "
            "claim_seq) VALUES (:r, 1, 1, 'w1', 'RUNNING', 'RELEASED', :t, :t, :t, 0, "
            "(SELECT MAX(event_id) + 1000 FROM run_events))", r=sub.run_id, t=T0 + 5)
    return sub.run_id


def _claim_after_success(store: Store, clock: ManualClock) -> str:
    """A SUCCEEDED run claimed again: the claim on a new attempt row breaks the chain."""
    run_id = done_run(store)
    execute(store, "INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, "
            "status, lease_status, lease_expires_at, heartbeat_at, started_at, claim_tx, "
            "claim_seq) VALUES (:r, 2, 2, 'w9', 'RUNNING', 'RELEASED', :t, :t, :t, 0, "
            "(SELECT MAX(m) + 1000 FROM (SELECT MAX(event_id) AS m FROM run_events UNION ALL "
            "SELECT MAX(end_seq) FROM attempts) x))", r=run_id, t=T0 + 5)
    execute(store, "UPDATE runs SET attempt_count = 2, fencing_token = 2 WHERE run_id = :r",
            r=run_id)
    return run_id


def _illegal_end(store: Store, clock: ManualClock) -> str:
    """An attempt's end recorded as a hop the transition table forbids."""
    run_id = done_run(store)
    execute(store, "UPDATE attempts SET end_from_status = 'SUCCEEDED', "
            "end_to_status = 'RUNNING' WHERE run_id = :r", r=run_id)
    return run_id


def _created_then_admitted(store: Store, clock: ManualClock) -> str:
    """A run whose row records its creation QUEUED, then an event that starts from
    another status: the chain from the run row is checked too."""
    [sub] = submit(store)
    execute(store, "INSERT INTO run_events (run_id, at, actor, from_status, to_status) "
            "VALUES (:r, :t, 'x', 'ADMITTED', 'QUEUED')", r=sub.run_id, t=T0 + 1)
    return sub.run_id


PLANTED = {
    "stale_token_write": _stale_end,
    "claimed_after_cancel": _claim_after_cancel,
    "event_chain_broken": _claim_after_success,
    "illegal_transition": _illegal_end,
    "event_chain_broken (creation)": _created_then_admitted,
}


@pytest.mark.parametrize("check", list(PLANTED))
def test_the_audit_finds_violations_on_the_attempt_and_run_rows(
        store: Store, clock: ManualClock, check: str) -> None:
    run_id = PLANTED[check](store, clock)
    found = {(v.check, v.run_id) for v in store.audit()}
    assert (check.split(" ")[0], run_id) in found, found


def test_the_harness_sees_a_recovery_recorded_on_the_attempt_row(
        store: Store, clock: ManualClock) -> None:
    """The fault harness's report reads when maintenance took a lost lease back: now
    the attempt's end (RUNNING -> STALE_LEASE)."""
    from runlane.store import invariants

    [sub] = submit(store)
    store.claim("w-dead", lease_ttl=TTL)
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    with store.engine.connect() as conn:
        found = list(conn.execute(text(invariants.RECOVERIES)))
    assert [(r.run_id, r.attempt_no) for r in found] == [(sub.run_id, 1)]
