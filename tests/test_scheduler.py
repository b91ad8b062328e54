"""The scheduler on both engines: admission, policy at claim, limits, fairness,
priority, routing, budgets, dependencies, and the seed 003 starvation cases."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.errors import CostLimitExceeded, LeaseLost, PolicyDenied
from runlane.services.scheduler import PassTrigger
from runlane.store import lanes_sql, scheduling
from runlane.store.lanes import BLOCKED_LANE_RECHECK_SECONDS
from runlane.store.store import Store

from .conftest import CLAIM_PATHS, claim_path_database, truncate_pg
from .support import (
    assert_planned_once,
    events_of,
    execute,
    run_row,
    spec,
    submit,
    wait_for_a_lock_wait,
)

S = RunStatus
TTL = 30.0


@pytest.fixture(params=CLAIM_PATHS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> str:
    """Both engines, and PostgreSQL's claims both ways: in one statement where they can
    (the default; SchedulingMixin._claim_in_one_trip) and always as a transaction (the
    form every claim falls back to, and SQLite's)."""
    return claim_path_database(request, tmp_path, monkeypatch)


def apply(store: Store, text_: str) -> int:
    return store.apply_policy(parse_policy(text_), source="test").version


def statuses(store: Store) -> Counter[str]:
    with store.engine.connect() as conn:
        return Counter(r.status for r in conn.execute(text("SELECT status FROM runs")))


# --- policy versions and admission ---------------------------------------------------


def test_policy_versions_are_numbered_and_unchanged_files_make_none(store: Store) -> None:
    assert store.current_policy()[0] == 0
    first = store.apply_policy(parse_policy("[concurrency]\nglobal_max_active = 5\n"),
                               source="a.toml")
    again = store.apply_policy(parse_policy("[concurrency]\n\nglobal_max_active=5\n"),
                               source="b.toml")
    changed = store.apply_policy(parse_policy("[concurrency]\nglobal_max_active = 6\n"),
                                 source="a.toml")
    assert (first.version, first.created) == (1, True)
    assert (again.version, again.created) == (1, False)
    assert (changed.version, changed.created) == (2, True)
    record = store.policy_record()
    assert record is not None and record["version"] == 2
    assert record["policy"]["concurrency"]["global_max_active"] == 6


def test_admission_decisions_are_recorded_on_the_run(store: Store, clock: ManualClock) -> None:
    version = apply(store, """
[[repositories]]
match = "*/payments*"
autonomous_agents = false
message = "analysis only"

[tenants.broke]
daily_model_budget_usd = 1.0
""")
    admitted = submit(store, repo="/srv/git/app.git")[0]
    denied = submit(store, repo="/srv/git/payments.git")[0]
    execute(store, "INSERT INTO tenant_spend (tenant, day, usd) VALUES ('broke', :d, 2.0)",
            d="2027-01-15")
    deferred = submit(store, tenant="broke")[0]

    assert admitted.status == S.QUEUED.value
    row = run_row(store, admitted.run_id)
    assert row.policy_version == version
    assert denied.status == S.POLICY_DENIED.value
    assert denied.reason_code == Reason.REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT
    assert run_row(store, denied.run_id).message == "analysis only"
    assert deferred.status == S.WAITING_CAPACITY.value
    assert deferred.reason_code == Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED
    # Deferred until the next UTC day; the run records the decision.
    shown = store.get_run(deferred.run_id)
    assert run_row(store, deferred.run_id).visible_at == 1800057600.0
    assert shown["admission"]["decision"] == "DEFER"
    assert shown["admission"]["policy_version"] == version
    # A deferred run is never claimed before its retry-after, and a scheduler pass
    # after it re-admits it (the spend belongs to the day before).
    assert store.claim("w1", limit=10, lease_ttl=TTL)[0].run_id == admitted.run_id
    assert store.schedule_pass() == {"readmitted": 0, "denied": 0, "deferred": 0,
                                     "held_for_approval": 0,
                                     "dependencies_resolved": 0, "queued_readmitted": 0,
                                     "queued_terms_changed": 0, "queued_skipped": 0}
    clock.set(1800057600.0 + 1)
    assert store.schedule_pass()["readmitted"] == 1
    assert run_row(store, deferred.run_id).status == S.QUEUED.value


def test_drill_6_policy_denies_while_queued_the_run_never_executes(store: Store) -> None:
    """Policy checked at claim: the run admitted under v1 is refused under v2, and its
    record names both versions. The claimer has claimed under v1 before (on PostgreSQL
    its claims are then one statement, which must see that v1 is no longer in force)."""
    v1 = apply(store, "[defaults]\nqueue = 'default'\n")
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []  # the claimer saw v1
    run = submit(store)[0]
    v2 = apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'deny'\n"
                      "reason_code = 'TENANT_SUSPENDED'\nmessage = 'suspended'\n")
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    row = run_row(store, run.run_id)
    assert (row.status, row.reason_code) == (S.POLICY_DENIED.value, "TENANT_SUSPENDED")
    assert f"policy v{v2}" in row.message and f"v{v1}" in row.message
    assert row.attempt_count == 0  # never executed


def test_a_claims_denials_move_their_lanes_with_its_own_in_lane_id_order(
        store: Store) -> None:
    """PostgreSQL: runs a claim denies, defers or prunes leave their lanes in the
    claim's one lane write (after its counters, in lane_id order), not one by one as
    admission meets them. A denial's lane write came first: two claims, each denying
    a run in the lane the other claimed from, deadlocked (found by
    test_the_backlog_pass_races_4_claimer_processes_and_every_invariant_holds)."""
    if not store.is_postgres:
        pytest.skip("row locks (SQLite serializes writers on the file)")
    apply(store, "[concurrency]\nper_tenant_max_active = 5\n")
    frozen = submit(store, 2, tenant="alpha", repo="/srv/git/payments.git")
    kept = submit(store, 2, tenant="beta")
    gone = submit(store, 1, tenant="gamma", repo="/srv/git/payments.git")
    apply(store, "[concurrency]\nper_tenant_max_active = 5\n[[rules]]\n"
                 "when = { repo = '*payments*' }\naction = 'deny'\n")
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        statements.append(" ".join(statement.split()))

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        claimed = store.claim("w1", limit=5, lease_ttl=TTL)  # a transaction: v2 is new
        assert {lease.run_id for lease in claimed} == {r.run_id for r in kept}
        assert store.claim("w1", limit=5, lease_ttl=TTL) == []  # nothing left
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    lane_leave = " ".join(lanes_sql.LANE_LEAVE.split()).split(":n")[0]
    assert not [s for s in statements if s.startswith(lane_leave)], \
        "a denied run's lane was written before the claim's counters"
    for run in [*frozen, *gone]:
        assert run_row(store, run.run_id).status == S.POLICY_DENIED.value
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT SUM(queued_count) FROM lanes")).scalar() == 0
    assert store.audit() == []


