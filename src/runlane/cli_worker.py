"""``runlane worker`` and ``runlane up``: the same worker options on both (``up``
passes them to each of its worker processes), and ``up``'s supervision: a worker
that dies is restarted after a backoff that doubles while it keeps dying at once; a
crash loop stops ``up`` with the worker's own error (exit 1)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from runlane.api import MAX_CONCURRENCY, Runlane
from runlane.cli_common import (
    MAINTENANCE_CONNECTIONS,
    _join,
    _lane,
    _start_maintenance,
    _stop_on_sigterm,
    out,
    state,
)
from runlane.cli_serve import host_port_options, metrics_port_option
from runlane.domain.policy import MAX_COUNT
from runlane.domain.routing import canonical_capabilities, parse_capabilities
from runlane.domain.tasks import TaskInvalid, valid_name

F = TypeVar("F", bound=Callable[..., Any])

# Pooled PostgreSQL connections of one worker process (its LISTEN is one more).
WORKER_CONNECTIONS = 1


def _capabilities(values: tuple[str, ...]) -> dict[str, Any]:
    """``--capability`` values as a JSON-able mapping (repeated keys gather a set)."""
    try:
        return dict(json.loads(canonical_capabilities(parse_capabilities(list(values))) or "{}"))
    except ValueError as exc:
        raise TaskInvalid("--capability", str(exc)) from None


def _finite(_ctx: click.Context, param: click.Parameter, value: float | None
            ) -> float | None:
    """click's FloatRange lets NaN through (every comparison with it is false)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter("must be a finite number", param=param)
    return value


