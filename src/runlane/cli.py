"""The ``runlane`` command. Data goes to stdout (one JSON document with ``--json``);
logs and errors go to stderr; an error is one line and a non-zero exit code:
1 invariant violations or a refused operation, 2 bad input, 3 not found,
4 database unreachable or schema outdated, 70 internal error."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Column, Table
from sqlalchemy.exc import DBAPIError

from runlane.api import MAX_CONCURRENCY, Runlane, shown_url
from runlane.cli_serve import host_port_options, metrics_port_option
from runlane.domain.policy import MAX_COUNT, PolicyInvalid, read_policy_text
from runlane.domain.routing import (
    canonical_capabilities,
    parse_capabilities,
    parse_requirements,
    requirements_to_mapping,
)
from runlane.domain.tasks import TaskInvalid, valid_name
from runlane.errors import DatabaseUnavailable, RunlaneError
from runlane.logs import FORMATS, configure_logging
from runlane.settings import Settings, load_settings

out = Console()
F = TypeVar("F", bound=Callable[..., Any])


def json_flag(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print exactly one JSON document on stdout.")(fn)


class State:
    database_url: str | None = None
    settings: dict[str, str] = {}  # the other settings given as flags, by name
    logging: dict[str, str] = {}  # --log-level and --log-format as given (for up's workers)


state = State()
# Commands that log at INFO unless told otherwise: what an operator watches run.
LOUD_COMMANDS = frozenset({"worker", "maintain", "up"})
# Commands whose spans are exported when tracing is configured (the others make none).
TRACED_COMMANDS = frozenset({"submit", "worker", "up", "serve"})
# Every setting is a flag of the top-level command (the documented rule: a flag, else
# RUNLANE_<NAME>, else runlane.toml, else the default), `--lease-ttl-seconds 30`.
SETTING_FLAGS = tuple(name for name in Settings.model_fields if name != "database_url")


def setting_options(fn: F) -> F:
    for name in reversed(SETTING_FLAGS):
        fn = click.option(f"--{name.replace('_', '-')}", name, default=None, metavar="VALUE",
                          help=f"Setting {name.upper()} (else RUNLANE_{name.upper()}, "
                          "runlane.toml, the default).")(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--database-url", default=None,
              help="SQLAlchemy URL (else RUNLANE_DATABASE_URL, runlane.toml, "
              "sqlite:///runlane.db).")
@click.option("--log-level", envvar="RUNLANE_LOG_LEVEL", default=None,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Default: INFO for worker, maintain and up (their runs' claims and "
              "transitions), WARNING for the other commands.")
@click.option("--log-format", envvar="RUNLANE_LOG_FORMAT", default=None,
              type=click.Choice(FORMATS, case_sensitive=False),
              help="Logs on stderr as JSON lines or for people (default: console on a "
              "terminal, json otherwise).")
@setting_options
@click.version_option(package_name="runlane")
def app(database_url: str | None, log_level: str | None, log_format: str | None,
        **settings: str | None) -> None:
    """runlane: a durable run scheduler for background AI coding agents."""
    state.database_url = database_url
    state.settings = {name: value for name, value in settings.items() if value is not None}
    state.logging = {k: v for k, v in (("LOG_LEVEL", log_level), ("LOG_FORMAT", log_format))
                     if v is not None}
    command = click.get_current_context().invoked_subcommand
    level = log_level or ("INFO" if command in LOUD_COMMANDS else "WARNING")
    fmt = (log_format or ("console" if sys.stderr.isatty() else "json")).lower()
    configure_logging(level, json=fmt == "json", capture_stdlib=True)
    if command in TRACED_COMMANDS:
        from runlane.observability.tracing import configure_tracing

        configure_tracing()  # OTEL_* variables (docs/tracing.md); off when unset


@app.group("db")
def db_app() -> None:
    """Schema management."""


@app.group("runs")
def runs_app() -> None:
    """Inspect runs."""


def _lane(check_schema: bool = True) -> Runlane:
    lane = Runlane(settings=load_settings(database_url=state.database_url, **state.settings))
    if check_schema:
        lane.check_schema()
    return lane


def _iso(value: Any) -> Any:
    if isinstance(value, float):
        return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds")
    return value


# Fields holding a point in time (epoch seconds in the database) that are not named
# *_at: an event's `at`, an admission's `retry_after`.
TIME_FIELDS = frozenset({"at", "retry_after"})


def _times(row: dict[str, Any]) -> dict[str, Any]:
    """Every point in time of ``row`` as ISO 8601 UTC, one format for all of them."""
    return {k: (_iso(v) if k.endswith("_at") or k in TIME_FIELDS else v)
            for k, v in row.items()}


RUN_FIELDS = ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
              "attempt_count", "max_attempts", "fencing_token", "visible_at", "created_at",
              "updated_at", "ended_at", "reason_code", "message", "outcome", "cost_usd",
              "estimated_cost_usd", "user_id", "risk_class", "route_key", "policy_version")


def run_document(run: dict[str, Any]) -> dict[str, Any]:
    return _times({k: run.get(k) for k in RUN_FIELDS})


def _print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


# --- db -----------------------------------------------------------------------------


@db_app.command("upgrade")
@json_flag
def db_upgrade(as_json: bool) -> None:
    """Create or migrate the schema; safe to repeat."""
    with _lane(check_schema=False) as lane:
        try:
            before, after = lane.upgrade_schema()
        except DBAPIError as exc:
            raise DatabaseUnavailable(
                f"cannot upgrade {shown_url(lane.store.engine.url)}: "
                f"{str(exc.orig).strip().splitlines()[0]}") from None
    if as_json:
        _print_json({"from": before, "to": after, "changed": before != after})
    else:
        out.print(f"schema at {after}" + ("" if before == after else f" (was {before or 'empty'})"))


# --- submit / cancel ----------------------------------------------------------------


@app.command()
@click.option("--tenant", help="Who the run is for.")
@click.option("--repo", help="Repository URL or local path.")
@click.option("--prompt", help="What the agent should do.")
@click.option("--queue", help="Queue of the run (default: the policy's, else 'default').")
@click.option("--priority", help="Integer (lower first) or critical|high|normal|low|batch.")
@click.option("--idempotency-key",
              help="Per tenant: the same key again returns the same task and run.")
@click.option("--max-attempts",
              help="Attempts of this run, 1-100 (default: the policy's, else the setting "
              "MAX_ATTEMPTS).")
@click.option("--require", "requires", multiple=True,
              help="Required worker capability: KEY=VALUE, KEY=A,B (set), KEY=N (at least), "
              "KEY>=VERSION (repeatable).")
@click.option("--depends-on", "depends_on", multiple=True,
              help="Task that must succeed before this one runs (repeatable).")
@click.option("--parent", "parent_task_id", help="Task this one follows up on.")
@click.option("--user", help="Who asked (for per-user limits).")
@click.option("--estimated-cost", "estimated_cost_usd", help="Expected model cost in USD.")
@click.option("--context", type=click.Path(path_type=Path),
              help="JSON object of optional context sections (summary, history, comments, "
              "diff, ci_failures).")
@click.option("--batch", type=click.Path(path_type=Path),
              help="JSON Lines file, one task per line; all or nothing.")
@json_flag
def submit(tenant: str | None, repo: str | None, prompt: str | None, queue: str | None,
           priority: str | None, idempotency_key: str | None, max_attempts: str | None,
           requires: tuple[str, ...], depends_on: tuple[str, ...], parent_task_id: str | None,
           user: str | None, estimated_cost_usd: str | None,
           context: Path | None, batch: Path | None, as_json: bool) -> None:
    """Submit a task (or a batch); the same tenant and idempotency key returns the same run.

    Each run is admitted under the policy in force: it is queued, denied
    (POLICY_DENIED) or deferred (WAITING_CAPACITY) with a reason code."""
    if batch is not None:
        if any(v is not None for v in (tenant, repo, prompt, queue, priority, idempotency_key,
                                       max_attempts, context, parent_task_id, user,
                                       estimated_cost_usd)) or requires or depends_on:
            raise TaskInvalid("--batch", "cannot be combined with per-task flags")
        rows = _read_jsonl(batch)
        with _lane() as lane:
            results = lane.submit_batch(rows)
        docs = [_submission(s) for s in results]
        if as_json:
            _print_json(docs)
        else:
            created = sum(1 for s in results if s.created)
            out.print(f"{len(results)} task(s): {created} created, "
                      f"{len(results) - created} already present")
        return
    raw: dict[str, Any] = {"tenant": tenant, "repo": repo, "prompt": prompt, "queue": queue,
                           "priority": priority, "idempotency_key": idempotency_key,
                           "max_attempts": max_attempts, "parent_task_id": parent_task_id,
                           "user": user, "estimated_cost_usd": estimated_cost_usd}
    if requires:
        try:
            raw["requires"] = requirements_to_mapping(parse_requirements(list(requires)))
        except ValueError as exc:
            raise TaskInvalid("--require", str(exc)) from None
    if depends_on:
        raw["depends_on"] = list(depends_on)
    if context is not None:
        raw["context"] = _read_json(context, "--context")
    missing = [f"--{k}" for k in ("tenant", "repo", "prompt") if raw[k] is None]
    if missing:
        raise TaskInvalid(missing[0], "is required (or use --batch FILE)")
    with _lane() as lane:
        result = lane.submit(**{k: v for k, v in raw.items() if v is not None})
    if as_json:
        _print_json(_submission(result))
    else:
        verb = "submitted" if result.created else "already submitted"
        why = f": {result.reason_code}" if result.reason_code else ""
        out.print(f"{verb}: task {result.task_id} run {result.run_id} ({result.status}{why})")


def _submission(s: Any) -> dict[str, Any]:
    return {"task_id": s.task_id, "run_id": s.run_id, "status": s.status, "created": s.created,
            "reason_code": s.reason_code, "truncated_sections": list(s.truncated_sections),
            "payload_bytes": s.payload_bytes}


def _read_json(path: Path, flag: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TaskInvalid(flag, f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise TaskInvalid(flag, f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise TaskInvalid(flag, f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None


def _read_jsonl(path: Path) -> list[Any]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise TaskInvalid("--batch", f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise TaskInvalid("--batch", f"cannot read {path}: {exc.strerror}") from None
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TaskInvalid(f"line {number}", f"is not JSON: {exc.msg}") from None
    if not rows:
        raise TaskInvalid("--batch", f"{path} holds no tasks")
    return rows


@app.command()
@click.argument("task_id")
@json_flag
def cancel(task_id: str, as_json: bool) -> None:
    """Cancel a task: queued runs stop now, running ones before their next side effect."""
    with _lane() as lane:
        result = lane.cancel(task_id)
    if as_json:
        _print_json({"task_id": result.task_id,
                     "runs": [{"run_id": r, "status": s} for r, s in result.runs.items()]})
    else:
        for run_id, status in result.runs.items():
            out.print(f"run {run_id}: {status}")


# --- runs ---------------------------------------------------------------------------


@runs_app.command("show")
@click.argument("run_id")
@json_flag
def runs_show(run_id: str, as_json: bool) -> None:
    """One run with its attempts and its event history."""
    with _lane() as lane:
        run = lane.run(run_id)
    # The model's JSON: every field `runs show --json` has printed, and more (README).
    document = run.model_dump(mode="json")
    if as_json:
        _print_json(document)
        return
    for key in ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
                "attempt_count", "reason_code", "message", "outcome", "cost_usd",
                "late_cost_usd", "estimated_cost_usd", "policy_version", "route_key",
                "parent_task_id", "depends_on", "retry_of_run_id", "retried_by_run_id",
                "created_at"):
        out.print(f"[bold]{key}[/bold]: {document[key]}")
    admission = document["admission"] or {}
    if admission:
        first = admission.get("first_policy_version")
        out.print(f"[bold]admission[/bold]: {admission.get('decision')} under policy "
                  f"v{admission.get('policy_version')}"
                  + (f", first admitted under v{first}" if first is not None else "")
                  + (f" ({admission.get('reason_code')}: {admission.get('message')})"
                     if admission.get("reason_code") else "")
                  + (f", retry after {admission['retry_after']}"
                     if admission.get("retry_after") else ""))
    attempts = Table("#", "status", "reason", "worker", "token", "lease", "started", "ended",
                     "late $")
    for a in document["attempts"]:
        attempts.add_row(str(a["attempt_no"]), a["status"], a["reason_code"] or "",
                         a["worker_id"], str(a["fencing_token"]), a["lease_status"],
                         str(a["started_at"]), str(a["ended_at"] or ""),
                         f"{a['late_cost_usd']:g}" if a["late_cost_usd"] else "")
    out.print(attempts)
    events = Table("at", "actor", "from", "to", "reason", "token")
    for e in document["events"]:
        events.add_row(str(e["at"]), e["actor"], e["from_status"] or "-", e["to_status"],
                       e["reason_code"] or "", str(e["fencing_token"] or ""))
    out.print(events)


# --- policy -------------------------------------------------------------------------


@app.group("policy")
def policy_app() -> None:
    """The scheduling policy: tenants, limits, budgets, rules (docs/policy.md)."""


@policy_app.command("apply")
@click.argument("file", type=click.Path(path_type=Path))
@json_flag
def policy_apply(file: Path, as_json: bool) -> None:
    """Validate FILE and store it as a new numbered version (none if unchanged)."""
    # The file's name as a label: one that is not UTF-8 cannot be stored as it is.
    source = os.fsencode(file).decode("utf-8", errors="replace")
    text = read_policy_text(file)  # PolicyInvalid names the file and the problem
    with _lane() as lane:
        applied = lane.apply_policy(text, source=source)
    if as_json:
        _print_json({"version": applied.version, "digest": applied.digest,
                     "created": applied.created})
    else:
        out.print(f"policy v{applied.version} " + (
            "applied" if applied.created else "unchanged (no new version)"))


@policy_app.command("show")
@json_flag
def policy_show(as_json: bool) -> None:
    """The policy in force, with its version."""
    with _lane() as lane:
        record = lane.store.policy_record()
    if record is None:
        record = {"version": 0, "digest": None, "source": None, "created_at": None,
                  "policy": None}
    if as_json:
        _print_json(_times(record))
        return
    if record["version"] == 0:
        out.print("no policy applied: every run is admitted, no limits")
        return
    out.print(f"policy v{record['version']} from {record['source']} "
              f"({_iso(record['created_at'])}, sha256 {record['digest'][:12]})")
    out.print_json(data=record["policy"])


# --- worker / up / prs ----------------------------------------------------------------


def _capabilities(values: tuple[str, ...]) -> dict[str, Any]:
    """``--capability`` values as a JSON-able mapping (repeated keys gather a set)."""
    try:
        return dict(json.loads(canonical_capabilities(parse_capabilities(list(values))) or "{}"))
    except ValueError as exc:
        raise TaskInvalid("--capability", str(exc)) from None


def _pairs(values: tuple[str, ...], flag: str) -> dict[str, str]:
    parsed: dict[str, str] = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key.strip():
            raise TaskInvalid(flag, f"{value!r} is not KEY=VALUE")
        parsed[key.strip()] = val.strip()
    return parsed


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


@app.command()
@click.option("--agent-command", required=True, callback=_command,
              help="Run by /bin/sh -c in the workspace.")
@click.option("--verify-command", callback=_command,
              help="Run in the workspace after the agent succeeds.")
@click.option("--queue", "queues", multiple=True, callback=_queue_names,
              help="Queue to claim from (repeatable).")
@click.option("--concurrency", type=click.IntRange(min=1, max=MAX_CONCURRENCY), default=1,
              show_default=True)
@click.option("--capability", "capabilities", multiple=True, help="KEY=VALUE (repeatable).")
@click.option("--exit-when-idle", is_flag=True,
              help="Exit once nothing is active and nothing is queued in its queues.")
@click.option("--timeout-seconds", type=click.FloatRange(min=0, min_open=True),
              callback=_finite, help="Wall-clock limit of one attempt's agent (TIMEOUT).")
@click.option("--max-changed-files", type=click.IntRange(min=0, max=MAX_COUNT),
              help="More changed files fail the attempt (LIMIT_EXCEEDED).")
@click.option("--max-diff-lines", type=click.IntRange(min=0, max=MAX_COUNT),
              help="More diff lines fail the attempt (LIMIT_EXCEEDED).")
@click.option("--keep-failed-workspaces", is_flag=True)
@metrics_port_option
def worker(agent_command: str, verify_command: str | None, queues: tuple[str, ...],
           concurrency: int, capabilities: tuple[str, ...], exit_when_idle: bool,
           timeout_seconds: float | None, max_changed_files: int | None,
           max_diff_lines: int | None, keep_failed_workspaces: bool, metrics_port: int) -> None:
    """A long-running worker; SIGTERM drains it."""
    from runlane.agents.base import AttemptLimits
    from runlane.services.supervisor import follow_supervisor

    with _lane() as lane:
        runner = lane.worker(
            agent_command=agent_command, verify_command=verify_command,
            queues=list(queues) or ["default"], concurrency=concurrency,
            capabilities=_capabilities(capabilities), exit_when_idle=exit_when_idle,
            limits=AttemptLimits(timeout_seconds, max_changed_files, max_diff_lines),
            keep_failed_workspaces=keep_failed_workspaces)
        _warn_if_unsandboxed(lane)
        if metrics_port:  # this process's counts; the database's gauges: serve, maintain
            lane.serve_metrics(metrics_port, database_gauges=False)
        # Started by `up` or the demo: drain when the supervisor dies. A SIGTERM that
        # comes before run() installs its handler just ends a worker with no attempts.
        follow_supervisor()
        sys.exit(runner.run(handle_signals=True))


@app.command()
@click.option("--workers", type=click.IntRange(min=1, max=MAX_CONCURRENCY), default=2,
              show_default=True, help="Worker processes to run.")
@click.option("--agent-command", required=True, callback=_command,
              help="Passed to every worker.")
@click.option("--verify-command", callback=_command)
@click.option("--queue", "queues", multiple=True, callback=_queue_names)
@click.option("--concurrency", type=click.IntRange(min=1, max=MAX_CONCURRENCY), default=1,
              show_default=True, help="Per worker process.")
@click.option("--capability", "capabilities", multiple=True,
              help="KEY=VALUE declared by every worker, as `runlane worker --capability` "
              "(repeatable): runs that require it are served.")
@click.option("--serve", is_flag=True, help="Also serve the HTTP API and dashboard "
              "(as `runlane serve`, on --host and --port).")
@host_port_options
@metrics_port_option
def up(workers: int, agent_command: str, verify_command: str | None, queues: tuple[str, ...],
       concurrency: int, capabilities: tuple[str, ...], serve: bool, host: str,
       port: int, metrics_port: int) -> None:
    """Everything on one machine: maintenance and N worker processes (restarted if they
    die), and with --serve the HTTP API; SIGTERM or Ctrl-C drains the workers and stops."""
    from runlane.observability.metrics import counting_across_processes
    from runlane.services.supervisor import WorkerPool

    _capabilities(capabilities)  # bad input is refused here, not by each worker's restart
    # Served metrics are every process's: the workers count in files that this process
    # sums (prometheus_client's multiprocess mode, in a private directory).
    with counting_across_processes(bool(metrics_port or serve)), _lane() as lane:
        # Refused here, once, rather than by every worker, restarted forever.
        _check_sandbox(lane)
        args = ["--agent-command", agent_command, "--concurrency", str(concurrency)]
        if verify_command:
            args += ["--verify-command", verify_command]
        for queue in queues:
            args += ["--queue", queue]
        for capability in capabilities:
            args += ["--capability", capability]
        # The settings given as flags reach the workers as their environment.
        pool = WorkerPool(args, workers, database_url=lane.settings.database_url,
                          env={f"RUNLANE_{name.upper()}": value
                               for name, value in {**state.settings,
                                                   **state.logging}.items()})
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
            while not stop.wait(1.0):
                pool.supervise()
        except KeyboardInterrupt:
            stop.set()
        if web is not None:
            web.stop()
        pool.stop(lane.settings.drain_grace_seconds + lane.settings.agent_term_grace_seconds)
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


def _stop_on_sigterm() -> threading.Event:
    """An event SIGTERM sets (a deploy's or a supervisor's stop), instead of killing the
    process wherever it is."""
    import signal as signals

    stop = threading.Event()
    signals.signal(signals.SIGTERM, lambda *_: stop.set())
    return stop


def _start_maintenance(lane: Runlane, stop: threading.Event) -> list[threading.Thread]:
    """The maintenance services, each on a thread, until ``stop`` is set."""
    services = [lane.reaper(), lane.reconciler(), lane.scheduler(), lane.pruner()]
    threads = [threading.Thread(target=svc.run_forever, args=(stop,), daemon=True,
                                name=f"runlane-{svc.name}")
               for svc in services if svc is not None]
    for t in threads:
        t.start()
    return threads


def _join(threads: list[threading.Thread]) -> None:
    """Let each service finish the pass it is in: a pass is a few short transactions,
    and one cut short by the exit would only be redone by the next, but stopping
    between passes leaves nothing to redo and the logs tell the truth."""
    for t in threads:
        t.join()


@app.group("prs")
def prs_app() -> None:
    """Pull requests opened by runs."""


@prs_app.command("list")
@json_flag
def prs_list(as_json: bool) -> None:
    """Pull requests opened (or adopted after a crash) by runs."""
    with _lane() as lane:
        rows = lane.pull_requests()
    if as_json:
        _print_json(rows)
        return
    # Whole run ids, as `runs list` prints them (`runs show RUN_ID` takes them from
    # here); the other columns fold instead.
    table = Table(Column("run", no_wrap=True,
                         min_width=max((len(r["run_id"]) for r in rows), default=3)),
                  *(Column(name, overflow="fold") for name in ("repo", "branch", "number",
                                                               "url")))
    for r in rows:
        table.add_row(r["run_id"], str(r["repo"]), str(r["branch"]), str(r["number"]),
                      str(r["url"]))
    out.print(table)


# --- audit / maintain / demo ---------------------------------------------------------


@app.command()
@click.option("--remote-checks", is_flag=True,
              help="Also ask the code host about runs that ended without success with a "
                   "push or a pull request in their ledger (open or unrecorded ones).")
@click.option("--limit", type=click.IntRange(1, MAX_COUNT), default=1000, show_default=True,
              help="With --remote-checks: at most this many such runs, newest first.")
@json_flag
def audit(remote_checks: bool, limit: int, as_json: bool) -> None:
    """Check runlane's invariants on the live database; exit 1 on any violation."""
    with _lane() as lane:
        violations = lane.audit(remote_checks=remote_checks, limit=limit)
    if as_json:
        _print_json({"ok": not violations,
                     "violations": [v.__dict__ for v in violations]})
    elif violations:
        for v in violations:
            out.print(f"[red]{v.check}[/red] {v.subject}: {v.detail}")
    else:
        out.print("all invariants hold")
    if violations:
        sys.exit(1)


