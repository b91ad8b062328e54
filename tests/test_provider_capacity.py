"""Provider capacity (``[providers.NAME]``, ``queue_providers``) and sandbox slots: a
provider's limit is one more scope of the claim, all or nothing with the others, on
every claim path; held across real claimer processes; a worker runs no more attempts
than its sandbox slots."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text

from runlane.api import InvalidArgument, Runlane
from runlane.domain.policy import PolicyInvalid, parse_policy
from runlane.domain.tasks import parse_task
from runlane.store.store import Store

from .conftest import CLAIM_PATHS, claim_path_database
from .support import cli_env

REPO = "/srv/git/app.git"
TTL = 60.0

PROVIDERS = """
[providers.openai]
max_active = 2
[providers.anthropic]
[queue_providers]
batch = "openai"
"""


@pytest.fixture(params=CLAIM_PATHS)
def url(request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> str:
    return claim_path_database(request, tmp_path, monkeypatch)


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    s = Store(url)
    yield s
    s.close()


def task(tenant: str, n: int, **fields: Any) -> Any:
    return parse_task({"tenant": tenant, "repo": REPO, "prompt": f"run {n}", **fields})


def provider_of(store: Store, run_id: str) -> str | None:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT provider FROM runs WHERE run_id = :r"),
                            {"r": run_id}).scalar()


def counters(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return {r.scope: r.active for r in conn.execute(
            text("SELECT scope, active FROM limit_counters"))}


def test_a_provider_limit_holds_in_the_claim_all_or_nothing(store: Store) -> None:
    store.apply_policy(parse_policy(PROVIDERS + "[tenants.t2]\nmax_active = 1\n"),
                       source="test")
    named = store.submit([task("t1", 0, provider="openai")])[0]
    by_queue = store.submit([task("t1", 1, queue="batch")])[0]  # the queue's provider
    assert (provider_of(store, named.run_id), provider_of(store, by_queue.run_id)) == (
        "openai", "openai")
    store.submit([task("t1", 2, provider="openai"), task("t2", 3, provider="openai"),
                  task("t1", 4, provider="anthropic"), task("t1", 5)])
    leases = store.claim("w1", limit=10, lease_ttl=TTL)
    providers = sorted(str(provider_of(store, lease.run_id)) for lease in leases)
    # 2 of the 4 openai runs; anthropic (no limit) and the run with no provider.
    assert providers == ["None", "anthropic", "openai", "openai"]
    assert counters(store)["provider:openai"] == 2
    # All or nothing: a run held back by the provider took no tenant slot either.
    with store.engine.connect() as conn:
        t2_claimed = conn.execute(text("SELECT COUNT(*) FROM runs WHERE tenant = 't2' "
                                       "AND status = 'CLAIMED'")).scalar()
    assert counters(store).get("tenant:t2", 0) == t2_claimed
    assert store.claim("w1", limit=10, lease_ttl=TTL) == []
    # An attempt holds its provider's scope, and its end gives the slot back.
    with store.engine.connect() as conn:
        held = conn.execute(text("SELECT limit_scopes FROM attempts WHERE run_id = :r"),
                            {"r": leases[0].run_id}).scalar()
    openai = [lease for lease in leases if provider_of(store, lease.run_id) == "openai"]
    store.complete(openai[0])
    [more] = store.claim("w1", limit=10, lease_ttl=TTL)
    assert provider_of(store, more.run_id) == "openai"
    assert held is not None
    for lease in [*leases, more]:
        if lease is not openai[0]:
            store.complete(lease)
    while rest := store.claim("w1", limit=10, lease_ttl=TTL):
        for lease in rest:
            store.complete(lease)
    assert set(counters(store).values()) == {0}
    assert store.audit() == []


def test_a_policy_provider_error_names_the_field() -> None:
    with pytest.raises(PolicyInvalid) as caught:
        parse_policy("[queue_providers]\nbatch = 'openai'\n", "policy.toml")
    assert (caught.value.source, caught.value.field) == ("policy.toml", "queue_providers")
    assert caught.value.problem == "batch: provider 'openai' has no [providers.openai] table"
    with pytest.raises(PolicyInvalid) as caught:
        parse_policy("[providers.openai]\nmax_active = -1\n", "policy.toml")
    assert caught.value.field == "providers.openai.max_active"
    with pytest.raises(PolicyInvalid) as caught:
        parse_policy("[providers.openai]\ntokens = 5\n", "policy.toml")
    assert (caught.value.field, caught.value.problem) == ("providers.openai.tokens",
                                                          "unknown field")


def claim_statements(url: str, policy: str, provider: str | None) -> list[str]:
    """The statements of one claim of 1 (SQLAlchemy's cursor events), after a first
    claim made the counters and read the policy."""
    store = Store(url)
    with store.engine.begin() as conn:  # each round starts from an empty queue
        conn.execute(text("UPDATE runs SET status = 'CANCELLED' WHERE status = 'QUEUED'"))
        conn.execute(text("UPDATE lanes SET queued_count = 0"))
    store.apply_policy(parse_policy(policy), source=str(hash(policy)))
    store.submit([task("t1", i, provider=provider) for i in range(4)])
    store.complete(store.claim("warm", limit=1, lease_ttl=TTL)[0])
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    [lease] = store.claim("w1", limit=1, lease_ttl=TTL)
    event.remove(store.engine, "before_cursor_execute", count)
    store.complete(lease)
    store.close()
    return statements


def test_without_provider_limits_a_claim_runs_the_same_statements(url: str) -> None:
    """A run that names a provider the policy does not limit claims with exactly the
    statements of one that names none; a provider limit is one more limited scope of
    the counters (SQLite: one more ADD_SLOTS, as any limit; PostgreSQL: none)."""
    limits = "[concurrency]\nglobal_max_active = 50\n"
    # Each first round after a new policy version claims otherwise (the backlog of the
    # old version): the rounds compared are those after it.
    claim_statements(url, limits, None)
    plain = claim_statements(url, limits, None)
    named = claim_statements(url, limits, "openai")
    claim_statements(url, limits + PROVIDERS, "openai")
    limited = claim_statements(url, limits + PROVIDERS, "openai")
    print(f"statements per claim: none {len(plain)}, named {len(named)}, "
          f"limited {len(limited)}")
    assert named == plain
    extra = 1 if url.startswith("sqlite") else 0
    assert len(limited) == len(plain) + extra


@pytest.mark.slow
def test_a_provider_limit_of_2_holds_across_3_claimer_processes(url: str) -> None:
    """3 processes claim 60 runs, 40 of them openai (limit 2); the lease intervals,
    reconstructed from the attempts, never hold more than 2 openai runs at once."""
    from .procs import claim_hold_complete

    store = Store(url)
    store.apply_policy(parse_policy(PROVIDERS), source="test")
    store.submit([task(f"t{i % 3}", i, **({"provider": "openai"} if i % 3 else {}))
                  for i in range(60)])
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=claim_hold_complete, args=(url, f"w{i}", 2, start, results))
             for i in range(3)]
    for p in procs:
        p.start()
    start.set()
    total = sum(results.get(timeout=240)[1] for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert total == 60
    with store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT r.provider, a.started_at, a.lease_ended_at "
            "FROM attempts a JOIN runs r ON r.run_id = a.run_id")).all()
    spans = [(r.started_at, r.lease_ended_at) for r in rows if r.provider == "openai"]
    assert len(spans) == 40
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans],
                   key=lambda x: (x[0], x[1]))
    live = peak = 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    assert peak == 2, f"openai had {peak} runs at once"
    others = [(r.started_at, r.lease_ended_at) for r in rows if r.provider != "openai"]
    assert others
    assert set(counters(store).values()) == {0}
    assert store.audit() == []
    store.close()


def test_submit_takes_a_provider_flag_and_a_batch_field(db_url: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    env = cli_env(tmp_path, RUNLANE_DATABASE_URL=db_url)
    one = subprocess.run(
        [sys.executable, "-m", "runlane", "submit", "--tenant", "acme", "--repo", REPO,
         "--prompt", "x", "--provider", "openai", "--json", "--no-repo-check"],
        env=env, capture_output=True, text=True, check=True)
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"tenant": "acme", "repo": REPO, "prompt": "y",
                                 "provider": "anthropic"}) + "\n")
    two = subprocess.run([sys.executable, "-m", "runlane", "submit", "--batch", str(batch),
                          "--no-repo-check", "--json"],
                         env=env, capture_output=True, text=True, check=True)
    bad = subprocess.run(
        [sys.executable, "-m", "runlane", "submit", "--tenant", "acme", "--repo", REPO,
         "--prompt", "x", "--provider", "no such", "--no-repo-check"],
        env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "provider" in bad.stderr and "Traceback" not in bad.stderr
    store = Store(db_url)
    first = json.loads(one.stdout)["run_id"]
    [second] = json.loads(two.stdout)
    assert provider_of(store, first) == "openai"
    assert provider_of(store, second["run_id"]) == "anthropic"
    store.close()
    shown = subprocess.run([sys.executable, "-m", "runlane", "runs", "show", first],
                           env=env, capture_output=True, text=True, check=True)
    assert "provider openai" in shown.stdout
    shown = subprocess.run([sys.executable, "-m", "runlane", "runs", "show", first, "--json"],
                           env=env, capture_output=True, text=True, check=True)
    assert json.loads(shown.stdout)["provider"] == "openai"


def test_a_worker_claims_no_more_than_its_sandbox_slots(db_url: str) -> None:
    with Runlane(db_url) as lane:
        worker = lane.worker(agent_command="true", concurrency=4, sandbox_slots=2)
        assert worker.config.concurrency == 2
        assert lane.worker(agent_command="true", concurrency=1,
                           sandbox_slots=3).config.concurrency == 1
        with pytest.raises(InvalidArgument, match="sandbox_slots"):
            lane.worker(agent_command="true", concurrency=2, sandbox_slots=0)


def test_a_rate_limited_provider_pauses_its_runs_for_every_tenant(url: str) -> None:
    """One 429 with a retry-after of 5 s: every queued run of that provider, any
    tenant's, waits 5 s (one pause row); another provider's runs do not."""
    from runlane.clock import ManualClock
    from runlane.domain.reasons import Reason

    from .conftest import T0

    clock = ManualClock(T0)
    store = Store(url, clock=clock)
    store.apply_policy(parse_policy(PROVIDERS), source="test")
    [limited] = store.submit([task("t1", 0, provider="openai")])
    [lease] = store.claim("w1", run_id=limited.run_id, lease_ttl=TTL)
    store.fail(lease, Reason.PROVIDER_RATE_LIMIT, retry_after_seconds=5)
    waiting = store.submit([task("t1", 1, provider="openai"), task("t2", 2, provider="openai"),
                            task("t2", 3, provider="anthropic"), task("t3", 4)])
    provider_runs = {s.run_id for s in waiting[:2]}
    # A store that has not read the policy yet (its first claim) and one that has.
    fresh = Store(url, clock=clock)
    for claimer in (fresh, store):
        taken = claimer.claim("w2", limit=10, lease_ttl=TTL)
        assert {str(provider_of(store, t.run_id)) for t in taken} <= {"anthropic", "None"}
        for t in taken:
            claimer.complete(t)
    clock.advance(4.9)
    assert store.claim("w2", limit=10, lease_ttl=TTL) == []
    assert fresh.claim("w2", limit=10, lease_ttl=TTL) == []
    clock.advance(0.1)
    taken = store.claim("w2", limit=10, lease_ttl=TTL)
    # Both tenants' runs now (the limit of 2 holds); the failed run itself waits for
    # its own retry delay (at least the retry-after).
    assert {t.run_id for t in taken} == provider_runs
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM provider_pauses")).scalar() == 1
    for t in taken:
        store.complete(t)
    fresh.close()
    store.close()


def test_a_provider_token_budget_pauses_it_until_the_minute_ends(url: str) -> None:
    """``tokens_per_minute``: the cost report that brings the provider's minute to its
    budget pauses its runs (every tenant's) until that minute ends."""
    from runlane.clock import ManualClock

    from .conftest import T0

    clock = ManualClock(T0 - T0 % 60 + 10)  # 10 s into a clock minute
    store = Store(url, clock=clock)
    store.apply_policy(parse_policy(
        "[providers.openai]\ntokens_per_minute = 1000\n[providers.anthropic]\n"),
        source="test")
    runs = store.submit([task("t1", 0, provider="openai"), task("t2", 1, provider="openai"),
                         task("t2", 2, provider="openai"), task("t1", 3, provider="anthropic")])
    [first] = store.claim("w1", run_id=runs[0].run_id, lease_ttl=TTL)
    store.report_cost(first, 0.01, input_tokens=300, output_tokens=100)  # 400: room left
    [second] = store.claim("w1", run_id=runs[1].run_id, lease_ttl=TTL)
    store.report_cost(second, 0.01, input_tokens=500, output_tokens=100)  # 1,000: paused
    taken = store.claim("w1", limit=10, lease_ttl=TTL)
    assert [t.run_id for t in taken] == [runs[3].run_id]  # anthropic only
    clock.advance(49.9)
    assert store.claim("w1", limit=10, lease_ttl=TTL) == []
    clock.advance(0.1)  # the next minute: a new window
    [third] = store.claim("w1", limit=10, lease_ttl=TTL)
    assert third.run_id == runs[2].run_id
    store.report_cost(third, 0.01, input_tokens=10)
    with store.engine.connect() as conn:
        row = conn.execute(text("SELECT window_tokens, paused_until FROM provider_pauses "
                                "WHERE provider = 'openai'")).one()
    assert (row.window_tokens, row.paused_until) == (10, clock.now())
    for lease in (first, second, *taken, third):
        store.complete(lease)
    store.close()
