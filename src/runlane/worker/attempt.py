"""One attempt, driven end to end on its own thread: workspace, agent, verify, judge,
finalize. A lost lease stops everything at once and nothing more is written; a
cancel stops the agent and ends the run CANCELLED; nothing irreversible happens
after either."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import structlog
from sqlalchemy.exc import DBAPIError

from runlane.agents.base import AgentResult, AttemptControl, AttemptLimits, StopReason
from runlane.agents.resources import ResourceLimits
from runlane.codehost.base import CodeHost, CodeHostError, PullRequestExists
from runlane.codehost.factory import clone_source
from runlane.domain.agent_limits import CooperativeLimits
from runlane.domain.reasons import WORKER_ONLY, Reason
from runlane.domain.states import RunStatus
from runlane.errors import CancelRequested, CostLimitExceeded, LeaseLost, PolicyDenied
from runlane.observability import tracing
from runlane.settings import SettingsInvalid
from runlane.store.records import Lease
from runlane.store.store import Store
from runlane.worker.effects import perform_effect
from runlane.worker.finalizer import Finalizer, NothingToFinalize
from runlane.workspace import (
    AgentLeftBadTree,
    CloneFailed,
    PushFailed,
    Workspace,
    make_private_dirs,
    unsafe_workspace_root,
)

log = structlog.get_logger("runlane.worker")
S = RunStatus

# A judge looks at the task, the workspace and the agent's result; it returns None to
# accept, or the reason it rejects (the attempt fails with JUDGE_REJECTED).
Judge = Callable[[dict[str, Any], Path, AgentResult], str | None]


class AgentRunner(Protocol):
    def run(self, *, workspace: Path, artifacts_dir: Path, env: dict[str, str],
            control: AttemptControl, limits: AttemptLimits,
            log_name: str = "agent.log") -> AgentResult: ...


class Stop(Exception):
    """Raised inside the driver when the attempt must stop before its next step."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


