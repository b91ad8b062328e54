"""Batched completion (``Store.complete_many``) on both engines: the same fenced,
table-checked moves as ``Store.complete``, for many leases in one transaction; a
stale, lost or cancelled lease is refused and never stops the others."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import psycopg
import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import DBAPIError

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.states import IllegalTransition, RunStatus
from runlane.errors import CancelRequested, LeaseLost, TransitionRefused
from runlane.store import history
from runlane.store.records import Lease
from runlane.store.store import Store

from .support import attempts_of, events_of, run_row, spec, submit

S = RunStatus
TTL = 30.0


def counters(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {r.scope: r.active for r in conn.execute(
            text("SELECT scope, active FROM limit_counters"))}



def completes_b_refuses_a(store: Store, leases: list[Lease], a: str, b: str) -> Any:
    """Complete both leases: run ``b`` completes, ``a``'s lease is refused as lost and
    changes nothing (the run CLAIMED, its attempt running). Returns ``a``'s attempt."""
    done = store.complete_many(leases)
    assert [lease.run_id for lease in done.completed] == [b]
    assert [(lease.run_id, type(exc)) for lease, exc in done.refused] == [(a, LeaseLost)]
    assert run_row(store, a).status == "CLAIMED"
    [attempt] = attempts_of(store, a)
    assert (attempt.status, attempt.ended_at) == ("RUNNING", None)
    return attempt


def test_a_batch_completes_every_lease_with_its_events_and_attempt(store: Store) -> None:
    subs = submit(store, 3)
    leases = store.claim("w1", limit=3, lease_ttl=TTL)
    store.advance(leases[1], S.FINALIZING)  # one lease further along: a one-hop path
    done = store.complete_many(leases, outcome="no_changes")
    assert [lease.run_id for lease in done.completed] == [lease.run_id for lease in leases]
    assert done.refused == ()
    for sub in subs:
        run = run_row(store, sub.run_id)
        assert (run.status, run.outcome) == ("SUCCEEDED", "no_changes")
        assert run.ended_at is not None
        [attempt] = attempts_of(store, sub.run_id)
        assert (attempt.status, attempt.lease_status) == ("SUCCEEDED", "RELEASED")
        assert attempt.ended_at is not None
        assert events_of(store, sub.run_id)[-2:] == [("CLAIMED", "FINALIZING"),
                                                     ("FINALIZING", "SUCCEEDED")]
    assert all(lease.stage is S.SUCCEEDED for lease in leases)
    assert store.audit() == []


def test_a_stale_lease_in_the_middle_is_refused_and_the_others_complete(
        store: Store, clock: ManualClock) -> None:
    """Invariant 3 in a batch: the middle lease expired, was reaped and its run claimed
    again by another worker; the old holder's batch completes the two others, and
    the middle run, its new lease and its attempts are untouched."""
    first, middle, last = submit(store, 3)
    [stale] = store.claim("w1", run_id=middle.run_id, lease_ttl=10.0)
    live = store.claim("w1", limit=2, lease_ttl=100.0)
    clock.advance(11)
    assert store.reap_expired_leases() == 1
    clock.advance(13)  # past the retry backoff
    [retaken] = store.claim("w2", lease_ttl=100.0)
    assert (retaken.run_id, retaken.fencing_token) == (middle.run_id, 2)

    done = store.complete_many([live[0], stale, live[1]])
    assert [lease.run_id for lease in done.completed] == [live[0].run_id, live[1].run_id]
    assert [(lease.run_id, type(exc)) for lease, exc in done.refused] == [
        (middle.run_id, LeaseLost)]
    assert {run_row(store, s.run_id).status for s in (first, last)} == {"SUCCEEDED"}
    assert run_row(store, middle.run_id).status == "CLAIMED"
    old, new = attempts_of(store, middle.run_id)
    assert (old.status, old.lease_status) == ("FAILED", "EXPIRED")
    assert (new.status, new.lease_status) == ("RUNNING", "ACTIVE")
    assert ("CLAIMED", "FINALIZING") not in events_of(store, middle.run_id)
    assert stale.stage is S.CLAIMED
    store.complete(retaken)  # the live holder still can
    assert run_row(store, middle.run_id).status == "SUCCEEDED"
    assert store.audit() == []


def test_an_expired_but_unreaped_lease_is_refused(store: Store, clock: ManualClock) -> None:
    """The lease fence, alone: the run's token is still this lease's, but the lease has
    expired by the clock (the reaper has not come yet)."""
    a, b = submit(store, 2)
    [expiring] = store.claim("w1", run_id=a.run_id, lease_ttl=10.0)
    [holding] = store.claim("w1", run_id=b.run_id, lease_ttl=100.0)
    clock.advance(11)
    done = store.complete_many([expiring, holding])
    assert [lease.run_id for lease in done.completed] == [b.run_id]
    assert [(lease.run_id, type(exc)) for lease, exc in done.refused] == [(a.run_id, LeaseLost)]
    assert run_row(store, a.run_id).status == "CLAIMED"
    [attempt] = attempts_of(store, a.run_id)
    assert (attempt.lease_status, attempt.ended_at) == ("ACTIVE", None)
    assert store.reap_expired_leases() == 1
    assert store.audit() == []


