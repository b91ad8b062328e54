"""The finalizer: the door to SUCCEEDED (``Store._end_attempt`` only completes a run
whose pull request the finalizer recorded, when its attempt ends otherwise).

It re-checks the lease and cancellation, commits every change on the run's own
branch with the run's trailer, and performs the two external effects (push,
pull request) through the side-effect ledger, each looked up by its marker first.

The stale window (a worker paused between its lease check and its push) is closed
twice over:

* right before each push and each pull-request call the lease is checked in the
  database and against the local deadline (``LeaseWindow``), and the call's timeout
  is what the lease has left, taken again right before it starts: a worker paused
  in between makes no call, and no call outlives the lease;
* a commit found on the run's branch is adopted only when it is this attempt's own
  or, for an attempt that only finishes an earlier one's work, the one the ledger's
  push intent recorded (the intent names the commit before the push). The push is
  conditional on what was seen there (``--force-with-lease``, "absent" included), so
  a stale push and a fresh one never overwrite each other unseen; a stale commit is
  replaced, never adopted, and reported (``STALE_PUSH_REPLACED``, ``stale_push_replaced``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import structlog

from runlane.codehost.base import (
    CodeHost,
    CodeHostError,
    PullRequest,
    PullRequestExists,
    branch_name,
    pr_marker,
)
from runlane.domain.reasons import Reason
from runlane.domain.states import RunStatus
from runlane.faults import crash_point, pause_point
from runlane.observability import tracing
from runlane.store.evidence import PULL_REQUEST_EFFECT
from runlane.store.evidence import PUSH_EFFECT as PUSH_EFFECT  # tests import it from here
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.worker.effects import LeaseWindow, perform_effect
from runlane.workspace import PushFailed, Workspace

log = structlog.get_logger("runlane.worker")
# Pushes of one publication at most: a push rejected because another commit landed on
# the run's branch since the look is made again over that commit, a bounded number of
# times (each behind a fresh lease check).
PUSH_TRIES = 3


class NothingToFinalize(PushFailed):
    """An attempt with no work of its own (a finalize-only attempt, or one resuming an
    earlier attempt's push) found no commit on the run's branch that it may adopt."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)


def trailer(run_id: str) -> str:
    return f"Agent-Run-ID: {run_id}"


# GitHub refuses a pull request body over 65,536 characters (422 "body is too long").
MAX_PR_BODY_CHARS = 65536


def pr_body(task: dict[str, Any], run_id: str, attempt_no: int,
            campaign: str | None = None) -> str:
    """The task's prompt, then runlane's footer with the run's marker (and the campaign
    the run is part of), always last and whole: a prompt too long for the body is cut,
    with a note saying so."""
    part_of = f" as part of campaign `{campaign}`" if campaign else ""
    footer = (f"\n\nOpened by runlane for task `{task['task_id']}`, "
              f"run `{run_id}` (attempt {attempt_no}){part_of}.\n\n{pr_marker(run_id)}\n")
    prompt = str(task["prompt"])
    room = MAX_PR_BODY_CHARS - len(footer)
    if len(prompt) > room:
        note = (f"\n\n[runlane: the prompt is cut here; {len(prompt):,} characters in all, "
                f"the first {{shown:,}} shown]")
        shown = max(0, room - len(note.format(shown=room)))
        prompt = prompt[:shown] + note.format(shown=shown)
    return prompt + footer


def pr_title(task: dict[str, Any]) -> str:
    first = task["prompt"].strip().splitlines()[0] if task["prompt"].strip() else "agent run"
    return first if len(first) <= 72 else first[:69] + "..."


class Finalizer:
    def __init__(self, store: Store, code_host_for: Callable[[str], CodeHost]) -> None:
        self.store = store
        self.code_host_for = code_host_for

    def already_pushed(self, lease: Lease, workspace: Workspace, window: LeaseWindow) -> bool:
        """True when an earlier attempt of this run got as far as pushing its branch:
        recorded, or found on the remote after a crash before the record, as the very
        commit its push intent named (any other commit there is not adopted)."""
        effects = {e.effect_key: e for e in self.store.side_effects(lease.run_id)}
        push = effects.get(PUSH_EFFECT)
        if push is None:
            return False
        if push.status == "DONE":
            return True
        recorded = (push.result or {}).get("sha")
        if not recorded:
            return False
        found = workspace.remote_branch_sha(branch_name(lease.task_id, lease.run_id),
                                            timeout=window.time_left(window.open_window()))
        return bool(found == recorded)

    def resume(self, lease: Lease, workspace: Workspace, task: dict[str, Any],
               window: LeaseWindow) -> str:
        """Finish what an earlier attempt started: adopt its pushed branch and open (or
        adopt) its pull request, without running the agent again (a finalize-only
        attempt does only this). A retry must not end ``no_changes`` or FAILED while the
        run's branch and pull request exist. Raises NothingToFinalize when the branch
        holds no commit the ledger recorded."""
        if lease.stage is not RunStatus.FINALIZING:
            self.store.advance(lease, RunStatus.FINALIZING)
        self.store.check_lease(lease)
        return self._publish(lease, workspace, task, window, sha=None)

    def finalize(self, lease: Lease, workspace: Workspace, task: dict[str, Any],
                 window: LeaseWindow) -> str:
        """Returns the run's outcome: ``no_changes`` or ``pull_request``."""
        if lease.stage is not RunStatus.FINALIZING:
            self.store.advance(lease, RunStatus.FINALIZING)
        if not workspace.has_changes():
            self.store.complete(lease, outcome="no_changes")
            return "no_changes"
        self.store.check_lease(lease)  # cancellation and lease, before the first effect
        branch = branch_name(lease.task_id, lease.run_id)
        sha = workspace.commit_all(branch, pr_title(task), trailer(lease.run_id))
        return self._publish(lease, workspace, task, window, sha=sha)

    def _publish(self, lease: Lease, workspace: Workspace, task: dict[str, Any],
                 window: LeaseWindow, sha: str | None) -> str:
        """``sha``: this attempt's own commit; None when it only finishes an earlier
        attempt's push (it may adopt only the commit that push's intent recorded)."""
        branch = branch_name(lease.task_id, lease.run_id)
        push_row = {e.effect_key: e for e in self.store.side_effects(lease.run_id)}.get(
            PUSH_EFFECT)
        recorded = (push_row.result or {}).get("sha") if push_row is not None else None
        own = sha if sha is not None else recorded  # the one commit this attempt adopts
        deadline = [window.open_window()]
        seen: list[str | None] = [None]  # the branch's commit at the last look, not ours

        def look() -> str | None:
            return workspace.remote_branch_sha(branch, timeout=window.time_left(deadline[0]))

        def remote_branch() -> dict[str, Any] | None:
            found = look()
            if found is not None and found == own:
                return {"branch": branch, "sha": found}
            seen[0] = found
            return None

        def push() -> dict[str, Any]:
            if sha is None:  # no work of its own: nothing it may push
                raise NothingToFinalize(
                    f"branch {branch} holds {seen[0] or 'nothing'}, not the commit "
                    f"{recorded or '(none recorded)'} the run's push intent recorded")
            for _ in range(PUSH_TRIES):
                expected = seen[0]
                stale = expected is not None and self._carries_trailer(
                    workspace, expected, lease, window, deadline[0])
                deadline[0] = window.open_window()  # the lease, right before the push
                crash_point("before_push")  # the intent names the commit; nothing pushed
                pause_point("before_push")
                try:
                    workspace.push(branch, expected=expected,
                                   timeout=window.time_left(deadline[0]))
                except PushFailed:
                    # Rejected (a commit landed on the branch since the look: a push
                    # that outlived its lease, or the agent's) or timed out after it
                    # landed: look again. Ours: adopted; another: replaced next round.
                    try:
                        found = look()
                    except PushFailed:
                        found = expected  # the remote cannot be read either: the push's error
                    if found == sha:
                        return {"branch": branch, "sha": sha, "adopted": True}
                    if found == expected:
                        raise
                    seen[0] = found
                    continue
                if expected is not None:
                    self._replaced(lease, branch, expected, sha, stale)
                    return {"branch": branch, "sha": sha, "replaced": expected}
                return {"branch": branch, "sha": sha}
            raise PushFailed(f"branch {branch} changed under each of {PUSH_TRIES} pushes",
                             transient=True)

        with tracing.stage("runlane.push", {"runlane.branch": branch}) as span:
            pushed = perform_effect(self.store, lease, PUSH_EFFECT, find=remote_branch,
                                    do=push, intent={"sha": sha} if sha is not None else None,
                                    check=lambda: None)  # push() checks the lease before it
            span.set_attributes(_effect_attributes(pushed))

        host = self.code_host_for(task["repo"])
        set_deadline = getattr(host, "set_deadline", None)
        marker = pr_marker(lease.run_id)

        def bound(when: float) -> None:
            if callable(set_deadline):
                set_deadline(when)  # no code-host call outlives the lease

        def existing_pr() -> dict[str, Any] | None:
            bound(deadline[0])
            found = host.find_pull_request(task["repo"], branch, marker)
            return _pr(found) if found else None

        def open_pr() -> dict[str, Any]:
            deadline[0] = window.open_window()  # the lease, right before the call
            pause_point("before_pull_request")
            window.time_left(deadline[0])
            bound(deadline[0])
            try:
                return _pr(host.open_pull_request(
                    task["repo"], head_branch=branch, base_branch=workspace.base_branch(),
                    title=pr_title(task), body=pr_body(
                        task, lease.run_id, lease.attempt_no,
                        campaign=self.store.campaign_of_run(lease.run_id))))
            except PullRequestExists:
                found = host.find_pull_request(task["repo"], branch, marker)
                if found is None:
                    raise
                return _pr(found)
            except CodeHostError as exc:
                if not exc.transient:
                    raise
                # A timeout or a 5xx leaves it open whether the host created the pull
                # request: the marker says (a lookup that fails too changes nothing).
                try:
                    found = host.find_pull_request(task["repo"], branch, marker)
                except CodeHostError:
                    found = None
                if found is None:
                    raise
                return {**_pr(found), "adopted": True}

        try:
            with tracing.stage("runlane.pull_request") as span:
                opened = perform_effect(self.store, lease, PULL_REQUEST_EFFECT,
                                        find=existing_pr, do=open_pr,
                                        check=lambda: None)  # open_pr() checks it
                span.set_attributes(_effect_attributes(opened))
        finally:
            close = getattr(host, "close", None)
            if callable(close):
                close()  # an HTTP client holds a connection pool
        self.store.complete(lease, outcome="pull_request")
        return "pull_request"

    @staticmethod
    def _carries_trailer(workspace: Workspace, sha: str, lease: Lease, window: LeaseWindow,
                         deadline: float) -> bool:
        """Whether the commit on the run's branch is runlane's for this run (a stale
        push) rather than the agent's own push; unknown (not fetchable) counts as
        runlane's, so that a replacement is reported rather than missed."""
        try:
            return workspace.remote_commit_carries(sha, trailer(lease.run_id),
                                                   timeout=window.time_left(deadline))
        except PushFailed:
            return True

    def _replaced(self, lease: Lease, branch: str, old: str, new: str, stale: bool) -> None:
        """Report a commit this attempt's push replaced on the run's branch: a log line
        always; a note on the run when it was runlane's own (a push that outlived its
        lease), which is never adopted."""
        if not stale:
            log.info("agent_branch_replaced", run_id=lease.run_id, attempt_id=lease.attempt_id,
                     branch=branch, replaced=old, sha=new)
            return
        log.warning("stale_push_replaced", run_id=lease.run_id, attempt_id=lease.attempt_id,
                    fencing_token=lease.fencing_token, worker_id=lease.worker_id,
                    branch=branch, replaced=old, sha=new)
        self.store.note(lease, Reason.STALE_PUSH_REPLACED,
                        f"attempt {lease.attempt_no} replaced commit {old} on {branch}, "
                        "a commit of this run that was neither this attempt's nor the one "
                        "the ledger recorded (a push that outlived its lease); the branch "
                        f"now holds {new}")


def _pr(pr: PullRequest) -> dict[str, Any]:
    return asdict(pr)


def _effect_attributes(result: dict[str, Any]) -> dict[str, Any]:
    """What a push or a pull request left, for its span: the commit, the pull request's
    number and URL, and whether it was found made already (adopted)."""
    return {f"runlane.{k}": v for k, v in result.items()
            if k in ("sha", "number", "url", "adopted", "replaced")
            and isinstance(v, str | int | bool)}
