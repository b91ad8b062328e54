"""Repository identity in the scheduler: a repository's spellings are one concurrency
scope, one thing a policy rule names, and one string shown (domain/repos.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runlane.clock import ManualClock
from runlane.domain.policy import parse_policy
from runlane.store.store import Store

from .conftest import CLAIM_PATHS, POLICY, claim_path_database
from .support import cli_env, spec

# The four spellings of one repository.
FOUR = ("https://github.com/acme/app", "https://github.com/acme/app.git",
        "git@github.com:acme/app.git", "github.com/acme/app/")
CANONICAL = "https://github.com/acme/app"
TTL = 60.0


@pytest.fixture(params=CLAIM_PATHS)
def claim_url(request: pytest.FixtureRequest, tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> str:
    """A database for each claim path: SQLite, PostgreSQL's one statement and its
    transaction (the other tests run on the two engines, ``store``)."""
    return claim_path_database(request, tmp_path, monkeypatch)


@pytest.fixture
def claim_store(claim_url: str, clock: ManualClock) -> Iterator[Store]:
    s = Store(claim_url, clock=clock, retry_policy=POLICY, rng=random.Random(1))
    yield s
    s.close()


def apply(store: Store, text_: str) -> int:
    return store.apply_policy(parse_policy(text_), source="test").version


# --- limits -----------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [
    "[concurrency]\nper_repository_max_active = 1\n",
    # a repository rule written in one spelling limits every spelling
    "[[repositories]]\nmatch = 'git@github.com:acme/app.git'\nmax_active = 1\n",
    "[[repositories]]\nmatch = 'https://GitHub.com/acme/*.git'\nmax_active = 1\n",
])
def test_a_repository_limit_of_1_holds_across_four_spellings(claim_store: Store,
                                                             limit: str) -> None:
    """Four runs on one repository, each written differently: one claim of 4 takes
    one, and the next claims take none until it ends (each spelling was a scope of its
    own: 4 ran at once). On SQLite, PostgreSQL's one statement and its transaction."""
    store = claim_store
    apply(store, limit)
    subs = store.submit([spec(repo=r) for r in FOUR])
    assert {s.status for s in subs} == {"QUEUED"}
    first = store.claim("w1", limit=4, lease_ttl=TTL)
    assert len(first) == 1
    assert [store.claim(f"w{i}", lease_ttl=TTL) for i in (2, 3, 4)] == [[], [], []]
    assert first[0].repo == CANONICAL
    store.complete(first[0])
    [second] = store.claim("w5", limit=4, lease_ttl=TTL)
    assert second.run_id != first[0].run_id
    assert store.audit() == []


def test_four_claimers_racing_take_one_run_of_one_repository(db_url: str) -> None:
    """Four processes claim at once, each for up to 4 runs, over four spellings of
    one repository limited to 1: exactly one run is claimed in all. (Processes claim
    on PostgreSQL's default path: a test's switch does not reach them.)"""
    store = Store(db_url)
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    store.submit([spec(repo=r) for r in FOUR])
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    from .procs import claim_once
    procs = [ctx.Process(target=claim_once, args=(db_url, f"w{i}", start, results))
             for i in range(4)]
    for p in procs:
        p.start()
    start.set()
    claimed = [run for _ in procs for run in results.get(timeout=120)[1]]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(claimed) == 1, claimed
    assert store.audit() == []
    store.close()


# --- policy rules -----------------------------------------------------------------------


DENY_ONE_SPELLING = [
    """[[rules]]
name = "no-agents-on-app"
when = { repo = "git@github.com:acme/app.git" }
action = "deny"
""",
    """[[rules]]
when = { repo = ["https://github.com/Acme/App"] }
action = "deny"
""",
    """[[rules]]
when = { repo = "github.com/acme/ap?/" }
action = "deny"
""",
    """[[repositories]]
match = "https://github.com/acme/app.git"
autonomous_agents = false
""",
    """[[repositories]]
match = "acme/app"
autonomous_agents = false
""",
]


