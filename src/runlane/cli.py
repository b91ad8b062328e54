"""The ``runlane`` command. Data goes to stdout (one JSON document with ``--json``);
logs and errors go to stderr; an error is one line and a non-zero exit code:
1 invariant violations or a refused operation, 2 bad input, 3 not found,
4 database unreachable or schema outdated, 70 internal error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from sqlalchemy.exc import DBAPIError

from runlane.api import shown_url
from runlane.chaos.cli import chaos_command
from runlane.cli_approvals import register as register_approvals
from runlane.cli_campaigns import register as register_campaigns
from runlane.cli_common import (
    MAINTENANCE_CONNECTIONS,
    F,
    _iso,
    _join,
    _lane,
    _start_maintenance,
    _stop_on_sigterm,
    _times,
    json_flag,
    out,
    state,
)
from runlane.cli_info import info_command
from runlane.cli_output import Col, chosen_output, output_options, print_json, render
from runlane.cli_run import run_command
from runlane.cli_runs import register as register_runs
from runlane.cli_serve import metrics_port_option, serve_command
from runlane.cli_submit import submit
from runlane.cli_tasks import retry_command, tasks_group
from runlane.cli_tokens import tokens_group
from runlane.cli_top import register as register_top
from runlane.cli_views import register as register_views
from runlane.cli_worker import up, worker
from runlane.domain.policy import MAX_COUNT, read_policy_text
from runlane.errors import DatabaseUnavailable
from runlane.logs import FORMATS, configure_logging
from runlane.settings import Settings

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


class Runlane_(click.Group):
    """The top-level command: its options (the database, logging, every setting) are
    taken after the subcommand too (`runs list --database-url URL`), unless that
    subcommand has an option of the same name; alone, it prints its help."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist_global_options(self, ctx, args))


def _takes_value(command: click.Command) -> dict[str, bool]:
    """Each option string of ``command``, and whether it takes a value."""
    found: dict[str, bool] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in (*param.opts, *param.secondary_opts):
                found[name] = not (param.is_flag or param.count)
    return found


def hoist_global_options(group: click.Group, ctx: click.Context, args: list[str]
                         ) -> list[str]:
    """``args`` with the group's options given after its subcommand moved before it."""
    mine = _takes_value(group)
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        i += 2 if mine.get(args[i], False) else 1
    if i >= len(args) or args[i] == "--":
        return args
    command: click.Command | None = group
    j = i
    while isinstance(command, click.Group) and j < len(args):
        command = command.get_command(ctx, args[j])
        j += 1
    if command is None:
        return args
    theirs = _takes_value(command)
    moved: list[str] = []
    rest = args[:j]
    while j < len(args):
        arg = args[j]
        if arg == "--":
            rest += args[j:]
            break
        name = arg.split("=", 1)[0]
        if name in mine and name not in theirs and arg.startswith("--"):
            width = 2 if mine[name] and "=" not in arg else 1
            moved += args[j:j + width]
            j += width
            continue
        rest.append(arg)
        if theirs.get(arg, False) and j + 1 < len(args):
            rest.append(args[j + 1])
            j += 1
        j += 1
    return moved + rest


@click.group(cls=Runlane_, invoke_without_command=True, no_args_is_help=False,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--database-url", default=None,
              help="SQLAlchemy URL (else RUNLANE_DATABASE_URL, runlane.toml, "
              "SQLite in ~/.local/state/runlane/runlane.db; `runlane info` shows it).")
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
    """runlane: a durable run scheduler for background AI coding agents.

    Options of this command are taken after the subcommand too."""
    ctx = click.get_current_context()
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())
        ctx.exit(0)
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
        print_json({"from": before, "to": after, "changed": before != after})
    else:
        out.print(f"schema at {after}" + ("" if before == after else f" (was {before or 'empty'})"))


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
        print_json({"version": applied.version, "digest": applied.digest,
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
        print_json(_times(record))
        return
    if record["version"] == 0:
        out.print("no policy applied: every run is admitted, no limits")
        return
    out.print(f"policy v{record['version']} from {record['source']} "
              f"({_iso(record['created_at'])}, sha256 {record['digest'][:12]})")
    out.print_json(data=record["policy"])


# --- services and prs -------------------------------------------------------------


@app.group("prs")
def prs_app() -> None:
    """Pull requests opened by runs."""


@prs_app.command("list")
@output_options
def prs_list(output: str | None, as_json: bool) -> None:
    """Pull requests opened (or adopted after a crash) by runs."""
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        rows = lane.pull_requests()
    columns = (Col("run", lambda r: r["run_id"], ident=True, key="run_id"),
               Col("number", lambda r: r["number"], right=True),
               Col("url", lambda r: r["url"]),
               Col("branch", lambda r: r["branch"], drop=2),
               Col("repo", lambda r: r["repo"], drop=1))
    render(rows, columns, fmt, json_document=lambda: rows, empty="no pull requests",
           console=out)


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
        print_json({"ok": not violations,
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
    """Reaper, reconciler, scheduler pass and retention; on several machines, one of them
    (the maintenance leader) runs them at a time."""
    if as_json and not once:
        # Only one pass has counts to print: without --once nothing would ever be.
        raise click.UsageError("--json needs --once (one pass, then its counts)")
    with _lane(connections=MAINTENANCE_CONNECTIONS) as lane:
        if once:
            counts = lane.maintain_once()
            if as_json:
                print_json(counts)
            else:  # what the pass did; every counter with --json
                done = {k: v for k, v in counts.items() if v}
                out.print(", ".join(f"{k}={v}" for k, v in done.items()) if done else
                          f"nothing to do (all {len(counts)} counters 0; --json lists them)",
                          soft_wrap=True, highlight=False)
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
        print_json(summary)
    if summary["violations"]:
        sys.exit(1)


def _register() -> None:
    """Commands kept in modules of their own (this one would pass 800 lines), added in
    the order the reference (docs/cli.md) lists them."""
    for command in (chaos_command, serve_command, worker, up, info_command, submit,
                    tokens_group, retry_command, tasks_group):
        app.add_command(command)
    register_views(app, policy_app)
    register_runs(app, runs_app)
    register_top(app)
    register_campaigns(app)
    register_approvals(app)


_register()


def main() -> None:
    """Entry point of `runlane`."""
    run_command(app, "runlane")