@app.command()
@click.option("--once", is_flag=True, help="One pass, then exit.")
@metrics_port_option
@json_flag
def maintain(once: bool, metrics_port: int, as_json: bool) -> None:
    """Reaper, reconciler, scheduler pass and retention; safe on several machines."""
    if as_json and not once:
        # Only one pass has counts to print: without --once nothing would ever be.
        raise click.UsageError("--json needs --once (one pass, then its counts)")
    with _lane() as lane:
        if once:
            counts = lane.maintain_once()
            if as_json:
                _print_json(counts)
            else:
                out.print(", ".join(f"{k}={v}" for k, v in counts.items()))
            return
        # SIGTERM (a deploy, systemd, Kubernetes) stops it as Ctrl-C does: the passes in
        # flight finish, then exit 0.
        stop = _stop_on_sigterm()
        if metrics_port:  # its counts (the reaper's) and the database's gauges
            lane.serve_metrics(metrics_port)
        threads = _start_maintenance(lane, stop)
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            stop.set()
        _join(threads)


@app.command()
@click.option("--directory", type=click.Path(path_type=Path), default=Path("runlane-demo"),
              show_default=True, help="Where the demo keeps its database.")
@json_flag
def demo(directory: Path, as_json: bool) -> None:
    """The main job on SQLite: real workers, a killed worker, a cancel, pull requests."""
    from runlane.demo import run_demo

    summary = run_demo(directory, console=None if as_json else out)
    if as_json:
        _print_json(summary)
    if summary["violations"]:
        sys.exit(1)


