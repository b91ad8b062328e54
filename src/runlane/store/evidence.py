"""Pull-request evidence: the store's half of "a run's push and pull request are never
lost" (docs/reliability.md, "Pull-request evidence").

Two duties, each decided where a run's state is decided, in the transaction that
decides it:

* **Finalize-only attempts.** An attempt ends, the ordinary retry decision would end
  the run FAILED, and the run's ledger holds a push or a pull request that was begun:
  the code host may hold the run's branch or an open pull request nobody recorded.
  Instead of FAILED the run is requeued (``FAILED_RETRYABLE -> QUEUED``, the table's
  own path) for a finalize-only attempt: the worker looks the branch and the pull
  request up by their identities, opens the pull request from the pushed branch if
  it is missing, records both and completes the run; it never runs the agent. Those
  attempts are outside the run's attempt budget (``runs.finalize_only_after``), and
  at most ``MAX_FINALIZE_ONLY_ATTEMPTS`` of them are given.
* **Withdrawal.** A run that ends FAILED, CANCELLED or POLICY_DENIED with a push or a
  pull request in its ledger is due a withdrawal (``runs.close_due_at``): a worker
  closes its open pull request with a comment naming why, and records what it found
  (the pull request, the branch's commit) in the ledger under ``close_pull_request``.
  The run itself never changes again (a terminal state is final); only its ledger
  grows.

* **Late evidence.** A worker paused inside its push or pull-request call (after its
  lease's window was checked) finishes that call when it is resumed, after its lease
  is gone: the code host holds what the ledger refuses to record (``effect_done``
  raises LeaseLost). The worker records it anyway (``record_late_effect``): the
  ledger row keeps its status and token and gains the result under ``late`` (with
  the stale lease's token), the run a ``LATE_EFFECT_RECORDED`` note; nothing about
  the run or its lease changes. A run that already ended without success is due a
  withdrawal again, even after one was done (it may have looked before the late
  call landed); a live run's next attempt finds the pull request by its marker.

``runlane audit`` checks the outcome (``pull_request_evidence_unsettled``) and, with
``--remote-checks``, the code host itself (``services/evidence_audit.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from sqlalchemy import Connection

from runlane.domain.reasons import Reason
from runlane.domain.retry import backoff_delay
from runlane.domain.states import TERMINAL, RunStatus

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from runlane.clock import Clock
    from runlane.domain.retry import RetryPolicy
    from runlane.store.records import Lease, _Snapshot

log = structlog.get_logger("runlane.store")
T = TypeVar("T")
S = RunStatus

# The ledger's keys of a run's publication (the finalizer records the first two).
PUSH_EFFECT = "push_branch"
PULL_REQUEST_EFFECT = "pull_request"
CLOSE_EFFECT = "close_pull_request"
PUBLISH_EFFECTS = (PUSH_EFFECT, PULL_REQUEST_EFFECT)
# A run ending in one of these with a publication in its ledger is due a withdrawal.
ENDED_WITHOUT_SUCCESS = frozenset({S.FAILED, S.CANCELLED, S.POLICY_DENIED})
# How often a worker tries a withdrawal before giving it up (the audit then reports
# the run): the code host refusing for good, or a repository gone.
MAX_WITHDRAWAL_TRIES = 5
# The reasons of note events: an event that changes no status (from = to).
NOTE_REASONS = (Reason.STALE_PUSH_REPLACED, Reason.LATE_EFFECT_RECORDED)

_ENDED = "('FAILED', 'CANCELLED', 'POLICY_DENIED')"
_PUBLISHED = "('push_branch', 'pull_request')"

# The run's publication rows in the ledger, by key (read under the run's lock).
LEDGER_OF_RUN = """
SELECT effect_key, status, result FROM side_effects
WHERE run_id = :run_id AND effect_key IN ('push_branch', 'pull_request', 'close_pull_request')
"""
# Finalize-only attempts of a run that count towards the cap: those numbered above
# ``finalize_only_after``, drained ones left out (the one ending is still unended,
# and counted).
FINALIZE_ATTEMPTS = """
SELECT COUNT(*) FROM attempts
WHERE run_id = :run_id AND attempt_no > :after
  AND (reason_code IS NULL OR reason_code <> 'LEASE_RELEASED')
