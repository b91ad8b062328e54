"""`runlane top`'s figures on both engines: claims per queue in a window (and over the
newest claims past the sample), the latest failures with their reason codes, fair
shares, each as a tenant's principal sees it; the snapshot from the facade and from the
HTTP API is one model made by one function; `top --once --json` and its errors; the
reads are index walks bounded whatever the size of the tables (EXPLAIN)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane import api_activity
from runlane.api import InvalidArgument, Runlane
from runlane.clock import ManualClock
from runlane.domain.access import Principal, Role
from runlane.errors import DatabaseUnavailable, Unauthenticated
from runlane.models.fleet import LimitView, QueueView, WorkerView
from runlane.models.top import ClaimRates, FailureView, QueueClaims
from runlane.store import activity_sql
from runlane.store.store import Store
from runlane.tui.snapshot import FacadeSource, HttpSource, SourceUnavailable, assemble

from .conftest import CLAIM_PATHS, T0, claim_path_database
from .http_support import free_port, make_token, serve
from .support import cli_env, one_line_error

ACME = Principal(role=Role.READ, tenant="acme", token_id="t-acme")
BETA = Principal(role=Role.READ, tenant="beta", token_id="t-beta")
GAMMA = Principal(role=Role.READ, tenant="gamma", token_id="t-gamma")


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def submit(lane: Runlane, n: int, **fields: Any) -> list[str]:
    rows = [{"tenant": "acme", "repo": "/srv/git/app.git", "prompt": f"task {i}", **fields}
            for i in range(n)]
    return [s.run_id for s in lane.submit_batch(rows)]


def register(store: Store, worker_id: str, queues: list[str]) -> None:
    store.register_worker(worker_id, version="9.9", queues=queues, capabilities={})


def rates(found: ClaimRates) -> dict[str, tuple[int, float]]:
    return {q.queue: (q.claims, q.per_minute) for q in found.queues}


# --- claim rates -------------------------------------------------------------------------


def test_claims_are_counted_per_queue_in_the_window_and_a_tenant_counts_its_own(
        lane: Runlane, clock: ManualClock) -> None:
    submit(lane, 4, queue="a")
    submit(lane, 2, queue="b", tenant="beta")
    register(lane.store, "host/1/w", ["a", "b"])
    assert len(lane.store.claim("host/1/w", "a", limit=2, lease_ttl=600)) == 2
    assert len(lane.store.claim("host/1/w", "b", limit=1, lease_ttl=600)) == 1
    clock.advance(30)
    assert len(lane.store.claim("host/1/w", "a", limit=1, lease_ttl=600)) == 1

    found = lane.claim_rates()
    assert (found.window_seconds, found.span_seconds) == (60.0, 60.0)
    assert rates(found) == {"a": (3, 3.0), "b": (1, 1.0)}
    assert rates(lane.claim_rates(window_seconds=20)) == {"a": (1, 3.0)}
    assert rates(lane.claim_rates(principal=ACME)) == {"a": (3, 3.0)}
    assert rates(lane.claim_rates(principal=BETA)) == {"b": (1, 1.0)}
    assert lane.claim_rates(principal=GAMMA).queues == []

    clock.advance(40)  # the first claims are 70 s old now, the last one 40 s
    assert rates(lane.claim_rates()) == {"a": (1, 1.0)}
    for bad in (0, -1, 3601, float("nan"), True, "60"):
        with pytest.raises(InvalidArgument, match="window_seconds"):
            lane.claim_rates(window_seconds=bad)


@pytest.fixture(params=CLAIM_PATHS)
def claim_path_url(request: pytest.FixtureRequest, tmp_path: Path,
                   monkeypatch: pytest.MonkeyPatch) -> str:
    return claim_path_database(request, tmp_path, monkeypatch)


def test_every_claim_path_is_counted(claim_path_url: str, clock: ManualClock) -> None:
    """The rate counts claim events: each of the three claim paths writes one per run,
    batches and limited scopes included."""
    with Runlane(claim_path_url, clock=clock) as lane:
        lane.apply_policy("[tenants.acme]\nmax_active = 10\n")
        submit(lane, 6, queue="a")
        register(lane.store, "host/1/w", ["a"])
        assert len(lane.store.claim("host/1/w", "a", limit=4, lease_ttl=600)) == 4
        assert len(lane.store.claim("host/1/w", "a", limit=1, lease_ttl=600)) == 1
        assert rates(lane.claim_rates()) == {"a": (5, 5.0)}


def test_past_the_sample_the_rate_is_measured_over_the_newest_claims(
        lane: Runlane, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """Five claims 10 s apart, three counted at most: the newest three span 20 s, so
    the rate is 9 a minute (over the 60 s window it would read 3: a busy queue would
    look idle as soon as it claims more than one read counts)."""
    monkeypatch.setattr(api_activity, "CLAIM_SAMPLE", 3)
    submit(lane, 5, queue="a")
    register(lane.store, "host/1/w", ["a"])
    for _ in range(5):
        assert len(lane.store.claim("host/1/w", "a", lease_ttl=600)) == 1
        clock.advance(10)
    clock.advance(-10)
    found = lane.claim_rates()
    assert found.span_seconds == pytest.approx(20.0)
    assert rates(found) == {"a": (3, pytest.approx(9.0))}


# --- failures ---------------------------------------------------------------------------


def test_the_latest_failures_newest_first_with_reason_codes_and_each_tenants_own(
        lane: Runlane, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    lane.apply_policy("allow_unknown_tenants = false\n[tenants.acme]\n[tenants.beta]\n")
    [acme_run] = submit(lane, 1, queue="a", max_attempts=3)
    [beta_run] = submit(lane, 1, queue="b", tenant="beta", max_attempts=1)
    register(lane.store, "host/1/w", ["a", "b"])
    [lease] = lane.store.claim("host/1/w", "a", lease_ttl=600)
    assert lease.run_id == acme_run
    clock.advance(1)
    lane.store.fail(lease, "PROVIDER_RATE_LIMIT", message="429 from https://u:secret@x.io")
    clock.advance(1)
    [lease] = lane.store.claim("host/1/w", "b", lease_ttl=600)
    lane.store.fail(lease, "VERIFIER_FAILED", message="tests failed")
    clock.advance(1)
    [denied] = lane.submit_batch([{"tenant": "stranger", "repo": "/srv/x", "prompt": "p"}])
    assert denied.status == "POLICY_DENIED"
    submit(lane, 3, queue="a")  # queued, nothing failed: not a failure

    found = lane.failures()
    assert [(f.run_id, f.status, f.reason_code, f.attempt_no) for f in found] == [
        (denied.run_id, "POLICY_DENIED", "TENANT_NOT_ALLOWED", None),
        (beta_run, "FAILED", "VERIFIER_FAILED", 1),
        (acme_run, "FAILED_RETRYABLE", "PROVIDER_RATE_LIMIT", 1)]
    assert [f.at.timestamp() for f in found] == [T0 + 3, T0 + 2, T0 + 1]
    assert (found[1].tenant, found[1].queue, found[1].repo) == ("beta", "b", "/srv/git/app.git")
    assert found[2].message == "429 from https://***@x.io"
    assert [f.run_id for f in lane.failures(limit=2)] == [denied.run_id, beta_run]
    assert [f.run_id for f in lane.failures(principal=ACME)] == [acme_run]
    assert [f.run_id for f in lane.failures(principal=BETA)] == [beta_run]
    assert lane.failures(principal=GAMMA) == []
    for bad in (0, 101, True, "5"):
        with pytest.raises(InvalidArgument, match="limit"):
            lane.failures(limit=bad)
    # A tenant's are looked for among the newest failures of every tenant only: the
    # read stays bounded however many failures other tenants have.
    monkeypatch.setattr(api_activity, "FAILURE_SCAN", 2)
    assert lane.failures(principal=ACME) == []
    assert [f.run_id for f in lane.failures(principal=BETA)] == [beta_run]


# --- fair share and the snapshot --------------------------------------------------------


def test_fair_share_is_the_weight_among_tenants_with_a_ready_run(lane: Runlane) -> None:
    lane.apply_policy("[tenants.acme]\nweight = 3\n[tenants.beta]\nweight = 1\n"
                      "[tenants.gamma]\nweight = 4\n")
    submit(lane, 2)
    submit(lane, 1, tenant="beta")
    shares = {t.tenant: t.fair_share for t in lane.tenants()}
    assert shares == {"acme": 0.75, "beta": 0.25, "gamma": None}  # gamma: nothing ready
    # A tenant's principal: its weight, not the others' (their sum would tell them).
    [mine] = lane.tenants(principal=ACME)
    assert (mine.weight, mine.fair_share) == (3.0, None)


def test_the_snapshot_from_the_facade(lane: Runlane, clock: ManualClock) -> None:
    lane.apply_policy("[concurrency.per_queue_max_active]\na = 5\n")
    submit(lane, 3, queue="a")
    [gone] = submit(lane, 1, queue="b", max_attempts=1)
    register(lane.store, "host/1/w", ["a", "b"])
    register(lane.store, "host/2/w", ["a"])
    [lease] = lane.store.claim("host/1/w", "b", lease_ttl=600)
    lane.store.fail(lease, "JUDGE_REJECTED", message="no")
    [_] = lane.store.claim("host/1/w", "a", lease_ttl=600)
    lane.drain_worker("host/2/w")
    clock.advance(2)

    snap = FacadeSource(lane, failures=5, claim_window=60).fetch()
    assert snap.source == str(lane.store.engine.url.render_as_string(hide_password=True))
    queues = {q.queue: q for q in snap.queues}
    # Queue b has nothing queued or running any more: listed for its claim all the same.
    assert [q.queue for q in snap.queues] == ["a", "b"]
    a, b = queues["a"], queues["b"]
    assert (a.queued, a.active, a.max_active, a.claims_per_minute) == (2, 1, 5, 1.0)
    assert a.oldest_ready_age_seconds == pytest.approx(2.0)
    assert (b.queued, b.active, b.max_active, b.claims_per_minute) == (0, 0, None, 1.0)
    [acme] = snap.tenants
    assert (acme.tenant, acme.queued, acme.active, acme.fair_share) == ("acme", 2, 1, 1.0)
    workers = {w.worker_id: w for w in snap.workers}
    assert workers["host/1/w"].leases_held == 1 and not workers["host/1/w"].draining
    assert workers["host/2/w"].draining and workers["host/2/w"].status == "READY"
    assert workers["host/1/w"].heartbeat_age_seconds == pytest.approx(2.0)
    [failure] = snap.failures
    assert (failure.run_id, failure.reason_code, failure.status) == (
        gone, "JUDGE_REJECTED", "FAILED")


def test_assemble_takes_a_queues_own_limit_and_lists_queues_only_claims_show() -> None:
    now = datetime.now(UTC)
    snap = assemble(
        "x", queues=[QueueView(queue="a", queued=1, oldest_ready_age_seconds=None,
                               active=2, limits=[LimitView(scope="queue:a", max_active=3,
                                                           active=None)])],
        tenants=[], workers=[WorkerView(
            worker_id="w", status="DRAINING", version="1", queues=[], capabilities={},
            started_at=now, heartbeat_at=now, heartbeat_age_seconds=0, leases_held=0,
            leases=[])],
        claims=ClaimRates(window_seconds=60, span_seconds=30, queues=[
            QueueClaims(queue="z", claims=1, per_minute=2.0),
            QueueClaims(queue="a", claims=3, per_minute=6.0)]),
        failures=[FailureView(run_id="r", task_id="t", tenant="acme", repo="/r", queue="a",
                              attempt_no=1, status="FAILED", reason_code="TIMEOUT",
                              message=None, at=now)], taken_at=now)
    assert [(q.queue, q.max_active, q.claims_per_minute) for q in snap.queues] == [
        ("a", 3, 6.0), ("z", None, 2.0)]
    assert snap.claim_span_seconds == 30 and snap.workers[0].draining


# --- the HTTP API: the same snapshot, scoped by the token ---------------------------------


def test_the_api_gives_the_facades_snapshot_and_a_tenant_token_its_own_figures(
        db_url: str, tmp_path: Path) -> None:
    with Runlane(db_url) as lane:
        lane.apply_policy("[tenants.acme]\nweight = 2\n[tenants.beta]\nweight = 1\n")
        [acme_failed] = submit(lane, 1, queue="a", max_attempts=1)
        submit(lane, 2, queue="a")
        submit(lane, 2, queue="b", tenant="beta")
        register(lane.store, "host/1/w", ["a", "b"])
        [lease] = lane.store.claim("host/1/w", "a", lease_ttl=600)
        assert lease.run_id == acme_failed
        lane.store.fail(lease, "TIMEOUT", message="slow")
        assert len(lane.store.claim("host/1/w", "b", lease_ttl=600)) == 1
        direct = FacadeSource(lane, failures=10, claim_window=60)
        admin, acme = make_token(db_url, "admin"), make_token(db_url, "read", "acme")
        beta = make_token(db_url, "read", "beta")
        with serve(db_url, tmp_path) as served:
            def over_http(token: str) -> Any:
                source = HttpSource(served.url, token, failures=10, claim_window=60)
                try:
                    return source.fetch()
                finally:
                    source.close()

            # The figures move with the clock (ages): compare what does not.
            def figures(snap: Any) -> dict[str, Any]:
                found = snap.model_dump(exclude={"source", "taken_at"})
                for row in found["queues"]:
                    row.pop("oldest_ready_age_seconds")
                for row in found["workers"]:
                    row.pop("heartbeat_age_seconds")
                for row in found["failures"]:  # JSON writes milliseconds
                    row["at"] = row["at"].replace(microsecond=row["at"].microsecond // 1000
                                                  * 1000)
                return found

            everything = over_http(admin)
            assert everything.source == served.url
            assert figures(everything) == figures(direct.fetch())
            assert {q.queue: q.queued for q in everything.queues} == {"a": 2, "b": 1}
            assert [t.fair_share for t in everything.tenants] == [
                pytest.approx(2 / 3), pytest.approx(1 / 3)]

            mine = over_http(acme)
            assert [(q.queue, q.queued, q.claims_per_minute) for q in mine.queues] == [
                ("a", 2, 1.0)]
            assert [(t.tenant, t.fair_share) for t in mine.tenants] == [("acme", None)]
            assert mine.workers == []  # no lease of acme's runs: the fleet is not its
            assert [f.run_id for f in mine.failures] == [acme_failed]

            theirs = over_http(beta)
            assert [(q.queue, q.active) for q in theirs.queues] == [("b", 1)]
            assert [(w.worker_id, w.leases_held) for w in theirs.workers] == [
                ("host/1/w", 1)]
            assert theirs.failures == [] and "acme" not in theirs.model_dump_json()

            # A token that is not one: refused, not retried.
            with pytest.raises(Unauthenticated, match="401"):
                over_http("rl_not-a-token")
    # Nothing answers: the API is unavailable, as a database that is down.
    with pytest.raises(SourceUnavailable, match=r"API http://127\.0\.0\.1:"):
        HttpSource(f"http://127.0.0.1:{free_port()}", "x", failures=1,
                   claim_window=60).fetch()


# --- the command --------------------------------------------------------------------------


def runlane(tmp_path: Path, *args: str, code: int = 0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "runlane", *args], capture_output=True,
                            text=True, env=cli_env(tmp_path, **(env or {})), cwd=tmp_path,
                            timeout=120)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    return result


def test_top_once_prints_the_snapshot_and_one_frame(db_url: str, tmp_path: Path) -> None:
    with Runlane(db_url) as lane:
        [failed] = submit(lane, 1, queue="q-alpha", max_attempts=1)
        register(lane.store, "host-7/w-once", ["q-alpha"])
        [lease] = lane.store.claim("host-7/w-once", "q-alpha", lease_ttl=600)
        lane.store.fail(lease, "JUDGE_REJECTED", message="no")
        submit(lane, 3, queue="q-alpha")
    shown = json.loads(runlane(tmp_path, "--database-url", db_url, "top", "--json").stdout)
    assert set(shown) == {"source", "taken_at", "claim_span_seconds", "queues", "tenants",
                          "workers", "failures", "awaiting_approval"}
    assert shown["awaiting_approval"] == 0
    assert [(q["queue"], q["queued"], q["claims_per_minute"]) for q in shown["queues"]] == [
        ("q-alpha", 3, 1.0)]
    assert [w["worker_id"] for w in shown["workers"]] == ["host-7/w-once"]
    assert [(f["run_id"], f["reason_code"]) for f in shown["failures"]] == [
        (failed, "JUDGE_REJECTED")]
    frame = runlane(tmp_path, "--database-url", db_url, "top", "--once",
                    env={"COLUMNS": "160"}).stdout
    assert "host-7/w-once" in frame and failed in frame and "JUDGE_REJECTED" in frame
    assert "q quits" not in frame


def test_top_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    migrated = f"sqlite:///{tmp_path / 'runlane.db'}"
    runlane(tmp_path, "--database-url", migrated, "db", "upgrade")
    # Not on a terminal: the live view has nowhere to draw.
    one_line_error(runlane(tmp_path, "--database-url", migrated, "top", code=2), 2, "--once")
    one_line_error(runlane(tmp_path, "--database-url", migrated, "top", "--once", "--token",
                           "x", code=2), 2, "--token")
    one_line_error(runlane(tmp_path, "top", "--once", "--url", "ftp://x", "--token", "t",
                           code=2), 2, "--url")
    one_line_error(runlane(tmp_path, "top", "--once", "--url", "http://127.0.0.1:1",
                           code=2), 2, "--token")
    down = f"postgresql://nobody@127.0.0.1:{free_port()}/none"
    one_line_error(runlane(tmp_path, "--database-url", down, "top", "--once", code=4), 4,
                   "database")
    closed = f"http://127.0.0.1:{free_port()}"
    one_line_error(runlane(tmp_path, "top", "--once", "--url", closed, code=4,
                           env={"RUNLANE_API_TOKEN": "rl_x"}), 4, f"API {closed}/v1/")


def test_a_database_never_upgraded_is_said_so(tmp_path: Path) -> None:
    from runlane.errors import SchemaOutdated

    with Runlane(f"sqlite:///{tmp_path / 'none.db'}") as lane:
        for call in (lane.claim_rates, lane.failures):
            with pytest.raises(SchemaOutdated, match="runlane db upgrade"):
                call()


def test_a_database_that_stops_answering_is_unavailable_not_a_driver_error(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'runlane.db'}"
    with Runlane(url) as lane:
        lane.upgrade_schema()
        with lane.store.engine.begin() as conn:
            conn.execute(text("DROP TABLE run_events"))
        with pytest.raises(DatabaseUnavailable, match="run_events"):
            lane.failures()


# --- bounded reads ------------------------------------------------------------------------


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_claims_and_failures_read_a_bounded_walk_of_their_indexes(lane: Runlane) -> None:
    """100,000 runs, each claimed and ended on its attempt's row (migration 0028), a
    fifth of them failed, and as many older runs whose claims and failures are events:
    the claim rate reads at most ``cap`` entries of each claims index, the latest
    failures as many entries of each failures index as they show."""
    if not lane.store.is_postgres:
        pytest.skip("the plan is PostgreSQL's (SQLite: below)")
    with lane.store.engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                              max_attempts, visible_at, created_at, updated_at)
            SELECT 'r' || g, 't' || g, 'tenant' || (g % 50), '/srv/app', 'q' || (g % 7), 100,
                   'SUCCEEDED', 3, 1e9 + g, 1e9 + g, 1e9 + g
            FROM generate_series(1, 200000) AS g"""))
        conn.execute(text("""
            INSERT INTO attempts (run_id, attempt_no, fencing_token, worker_id, status,
                                  lease_status, lease_expires_at, heartbeat_at, started_at,
                                  ended_at, claim_tx, claim_seq, end_tx, end_seq,
                                  end_from_status, end_to_status, end_reason_code)
            SELECT 'r' || g, 1, 1, 'w', 'SUCCEEDED', 'RELEASED', 2e9, 1e9,
                   1e9 + g * 0.06 - 30, 1e9 + g * 0.06, g, 2 * g, g, 2 * g + 1, 'RUNNING',
                   CASE WHEN g % 5 = 0 THEN 'FAILED' ELSE 'SUCCEEDED' END,
                   CASE WHEN g % 5 = 0 THEN 'TIMEOUT' END
            FROM generate_series(100001, 200000) AS g"""))
        conn.execute(text("""
            INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status,
                                    reason_code)
            SELECT 'r' || g, 1, 1e9 + g * 0.06 - 30 * x, 'w',
                   CASE x WHEN 1 THEN 'QUEUED' ELSE 'RUNNING' END,
                   CASE WHEN x = 1 THEN 'CLAIMED' WHEN g % 5 = 0 THEN 'FAILED'
                        ELSE 'SUCCEEDED' END,
                   CASE WHEN x = 0 AND g % 5 = 0 THEN 'TIMEOUT' END
            FROM generate_series(1, 100000) AS g, generate_series(0, 1) AS x"""))
        conn.execute(text("ANALYZE runs; ANALYZE attempts; ANALYZE run_events"))
    now = 1e9 + 200000 * 0.06
    with lane.store.engine.connect() as conn:
        def explain(statement: str, **params: Any) -> list[dict[str, Any]]:
            [[plan]] = conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + statement),
                                    params).one()
            return list(_plan_nodes(plan["Plan"]))

        def scanned(nodes: list[dict[str, Any]], index: str) -> int:
            return sum(int(n["Actual Rows"]) for n in nodes if n.get("Index Name") == index)

        nodes = explain(activity_sql.CLAIMS_SINCE, since=now - 60, cap=5000)
        assert scanned(nodes, "ix_attempts_claim_feed") == 5000  # the newest cap claims
        assert scanned(nodes, "ix_run_events_claims") == 0  # none that recent
        assert not any(n["Node Type"] == "Seq Scan" for n in nodes), nodes
        got = conn.execute(text(activity_sql.CLAIMS_SINCE), {"since": now - 60, "cap": 5000})
        assert 499 <= sum(r.claims for r in got) <= 502  # the claims of that minute

        nodes = explain(activity_sql.FAILURES, scan=10)
        assert scanned(nodes, "ix_attempts_failed_ends") == 10
        assert scanned(nodes, "ix_run_events_failures") <= 10  # older: merged, stops
        assert not any(n["Node Type"] == "Seq Scan" for n in nodes), nodes

        nodes = explain(activity_sql.TENANT_FAILURES, scan=1000, limit=10, tenant="tenant5")
        assert scanned(nodes, "ix_attempts_failed_ends") <= 1000
        assert scanned(nodes, "ix_run_events_failures") <= 1000
        assert not any(n["Node Type"] == "Seq Scan" for n in nodes), nodes


