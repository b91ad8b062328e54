"""Batch submit on both engines: the writes of a submit (PostgreSQL: one statement)
insert only the runs of tasks really inserted, count them into their lanes, place
new lanes at the virtual time, wake only the queues that got queued runs, lock lanes
in lane_id order; admission is decided once per distinct request when the policy
needs no usage; a policy applied before the write is the one the run records."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq
from sqlalchemy import event, text

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.states import RunStatus
from runlane.store.core import WAKEUP_CHANNEL
from runlane.store.lanes import JOIN_AHEAD
from runlane.store.store import Store
from runlane.store.wakeup import Listener, libpq_url

from .conftest import truncate_pg
from .support import events_of, execute, run_row, spec, wait_for_a_lock_wait

S = RunStatus


def lanes(store: Store) -> dict[tuple[str, int, str], Any]:
    with store.engine.connect() as conn:
        return {(r.queue, r.priority, r.tenant): r for r in conn.execute(text(
            "SELECT lane_id, queue, priority, tenant, queued_count, pass AS pass_ FROM lanes"))}


def apply(store: Store, source: str) -> None:
    store.apply_policy(parse_policy(source), source="test")


def test_a_batch_with_repeated_keys_and_several_lanes_counts_only_what_it_inserts(
        store: Store) -> None:
    [before] = store.submit([spec(idempotency_key="k1")])
    subs = store.submit([
        spec(idempotency_key="k1"),  # taken by an earlier submit (the same request)
        spec(idempotency_key="k2"),
        spec(idempotency_key="k2"),  # a repeat inside the batch
        spec(),
        spec(tenant="globex", queue="java", idempotency_key="k1"),  # another tenant's k1
        spec(tenant="globex", priority=10),
        spec(queue="java", depends_on=[before.task_id]),  # ADMITTED (waits for k1's)
    ])
    assert [s.created for s in subs] == [False, True, False, True, True, True, True]
    assert (subs[0].task_id, subs[0].run_id, subs[0].status) == (
        before.task_id, before.run_id, S.QUEUED.value)
    # A replay answers with the first submit's size (it said 0: a review of 2026-12-02).
    assert (subs[0].payload_bytes, subs[0].truncated_sections) == (
        before.payload_bytes, before.truncated_sections) and before.payload_bytes > 0
    assert subs[2].run_id == subs[1].run_id
    assert [s.status for s in subs[3:]] == [S.QUEUED.value] * 3 + [S.ADMITTED.value]
    by_lane = {key: lane.queued_count for key, lane in lanes(store).items()}
    assert by_lane == {("default", 100, "acme"): 3, ("java", 100, "globex"): 1,
                       ("default", 10, "globex"): 1, ("java", 100, "acme"): 0}
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM runs")).scalar_one() == 6
        assert conn.execute(text("SELECT COUNT(*) FROM tasks")).scalar_one() == 6
        # One creation per run: the 5 admitted QUEUED on their rows (migration 0028),
        # the one ADMITTED (waiting for a dependency) as an event.
        assert conn.execute(text("SELECT COUNT(*) FROM run_events")).scalar_one() == 1
        assert conn.execute(text("SELECT COUNT(*) FROM runs WHERE created_seq IS NOT NULL")
                            ).scalar_one() == 5
    for s in subs[1:]:
        assert events_of(store, s.run_id) == [(None, s.status)]
    assert store.audit() == []


def test_new_lanes_join_at_the_virtual_time_of_their_queue_and_priority(
        store: Store) -> None:
    store.submit([spec(tenant="a"), spec(tenant="c")])
    execute(store, "UPDATE lanes SET pass = 5.0 WHERE tenant = 'a'")
    execute(store, "UPDATE lanes SET pass = 1.0, queued_count = 0 WHERE tenant = 'c'")
    execute(store, "UPDATE runs SET status = 'CANCELLED' WHERE tenant = 'c'")
    store.submit([spec(tenant="b"), spec(tenant="d"), spec(tenant="c"), spec(tenant="a"),
                  spec(tenant="b", priority=7)])
    got = {key: (lane.queued_count, lane.pass_) for key, lane in lanes(store).items()}
    head = 5.0 - JOIN_AHEAD
    assert got == {
        ("default", 100, "a"): (2, 5.0),  # had work: keeps its pass
        ("default", 100, "b"): (1, head),  # new: just ahead of the head
        ("default", 100, "c"): (1, head),  # empty, rejoins at the head, not behind it
        ("default", 100, "d"): (1, head),
        ("default", 7, "b"): (1, 0.0),  # the first lane of its priority
    }
    assert store.audit() == []


def test_lanes_remember_a_pass_ahead_of_the_head(store: Store) -> None:
    store.submit([spec(tenant="a"), spec(tenant="c")])
    execute(store, "UPDATE lanes SET pass = 5.0 WHERE tenant = 'a'")
    execute(store, "UPDATE lanes SET pass = 9.0, queued_count = 0 WHERE tenant = 'c'")
    execute(store, "UPDATE runs SET status = 'CANCELLED' WHERE tenant = 'c'")
    store.submit([spec(tenant="c")])
    assert lanes(store)[("default", 100, "c")].pass_ == 9.0  # no credit banked, none lost


def test_admission_is_decided_per_distinct_request(store: Store) -> None:
    apply(store, "[[rules]]\nwhen = { user = 'bob' }\naction = 'deny'\n"
                 "[[rules]]\nwhen = { repo = '*/slow*' }\naction = 'defer'\n"
                 "retry_after_seconds = 60\n")
    batch = [spec(user="alice"), spec(user="bob"), spec(user="alice"), spec(user="bob"),
             spec(repo="/srv/git/slow.git"), spec(requires={"gpu": 1}),
             spec(requires={"gpu": 1}, user="bob"), spec(requires={"gpu": 2})]
    subs = store.submit(batch)
    assert [s.status for s in subs] == [
        S.QUEUED.value, S.POLICY_DENIED.value, S.QUEUED.value, S.POLICY_DENIED.value,
        S.WAITING_CAPACITY.value, S.QUEUED.value, S.POLICY_DENIED.value, S.QUEUED.value]
    with store.engine.connect() as conn:
        routes = {r.run_id: r.route_key for r in conn.execute(
            text("SELECT run_id, route_key FROM runs"))}
    assert routes[subs[5].run_id] != routes[subs[7].run_id]
    assert store.audit() == []


def test_requirements_that_are_not_plain_json_are_decided_on_their_own(
        store: Store) -> None:
    subs = store.submit([spec(requires={"tools": {"git", "maven"}}),
                         spec(requires={"tools": ["maven", "git"]}),
                         spec(requires={"tools": {"git", "maven"}})])
    assert [s.status for s in subs] == [S.QUEUED.value] * 3
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT DISTINCT route_key FROM runs")).scalars().all() == [
            '{"tools":["git","maven"]}']


def test_admission_with_usage_is_decided_run_by_run(store: Store) -> None:
    apply(store, "[tenants.acme]\nmax_queued = 2\n")
    subs = store.submit([spec() for _ in range(4)])
    assert Counter(s.status for s in subs) == {S.QUEUED.value: 2, S.WAITING_CAPACITY.value: 2}
    assert [s.reason_code for s in subs[2:]] == ["TENANT_QUEUE_FULL"] * 2


# --- PostgreSQL: the wake-up and the lock order ---------------------------------------


@pytest.fixture
def pg_store(pg_url: str) -> Any:
    truncate_pg(pg_url)
    store = Store(pg_url)
    yield store
    store.close()


def test_submit_wakes_only_the_queues_that_got_queued_runs(pg_store: Store,
                                                           pg_url: str) -> None:
    apply(pg_store, "[[rules]]\nwhen = { queue = 'python' }\naction = 'deny'\n")
    pg_store.submit([spec(queue="ruby", idempotency_key="k")])
    with Listener(pg_url) as listener:
        assert listener.wait_connected()
        pg_store.submit([spec(queue="java"), spec(queue="java"), spec(queue="python"),
                         spec(queue="ruby", idempotency_key="k"), spec(queue="go")])
        woken: list[str] = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            woken += [w.payload for w in listener.wait(0.1) if w.channel == WAKEUP_CHANNEL]
    assert sorted(woken) == ["go", "java"]


def test_submit_locks_lanes_in_lane_id_order(pg_store: Store, pg_url: str) -> None:
    """A claim locks lanes in lane_id order; so must a submit, else a claim holding
    the first lane and a submit holding the second wait for each other. Here lane
    "zeta" has the smaller id but the larger key."""
    pg_store.submit([spec(tenant="zeta")])
    pg_store.submit([spec(tenant="alpha")])
    ids = {key[2]: lane.lane_id for key, lane in lanes(pg_store).items()}
    assert ids["zeta"] < ids["alpha"]
    errors: list[BaseException] = []
    with psycopg.connect(libpq_url(pg_url)) as claim:
        claim.execute("SET lock_timeout = '5s'")
        claim.execute("SELECT 1 FROM lanes WHERE lane_id = %s FOR UPDATE", (ids["zeta"],))

        def submit() -> None:
            try:
                pg_store.submit([spec(tenant="alpha"), spec(tenant="zeta")])
            except BaseException as exc:  # reported below
                errors.append(exc)

        worker = threading.Thread(target=submit)
        worker.start()
        wait_for_a_lock_wait(pg_url, "new_tasks", "the claim's lane")
        # The claim goes on to its second lane: free, since the submit holds none yet.
        claim.execute("SELECT 1 FROM lanes WHERE lane_id = %s FOR UPDATE", (ids["alpha"],))
        claim.commit()
    worker.join(10)
    assert not worker.is_alive() and errors == []
    assert {key[2]: lane.queued_count for key, lane in lanes(pg_store).items()} == {
        "zeta": 2, "alpha": 2}


def test_submits_sharing_idempotency_keys_insert_them_in_key_order(pg_store: Store,
                                                                    pg_url: str) -> None:
    """Another transaction holds key k1 (inserted, not committed) and will insert k2;
    a submit of [k2, k1] must wait on k1 before it takes k2, or each waits for the
    other."""
    pg_store.submit([spec(idempotency_key="seed")])  # its lane and route exist
    errors: list[BaseException] = []
    results: list[Any] = []
    with psycopg.connect(libpq_url(pg_url)) as other:
        other.execute("SET lock_timeout = '5s'")
        insert = ("INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority,"
                  " idempotency_key, max_attempts, context, truncated_sections, payload_bytes,"
                  " created_at) VALUES (%s, 'acme', 'r', 'p', 'default', 100, %s, 3, '{}',"
                  " '[]', 1, 0)")
        other.execute(insert, ("00000000-0000-7000-8000-000000000001", "k1"))
        other.execute("INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority,"
                      " status, max_attempts, visible_at, created_at, updated_at)"
                      " VALUES ('r1', '00000000-0000-7000-8000-000000000001', 'acme', 'r',"
                      " 'default', 100, 'CANCELLED', 3, 0, 0, 0)")

        def submit() -> None:
            try:
                results.extend(pg_store.submit([spec(idempotency_key="k2"),
                                                spec(idempotency_key="k1")]))
            except BaseException as exc:  # reported below
                errors.append(exc)

        worker = threading.Thread(target=submit)
        worker.start()
        wait_for_a_lock_wait(pg_url, "new_tasks", "k1")
        other.execute(insert, ("00000000-0000-7000-8000-000000000002", "k2"))
        other.execute("INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority,"
                      " status, max_attempts, visible_at, created_at, updated_at)"
                      " VALUES ('r2', '00000000-0000-7000-8000-000000000002', 'acme', 'r',"
                      " 'default', 100, 'CANCELLED', 3, 0, 0, 0)")
        other.commit()
    worker.join(10)
    assert not worker.is_alive() and errors == []
    assert [(r.run_id, r.created) for r in results] == [("r2", False), ("r1", False)]


# --- PostgreSQL: a submit of one write runs without a transaction ---------------------


def traced_round_trips(store: Store, path: Path, action: Callable[[], object]) -> list[str]:
    """What the store's connections send to the server while ``action`` runs, one
    entry per round trip: the text of a simple query (BEGIN, COMMIT), or "statement"
    for an extended-protocol one (it ends with a Sync and waits for its reply)."""
    sent = path.read_text()
    action()
    trips = []
    for line in path.read_text()[len(sent):].splitlines():
        parts = line.split("\t")
        if len(parts) > 2 and parts[0] == "F" and parts[2] in ("Query", "Sync"):
            trips.append(parts[3].strip(" \"") if parts[2] == "Query" else "statement")
    return trips


@pytest.fixture
def traced(pg_url: str, tmp_path: Path) -> Iterator[tuple[Store, Path]]:
    """A store whose every PostgreSQL connection writes libpq's protocol trace."""
    truncate_pg(pg_url)
    store = Store(pg_url)
    path = tmp_path / "libpq.trace"
    path.touch()
    handles: list[Any] = []

    @event.listens_for(store.engine, "connect")
    def trace(dbapi_connection: Any, _record: Any) -> None:
        handles.append(path.open("a"))
        dbapi_connection.pgconn.trace(handles[-1].fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)

    yield store, path
    store.close()
    for handle in handles:
        handle.close()


