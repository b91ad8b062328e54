"""One maintenance leader per database (services/leader.py, store/leadership.py): of
several nodes, one runs the passes at a time; another takes over when it dies; a
leader whose lock session dies stops its passes and contends again."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from structlog.testing import capture_logs

from runlane.services.leader import MaintenanceLeader
from runlane.services.maintenance import MaintenanceService
from runlane.store.leadership import maintenance_lock
from runlane.store.store import Store
from runlane.store.wakeup import libpq_url

from .support import bare_remote, spec, wait_until

ROOT = Path(__file__).resolve().parent.parent
TTL = 3.0
REAPER_INTERVAL = 0.5


class Counting(MaintenanceService):
    """A pass that records which leader ran it."""

    name = "counting"
    interval_seconds = 0.01

    def __init__(self, passes: list[str]) -> None:
        self.passes = passes

    def run_once(self) -> dict[str, int]:
        self.passes.append(str(self.node))
        return {}


def _leader(url: str, passes: list[str], node: str) -> MaintenanceLeader:
    return MaintenanceLeader(maintenance_lock(url, check_seconds=0.05),
                             lambda: [Counting(passes)], retry_seconds=0.05, node_id=node)


@contextlib.contextmanager
def _running(leader: MaintenanceLeader) -> Iterator[threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=leader.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_one_of_two_nodes_leads_and_the_other_takes_over(db_url: str) -> None:
    passes: list[str] = []
    a, b = _leader(db_url, passes, "a"), _leader(db_url, passes, "b")
    with contextlib.ExitStack() as running:
        stop_a = running.enter_context(_running(a))
        wait_until(a.leading.is_set, 10, "a to lead")
        running.enter_context(_running(b))
        wait_until(lambda: passes.count("a") >= 5, 10, "a's passes")
        assert not b.leading.is_set() and "b" not in passes
        stop_a.set()  # a steps down (its lock released): b takes over
        wait_until(b.leading.is_set, 10, "b to lead")
        wait_until(lambda: passes.count("b") >= 5, 10, "b's passes")
        assert not a.leading.is_set()
    switches = sum(1 for x, y in itertools.pairwise(passes) if x != y)
    assert switches == 1, passes


def test_a_leader_whose_lock_session_dies_stops_and_contends_again(pg_url: str) -> None:
    passes: list[str] = []
    a = _leader(pg_url, passes, "a")
    with capture_logs() as logs, _running(a):
        wait_until(a.leading.is_set, 10, "a to lead")
        pid = a.lock._conn.info.backend_pid  # type: ignore[attr-defined]
        with psycopg.connect(libpq_url(pg_url), autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_until(lambda: a.terms >= 2 and a.leading.is_set(), 10, "a to lead again")
    events = [e["event"] for e in logs if e["event"].startswith("maintenance_leader")]
    assert events[:3] == ["maintenance_leader_acquired", "maintenance_leader_lost",
                          "maintenance_leader_acquired"], events


# --- three `runlane up` nodes, the leader SIGKILLed twice ---------------------------------


class Node:
    """A `runlane up` with one worker, logging JSON at DEBUG to a file."""

    def __init__(self, db_url: str, tmp_path: Path, i: int) -> None:
        self.log_path = tmp_path / f"node{i}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        env.update({
            "RUNLANE_FORGE_DIR": str(tmp_path / "forge"),
            "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
            "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
            "RUNLANE_LEASE_TTL_SECONDS": str(TTL),
            "RUNLANE_HEARTBEAT_SECONDS": "0.5",
            "RUNLANE_REAPER_INTERVAL_SECONDS": str(REAPER_INTERVAL),
            "RUNLANE_AGENT_TERM_GRACE_SECONDS": "0.5",
            "RUNLANE_DRAIN_GRACE_SECONDS": "1",
            "RUNLANE_RETRY_BASE_SECONDS": "0.1",
            "RUNLANE_RETRY_MAX_SECONDS": "0.2",
            "RUNLANE_SANDBOX": "off",
            "RUNLANE_LOG_LEVEL": "DEBUG",
            "RUNLANE_LOG_FORMAT": "json",
        })
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "runlane", "--database-url", db_url, "up",
                 "--workers", "1", "--agent-command", "sleep 20"],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True)

    def entries(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict):
                    out.append(entry)
        return out

    def leads(self) -> bool:
        return any(e.get("event") == "maintenance_leader_acquired" for e in self.entries())

    def worker_pids(self) -> list[int]:
        return [pid for e in self.entries() if e.get("event") == "workers_started"
                for pid in e["pids"]]

    def kill(self) -> float:
        """SIGKILL the node and its worker together; the wall time of the kill."""
        at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        return at

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def pass_intervals(entries: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    """(start, end, node) of every maintenance pass a node's log shows; a pass cut
    short by a SIGKILL ends at the node's last line."""
    open_: dict[tuple[str, str | None], float] = {}
    out: list[tuple[float, float, str]] = []
    last = 0.0
    for e in entries:
        if e.get("event") == "maintenance_pass_started":
            open_[(e["service"], e.get("node"))] = e["at"]
            last = max(last, e["at"])
        elif e.get("event") == "maintenance_pass_ended":
            start = open_.pop((e["service"], e.get("node")), None)
            if start is not None:
                out.append((start, e["at"], str(e.get("node"))))
            last = max(last, e["at"])
    out += [(start, last, str(node)) for (_, node), start in open_.items()]
    return out