def test_sqlite_walks_the_same_indexes(tmp_path: Path) -> None:
    from .conftest import migrated_sqlite

    url = migrated_sqlite(tmp_path / "plan.db")
    with Runlane(url) as lane, lane.store.engine.connect() as conn:
        def plan(statement: str, **params: Any) -> str:
            return "\n".join(row[-1] for row in conn.execute(
                text("EXPLAIN QUERY PLAN " + statement), params))

        claims = plan(activity_sql.CLAIMS_SINCE, since=T0, cap=5000)
        assert "USING INDEX ix_attempts_claim_feed" in claims, claims
        assert "USING INDEX ix_run_events_claims (at>?)" in claims, claims
        failures = plan(activity_sql.FAILURES, scan=10)
        assert "USING INDEX ix_attempts_failed_ends" in failures, failures
        assert "USING INDEX ix_run_events_failures" in failures, failures


# --- the frame ----------------------------------------------------------------------------


def _snapshot(workers: int, failures: int) -> Any:
    from runlane.models.top import TopQueue, TopSnapshot, TopTenant, TopWorker

    now = datetime.now(UTC)
    return TopSnapshot(
        source="sqlite:///x.db", taken_at=now, claim_span_seconds=60,
        queues=[TopQueue(queue="default", queued=7, oldest_ready_age_seconds=3.0, active=2,
                         max_active=4, claims_per_minute=12.0)],
        tenants=[TopTenant(tenant="acme", queued=7, active=2, max_active=None, weight=1,
                           fair_share=1.0, spent_today_usd=9.5, daily_budget_usd=10.0)],
        workers=[TopWorker(worker_id=f"host-{i:03d}/w", status="READY",
                           heartbeat_age_seconds=1.0, leases_held=1, draining=False)
                 for i in range(workers)],
        failures=[FailureView(run_id=f"01a23ab2-ad63-779f-be45-{i:012d}", task_id="t",
                              tenant="acme", repo="/srv/git/app.git", queue="default",
                              attempt_no=1, status="FAILED_RETRYABLE",
                              reason_code="PROVIDER_RATE_LIMIT", message="429\nslow down",
                              at=now) for i in range(failures)])