def test_a_scheduler_page_moves_its_lanes_in_lane_id_order(
        store: Store, clock: ManualClock) -> None:
    """A pass that queues deferred runs of several lanes writes each lane once, in
    lane_id order, at the end of its page (as a claim locks them), not in the runs'
    order: lanes taken out of order by one transaction deadlock with a claim taking
    them in order."""
    apply(store, "[[rules]]\nwhen = { repo = '*app*' }\naction = 'defer'\n"
                 "retry_after_seconds = 60\n")
    for tenant in ("a", "b", "c", "a"):  # created in this order: lanes 1, 2, 3, 1
        submit(store, tenant=tenant)
        clock.advance(1)
    apply(store, "[defaults]\nqueue = 'default'\n")  # the rule is gone
    entered: list[int] = []

    def record(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if " ".join(statement.split()).startswith("UPDATE lanes SET pass = CASE"):
            entered.append(params["lane_id"] if isinstance(params, dict) else params[-1])

    event.listen(store.engine, "before_cursor_execute", record)
    try:
        assert store.schedule_pass(not_yet_due=True)["readmitted"] == 4
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert len(entered) == 3 and entered == sorted(entered), entered
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT SUM(queued_count) FROM lanes")).scalar() == 4
    assert store.audit() == []


def test_a_policy_change_admits_the_queued_backlog_again(
        store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a policy change the scheduler's pass admits every run queued under an older
    version again: one the new policy denies ends POLICY_DENIED now, not at its claim
    (its message names both versions), one it defers waits, and one it admits records
    the new decision and the version it was first admitted under. Paged through the
    dispatch index (2 runs a page here, equal created_at across pages and lanes)."""
    from runlane.services.scheduler import Scheduler

    monkeypatch.setattr(scheduling, "QUEUED_SCAN", 2)
    v1 = apply(store, "[defaults]\nqueue = 'default'\n")
    kept = [*submit(store, 2), *submit(store, 2, tenant="zeta")]
    denied = submit(store, 2, repo="/srv/git/payments.git")
    deferred = submit(store, tenant="beta")[0]
    v2 = apply(store, """
[[rules]]
when = { repo = '*payments*' }
action = 'deny'
reason_code = 'REPOSITORY_FROZEN'
message = 'frozen'

[[rules]]
when = { tenant = 'beta' }
action = 'defer'
retry_after_seconds = 3600
""")
    scheduler = Scheduler(store)
    # Its first pass: the policy may have changed while no scheduler ran.
    counts = scheduler.run_once()
    assert (counts["queued_readmitted"], counts["denied"], counts["deferred"]) == (4, 2, 1)
    for run in kept:
        row = run_row(store, run.run_id)
        assert (row.status, row.policy_version) == (S.QUEUED.value, v2)
        admission = store.get_run(run.run_id)["admission"]
        assert (admission["decision"], admission["policy_version"]) == ("ADMIT", v2)
        assert admission["first_policy_version"] == v1
    for run in denied:
        row = run_row(store, run.run_id)
        assert (row.status, row.reason_code) == (S.POLICY_DENIED.value, "REPOSITORY_FROZEN")
        assert f"policy v{v2}" in row.message and f"admitted under v{v1}" in row.message
        assert row.attempt_count == 0
    assert run_row(store, deferred.run_id).status == S.WAITING_CAPACITY.value
    # Nothing left under an older version; a third version keeps the first one.
    assert store.schedule_pass(queued_under_older=True)["queued_readmitted"] == 0
    # A third version lifts the deferral: the deferred run is admitted once (not
    # decided again by the backlog's part of the pass) and keeps its first version.
    apply(store, "[defaults]\nqueue = 'default'\npriority = 'high'\n")
    counts = scheduler.run_once()
    assert (counts["queued_readmitted"], counts["readmitted"], counts["deferred"]) == (4, 1, 0)
    for run in [*kept, deferred]:
        assert store.get_run(run.run_id)["admission"]["first_policy_version"] == v1
    assert {lease.run_id for lease in store.claim("w1", limit=10, lease_ttl=TTL)} == \
        {run.run_id for run in [*kept, deferred]}
    assert store.audit() == []


def test_the_backlog_pass_keeps_a_runs_terms_and_prunes_cancelled_tasks(
        store: Store) -> None:
    """A queued run keeps the terms it entered the queue with (its lane, retries,
    limits, risk class): a new version that would change them leaves its record as it
    is, true to the run, and its claim admits it again (a review found the record
    claiming terms the run did not have). A run whose task's cancel was requested is
    pruned, as at claim (it was denied)."""
    from runlane.services.scheduler import Scheduler

    v1 = apply(store, "[defaults]\nqueue = 'default'\n")
    risky = submit(store, 2, repo="/srv/git/infra.git")
    plain = submit(store)[0]
    [cancelled] = submit(store)
    execute(store, "UPDATE tasks SET cancel_requested_at = 1 WHERE task_id = :t",
            t=cancelled.task_id)
    apply(store, "[[repositories]]\nmatch = '*infra*'\nrisk_class = 'high'\n"
                 "max_attempts = 1\n")
    counts = Scheduler(store).run_once()
    assert (counts["queued_terms_changed"], counts["queued_readmitted"]) == (2, 1)
    for run in risky:
        row = run_row(store, run.run_id)
        assert (row.status, row.policy_version, row.risk_class, row.max_attempts) == (
            S.QUEUED.value, v1, "low", 3)
        assert store.get_run(run.run_id)["admission"]["risk_class"] == "low"
    assert run_row(store, plain.run_id).policy_version == v1 + 1
    row = run_row(store, cancelled.run_id)
    assert (row.status, row.reason_code) == (S.CANCELLED.value, Reason.CANCELLED_BY_USER)
    assert {lease.run_id for lease in store.claim("w1", limit=10, lease_ttl=TTL)} == \
        {plain.run_id, *(run.run_id for run in risky)}
    assert store.audit() == []


def test_a_failed_backlog_pass_is_run_again(store: Store,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that fails after a policy change (a lost connection) must not count the
    change as seen: the next pass admits the backlog again and looks at the deferred
    runs (a review found both dropped until the next change)."""
    from runlane.services.scheduler import Scheduler

    apply(store, "[defaults]\nqueue = 'default'\n")
    run = submit(store)[0]
    scheduler = Scheduler(store)
    scheduler.run_once()
    v2 = apply(store, "[concurrency]\nglobal_max_active = 5\n")
    passes = store.schedule_pass
    failures = [RuntimeError("connection lost")]

    def schedule_pass(**kwargs: Any) -> dict[str, int]:
        if failures:
            raise failures.pop()
        return passes(**kwargs)

    monkeypatch.setattr(store, "schedule_pass", schedule_pass)
    with pytest.raises(RuntimeError, match="connection lost"):
        scheduler.run_once()
    assert scheduler.run_once()["queued_readmitted"] == 1
    assert run_row(store, run.run_id).policy_version == v2


def test_runs_a_claim_holds_during_the_backlog_pass_are_admitted_by_the_next(
        store: Store, db_url: str) -> None:
    """The pass skips the runs a claim holds (SKIP LOCKED) and tries them again at its
    end; those still held are counted, and the scheduler's next pass admits them (a
    review found them left under the old version for good)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    from runlane.services.scheduler import Scheduler

    apply(store, "[defaults]\nqueue = 'default'\n")
    held, free = submit(store, 2)
    scheduler = Scheduler(store)
    scheduler.run_once()
    v2 = apply(store, "[concurrency]\nglobal_max_active = 5\n")
    with store.engine.connect() as claim:  # a claim's lock, through the whole pass
        claim.execute(text("SELECT run_id FROM runs WHERE run_id = :r FOR UPDATE"),
                      {"r": held.run_id})
        counts = scheduler.run_once()
        claim.rollback()
    assert (counts["queued_readmitted"], counts["queued_skipped"]) == (1, 1)
    assert run_row(store, held.run_id).policy_version == v2 - 1
    assert not store.backlog_admitted(v2)  # a new scheduler's first pass reads it all
    counts = scheduler.run_once()  # no change since: the skipped run's turn
    assert (counts["queued_readmitted"], counts["queued_skipped"]) == (1, 0)
    assert run_row(store, held.run_id).policy_version == v2
    assert run_row(store, free.run_id).policy_version == v2
    assert store.backlog_admitted(v2)


def test_a_schedulers_first_pass_skips_a_backlog_already_admitted_again(
        store: Store) -> None:
    """A scheduler's first pass admits the backlog again (a policy may have changed
    while no scheduler ran), unless a pass did so under the version in force: it read
    the whole queue at every start and every `runlane maintain --once`."""
    from runlane.services.scheduler import Scheduler

    assert store.backlog_admitted(0)
    v1 = apply(store, "[defaults]\nqueue = 'default'\n")
    runs = submit(store, 2)
    v2 = apply(store, "[concurrency]\nglobal_max_active = 5\n")  # while none ran
    assert not store.backlog_admitted(v2)
    assert Scheduler(store).run_once()["queued_readmitted"] == 2
    assert store.backlog_admitted(v2)
    # A run back under v1 (a retry of a run claimed under its old record): a new
    # scheduler does not read the queue for it; its claim admits it again.
    execute(store, "UPDATE runs SET policy_version = :v WHERE run_id = :r", v=v1,
            r=runs[0].run_id)
    assert Scheduler(store).run_once()["queued_readmitted"] == 0
    assert run_row(store, runs[0].run_id).policy_version == v1
    v3 = apply(store, "[concurrency]\nglobal_max_active = 6\n")
    assert Scheduler(store).run_once()["queued_readmitted"] == 2
    assert store.backlog_admitted(v3)


def test_once_the_backlog_is_admitted_again_its_claims_are_one_statement(
        pg_url: str, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-statement claim takes only runs admitted under the version in force:
    after a policy change the queued backlog went through the transaction until it
    drained (a review of 2026-12-01). Once the pass has admitted it again, a store's
    claim is one statement; before, it falls back."""
    truncate_pg(pg_url)
    store = Store(pg_url, clock=clock)
    apply(store, "[defaults]\nqueue = 'default'\n")
    submit(store, 4)
    apply(store, "[[rules]]\nwhen = { repo = '*legacy*' }\naction = 'deny'\n")

    def claim_in_one_statement() -> int:
        claimer = Store(pg_url, clock=clock)

        def transaction(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the claim fell back to the transaction")

        monkeypatch.setattr(claimer, "_claim_candidates", transaction)
        try:
            return len(claimer.claim("w1", limit=2, lease_ttl=TTL))
        finally:
            claimer.close()

    with pytest.raises(AssertionError, match="fell back"):
        claim_in_one_statement()
    assert store.schedule_pass(queued_under_older=True)["queued_readmitted"] == 4
    assert claim_in_one_statement() == 2
    assert store.audit() == []
    store.close()


def test_policy_checked_before_a_side_effect(store: Store) -> None:
    apply(store, "[defaults]\nqueue = 'default'\n")
    submit(store)
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    apply(store, "[[rules]]\nwhen = { repo = '*app*' }\naction = 'deny'\n")
    with pytest.raises(PolicyDenied, match="push refused"):
        store.effect_intent(lease, "push")
    assert store.side_effects(lease.run_id) == []
    assert store.fail(lease, Reason.POLICY_DENIED, message="denied") is S.POLICY_DENIED


# --- concurrency limits ----------------------------------------------------------------


@pytest.mark.parametrize("policy, fields, cap", [
    ("[concurrency]\nglobal_max_active = 2\n", [{}], 2),
    ("[concurrency]\nper_tenant_max_active = 2\n", [{}], 2),
    ("[concurrency]\nper_repository_max_active = 2\n", [{}], 2),
    ("[concurrency]\nper_user_max_active = 2\n", [{"user": "ann"}], 2),
    ("[concurrency.per_queue_max_active]\ndefault = 2\n", [{}], 2),
    ("[concurrency.per_risk_class_max_active]\nlow = 2\n", [{}], 2),
])
def test_each_limit_holds_and_frees_its_slot(store: Store, policy: str,
                                             fields: list[dict[str, Any]], cap: int) -> None:
    apply(store, policy)
    submit(store, 5, **fields[0])
    leases = store.claim("w1", limit=5, lease_ttl=TTL)
    assert len(leases) == cap
    assert store.claim("w2", limit=5, lease_ttl=TTL) == []
    store.fail(leases[0], Reason.AGENT_FAILED)  # its slot comes back
    assert len(store.claim("w2", limit=5, lease_ttl=TTL)) == 1
    assert store.audit() == []


def test_an_ended_attempt_gives_its_slots_back_once_and_forgets_them(
        store: Store, clock: ManualClock) -> None:
    """A failed attempt and a reaped one each give their slots back and clear the
    scopes they held (PostgreSQL: in the statement that ends the attempt, which returns
    the old value; SQLite: after it): nothing can give them back a second time."""
    apply(store, "[concurrency]\nper_tenant_max_active = 1\nglobal_max_active = 5\n")
    submit(store, 2)

    def held() -> tuple[dict[str, int], list[Any]]:
        with store.engine.connect() as conn:
            active = dict(conn.execute(text("SELECT scope, active FROM limit_counters")).all())
            scopes = conn.execute(text(
                "SELECT limit_scopes FROM attempts ORDER BY started_at, run_id")).scalars()
            return active, list(scopes)

    [first] = store.claim("w1", limit=2, lease_ttl=TTL)
    assert held()[0] == {"global": 1, "tenant:acme": 1}
    store.fail(first, Reason.AGENT_FAILED)  # retryable: back to the queue
    assert held() == ({"global": 0, "tenant:acme": 0}, [None])
    [second] = store.claim("w1", limit=2, lease_ttl=TTL)
    clock.advance(TTL + 1)
    assert store.reap_expired_leases() == 1
    assert held() == ({"global": 0, "tenant:acme": 0}, [None, None])
    with pytest.raises(LeaseLost):  # the reaped lease is gone: nothing more comes back
        store.fail(second, Reason.AGENT_FAILED)
    assert held()[0] == {"global": 0, "tenant:acme": 0}
    assert store.audit() == []


def test_a_full_tenant_does_not_block_another(store: Store) -> None:
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, 50, tenant="big")
    small = submit(store, tenant="small")[0]
    first = store.claim("w1", limit=1, lease_ttl=TTL)
    second = store.claim("w1", limit=5, lease_ttl=TTL)
    claimed = [lease.tenant for lease in first + second]
    assert sorted(claimed) == ["big", "small"]
    assert small.run_id in {lease.run_id for lease in first + second}
    # The full tenant's lanes are hidden from the claim's lane scan.
    with store.engine.connect() as conn:
        hidden = conn.execute(text("SELECT tenant_at_limit FROM lanes WHERE tenant = 'big'"))
        assert {r.tenant_at_limit for r in hidden} == {1}



def take_the_higher_lane_while_holding_the_lower(store: Store, low_lane: int,
                                                 high_lane: int, writer: Any,
                                                 what: str) -> None:
    """A submit in progress holds a tenant's lower lane while ``writer`` (run in a
    thread) waits for it, then takes the higher lane: a deadlock (or the lock timeout)
    if ``writer`` locked the higher lane first."""
    with store.engine.connect() as holder:
        holder.execute(text("SELECT lane_id FROM lanes WHERE lane_id = :l FOR UPDATE"),
                       {"l": low_lane})
        thread = threading.Thread(target=writer)
        thread.start()
        # Any statement of the writer: the holder's is the only lock it can wait for.
        wait_for_a_lock_wait(store.url, "", f"{what}'s lock of the low lane")
        # The writer holds no lane yet: the high lane is free to take, now.
        holder.execute(text("SET LOCAL lock_timeout = '5s'"))
        holder.execute(text("UPDATE lanes SET queued_count = queued_count WHERE lane_id = :l"),
                       {"l": high_lane})
        holder.commit()
    thread.join(timeout=30)


def test_a_claim_filling_its_tenant_locks_the_tenants_lanes_in_lane_id_order(
        store: Store, db_url: str) -> None:
    """The claim that takes a tenant's last slot hides all its lanes. It locks them with
    the lane it claims from, in lane_id order, before touching any: it used to update
    its own lane first and then the tenant's others in scan order, so a writer holding
    a lower lane of that tenant (a submit) and then wanting the claimed one deadlocked
    with it."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, tenant="t", priority="low")  # the lower lane_id
    submit(store, tenant="t", priority="high")
    store.complete_many(store.claim("w0", limit=1, lease_ttl=TTL))  # the counters exist
    [high] = submit(store, tenant="t", priority="high")  # claimed next
    with store.engine.connect() as conn:
        low_lane, high_lane = conn.execute(text(
            "SELECT lane_id FROM lanes WHERE tenant = 't' ORDER BY priority DESC")).scalars()
    assert low_lane < high_lane
    claimed: list[Any] = []
    take_the_higher_lane_while_holding_the_lower(
        store, low_lane, high_lane,
        lambda: claimed.extend(store.claim("w1", limit=1, lease_ttl=TTL)), "the claim")
    assert [lease.run_id for lease in claimed] == [high.run_id]
    with store.engine.connect() as conn:
        assert set(conn.execute(text(
            "SELECT tenant_at_limit FROM lanes WHERE tenant = 't'")).scalars()) == {1}
    assert store.audit() == []


def test_a_release_below_its_tenants_limit_locks_the_tenants_lanes_in_lane_id_order(
        store: Store, db_url: str) -> None:
    """The release that takes a tenant below its limit shows all its lanes again. It
    updated them in scan order, where a lane updated since comes after the others: a
    writer holding a lower lane of that tenant (a submit) and then wanting a higher one
    deadlocked with it. It now locks them in lane_id order first."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, tenant="t", priority="low")  # the lower lane_id
    submit(store, tenant="t", priority="high")
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)  # the tenant is full
    with store.engine.connect() as conn:
        low_lane, high_lane = conn.execute(text(
            "SELECT lane_id FROM lanes WHERE tenant = 't' ORDER BY priority DESC")).scalars()
        assert low_lane < high_lane
        # The low lane's pass moves, as a claim from it moves it: its new version comes
        # after the high lane's, in the table and in the index by tenant.
        conn.execute(text("UPDATE lanes SET pass = pass + 1 WHERE lane_id = :l"),
                     {"l": low_lane})
        conn.commit()
        assert set(conn.execute(text(
            "SELECT tenant_at_limit FROM lanes WHERE tenant = 't'")).scalars()) == {1}
    errors: list[BaseException] = []

    def complete() -> None:
        try:
            store.complete(lease)
        except BaseException as exc:  # reported below
            errors.append(exc)

    take_the_higher_lane_while_holding_the_lower(store, low_lane, high_lane, complete,
                                                 "the release")
    assert errors == []
    with store.engine.connect() as conn:
        assert set(conn.execute(text(
            "SELECT tenant_at_limit FROM lanes WHERE tenant = 't'")).scalars()) == {0}
    assert store.audit() == []


