"""``runlane top``: a live full-screen view of queues, tenants, workers and the latest
failures (runlane.tui), from the database (SQLite or PostgreSQL, as every command) or,
with ``--url`` and ``--token``, from the HTTP API with that token's scope. ``--once``
prints one frame (``--json``: the snapshot) for scripts."""

from __future__ import annotations

import sys

import click
from rich.console import Console

from runlane.api_activity import CLAIM_WINDOW_SECONDS, MAX_CLAIM_WINDOW_SECONDS, MAX_FAILURES
from runlane.cli_common import _lane, json_flag
from runlane.cli_output import print_json
from runlane.domain.tasks import TaskInvalid
from runlane.tui.snapshot import FacadeSource, HttpSource, Source

# Refreshing faster than this is a typo (and a load on the database).
MIN_INTERVAL = 0.1


@click.command("top")
@click.option("--interval", type=click.FloatRange(min=MIN_INTERVAL, max=3600), default=1.0,
              show_default=True, help="Seconds between refreshes.")
@click.option("--once", is_flag=True, help="Print one frame and exit (no full screen).")
@click.option("--url", envvar="RUNLANE_API_URL",
              help="Read the HTTP API of `runlane serve` at this URL instead of the "
              "database (else RUNLANE_API_URL).")
@click.option("--token", envvar="RUNLANE_API_TOKEN",
              help="The API token for --url (else RUNLANE_API_TOKEN; the environment "
              "keeps it out of the process list).")
@click.option("--failures", "failures", type=click.IntRange(1, MAX_FAILURES), default=10,
              show_default=True, help="How many of the latest failures to read.")
@click.option("--claim-window", type=click.FloatRange(min=1, max=MAX_CLAIM_WINDOW_SECONDS),
              default=CLAIM_WINDOW_SECONDS, show_default=True,
              help="Seconds over which claims per minute are counted.")
@json_flag
def top_command(interval: float, once: bool, url: str | None, token: str | None,
                failures: int, claim_window: float, as_json: bool) -> None:
    """Queues (depth, oldest ready run, claims per minute), tenants (active against
    their limit, fair share, spend today against budget), workers (heartbeat age,
    leases, draining) and the latest failures with their reason codes, refreshed every
    --interval seconds; q quits. --json prints one snapshot (implies --once)."""
    console = Console()
    if not (once or as_json) and not console.is_terminal:
        raise TaskInvalid("--once", "runlane top draws on a terminal: give --once (or "
                          "--json) to print one frame")
    if url is None:
        if token is not None:
            raise TaskInvalid("--token", "is for --url (the HTTP API); without --url "
                              "top reads the database")
        with _lane() as lane:
            _show(FacadeSource(lane, failures=failures, claim_window=claim_window),
                  console, interval=interval, once=once, as_json=as_json)
        return
    if not url.startswith(("http://", "https://")):
        raise TaskInvalid("--url", f"{url!r} is not an http:// or https:// URL")
    if not token:
        raise TaskInvalid("--token", "is required with --url (or RUNLANE_API_TOKEN): "
                          "`runlane tokens create` makes one")
    source = HttpSource(url, token, failures=failures, claim_window=claim_window)
    try:
        _show(source, console, interval=interval, once=once, as_json=as_json)
    finally:
        source.close()


def _show(source: Source, console: Console, *, interval: float, once: bool,
          as_json: bool) -> None:
    # The first frame is read before the screen is taken: a database or API that does
    # not answer at all is an error on a terminal left as it was.
    first = source.fetch()
    if as_json:
        print_json(first.model_dump(mode="json"))
        return
    from runlane.tui import render

    if once:
        console.print(render.tables(first))
        return
    from runlane.tui.screen import run_live

    run_live(source, first, interval=interval, console=console, stdin=sys.stdin)


def register(app: click.Group) -> None:
    app.add_command(top_command)