"""
GRANT_FINALIZE_ONLY = """
UPDATE runs SET finalize_only_after = :attempt_no
WHERE run_id = :run_id AND finalize_only_after IS NULL
"""
FINALIZE_ONLY_AFTER = "SELECT finalize_only_after FROM runs WHERE run_id = :run_id"
# A run that just ended without success: due a withdrawal if its ledger holds a
# publication (one statement; no row changes for a run without one).
SCHEDULE_CLOSE = f"""
UPDATE runs SET close_due_at = {{now}}
WHERE run_id = :run_id AND close_due_at IS NULL
  AND EXISTS (SELECT 1 FROM side_effects s
              WHERE s.run_id = :run_id AND s.effect_key IN {_PUBLISHED})
  AND NOT EXISTS (SELECT 1 FROM side_effects c
                  WHERE c.run_id = :run_id AND c.effect_key = 'close_pull_request'
                    AND c.status = 'DONE')
"""
# Take the withdrawal due first, held for ``:hold`` seconds (its new close_due_at is
# the holder's token: a withdrawal taken over after the hold records nothing).
# ix_runs_close_due serves it; SKIP LOCKED: workers take different runs.
TAKE_CLOSE = f"""
UPDATE runs SET close_due_at = {{now}} + :hold
WHERE run_id = (SELECT r.run_id FROM runs r
                WHERE r.close_due_at <= {{now}} AND r.status IN {_ENDED}
                ORDER BY r.close_due_at LIMIT 1 {{lock_r_skip}})
  AND close_due_at <= {{now}}
RETURNING run_id, task_id, repo, status, reason_code, fencing_token, attempt_count,
          close_due_at
"""
# Whether any is due: a read (no write lock on SQLite) before the take.
WITHDRAWAL_DUE = "SELECT 1 FROM runs WHERE close_due_at <= {now} LIMIT 1"
CLOSE_HELD = """
UPDATE runs SET close_due_at = :next WHERE run_id = :run_id AND close_due_at = :held
"""
CLOSE_ROW = """
INSERT INTO side_effects (run_id, effect_key, status, attempt_no, fencing_token, result,
                          created_at, completed_at)
VALUES (:run_id, 'close_pull_request', 'INTENT', :attempt_no, :token, :result, {now}, NULL)
ON CONFLICT (run_id, effect_key) DO UPDATE SET result = excluded.result
WHERE side_effects.status = 'INTENT'
"""
CLOSE_GET = """
SELECT status, result FROM side_effects
WHERE run_id = :run_id AND effect_key = 'close_pull_request'
"""
CLOSE_RESULT = """
UPDATE side_effects SET result = :result
WHERE run_id = :run_id AND effect_key = 'close_pull_request' AND status = 'INTENT'
"""
CLOSE_DONE = """
UPDATE side_effects SET status = 'DONE', result = :result, completed_at = {now}
WHERE run_id = :run_id AND effect_key = 'close_pull_request' AND status = 'INTENT'
"""
# The runs ``runlane audit --remote-checks`` asks the code host about: ended without
# success with a publication in the ledger, newest first (ix_runs_status_updated).
EVIDENCE_RUNS = f"""
SELECT r.run_id, r.task_id, r.repo, r.status, r.close_due_at, r.updated_at
FROM runs r
WHERE r.status IN {_ENDED}
  AND EXISTS (SELECT 1 FROM side_effects s
              WHERE s.run_id = r.run_id AND s.effect_key IN {_PUBLISHED})
ORDER BY r.updated_at DESC
LIMIT :limit
"""
EVIDENCE_LEDGER = """
SELECT run_id, effect_key, status, result FROM side_effects
WHERE run_id IN :run_ids
  AND effect_key IN ('push_branch', 'pull_request', 'close_pull_request')
"""
# An effect's row, read under its run's lock (the caller's snapshot): a late result
# is added to it.
EFFECT_ROW = """
SELECT status, fencing_token, result FROM side_effects
WHERE run_id = :run_id AND effect_key = :effect_key
"""
# The late result, on the row as it was read (status and token unchanged: a live
# lease's intent and its ``effect_done`` are not disturbed).
LATE_RESULT = """
UPDATE side_effects SET result = :result
WHERE run_id = :run_id AND effect_key = :effect_key AND status = :status
  AND fencing_token = :token
