"""SQLite's change signal (store/wakeup.py) with real worker processes at the default
intervals: a cancel reaches the agent within a second whatever the heartbeat, an idle
worker claims a submit within a fraction of the poll, idle workers write nothing, and
one submit among four idle workers costs one claim (the claim gate)."""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runlane.store.store import Store
from runlane.store.wakeup import CHANGED, CLAIM_GATE_SUFFIX, ClaimGate, Listener

from .conftest import migrated_sqlite
from .http_support import free_port
from .support import bare_remote, processes_in, spec
from .test_worker import WorkerProcess, _workers, status_of, wait_until

# The defaults a user gets (the worker test fixture shortens them): the signal must not
# depend on a short heartbeat.
DEFAULTS = {"RUNLANE_LEASE_TTL_SECONDS": "60", "RUNLANE_HEARTBEAT_SECONDS": "10",
            "RUNLANE_AGENT_TERM_GRACE_SECONDS": "10"}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return migrated_sqlite(tmp_path / "runlane.db")


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    store = Store(sqlite_url)
    yield store
    store.close()


@pytest.fixture
def workers(sqlite_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(agent: str, *args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        process = WorkerProcess(sqlite_url, tmp_path, tmp_path / "forge", agent, *args,
                                env={**DEFAULTS, **(env or {})})
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def registered(store: Store, n: int) -> bool:
    return len(_workers(store)) >= n


def claims(port: int) -> float:
    """The claims a worker made so far (those that got a run and the empty ones)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               if family.name in ("runlane_scheduler_claim_success",
                                  "runlane_scheduler_claim_empty")
               for sample in family.samples if sample.name.endswith("_total"))


def test_a_cancel_reaches_the_agent_within_a_second_at_default_intervals(
        store: Store, tmp_path: Path, workers: Callable[..., WorkerProcess]) -> None:
    remote = bare_remote(tmp_path)
    [sub] = store.submit([spec(repo=str(remote))])
    workers("touch \"$RUNLANE_ARTIFACTS_DIR/started\"; sleep 120")
    started = tmp_path / "artifacts" / sub.run_id / "1" / "started"
    workspace = tmp_path / "workspaces" / f"{sub.run_id}-1"
    wait_until(lambda: started.exists() and status_of(store, sub.run_id) == "RUNNING", 30,
               "the agent to run")
    assert processes_in(workspace)
    store.cancel(sub.task_id)  # returns once the cancel is committed
    gone_after = wait_until(lambda: not processes_in(workspace), 15,
                            "the agent's processes to exit")
    # Without the signal the cancel waits for the next heartbeat: up to 10 s.
    assert gone_after < 1.0, f"the agent outlived the cancel by {gone_after:.2f} s"
    wait_until(lambda: status_of(store, sub.run_id) == "CANCELLED", 15, "CANCELLED")


def test_an_idle_worker_claims_a_submit_within_a_fraction_of_the_poll(
        store: Store, tmp_path: Path, workers: Callable[..., WorkerProcess]) -> None:
    remote = bare_remote(tmp_path)
    workers("true")
    wait_until(lambda: registered(store, 1), 30, "the worker to register")
    time.sleep(0.3)  # past its first look: the worker is idle, waiting
    waits = []
    for _ in range(6):
        [sub] = store.submit([spec(repo=str(remote))])
        waits.append(wait_until(lambda s=sub: status_of(store, s.run_id) != "QUEUED", 10,
                                "the claim"))
        wait_until(lambda s=sub: status_of(store, s.run_id) == "SUCCEEDED", 30, "the run")
        time.sleep(0.2)  # idle again
    # The poll is a second: a worker woken by nothing claims at 0.5 s at the median.
    assert statistics.median(waits) < 0.3, waits


def test_four_idle_workers_write_nothing_and_one_submit_costs_one_or_two_claims(
        store: Store, tmp_path: Path, workers: Callable[..., WorkerProcess]) -> None:
    remote = bare_remote(tmp_path)
    ports = [free_port() for _ in range(4)]
    # Beats 30 s apart (a legal setting), so that the idle window below holds none: what
    # it shows is the cost of the change signal and of the idle poll alone.
    for port in ports:
        workers("sleep 30", "--metrics-port", str(port),
                env={"RUNLANE_LEASE_TTL_SECONDS": "90", "RUNLANE_HEARTBEAT_SECONDS": "30"})
    wait_until(lambda: registered(store, 4), 30, "four workers")
    time.sleep(1.5)  # their start-up writes and first looks are done
    database = tmp_path / "runlane.db"
    wal = Path(f"{database}-wal")

    def files() -> tuple[int, int, int]:
        return database.stat().st_mtime_ns, wal.stat().st_size, wal.stat().st_mtime_ns

    seen, before = files(), [claims(port) for port in ports]
    time.sleep(10)  # ten polls each, and 200 reads of the change signal
    assert files() == seen, "idle workers wrote to the database"
    assert [claims(port) for port in ports] == before, "idle workers claimed on their poll"
    [sub] = store.submit([spec(repo=str(remote))])
    wait_until(lambda: status_of(store, sub.run_id) != "QUEUED", 10, "the claim")
    time.sleep(1.5)  # every worker has seen the commit, and its poll has passed
    made = sum(claims(port) for port in ports) - sum(before)
    # Without the claim gate each of the four claims (one run, three empty claims).
    assert 1 <= made <= 2, f"{made} claims for one submit among four idle workers"


def test_the_listener_wakes_on_another_connections_commit_only(
        store: Store, sqlite_url: str) -> None:
    listener = Listener(sqlite_url, change_poll_seconds=0.01).start()
    try:
        assert listener.wait_connected()
        assert listener.wait(0.2) == []  # nothing committed: nothing wakes
        store.submit([spec()])
        woken = listener.wait(5)
        assert [w.channel for w in woken] == [CHANGED]
    finally:
        listener.close()


def test_the_claim_gate_lets_one_holder_at_a_time_and_is_passed_by_when_stuck(
        sqlite_url: str, tmp_path: Path) -> None:
    first, second = ClaimGate(sqlite_url), ClaimGate(sqlite_url, wait_seconds=0.1)
    assert first.path == Path(str(tmp_path / "runlane.db") + CLAIM_GATE_SUFFIX)
    try:
        with first.held() as held:
            assert held
            started = time.monotonic()
            with second.held() as also:  # its holder is stuck: passed by, not waited for
                assert not also
            assert time.monotonic() - started >= 0.1
        with second.held() as held:
            assert held
        assert oct(os.stat(first.path).st_mode & 0o777) == "0o600"
    finally:
        first.close()
        second.close()