def _command(_ctx: click.Context, param: click.Parameter, value: str | None
             ) -> str | None:
    """An agent or verify command that is empty (`--agent-command "$AGENT"` with AGENT
    unset) is a mistake: no agent to run, or every run unverified."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty", param=param)
    return value


def _queue_names(_ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
                 ) -> tuple[str, ...]:
    """As a submit checks them: a worker on an empty or malformed queue name would
    serve nothing, silently."""
    for value in values:
        if not valid_name(value):
            raise click.BadParameter(f"{value!r} is not a queue name (1-128 characters of "
                                     "letters, digits and ._:@/-)", param=param)
    return values


def worker_options(fn: F) -> F:
    """The options of one worker process: `runlane worker`'s, and `up`'s for each of
    its workers."""
    options = [
        click.option("--agent-command", required=True, callback=_command,
                     help="The agent: run by /bin/sh -c in each attempt's workspace "
                     "(environment, control lines and exit codes: docs/agent-protocol.md)."),
        click.option("--verify-command", callback=_command,
                     help="Run in the workspace after the agent succeeds; non-zero fails "
                     "the attempt (VERIFY_FAILED)."),
        click.option("--queue", "queues", multiple=True, callback=_queue_names,
                     help="Queue to claim from (repeatable; default: default)."),
        click.option("--concurrency", type=click.IntRange(min=1, max=MAX_CONCURRENCY),
                     default=1, show_default=True,
                     help="Attempts one worker process runs at once."),
        click.option("--sandbox-slots", type=click.IntRange(min=1, max=1000),
                     help="Sandboxes this worker process may have at once (default: the "
                     "SANDBOX_SLOTS setting, else no bound): it runs at most "
                     "min(--concurrency, --sandbox-slots) attempts."),
        click.option("--capability", "capabilities", multiple=True,
                     help="KEY=VALUE the worker declares (repeatable): runs that --require "
                     "it are served."),
        click.option("--exit-when-idle", is_flag=True,
                     help="Exit once nothing is active and nothing it can serve is "
                     "queued (saying what queued runs it cannot serve, and why)."),
        click.option("--timeout-seconds", type=click.FloatRange(min=0, min_open=True),
                     callback=_finite,
                     help="Wall-clock limit of one attempt's agent (TIMEOUT)."),
        click.option("--max-changed-files", type=click.IntRange(min=0, max=MAX_COUNT),
                     help="More changed files fail the attempt (LIMIT_EXCEEDED)."),
        click.option("--max-diff-lines", type=click.IntRange(min=0, max=MAX_COUNT),
                     help="More diff lines fail the attempt (LIMIT_EXCEEDED)."),
        click.option("--keep-failed-workspaces", is_flag=True,
                     help="Keep the workspace of a failed attempt for inspection "
                     "(default: removed)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command()
@worker_options
@metrics_port_option
def worker(agent_command: str, verify_command: str | None, queues: tuple[str, ...],
           concurrency: int, sandbox_slots: int | None, capabilities: tuple[str, ...],
           exit_when_idle: bool,
           timeout_seconds: float | None, max_changed_files: int | None,
           max_diff_lines: int | None, keep_failed_workspaces: bool, metrics_port: int) -> None:
    """A long-running worker; SIGTERM drains it."""
    import sys

    from runlane.agents.base import AttemptLimits
    from runlane.faults import crash_point

    crash_point("worker_start")  # a worker that dies as it starts (up's crash-loop test)
    from runlane.services.supervisor import follow_supervisor

    # One pooled connection whatever --concurrency (and one LISTEN): a fleet's count
    # stays two per worker process (docs/running.md).
    with _lane(connections=WORKER_CONNECTIONS) as lane:
        runner = lane.worker(
            agent_command=agent_command, verify_command=verify_command,
            queues=list(queues) or ["default"], concurrency=concurrency,
            capabilities=_capabilities(capabilities), exit_when_idle=exit_when_idle,
            limits=AttemptLimits(timeout_seconds, max_changed_files, max_diff_lines),
            keep_failed_workspaces=keep_failed_workspaces, sandbox_slots=sandbox_slots)
        _warn_if_unsandboxed(lane)
        if metrics_port:  # this process's counts; the database's gauges: serve, maintain
            lane.serve_metrics(metrics_port, database_gauges=False)
        # Started by `up` or the demo: drain when the supervisor dies. A SIGTERM that
        # comes before run() installs its handler just ends a worker with no attempts.
        follow_supervisor()
        code = runner.run(handle_signals=True)
        if exit_when_idle:
            _say_what_is_left(lane, list(queues) or ["default"], _capabilities(capabilities))
        sys.exit(code)


def _say_what_is_left(lane: Runlane, queues: list[str], capabilities: dict[str, Any]) -> None:
    """After --exit-when-idle: the queued runs this worker could not serve, and why."""
    left = lane.unserved(queues=queues, capabilities=capabilities)
    if left:
        click.echo(f"runlane: {sum(n for n, _ in left)} queued run(s) left that this worker "
                   "cannot serve: " + "; ".join(f"{n} {why}" for n, why in left), err=True)


@click.command()
@click.option("--workers", type=click.IntRange(min=1, max=MAX_CONCURRENCY), default=2,
              show_default=True, help="Worker processes to run.")
@worker_options
@click.option("--serve", is_flag=True, help="Also serve the HTTP API and dashboard "
              "(as `runlane serve`, on --host and --port).")
@click.option("--restart-backoff-seconds", type=click.FloatRange(min=0.01, max=3600),
              default=1.0, show_default=True, callback=_finite,
              help="Wait before restarting a worker that died; doubled (up to 60 s) while "
              "it keeps dying within 30 s of its start.")
@click.option("--crash-loop-limit", type=click.IntRange(min=1, max=1000), default=5,
              show_default=True, help="A worker dying this many times in a row within "
              "30 s of its start stops `up` (exit 1) with the worker's error.")
@host_port_options
@metrics_port_option
def up(workers: int, agent_command: str, verify_command: str | None, queues: tuple[str, ...],
       concurrency: int, sandbox_slots: int | None, capabilities: tuple[str, ...],
       exit_when_idle: bool,
       timeout_seconds: float | None, max_changed_files: int | None,
       max_diff_lines: int | None, keep_failed_workspaces: bool, serve: bool,
       restart_backoff_seconds: float, crash_loop_limit: int, host: str,
       port: int, metrics_port: int) -> None:
    """Everything on one machine: maintenance and N worker processes (restarted if they
    die), and with --serve the HTTP API; SIGTERM or Ctrl-C drains the workers and stops."""
    from runlane.observability.metrics import counting_across_processes
    from runlane.services.supervisor import Backoff, WorkerPool

    _capabilities(capabilities)  # bad input is refused here, not by each worker's restart
    # Served metrics are every process's: the workers count in files that this process
    # sums (prometheus_client's multiprocess mode, in a private directory).
    # Without --serve, this process's pool serves only maintenance: bounded as
    # `maintain`'s (with it, the HTTP API's requests share the pool: the machine's size).
    with counting_across_processes(bool(metrics_port or serve)), \
            _lane(connections=None if serve else MAINTENANCE_CONNECTIONS) as lane:
        # Refused here, once, rather than by every worker.
        _check_sandbox(lane)
        args = ["--agent-command", agent_command, "--concurrency", str(concurrency)]
        for flag, value in (("--verify-command", verify_command),
                            ("--sandbox-slots", sandbox_slots),
                            ("--timeout-seconds", timeout_seconds),
                            ("--max-changed-files", max_changed_files),
                            ("--max-diff-lines", max_diff_lines)):
            if value is not None:
                args += [flag, str(value)]
        for flag, on in (("--exit-when-idle", exit_when_idle),
                         ("--keep-failed-workspaces", keep_failed_workspaces)):
            if on:
                args.append(flag)
        for queue in queues:
            args += ["--queue", queue]
        for capability in capabilities:
            args += ["--capability", capability]
        # The settings given as flags reach the workers as their environment.
        pool = WorkerPool(args, workers, database_url=lane.settings.database_url,
                          env={f"RUNLANE_{name.upper()}": value
                               for name, value in {**state.settings,
                                                   **state.logging}.items()},
                          backoff=Backoff(base_seconds=restart_backoff_seconds,
                                          crash_loop_limit=crash_loop_limit),
                          done_when_idle=exit_when_idle)
        stop = _stop_on_sigterm()
        web = None
        if serve:  # first: a port in use stops `up` before anything else starts
            from runlane.http.serve import ServerThread

            web = ServerThread(lane, host, port)
            web.start()
        threads = _start_maintenance(lane, stop)
        if metrics_port:
            lane.serve_metrics(metrics_port)
        pool.start()
        served = f", HTTP API on http://{host}:{port}" if web else ""
        out.print(f"runlane up: {workers} worker(s) {pool.pids()}, maintenance running"
                  f"{served}; Ctrl-C to stop", soft_wrap=True)
        try:
            while not stop.wait(min(1.0, restart_backoff_seconds / 2)):
                pool.supervise()  # raises WorkerCrashLoop
                if pool.all_done():
                    break
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            if web is not None:
                web.stop()
            pool.stop(lane.settings.drain_grace_seconds
                      + lane.settings.agent_term_grace_seconds)
            _join(threads)


def _check_sandbox(lane: Runlane) -> None:
    """What `runlane worker` checks before it claims anything: the directories, then a
    sandbox started once (exit 2 with the fix when it cannot start)."""
    from runlane.worker.attempt import AttemptSettings

    attempts = AttemptSettings(workspace_root=lane.settings.workspace_dir,
                               artifacts_root=lane.settings.artifacts_dir)
    attempts.check_directories()
    lane.sandbox().check(workspace_root=attempts.workspace_root,
                         artifacts_root=attempts.artifacts_root)
    _warn_if_unsandboxed(lane)


def _warn_if_unsandboxed(lane: Runlane) -> None:
    if lane.settings.sandbox == "off":
        from runlane.sandbox import OFF_WARNING

        click.echo(f"runlane: WARNING: {OFF_WARNING}", err=True)
