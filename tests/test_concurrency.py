"""Real concurrency: processes racing on one database file or server, and SIGKILL."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.domain.tasks import parse_task
from runlane.store.store import Store

from .procs import claim_until_empty
from .support import attempts_of, run_row

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_8_processes_claim_2000_runs_exactly_once_per_attempt(db_url: str) -> None:
    store = Store(db_url)
    store.submit([parse_task({"tenant": f"t{i % 5}", "repo": "/srv/git/app.git",
                              "prompt": f"run {i}"}) for i in range(2000)])
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=claim_until_empty,
                         args=(db_url, f"w{i}", 1 + i % 4 * 3, 7, start, results))
             for i in range(8)]
    for p in procs:
        p.start()
    start.set()
    claims: list[tuple[str, int, int]] = []
    for _ in procs:
        claims.extend(results.get(timeout=240)[1])
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    per_attempt = Counter((run_id, attempt) for run_id, attempt, _ in claims)
    assert max(per_attempt.values()) == 1, "an attempt was claimed twice"
    runs = store.list_runs(limit=5000)
    assert len(runs) == 2000
    assert Counter(r["status"] for r in runs) == {"SUCCEEDED": 2000}
    assert sum(r["attempt_count"] for r in runs) == len(claims)
    assert len(claims) > 2000  # some leases were given back and claimed again
    for run_id, attempt, token in claims[:50]:
        assert attempts_of(store, run_id)[attempt - 1].fencing_token == token
    assert store.audit() == []
    store.close()


def test_sigkilled_worker_is_recovered_within_ttl_plus_reaper_pass(db_url: str) -> None:
    """Drill 1 with a real process: SIGKILL while it holds a lease and heartbeats."""
    store = Store(db_url)
    [sub] = store.submit([parse_task({"tenant": "acme", "repo": "/srv/x", "prompt": "p"})])
    ttl = 1.0
    victim = subprocess.Popen([sys.executable, "-m", "tests.procs", db_url, str(ttl)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None
        assert victim.stdout.readline().strip() == "running"
        time.sleep(ttl * 1.5)  # heartbeats keep it alive past one TTL
        assert store.reap_expired_leases() == 0
        assert run_row(store, sub.run_id).status == "RUNNING"
    finally:
        os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait()
    while run_row(store, sub.run_id).status == "RUNNING":
        assert time.monotonic() - killed_at < ttl + 2.0, "run not recovered in time"
        store.reap_expired_leases()
        time.sleep(0.05)
    recovered_after = time.monotonic() - killed_at
    assert recovered_after <= ttl + 1.0
    run = run_row(store, sub.run_id)
    assert (run.status, run.reason_code) == ("QUEUED", "WORKER_LOST")
    [attempt] = attempts_of(store, sub.run_id)
    assert (attempt.lease_status, attempt.reason_code) == ("EXPIRED", "WORKER_LOST")
    assert store.audit() == []
    store.close()


LIMITS_POLICY = """
[concurrency]
global_max_active = 6
per_tenant_max_active = 3
per_repository_max_active = 2
per_user_max_active = 2
"""


def _peak_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant; an end at t comes before a start at t."""
    points = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    peak = open_now = 0
    for _, step in points:
        open_now += step
        peak = max(peak, open_now)
    return peak


@pytest.mark.slow
def test_8_claimer_processes_never_exceed_any_concurrency_limit(db_url: str) -> None:
    """Invariant 9 with real concurrency: 8 processes claim 400 runs under global,
    tenant, repository and user limits; the lease intervals, reconstructed from the
    attempts, never put more runs in any scope at one instant than its limit."""
    from runlane.domain.policy import parse_policy

    from .procs import claim_hold_complete

    store = Store(db_url)
    store.apply_policy(parse_policy(LIMITS_POLICY), source="test")
    store.submit([parse_task({"tenant": f"t{i % 4}", "repo": f"/srv/git/r{i % 5}.git",
                              "user": f"u{i % 3}", "prompt": f"run {i}"}) for i in range(400)])
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=claim_hold_complete,
                         args=(db_url, f"w{i}", 1 + i % 3, start, results)) for i in range(8)]
    for p in procs:
        p.start()
    start.set()
    total = sum(results.get(timeout=240)[1] for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert total == 400
    with store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT r.tenant, r.repo, r.user_id, a.started_at, a.lease_ended_at "
            "FROM attempts a JOIN runs r ON r.run_id = a.run_id")).all()
    assert len(rows) == 400
    assert_limits_held(store)
    store.close()


def assert_limits_held(store: Store) -> None:
    """LIMITS_POLICY's limits held at every instant, by the lease intervals of every
    attempt (all ended), and reached at least once; the counters are back to 0."""
    with store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT r.tenant, r.repo, r.user_id, a.started_at, a.lease_ended_at "
            "FROM attempts a JOIN runs r ON r.run_id = a.run_id")).all()
    assert all(r.lease_ended_at is not None for r in rows)
    scopes: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        for scope in ("global", f"tenant:{r.tenant}", f"repo:{r.repo}", f"user:{r.user_id}"):
            scopes.setdefault(scope, []).append((r.started_at, r.lease_ended_at))
    limit = {"global": 6, "tenant": 3, "repo": 2, "user": 2}
    peaks = {scope: _peak_overlap(spans) for scope, spans in scopes.items()}
    for scope, peak in peaks.items():
        assert peak <= limit[scope.split(":")[0]], f"{scope} had {peak} runs at once"
    assert any(peak == limit[scope.split(":")[0]] for scope, peak in peaks.items()), \
        f"no limit was ever reached, the test proves nothing: {peaks}"
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT SUM(active) FROM limit_counters")).scalar() == 0
    assert store.audit() == []