@pytest.mark.parametrize("policy", DENY_ONE_SPELLING)
def test_a_deny_rule_for_one_spelling_denies_every_other(store: Store, policy: str) -> None:
    """At submit: each spelling is denied, whichever one the rule was written in, on
    its own and in one batch."""
    apply(store, policy)
    spellings = (*FOUR, "acme/app", "ssh://git@github.com:22/acme/app.git",
                 "https://x-access-token:ghp_SECRET@github.com/ACME/app.git")
    alone = [store.submit([spec(repo=r)])[0].status for r in reversed(spellings)]
    assert alone == ["POLICY_DENIED"] * len(spellings)
    subs = store.submit([spec(repo=r) for r in spellings])
    assert {s.status for s in subs} == {"POLICY_DENIED"}
    assert store.submit([spec(repo="https://github.com/acme/other")])[0].status == "QUEUED"


@pytest.mark.parametrize("policy", DENY_ONE_SPELLING[:1] + DENY_ONE_SPELLING[3:4])
def test_a_deny_rule_applied_later_stops_queued_runs_of_every_spelling(
        claim_store: Store, policy: str) -> None:
    """At claim: runs queued before the rule, under any spelling, are denied when
    claimed, not started (each claim path re-admits, or refuses a decision made under
    an older version)."""
    store = claim_store
    store.submit([spec(repo=r) for r in FOUR])
    apply(store, policy)
    assert store.claim("w1", limit=4, lease_ttl=TTL) == []
    assert {r["status"] for r in store.list_runs()} == {"POLICY_DENIED"}


# --- display ----------------------------------------------------------------------------


def test_runs_and_pull_requests_show_the_canonical_form_without_credentials(
        store: Store, tmp_path: Path) -> None:
    """``runs list``, ``runs show`` (JSON and text) and ``prs list`` show the identity;
    the token of the written URL appears nowhere, though the task keeps it to clone."""
    written = "https://x-access-token:ghp_SECRET@GitHub.com/Acme/App.git/"
    [sub] = store.submit([spec(repo=written)])
    [lease] = store.claim("w1", lease_ttl=TTL)
    store.effect_intent(lease, "pull_request")
    store.effect_done(lease, "pull_request", {  # as an older ledger recorded it
        "repo": written, "head_branch": "agent/x", "number": 7,
        "url": "https://github.com/acme/app/pull/7"})
    assert store.get_task(sub.task_id)["repo"] == written.strip()
    url = str(store.engine.url.render_as_string(hide_password=False))
    env = cli_env(tmp_path, COLUMNS="250")

    def cli(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                              capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert "ghp_SECRET" not in done.stdout + done.stderr
        return done.stdout

    [run] = json.loads(cli("runs", "list", "--json"))
    assert run["repo"] == CANONICAL
    shown = json.loads(cli("runs", "show", sub.run_id, "--json"))
    assert shown["repo"] == CANONICAL
    assert re.search(rf"repo +{re.escape(CANONICAL)}", cli("runs", "show", sub.run_id))
    [pr] = json.loads(cli("prs", "list", "--json"))
    assert (pr["repo"], pr["number"]) == (CANONICAL, 7)
    assert CANONICAL in cli("prs", "list")


def test_a_local_repository_is_one_identity_through_links_and_file_urls(
        store: Store, tmp_path: Path) -> None:
    """Local paths: a symbolic link, a file:// URL, a trailing slash and a relative path
    to one bare repository are one scope (a limit of 1 claims one of them)."""
    real = tmp_path / "git" / "app.git"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "git")
    apply(store, "[concurrency]\nper_repository_max_active = 1\n")
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        store.submit([spec(repo=r) for r in (str(real), f"file://{real}", f"{real}/",
                                             "link/app.git", "./git/app.git")])
    finally:
        os.chdir(here)
    assert {r["repo"] for r in store.list_runs()} == {str(real.resolve())}
    assert len(store.claim("w1", limit=5, lease_ttl=TTL)) == 1


def test_written_form_is_what_the_worker_clones() -> None:
    """The identity is for scheduling and display; the code host and git get the
    repository as written (``host/path`` spelled out as the URL git needs)."""
    from runlane.codehost.factory import clone_source
    assert clone_source("git@github.com:acme/app.git", env={}) == "git@github.com:acme/app.git"
    assert clone_source("github.com/acme/app/", env={}) == "https://github.com/acme/app/"
    assert clone_source("acme/app", env={}) == "https://github.com/acme/app.git"