def test_an_attempt_starts_when_its_slots_are_taken_not_before_a_wait_for_them(
        db_url: str) -> None:
    """A claim that waits for a counter (a release holding it until it commits) reads
    its time after the wait: the attempt's start is never before the release that
    freed its slot ended, so lease intervals reconstructed from the attempts hold the
    limits. Both claim forms read it first before (the 8-process test saw a repository
    with 3 runs under a limit of 2)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    store = Store(db_url)  # the database's clock: the time is read when it is read
    apply(store, "[concurrency]\nglobal_max_active = 20\n")
    runs = store.submit([spec(tenant=f"t{i}") for i in range(11)])
    [first] = store.claim("w0", limit=1, lease_ttl=TTL)  # the counter exists now
    claimed: list[Any] = []
    with store.engine.connect() as holder:  # a release of "global", not yet committed
        holder.execute(text("SELECT scope FROM limit_counters WHERE scope = 'global' "
                            "FOR UPDATE"))
        claim = threading.Thread(target=lambda: claimed.extend(
            store.claim("w1", limit=10, lease_ttl=TTL)))
        claim.start()
        wait_for_a_lock_wait(store.url, "", "the claim's lock of the global counter")
        time.sleep(0.05)
        released_at = holder.execute(text(
            "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision)"
        )).scalar_one()
        holder.commit()
    claim.join(timeout=30)
    assert sorted(lease.run_id for lease in claimed) == sorted(
        r.run_id for r in runs if r.run_id != first.run_id)
    with store.engine.connect() as conn:
        started = conn.execute(text("SELECT MIN(started_at) FROM attempts WHERE worker_id = "
                                    "'w1'")).scalar_one()
    assert started >= released_at
    store.complete_many([first, *claimed])
    store.close()


def test_after_one_statement_claims_fall_back_the_next_claims_are_transactions(
        pg_url: str, clock: ManualClock) -> None:
    """A one-statement claim that finds no room for its whole batch falls back to the
    transaction (which gives the slots run by run): a statement for nothing. After a
    fallback the store's next claim is a transaction, after two in a row the next 3,
    then 7 (scheduling.ONE_TRIP_MAX_SKIPS): under a repository limit of 1, claims of 2
    runs of that repository try the one statement 3 times in 8 claims, not 8."""
    truncate_pg(pg_url)
    store = Store(pg_url, clock=clock)
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    store.submit([spec(tenant=f"t{i % 2}") for i in range(20)])  # one repository
    tried: list[str] = []

    def one_statement(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if "chosen AS" in statement:
            tried.append(statement)

    event.listen(store.engine, "before_cursor_execute", one_statement)
    try:
        for _ in range(8):
            [lease] = store.claim("w1", limit=2, lease_ttl=TTL)
            store.complete(lease)
    finally:
        event.remove(store.engine, "before_cursor_execute", one_statement)
    assert len(tried) == 3  # claims 1, 3 and 7
    assert store.audit() == []
    store.close()


def test_a_limit_removed_and_applied_again_counts_the_runs_still_holding_it(
        store: Store) -> None:
    """A policy that removes a limit deletes its counter; the attempts claimed under it
    still hold the scope. When a policy brings the limit back, the new counter starts
    at what they hold: it started at 0, and a repository limited to 1 ran 2 runs (a
    review of 2026-12-01). A scope without a counter is not audited."""
    limit = "[concurrency]\nper_repository_max_active = 1\n"
    apply(store, limit)
    submit(store, 3)
    [first] = store.claim("w1", limit=1, lease_ttl=TTL)
    apply(store, "[defaults]\nqueue = 'default'\n")  # the limit removed
    assert store.audit() == []
    apply(store, limit + "global_max_active = 100\n")  # and back
    assert store.claim("w2", limit=1, lease_ttl=TTL) == []  # the repository is full
    store.complete(first)
    assert len(store.claim("w2", limit=1, lease_ttl=TTL)) == 1
    assert store.audit() == []


def test_a_limit_applied_while_runs_are_live_counts_them(store: Store) -> None:
    """Runs claimed while nothing limited their tenant, then a policy limits it to 2:
    the new counter starts at the live attempts in its scope, so no more runs of the
    tenant start until they end. Attempts held only the scopes limited at their claim,
    the new counter started at 0 and a claim took 2 more: 4 live against a limit of 2
    (a review of 2026-12-02). Every attempt now holds every scope of its run; the end
    of one gives the new counter's slot back."""
    submit(store, 6, tenant="a")
    first = store.claim("w1", limit=2, lease_ttl=TTL)
    assert len(first) == 2
    apply(store, "[concurrency]\nper_tenant_max_active = 2\n")
    assert store.claim("w1", limit=5, lease_ttl=TTL) == []  # 2 live: the tenant is full
    assert store.audit() == []
    store.complete(first[0])
    assert len(store.claim("w1", limit=5, lease_ttl=TTL)) == 1  # its slot came back
    assert store.audit() == []
    # A scope limited to 1 after the fact (a repository): the same.
    apply(store, "[concurrency]\nper_tenant_max_active = 2\nper_repository_max_active = 1\n")
    store.complete(first[1])
    assert store.claim("w1", limit=5, lease_ttl=TTL) == []  # repo still at 2 live of 1
    assert store.audit() == []