def test_a_submit_without_dependencies_is_one_round_trip_with_no_begin_or_commit(
        traced: tuple[Store, Path]) -> None:
    """SUBMIT_WRITE_PG is the submit's one write, atomic by itself: in autocommit it
    commits as it ends, so psycopg sends neither BEGIN nor COMMIT (nor a ROLLBACK when
    the pool takes the connection back). A store's first submit reads the time and the
    policy version (SUBMIT_CONTEXT); later ones decide under the version the last
    write found and send the write alone. The pooled connection is transactional
    again for the next caller (a heartbeat's transaction here)."""
    store, path = traced
    with store.engine.connect() as conn:  # connected: the dialect's first queries
        conn.execute(text("SELECT 1"))
    trips = traced_round_trips(store, path, lambda: store.submit([spec()]))
    assert trips == ["statement", "statement"]  # SUBMIT_CONTEXT, SUBMIT_WRITE_PG
    trips = traced_round_trips(store, path, lambda: store.submit([spec(), spec(queue="b")]))
    assert trips == ["statement"]  # SUBMIT_WRITE_PG
    leases = store.claim("w1")
    trips = traced_round_trips(store, path, lambda: store.heartbeat("w1", leases))
    assert trips[0].startswith("BEGIN") and trips[-1] == "COMMIT"
    with store.engine.connect() as conn:
        assert conn.connection.dbapi_connection is not None
        assert conn.connection.dbapi_connection.autocommit is False


