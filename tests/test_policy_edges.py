"""Policy, retries, budgets and SQLite under concurrency (a review, 2026-12-02).

Every test here failed before its fix: each asserts what docs/policy.md, CONTRACT.md
or a user expects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.services.scheduler import Scheduler
from runlane.store.store import Store

from .conftest import migrated_sqlite
from .support import attempts_of, run_row, spec, submit
from .test_worker import forge_dir, pstore, remote, wait_until, workers  # noqa: F401

S = RunStatus
TTL = 30.0


def apply(store: Store, text_: str) -> int:
    return store.apply_policy(parse_policy(text_), source="test").version


# --- A. policy, admission, retries, budgets ----------------------------------------------


def test_the_policys_retry_base_seconds_sets_the_backoff(store: Store, clock: ManualClock
                                                         ) -> None:
    """docs/policy.md [retry]: base_seconds is the first retry delay (the store's
    settings are 10 s base, 100 s cap; the policy raises both)."""
    apply(store, "[retry]\nbase_seconds = 1000\nmax_seconds = 2000\n")
    run = submit(store)[0]
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    assert store.fail(lease, Reason.TIMEOUT) is S.QUEUED
    row = run_row(store, run.run_id)
    assert row.visible_at - clock.now() >= 1000.0


def test_the_policys_retry_max_cost_stops_retries(store: Store) -> None:
    """docs/policy.md [retry]: max_cost_usd: no retry once a run has cost this much."""
    apply(store, "[retry]\nmax_cost_usd = 1.0\n")
    run = submit(store)[0]
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    store.report_cost(lease, 1.5)
    status = store.fail(lease, Reason.TIMEOUT)
    row = run_row(store, run.run_id)
    assert (status, row.reason_code) == (S.FAILED, Reason.RETRY_BUDGET_EXHAUSTED)


def test_the_policys_retry_max_total_run_seconds_stops_retries(store: Store,
                                                                clock: ManualClock) -> None:
    """docs/policy.md [retry]: max_total_run_seconds: no retry once a run lasted this long."""
    apply(store, "[retry]\nmax_total_run_seconds = 60\n")
    run = submit(store)[0]
    [lease] = store.claim("w1", limit=1, lease_ttl=3600)
    clock.advance(600)
    status = store.fail(lease, Reason.TIMEOUT)
    row = run_row(store, run.run_id)
    assert (status, row.reason_code) == (S.FAILED, Reason.RETRY_BUDGET_EXHAUSTED)


def test_a_fresh_scheduler_after_a_policy_change_admits_the_deferred_runs(
        store: Store) -> None:
    """docs/policy.md "When the policy changes": deferred runs are looked at again at
    once, before their retry-after; a lifted rule admits them now. `runlane maintain
    --once` (and a restarted `runlane maintain`/`up`) runs a new Scheduler, whose first
    pass never sees the change."""
    apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'defer'\n"
                 "retry_after_seconds = 3600\n")
    run = submit(store)[0]
    assert run.status == S.WAITING_CAPACITY.value
    apply(store, "[concurrency]\nglobal_max_active = 5\n")  # the rule is lifted
    Scheduler(store).run_once()  # what `runlane maintain --once` does
    assert run_row(store, run.run_id).status == S.QUEUED.value


def test_a_run_over_its_max_cost_ends_limit_exceeded_even_if_the_agent_also_failed(
        pstore: Store, workers, remote) -> None:  # noqa: F811
    """docs/policy.md limits.max_cost_usd: LIMIT_EXCEEDED when an attempt reports more.
    An agent that reports a cost over the maximum and then a retryable failure (a rate
    limit) exits before the worker's watch loop sees the limit: the run is retried, and
    every retry spends again."""
    apply(pstore, "[defaults.limits]\nmax_cost_usd = 1.0\n")
    run = pstore.submit([spec(repo=str(remote))])[0]
    agent = ("echo '{\"runlane\": \"cost\", \"usd\": 5}'; "
             "echo '{\"runlane\": \"fail\", \"reason_code\": \"PROVIDER_RATE_LIMIT\", "
             "\"retry_after_seconds\": 0.1}'; exit 1")
    worker = workers(agent, "--exit-when-idle")
    wait_until(lambda: str(run_row(pstore, run.run_id).status) in ("FAILED", "SUCCEEDED"),
               60, "the run to end")
    worker.wait(30)
    row = run_row(pstore, run.run_id)
    tried = attempts_of(pstore, run.run_id)
    assert (row.status, row.reason_code, len(tried)) == ("FAILED", "LIMIT_EXCEEDED", 1), (
        row.status, row.reason_code, [(a.reason_code, a.cost_usd) for a in tried])



def test_a_deferred_run_the_new_version_denies_records_the_rules_message_and_both_versions(
        store: Store, clock: ManualClock) -> None:
    """docs/policy.md [[rules]]: a rule's `message` is recorded on the run; "A run the
    new version denies ends POLICY_DENIED, with a message that names both versions".
    A run deferred under v1 and denied by the scheduler pass under v2 records only
    "DENY under policy v2"."""
    v1 = apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'defer'\n"
                      "retry_after_seconds = 60\n")
    run = submit(store)[0]
    assert run.status == S.WAITING_CAPACITY.value
    v2 = apply(store, "[[rules]]\nwhen = { tenant = 'acme' }\naction = 'deny'\n"
                      "reason_code = 'TENANT_SUSPENDED'\nmessage = 'suspended for review'\n")
    clock.advance(120)
    store.schedule_pass()
    row = run_row(store, run.run_id)
    assert (row.status, row.reason_code) == (S.POLICY_DENIED.value, "TENANT_SUSPENDED")
    assert "suspended for review" in row.message, row.message
    assert f"v{v1}" in row.message and f"v{v2}" in row.message, row.message


@pytest.mark.parametrize(("first", "same"), [
    ("[[rules]]\nwhen = { tenant = ['a', 'b'] }\naction = 'deny'\n",
     "[[rules]]\nwhen = { tenant = ['b', 'a'] }\naction = 'deny'\n"),
    ("[[rules]]\naction = 'defer'\n",
     "[[rules]]\naction = 'defer'\nretry_after_seconds = 60\n"),
])
def test_an_equivalent_policy_makes_no_new_version(store: Store, first: str, same: str
                                                   ) -> None:
    """docs/policy.md "The digest": every default filled in, sets sorted; applying the
    same policy twice makes no new version. A `when` glob list is a set (any may match)
    and a rule's retry_after_seconds defaults to 60."""
    assert store.apply_policy(parse_policy(first), source="a").created
    again = store.apply_policy(parse_policy(same), source="b")
    assert (again.version, again.created) == (1, False)


