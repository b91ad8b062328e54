"""Entry points for the real processes the concurrency tests start (spawn context)."""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

from runlane.domain.states import RunStatus
from runlane.logs import configure_logging
from runlane.store.store import Store


def claim_until_empty(url: str, worker_id: str, batch: int, release_every: int,
                      start: Any, results: Any) -> None:
    """Claim in batches until the queue is empty; give back every Nth lease (a new
    attempt follows) and complete the rest. Reports every (run, attempt, token) claimed."""
    configure_logging("WARNING")
    store = Store(url, rng=random.Random(worker_id))
    claimed: list[tuple[str, int, int]] = []
    start.wait()
    empty = 0
    n = 0
    while empty < 3:
        leases = store.claim(worker_id, limit=batch, lease_ttl=60)
        if not leases:
            empty += 1
            time.sleep(0.02)
            continue
        empty = 0
        for lease in leases:
            claimed.append((lease.run_id, lease.attempt_no, lease.fencing_token))
            n += 1
            if release_every and n % release_every == 0 and lease.attempt_no < 3:
                store.release(lease)
            else:
                store.complete(lease)
    store.close()
    results.put((worker_id, claimed))


def hold_a_lease_forever(url: str, ttl: float) -> None:
    """Claim one run, move it to RUNNING and heartbeat until killed."""
    configure_logging("WARNING")  # stdout carries only the "running" line
    store = Store(url)
    while True:
        leases = store.claim(f"victim/{os.getpid()}", lease_ttl=ttl)
        if leases:
            break
        time.sleep(0.05)
    [lease] = leases
    store.advance(lease, RunStatus.RUNNING)
    print("running", flush=True)
    while True:
        store.heartbeat(lease.worker_id, [lease], lease_ttl=ttl)
        time.sleep(ttl / 5)


if __name__ == "__main__":
    hold_a_lease_forever(sys.argv[1], float(sys.argv[2]))


def claim_hold_complete(url: str, worker_id: str, batch: int, start: Any, results: Any) -> None:
    """Claim in batches, hold each lease a few milliseconds, complete it; until no run
    is queued (an empty claim alone proves nothing: the others' leases may fill a
    limit, a backlog pass may hold the rows; on a loaded machine for seconds). Reports
    the runs claimed, each with the wall time its claim call began. For the
    concurrency-limit tests (invariant 9)."""
    configure_logging("WARNING")
    store = Store(url, rng=random.Random(worker_id))
    rng = random.Random(worker_id)
    start.wait()
    claimed = 0
    calls: list[tuple[str, float]] = []  # (run, wall time its claim call began)
    give_up = time.monotonic() + 180  # the test then fails on its counts, not a hang
    while time.monotonic() < give_up:
        began = time.time()
        leases = store.claim(worker_id, limit=batch, lease_ttl=60)
        if not leases:
            if not store.list_runs(status="QUEUED", limit=1):
                break
            time.sleep(0.01)
            continue
        for lease in leases:
            calls.append((lease.run_id, began))
            time.sleep(rng.uniform(0.0, 0.004))
            store.complete(lease)
            claimed += 1
    store.close()
    results.put((worker_id, claimed, calls))


def backlog_passes(url: str, go: Any, stop: Any, results: Any) -> None:
    """Scheduler passes that admit the queued backlog again, back to back from ``go``
    until ``stop``; reports their summed counts. For the backlog race test."""
    configure_logging("WARNING")
    store = Store(url)
    totals: dict[str, int] = {}
    go.wait()
    while not stop.is_set():
        for key, n in store.schedule_pass(queued_under_older=True).items():
            totals[key] = totals.get(key, 0) + n
        time.sleep(0.002)
    store.close()
    results.put(("passes", totals))


def claim_once(url: str, worker_id: str, start: Any, results: Any) -> None:
    """One claim of up to 4 runs at ``start``, the leases kept; reports the runs claimed.
    For the repository-identity race (four spellings of one repository)."""
    configure_logging("WARNING")
    store = Store(url)
    start.wait()
    leases = store.claim(worker_id, limit=4, lease_ttl=60)
    store.close()
    results.put((worker_id, [lease.run_id for lease in leases]))