def test_a_claim_of_up_to_n_runs_is_one_round_trip(traced: tuple[Store, Path]) -> None:
    """Issue 5: one round trip claims up to N runs and opens their attempts and leases
    (CLAIM_ONE_TRIP_PG, autocommit: no BEGIN, no COMMIT). A store's first claim reads
    the policy in force first; a claim of a tenant over its daily budget, or of a run
    admitted under another policy, is a transaction (the decision must be made again)."""
    store, path = traced
    store.submit([spec(tenant=f"t{i % 4}") for i in range(30)])
    claimed: list[Any] = []
    trips = traced_round_trips(store, path, lambda: claimed.extend(store.claim("w1")))
    # The policy version, the served routes (both cached), CLAIM_ONE_TRIP_PG.
    assert len(trips) == 3 and not {"BEGIN", "COMMIT"} & set(trips), trips
    trips = traced_round_trips(store, path,
                               lambda: claimed.extend(store.claim("w1", limit=10)))
    assert trips == ["statement"] and len(claimed) == 11
    # Four equal tenants share the eleven slots fairly across both claims.
    assert sorted(Counter(lease.tenant for lease in claimed).values()) == [2, 3, 3, 3]
    with store.engine.connect() as conn:
        live = conn.execute(text(
            "SELECT COUNT(*) FROM attempts a JOIN runs r ON r.run_id = a.run_id "
            "WHERE a.lease_status = 'ACTIVE' AND r.status = 'CLAIMED' "
            "AND a.worker_id = 'w1'")).scalar_one()
    assert live == 11
    assert store.audit() == []