def test_applying_a_policy_locks_the_counters_in_scope_order(db_url: str) -> None:
    """apply_policy brings every counter to the new maxima. It updated them in the order
    its scan met them (physical order), so with "global" stored after "tenant:a" it
    held tenant:a and waited for global while a claim held global and waited for
    tenant:a: a deadlock, raised to the claim (a review of 2026-12-01). It locks them
    in scope order first, as claims and releases do."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    store = Store(db_url)
    apply(store, "[concurrency]\nglobal_max_active = 50\nper_tenant_max_active = 10\n")
    submit(store, 6, tenant="a")
    store.complete_many(store.claim("w0", limit=1, lease_ttl=TTL))  # the counters exist
    execute(store, "UPDATE limit_counters SET active = active WHERE scope = 'global'")
    with store.engine.connect() as conn:  # global now comes after tenant:a in the heap
        assert conn.execute(text("SELECT scope FROM limit_counters")).scalars().all() == \
            ["tenant:a", "global"]
    outcome: dict[str, Any] = {}

    def claim() -> None:
        try:
            outcome["claim"] = len(store.claim("w1", limit=1, lease_ttl=TTL))
        except Exception as exc:  # the deadlock is what is looked for
            outcome["claim"] = repr(exc)

    def policy() -> None:
        try:
            outcome["policy"] = apply(Store(db_url), "[concurrency]\nglobal_max_active = 51"
                                                     "\nper_tenant_max_active = 11\n")
        except Exception as exc:
            outcome["policy"] = repr(exc)

    threads = [threading.Thread(target=claim), threading.Thread(target=policy)]
    with store.engine.connect() as holder:  # a release holding "global"
        holder.execute(text("SELECT scope FROM limit_counters WHERE scope = 'global' "
                            "FOR UPDATE"))
        threads[0].start()
        wait_for_a_lock_wait(store.url, "", "the claim's lock of the global counter")
        threads[1].start()
        wait_for_a_lock_wait(store.url, "", "the policy's lock of a counter", sessions=2)
        holder.commit()
    for t in threads:
        t.join(timeout=30)
    assert outcome == {"claim": 1, "policy": 2}
    assert store.audit() == []
    store.close()



# --- priority, fairness, starvation (seed 003) -------------------------------------------


def test_critical_row_behind_210_older_low_priority_rows_is_claimed_first(
        store: Store, clock: ManualClock) -> None:
    submit(store, 210, priority="low")
    clock.advance(1)
    critical = submit(store, priority="critical", tenant="other")[0]
    [first] = store.claim("w1", limit=1, lease_ttl=TTL)
    assert first.run_id == critical.run_id


@pytest.mark.parametrize("blocker", ["repository_limit", "backoff", "dependency"])
def test_2010_blocked_rows_ahead_of_one_runnable_row(store: Store, clock: ManualClock,
                                                      blocker: str) -> None:
    """Rows that cannot run never crowd out a runnable one, however many are ahead."""
    tenant = "acme"
    if blocker == "repository_limit":  # blocked rows inside the runnable row's own lane
        apply(store, "[concurrency]\nper_repository_max_active = 1\n")
        submit(store, 2011, repo="/srv/git/mono.git")
        assert len(store.claim("w0", limit=1, lease_ttl=TTL)) == 1  # mono is now full
    elif blocker == "backoff":  # a better lane holding only rows in backoff
        submit(store, 2010, priority="critical")
        execute(store, "UPDATE runs SET visible_at = :later", later=clock.now() + 3600)
        tenant = "other"
    else:
        parent = submit(store, repo="/srv/git/upstream.git")[0]  # running: never claimed
        store.submit([spec(depends_on=[parent.task_id]) for _ in range(2010)])
        execute(store, "UPDATE runs SET status = 'RUNNING' WHERE run_id = :r", r=parent.run_id)
    clock.advance(1)
    runnable = submit(store, repo="/srv/git/other.git", tenant=tenant)[0]
    leases = store.claim("w1", limit=1, lease_ttl=TTL)
    assert [lease.run_id for lease in leases] == [runnable.run_id]


def flood_lane(store: Store) -> tuple[float | None, list[str]]:
    """The flood tenant's lane: when it wakes (None: awake) and the scopes it sleeps on."""
    with store.engine.connect() as conn:
        lane_id, wake_at = conn.execute(text(
            "SELECT lane_id, wake_at FROM lanes WHERE tenant = 'flood'")).one()
        scopes = conn.execute(text("SELECT scope FROM lane_blocks WHERE lane_id = :l "
                                   "ORDER BY scope"), {"l": lane_id}).scalars().all()
    return wake_at, list(scopes)