@dataclass
class AttemptState:
    """The shared flags between the heartbeat loop and the attempt's thread."""

    lease: Lease
    store: Store
    # When the lease surely runs out, on this machine's monotonic clock: set from the
    # moment a claim or heartbeat that extended it was *sent*, minus a margin. Past it
    # the attempt stops even if the heartbeat is stuck (a silent network partition).
    local_deadline: float = float("inf")
    # Time the agent needs to stop after SIGTERM: it must be gone before the lease is.
    stop_grace: float = 0.0
    deadline_fired: bool = False
    cancel: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    drain: threading.Event = field(default_factory=threading.Event)
    over_budget: threading.Event = field(default_factory=threading.Event)
    over_budget_message: str = ""  # the limit and its figures, for the run's message
    # The agent's tool calls and iterations against the run's limits: reported on the
    # output-reader thread, checked on the attempt's (hence the lock).
    _counts: CooperativeLimits | None = None
    _counting: threading.Lock = field(default_factory=threading.Lock)
    # Told each new local deadline as the heartbeat sets it (the sandbox's guard, which
    # ends the agent at it): see watch_deadline.
    _deadline_watchers: list[Callable[[float], None]] = field(default_factory=list)
    _watchers_lock: threading.Lock = field(default_factory=threading.Lock)
    # The claim's start and end (wall clock, ns): the attempt's span starts there.
    claimed_ns: tuple[int, int] | None = None
    # The attempt's span (observability/tracing.py): the agent's lines become its events.
    trace: tracing.AttemptTrace | tracing.NoTrace = tracing.NO_TRACE

    def extended(self, sent_at: float, ttl: float) -> None:
        self.local_deadline = deadline = (sent_at + ttl - min(ttl * 0.2, 5.0)
                                          - self.stop_grace)
        with self._watchers_lock:
            watchers = list(self._deadline_watchers)
        for tell in watchers:  # on the heartbeat thread: at once, not at the next poll
            try:
                tell(deadline)
            except Exception as exc:  # a watcher must never stop the heartbeat
                log.error("deadline_watcher_failed", run_id=self.lease.run_id,
                          error=f"{type(exc).__name__}: {exc}")

    def watch_deadline(self, tell: Callable[[float], None]) -> Callable[[], None]:
        """Call ``tell`` with every new local deadline (from the heartbeat thread); the
        function returned stops it."""
        with self._watchers_lock:
            self._deadline_watchers.append(tell)

        def unwatch() -> None:
            with self._watchers_lock, contextlib.suppress(ValueError):
                self._deadline_watchers.remove(tell)

        return unwatch

    def stop_reason(self) -> StopReason | None:
        if not self.lost.is_set() and time.monotonic() >= self.local_deadline:
            self.deadline_fired = True
            self.lost.set()
        if self._counts is not None and self._counts.timing:  # a shell command is open
            with self._counting:
                over = self._counts.overdue(time.monotonic())
            if over is not None:
                self.exceeded(over)
        if self.lost.is_set():
            return StopReason.LEASE_LOST
        if self.cancel.is_set():
            return StopReason.CANCELLED
        if self.over_budget.is_set():
            return StopReason.LIMIT_EXCEEDED
        if self.drain.is_set():
            return StopReason.DRAINING
        return None

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None:
        """Every cost line is money spent: while the lease is held, the attempt's cost;
        once it is lost, or given up on the local deadline (the agent is being stopped,
        and may print more), the attempt's late cost: one write per line, counted in
        the tenant's day all the same."""
        self.trace.event("cost", {"runlane.usd": usd, "runlane.input_tokens": input_tokens,
                                  "runlane.output_tokens": output_tokens})
        if self.lost.is_set():
            self.store.report_late_cost(self.lease, usd)
            return
        try:
            self.store.report_cost(self.lease, usd, input_tokens=input_tokens,
                                   output_tokens=output_tokens)
        except LeaseLost:  # recorded as late cost by the store
            self.lost.set()
        except CostLimitExceeded as exc:
            log.warning("cost_limit_exceeded", run_id=self.lease.run_id, message=str(exc))
            self.exceeded(str(exc))

    def exceeded(self, message: str) -> None:
        """The run is over one of its limits: the agent is stopped, the attempt ends
        LIMIT_EXCEEDED with this message (the first limit reported wins)."""
        if not self.over_budget.is_set():
            self.over_budget_message = message
            self.over_budget.set()

    def _cooperative(self) -> CooperativeLimits:
        if self._counts is None:
            self._counts = CooperativeLimits.from_snapshot(self.lease.limits)
        return self._counts

    def tool_call(self, call_id: str | None, name: str | None, *, shell: bool = False,
                  seconds: float | None = None) -> None:
        self.trace.event("tool_call" if seconds is None else "tool_call_ended", {
            "runlane.tool_call_id": call_id, "runlane.tool_name": name,
            "runlane.shell": shell, "runlane.seconds": seconds})
        with self._counting:
            over = self._cooperative().tool_call(call_id, name, shell=shell, seconds=seconds,
                                                 now=time.monotonic())
        if over is not None:
            log.warning("agent_limit_exceeded", run_id=self.lease.run_id, message=over)
            self.exceeded(over)

    def iteration(self) -> None:
        self.trace.event("iteration", {})
        with self._counting:
            over = self._cooperative().iteration()
        if over is not None:
            log.warning("agent_limit_exceeded", run_id=self.lease.run_id, message=over)
            self.exceeded(over)

    def progress(self, message: str) -> None:
        self.trace.event("progress", {"runlane.message": message})
        log.info("agent_progress", run_id=self.lease.run_id, attempt_id=self.lease.attempt_id,
                 message=message)

    def effect(self, key: str, *, find: Callable[[], dict[str, Any] | None],
               do: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return perform_effect(self.store, self.lease, f"agent:{key}", find=find, do=do)

    def check(self) -> None:
        reason = self.stop_reason()
        if reason is not None:
            raise Stop(reason)

    # --- the lease's window, before a call that touches the world (LeaseWindow) ------

    def open_window(self) -> float:
        """The attempt may go on (``check``: its local deadline too), the lease is live
        and the run not being cancelled in the database: the ``time.monotonic()`` by
        which a call made now must be over, the lease's expiry as the database gave it,
        counted from before it was asked (a heartbeat extends the lease, not a call
        already made: the call's timeout is fixed when it starts)."""
        self.check()
        asked_at = time.monotonic()
        left = self.store.lease_remaining(self.lease)  # LeaseLost, CancelRequested
        deadline = asked_at + left
        self.time_left(deadline)
        return deadline

    def time_left(self, deadline: float) -> float:
        """Seconds until ``deadline``: a worker paused since its lease was checked
        (SIGSTOP, a VM pause) finds it passed and makes no call."""
        left = deadline - time.monotonic()
        if left <= 0:
            self.deadline_fired = True  # as the local deadline: _stopped gives it back
            self.lost.set()
            raise Stop(StopReason.LEASE_LOST)
        return left


@dataclass
class AttemptSettings:
    workspace_root: Path
    artifacts_root: Path
    limits: AttemptLimits = field(default_factory=AttemptLimits)
    keep_failed_workspaces: bool = False
    clone_timeout_seconds: float = 300.0

    def __post_init__(self) -> None:
        # Absolute, from the worker's working directory: the agent runs in its
        # workspace, where a relative RUNLANE_ARTIFACTS_DIR (the default is
        # `runlane-artifacts`) named a directory inside the clone, committed and pushed.
        self.workspace_root = Path(self.workspace_root).expanduser().absolute()
        self.artifacts_root = Path(self.artifacts_root).expanduser().absolute()

    def check_directories(self) -> None:
        """Create both roots and prove them writable, at worker start-up: a worker that
        cannot make a workspace or an artifacts directory would claim runs only to fail
        each one (WORKER_ERROR, not retried), emptying the queue. The workspace root is
        made 0700 and refused when another user could write it or replace it (see
        workspace.unsafe_workspace_root). Raises SettingsInvalid."""
        for name, root in (("WORKSPACE_DIR", self.workspace_root),
                           ("ARTIFACTS_DIR", self.artifacts_root)):
            try:
                if name == "WORKSPACE_DIR":
                    make_private_dirs(root)  # 0700: the clones are no one else's
                else:
                    root.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryFile(dir=root):
                    pass
                unsafe = unsafe_workspace_root(root) if name == "WORKSPACE_DIR" else None
            except OSError as exc:
                raise SettingsInvalid(
                    f"{name} {root}: not a usable directory "
                    f"({exc.strerror or type(exc).__name__}: {exc.filename or root})") from None
            if unsafe is not None:
                raise SettingsInvalid(f"{name} {root}: {unsafe}")


class AttemptDriver:
    def __init__(self, store: Store, agent: AgentRunner, settings: AttemptSettings, *,
                 code_host_for: Callable[[str], CodeHost],
                 verifier: AgentRunner | None = None, judge: Judge | None = None) -> None:
        self.store = store
        self.agent = agent
        self.verifier = verifier
        self.judge = judge
        self.settings = settings
        self.code_host_for = code_host_for
        self.finalizer = Finalizer(store, code_host_for)

    def run(self, state: AttemptState) -> str:
        """Drive one attempt; returns how it ended (for logs and tests)."""
        lease = state.lease
        bound = log.bind(task_id=lease.task_id, run_id=lease.run_id,
                         attempt_id=lease.attempt_id, fencing_token=lease.fencing_token,
                         worker_id=lease.worker_id)
        workspace: Workspace | None = None
        ended = "failed"
        try:
            task = self.store.get_task(lease.task_id)
            state.trace = tracing.attempt(lease, task.get("traceparent"), state.claimed_ns)
            try:  # an unsupported code host fails the run now, not after the push
                host = self.code_host_for(task["repo"])
                close = getattr(host, "close", None)
                if callable(close):
                    close()
            except CodeHostError as exc:
                if exc.transient:
                    raise
                return self._fail(state, Reason.TASK_CONTRACT_INVALID, str(exc))
            artifacts = self.settings.artifacts_root / lease.run_id / str(lease.attempt_no)
            artifacts.mkdir(parents=True, exist_ok=True)
            self.store.advance(lease, S.PREPARING_SANDBOX)
            self._remove_earlier_workspaces(lease)
            try:
                with state.trace.stage("runlane.clone"):
                    workspace = Workspace.clone(clone_source(task["repo"]),
                                                self.settings.workspace_root,
                                                f"{lease.run_id}-{lease.attempt_no}",
                                                timeout=self.settings.clone_timeout_seconds)
            except CloneFailed as exc:
                reason = (Reason.GIT_CLONE_FAILED_TRANSIENT if exc.transient
                          else Reason.TASK_CONTRACT_INVALID)
                self.store.fail(lease, reason, message=str(exc))
                return reason.value
            if workspace.base_sha is None:  # an empty repository (`git init --bare`)
                # Nothing to open a pull request against: refuse before the agent runs
                # rather than push a root commit for a pull request that cannot be made.
                return self._fail(state, Reason.TASK_CONTRACT_INVALID,
                                  "the repository has no branch at all, so no default "
                                  "branch to work on (push one first)")
            state.check()
            if self.store.finalize_only_after(lease.run_id) is not None:
                # A finalize-only attempt (store/evidence.py): it records the run's branch
                # and pull request, or finds there is nothing to record; never the agent.
                try:
                    ended = self.finalizer.resume(lease, workspace, task, state)
                except NothingToFinalize as exc:
                    ended = self._fail(state, Reason.NOTHING_TO_FINALIZE, str(exc))
                return ended
            if self.finalizer.already_pushed(lease, workspace, state):
                ended = self.finalizer.resume(lease, workspace, task, state)
                return ended
            # The sandbox is the workspace's: the agent's and the verify command's (each
            # its own bwrap) see it, and it names them in the trace (docs/tracing.md).
            state.trace.set({"runlane.sandbox_id": workspace.path.name})
            self.store.advance(lease, S.RUNNING)
            env = self._env(lease, task, workspace.path, artifacts, state.trace.traceparent())
            with state.trace.stage("runlane.agent", events=True) as span:
                result = self.agent.run(workspace=workspace.path, artifacts_dir=artifacts,
                                        env=env, control=state, limits=self._limits(lease))
                span.set_attributes(_outcome(result))
            ended = self._after_agent(state, workspace, artifacts, env, task, result)
            return ended
        except Stop as stop:
            ended = self._stopped(state, stop.reason)
            return ended
        except CancelRequested:
            ended = self._finish_cancel(state)
            return ended
        except LeaseLost:
            bound.warning("lease_lost_stopping")
            ended = "lease_lost"
            return ended
        except AgentLeftBadTree as exc:  # what the agent left, not a fault of runlane's
            ended = self._fail(state, Reason.AGENT_FAILED, str(exc))
            return ended
        except (CodeHostError, PushFailed) as exc:
            # A 429, a rate-limit 403 or a 503 says how long to wait: the retry waits
            # at least that long (a git push failure carries no such hint).
            ended = self._fail(state, Reason.CODE_HOST_FAILED_TRANSIENT if exc.transient
                               else Reason.WORKER_ERROR, str(exc),
                               getattr(exc, "retry_after", None) if exc.transient else None)
            return ended
        except PullRequestExists as exc:  # the host's list lags its create: look again later
            ended = self._fail(state, Reason.CODE_HOST_FAILED_TRANSIENT, str(exc))
            return ended
        except PolicyDenied as exc:  # the policy changed under the run: no side effect
            ended = self._fail(state, Reason.POLICY_DENIED, str(exc))
            return ended
        except DBAPIError as exc:
            # The database is unreachable: write nothing; the lease expires and the
            # reaper recovers the run (WORKER_LOST).
            bound.error("database_error_abandoning_attempt",
                        error=str(exc.orig).strip().splitlines()[0])
            ended = "abandoned"
            return ended
        except Exception as exc:
            bound.exception("attempt_crashed")
            ended = self._fail(state, Reason.WORKER_ERROR, f"{type(exc).__name__}: {exc}")
            return ended
        finally:
            succeeded = ended in ("no_changes", "pull_request")
            if workspace is not None and (succeeded or not self.settings.keep_failed_workspaces):
                workspace.remove()
            elif workspace is not None:
                workspace.release()
            bound.info("attempt_finished", ended=ended)
            state.trace.end(ended)

    def _after_agent(self, state: AttemptState, workspace: Workspace, artifacts: Path,
                     env: dict[str, str], task: dict[str, Any], result: AgentResult) -> str:
        lease = state.lease
        if result.stopped is not None:
            return self._stopped(state, result.stopped, result.limit)
        if state.over_budget.is_set():  # its cost went over the run's maximum before it
            # exited: LIMIT_EXCEEDED, never retried, whatever the agent said after
            return self._stopped(state, StopReason.LIMIT_EXCEEDED)
        # The agent protocol: exit 0 means done; a fail line classifies a non-zero exit (an
        # agent that reported a rate limit, waited and finished keeps its work).
        if result.failure is not None and result.exit_code != 0:
            reason, message = result.failure.reason_code, result.failure.message
            if reason in WORKER_ONLY:
                message = f"agent reported {reason}, a code only runlane may record"
                reason = Reason.AGENT_FAILED
            return self._fail(state, reason, message, result.failure.retry_after_seconds)
        if result.exit_code != 0:
            return self._fail(state, Reason.AGENT_FAILED,
                              f"agent exited with status {result.exit_code}")
        workspace.keep_agent_tree()  # what is committed: not what the verify command adds
        over = workspace.check_limits(self._limits(lease))
        if over:
            return self._fail(state, Reason.LIMIT_EXCEEDED, over)
        if self.verifier is not None:
            state.check()
            # The wall-clock limit is the run's: the verify command gets what the agent
            # left of it, not the whole limit again.
            limits = self._limits(lease)
            if limits.wall_clock_seconds is not None:
                left = limits.wall_clock_seconds - (result.duration_seconds or 0.0)
                if left <= 0:
                    return self._stopped(state, StopReason.TIMEOUT)
                limits = replace(limits, wall_clock_seconds=left)
            # max_verifier_minutes bounds the verify stage on its own. Over it the attempt
            # ends LIMIT_EXCEEDED, not TIMEOUT: the same tree verifies as slowly again, so
            # a retry (TIMEOUT is retried) would only spend the time once more.
            verifier_minutes = lease.limits.get("max_verifier_minutes")
            verifier_seconds = (None if verifier_minutes is None
                                else float(verifier_minutes) * 60)
            by_verifier_limit = verifier_seconds is not None and (
                limits.wall_clock_seconds is None or verifier_seconds < limits.wall_clock_seconds)
            if by_verifier_limit:
                limits = replace(limits, wall_clock_seconds=verifier_seconds)
            self.store.advance(lease, S.VERIFYING)
            # The repository's own code runs here (its tests): the policy's secrets are
            # the agent's (its model's API key), not the verify command's.
            limits = replace(limits, secrets=())
            with state.trace.stage("runlane.verify", events=True) as span:
                verdict = self.verifier.run(workspace=workspace.path, artifacts_dir=artifacts,
                                            env=env, control=state, limits=limits,
                                            log_name="verify.log")
                span.set_attributes(_outcome(verdict))
            if verdict.stopped is StopReason.TIMEOUT and by_verifier_limit:
                return self._fail(
                    state, Reason.LIMIT_EXCEEDED,
                    f"max_verifier_minutes {verifier_minutes:g} exceeded: the verify command "
                    f"ran {verdict.duration_seconds or 0.0:.1f} s")
            if verdict.stopped is not None:
                return self._stopped(state, verdict.stopped, verdict.limit)
            if verdict.exit_code != 0:
                return self._fail(state, Reason.VERIFIER_FAILED,
                                  f"verify command exited with status {verdict.exit_code}")
        if self.judge is not None:
            state.check()
            self.store.advance(lease, S.JUDGING)
            with state.trace.stage("runlane.judge") as span:
                rejection = self.judge(task, workspace.path, result)
                span.set_attribute("runlane.accepted", not rejection)
            if rejection:
                return self._fail(state, Reason.JUDGE_REJECTED, rejection)
        state.check()
        return self.finalizer.finalize(lease, workspace, task, state)

    def _stopped(self, state: AttemptState, reason: StopReason,
                 limit: str | None = None) -> str:
        if reason is StopReason.LEASE_LOST:
            if not state.lost.is_set():
                # Not this thread's own finding: the sandbox's guard ended the agent at
                # the lease deadline while this worker could not (paused, then resumed,
                # and its heartbeat may have extended the lease since). As the local
                # deadline: stop, write nothing else, give a live lease back.
                log.warning("agent_ended_at_lease_deadline", run_id=state.lease.run_id,
                            attempt_no=state.lease.attempt_no)
                state.deadline_fired = True
                state.lost.set()
            if state.deadline_fired:
                # Stopped on the local deadline, without word from the database: if the
                # lease is in fact still live, give it back rather than leave the run to
                # the reaper (a fenced write: refused if the lease is really gone).
                with contextlib.suppress(Exception):
                    self.store.release(state.lease, message="local lease deadline passed")
            return "lease_lost"  # someone else owns the run now: write nothing
        if reason is StopReason.CANCELLED:
            return self._finish_cancel(state)
        if reason is StopReason.DRAINING:
            try:
                self.store.release(state.lease)
            except (LeaseLost, CancelRequested):
                return "lease_lost"
            return "released"
        if reason is StopReason.TIMEOUT:
            return self._fail(state, Reason.TIMEOUT, "the run's wall-clock limit passed")
        # A limit names itself with its figures (the runner's resource watch, else the
        # store's cost check or the agent's counts), not only "limit_exceeded".
        return self._fail(state, Reason.LIMIT_EXCEEDED,
                          limit or state.over_budget_message or reason.value)

    def _finish_cancel(self, state: AttemptState) -> str:
        lease = state.lease
        try:
            if lease.stage is not S.CANCELLING:
                self.store.acknowledge_cancel(lease)
            self.store.finish_cancel(lease)
        except LeaseLost:
            return "lease_lost"
        except DBAPIError as exc:  # called from a handler: nothing outside would catch it
            return self._abandon(state, exc)
        return "cancelled"

    def _fail(self, state: AttemptState, reason: str, message: str | None,
              retry_after: float | None = None) -> str:
        try:
            self.store.fail(state.lease, reason, message=message,
                            retry_after_seconds=retry_after)
        except LeaseLost:
            return "lease_lost"
        except DBAPIError as exc:  # called from a handler: nothing outside would catch it
            return self._abandon(state, exc)
        return str(reason)

    def _abandon(self, state: AttemptState, exc: DBAPIError) -> str:
        """The database is unreachable: write nothing; the lease expires and the reaper
        recovers the run (WORKER_LOST)."""
        log.error("database_error_abandoning_attempt", run_id=state.lease.run_id,
                  attempt_no=state.lease.attempt_no,
                  error=str(exc.orig or exc).strip().splitlines()[0])
        return "abandoned"

    def _remove_earlier_workspaces(self, lease: Lease) -> None:
        """The clones of this run's earlier attempts on this machine: a worker killed
        mid-attempt never removed its own (a full clone per lost worker). Their leases
        are gone (this attempt holds the run's newest), so nothing writes from them."""
        if self.settings.keep_failed_workspaces:
            return
        for attempt_no in range(1, lease.attempt_no):
            Workspace.remove_named(self.settings.workspace_root, f"{lease.run_id}-{attempt_no}")

    def _limits(self, lease: Lease) -> AttemptLimits:
        """The worker's limits, tightened by the run's limits snapshot (policy)."""
        own, run = self.settings.limits, lease.limits

        def tighter(mine: float | None, theirs: Any) -> Any:
            if theirs is None:
                return mine
            return theirs if mine is None else min(mine, theirs)

        minutes = run.get("max_wall_clock_minutes")
        resources = ResourceLimits.from_snapshot(run)
        network = run.get("network")  # absent: a run admitted before the field existed
        return AttemptLimits(
            wall_clock_seconds=tighter(own.wall_clock_seconds,
                                       None if minutes is None else float(minutes) * 60),
            max_changed_files=tighter(own.max_changed_files, run.get("max_changed_files")),
            max_diff_lines=tighter(own.max_diff_lines, run.get("max_diff_lines")),
            resources=ResourceLimits(**{
                name: tighter(getattr(own.resources, name), getattr(resources, name))
                for name in ResourceLimits.__dataclass_fields__}),
            network=own.network if network is None else bool(network) and own.network,
            secrets=tuple(run.get("secrets") or ()))

    @staticmethod
    def _env(lease: Lease, task: dict[str, Any], workspace: Path, artifacts: Path,
             traceparent: str | None = None) -> dict[str, str]:
        # TRACEPARENT: the attempt's span, for an agent that traces (docs/tracing.md); it
        # passes the sandbox's filter as the contract's variables do.
        return ({"TRACEPARENT": traceparent} if traceparent else {}) | {
            "RUNLANE_TASK_ID": lease.task_id,
            "RUNLANE_RUN_ID": lease.run_id,
            "RUNLANE_ATTEMPT": str(lease.attempt_no),
            "RUNLANE_TENANT": lease.tenant,
            "RUNLANE_REPO": task["repo"],
            "RUNLANE_PROMPT": task["prompt"],
            "RUNLANE_WORKSPACE": str(workspace),
            "RUNLANE_ARTIFACTS_DIR": str(artifacts),
        }



def _outcome(result: AgentResult) -> dict[str, Any]:
    """How an agent or verify command ended, as attributes of its stage's span."""
    return {k: v for k, v in (("runlane.exit_code", result.exit_code),
                              ("runlane.stopped", result.stopped and result.stopped.value),
                              ("runlane.duration_seconds", result.duration_seconds))
            if v is not None}