def test_a_submit_decided_without_the_time_is_stamped_once_by_the_database_clock(
        pg_store: Store) -> None:
    """A submit that read no time before its write stamps every row with one reading
    of the database clock (created_at, visible_at, the event, a denied run's
    ended_at), as SUBMIT_CONTEXT's time stamped them before."""
    apply(pg_store, "[[rules]]\nwhen = { queue = 'python' }\naction = 'deny'\n")
    pg_store.submit([spec()])  # the store has seen the version in force
    before = time.time()
    queued, denied = pg_store.submit([spec(), spec(queue="python")])
    after = time.time()
    assert (queued.status, denied.status) == (S.QUEUED.value, S.POLICY_DENIED.value)
    with pg_store.engine.connect() as conn:
        stamps = conn.execute(text(
            "SELECT r.created_at, r.updated_at, r.visible_at, t.created_at AS task_at,"
            " e.at, r.ended_at, r.status FROM runs r JOIN tasks t USING (task_id)"
            " JOIN run_events e USING (run_id) WHERE r.run_id IN (:a, :b)"),
            {"a": queued.run_id, "b": denied.run_id}).all()
    [at] = {r.created_at for r in stamps}
    assert before <= at <= after
    for r in stamps:
        assert (r.updated_at, r.visible_at, r.task_at, r.at) == (at, at, at, at)
        assert r.ended_at == (at if r.status == S.POLICY_DENIED.value else None)


