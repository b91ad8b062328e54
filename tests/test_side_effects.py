"""The side-effect ledger (invariant 8), on both engines."""

from __future__ import annotations

import pytest

from runlane.clock import ManualClock
from runlane.errors import CancelRequested, LeaseLost
from runlane.store.store import Store
from runlane.worker.effects import perform_effect

from .support import execute, submit

TTL = 30.0


def test_intent_then_done_then_the_recorded_result_is_returned(store: Store) -> None:
    submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    intent = store.effect_intent(lease, "pull_request")
    assert (intent.status, intent.fencing_token, intent.result) == ("INTENT", 1, None)
    store.effect_done(lease, "pull_request", {"number": 7})
    again = store.effect_intent(lease, "pull_request")
    assert (again.status, again.result) == ("DONE", {"number": 7})
    assert store.audit() == []


def test_perform_effect_acts_once_and_adopts_what_it_finds(store: Store) -> None:
    submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    calls: list[str] = []

    def do() -> dict[str, object]:
        calls.append("do")
        return {"number": 1}

    assert perform_effect(store, lease, "pr", find=lambda: None, do=do) == {"number": 1}
    assert perform_effect(store, lease, "pr", find=lambda: None, do=do) == {"number": 1}
    assert calls == ["do"]
    found = perform_effect(store, lease, "push", find=lambda: {"sha": "abc"}, do=do)
    assert found == {"sha": "abc", "adopted": True} and calls == ["do"]


def test_no_intent_without_a_live_lease_or_after_a_cancel(store: Store,
                                                          clock: ManualClock) -> None:
    [a, b] = submit(store, 2)
    [la, lb] = sorted(store.claim("w1", limit=2, lease_ttl=TTL),
                      key=lambda lease: lease.run_id == b.run_id)
    store.cancel(a.task_id if la.run_id == a.run_id else b.task_id)
    with pytest.raises(CancelRequested):
        store.effect_intent(la, "push_branch")
    with pytest.raises(CancelRequested):
        store.check_lease(la)
    clock.advance(TTL + 1)
    with pytest.raises(LeaseLost):
        store.effect_intent(lb, "push_branch")
    assert store.side_effects() == []


def test_a_newer_lease_takes_over_an_unfinished_intent(store: Store,
                                                       clock: ManualClock) -> None:
    [sub] = submit(store)
    [old] = store.claim("w1", lease_ttl=TTL)
    store.effect_intent(old, "pull_request")  # then the worker freezes
    clock.advance(TTL + 1)
    store.reap_expired_leases()
    clock.advance(100)
    [new] = store.claim("w2", lease_ttl=TTL)
    assert store.effect_intent(new, "pull_request").fencing_token == new.fencing_token
    with pytest.raises(LeaseLost):
        store.effect_done(old, "pull_request", {"number": 1})  # the stale holder wakes up
    store.effect_done(new, "pull_request", {"number": 2})
    [effect] = store.side_effects(sub.run_id)
    assert (effect.status, effect.fencing_token, effect.result) == ("DONE", 2, {"number": 2})
    assert store.audit() == []


def test_audit_flags_an_effect_recorded_outside_its_lease(store: Store) -> None:
    [sub] = submit(store)
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.effect_intent(lease, "push_branch")
    store.effect_done(lease, "push_branch", {"sha": "x"})
    execute(store, "UPDATE side_effects SET completed_at = completed_at + 1000 "
            "WHERE run_id = :r", r=sub.run_id)
    assert [v.check for v in store.audit()] == ["side_effect_with_stale_token"]