# --- B. SQLite under real processes ------------------------------------------------------

# Holds SQLite's write lock until its stdin closes (or argv[2] seconds pass).
HOLD_A_WRITE = """
import select, sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None)
c.execute("BEGIN IMMEDIATE")
c.execute("UPDATE runs SET priority = priority")
print("holding", flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))
c.execute("COMMIT")
print("released", flush=True)
"""


def _cli(url: str, *args: str) -> tuple[int, str, str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                          env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def test_a_reader_does_not_wait_for_a_long_write_transaction(tmp_path: Path) -> None:
    """SQLite in WAL mode: a reader reads the last committed state while a writer holds
    the write lock. `runlane runs list` and `runs show` open BEGIN IMMEDIATE (every
    transaction of the engine does, engine._on_begin) and queue behind the writer: for
    the whole write here, and past the 60 s busy timeout they fail with "database is
    locked" (no retry on the read path)."""
    url = migrated_sqlite(tmp_path / "runlane.db")
    store = Store(url)
    run = submit(store)[0]
    store.close()
    hold = 120.0  # past any CLI start on a loaded machine: released by the test
    writer = subprocess.Popen([sys.executable, "-c", HOLD_A_WRITE,
                               str(tmp_path / "runlane.db"), str(hold)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "holding"
        rc, out, err, _ = _cli(url, "runs", "list", "--json")
        assert rc == 0, err
        assert [r["run_id"] for r in json.loads(out)] == [run.run_id]
        rc2, _, err2, _ = _cli(url, "runs", "show", run.run_id, "--json")
        assert rc2 == 0, err2
        # Both answered while the writer still held its lock: it has not released.
        assert writer.poll() is None
    finally:
        assert writer.stdin is not None
        writer.stdin.close()
        writer.wait(timeout=60)