def test_a_lane_blocked_by_a_full_repository_sleeps_until_a_release_frees_it(
        store: Store, clock: ManualClock) -> None:
    """A lane whose visible runs are all in a full repository gets nothing, so its pass
    never moves and every claim walked its whole backlog (13 ms per claim behind 20,000
    runs, bench/blocked_lane.py). The claim that finds it so puts it to sleep on that
    scope; a release of another scope leaves it asleep, the release of its repository's
    slot wakes it and the next claim takes its run at once; without that release the
    recheck interval ends the sleep (and the lane, still blocked, sleeps again)."""
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    flood = submit(store, 30, tenant="flood", repo="/srv/git/mono.git")
    [held] = store.claim("w0", limit=1, lease_ttl=TTL)  # mono is now full
    assert held.run_id in {r.run_id for r in flood}
    clock.advance(1)
    store.submit([spec(tenant="other", repo=f"/srv/git/r{i}.git") for i in range(10)])

    def claim_others_until_the_flood_lane_sleeps() -> list[Any]:
        taken = []
        while flood_lane(store)[0] is None:
            [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
            assert lease.tenant == "other"
            taken.append(lease)
            assert len(taken) <= 2, "the flood lane, first in line, was walked and kept awake"
        return taken

    others = claim_others_until_the_flood_lane_sleeps()
    assert flood_lane(store) == (clock.now() + BLOCKED_LANE_RECHECK_SECONDS,
                                 ["repo:/srv/git/mono.git"])
    store.complete(others[0])  # its repository frees: nothing waits on it
    assert flood_lane(store)[0] is not None
    store.complete(held)  # mono frees: the flood lane wakes, its blocks go
    assert flood_lane(store) == (None, [])
    [next_run] = store.claim("w0", limit=1, lease_ttl=TTL)
    assert (next_run.tenant, next_run.repo) == ("flood", "/srv/git/mono.git")
    # mono is full again and nobody releases it: the lane sleeps again, and when the
    # recheck interval is over the claim wakes it, walks it and puts it back to sleep.
    claim_others_until_the_flood_lane_sleeps()
    clock.advance(BLOCKED_LANE_RECHECK_SECONDS + 1)
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    assert lease.tenant == "other"
    if flood_lane(store)[0] is None:  # woken, and not first in line this time
        claim_others_until_the_flood_lane_sleeps()
    assert flood_lane(store) == (clock.now() + BLOCKED_LANE_RECHECK_SECONDS,
                                 ["repo:/srv/git/mono.git"])
    assert store.audit() == []


def test_a_lane_blocked_by_a_limit_wakes_when_a_policy_raises_it_or_a_recount_lowers_it(
        store: Store) -> None:
    """Releases are not the only way a full scope gets room: a new policy raises its
    limit, or the reconciler finds its counter drifted above the slots really held.
    Either wakes the lanes asleep on it at once (not after the recheck interval)."""
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    flood = submit(store, 3, tenant="flood", repo="/srv/git/mono.git")
    [held] = store.claim("w0", limit=1, lease_ttl=TTL)
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    assert flood_lane(store)[1] == ["repo:/srv/git/mono.git"]
    apply(store, "[concurrency]\nper_repository_max_active = 2\n")
    assert flood_lane(store) == (None, [])
    [second] = store.claim("w1", limit=1, lease_ttl=TTL)
    assert second.run_id in {r.run_id for r in flood}
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []  # 2 of 2: asleep again
    assert flood_lane(store)[1] == ["repo:/srv/git/mono.git"]
    store.complete(second)  # its release frees a slot; then the counter drifts up
    assert flood_lane(store) == (None, [])
    execute(store, "UPDATE limit_counters SET active = 2 WHERE scope = 'repo:/srv/git/mono.git'")
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    assert flood_lane(store)[1] == ["repo:/srv/git/mono.git"]
    assert store.reconcile()["slot_counters_repaired"] == 1
    assert flood_lane(store) == (None, [])
    assert len(store.claim("w1", limit=1, lease_ttl=TTL)) == 1
    store.complete(held)


def _asleep_on_mono(store: Store) -> tuple[list[Any], Any]:
    """The flood lane asleep on its full repository: its runs, and the lease holding it."""
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    flood = submit(store, 5, tenant="flood", repo="/srv/git/mono.git")
    [held] = store.claim("w0", limit=1, lease_ttl=TTL)
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    assert flood_lane(store)[1] == ["repo:/srv/git/mono.git"]
    return flood, held


def _release_while(store: Store, db_url: str, statement_part: str, held: Any) -> Any:
    """A hook: when a statement containing ``statement_part`` has run (its transaction
    still open, holding the lanes it wrote), ``held`` is completed by another thread;
    the hook returns once that release committed and waits for the lane."""
    threads: list[threading.Thread] = []

    def hook(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement_part in statement and not threads:
            threads.append(threading.Thread(target=store.complete, args=(held,)))
            threads[0].start()
            wait_for_a_lock_wait(db_url, "lanes.wake_at IS NOT NULL",
                                 "the release's wake of a lane it had to skip")

    event.listen(store.engine, "after_cursor_execute", hook)
    return threads, lambda: event.remove(store.engine, "after_cursor_execute", hook)


@pytest.mark.parametrize("holder", ["cancel"])
def test_a_lane_the_releases_wake_skipped_is_woken_after_the_release_commits(
        store: Store, db_url: str, holder: str) -> None:
    """The wake skips lanes another transaction holds (waiting there could close a
    cycle), and not every holder wakes them: a cancel of one of the lane's runs. Such a
    lane stayed asleep with room for its runs; the release wakes it after its commit,
    holding nothing else. (A policy recomputing the tenant flags was another such
    holder; it now holds every counter while it does, so no release runs meanwhile.)"""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    flood, held = _asleep_on_mono(store)
    part = "queued_count = queued_count -" if holder == "cancel" else "SET tenant_at_limit = CASE"
    threads, stop = _release_while(store, db_url, part, held)
    try:
        if holder == "cancel":
            store.cancel([r for r in flood if r.run_id != held.run_id][-1].task_id)
        else:
            apply(store, "[concurrency]\nper_repository_max_active = 1\nglobal_max_active = 99\n")
    finally:
        stop()
    threads[0].join(timeout=30)
    assert not threads[0].is_alive()
    assert flood_lane(store) == (None, [])
    assert len(store.claim("w1", limit=1, lease_ttl=TTL)) == 1


def _flood_with_mono_counted_and_free(store: Store) -> None:
    """Limit 1 per repository, 5 flood runs in mono, whose counter exists and is empty
    (one run claimed and completed)."""
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    submit(store, 5, tenant="flood", repo="/srv/git/mono.git")
    store.complete(store.claim("w0", limit=1, lease_ttl=TTL)[0])


def test_a_claim_during_a_policy_change_waits_for_it_then_claims_under_the_new_limit(
        store: Store, db_url: str) -> None:
    """apply_policy locks every counter, in scope order, before it reads them: no claim
    fills a scope, and no lane falls asleep on one, between that read and the policy's
    commit (with an unlocked read both could, and the lane then slept with room under
    the raised limit). A claim meanwhile waits, then claims under the new limit."""
    if not db_url.startswith("postgresql"):
        pytest.skip("a second writer during apply_policy (SQLite serializes writers)")
    _flood_with_mono_counted_and_free(store)
    claims: list[threading.Thread] = []
    claimed: list[Any] = []

    def claim_meanwhile(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if statement.startswith("SELECT scope, active, max_active FROM limit_counters") \
                and not claims:
            claims.append(threading.Thread(target=lambda: claimed.extend(
                store.claim("w0", limit=1, lease_ttl=TTL))))
            claims[0].start()
            wait_for_a_lock_wait(db_url, "", "the claim's wait for the policy's counters")

    event.listen(store.engine, "after_cursor_execute", claim_meanwhile)
    try:
        apply(store, "[concurrency]\nper_repository_max_active = 2\n")
    finally:
        event.remove(store.engine, "after_cursor_execute", claim_meanwhile)
    claims[0].join(timeout=30)
    assert len(claimed) == 1
    assert len(store.claim("w1", limit=1, lease_ttl=TTL)) == 1  # mono's second slot
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []  # and no third
    assert store.audit() == []


def test_reading_a_blocked_lanes_scopes_pairs_no_run_with_every_full_scope(
        store: Store, clock: ManualClock, db_url: str) -> None:
    """A lane's runs matched to the full scopes by ``scope IN (three columns)`` could
    not be hashed: every run was paired with every full scope (2 s for 20,000 runs
    over 1,000 full repositories, inside the claim, with the counters share-locked).
    One hashed test per kind of scope reads each run once. 1,000 runs over 100 full
    repositories: the rows filters drop stay within a few per run (the paired forms
    dropped 100 to 250 per run)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's plan counters")
    from .test_dispatch_explain import explain, nodes

    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    store.submit([spec(tenant="holders", repo=f"/srv/git/r{i}.git") for i in range(100)])
    assert len(store.claim("w0", limit=100, lease_ttl=TTL)) == 100  # every repository full
    clock.advance(1)
    store.submit([spec(tenant="flood", repo=f"/srv/git/r{i % 100}.git") for i in range(1000)])
    with store.engine.connect() as conn:
        lane_id = conn.execute(text("SELECT lane_id FROM lanes WHERE tenant = 'flood'")).scalar()
        blocks = conn.execute(store._q(lanes_sql.LANE_BLOCKING_SCOPES["postgresql"]),
                              {"lane_ids": [lane_id], "now": clock.now()}).all()
        plan = explain(conn, lanes_sql.LANE_BLOCKING_SCOPES["postgresql"],
                       {"lane_ids": [lane_id], "now": clock.now()})
        conn.rollback()
    assert len(blocks) == 100
    dropped = sum((n.get("Rows Removed by Join Filter", 0) + n.get("Rows Removed by Filter", 0))
                  * n.get("Actual Loops", 1) for n in nodes(plan))
    assert dropped <= 5 * 1000, dropped


def test_a_claim_that_read_an_older_policy_does_not_write_its_limit_back(
        store: Store, db_url: str) -> None:
    """A policy raising a limit is applied between a claim's first statement and its
    counters: the claim wrote its version's maximum back over the raise, and with the
    scope full under the old limit its runs were kept out of every walk. The change
    now waits for the claim in flight (LOCK_CLAIMS_FOR_POLICY_PG) and commits after it:
    the counter ends with the raised maximum and the claim's slot."""
    if not db_url.startswith("postgresql"):
        pytest.skip("a policy applied during a claim (SQLite serializes writers)")
    import threading

    _flood_with_mono_counted_and_free(store)
    raised: list[int] = []
    changes: list[threading.Thread] = []
    waited: list[bool] = []

    def raise_the_limit(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if "page AS (" in statement and not changes:
            changes.append(threading.Thread(target=lambda: raised.append(
                apply(store, "[concurrency]\nper_repository_max_active = 2\n"))))
            changes[0].start()
            changes[0].join(1.0)
            waited.append(changes[0].is_alive())

    event.listen(store.engine, "after_cursor_execute", raise_the_limit)
    try:
        [first] = store.claim("w1", limit=1, lease_ttl=TTL)
    finally:
        event.remove(store.engine, "after_cursor_execute", raise_the_limit)
        for change in changes:
            change.join(30)
    assert waited == [True] and raised
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT active, max_active FROM limit_counters "
                                 "WHERE scope = 'repo:/srv/git/mono.git'")).one() == (1, 2)
    [second] = store.claim("w1", limit=1, lease_ttl=TTL)  # 2 of 2 under the new policy
    store.complete_many([first, second])


def test_a_lane_with_a_runnable_run_another_claim_holds_stays_awake(
        store: Store, clock: ManualClock, db_url: str) -> None:
    """The walk skips runs other claims hold, so a lane can give nothing while one of
    its runs could run. It slept on the full scopes of its other runs, for a whole
    recheck interval, with that run runnable once the other claim let go (8 claimer
    processes gave up with 13 of 400 runs left, CI of 2026-12-01): it sleeps only when
    every visible run is blocked."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite locks the whole file)")
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    submit(store, 5, tenant="flood", repo="/srv/git/mono.git")
    [held] = store.claim("w0", limit=1, lease_ttl=TTL)  # mono is now full
    clock.advance(1)
    [free] = submit(store, tenant="flood", repo="/srv/git/free.git")
    with store.engine.connect() as other:  # another claim's walk holds the free run
        other.execute(text("SELECT run_id FROM runs WHERE run_id = :r FOR UPDATE"),
                      {"r": free.run_id})
        assert store.claim("w1", limit=1, lease_ttl=TTL) == []
        assert flood_lane(store) == (None, [])
        other.rollback()
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)  # at once: no recheck to wait for
    assert lease.run_id == free.run_id
    store.complete_many([held, lease])
    assert store.audit() == []


def test_a_scope_a_release_is_freeing_does_not_put_a_lane_to_sleep(
        store: Store, db_url: str) -> None:
    """A release that has taken its slot back but not committed has already sent its
    wake (last in its transaction), which cannot see the blocks of a claim that commits
    later: a lane put to sleep on that scope then would sleep the whole recheck with
    room for its runs. The claim share-locks the full counters it sleeps on, skipping
    the ones a release holds: such a scope has room, and the lane stays awake."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite serializes writers on the file)")
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    submit(store, 5, tenant="flood", repo="/srv/git/mono.git")
    [held] = store.claim("w0", limit=1, lease_ttl=TTL)  # mono is now full
    with store.engine.connect() as release:  # a release between its slot and its commit
        release.execute(text("UPDATE limit_counters SET active = active - 1 "
                             "WHERE scope = 'repo:/srv/git/mono.git'"))
        assert store.claim("w1", limit=1, lease_ttl=TTL) == []  # mono still full to it
        assert flood_lane(store) == (None, [])
        release.rollback()
    # Once nothing is freeing mono, the same claim puts the lane to sleep on it.
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    assert flood_lane(store)[1] == ["repo:/srv/git/mono.git"]
    store.complete(held)
    assert flood_lane(store) == (None, [])


def test_a_run_submitted_while_a_claim_finds_its_lane_blocked_keeps_the_lane_awake(
        store: Store, db_url: str) -> None:
    """The claim's backoff sleep (LANES_SLEEP) locks every empty lane it can, so a
    submit to one waits for the claim's commit and then wakes it. A lane another
    transaction held then is not locked: a submit that commits between the claim's read
    of its blocked runs and its sleep brings a run the read did not see (here with a
    cancel, so that the lane's queued count and pass are as read: comparing those was
    not enough). The sleep is only for a lane not updated since the read."""
    if not db_url.startswith("postgresql"):
        pytest.skip("a second writer during a claim (SQLite serializes writers)")
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    flood = submit(store, 5, tenant="flood", repo="/srv/git/mono.git")
    [held] = store.claim("w0", limit=1, lease_ttl=TTL)  # mono is now full
    late: list[Any] = []
    holder = store.engine.connect()  # holds the lane while the claim's LANES_SLEEP runs
    holder.execute(text("SELECT lane_id FROM lanes WHERE tenant = 'flood' FOR UPDATE"))

    def submit_after_the_read(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if "visible AS (" in statement and not late:
            holder.rollback()
            # A cancel and a submit: the lane's queued count and pass are as read.
            store.cancel([r for r in flood if r.run_id != held.run_id][-1].task_id)
            late.extend(submit(store, tenant="flood", repo="/srv/git/free.git"))

    event.listen(store.engine, "after_cursor_execute", submit_after_the_read)
    try:
        assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    finally:
        event.remove(store.engine, "after_cursor_execute", submit_after_the_read)
        holder.close()
    assert late and flood_lane(store) == (None, [])
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    assert lease.run_id == late[0].run_id
    store.complete_many([held, lease])


class LaneWalks:
    """Counts the lane-walk statements (LANE_RUNS) a store sends."""

    def __init__(self, store: Store) -> None:
        self.count = 0
        event.listen(store.engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "task_cancelled" in statement and "full_scopes AS" in statement:
            self.count += 1

    def during(self, work: Any) -> tuple[Any, int]:
        before = self.count
        result = work()
        return result, self.count - before


def test_lanes_whose_runs_all_wait_for_backoff_sleep_until_due(
        store: Store, clock: ManualClock) -> None:
    """40 tenants' retries wait for their backoff in lanes ahead of a runnable run (a
    better priority): the first claim walks those lanes once and puts them to sleep;
    later claims never walk them (one lane walk each); when the backoff is over they
    wake and are claimed."""
    retried = submit_each(store, [f"t{i:02d}" for i in range(40)], priority="high")
    leases = store.claim("w0", limit=40, lease_ttl=TTL)
    assert len(leases) == 40
    for lease in leases:
        store.fail(lease, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=300.0)
    walks = LaneWalks(store)
    first = submit(store, tenant="z")[0]
    got, n = walks.during(lambda: store.claim("w1", limit=1, lease_ttl=TTL))
    assert [lease.run_id for lease in got] == [first.run_id]
    assert n >= 3  # 40 empty lanes, pages of 16, then z's
    with store.engine.connect() as conn:
        asleep = conn.execute(text("SELECT COUNT(*) FROM lanes WHERE wake_at IS NOT NULL")
                              ).scalar_one()
    assert asleep == 40
    for _ in range(3):
        later = submit(store, tenant="z")[0]
        got, n = walks.during(lambda: store.claim("w1", limit=1, lease_ttl=TTL))
        assert [lease.run_id for lease in got] == [later.run_id]
        assert n == 1, "sleeping lanes were walked again"
    # A new run in a sleeping lane wakes it at once.
    fresh = submit(store, tenant="t07", priority="high")[0]
    assert [lease.run_id for lease in store.claim("w1", limit=1, lease_ttl=TTL)] == \
        [fresh.run_id]
    assert store.claim("w1", limit=5, lease_ttl=TTL) == []  # all the rest still wait
    clock.advance(301 * 1.3)  # past the backoff and its jitter
    woken = store.claim("w1", limit=40, lease_ttl=TTL)
    assert sorted(lease.run_id for lease in woken) == sorted(r.run_id for r in retried)
    assert {lease.attempt_no for lease in woken} == {2}
    assert store.audit() == []


def test_lanes_sleep_walks_the_dispatch_index_when_statistics_are_stale(
        store: Store, db_url: str) -> None:
    """After a drain and before the next ANALYZE, the planner still believes each lane
    holds ~1,000 queued runs: LANES_SLEEP's "is a run visible?" must still be a walk of
    the dispatch index from the lane's head (as an EXISTS it became a Seq Scan of every
    run, 39 ms per claim that found a lane empty, seen after the peer bench's drain)."""
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's planner (SQLite has no statistics here)")
    submit_each(store, [f"t{i % 8}" for i in range(8000)])
    with store.engine.begin() as conn:
        conn.execute(text("ANALYZE runs"))
        conn.execute(text("UPDATE runs SET status = 'SUCCEEDED'"))  # a drain, not analyzed
        lane_ids = list(conn.execute(text("SELECT lane_id FROM lanes")).scalars())
    statement = store._q(lanes_sql.LANES_SLEEP["postgresql"]).compile(dialect=store.engine.dialect)
    with store.engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()
        cursor.execute("EXPLAIN " + statement.string,
                       {"lane_ids": lane_ids, "now": None})
        plan = "\n".join(r[0] for r in cursor.fetchall())
        conn.rollback()
    assert "Seq Scan on runs" not in plan, plan
    assert "Index Scan using ix_runs_lane_dispatch" in plan, plan


def test_a_claim_locks_only_the_runs_its_shares_can_take(store: Store, db_url: str) -> None:
    """Every run the claim walks is locked (FOR UPDATE SKIP LOCKED) until it commits, and
    other claimers skip it. 8 tenants and a claim of 10: each lane can get 2 runs at
    most, so 16 are locked while the claim runs; it locked 80 (10 per lane) while the
    bound ignored that the lanes take turns."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks (SQLite locks the whole file)")
    submit_each(store, [f"t{i % 8}" for i in range(160)])
    locked_while_claiming: list[int] = []

    def count_locked(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        if "page AS (" not in statement:
            return
        with store.engine.connect() as other:  # another session: skips what is locked
            free = other.execute(text(
                "SELECT COUNT(*) FROM (SELECT run_id FROM runs WHERE status = 'QUEUED' "
                "FOR UPDATE SKIP LOCKED) free")).scalar_one()
            other.rollback()
        locked_while_claiming.append(160 - free)

    event.listen(store.engine, "after_cursor_execute", count_locked)
    try:
        leases = store.claim("w1", limit=10, lease_ttl=TTL)
    finally:
        event.remove(store.engine, "after_cursor_execute", count_locked)
    assert len(leases) == 10
    assert Counter(lease.tenant for lease in leases).most_common(1)[0][1] == 2
    assert locked_while_claiming and max(locked_while_claiming) <= 16, locked_while_claiming


def test_the_claims_pick_is_planned_once_per_session_not_per_claim(
        store: Store, db_url: str) -> None:
    """PostgreSQL keeps a prepared statement on custom plans (planned at every
    execution) while its generic plan looks dearer. The pick's did: its array of
    served routes was costed at 10 routes, and every claim paid 0.5-0.7 ms of planning
    for 0.4-0.6 ms of execution. Bounded by the array's own length, the generic plan
    wins after the first custom plans, as for the claim's other statements."""
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's plan cache")
    submit_each(store, [f"t{i % 4}" for i in range(40)])
    for _ in range(12):
        store.complete_many(store.claim("w1", limit=1, lease_ttl=TTL))
    with store.engine.connect() as conn:  # the one pooled session the claims used
        assert_planned_once(conn, "page AS (")


def submit_each(store: Store, tenants: list[str], **fields: Any) -> list[Any]:
    return store.submit([spec(tenant=t, **fields) for t in tenants])


def test_equal_created_at_at_a_page_boundary_neither_skipped_nor_repeated(
        store: Store, clock: ManualClock) -> None:
    """Keyset paging on (created_at, run_id): 250 deferred runs stamped the same instant,
    re-admitted in pages of 100, each exactly once."""
    apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'defer'\n"
                 "retry_after_seconds = 60\n")
    runs = submit(store, 250)
    assert {r.status for r in runs} == {S.WAITING_CAPACITY.value}
    apply(store, "[defaults]\nqueue = 'default'\n")
    clock.advance(61)
    assert store.schedule_pass(page_size=100)["readmitted"] == 250
    claimed = [lease.run_id for _ in range(3)
               for lease in store.claim("w1", limit=100, lease_ttl=TTL)]
    assert sorted(claimed) == sorted(r.run_id for r in runs)
    for r in runs[:5]:
        assert events_of(store, r.run_id).count(("WAITING_CAPACITY", "QUEUED")) == 1


def test_a_new_tenant_is_not_delayed_by_other_tenants_backlogs(
        store: Store, clock: ManualClock) -> None:
    """Its first run is the next one claimed, behind 2,000 runs of one tenant or 40
    tenants' backlogs (more lanes than a claim reads in one page)."""
    store.submit([spec(tenant="flood") for _ in range(2000)])
    store.submit([spec(tenant=f"t{i:02d}") for i in range(40) for _ in range(5)])
    store.claim("w0", limit=7, lease_ttl=TTL)  # the backlogs are being served
    clock.advance(1)
    late = submit(store, tenant="late")[0]
    [first] = store.claim("w1", lease_ttl=TTL)
    assert first.run_id == late.run_id
    # And it banked no credit: its next run waits its turn behind tenants that have
    # been served less.
    clock.advance(1)
    again = submit(store, tenant="late")[0]
    [following] = store.claim("w1", lease_ttl=TTL)
    assert following.run_id != again.run_id and following.tenant != "late"


def test_weighted_fair_share_between_tenants(store: Store) -> None:
    apply(store, "[tenants.gold]\nweight = 3.0\n[tenants.tin]\nweight = 1.0\n")
    store.submit([spec(tenant="gold") for _ in range(40)] +
                 [spec(tenant="tin") for _ in range(40)])
    served = Counter(lease.tenant for _ in range(10)
                     for lease in store.claim("w1", limit=4, lease_ttl=TTL))
    assert served == {"gold": 30, "tin": 10}


# --- routing -------------------------------------------------------------------------


def test_capability_routing_and_unroutable_runs(store: Store) -> None:
    java = submit(store, requires={"jdk": ">=21", "tools": ["git", "maven"]})[0]
    big = submit(store, requires={"workspace_gb": 50})[0]
    plain = submit(store)[0]
    store.register_worker("old-jdk", version="t", queues=["default"],
                          capabilities={"jdk": "17.0.2", "tools": ["git", "maven"]})
    caps17 = {"jdk": "17.0.2", "tools": ["git", "maven"], "workspace_gb": 100}
    got = {lease.run_id for lease in store.claim("old-jdk", limit=5, lease_ttl=TTL,
                                                  capabilities=caps17)}
    assert got == {big.run_id, plain.run_id}
    unroutable = store.unroutable_runs()
    assert [r["run_id"] for r in unroutable] == [java.run_id]
    assert "jdk>=21" in unroutable[0]["unroutable_because"]
    caps21 = {"jdk": "21.0.1", "tools": ["git", "maven", "rg"]}
    store._routes_cache.clear()
    assert [lease.run_id for lease in store.claim("new-jdk", limit=5, lease_ttl=TTL,
                                                   capabilities=caps21)] == [java.run_id]


# --- budgets and cost ------------------------------------------------------------------


def test_per_run_cost_limit_and_tenant_spend(store: Store) -> None:
    apply(store, "[defaults.limits]\nmax_cost_usd = 1.0\n")
    run = submit(store, estimated_cost_usd=0.4)[0]
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    assert lease.limits["max_cost_usd"] == 1.0
    store.report_cost(lease, 0.6)
    with pytest.raises(CostLimitExceeded):
        store.report_cost(lease, 0.6)
    shown = store.get_run(run.run_id)
    assert shown["cost_usd"] == pytest.approx(1.2)
    assert shown["estimated_cost_usd"] == 0.4
    assert shown["attempts"][0]["estimated_cost_usd"] == 0.4
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT usd FROM tenant_spend")).scalar() == pytest.approx(1.2)


# --- dependencies and lineage -----------------------------------------------------------


def test_dependencies_release_on_success_and_cancel_on_failure(store: Store) -> None:
    a, b = submit(store, 2)
    child = store.submit([spec(depends_on=[a.task_id, b.task_id], parent_task_id=a.task_id)])[0]
    doomed = store.submit([spec(depends_on=[b.task_id])])[0]
    assert (child.status, doomed.status) == (S.ADMITTED.value, S.ADMITTED.value)
    assert store.get_run(child.run_id)["task"]["parent_task_id"] == a.task_id
    leases = {lease.run_id: lease for lease in store.claim("w1", limit=2, lease_ttl=TTL)}
    la, lb = leases[a.run_id], leases[b.run_id]
    for stage in (S.PREPARING_SANDBOX, S.RUNNING, S.FINALIZING):
        store.advance(la, stage)
    store.complete(la)
    assert run_row(store, child.run_id).status == S.ADMITTED.value  # b still running
    store.fail(lb, Reason.AGENT_FAILED)
    assert run_row(store, doomed.run_id).status == S.CANCELLED.value
    assert run_row(store, doomed.run_id).reason_code == Reason.DEPENDENCY_FAILED
    assert run_row(store, child.run_id).status == S.CANCELLED.value
    assert store.audit() == []


def test_unknown_dependency_is_refused(store: Store) -> None:
    from runlane.domain.tasks import TaskInvalid
    with pytest.raises(TaskInvalid, match="depends_on"):
        store.submit([spec(depends_on=["no-such-task"])])
    assert statuses(store) == Counter()


# --- the pass trigger -------------------------------------------------------------------


def test_triggers_during_a_pass_fold_into_exactly_one_follow_up() -> None:
    started, release = threading.Event(), threading.Event()
    passes: list[int] = []

    def one_pass() -> dict[str, int]:
        passes.append(len(passes))
        if len(passes) == 1:
            started.set()
            release.wait(5)
        return {}

    trigger = PassTrigger(one_pass)
    runner = threading.Thread(target=trigger.run_pending)
    trigger.request()
    runner.start()
    assert started.wait(5)
    for _ in range(10):
        trigger.request()  # arrives while the first pass runs
    assert trigger.run_pending() is False  # single flight: this caller does not run one
    release.set()
    runner.join(5)
    assert passes == [0, 1]  # the first pass and exactly one follow-up


# --- audit and repair of the scheduler's bookkeeping -----------------------------------


def test_audit_catches_and_reconciler_repairs_drifted_counts(store: Store) -> None:
    apply(store, "[concurrency]\nper_tenant_max_active = 1\n")
    submit(store, 3)
    [lease] = store.claim("w1", limit=3, lease_ttl=TTL)
    assert store.audit() == []
    execute(store, "UPDATE lanes SET queued_count = 0")  # the lane looks empty
    execute(store, "UPDATE limit_counters SET active = 0")  # the slot looks free
    found = {v.check for v in store.audit()}
    # the tenant's lane stays hidden while its counter says it has room
    assert found == {"lane_count_drift", "slot_count_drift", "lane_hidden_below_tenant_limit"}
    assert store.claim("w2", limit=3, lease_ttl=TTL) == []  # hidden lane: starved
    counts = store.reconcile()
    assert (counts["lane_counts_repaired"], counts["slot_counters_repaired"]) == (1, 1)
    assert store.audit() == []
    assert store.claim("w2", limit=3, lease_ttl=TTL) == []  # the tenant's one slot is held
    store.complete(lease)
    assert len(store.claim("w2", limit=3, lease_ttl=TTL)) == 1


def test_the_reconciler_never_waits_on_a_lane_another_transaction_holds(
        store: Store, db_url: str) -> None:
    """A lane locked elsewhere (a submit or a claim half-way) is left for the next
    pass instead of waited on: the recount is in no lock cycle."""
    if not db_url.startswith("postgresql"):
        pytest.skip("row locks: PostgreSQL (SQLite serializes writers on the file)")
    submit(store, 2)
    execute(store, "UPDATE lanes SET queued_count = 0")
    holder = Store(db_url)
    try:
        with holder.engine.connect() as conn:
            conn.execute(text("SELECT lane_id FROM lanes FOR UPDATE"))
            started = time.monotonic()
            counts = store.reconcile()  # would block here if it waited
            assert time.monotonic() - started < 5
            assert counts["lane_counts_repaired"] == 0
            conn.rollback()
    finally:
        holder.close()
    assert store.reconcile()["lane_counts_repaired"] == 1
    assert store.audit() == []


def test_a_new_policy_readmits_deferred_runs_at_once(
        store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Event-driven: applying a policy wakes the scheduler (NOTIFY on PostgreSQL; the
    next pass elsewhere), which then looks at deferred runs before their retry-after.
    The scheduler's listener connects slowly here: a policy applied before it listens
    must still be seen (its loop read the version before it listened, and the policy
    waited for the periodic pass: this test failed 2 times in 30)."""
    from runlane.services.scheduler import Scheduler, SchedulerConfig
    from runlane.store import wakeup

    libpq_url = wakeup.libpq_url

    def slow_url(url: str) -> str:
        time.sleep(0.3)
        return libpq_url(url)

    monkeypatch.setattr(wakeup, "libpq_url", slow_url)

    apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'defer'\n"
                 "retry_after_seconds = 3600\n")
    run = submit(store)[0]
    assert run.status == S.WAITING_CAPACITY.value
    live = Store(db_url)  # the service on the database clock, as in `runlane maintain`
    scheduler = Scheduler(live, SchedulerConfig(interval_seconds=60.0))
    scheduler.run_once()  # sees the current version; nothing is due
    assert run_row(store, run.run_id).status == S.WAITING_CAPACITY.value
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.run_forever, args=(stop,))
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while scheduler.passes < 2:  # the loop's first pass is done: it now waits
            assert time.monotonic() < deadline
            time.sleep(0.01)
        apply(store, "[defaults]\nqueue = 'default'\n")  # the rule is gone
        if not live.is_postgres:
            scheduler.run_once()
        deadline = time.monotonic() + 10
        while run_row(store, run.run_id).status != S.QUEUED.value:
            assert time.monotonic() < deadline, "the deferred run was not re-admitted"
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(timeout=10)
        live.close()


def test_the_reconciler_leaves_runs_waiting_for_dependencies_alone(
        store: Store, clock: ManualClock) -> None:
    parent = submit(store)[0]
    child = store.submit([spec(depends_on=[parent.task_id])])[0]
    clock.advance(3600)
    assert store.reconcile(admitted_grace=0)["admitted_requeued"] == 0
    assert run_row(store, child.run_id).status == S.ADMITTED.value
    assert store.schedule_pass()["dependencies_resolved"] == 0


def test_a_tenant_over_its_daily_budget_starts_nothing_more_today(
        store: Store, clock: ManualClock) -> None:
    apply(store, "[tenants.acme]\ndaily_model_budget_usd = 1.0\n")
    runs = submit(store, 2)
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    second = next(r for r in runs if r.run_id != lease.run_id)
    store.report_cost(lease, 1.5)  # the day's budget is spent by the first run
    assert store.claim("w1", limit=1, lease_ttl=TTL) == []
    row = run_row(store, second.run_id)
    assert (row.status, row.reason_code) == (S.WAITING_CAPACITY.value,
                                             Reason.TENANT_DAILY_MODEL_BUDGET_EXCEEDED)
    assert row.visible_at == 1800057600.0  # the next UTC midnight
    clock.set(1800057600.0 + 1)
    assert store.schedule_pass()["readmitted"] == 1
    assert [x.run_id for x in store.claim("w1", limit=1, lease_ttl=TTL)] == [second.run_id]


def test_two_schedulers_at_once_readmit_each_run_exactly_once(
        store: Store, clock: ManualClock, db_url: str) -> None:
    apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'defer'\n"
                 "retry_after_seconds = 60\n")
    runs = store.submit([spec() for _ in range(300)])
    apply(store, "[defaults]\nqueue = 'default'\n")
    clock.advance(61)
    stores = [Store(db_url, clock=clock) for _ in range(2)]
    results: list[dict[str, int]] = []
    go = threading.Barrier(2)

    def one(s: Store) -> None:
        go.wait()
        results.append(s.schedule_pass(page_size=25))

    threads = [threading.Thread(target=one, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s in stores:
        s.close()
    assert sum(r["readmitted"] for r in results) == 300
    with store.engine.connect() as conn:
        moved = conn.execute(text(
            "SELECT run_id, COUNT(*) AS n FROM run_events WHERE from_status = 'WAITING_CAPACITY'"
            " AND to_status = 'QUEUED' GROUP BY run_id")).all()
    assert len(moved) == 300 and {r.n for r in moved} == {1}
    assert {r.run_id for r in moved} == {r.run_id for r in runs}
    assert store.audit() == []


def test_a_lane_another_claim_moved_is_not_walked_twice_in_one_claim(
        store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim reads lanes a page (a statement) at a time. Between two pages another
    claim may commit and advance a lane's pass past the page's keyset, so the next
    page brings that lane again: the claim must not walk it from its head again and
    take its runs twice. (The 8-process test hit this one claim in a few thousand.)"""
    if not db_url.startswith("postgresql"):
        pytest.skip("a statement's snapshot: PostgreSQL (SQLite reads one snapshot)")
    for i in range(17):  # each new lane joins just ahead of the others: t16 leads
        submit(store, 2, tenant=f"t{i:02d}")
    # Lanes t00-t03 lead the pick, but all their runs wait for a backoff: they come
    # up short, and the claim of 16 needs a second page (t04, the 17th lane).
    execute(store, "UPDATE runs SET visible_at = visible_at + 3600 "
                   "WHERE tenant IN ('t00', 't01', 't02', 't03')")
    execute(store, "UPDATE lanes SET pass = pass - 1 "
                   "WHERE tenant IN ('t00', 't01', 't02', 't03')")
    pick = store._pick_lanes
    pages: list[list[int]] = []

    def pick_then_move_a_lane(*args: Any, **kwargs: Any) -> Any:
        page = pick(*args, **kwargs)
        pages.append([lane.lane_id for lane in page[0]])
        if len(pages) == 1:  # another claim commits: the page's last lane moves on,
            # just past the page's keyset and still ahead of t04
            execute(store, "UPDATE lanes SET pass = pass + 1e-7 WHERE lane_id = :lane",
                    lane=pages[0][-1])
        return page

    monkeypatch.setattr(store, "_pick_lanes", pick_then_move_a_lane)
    leases = store.claim("w1", limit=16, lease_ttl=TTL)
    assert len(pages) >= 2 and pages[0][-1] in pages[1]  # the lane came again
    assert len({lease.run_id for lease in leases}) == len(leases) == 16
    assert store.audit() == []