"""
# A run that ended without success is due a withdrawal again (late evidence): now,
# whatever it was (a holder's token is void: its record is refused), and its recorded
# withdrawal, if any, is open again with fresh tries.
REOPEN_CLOSE = f"""
UPDATE runs SET close_due_at = :now WHERE run_id = :run_id AND status IN {_ENDED}
"""
REOPEN_CLOSE_ROW = """
UPDATE side_effects SET status = 'INTENT', result = :result, completed_at = NULL
WHERE run_id = :run_id AND effect_key = 'close_pull_request'
"""
# A note on a run: an event from its status to the same status (no transition),
# written only while the lease that writes it is live (the caller's snapshot), except
# the note of a late effect, which reports what a lost lease did.
NOTE_EVENT = """
INSERT INTO run_events (run_id, attempt_no, at, actor, from_status, to_status, reason_code,
                        fencing_token, message)
VALUES (:run_id, :attempt_no, :now, :actor, :status, :status, :reason_code, :token, :message)
"""


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _late_message(lease: Lease, key: str, result: dict[str, Any], status: RunStatus,
                  reopened: bool) -> str:
    """The note's words: what the stale lease did, and what becomes of it."""
    found = bool(result.get("adopted"))
    if key == PULL_REQUEST_EFFECT:
        what = (f"{'found' if found else 'opened'} pull request #{result.get('number')} "
                f"({result.get('url')})")
    elif key == PUSH_EFFECT:
        what = f"{'found' if found else 'pushed'} {result.get('sha')} on {result.get('branch')}"
    else:
        what = f"performed effect {key}"
    if reopened:
        then = "its withdrawal is due again (it closes the pull request, records the branch)"
    elif status not in TERMINAL and key in PUBLISH_EFFECTS:
        then = "the run's live attempt looks it up by its marker before it acts"
    else:
        then = "nothing to withdraw"
    return (f"attempt {lease.attempt_no} {what} after its lease (token "
            f"{lease.fencing_token}) was lost, finishing a call it had begun; recorded "
            f"late, the run is {status.value}: {then}")


@dataclass(frozen=True)
class Ledger:
    """A run's publication as its ledger holds it: each key's status and result."""

    rows: dict[str, tuple[str, dict[str, Any] | None]]

    def status(self, key: str) -> str | None:
        row = self.rows.get(key)
        return row[0] if row else None

    def result(self, key: str) -> dict[str, Any] | None:
        row = self.rows.get(key)
        return row[1] if row else None

    @property
    def begun(self) -> bool:
        """A push or a pull request was begun (INTENT) or done."""
        return any(key in self.rows for key in PUBLISH_EFFECTS)

    @property
    def recorded_pull_request(self) -> dict[str, Any] | None:
        if self.status(PULL_REQUEST_EFFECT) != "DONE":
            return None
        return self.result(PULL_REQUEST_EFFECT) or {}


@dataclass(frozen=True)
class Withdrawal:
    """A run due a withdrawal, as a worker took it (``held`` is its token)."""

    run_id: str
    task_id: str
    repo: str
    status: str
    reason_code: str | None
    held: float
    tries: int


