"""``runlane worker``: register, claim up to ``concurrency`` runs, drive each attempt
on its own thread, extend every lease from one heartbeat loop, and drain on SIGTERM.

Threads, not asyncio: an attempt spends its life waiting on a subprocess, and the
store is synchronous; one thread per active attempt is cheap at agent concurrency.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import structlog
from sqlalchemy.exc import DBAPIError

from runlane.domain.states import LEASED, RunStatus
from runlane.observability import metrics
from runlane.store.store import CANCEL_CHANNEL, WAKEUP_CHANNEL, Lease, Store
from runlane.store.wakeup import CHANGE_POLL_SECONDS, CHANGED, ClaimGate, Listener
from runlane.version import __version__
from runlane.worker.attempt import AttemptDriver, AttemptState
from runlane.worker.withdraw import Withdrawer

log = structlog.get_logger("runlane.worker")


# A wake-up (NOTIFY) can announce a run before it is visible: the reaper requeues with
# a backoff, and its notification arrives within milliseconds. A wake-up whose claim
# found nothing is followed by one more look after this long (at most the poll).
WAKEUP_RECHECK_SECONDS = 0.1
# The stages in which an attempt still holds its lease (a cancel being delivered too).
_HELD = LEASED | {RunStatus.CANCEL_REQUESTED, RunStatus.CANCELLING}


def holds_lease(lease: Lease) -> bool:
    """False once the attempt's own write ended its lease (complete, fail, release,
    cancel): the heartbeat has nothing left to extend."""
    return lease.stage in _HELD


def _key(state: AttemptState) -> tuple[str, int]:
    return state.lease.run_id, state.lease.fencing_token


def new_worker_id() -> str:
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4()}"


@dataclass
class WorkerConfig:
    queues: list[str] = field(default_factory=lambda: ["default"])
    concurrency: int = 1
    capabilities: dict[str, Any] = field(default_factory=dict)
    lease_ttl_seconds: float = 60.0
    heartbeat_seconds: float = 10.0
    poll_seconds: float = 1.0
    drain_grace_seconds: float = 30.0
    agent_term_grace_seconds: float = 10.0
    exit_when_idle: bool = False
    # SQLite: how often the change signal is read (store/wakeup.py).
    change_poll_seconds: float = CHANGE_POLL_SECONDS


class Worker:
    def __init__(self, store: Store, driver: AttemptDriver, config: WorkerConfig,
                 *, worker_id: str | None = None) -> None:
        self.store = store
        self.driver = driver
        self.config = config
        self.worker_id = worker_id or new_worker_id()
        self.listener = Listener(store.url, change_poll_seconds=config.change_poll_seconds,
                                 listen_database_url=store.listen_url)
        self.gate = ClaimGate(store.url)
        self.draining = threading.Event()
        self._stopped = threading.Event()
        self._beat_now = threading.Event()
        # Keyed by attempt (run_id, fencing token), not by run: an attempt that gave its
        # lease back may still be cleaning up when this worker claims the run again, and
        # its thread must not drop the newer attempt (no more heartbeats) when it ends.
        self._active: dict[tuple[str, int], tuple[threading.Thread, AttemptState]] = {}
        self._lock = threading.Lock()
        self._signal: str | None = None  # the signal that started the drain
        self.outcomes: list[str] = []
        self.log = log.bind(worker_id=self.worker_id)
        # Withdrawals (worker/withdraw.py): looked for at most once a poll interval, on
        # a thread of their own, one pass at a time (through the driver's code hosts;
        # a driver without any, a test's, takes none).
        code_host_for = getattr(driver, "code_host_for", None)
        self.withdrawer = (Withdrawer(store, code_host_for, self.worker_id)
                           if code_host_for is not None else None)
        self._withdrawing: threading.Thread | None = None
        self._next_withdrawal = 0.0

    # --- lifecycle ------------------------------------------------------------------

    def run(self, *, handle_signals: bool = False) -> int:
        """Run until drained (SIGTERM, or ``request_drain()``) or, with
        ``exit_when_idle``, until no work is left. ``handle_signals`` makes SIGTERM and
        SIGINT start the drain (the CLI's worker; only from the main thread)."""
        if handle_signals and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        self.store.register_worker(self.worker_id, version=__version__,
                                   queues=self.config.queues,
                                   capabilities=self.config.capabilities)
        # LISTEN before the first claim: a run submitted in between would otherwise
        # wait for the poll.
        self.listener.start().wait_connected()
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="runlane-heartbeat",
                                     daemon=True)
        heartbeat.start()
        self.log.info("worker_started", queues=self.config.queues,
                      concurrency=self.config.concurrency)
        try:
            self._claim_loop()
        finally:
            if self._signal is not None:
                self.log.info("drain_requested", signal=self._signal)
            self.request_drain()
            self._drain()  # never leave with attempts running: they would be orphaned
            if self._withdrawing is not None:  # bounded: code-host and git timeouts
                self._withdrawing.join(timeout=self.config.drain_grace_seconds)
            self._stopped.set()
            self._beat_now.set()
            heartbeat.join(timeout=5)
            self.listener.close()
            self.gate.close()
            self._set_status("STOPPED")
            self.log.info("worker_stopped", outcomes=len(self.outcomes))
        return 0

    def request_drain(self) -> None:
        if not self.draining.is_set():
            self.draining.set()
            self.listener.poke()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Python runs a handler in the main thread between two bytecodes, maybe while
        # that thread holds a lock: the listener's inbox (inside Listener.wait), the
        # log's write lock. Taking one of those here would never return (the worker
        # would never drain): no logging here, and poke() is reentrant.
        self._signal = signal.Signals(signum).name
        self.request_drain()

    # --- claiming ----------------------------------------------------------------------

    def _claim_loop(self) -> None:
        """Claim, then wait for a wake-up or the poll. A NOTIFY for new work is answered
        with a claim; anything else (the poll, SQLite's change signal, a slot freed)
        with a look first (``_claim_if_ready``), so an idle worker's poll and every
        commit on SQLite cost a read, not a claim."""
        announced = False  # the last wait was ended by a wake-up for new work
        while not self.draining.is_set():
            try:
                claimed = self._claim_once() if announced else self._claim_if_ready()
                self._withdraw_soon()
                if (self.config.exit_when_idle and claimed == 0 and self._active_count() == 0
                        and self.store.waiting_count(self.config.queues,
                                                     self.config.capabilities) == 0
                        and not self._withdrawal_running()
                        and not self.store.withdrawal_due()):
                    return
            except Exception as exc:  # keep the worker alive; its attempts keep running
                self.log.error("claim_loop_error", error=f"{type(exc).__name__}: {exc}")
                claimed = 0
            if claimed:
                wait = 0.0
            elif announced:  # woken for work that was not visible yet: look again soon
                wait = min(self.config.poll_seconds, WAKEUP_RECHECK_SECONDS)
            else:
                wait = self.config.poll_seconds
            woken = self.listener.wait(wait)
            announced = any(w.channel == WAKEUP_CHANNEL for w in woken)
            for wake in woken:
                if wake.channel == CANCEL_CHANNEL:
                    with self._lock:
                        if any(run_id == wake.payload for run_id, _ in self._active):
                            self._beat_now.set()  # deliver the cancel without waiting
            if any(w.channel == CHANGED for w in woken):
                self._look_for_cancels()

    def _claim_if_ready(self) -> int:
        """Claim if a look (one read of the lanes) finds work for this worker. On SQLite
        the look is made again holding the claim gate, and the claim under it: workers
        woken by one commit claim one after another, and the later ones' second look
        finds the run taken (one submit, one claim)."""
        if self.config.concurrency - self._active_count() <= 0:
            return 0
        ready = self.store.has_ready_work
        if not ready(self.config.queues, self.config.capabilities):
            return 0
        if self.gate.path is None:
            return self._claim_once()
        with self.gate.held():
            if not ready(self.config.queues, self.config.capabilities):
                return 0
            return self._claim_once()

    def _look_for_cancels(self) -> None:
        """SQLite: something was committed; if it was a cancel of a run this worker
        holds, beat now (the beat delivers it). Runs whose cancel is already delivered
        are not looked for again: the beat itself commits, and would wake this again."""
        with self._lock:
            held = [state.lease.run_id for _, (_, state) in self._active.items()
                    if holds_lease(state.lease) and not state.cancel.is_set()]
        if not held:
            return
        try:
            if self.store.cancels_among(held):
                self._beat_now.set()
        except Exception as exc:  # the heartbeat delivers it anyway
            self.log.warning("cancel_look_failed", error=f"{type(exc).__name__}: {exc}")

    def _claim_once(self) -> int:
        claimed = 0
        for queue in self.config.queues:
            free = self.config.concurrency - self._active_count()
            if free <= 0 or self.draining.is_set():
                break
            sent_at = time.monotonic()
            asked_ns = time.time_ns()  # the claim's span (observability/tracing.py)
            leases = self.store.claim(self.worker_id, queue, limit=free,
                                      lease_ttl=self.config.lease_ttl_seconds,
                                      capabilities=self.config.capabilities)
            claimed_ns = (asked_ns, time.time_ns())
            for lease in leases:
                state = AttemptState(lease, self.store,
                                     stop_grace=self.config.agent_term_grace_seconds,
                                     claimed_ns=claimed_ns)
                state.extended(sent_at, self.config.lease_ttl_seconds)
                self._start(state)
            if leases:
                self._beat_now.set()  # a slow claim must not eat into the first lease
            claimed += len(leases)
        return claimed

    def _start(self, state: AttemptState) -> None:
        thread = threading.Thread(target=self._drive, args=(state,), daemon=True,
                                  name=f"attempt-{state.lease.attempt_id}")
        with self._lock:
            self._active[_key(state)] = (thread, state)
        thread.start()

    def _drive(self, state: AttemptState) -> None:
        try:
            self.outcomes.append(self.driver.run(state))
        finally:
            with self._lock:
                self._active.pop(_key(state), None)
            self.listener.poke()  # a slot is free

    def _active_count(self) -> int:
        with self._lock:
            return len(self._active)

    # --- withdrawals -------------------------------------------------------------------

    def _withdraw_soon(self) -> None:
        """Start a pass of withdrawals if none is running and the last look is a poll
        interval old."""
        now = time.monotonic()
        if self.withdrawer is None or self._withdrawal_running() or \
                now < self._next_withdrawal:
            return
        self._next_withdrawal = now + self.config.poll_seconds
        self._withdrawing = threading.Thread(target=self._withdraw, daemon=True,
                                             name="runlane-withdraw")
        self._withdrawing.start()

    def _withdrawal_running(self) -> bool:
        return self._withdrawing is not None and self._withdrawing.is_alive()

    def _withdraw(self) -> None:
        assert self.withdrawer is not None
        try:
            self.withdrawer.run_once()
        except Exception as exc:  # the database, say: the next pass tries again
            self.log.error("withdrawal_pass_failed", error=f"{type(exc).__name__}: {exc}")

    # --- heartbeat ---------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Beats every ``heartbeat_seconds`` counted from when the last beat was *sent*
        (a slow answer does not push the next beat out), at once when asked, and again
        within a second after a failed beat."""
        last_ok = time.monotonic()
        wait = self.config.heartbeat_seconds
        while not self._stopped.is_set():
            self._beat_now.wait(wait)
            self._beat_now.clear()
            with self._lock:  # not the attempts that have ended or are stopping for a loss
                # (by run: of a run's attempts here, the newest, sorted last, wins)
                states = {s.lease.run_id: s for _, (_, s) in sorted(
                    self._active.items(), key=lambda entry: entry[0])
                    if holds_lease(s.lease) and not s.lost.is_set()}
            sent_at = time.monotonic()
            try:
                result = self.store.heartbeat(self.worker_id, [s.lease for s in states.values()],
                                              lease_ttl=self.config.lease_ttl_seconds)
                if self._set_status("DRAINING" if self.draining.is_set() else "READY") \
                        and not self.draining.is_set():
                    # `runlane workers drain`: exactly as SIGTERM would.
                    self.log.info("drain_requested", by="operator")
                    self.request_drain()
                last_ok = time.monotonic()
                metrics.heartbeat(last_ok - sent_at)
            except Exception as exc:  # a dead heartbeat thread would keep leases "alive"
                self.log.error("heartbeat_failed", error=f"{type(exc).__name__}: {exc}")
                if time.monotonic() - last_ok > self.config.lease_ttl_seconds:
                    for s in states.values():  # the leases have expired by now
                        s.lost.set()
                wait = min(1.0, self.config.heartbeat_seconds)
                continue
            wait = max(0.0, self.config.heartbeat_seconds - (time.monotonic() - sent_at))
            for run_id in result.extended:  # each also tells the sandbox's guard at once
                states[run_id].extended(sent_at, self.config.lease_ttl_seconds)
            # An attempt may end its lease while the beat is on its way: not a loss.
            lost = sorted(r for r in result.lost if holds_lease(states[r].lease))
            if lost:
                self.log.warning("lease_lost", run_ids=lost)
            for run_id in lost:
                states[run_id].lost.set()
            for run_id in result.cancel_requested:
                states[run_id].cancel.set()

    def _set_status(self, status: str) -> bool:
        """Whether an operator asked this worker to drain (False when the write failed:
        the next beat asks again)."""
        with contextlib.suppress(DBAPIError):
            return self.store.set_worker_status(self.worker_id, status)
        return False

    # --- drain -------------------------------------------------------------------------

    def _drain(self) -> None:
        """No new claims; active runs get the grace period, then give their leases back."""
        if not self._active_count():
            return
        self._set_status("DRAINING")
        deadline = time.monotonic() + self.config.drain_grace_seconds
        self.log.info("draining", active=self._active_count(),
                      grace_seconds=self.config.drain_grace_seconds)
        while self._active_count() and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            remaining = list(self._active.values())
        for _, state in remaining:
            state.drain.set()
        for thread, _ in remaining:
            thread.join()

