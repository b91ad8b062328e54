"""Approval gates (docs/policy.md): a run a gate holds waits in AWAITING_APPROVAL,
holds no slot and is never claimed; approved it is admitted again under the policy in
force, rejected or expired it ends POLICY_DENIED and never starts. On both engines."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.api import Runlane
from runlane.clock import ManualClock
from runlane.domain.admission import AdmissionRequest, TenantUsage, admit
from runlane.domain.policy import PolicyInvalid, parse_policy, policy_document
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus as S
from runlane.errors import Conflict, NotFound
from runlane.services.scheduler import Scheduler
from runlane.store.approvals import decide_approval, pending_approvals
from runlane.store.store import Store
from tests.http_support import Served, make_token, serve
from tests.support import cli_env, events_of, one_line_error, run_row, submit

GATED = """
[concurrency]
global_max_active = 1

[[approvals]]
name = "risky"
when = { risk_class = "high" }
timeout_seconds = 600

[[approvals]]
name = "costly"
when = { estimated_cost_usd_above = 10 }

[[repositories]]
match = "*/payments*"
risk_class = "high"
"""
PAYMENTS = "/srv/git/payments.git"
NOW = 1_800_000_000.0


def apply(store: Store, text: str) -> int:
    return store.apply_policy(parse_policy(text), source="test").version


def slots(store: Store) -> int:
    """Slots held in every scope: the attempts that hold them."""
    with store.engine.connect() as conn:
        return int(conn.execute(text(
            "SELECT COUNT(*) FROM attempts WHERE limit_scopes IS NOT NULL "
            "AND ended_at IS NULL")).scalar() or 0)


# --- the policy and admission (pure) ------------------------------------------------


def test_gates_decide_after_every_other_check() -> None:
    policy = parse_policy(GATED + '\n[[rules]]\nwhen = { tenant = "banned" }\naction = "deny"\n')
    held = admit(AdmissionRequest("acme", "/srv/git/payments.git"), policy, 3, TenantUsage(),
                 NOW)
    assert (held.decision, held.reason_code) == ("REQUIRE_APPROVAL", Reason.APPROVAL_REQUIRED)
    assert held.retry_after == NOW + 600 and "'risky'" in (held.message or "")
    # A deny rule decides first: an approval gate never turns a DENY into a wait.
    denied = admit(AdmissionRequest("banned", "/srv/git/payments.git"), policy, 3,
                   TenantUsage(), NOW)
    assert denied.decision == "DENY"
    # Past its gate (approved, or re-checked at claim): every other check still applies.
    assert admit(AdmissionRequest("acme", "/srv/git/payments.git", gated=False), policy, 3,
                 TenantUsage(), NOW).decision == "ADMIT"
    # The cost gate: only an estimate above the threshold (no estimate: not held).
    for cost, decision in ((None, "ADMIT"), (10.0, "ADMIT"), (10.01, "REQUIRE_APPROVAL")):
        got = admit(AdmissionRequest("acme", "/srv/git/app.git", estimated_cost_usd=cost),
                    policy, 3, TenantUsage(), NOW)
        assert got.decision == decision, cost
    assert got.retry_after == NOW + 86_400  # the default timeout: one day


def test_a_policy_without_gates_keeps_its_digest_and_bad_gates_name_their_field() -> None:
    assert "approvals" not in policy_document(parse_policy("[defaults]\nqueue = 'q'\n"))
    for bad, field in (('[[approvals]]\ntimeout_seconds = 0\n', "approvals[0].timeout_seconds"),
                       ('[[approvals]]\nwhen = { estimated_cost_usd_above = -1 }\n',
                        "approvals[0].when.estimated_cost_usd_above"),
                       ('[[approvals]]\naction = "deny"\n', "approvals[0].action")):
        with pytest.raises(PolicyInvalid) as caught:
            parse_policy(bad, "p.toml")
        assert caught.value.field == field


# --- the store, on both engines -----------------------------------------------------


def test_a_held_run_takes_no_slot_and_is_never_claimed_until_approved(store: Store) -> None:
    version = apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    assert held.status == S.AWAITING_APPROVAL.value
    assert run_row(store, held.run_id).reason_code == Reason.APPROVAL_REQUIRED
    # Not claimable, holds no slot: another run takes the only global slot.
    assert store.claim("w1", limit=5) == []
    [other] = submit(store)
    [lease] = store.claim("w1", limit=5)
    assert lease.run_id == other.run_id and slots(store) == 1
    assert [p["run_id"] for p in pending_approvals(store)] == [held.run_id]
    assert pending_approvals(store, tenant="someone-else") == []
    done = decide_approval(store, held.run_id, approve=True, actor="alice", note="checked")
    assert (done.decision, done.status, done.policy_version) == ("APPROVED", "QUEUED", version)
    assert store.claim("w2", limit=5) == []  # the global limit of 1 is held by `other`


def test_approve_then_claim(store: Store) -> None:
    apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    done = decide_approval(store, held.run_id, approve=True, actor="alice")
    assert done.status == S.QUEUED.value and not done.repeated
    [lease] = store.claim("w1")
    assert lease.run_id == held.run_id
    assert events_of(store, held.run_id)[:3] == [
        (None, "AWAITING_APPROVAL"), ("AWAITING_APPROVAL", "QUEUED"), ("QUEUED", "CLAIMED")]
    # The same decision again: the first one, recorded once; the other one: a Conflict.
    again = decide_approval(store, held.run_id, approve=True, actor="bob")
    assert again.repeated and again.actor == "alice"
    with pytest.raises(Conflict, match="already approved by alice"):
        decide_approval(store, held.run_id, approve=False, actor="bob")


def test_reject_ends_the_run_for_good(store: Store) -> None:
    apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    done = decide_approval(store, held.run_id, approve=False, actor="bob", note="too risky")
    assert (done.decision, done.status, done.note) == ("REJECTED", "POLICY_DENIED", "too risky")
    row = run_row(store, held.run_id)
    assert (row.status, row.reason_code) == ("POLICY_DENIED", Reason.APPROVAL_REJECTED)
    assert row.ended_at is not None
    with pytest.raises(Conflict, match="already rejected"):
        decide_approval(store, held.run_id, approve=True, actor="alice")
    assert store.claim("w1", limit=5) == []
    assert run_row(store, held.run_id).status == "POLICY_DENIED"


def test_a_run_never_held_is_a_conflict_and_an_unknown_one_not_found(store: Store) -> None:
    [plain] = submit(store)
    with pytest.raises(Conflict, match="not waiting for approval"):
        decide_approval(store, plain.run_id, approve=True, actor="alice")
    with pytest.raises(NotFound):
        decide_approval(store, "no-such-run", approve=True, actor="alice")
    apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    with pytest.raises(NotFound):  # another tenant's run: as if it did not exist
        decide_approval(store, held.run_id, approve=True, actor="eve", tenant="other")


def test_expiry_by_the_scheduler_pass_and_its_clock(store: Store, clock: ManualClock) -> None:
    apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    scheduler = Scheduler(store)
    clock.advance(599)
    assert scheduler.run_once()["approvals_expired"] == 0
    assert run_row(store, held.run_id).status == S.AWAITING_APPROVAL.value
    clock.advance(2)
    assert scheduler.run_once()["approvals_expired"] == 1
    row = run_row(store, held.run_id)
    assert (row.status, row.reason_code) == ("POLICY_DENIED", Reason.APPROVAL_EXPIRED)
    with pytest.raises(Conflict, match="already expired by scheduler"):
        decide_approval(store, held.run_id, approve=True, actor="alice")
    assert store.claim("w1", limit=5) == []


def test_approval_then_a_deny_policy_ends_the_run_at_claim(store: Store) -> None:
    apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    assert decide_approval(store, held.run_id, approve=True, actor="alice").status == "QUEUED"
    apply(store, GATED + '\n[[rules]]\nwhen = { repo = "*/payments*" }\naction = "deny"\n')
    assert store.claim("w1", limit=5) == []
    row = run_row(store, held.run_id)
    assert (row.status, row.reason_code) == ("POLICY_DENIED", Reason.POLICY_RULE_DENIED)


def test_approval_under_a_deny_policy_denies_the_run(store: Store) -> None:
    """Approval admits the run again under the policy in force: a DENY since wins."""
    apply(store, GATED)
    [held] = submit(store, repo=PAYMENTS)
    apply(store, GATED + '\n[[rules]]\nwhen = { repo = "*/payments*" }\naction = "deny"\n')
    done = decide_approval(store, held.run_id, approve=True, actor="alice")
    assert (done.decision, done.status) == ("APPROVED", "POLICY_DENIED")


def test_a_deferred_run_meets_its_gate_when_admitted(store: Store, clock: ManualClock) -> None:
    """A run deferred at submit (a full tenant queue) is held when the scheduler admits
    it; approved and deferred again, it is not held a second time."""
    apply(store, GATED + "\n[tenants.acme]\nmax_queued = 0\n")
    [deferred] = submit(store, repo=PAYMENTS)
    assert deferred.status == S.WAITING_CAPACITY.value
    apply(store, GATED)
    counts = store.schedule_pass(not_yet_due=True)
    assert counts["held_for_approval"] == 1
    assert run_row(store, deferred.run_id).status == S.AWAITING_APPROVAL.value
    apply(store, GATED + "\n[tenants.acme]\nmax_queued = 0\n")
    assert decide_approval(store, deferred.run_id, approve=True,
                           actor="alice").status == "WAITING_CAPACITY"
    apply(store, GATED)
    assert store.schedule_pass(not_yet_due=True)["readmitted"] == 1
    assert run_row(store, deferred.run_id).status == S.QUEUED.value


def test_two_approvers_at_once_record_one_approval(db_url: str, clock: ManualClock) -> None:
    stores = [Store(db_url, clock=clock) for _ in range(4)]
    try:
        apply(stores[0], GATED)
        [held] = submit(stores[0], repo=PAYMENTS)
        barrier = threading.Barrier(len(stores))
        results: list[Any] = []

        def approve(store: Store, who: str) -> None:
            barrier.wait()
            results.append(decide_approval(store, held.run_id, approve=True, actor=who))

        threads = [threading.Thread(target=approve, args=(s, f"approver-{i}"))
                   for i, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == len(stores)
        assert sum(not r.repeated for r in results) == 1
        assert len({(r.actor, r.decided_at) for r in results}) == 1  # all see the first
        assert [e for e in events_of(stores[0], held.run_id)
                if e[0] == "AWAITING_APPROVAL"] == [("AWAITING_APPROVAL", "QUEUED")]
        with stores[0].engine.connect() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM run_approvals")).scalar() == 1
    finally:
        for s in stores:
            s.close()


# --- the HTTP API: the approve role, and another tenant's token ------------------------


@pytest.fixture
def served(db_url: str, tmp_path: Path) -> Iterator[Served]:
    with serve(db_url, tmp_path) as server:
        yield server


def test_http_approve_role_and_tenant_scoping(served: Served) -> None:
    db = served.database_url
    with Runlane(db) as lane:
        lane.store.apply_policy(parse_policy(GATED), source="test")
        ours = lane.submit("acme", PAYMENTS, "ours")
        theirs = lane.submit("globex", PAYMENTS, "theirs")
    acme_approver = make_token(db, "approve", "acme")
    acme_submitter = make_token(db, "submit", "acme")
    globex_approver = make_token(db, "approve", "globex")
    with served.client(globex_approver) as client:
        # Another tenant's run: not listed, and as unknown as a run that does not exist.
        assert [p["run_id"] for p in client.get("/v1/approvals").json()] == [theirs.run_id]
        assert client.get("/v1/approvals", params={"tenant": "acme"}).json() == []
        for verb in ("approve", "reject"):
            refused = client.post(f"/v1/runs/{ours.run_id}/{verb}", json={"note": "mine now"})
            assert refused.status_code == 404, refused.text
            assert refused.json()["reason_code"] == "NOT_FOUND"
    with served.client(acme_submitter) as client:  # a submitter never approves
        refused = client.post(f"/v1/runs/{ours.run_id}/approve")
        assert (refused.status_code, refused.json()["reason_code"]) == (403, "FORBIDDEN")
    with Runlane(db) as lane:
        assert lane.run(ours.run_id).status == "AWAITING_APPROVAL"
        assert lane.run(ours.run_id).approval is None
    with served.client(acme_approver) as client:
        assert [p["run_id"] for p in client.get("/v1/approvals").json()] == [ours.run_id]
        done = client.post(f"/v1/runs/{ours.run_id}/approve", json={"note": "reviewed"})
        assert done.status_code == 200, done.text
        body = done.json()
        assert (body["decision"], body["status"], body["note"], body["repeated"]) == (
            "APPROVED", "QUEUED", "reviewed", False)
        assert body["actor"].startswith("token:")
        assert client.post(f"/v1/runs/{ours.run_id}/approve").json()["repeated"] is True
        late = client.post(f"/v1/runs/{ours.run_id}/reject")
        assert (late.status_code, late.json()["reason_code"]) == (409, "NOT_AWAITING_APPROVAL")
        shown = client.get(f"/v1/runs/{ours.run_id}").json()
        assert shown["approval"]["decision"] == "APPROVED"
        assert shown["approval"]["note"] == "reviewed"
    with Runlane(db) as lane:
        assert lane.run(theirs.run_id).status == "AWAITING_APPROVAL"  # untouched


# --- the CLI -----------------------------------------------------------------------------


def test_cli_list_approve_reject(db_url: str, tmp_path: Path) -> None:
    env = cli_env(tmp_path, RUNLANE_DATABASE_URL=db_url)
    with Runlane(db_url) as lane:
        lane.store.apply_policy(parse_policy(GATED), source="test")
        first = lane.submit("acme", PAYMENTS, "one")
        second = lane.submit("acme", PAYMENTS, "two")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runlane", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    listed = cli("approvals", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [p["run_id"] for p in json.loads(listed.stdout)] == [first.run_id, second.run_id]
    plain = cli("approvals", "list", "--output", "plain")
    assert plain.stdout.splitlines()[0].split("\t")[:2] == ["run_id", "tenant"]
    approved = cli("approve", first.run_id, "--note", "ok", "--by", "alice", "--json")
    assert approved.returncode == 0, approved.stderr
    assert json.loads(approved.stdout)["status"] == "QUEUED"
    rejected = cli("reject", second.task_id, "--note", "no")  # a task's id: its run
    assert rejected.returncode == 0, rejected.stderr
    assert f"run {second.run_id} rejected by" in rejected.stdout
    one_line_error(cli("approve", second.run_id), 2, "already rejected")
    one_line_error(cli("approve", "no-such-run"), 3, "no run")
    shown = json.loads(cli("runs", "show", first.run_id, "--json").stdout)
    assert (shown["approval"]["actor"], shown["approval"]["note"]) == ("alice", "ok")
    text_shown = cli("runs", "show", second.run_id).stdout
    assert "approval" in text_shown and "REJECTED by cli" in text_shown
    listed = cli("runs", "list", "--status", "awaiting_approval", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []


def test_top_counts_the_runs_awaiting_approval(db_url: str) -> None:
    from runlane.tui.render import header
    from runlane.tui.snapshot import FacadeSource

    with Runlane(db_url) as lane:
        lane.store.apply_policy(parse_policy(GATED), source="test")
        for prompt in ("one", "two"):
            lane.submit("acme", PAYMENTS, prompt)
        snap = FacadeSource(lane, failures=5, claim_window=60).fetch()
    assert snap.awaiting_approval == 2
    shown = header(snap, interval=None, stale=None, now=snap.taken_at).plain
    assert "queued 0  awaiting approval 2  active 0" in shown


def test_gates_add_no_statement_to_a_submit_or_a_claim_they_do_not_hold(store: Store) -> None:
    """A policy with approval gates (none matching these runs) sends the statements a
    policy without them sends: gates are decided in memory, and never at claim."""
    from sqlalchemy import event

    def sent_by_submit_and_claim() -> list[str]:
        submit(store)  # warm: the first submit and claim after a policy change read it
        assert len(store.claim("w", limit=1)) == 1
        seen: list[str] = []

        def record(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
            seen.append(statement)

        event.listen(store.engine, "before_cursor_execute", record)
        try:
            submit(store)
            assert len(store.claim("w", limit=1)) == 1
        finally:
            event.remove(store.engine, "before_cursor_execute", record)
        return seen

    apply(store, "[concurrency]\nglobal_max_active = 100\n")
    without = sent_by_submit_and_claim()
    apply(store, "[concurrency]\nglobal_max_active = 100\n"
                 '[[approvals]]\nwhen = { tenant = "nobody" }\n'
                 "[[approvals]]\nwhen = { estimated_cost_usd_above = 1000 }\n")
    assert sent_by_submit_and_claim() == without
