"""``runlane worker``: register, claim up to ``concurrency`` runs, drive each attempt
on its own thread, extend every lease from one heartbeat loop, and drain on SIGTERM.

Threads, not asyncio: an attempt spends its life waiting on a subprocess, and the
store is synchronous; one thread per active attempt is cheap at agent concurrency.
"""

from __future__ import annotations

import contextlib
import os
import random
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
from runlane.store.core import CANCEL_CHANNEL, WAKEUP_CHANNEL
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.store.wakeup import CHANGE_POLL_SECONDS, CHANGED, ClaimGate, Listener
from runlane.version import __version__
from runlane.worker.attempt import AttemptDriver, AttemptState
from runlane.worker.withdraw import Withdrawer

log = structlog.get_logger("runlane.worker")


# A wake-up (NOTIFY) can announce a run before it is visible: the reaper requeues with
# a backoff, and its notification arrives within milliseconds. A wake-up whose claim
# found nothing is followed by one more look after this long (at most the poll).
WAKEUP_RECHECK_SECONDS = 0.1
# An idle worker whose wake-ups work (LISTEN, SQLite's change signal) backs its poll off
# from ``poll_seconds``, IDLE_POLL_GROWTH times longer after each look that found
# nothing (1, 4, 16, 20 s), up to ``idle_poll_max_seconds`` (IDLE_POLL_MAX_SECONDS);
# never past the end of a backoff it saw. Each wait is cut to a random share of at
# least IDLE_POLL_JITTER of it, so that a fleet started together does not look all at
# once. Withdrawals are looked for every WITHDRAWAL_IDLE_POLLS idle polls.
IDLE_POLL_GROWTH = 4.0
IDLE_POLL_JITTER = 0.75
WITHDRAWAL_IDLE_POLLS = 3
# A worker that holds no lease beats its row every two heartbeats, but no less often
# than every this many seconds unless one heartbeat is longer (the heartbeat-lag alert
# fires at 30 s).
IDLE_BEAT_SECONDS = 20.0
# One NOTIFY wakes every idle worker of the queue in the cluster. Each waits a random
# delay in [0, spread), looks, and claims only if its look still finds the run: the
# first to claim takes it, and the later ones' look finds it gone (no empty claim). The
# spread is HERD_SPREAD_PER_PEER_SECONDS per other worker racing it, as estimated from
# the share of its races it won (an average over the last HERD_WINDOW or so; it starts
# assuming one), at most HERD_SPREAD_MAX_SECONDS: a lone worker soon waits nothing;
# 100 idle ones spread over a second, the first of them claiming after about 10 ms.
HERD_SPREAD_PER_PEER_SECONDS = 0.01
HERD_SPREAD_MAX_SECONDS = 1.0
HERD_WINDOW = 5
HERD_FIRST_WIN_RATE = 0.5
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
    # The poll's cap when idle and woken by commits (IDLE_POLL_MAX_SECONDS).
    idle_poll_max_seconds: float = 20.0
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
        self._next_in: float | None = None  # the last look: when a backoff it saw ends
        self._idle_wait = config.poll_seconds
        self._win_rate = HERD_FIRST_WIN_RATE  # of the races for new work it joined
        self._rng = random.Random()

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
        with a look after a short random delay, then a claim if the look finds work
        (``_claim_announced``); anything else (the poll, SQLite's change signal, a slot
        freed) with a look first (``_claim_if_ready``), so an idle worker's poll and
        every commit on SQLite cost a read, not a claim. The poll backs off while idle
        (``_next_wait``)."""
        announced = False  # the last wait was ended by a wake-up for new work
        while not self.draining.is_set():
            try:
                claimed = self._claim_announced() if announced else self._claim_if_ready()
                self._withdraw_soon()
                if (self.config.exit_when_idle and claimed == 0 and self._active_count() == 0
                        and self.store.waiting_count(self.config.queues,
                                                     self.config.capabilities) == 0):
                    if not self._withdrawal_running() and not self.store.withdrawal_due():
                        return
                    # Idle but for a withdrawal: look for it every poll, not backed off
                    # (it is all that keeps this worker from exiting).
                    self._idle_wait = self.config.poll_seconds
                    self._next_withdrawal = 0.0
            except Exception as exc:  # keep the worker alive; its attempts keep running
                self.log.error("claim_loop_error", error=f"{type(exc).__name__}: {exc}")
                claimed = 0
            woken = self.listener.wait(self._next_wait(claimed, announced))
            # New work in a queue this worker serves (the payload names the queue).
            announced = any(w.channel == WAKEUP_CHANNEL and w.payload in self.config.queues
                            for w in woken)
            for wake in woken:
                if wake.channel == CANCEL_CHANNEL:
                    with self._lock:
                        if any(run_id == wake.payload for run_id, _ in self._active):
                            self._beat_now.set()  # deliver the cancel without waiting
            if any(w.channel == CHANGED for w in woken):
                self._look_for_cancels()

    def _next_wait(self, claimed: int, announced: bool) -> float:
        """How long to wait for a wake-up: none after a claim; a moment after a wake-up
        for work its claim did not find (not visible yet); else the poll, made longer
        after each look that found nothing while wake-ups work, up to
        idle_poll_max_seconds, and never past the end of a backoff the last look saw."""
        poll = self.config.poll_seconds
        if claimed or announced:
            self._idle_wait = poll
            return 0.0 if claimed else min(poll, WAKEUP_RECHECK_SECONDS)
        wait = self._idle_wait
        if wait > poll:
            wait *= self._rng.uniform(IDLE_POLL_JITTER, 1.0)
        if self._next_in is not None:
            wait = min(wait, max(self._next_in, WAKEUP_RECHECK_SECONDS))
        cap = max(poll, self.config.idle_poll_max_seconds)
        self._idle_wait = (min(self._idle_wait * IDLE_POLL_GROWTH, cap)
                           if self.listener.healthy else poll)
        return wait

    def _claim_announced(self) -> int:
        """A wake-up for new work (NOTIFY), which every idle worker got: wait a random
        delay in [0, spread), where the spread grows with the workers racing this one
        (estimated from the share of such races it won), then look and claim. The
        first worker's claim takes the run; the others' look finds it gone."""
        if self.config.concurrency - self._active_count() <= 0:
            return 0
        peers = max(0.0, 1.0 / max(self._win_rate, 1e-3) - 1.0)
        spread = min(HERD_SPREAD_MAX_SECONDS, HERD_SPREAD_PER_PEER_SECONDS * peers)
        if spread > 0 and self.draining.wait(self._rng.uniform(0.0, spread)):
            return 0
        claimed = self._claim_if_ready()
        self._win_rate += (float(claimed > 0) - self._win_rate) / HERD_WINDOW
        return claimed

    def _claim_if_ready(self) -> int:
        """Claim if a look (one read of the lanes) finds work for this worker. On SQLite
        the look is made again holding the claim gate, and the claim under it: workers
        woken by one commit claim one after another, and the later ones' second look
        finds the run taken (one submit, one claim)."""
        if self.config.concurrency - self._active_count() <= 0:
            return 0
        if not self._ready():
            return 0
        if self.gate.path is None:
            claimed = self._claim_once()
        else:
            with self.gate.held():
                if not self._ready():
                    return 0
                claimed = self._claim_once()
        if claimed == 0:
            # The look saw an awake lane, but its runs wait out a backoff: the empty claim
            # put the lane to sleep until the first is due. Look again to learn when, or
            # a retry due in a second would wait for the idle poll (up to 20 s).
            self._ready()
        return claimed

    def _ready(self) -> bool:
        """The look (one read): remembers when a backoff it saw ends."""
        look = self.store.look(self.config.queues, self.config.capabilities)
        self._next_in = look.next_in
        return look.ready

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
        # Once a poll while busy; while idle, every few of its (backed-off) polls: any
        # worker of the cluster takes a withdrawal, so each needs to look only seldom.
        idle = self._idle_wait > self.config.poll_seconds
        self._next_withdrawal = now + (WITHDRAWAL_IDLE_POLLS * self._idle_wait if idle
                                       else self.config.poll_seconds)
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
        finally:
            self.listener.poke()  # the claim loop looks again (--exit-when-idle: exit)

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
            # A worker holding no lease only shows it is alive: every two heartbeats
            # (IDLE_BEAT_SECONDS at most, unless one heartbeat is longer).
            every = self.config.heartbeat_seconds if states else min(
                2 * self.config.heartbeat_seconds,
                max(self.config.heartbeat_seconds, IDLE_BEAT_SECONDS))
            wait = max(0.0, every - (time.monotonic() - sent_at))
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

