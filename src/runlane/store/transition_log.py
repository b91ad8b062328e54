"""The INFO lines of run transitions: ``run_claimed`` and ``run_transition``, one per hop,
each with the ids of the run's chain (docs/tracing.md, "Logs").

A hop is noted in the transaction that makes it (``note``: a tuple in ``conn.info``)
and logged only once that transaction committed (``Store._transaction``): a move rolled
back (a submit decided again, a retried transaction) is never announced. Every line
has the same fields, ``None`` where a move concerns no lease (a queued run admitted or
cancelled): run_id, task_id, queue, worker_id, lease_id, fencing_token, attempt_no,
then from_status, to_status, reason_code and the actor that moved it. runlane keeps a
lease in its attempt's row, one lease per attempt: ``lease_id`` is the attempt's id
(``{run_id}/{attempt_no}``), ``fencing_token`` the lease's token.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import Connection

from runlane.domain.states import RunStatus
from runlane.logs import enabled_for

if TYPE_CHECKING:
    from runlane.store.records import Lease

log = structlog.get_logger("runlane.store")

MOVES = "runlane_moves"  # conn.info key: the hops of the transaction, in order
Move = tuple[str, str | None, str | None, RunStatus, Sequence[RunStatus], int | None,
             int | None, str | None, str, str | None]


def note(conn: Connection, run_id: str, task_id: str | None, queue: str | None,
         source: RunStatus, path: Sequence[RunStatus], *, token: int | None,
         attempt_no: int | None, worker_id: str | None, actor: str,
         reason_code: str | None) -> None:
    """Keep one status move (its hops) to log after the commit."""
    conn.info.setdefault(MOVES, []).append(
        (run_id, task_id, queue, source, path, token, attempt_no, worker_id, actor,
         reason_code))


def log_moves(moves: Iterable[Move]) -> None:
    if not enabled_for(logging.INFO, log):
        return
    for (run_id, task_id, queue, source, path, token, attempt_no, worker_id, actor,
         reason_code) in moves:
        leased = attempt_no is not None
        for a, b in itertools.pairwise([source, *path]):
            log.info("run_transition", **_ids(
                run_id, task_id, queue, worker_id, attempt_no, token if leased else None),
                from_status=a.value, to_status=b.value, reason_code=reason_code, actor=actor)


def log_claimed(leases: Sequence[Lease]) -> None:
    """``run_claimed``, the seed's line, for each lease of a claim (committed)."""
    if not leases or not enabled_for(logging.INFO, log):
        return
    for lease in leases:
        log.info("run_claimed", **_ids(lease.run_id, lease.task_id, lease.queue,
                                       lease.worker_id, lease.attempt_no,
                                       lease.fencing_token),
                 lease_expires_at=lease.expires_at)


def log_completed(moves: Sequence[tuple[Lease, RunStatus, Sequence[RunStatus]]]) -> None:
    """The hops of a batched completion (``Store.complete_many``, set-based: not
    through ``note``): (lease, its stage before, its path)."""
    log_moves((lease.run_id, lease.task_id, lease.queue, stage, path, lease.fencing_token,
               lease.attempt_no, lease.worker_id, lease.worker_id, None)
              for lease, stage, path in moves)


def _ids(run_id: str, task_id: str | None, queue: str | None, worker_id: str | None,
         attempt_no: int | None, token: int | None) -> dict[str, Any]:
    return {"run_id": run_id, "task_id": task_id, "queue": queue, "worker_id": worker_id,
            "lease_id": f"{run_id}/{attempt_no}" if attempt_no is not None else None,
            "fencing_token": token, "attempt_no": attempt_no}