def overlaps(intervals: list[tuple[float, float, str]]) -> list[tuple[Any, Any]]:
    """Pairs of passes of two different nodes that ran at the same time."""
    found = []
    ordered = sorted(intervals)
    for i, (start, end, node) in enumerate(ordered):
        for other in ordered[i + 1:]:
            if other[0] > end:
                break
            if other[2] != node:
                found.append(((start, end, node), other))
    return found


def node_switches(intervals: list[tuple[float, float, str]]) -> int:
    nodes = [node for _, _, node in sorted(intervals)]
    return sum(1 for x, y in itertools.pairwise(nodes) if x != y)


def lost_leases(store: Store, worker_pids: list[int]) -> list[tuple[str, float]]:
    """(run, when its lease was reaped) of the expired leases of these workers."""
    from sqlalchemy import text

    with store.engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT worker_id, run_id, lease_ended_at FROM attempts "
            "WHERE lease_status = 'EXPIRED' AND reason_code = 'WORKER_LOST'")).all()
    return [(r.run_id, float(r.lease_ended_at)) for r in rows
            if int(r.worker_id.split("/")[1]) in worker_pids]


def held_by(store: Store, worker_pids: list[int]) -> list[str]:
    from sqlalchemy import text

    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT worker_id, run_id FROM attempts "
                                 "WHERE lease_status = 'ACTIVE'")).all()
    return [r.run_id for r in rows if int(r.worker_id.split("/")[1]) in worker_pids]


def test_three_up_nodes_one_leader_at_a_time_through_two_kills(
        db_url: str, tmp_path: Path) -> None:
    remote = bare_remote(tmp_path)
    store = Store(db_url)
    nodes: list[Node] = []
    try:
        store.submit([spec(repo=str(remote)) for _ in range(6)])
        nodes = [Node(db_url, tmp_path, i) for i in range(3)]
        alive = list(nodes)
        recoveries: list[float] = []
        for _ in range(2):
            leader = wait_until(lambda: [n for n in alive if n.leads()], 60, "a leader")
            assert len(leader) == 1, "two nodes lead at once"
            [leader] = leader
            pids = wait_until(leader.worker_pids, 30, "the leader's worker")
            # The leader's worker holds a lease: killed with it, its run must be
            # recovered by the next leader's reaper.
            wait_until(lambda: held_by(store, pids), 60, "the leader's worker to hold a run")  # noqa: B023
            time.sleep(TTL / 2)  # passes on every node's log: long enough to overlap
            killed_at = leader.kill()
            alive.remove(leader)
            [(_run_id, reaped_at)] = wait_until(lambda: lost_leases(store, pids), 30,  # noqa: B023
                                               "the dead worker's lease to be reaped")
            recoveries.append(reaped_at - killed_at)
        wait_until(lambda: [n for n in alive if n.leads()], 30, "a third leader")
        time.sleep(TTL / 2)
    finally:
        for node in nodes:
            node.stop()
        store.close()
    intervals = [iv for node in nodes for iv in pass_intervals(node.entries())]
    assert len({node for _, _, node in intervals}) == 3, "each node led once"
    assert not overlaps(intervals), overlaps(intervals)[:5]
    assert node_switches(intervals) == 2
    # Recovery of a dead worker's run: its lease's expiry (at most TTL after the kill)
    # plus a pass of the new leader's reaper, plus a second of slack.
    assert all(0 < r <= TTL + REAPER_INTERVAL + 1.0 for r in recoveries), recoveries
    acquired = [e for node in nodes for e in node.entries()
                if e.get("event") == "maintenance_leader_acquired"]
    assert len(acquired) == 3


def test_the_lock_goes_where_listen_goes_and_never_through_a_pooler() -> None:
    """A session lock does not survive a transaction pooler: behind one the lock takes
    LISTEN_DATABASE_URL; without it there is no election (every node runs the passes,
    safe side by side) and a warning says so."""
    from runlane.store.leadership import AdvisoryLock, NoLock

    pooled = "postgresql://postgres@127.0.0.1:6432/test?pooler=transaction"
    direct = "postgresql://postgres@127.0.0.1:5432/test"
    with capture_logs() as logs:
        lock = maintenance_lock(pooled, listen_database_url=direct)
    assert isinstance(lock, AdvisoryLock) and "5432" in lock.dsn and "pooler" not in lock.dsn
    assert not [e for e in logs if e["event"] == "maintenance_lock_unavailable"]
    with capture_logs() as logs:
        assert isinstance(maintenance_lock(pooled), NoLock)
    assert [e["event"] for e in logs] == ["maintenance_lock_unavailable"]
    assert isinstance(maintenance_lock(direct), AdvisoryLock)