class EvidenceMixin:
    """``Store`` inherits this: the ledger reads and writes of pull-request evidence."""

    if TYPE_CHECKING:
        reads: Engine
        clock: Clock
        rng: Any
        retry_policy: RetryPolicy

        def _q(self, statement: str, *expanding: str) -> Any: ...
        def _snapshot(self, conn: Connection, run_id: str, token: int, *,
                      lock: bool = True) -> _Snapshot | None: ...
        def _transaction(self, work: Callable[[Connection], T], *,
                         autocommit: bool = False) -> T: ...

    # --- inside the store's transactions ------------------------------------------------

    def _ledger(self, conn: Connection, run_id: str) -> Ledger:
        rows = conn.execute(self._q(LEDGER_OF_RUN), {"run_id": run_id}).all()
        return Ledger({r.effect_key: (r.status, _json(r.result)) for r in rows})

    def _finalize_attempts(self, conn: Connection, run_id: str, after: int) -> int:
        return int(conn.execute(self._q(FINALIZE_ATTEMPTS),
                                {"run_id": run_id, "after": after}).scalar_one())

    def _grant_finalize_only(self, conn: Connection, run_id: str, attempt_no: int) -> None:
        conn.execute(self._q(GRANT_FINALIZE_ONLY), {"run_id": run_id, "attempt_no": attempt_no})

    def _schedule_close(self, conn: Connection, run_id: str, now: float | None) -> None:
        """Called on every status write that ends a run without success."""
        if conn.execute(self._q(SCHEDULE_CLOSE), {"run_id": run_id, "now": now}).rowcount:
            log.info("withdrawal_due", run_id=run_id)

    def _note(self, conn: Connection, *, run_id: str, status: RunStatus, attempt_no: int,
              token: int, actor: str, now: float, reason_code: str, message: str) -> None:
        conn.execute(self._q(NOTE_EVENT), {
            "run_id": run_id, "attempt_no": attempt_no, "now": now, "actor": actor,
            "status": status.value, "reason_code": reason_code, "token": token,
            "message": message})

    # --- public ---------------------------------------------------------------------------

    def record_late_effect(self, lease: Lease, key: str, result: dict[str, Any]) -> bool:
        """An effect this lease performed after it was lost (``effect_done`` refused):
        its result on the ledger row under ``late`` (a list: attempt, stale token,
        worker, time, result), a ``LATE_EFFECT_RECORDED`` note on the run, and, when the
        run already ended without success and the effect is a push or a pull request,
        the run due a withdrawal again. The row's status and token and the run's state
        are left alone: a live attempt's own intent and record go on as before (its
        finalizer finds the pull request by its marker). One transaction under the
        run's lock, so a withdrawal cannot end between the look and the reopening.
        False when there is nothing to record it on (the run or its row pruned)."""
        def work(conn: Connection) -> tuple[str, bool] | None:
            snap = self._snapshot(conn, lease.run_id, lease.fencing_token)
            row = conn.execute(self._q(EFFECT_ROW), {"run_id": lease.run_id,
                                                     "effect_key": key}).first()
            if snap is None or row is None:
                return None
            before = _json(row.result)
            entry = {"attempt_no": lease.attempt_no, "fencing_token": lease.fencing_token,
                     "worker_id": lease.worker_id, "at": snap.now, "result": result}
            kept = dict(before) if isinstance(before, dict) else {}
            kept["late"] = [*(kept.get("late") or []), entry]
            conn.execute(self._q(LATE_RESULT), {
                "run_id": lease.run_id, "effect_key": key, "status": row.status,
                "token": row.fencing_token, "result": json.dumps(kept)})
            reopen = snap.status in ENDED_WITHOUT_SUCCESS and key in PUBLISH_EFFECTS
            if reopen:
                conn.execute(self._q(REOPEN_CLOSE), {"run_id": lease.run_id,
                                                     "now": snap.now})
                close = conn.execute(self._q(CLOSE_GET), {"run_id": lease.run_id}).first()
                if close is not None:
                    conn.execute(self._q(REOPEN_CLOSE_ROW), {
                        "run_id": lease.run_id, "result": json.dumps({
                            "tries": 0, "reopened": {"by": key,
                                                     "fencing_token": lease.fencing_token,
                                                     "before": _json(close.result)}})})
            self._note(conn, run_id=lease.run_id, status=snap.status,
                       attempt_no=lease.attempt_no, token=lease.fencing_token,
                       actor=lease.worker_id, now=snap.now,
                       reason_code=Reason.LATE_EFFECT_RECORDED,
                       message=_late_message(lease, key, result, snap.status, reopen))
            return snap.status.value, reopen

        done = self._transaction(work)
        if done is None:
            log.warning("late_effect_not_recorded", run_id=lease.run_id, effect=key,
                        fencing_token=lease.fencing_token, result=result)
            return False
        log.warning("late_effect_recorded", run_id=lease.run_id, attempt_id=lease.attempt_id,
                    fencing_token=lease.fencing_token, worker_id=lease.worker_id, effect=key,
                    result=result, run_status=done[0], withdrawal_due=done[1])
        return True

    def finalize_only_after(self, run_id: str) -> int | None:
        """The attempt number above which the run's attempts are finalize-only (a
        worker asks at the start of each attempt), None when none was granted."""
        with self.reads.connect() as conn:  # a read: no write lock on SQLite
            value = conn.execute(self._q(FINALIZE_ONLY_AFTER), {"run_id": run_id}).scalar()
        return None if value is None else int(value)

    def take_withdrawal(self, worker_id: str, *, hold_seconds: float) -> Withdrawal | None:
        """The run due a withdrawal first, held by this worker for ``hold_seconds``
        (another may take it over after that), with its tries counted; None when none
        is due."""
        if not self.withdrawal_due():  # the common case: a read, no write lock
            return None

        def work(conn: Connection) -> Withdrawal | None:
            row = conn.execute(self._q(TAKE_CLOSE), {"now": self.clock.now(),
                                                     "hold": hold_seconds}).first()
            if row is None:
                return None
            recorded = conn.execute(self._q(CLOSE_GET), {"run_id": row.run_id}).first()
            before = _json(recorded.result) if recorded is not None else None
            tries = int((before or {}).get("tries", 0)) + 1
            conn.execute(self._q(CLOSE_ROW), {
                "run_id": row.run_id, "attempt_no": row.attempt_count,
                "token": row.fencing_token, "now": self.clock.now(),
                "result": json.dumps({**(before or {}), "tries": tries,
                                      "taken_by": worker_id})})
            return Withdrawal(run_id=row.run_id, task_id=row.task_id, repo=row.repo,
                              status=row.status, reason_code=row.reason_code,
                              held=float(row.close_due_at), tries=tries)

        return self._transaction(work)

    def withdrawal_done(self, withdrawal: Withdrawal, result: dict[str, Any]) -> bool:
        """Record a withdrawal's result (DONE) and clear the run's due time; False, and
        nothing written, when another worker took it over meanwhile."""
        def work(conn: Connection) -> bool:
            held = conn.execute(self._q(CLOSE_HELD), {
                "run_id": withdrawal.run_id, "held": withdrawal.held, "next": None}).rowcount
            if held != 1:
                return False
            conn.execute(self._q(CLOSE_DONE), {
                "run_id": withdrawal.run_id, "now": self.clock.now(),
                "result": json.dumps({**result, "tries": withdrawal.tries})})
            return True

        done = self._transaction(work)
        if done:
            log.info("withdrawal_done", run_id=withdrawal.run_id, result=result)
        return done

    def withdrawal_failed(self, withdrawal: Withdrawal, error: str,
                          retry_after: float | None = None) -> bool:
        """A withdrawal that failed: due again after a backoff, or given up after
        ``MAX_WITHDRAWAL_TRIES`` (the ledger keeps the error; the audit reports the
        run). True when given up."""
        gave_up = withdrawal.tries >= MAX_WITHDRAWAL_TRIES

        def work(conn: Connection) -> None:
            now = float(conn.execute(self._q("SELECT {now} AS now"),
                                     {"now": self.clock.now()}).scalar_one())
            delay = backoff_delay(withdrawal.tries, self.retry_policy.base_seconds,
                                  self.retry_policy.max_seconds, self.rng)
            if retry_after is not None:
                delay = max(delay, retry_after)
            held = conn.execute(self._q(CLOSE_HELD), {
                "run_id": withdrawal.run_id, "held": withdrawal.held,
                "next": None if gave_up else now + delay}).rowcount
            if held != 1:
                return  # taken over: the new holder records its own outcome
            conn.execute(self._q(CLOSE_RESULT), {
                "run_id": withdrawal.run_id,
                "result": json.dumps({"tries": withdrawal.tries, "error": error[:2000],
                                      "gave_up": gave_up})})

        self._transaction(work)
        (log.error if gave_up else log.warning)(
            "withdrawal_failed", run_id=withdrawal.run_id, tries=withdrawal.tries,
            gave_up=gave_up, error=error)
        return gave_up

    def withdrawal_due(self) -> bool:
        """Whether a withdrawal is due now (a worker with ``--exit-when-idle`` takes it
        before it exits; one waiting out a backoff does not keep it)."""
        with self.reads.connect() as conn:
            return conn.execute(self._q(WITHDRAWAL_DUE),
                                {"now": self.clock.now()}).first() is not None

    def evidence_runs(self, *, limit: int) -> list[dict[str, Any]]:
        """The runs that ended without success with a publication in their ledger,
        newest first, each with its ledger rows (``ledger``: key -> (status, result))."""
        def work(conn: Connection) -> list[dict[str, Any]]:
            found = [dict(r._mapping) for r in conn.execute(self._q(EVIDENCE_RUNS),
                                                             {"limit": limit})]
            if not found:
                return []
            ledger: dict[str, dict[str, tuple[str, Any]]] = {r["run_id"]: {} for r in found}
            for row in conn.execute(self._q(EVIDENCE_LEDGER, "run_ids"),
                                    {"run_ids": sorted(ledger)}):
                ledger[row.run_id][row.effect_key] = (row.status, _json(row.result))
            for run in found:
                run["ledger"] = Ledger(ledger[run["run_id"]])
            return found

        # A read (no write lock on SQLite): a run that ended stays ended, and its ledger
        # read a moment later holds at least what the first statement saw.
        with self.reads.connect() as conn:
            return work(conn)