def test_a_cancelled_run_in_the_batch_is_refused_and_stays_cancelling(store: Store) -> None:
    """Cancellation is monotonic (invariant 5): a run whose cancel was requested while
    its worker finished is never completed by the batch; the others are."""
    subs = submit(store, 3)
    leases = store.claim("w1", limit=3, lease_ttl=TTL)
    victim = leases[1]
    store.cancel(victim.task_id)
    assert run_row(store, victim.run_id).status == "CANCEL_REQUESTED"
    done = store.complete_many(leases)
    assert [lease.run_id for lease in done.completed] == [leases[0].run_id, leases[2].run_id]
    assert [(lease.run_id, type(exc)) for lease, exc in done.refused] == [
        (victim.run_id, CancelRequested)]
    assert run_row(store, victim.run_id).status == "CANCEL_REQUESTED"
    [attempt] = attempts_of(store, victim.run_id)
    assert (attempt.status, attempt.lease_status) == ("RUNNING", "ACTIVE")
    store.acknowledge_cancel(victim)
    store.finish_cancel(victim)
    assert {run_row(store, s.run_id).status for s in subs} == {"SUCCEEDED", "CANCELLED"}
    assert store.audit() == []


def test_a_batch_gives_back_every_slot_and_unhides_a_full_tenant(store: Store) -> None:
    """Invariant 9: the slots the batch's attempts held come back once, in every scope,
    and a tenant that was at its limit is claimable again."""
    store.apply_policy(parse_policy(
        "[concurrency]\nglobal_max_active = 5\nper_tenant_max_active = 2\n"
        "per_repository_max_active = 3\n"), source="test")
    submit(store, 4)
    leases = store.claim("w1", limit=4, lease_ttl=TTL)
    assert len(leases) == 2  # the tenant's limit
    assert counters(store) == {"global": 2, "tenant:acme": 2,
                               "repo:/srv/git/app.git": 2}
    assert store.claim("w2", limit=4, lease_ttl=TTL) == []
    done = store.complete_many(leases)
    assert len(done.completed) == 2
    assert counters(store) == {"global": 0, "tenant:acme": 0, "repo:/srv/git/app.git": 0}
    with store.engine.connect() as conn:
        flags = {r.tenant_at_limit for r in conn.execute(
            text("SELECT tenant_at_limit FROM lanes WHERE tenant = 'acme'"))}
    assert flags == {0}
    assert store.audit() == []
    assert len(store.claim("w2", limit=4, lease_ttl=TTL)) == 2
    assert store.audit() == []


def test_a_refused_lease_gives_back_no_slot(store: Store, clock: ManualClock) -> None:
    """Only the completed leases' slots come back: the refused one's slot stays held
    until the reaper ends its attempt (then it comes back exactly once)."""
    store.apply_policy(parse_policy("[concurrency]\nglobal_max_active = 3\n"), source="test")
    a, b = submit(store, 2)
    [expiring] = store.claim("w1", run_id=a.run_id, lease_ttl=10.0)
    [holding] = store.claim("w1", run_id=b.run_id, lease_ttl=100.0)
    clock.advance(11)
    done = store.complete_many([expiring, holding])
    assert len(done.completed) == 1
    assert counters(store) == {"global": 1}
    assert store.audit() == []
    assert store.reap_expired_leases() == 1
    assert counters(store) == {"global": 0}
    assert store.audit() == []


def test_completing_a_batch_releases_the_tasks_waiting_on_it(store: Store) -> None:
    parents = submit(store, 2)
    child = store.submit([spec(depends_on=[p.task_id for p in parents])])[0]
    assert child.status == "ADMITTED"
    leases = store.claim("w1", limit=2, lease_ttl=TTL)
    assert {lease.run_id for lease in leases} == {p.run_id for p in parents}
    store.complete_many(leases)
    assert run_row(store, child.run_id).status == "QUEUED"
    [lease] = store.claim("w1", lease_ttl=TTL)
    assert lease.run_id == child.run_id
    assert store.audit() == []


