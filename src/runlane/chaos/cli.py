"""``runlane chaos``: the fault harness's command. ``chaos_command`` is a click
command for the main CLI; ``python -m runlane.chaos`` runs it on its own."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from runlane.chaos.checks import evaluate
from runlane.chaos.harness import Harness, remove_directory
from runlane.chaos.profiles import FAULTS, PROFILES, build_config
from runlane.chaos.report import Report, render
from runlane.cli_run import run_command
from runlane.logs import configure_logging


class _Progress:
    """Progress on stderr: a live table on a terminal, a line every 10 s otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.console = Console(stderr=True)
        self.quiet = quiet
        self.live: Live | None = None
        self.last_line = -10.0

    def __call__(self, state: dict[str, Any]) -> None:
        if self.quiet:
            return
        states = state["states"]
        ended = sum(states.get(s, 0) for s in ("SUCCEEDED", "FAILED", "CANCELLED",
                                              "POLICY_DENIED"))
        faults = ", ".join(f"{k} {v}" for k, v in state["faults"].items()) or "none yet"
        if self.console.is_terminal:
            table = Table(title=f"runlane chaos - {state['elapsed']:.0f}s", title_justify="left",
                          show_header=False)
            table.add_column()
            table.add_column()
            table.add_row("runs", f"{ended} ended of {state['submitted']} submitted "
                                  f"({state['runs']} planned)")
            table.add_row("by state", ", ".join(f"{k} {v}" for k, v in sorted(states.items())))
            table.add_row("faults", faults)
            table.add_row("workers", str(state["workers"]))
            if self.live is None:
                self.live = Live(table, console=self.console, refresh_per_second=4,
                                 transient=True)
                self.live.start()
            else:
                self.live.update(table)
        elif state["elapsed"] - self.last_line >= 10:
            self.last_line = state["elapsed"]
            self.console.print(f"chaos {state['elapsed']:.0f}s: {ended}/{state['runs']} runs "
                               f"ended; faults: {faults}", markup=False, highlight=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


@click.command("chaos")
@click.option("--profile", type=click.Choice(sorted(PROFILES)), default="short",
              show_default=True, help="short: CI, 300 runs on PostgreSQL; long: 2,000 runs; "
              "sqlite: 8 worker processes on one SQLite file.")
@click.option("--seed", type=int, default=None,
              help="Fixes the workload and the fault schedule (default: random, printed).")
@click.option("--engine", type=click.Choice(["postgresql", "sqlite"]), default=None,
              help="Default: the profile's; postgresql means a private throw-away cluster.")
@click.option("--database-url", default=None,
              help="Use this (empty) database instead; no PostgreSQL restarts then.")
@click.option("--pgbouncer", is_flag=True,
              help="Workers and maintenance reach PostgreSQL through a PgBouncer in "
              "transaction pooling mode (LISTEN directly); needs Debian's pgbouncer.")
@click.option("--runs", type=click.IntRange(min=1), default=None,
              help="Runs the workload submits (default: the profile's).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help="Runs per worker process.")
@click.option("--faults", default=None,
              help=f"Comma-separated, or all / none: {', '.join(FAULTS)}.")
@click.option("--kill-every", type=click.FloatRange(min=0), default=None,
              help="Seconds between worker SIGKILLs (on average).")
@click.option("--stop-every", type=click.FloatRange(min=0), default=None,
              help="Seconds between worker SIGSTOPs (each for 1.5 x the lease TTL).")
@click.option("--terminate-every", type=click.FloatRange(min=0), default=None,
              help="Seconds between pg_terminate_backend rounds.")
@click.option("--restarts", type=click.IntRange(min=0), default=None,
              help="PostgreSQL immediate restarts during the run.")
@click.option("--lease-ttl", type=click.FloatRange(min=0.5), default=None,
              help="LEASE_TTL_SECONDS of the drill's processes (default: the profile's).")
@click.option("--max-seconds", type=click.FloatRange(min=1), default=None,
              help="Stop waiting for the runs after this long.")
@click.option("--stall-seconds", type=click.FloatRange(min=1), default=None,
              help="Stop waiting once no run changed state for this long.")
@click.option("--directory", type=click.Path(path_type=Path), default=None,
              help="Work here (remotes, forge, logs, SQLite file) and keep it.")
@click.option("--keep", is_flag=True, help="Keep the work directory (kept anyway on a "
              "violation).")
@click.option("--plant", type=click.Choice(["no_fencing", "no_lease_expiry"]), default=None,
              hidden=True, help="Plant a bug in the workers and maintenance (harness tests).")
@click.option("--agent-sleep", type=click.FloatRange(min=0), default=None, hidden=True,
              help="Every agent works this long (harness tests).")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@click.option("--json", "as_json", is_flag=True,
              help="Print exactly one JSON document on stdout.")
def chaos_command(profile: str, seed: int | None, engine: str | None,
                  database_url: str | None, pgbouncer: bool, runs: int | None, workers: int | None,
                  concurrency: int | None, faults: str | None, kill_every: float | None,
                  stop_every: float | None, terminate_every: float | None,
                  restarts: int | None, lease_ttl: float | None, max_seconds: float | None,
                  stall_seconds: float | None, directory: Path | None, keep: bool,
                  plant: str | None, agent_sleep: float | None, quiet: bool,
                  as_json: bool) -> None:
    """The fault harness: a workload with faults injected on a seeded schedule, then
    every invariant checked; exit 1 when any was violated."""
    if seed is None:
        seed = int.from_bytes(os.urandom(3), "big")
    if database_url is None:  # `runlane --database-url URL chaos`: the group's option
        root = click.get_current_context().find_root()
        given = root.params.get("database_url") if root.command is not chaos_command else None
        database_url = given if isinstance(given, str) else None
    config = build_config(
        profile, seed=seed, engine=engine, faults=faults, database_url=database_url,
        runs=runs, workers=workers, concurrency=concurrency, kill_every=kill_every,
        stop_every=stop_every, terminate_every=terminate_every, restarts=restarts,
        lease_ttl=lease_ttl, max_seconds=max_seconds, stall_seconds=stall_seconds,
        directory=directory, keep=keep, plant=plant, agent_sleep=agent_sleep,
        pgbouncer=pgbouncer or None)
    progress = _Progress(quiet)
    harness = Harness(config, progress)
    report: Report | None = None
    previous = signal.signal(signal.SIGTERM, _interrupt)  # clean up as on Ctrl-C
    try:
        outcome = harness.run()
        progress.close()
        report = evaluate(outcome)
    finally:
        signal.signal(signal.SIGTERM, previous)
        progress.close()
        harness.close()
        work = harness.directory
        kept = keep or directory is not None or report is None or not report.ok
        if work is not None and not kept:
            remove_directory(work)
    if kept and work is not None:
        report.directory = str(work)
    _emit(report, as_json)
    if not report.ok:
        sys.exit(1)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _emit(report: Report, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(report.document(), indent=2, default=str) + "\n")
    else:
        render(report, Console())


def main() -> None:
    """``python -m runlane.chaos``: one clear line on stderr for every error."""
    configure_logging(os.environ.get("RUNLANE_LOG_LEVEL", "WARNING"))
    run_command(chaos_command, "runlane chaos")