def test_a_deferral_under_the_version_seen_reads_the_time(store: Store,
                                                          clock: ManualClock) -> None:
    """A DEFER's retry-after is the time plus the wait: a submit that decided without
    the time reads it and decides again."""
    apply(store, "[[rules]]\nwhen = { queue = 'later' }\naction = 'defer'\n"
                 "retry_after_seconds = 3600\n")
    store.submit([spec()])
    [deferred] = store.submit([spec(queue="later")])
    assert deferred.status == S.WAITING_CAPACITY.value
    assert run_row(store, deferred.run_id).visible_at == clock.now() + 3600


def test_a_submit_with_dependencies_stays_one_transaction(
        traced: tuple[Store, Path]) -> None:
    """Dependencies are more writes (their rows, the release of a run whose
    dependencies already ended): that submit keeps its BEGIN … COMMIT."""
    store, path = traced
    [parent] = store.submit([spec()])
    trips = traced_round_trips(
        store, path, lambda: store.submit([spec(depends_on=[parent.task_id])]))
    assert trips[0].startswith("BEGIN") and trips[-1] == "COMMIT"
    assert len(trips) > 4


def test_a_submit_on_a_pooled_session_that_died_runs_on_a_new_one(pg_store: Store,
                                                                    pg_url: str) -> None:
    """The autocommit submit keeps the stale-connection retry: its first statement
    fails before anything reached the server, and the submit runs again."""
    pg_store.submit([spec()])
    with pg_store.engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with psycopg.connect(libpq_url(pg_url), autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    [sub] = pg_store.submit([spec(idempotency_key="after")])
    assert sub.created and sub.status == S.QUEUED.value


@pytest.mark.parametrize("with_dependency", [False, True], ids=["no_dependency", "dependency"])
def test_a_policy_applied_between_the_decision_and_the_write_is_the_one_recorded(
        pg_store: Store, pg_url: str, with_dependency: bool) -> None:
    """The write reads its own snapshot: when a newer policy version is in force by
    then, it writes nothing and the submit decides again, so the run records the
    version in force and that version's decision."""
    apply(pg_store, "[[rules]]\nwhen = { queue = 'ruby' }\naction = 'deny'\n")
    [parent] = pg_store.submit([spec()])
    other = Store(pg_url)  # another process applies a policy
    applied: list[int] = []

    @event.listens_for(pg_store.engine, "before_cursor_execute")
    def between(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "new_tasks" in statement and not applied:
            applied.append(other.apply_policy(parse_policy(
                "[[rules]]\nwhen = { queue = 'python' }\naction = 'deny'\n"),
                source="test").version)

    try:
        [sub] = pg_store.submit([spec(queue="python", depends_on=[parent.task_id]
                                      if with_dependency else [])])
    finally:
        event.remove(pg_store.engine, "before_cursor_execute", between)
        other.close()
    assert applied == [2]
    assert sub.status == S.POLICY_DENIED.value
    run = run_row(pg_store, sub.run_id)
    assert (run.status, run.policy_version) == (S.POLICY_DENIED.value, 2)
    assert events_of(pg_store, sub.run_id) == [(None, S.POLICY_DENIED.value)]
    with pg_store.engine.connect() as conn:  # nothing was written under version 1
        assert conn.execute(text("SELECT COUNT(*) FROM tasks")).scalar_one() == 2
        assert conn.execute(text("SELECT COUNT(*) FROM runs")).scalar_one() == 2
