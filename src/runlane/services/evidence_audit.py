"""``runlane audit --remote-checks``: what the code host holds for runs that ended
without success, against what their ledger recorded.

The database's own audit can tell that such a run's withdrawal is due or recorded
(``pull_request_evidence_unsettled``); only the code host can tell whether a pull
request is open there or a branch holds a commit nobody recorded. So this asks it,
for the runs that can have one at all: those that ended FAILED, CANCELLED or
POLICY_DENIED with a push or a pull request in their ledger (newest first, at most
``limit``; every other run is never looked at, so the check stays bounded on a large
database). A run whose withdrawal is still due is skipped: a worker is about to
close what it left.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runlane.codehost.base import CodeHost, CodeHostError, branch_name, pr_marker
from runlane.codehost.factory import clone_source
from runlane.store.evidence import CLOSE_EFFECT, PULL_REQUEST_EFFECT, PUSH_EFFECT, Ledger
from runlane.store.records import Violation
from runlane.store.store import Store
from runlane.workspace import PushFailed, remote_branch_sha

CHECK = "unrecorded_pull_request_evidence"
UNREACHABLE = "remote_check_failed"
DEFAULT_LIMIT = 1000
LS_REMOTE_TIMEOUT_SECONDS = 60.0


@dataclass
class RemoteAudit:
    """What one pass found: violations, and how many runs it looked at or skipped."""

    violations: list[Violation] = field(default_factory=list)
    checked: int = 0
    skipped_due: int = 0


def _recorded(ledger: Ledger) -> tuple[set[int], set[str]]:
    """The pull request numbers and branch commits the ledger records as done."""
    numbers: set[int] = set()
    shas: set[str] = set()
    if ledger.status(PULL_REQUEST_EFFECT) == "DONE":
        number = (ledger.result(PULL_REQUEST_EFFECT) or {}).get("number")
        if number is not None:
            numbers.add(int(number))
    if ledger.status(PUSH_EFFECT) == "DONE":
        sha = (ledger.result(PUSH_EFFECT) or {}).get("sha")
        if sha:
            shas.add(str(sha))
    if ledger.status(CLOSE_EFFECT) == "DONE":
        close = ledger.result(CLOSE_EFFECT) or {}
        pr = close.get("pull_request") or {}
        if pr.get("number") is not None:
            numbers.add(int(pr["number"]))
        if close.get("branch_sha"):
            shas.add(str(close["branch_sha"]))
    return numbers, shas


def check_run(run: dict[str, Any], host: CodeHost, *,
              ls_remote_timeout: float = LS_REMOTE_TIMEOUT_SECONDS) -> list[Violation]:
    """The code host's side of one run (``Store.evidence_runs`` gives ``run``)."""
    run_id, status, repo = str(run["run_id"]), str(run["status"]), str(run["repo"])
    branch = branch_name(str(run["task_id"]), run_id)
    numbers, shas = _recorded(run["ledger"])
    pr = host.find_pull_request(repo, branch, pr_marker(run_id))
    sha = remote_branch_sha(clone_source(repo), branch, timeout=ls_remote_timeout)
    found: list[Violation] = []
    if pr is not None and pr.state == "open":
        found.append(Violation(CHECK, run_id, f"ended {status}, and its pull request "
                                              f"#{pr.number} is open ({pr.url})"))
    elif pr is not None and pr.number not in numbers:
        found.append(Violation(CHECK, run_id, f"ended {status}; its pull request #{pr.number} "
                                              f"({pr.state}) is not recorded in the ledger"))
    if sha is not None and sha not in shas:
        found.append(Violation(CHECK, run_id, f"ended {status}; branch {branch} holds {sha}, "
                                              "a commit the ledger does not record"))
    return found


def remote_audit(store: Store, code_host_for: Callable[[str], CodeHost], *,
                 limit: int = DEFAULT_LIMIT) -> RemoteAudit:
    """Ask the code host about each run that may have left evidence there."""
    audit = RemoteAudit()
    for run in store.evidence_runs(limit=limit):
        if run["close_due_at"] is not None:
            audit.skipped_due += 1
            continue
        audit.checked += 1
        host: CodeHost | None = None
        try:
            host = code_host_for(str(run["repo"]))
            audit.violations.extend(check_run(run, host))
        except (CodeHostError, PushFailed) as exc:
            audit.violations.append(Violation(
                UNREACHABLE, str(run["run_id"]),
                f"ended {run['status']}; its code host could not be asked: {exc}"))
        finally:
            close = getattr(host, "close", None)
            if callable(close):
                close()
    return audit