@pytest.mark.parametrize("width", [160, 80])
def test_the_frame_fits_the_screen_and_says_what_it_cut(width: int) -> None:
    """50 lines whatever the rows: a table that has more rows than its region ends in
    "+N more", every other table still shows; run ids stay whole on 80 columns."""
    import io

    from rich.console import Console

    from runlane.tui.render import Stale, frame

    snap = _snapshot(workers=40, failures=3)
    console = Console(width=width, height=50, file=io.StringIO(), color_system=None)
    console.print(frame(snap, interval=1.0, now=snap.taken_at, width=width,
                        stale=Stale(snap.taken_at, "database down")))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    screen = "\n".join(lines)
    assert len(lines) == 50, screen
    assert "STALE since" in screen and "database down" in screen
    more = re.search(r"\+(\d+) more", screen)
    assert more is not None, screen
    shown = len(re.findall(r"^host-\d{3}/w ", screen, re.MULTILINE))
    assert shown + int(more[1]) == 40 and shown > 5, screen
    assert all(f.run_id in screen for f in snap.failures), screen
    assert "PROVIDER_RATE_LIMIT" in screen and "$9.50 of $10.00" in screen
    assert re.search(r"^default\s+7\s+3\.0s\s+12\.0\s+2/4", screen, re.MULTILINE), screen