def test_a_lease_twice_in_one_batch_and_an_illegal_path_are_refused(store: Store) -> None:
    submit(store, 2)
    first, second = store.claim("w1", limit=2, lease_ttl=TTL)
    twin = replace(first)
    cancelling = replace(second, stage=S.CANCEL_REQUESTED)  # no path to SUCCEEDED
    done = store.complete_many([first, twin, cancelling])
    assert [lease.run_id for lease in done.completed] == [first.run_id]
    assert [(lease.run_id, type(exc)) for lease, exc in done.refused] == [
        (first.run_id, TransitionRefused), (second.run_id, IllegalTransition)]
    assert run_row(store, second.run_id).status == "CLAIMED"
    assert store.complete_many([]) == store.complete_many([]).__class__()
    assert store.audit() == []


def test_complete_of_one_lease_raises_why_it_was_refused(store: Store,
                                                         clock: ManualClock) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=10.0)
    clock.advance(11)
    with pytest.raises(LeaseLost):
        store.complete(lease)
    assert run_row(store, sub.run_id).status == "CLAIMED"
    assert lease.stage is S.CLAIMED


def terminate_the_pooled_session(store: Store) -> None:
    """Terminate, from another store, the session the store's pool holds idle."""
    with store.engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    other = Store(store.url)
    try:
        with other.engine.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:pid)"),
                                {"pid": pid}).scalar_one()
    finally:
        other.close()


def test_a_pooled_session_that_died_is_replaced_without_an_error(db_url: str,
                                                                clock: ManualClock) -> None:
    """No pre-ping: a pooled PostgreSQL session terminated while idle fails on the
    transaction's first statement, and the transaction runs again on a new one. Also
    when that statement is one run on psycopg's own cursor (the submit, the
    one-statement claim and the completion, once the store knows the policy)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL sessions only")
    store = Store(db_url, clock=clock)
    try:
        submit(store, 2)
        terminate_the_pooled_session(store)
        # A pool of one idle connection per checkout: the next transaction meets it.
        leases = store.claim("w1", limit=2, lease_ttl=TTL)
        assert len(leases) == 2
        terminate_the_pooled_session(store)
        assert len(store.complete_many(leases).completed) == 2
        terminate_the_pooled_session(store)
        submit(store, 2)  # first statement: SUBMIT_WRITE_PG (the policy is known)
        terminate_the_pooled_session(store)
        leases = store.claim("w1", limit=2, lease_ttl=TTL)  # CLAIM_ONE_TRIP_PG
        assert len(leases) == 2
        terminate_the_pooled_session(store)
        assert len(store.complete_many(leases).completed) == 2  # COMPLETE_WRITE_PG
    finally:
        store.close()


def test_a_failed_statement_on_psycopgs_cursor_is_sqlalchemys_error(db_url: str) -> None:
    """The claim, submit and completion statements run on psycopg's own cursor; their
    failures still reach callers as SQLAlchemy's DBAPIError, which the CLI, the API
    and the worker catch (a psycopg error would escape them as a traceback)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL only")
    store = Store(db_url)

    @event.listens_for(store.engine, "connect")
    def lock_timeout(dbapi_connection: Any, _: Any) -> None:
        dbapi_connection.execute("SET lock_timeout = 200")
        dbapi_connection.commit()

    try:
        submit(store, 1)
        assert store.claim("w1", lease_ttl=TTL) and submit(store, 1)  # the policy is known
        with store.engine.connect() as holder:
            holder.execute(text("SELECT lane_id FROM lanes FOR UPDATE"))
            with pytest.raises(DBAPIError) as failed:
                store.claim("w1", lease_ttl=TTL)  # CLAIM_ONE_TRIP_PG waits for the lanes
            assert isinstance(failed.value.orig, psycopg.errors.LockNotAvailable)
            assert "claimed AS (" in str(failed.value.statement)
        assert len(store.claim("w1", lease_ttl=TTL)) == 1  # the lock is gone: claimed
    finally:
        store.close()


def event_rows(store: Store, run_id: str) -> list[tuple[str, str, int, int, str, float]]:
    with store.engine.connect() as conn:
        return [(r.from_status, r.to_status, r.attempt_no, r.fencing_token, r.actor, r.at)
                for r in conn.execute(text(
                    f"SELECT * FROM {history.ALL} h WHERE run_id = :r AND from_status IN "
                    "('CLAIMED', 'FINALIZING') ORDER BY event_id"), {"r": run_id})]