FREEZE_R4 = """
[[rules]]
when = { repo = '*r4*' }
action = 'deny'
reason_code = 'REPOSITORY_FROZEN'
message = 'frozen'
"""


def next_report(results: Any, procs: list[Any], *, timeout: float) -> Any:
    """The next report a child process put, failing at once if one of them died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return results.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a child process died (exit codes {dead})"
            assert time.monotonic() < deadline, "no report in time"


@pytest.mark.slow
def test_the_backlog_pass_races_4_claimer_processes_and_every_invariant_holds(
        db_url: str) -> None:
    """A policy change while 4 processes claim under concurrency limits, then 2 more
    processes admitting the queued backlog again while they claim (each run locked by
    one of them at a time, the others skipping it): every run of the repository the new
    version denies that was still queued ends POLICY_DENIED without an attempt, its
    record naming both versions; every other run succeeds exactly once; a run admitted
    again keeps the version it was first admitted under; no limit is exceeded at any
    instant; the audit is clean."""
    from runlane.domain.policy import parse_policy

    from .procs import backlog_passes, claim_hold_complete

    store = Store(db_url)
    v1 = store.apply_policy(parse_policy(LIMITS_POLICY), source="test").version
    store.submit([parse_task({"tenant": f"t{i % 4}", "repo": f"/srv/git/r{i % 5}.git",
                              "user": f"u{i % 3}", "prompt": f"run {i}"}) for i in range(400)])
    ctx = multiprocessing.get_context("spawn")
    start, go, stop = ctx.Event(), ctx.Event(), ctx.Event()
    results = ctx.Queue()
    claimers = [ctx.Process(target=claim_hold_complete,
                            args=(db_url, f"w{i}", 1 + i % 3, start, results))
                for i in range(4)]
    passes = [ctx.Process(target=backlog_passes, args=(db_url, go, stop, results))
              for _ in range(2)]
    for p in [*claimers, *passes]:
        p.start()
    try:
        start.set()
        deadline = time.monotonic() + 60
        while len(store.list_runs(status="SUCCEEDED")) < 40:
            assert time.monotonic() < deadline, "the claimers made no progress"
            time.sleep(0.01)
        v2 = store.apply_policy(parse_policy(LIMITS_POLICY + FREEZE_R4), source="test").version
        committed_at = time.time()  # v2 is in force for every statement that begins later
        # The claimers go on under v2 with a backlog admitted under v1 (as when the periodic
        # pass lags), then the passes race them for the rest.
        while len(store.list_runs(status="SUCCEEDED")) < 80:
            assert time.monotonic() < deadline, "the claimers made no progress under v2"
            time.sleep(0.01)
        go.set()
        claimed = 0
        calls: list[tuple[str, float]] = []
        totals: dict[str, int] = {}
        for _ in claimers:
            report = next_report(results, [*claimers, *passes], timeout=240)
            assert report[0] != "passes", f"a pass process ended early: {report}"
            claimed += report[1]
            calls.extend(report[2])
        stop.set()
        for _ in passes:
            kind, counts = results.get(timeout=60)
            assert kind == "passes"
            for key, n in counts.items():
                totals[key] = totals.get(key, 0) + n
        for p in [*claimers, *passes]:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:  # a failed assertion must not leave processes on the test database
        stop.set()
        for p in [*claimers, *passes]:
            if p.is_alive():
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    assert totals["queued_readmitted"] > 0, f"no pass met the backlog: {totals}"

    runs = {r["run_id"]: r for r in store.list_runs(limit=1000)}
    assert len(runs) == 400
    denied = [r for r in runs.values() if r["status"] == "POLICY_DENIED"]
    assert denied, "the new version denied nothing still queued: the test proves nothing"
    for run in denied:
        assert "/r4.git" in run["repo"] and run["attempt_count"] == 0
        assert run["reason_code"] == "REPOSITORY_FROZEN"
        assert f"by policy v{v2} (admitted under v{v1})" in run["message"]
    succeeded = [r for r in runs.values() if r["status"] == "SUCCEEDED"]
    assert len(succeeded) + len(denied) == 400 == claimed + len(denied)
    # Drill 6 under the race: a claim that began after v2 was committed decided under
    # it, by whichever path, and never took a run of the frozen repository.
    late = [run_id for run_id, began in calls
            if began > committed_at and "/r4.git" in runs[run_id]["repo"]]
    assert late == [], f"{len(late)} runs of the frozen repository claimed under v{v2}"
    assert all(r["attempt_count"] == 1 for r in succeeded)
    readmitted = [store.get_run(r["run_id"])["admission"] for r in succeeded
                  if r["policy_version"] == v2]
    assert readmitted and all(a["first_policy_version"] == v1 for a in readmitted)
    assert_limits_held(store)
    store.close()
