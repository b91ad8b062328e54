"""Withdrawals: the pull request of a run that ended without success is closed, with a
comment naming why, and what the code host holds is recorded in the ledger.

A run ends FAILED, CANCELLED or POLICY_DENIED with a push or a pull request in its
ledger (a cancel that landed while its pull request was being opened, a worker that
died after the code host created it, finalize-only attempts that all failed): the
store marks it due (``runs.close_due_at``, store/evidence.py) in the transaction
that ends it. Any worker takes due withdrawals between claims, one at a time: it
looks the pull request up by the run's marker, comments (unless its comment is
already there) and closes it if it is open, reads the branch's commit, and records
all of it under ``close_pull_request``. A failure is tried again after a backoff, up
to ``MAX_WITHDRAWAL_TRIES``; then it is given up, and ``runlane audit`` reports the
run. The branch itself is kept: it is the run's evidence (a closed pull request
still shows it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from runlane.codehost.base import (
    CodeHost,
    CodeHostError,
    branch_name,
    pr_marker,
    withdrawal_marker,
)
from runlane.codehost.factory import clone_source
from runlane.store.evidence import Withdrawal
from runlane.store.store import Store
from runlane.workspace import PushFailed, remote_branch_sha

log = structlog.get_logger("runlane.worker")

# How long a taken withdrawal is this worker's: past it another worker may take it
# over (its record then wins; this one's is refused).
HOLD_SECONDS = 120.0
# The git look at the run's branch.
LS_REMOTE_TIMEOUT_SECONDS = 60.0
# Withdrawals one pass takes at most, so that a backlog never starves claims.
PER_PASS = 10

_WHY = {"CANCELLED": "was cancelled", "POLICY_DENIED": "was denied by the scheduling policy",
        "FAILED": "failed"}


def comment_for(w: Withdrawal) -> str:
    """The comment on a pull request runlane closes: why, and the run's marker."""
    why = _WHY.get(w.status, f"ended {w.status}")
    reason = f" ({w.reason_code})" if w.reason_code else ""
    return (f"runlane closed this pull request: run `{w.run_id}` of task `{w.task_id}` "
            f"{why}{reason} before it could record this pull request as its result. "
            f"The branch is kept.\n\n{withdrawal_marker(w.run_id)}\n")


def withdraw(w: Withdrawal, code_host_for: Callable[[str], CodeHost]) -> dict[str, Any]:
    """Close the run's pull request if it is open (comment first, once) and read its
    branch; the ledger's record of what was found. Raises CodeHostError or PushFailed."""
    branch = branch_name(w.task_id, w.run_id)
    host = code_host_for(w.repo)
    try:
        pr = host.find_pull_request(w.repo, branch, pr_marker(w.run_id))
        closed = commented = False
        if pr is not None and pr.state == "open":
            # The comment before the close: a withdrawal that dies in between finds the
            # pull request still open, and its comment already there.
            commented = host.comment_on_pull_request(w.repo, pr.number, comment_for(w),
                                                     marker=withdrawal_marker(w.run_id))
            pr = host.close_pull_request(w.repo, pr.number)
            closed = True
    finally:
        close = getattr(host, "close", None)
        if callable(close):
            close()
    sha = remote_branch_sha(clone_source(w.repo), branch, timeout=LS_REMOTE_TIMEOUT_SECONDS)
    return {"branch": branch, "branch_sha": sha,
            "pull_request": None if pr is None else {
                "number": pr.number, "url": pr.url, "state": pr.state},
            "closed": closed, "commented": commented, "run_status": w.status,
            "reason_code": w.reason_code}


class Withdrawer:
    """Takes the withdrawals due, one after another, for one worker."""

    def __init__(self, store: Store, code_host_for: Callable[[str], CodeHost],
                 worker_id: str) -> None:
        self.store = store
        self.code_host_for = code_host_for
        self.worker_id = worker_id

    def run_once(self) -> int:
        """Withdrawals taken in this pass (done or failed), at most ``PER_PASS``."""
        taken = 0
        while taken < PER_PASS:
            w = self.store.take_withdrawal(self.worker_id, hold_seconds=HOLD_SECONDS)
            if w is None:
                break
            taken += 1
            try:
                result = withdraw(w, self.code_host_for)
            except (CodeHostError, PushFailed) as exc:
                self.store.withdrawal_failed(w, str(exc), getattr(exc, "retry_after", None))
            except Exception as exc:  # a bug: the run is tried again, then given up
                log.exception("withdrawal_crashed", run_id=w.run_id)
                self.store.withdrawal_failed(w, f"{type(exc).__name__}: {exc}")
            else:
                self.store.withdrawal_done(w, result)
        return taken
