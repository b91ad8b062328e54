"""The fleet views on both engines, each with principals of two tenants: workers and
their leases, the remote drain (through a real worker process), queues and tenants from
the scheduler's counters, the policy in force and its versions."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.access import Principal, Role
from runlane.domain.policy import policy_from_document
from runlane.errors import Forbidden, NotFound
from runlane.models.fleet import LimitView
from runlane.store.store import Store

from .conftest import T0
from .support import bare_remote, cli_env, one_line_error, run_row
from .test_worker import AGENT_WRITES, WorkerProcess, wait_until

ACME = Principal(role=Role.READ, tenant="acme", token_id="t-acme")
ACME_ADMIN = Principal(role=Role.ADMIN, tenant="acme", token_id="t-acme-admin")
BETA = Principal(role=Role.SUBMIT, tenant="beta", token_id="t-beta")
GAMMA = Principal(role=Role.READ, tenant="gamma", token_id="t-gamma")
ADMIN = Principal(role=Role.ADMIN, tenant=None, token_id="t-admin")


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def submit(lane: Runlane, n: int, **fields: Any) -> list[str]:
    rows = [{"tenant": "acme", "repo": "/srv/git/app.git", "prompt": f"task {i}", **fields}
            for i in range(n)]
    return [s.run_id for s in lane.submit_batch(rows)]


def register(store: Store, worker_id: str, queues: list[str], **capabilities: Any) -> None:
    store.register_worker(worker_id, version="9.9", queues=queues, capabilities=capabilities)


def drain_requested(store: Store, worker_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT drain_requested_at FROM workers WHERE worker_id = :w"),
                            {"w": worker_id}).scalar_one()


POLICY = {
    "tenants": {"acme": {"weight": 3, "max_active": 2, "max_queued": 50,
                         "daily_model_budget_usd": 5},
                "beta": {"weight": 0.5}},
    "concurrency": {"per_queue_max_active": {"a": 4}},
}


# --- workers ---------------------------------------------------------------------------


def test_workers_with_their_leases_and_what_a_tenant_sees_of_them(
        lane: Runlane, clock: ManualClock) -> None:
    [acme_run] = submit(lane, 1, queue="a")
    [beta_run] = submit(lane, 1, queue="b", tenant="beta")
    store = lane.store
    register(store, "host/1/w1", ["a"], gpu="none")
    register(store, "host/2/w2", ["b"])
    register(store, "host/3/idle", ["a", "b"])
    register(store, "host/4/gone", ["a"])
    store.set_worker_status("host/4/gone", "STOPPED")
    [lease1] = store.claim("host/1/w1", "a", lease_ttl=600)
    [lease2] = store.claim("host/2/w2", "b", lease_ttl=600)
    assert (lease1.run_id, lease2.run_id) == (acme_run, beta_run)
    clock.advance(5)

    everything = {w.worker_id: w for w in lane.workers()}
    assert set(everything) == {"host/1/w1", "host/2/w2", "host/3/idle"}
    w1 = everything["host/1/w1"]
    assert (w1.status, w1.version, w1.queues, w1.capabilities) == (
        "READY", "9.9", ["a"], {"gpu": "none"})
    assert w1.heartbeat_age_seconds == pytest.approx(5.0)
    assert w1.leases_held == 1
    [lease] = w1.leases
    assert (lease.run_id, lease.tenant, lease.attempt_no, lease.fencing_token) == (
        acme_run, "acme", 1, lease1.fencing_token)
    assert everything["host/3/idle"].leases == []
    assert {w.worker_id for w in lane.workers(include_stopped=True)} == set(everything) | {
        "host/4/gone"}
    assert [w.worker_id for w in lane.workers(principal=ADMIN)] == list(everything)

    # A tenant sees the workers running its runs, with only those leases: not the
    # fleet, not what runs for another tenant.
    [mine] = lane.workers(principal=ACME)
    assert mine.worker_id == "host/1/w1"
    assert [x.run_id for x in mine.leases] == [acme_run]
    [theirs] = lane.workers(principal=BETA)
    assert [x.run_id for x in theirs.leases] == [beta_run]
    shown = json.dumps([w.model_dump(mode="json") for w in lane.workers(principal=ACME)])
    assert "beta" not in shown and beta_run not in shown and "host/2" not in shown
    assert lane.workers(principal=GAMMA) == []


def test_a_worker_holding_runs_of_two_tenants_shows_each_only_its_own(
        lane: Runlane) -> None:
    [acme_run] = submit(lane, 1)
    [beta_run] = submit(lane, 1, tenant="beta")
    register(lane.store, "host/1/both", ["default"])
    assert len(lane.store.claim("host/1/both", limit=2, lease_ttl=600)) == 2
    [seen] = lane.workers(principal=ACME)
    assert (seen.leases_held, [x.run_id for x in seen.leases]) == (1, [acme_run])
    [seen] = lane.workers(principal=BETA)
    assert (seen.leases_held, [x.run_id for x in seen.leases]) == (1, [beta_run])
    [seen] = lane.workers()
    assert seen.leases_held == 2


def test_draining_is_the_operators_and_the_worker_reads_it_at_its_heartbeat(
        lane: Runlane, clock: ManualClock) -> None:
    store = lane.store
    register(store, "host/1/w1", ["default"])
    register(store, "host/2/w2", ["default"])
    for principal in (ACME, BETA, ACME_ADMIN, Principal(role=Role.SUBMIT)):
        with pytest.raises(Forbidden, match="only an admin may drain"):
            lane.drain_worker("host/1/w1", principal=principal)
        with pytest.raises(Forbidden):  # the same answer for an id that does not exist
            lane.drain_worker("nope", principal=principal)
    assert drain_requested(store, "host/1/w1") is None  # nothing written
    with pytest.raises(NotFound, match="no worker 'nope'"):
        lane.drain_worker("nope")
    clock.advance(3)
    asked = lane.drain_worker("host/1/w1", principal=ADMIN)
    assert asked.drain_requested_at is not None
    assert asked.drain_requested_at.timestamp() == pytest.approx(T0 + 3)
    clock.advance(3)
    again = lane.drain_worker("host/1/w1")  # repeating it changes nothing
    assert again.drain_requested_at == asked.drain_requested_at
    # The heartbeat's status write answers the request; the worker is DRAINING from it.
    assert store.set_worker_status("host/1/w1", "READY") is True
    assert store.set_worker_status("host/2/w2", "READY") is False
    statuses = {w.worker_id: w.status for w in lane.workers()}
    assert statuses == {"host/1/w1": "DRAINING", "host/2/w2": "READY"}
    assert store.set_worker_status("host/1/w1", "STOPPED") is True
    assert {w.worker_id for w in lane.workers()} == {"host/2/w2"}


def test_a_real_worker_drains_at_its_next_heartbeat_as_on_sigterm(
        db_url: str, tmp_path: Path) -> None:
    """The worker process (heartbeat 0.3 s) is asked through the facade, not signalled:
    it stops claiming, finishes its run within the grace and exits 0; the other run
    stays queued, untouched."""
    remote = bare_remote(tmp_path)
    with Runlane(db_url) as lane:
        first, second = submit(lane, 2, repo=str(remote))
        worker = WorkerProcess(db_url, tmp_path, tmp_path / "forge", "sleep 3; " + AGENT_WRITES,
                               env={"RUNLANE_DRAIN_GRACE_SECONDS": "30",
                                    "RUNLANE_LEASE_TTL_SECONDS": "15"})
        try:
            def statuses() -> list[str]:
                return sorted(str(run_row(lane.store, r).status) for r in (first, second))

            wait_until(lambda: "RUNNING" in statuses(), 30, "a run to start")
            [view] = lane.workers()
            assert view.leases_held == 1 and view.drain_requested_at is None
            asked = lane.drain_worker(view.worker_id)
            assert asked.drain_requested_at is not None
            wait_until(lambda: lane.workers()[0].status == "DRAINING", 10,
                       "the worker to see the request")
            assert worker.wait(60) == 0
        finally:
            worker.stop()
        assert statuses() == ["QUEUED", "SUCCEEDED"]  # finished in the grace; nothing new
        queued = first if str(run_row(lane.store, first).status) == "QUEUED" else second
        assert run_row(lane.store, queued).attempt_count == 0
        [stopped] = lane.workers(include_stopped=True)
        assert stopped.status == "STOPPED" and stopped.leases_held == 0
        assert lane.workers() == []
        assert lane.store.audit() == []


# --- queues, tenants, limits ----------------------------------------------------------


def test_queues_tenants_and_limits_from_the_counters(lane: Runlane, clock: ManualClock) -> None:
    store = lane.store
    store.apply_policy(policy_from_document(POLICY), source="policy.toml")
    submit(lane, 3, queue="a")
    submit(lane, 1, queue="b")
    submit(lane, 2, queue="b", tenant="beta")
    clock.advance(30)
    [lease] = store.claim("host/1/w1", "a", lease_ttl=600)
    store.report_cost(lease, 1.25)
    clock.advance(10)

    queues = {q.queue: q for q in lane.queues()}
    assert set(queues) == {"a", "b"}
    assert (queues["a"].queued, queues["a"].active) == (2, 1)
    assert queues["a"].oldest_ready_age_seconds == pytest.approx(40.0)
    assert queues["a"].limits == [LimitView(scope="queue:a", max_active=4, active=1)]
    assert (queues["b"].queued, queues["b"].active, queues["b"].limits) == (3, 0, [])

    tenants = {t.tenant: t for t in lane.tenants()}
    assert set(tenants) == {"acme", "beta"}
    acme = tenants["acme"]
    assert (acme.queued, acme.active, acme.max_active, acme.max_queued) == (3, 1, 2, 50)
    assert (acme.weight, acme.spent_today_usd, acme.daily_budget_usd) == (3.0, 1.25, 5.0)
    assert acme.oldest_ready_age_seconds == pytest.approx(40.0)
    assert acme.limits == [LimitView(scope="tenant:acme", max_active=2, active=1)]
    beta = tenants["beta"]
    assert (beta.queued, beta.active, beta.max_active, beta.weight) == (2, 0, None, 0.5)
    assert (beta.spent_today_usd, beta.daily_budget_usd) == (0.0, None)

    # A tenant: its own tenant, and the queues it has runs in with its own counts; the
    # queue's limit counts every tenant's runs, so its `active` is not shown.
    assert [t.tenant for t in lane.tenants(principal=ACME)] == ["acme"]
    # Its fair share is not shown to it: the sum of the others' weights is theirs.
    assert acme.fair_share == pytest.approx(3 / 3.5)
    assert lane.tenants(principal=ACME)[0] == acme.model_copy(update={"fair_share": None})
    mine = {q.queue: q for q in lane.queues(principal=ACME)}
    assert (mine["a"].queued, mine["a"].active) == (2, 1)
    assert mine["a"].limits == [LimitView(scope="queue:a", max_active=4, active=None)]
    assert (mine["b"].queued, mine["b"].active) == (1, 0)
    theirs = {q.queue: q for q in lane.queues(principal=BETA)}
    assert set(theirs) == {"b"} and theirs["b"].queued == 2
    [gamma] = lane.tenants(principal=GAMMA)  # a tenant with nothing: zeros, not others'
    assert (gamma.tenant, gamma.queued, gamma.active, gamma.spent_today_usd) == (
        "gamma", 0, 0, 0.0)
    assert lane.queues(principal=GAMMA) == []

    assert {lim.scope: (lim.active, lim.max_active) for lim in lane.limits()} == {
        "queue:a": (1, 4), "tenant:acme": (1, 2)}
    assert lane.limits(principal=ACME) == [
        LimitView(scope="tenant:acme", max_active=2, active=1)]
    assert lane.limits(principal=BETA) == []


def test_the_oldest_ready_age_leaves_out_runs_waiting_for_their_backoff(
        lane: Runlane, clock: ManualClock) -> None:
    [old] = submit(lane, 1)
    clock.advance(20)
    submit(lane, 1)
    clock.advance(5)
    with lane.store.engine.begin() as conn:  # the old run waits for a retry's backoff
        conn.execute(text("UPDATE runs SET visible_at = :later WHERE run_id = :r"),
                     {"later": T0 + 3600, "r": old})
    [queue] = lane.queues()
    assert queue.queued == 2
    assert queue.oldest_ready_age_seconds == pytest.approx(5.0)


# --- policy ------------------------------------------------------------------------------


def test_the_policy_document_is_the_operators_a_tenant_gets_its_own_terms(
        lane: Runlane) -> None:
    none = lane.policy(principal=ACME)
    assert (none.version, none.document, none.tenant_limits and none.tenant_limits.known) == (
        0, None, False)
    assert lane.policy_versions() == []
    store = lane.store
    store.apply_policy(policy_from_document({"tenants": {"beta": {"weight": 2}}}),
                       source="/etc/runlane/v1.toml")
    store.apply_policy(policy_from_document({**POLICY, "allow_unknown_tenants": False}),
                       source="/etc/runlane/v2.toml")

    current = lane.policy()
    assert (current.version, current.source) == (2, "/etc/runlane/v2.toml")
    assert current.document is not None and set(current.document["tenants"]) == {"acme", "beta"}
    assert lane.policy(principal=ADMIN) == current

    mine = lane.policy(principal=ACME)
    assert (mine.version, mine.document, mine.source, mine.digest) == (2, None, None, None)
    assert mine.tenant_limits is not None
    terms = mine.tenant_limits
    assert (terms.tenant, terms.known, terms.admitted, terms.weight, terms.max_active,
            terms.max_queued, terms.daily_budget_usd) == ("acme", True, True, 3.0, 2, 50, 5.0)
    assert "beta" not in mine.model_dump_json()
    assert "etc/runlane" not in mine.model_dump_json()
    stranger = lane.policy(principal=GAMMA).tenant_limits
    assert stranger is not None and (stranger.known, stranger.admitted) == (False, False)
    # An admin token of one tenant is that tenant's: the others' terms stay hidden.
    assert lane.policy(principal=ACME_ADMIN).document is None

    versions = lane.policy_versions()
    assert [(v.version, v.in_force, v.source) for v in versions] == [
        (2, True, "/etc/runlane/v2.toml"), (1, False, "/etc/runlane/v1.toml")]
    assert all(v.digest for v in versions)
    theirs = lane.policy_versions(principal=BETA)
    assert [(v.version, v.in_force, v.source, v.digest) for v in theirs] == [
        (2, True, None, None), (1, False, None, None)]


# --- the CLI -----------------------------------------------------------------------------


def runlane(db_url: str, tmp_path: Path, *args: str, code: int = 0
            ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url, *args],
                            capture_output=True, text=True, env=cli_env(tmp_path), timeout=60)
    assert result.returncode == code, (result.stdout, result.stderr)
    return result


def test_cli_workers_queues_tenants_policy_versions(db_url: str, tmp_path: Path) -> None:
    with Runlane(db_url) as lane:
        lane.store.apply_policy(policy_from_document(POLICY), source="policy.toml")
        submit(lane, 2, queue="a")
        register(lane.store, "host/1/w1", ["a"])

        def run(*args: str) -> Any:
            return json.loads(runlane(db_url, tmp_path, *args, "--json").stdout)

        [listed] = run("workers", "list")
        assert (listed["worker_id"], listed["status"], listed["leases"]) == (
            "host/1/w1", "READY", [])
        assert isinstance(listed["heartbeat_age_seconds"], float)
        drained = run("workers", "drain", "host/1/w1")
        assert drained["worker_id"] == "host/1/w1" and drained["drain_requested_at"]
        assert drain_requested(lane.store, "host/1/w1") is not None
        missing = runlane(db_url, tmp_path, "workers", "drain", "host/9/none", code=3)
        one_line_error(missing, 3, "no worker 'host/9/none'")
        assert "host/1/w1" in runlane(db_url, tmp_path, "workers", "list").stdout
        [queue] = run("queues", "list")
        assert (queue["queue"], queue["queued"], queue["limits"]) == (
            "a", 2, [{"scope": "queue:a", "max_active": 4, "active": 0}])
        tenants = {t["tenant"]: t for t in run("tenants", "list")}
        assert tenants["acme"]["queued"] == 2 and tenants["beta"]["weight"] == 0.5
        [version] = run("policy", "versions")
        assert (version["version"], version["in_force"], version["source"]) == (
            1, True, "policy.toml")
        assert "acme" in runlane(db_url, tmp_path, "tenants", "list").stdout