def test_each_hop_is_one_event_with_the_lease_that_made_it(store: Store,
                                                           clock: ManualClock) -> None:
    """Invariant 6: the history shows every hop, in order, each with the attempt, the
    fencing token and the worker of the lease that wrote it, at the write's time."""
    a, b = submit(store, 2)
    [first] = store.claim("w1", run_id=a.run_id, lease_ttl=TTL)
    [second] = store.claim("w2", run_id=b.run_id, lease_ttl=TTL)
    store.advance(second, S.FINALIZING)
    clock.advance(1)
    done = store.complete_many([first, second])
    assert len(done.completed) == 2
    at = clock.now()
    assert event_rows(store, a.run_id) == [
        ("CLAIMED", "FINALIZING", 1, first.fencing_token, "w1", at),
        ("FINALIZING", "SUCCEEDED", 1, first.fencing_token, "w1", at)]
    assert event_rows(store, b.run_id)[-1] == (
        "FINALIZING", "SUCCEEDED", 1, second.fencing_token, "w2", at)
    assert len(event_rows(store, b.run_id)) == 2  # CLAIMED -> FINALIZING was advance's
    assert store.audit() == []


def test_a_lease_whose_run_moved_to_a_newer_token_is_refused(store: Store) -> None:
    """The fencing token guard alone: the run's token moved past the lease's while the
    lease's attempt still looks ACTIVE and unexpired (a split brain the lease fence
    cannot see); the write with the old token changes nothing."""
    a, b = submit(store, 2)
    leases = store.claim("w1", limit=2, lease_ttl=TTL)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE runs SET fencing_token = fencing_token + 1 "
                          "WHERE run_id = :r"), {"r": a.run_id})
    attempt = completes_b_refuses_a(store, leases, a.run_id, b.run_id)
    assert attempt.lease_status == "ACTIVE"
    assert ("CLAIMED", "FINALIZING") not in events_of(store, a.run_id)


def test_a_revoked_lease_is_refused(store: Store) -> None:
    """The lease fence on the lease's status: the run's token is still the lease's and
    its expiry is ahead, but the lease is no longer ACTIVE."""
    a, b = submit(store, 2)
    leases = store.claim("w1", limit=2, lease_ttl=TTL)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET lease_status = 'REVOKED' WHERE run_id = :r"),
                     {"r": a.run_id})
    completes_b_refuses_a(store, leases, a.run_id, b.run_id)



def complete_recording(store: Store, leases: list[Lease]) -> tuple[Any, list[tuple[str, Any]]]:
    """``complete_many(leases)``, and every (statement, parameters) it sent."""
    sent: list[tuple[str, Any]] = []

    def record(conn: object, cursor: object, statement: str, params: Any,
               *rest: object) -> None:
        sent.append((statement, params))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        done = store.complete_many(leases)
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    return done, sent


def test_the_common_path_is_one_statement_on_postgresql(store: Store) -> None:
    """No slots held, no dependents: the compare-and-set, the events and the attempts
    ended go in one statement (COMPLETE_WRITE_PG); SQLite sends them one by one (the
    stage hops' events, the attempts ended, their ends' positions reserved and
    recorded: store/history.py)."""
    submit(store, 3)
    leases = store.claim("w1", limit=3, lease_ttl=TTL)
    done, statements = complete_recording(store, leases)
    sent = [s for s, _ in statements if not s.startswith("BEGIN")]  # SQLite's IMMEDIATE
    assert len(done.completed) == 3
    assert len(sent) == (1 if store.is_postgres else 5)


def test_a_batch_locks_all_its_counters_once_in_scope_order(store: Store) -> None:
    """Invariant 9's lock order: the batch's counters are locked together, in scope
    order, before any slot is given back. Run by run, the first run's repository
    (repo:/srv/git/z.git) would be locked before the second's (repo:/srv/git/a.git):
    the opposite of a claim's order, a deadlock with a claim holding the lower one."""
    store.apply_policy(parse_policy(
        "[concurrency]\nglobal_max_active = 5\nper_repository_max_active = 3\n"),
        source="test")
    [late] = submit(store, repo="/srv/git/z.git")
    [early] = submit(store, repo="/srv/git/a.git")
    leases = store.claim("w1", limit=2, lease_ttl=TTL)
    assert sorted(lease.run_id for lease in leases) == sorted([late.run_id, early.run_id])
    assert late.run_id < early.run_id  # the batch's run order puts repo z first
    done, statements = complete_recording(store, leases)
    sent: list[tuple[str, list[str]]] = []
    for statement, params in statements:
        if "FROM limit_counters" in statement and "SELECT scope, active" in statement:
            values = params["scopes"] if isinstance(params, dict) else list(params)
            sent.append(("lock", list(values)))
        elif statement.lstrip().startswith("UPDATE limit_counters"):
            sent.append(("give", []))
    assert len(done.completed) == 2
    scopes = ["global", "repo:/srv/git/a.git", "repo:/srv/git/z.git"]
    # PostgreSQL gives the whole batch's slots back in one statement, SQLite run by run.
    gives = [("give", [])] * (1 if store.is_postgres else 2)
    assert sent == [("lock", scopes), *gives]
    assert counters(store) == {scope: 0 for scope in scopes}
    assert store.audit() == []