def _register_more() -> None:
    """Commands kept in modules of their own (this one would pass 800 lines)."""
    from runlane.chaos.cli import chaos_command
    from runlane.cli_serve import serve_command
    from runlane.cli_tasks import retry_command, tasks_group
    from runlane.cli_tokens import tokens_group

    app.add_command(chaos_command)
    app.add_command(serve_command)
    app.add_command(tokens_group)
    app.add_command(retry_command)
    app.add_command(tasks_group)


_register_more()


def _register_views() -> None:
    from runlane.cli_top import register as register_top
    from runlane.cli_views import register

    register(app)
    register_top(app)
    __import__("runlane.cli_campaigns").cli_campaigns.register(app)


_register_views()


def run_command(command: click.Command, prog_name: str) -> None:
    """Run a click command: one clear line on stderr for every error, never a
    traceback; the exit code says which kind (2 bad input, 4 database, 70 internal)."""
    err = Console(stderr=True, soft_wrap=True)
    try:
        code = command.main(standalone_mode=False, prog_name=prog_name)
        sys.exit(code if isinstance(code, int) else 0)
    except click.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        err.print(f"error: {exc.format_message()}{hint}", markup=False, highlight=False)
        sys.exit(2)
    except click.Abort:
        sys.exit(130)
    except (TaskInvalid, PolicyInvalid) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)
    except RunlaneError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except DBAPIError as exc:
        err.print(f"error: database: {str(exc.orig).strip().splitlines()[0]}", markup=False,
                  highlight=False)
        sys.exit(4)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("RUNLANE_DEBUG"):
            raise
        err.print(f"internal error: {type(exc).__name__}: {exc} (set RUNLANE_DEBUG=1 for the "
                  "traceback)", markup=False, highlight=False)
        sys.exit(70)


def main() -> None:
    """Entry point of `runlane`."""
    run_command(app, "runlane")
