"""The finalizer: the door to SUCCEEDED (``Store._end_attempt`` only completes a run
whose pull request the finalizer recorded, when its attempt ends otherwise).

It re-checks the lease and cancellation, commits every change on the run's own
branch with the run's trailer, and performs the two external effects (push,
pull request) through the side-effect ledger, each looked up by its marker first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from runlane.codehost.base import (
    CodeHost,
    CodeHostError,
    PullRequest,
    PullRequestExists,
    branch_name,
    pr_marker,
)
from runlane.domain.states import RunStatus
from runlane.store.store import PULL_REQUEST_EFFECT, Lease, Store
from runlane.worker.effects import perform_effect
from runlane.workspace import PushFailed, Workspace

PUSH_EFFECT = "push_branch"


def trailer(run_id: str) -> str:
    return f"Agent-Run-ID: {run_id}"


# GitHub refuses a pull request body over 65,536 characters (422 "body is too long").
MAX_PR_BODY_CHARS = 65536


def pr_body(task: dict[str, Any], run_id: str, attempt_no: int) -> str:
    """The task's prompt, then runlane's footer with the run's marker, always last and
    whole: a prompt too long for the body is cut, with a note saying so."""
    footer = (f"\n\nOpened by runlane for task `{task['task_id']}`, "
              f"run `{run_id}` (attempt {attempt_no}).\n\n{pr_marker(run_id)}\n")
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

    def already_pushed(self, lease: Lease, workspace: Workspace) -> bool:
        """True when an earlier attempt of this run got as far as pushing its branch
        (recorded, or found on the remote after a crash before the record)."""
        effects = {e.effect_key: e for e in self.store.side_effects(lease.run_id)}
        push = effects.get(PUSH_EFFECT)
        if push is None:
            return False
        if push.status == "DONE":
            return True
        found = workspace.remote_branch_sha(branch_name(lease.task_id, lease.run_id))
        return found is not None and workspace.remote_commit_carries(found, trailer(lease.run_id))

    def resume(self, lease: Lease, workspace: Workspace, task: dict[str, Any]) -> str:
        """Finish what an earlier attempt started: adopt its pushed branch and open (or
        adopt) its pull request, without running the agent again. A retry must not end
        ``no_changes`` or FAILED while the run's branch and pull request exist."""
        if lease.stage is not RunStatus.FINALIZING:
            self.store.advance(lease, RunStatus.FINALIZING)
        self.store.check_lease(lease)
        return self._publish(lease, workspace, task, sha=None)

    def finalize(self, lease: Lease, workspace: Workspace, task: dict[str, Any]) -> str:
        """Returns the run's outcome: ``no_changes`` or ``pull_request``."""
        if lease.stage is not RunStatus.FINALIZING:
            self.store.advance(lease, RunStatus.FINALIZING)
        if not workspace.has_changes():
            self.store.complete(lease, outcome="no_changes")
            return "no_changes"
        self.store.check_lease(lease)  # cancellation and lease, before the first effect
        branch = branch_name(lease.task_id, lease.run_id)
        sha = workspace.commit_all(branch, pr_title(task), trailer(lease.run_id))
        return self._publish(lease, workspace, task, sha=sha)

    def _publish(self, lease: Lease, workspace: Workspace, task: dict[str, Any],
                 sha: str | None) -> str:
        branch = branch_name(lease.task_id, lease.run_id)
        not_ours: list[str] = []  # the branch's commit on the remote, when not runlane's

        def remote_branch() -> dict[str, Any] | None:
            """Adopted only when its commit is runlane's for this run (the trailer): an
            agent that pushed the run's branch itself is not the run's push."""
            found = workspace.remote_branch_sha(branch)
            if found is None:
                return None
            if workspace.remote_commit_carries(found, trailer(lease.run_id)):
                return {"branch": branch, "sha": found}
            not_ours.append(found)
            return None

        def push() -> dict[str, Any]:
            if sha is None:  # resuming, and the branch is gone: nothing to push
                raise PushFailed(f"branch {branch} of an earlier attempt is not on the remote",
                                 transient=True)
            try:
                workspace.push(branch, replacing=not_ours[-1] if not_ours else None)
            except PushFailed:
                # Rejected (the branch appeared since the look above: an earlier
                # attempt's push, outliving its worker, landed in between) or timed out
                # after it landed: look again, and adopt the run's own commit.
                try:
                    landed = remote_branch()
                except PushFailed:
                    landed = None  # the remote cannot be read either: the push's error
                if landed is None:
                    raise
                return {**landed, "adopted": True}
            return {"branch": branch, "sha": sha}

        perform_effect(self.store, lease, PUSH_EFFECT, find=remote_branch, do=push)

        host = self.code_host_for(task["repo"])
        marker = pr_marker(lease.run_id)

        def existing_pr() -> dict[str, Any] | None:
            found = host.find_pull_request(task["repo"], branch, marker)
            return _pr(found) if found else None

        def open_pr() -> dict[str, Any]:
            try:
                return _pr(host.open_pull_request(
                    task["repo"], head_branch=branch, base_branch=workspace.base_branch(),
                    title=pr_title(task), body=pr_body(task, lease.run_id, lease.attempt_no)))
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
            perform_effect(self.store, lease, PULL_REQUEST_EFFECT, find=existing_pr, do=open_pr)
        finally:
            close = getattr(host, "close", None)
            if callable(close):
                close()  # an HTTP client holds a connection pool
        self.store.complete(lease, outcome="pull_request")
        return "pull_request"


def _pr(pr: PullRequest) -> dict[str, Any]:
    return asdict(pr)
