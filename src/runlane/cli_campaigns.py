"""``runlane campaign create|list|show|report|pause|resume|stop|retry-failed``: one
change across many repositories (docs/campaigns.md). The CLI is the operator: it sees
every tenant's campaigns; ``--tenant`` picks one when two tenants use the same name."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from runlane.cli_common import _lane, json_flag, out
from runlane.cli_output import print_json

tenant_option = click.option("--tenant", help="The campaign's tenant (when two tenants "
                             "have a campaign of this name).")


@click.group("campaign")
def campaign_group() -> None:
    """Campaigns: one change across many repositories, canary -> ramp -> all."""


@campaign_group.command("create")
@click.argument("file", type=click.Path(dir_okay=False))
@json_flag
def campaign_create(file: str, as_json: bool) -> None:
    """Create a campaign from a TOML FILE (the same file again creates nothing)."""
    with _lane() as lane:
        made = lane.create_campaign(path=file)
    if as_json:
        print_json(made)
        return
    verb = "created" if made["created"] else "exists already (nothing created)"
    click.echo(f"campaign {made['name']} ({made['tenant']}) {verb}: {made['targets']} "
               f"targets in batches of {made['batch_sizes']}; the scheduler pass "
               "(`runlane maintain`) dispatches the canary")


@campaign_group.command("list")
@json_flag
def campaign_list(as_json: bool) -> None:
    """Every campaign, oldest first."""
    with _lane() as lane:
        found = lane.campaigns()
    if as_json:
        print_json(found)
        return
    table = Table("name", "tenant", "status", "targets", "batch", "active", "created")
    for c in found:
        table.add_row(c["name"], c["tenant"], c["status"], str(c["targets"]),
                      f"{c['released_batch'] + 1}/{c['batches']}", str(c["active"]),
                      c["created_at"])
    out.print(table)


@campaign_group.command("show")
@click.argument("name")
@tenant_option
@click.option("--format", "fmt", type=click.Choice(["text", "markdown"]), default="text",
              help="markdown: the summary report (as `campaign report`).")
@json_flag
def campaign_show(name: str, tenant: str | None, fmt: str, as_json: bool) -> None:
    """Progress by state and by batch, failure rate, failed runs with their reasons."""
    with _lane() as lane:
        if fmt == "markdown" and not as_json:
            click.echo(lane.campaign_report(name, tenant=tenant), nl=False)
            return
        summary = lane.campaign(name, tenant=tenant)
    if as_json:
        print_json(summary)
        return
    _print_summary(summary)


@campaign_group.command("report")
@click.argument("name")
@tenant_option
def campaign_report(name: str, tenant: str | None) -> None:
    """The summary report in Markdown."""
    with _lane() as lane:
        click.echo(lane.campaign_report(name, tenant=tenant), nl=False)


def _print_summary(s: dict[str, Any]) -> None:
    click.echo(f"campaign {s['name']} ({s['tenant']}): {s['status']}"
               + (f" — {s['stop_reason']}" if s["stop_reason"] else ""))
    states = ", ".join(f"{k.lower()} {v}" for k, v in s["by_state"].items())
    click.echo(f"{s['targets']} targets: {states}")
    rate = s["failure_rate"]
    if rate["window"]:
        click.echo(f"failure rate: {rate['failed']}/{rate['window']} ({rate['rate']:.0%}) "
                   f"of the last counted runs; stop over "
                   f"{s['stop_rule']['failure_rate']:.0%}")
    table = Table("batch", "size", "released", "pending", "active", "succeeded", "failed",
                  "cancelled")
    for b in s["by_batch"]:
        table.add_row(str(b["batch"]), str(b["size"]), b["released_at"] or "-",
                      str(b["PENDING"]), str(b["ACTIVE"]), str(b["SUCCEEDED"]),
                      str(b["FAILED"]), str(b["CANCELLED"]))
    out.print(table)
    if s["failed_runs"]:
        failed = Table("repository", "reason", "run", "message")
        for f in s["failed_runs"]:
            failed.add_row(f["repo"], f["reason_code"] or "", f["run_id"] or "",
                           (f["message"] or "")[:80])
        out.print(failed)
    for p in s["pull_requests"]:
        click.echo(f"pull request: {p['repo']} {p['url'] or p['number']}")


def _move(verb: str, name: str, tenant: str | None, as_json: bool,
          **options: Any) -> None:
    with _lane() as lane:
        done = getattr(lane, f"{verb.replace('-', '_')}_campaign")(name, tenant=tenant,
                                                                 **options)
    if as_json:
        print_json(done)
        return
    if verb == "retry_failed":
        click.echo(f"campaign {done['name']}: {done['retried']} targets to run again; "
                   f"status {done['status']}")
        return
    what = "" if done["changed"] else " (unchanged)"
    if done.get("cancelled_running"):
        what += f"; {done['cancelled_running']} running runs cancelled"
    click.echo(f"campaign {done['name']}: {done['status']}{what}")


for _verb, _help in (("pause", "Hold the campaign: no new dispatch, its queued runs held."),
                     ("resume", "Resume a paused campaign: its held runs queued again."),
                     ("retry-failed", "New runs for the failed targets (and, of a stopped "
                      "campaign, those its stop cancelled before they started).")):
    def _command(name: str, tenant: str | None, as_json: bool,
                 verb: str = _verb.replace("-", "_")) -> None:
        _move(verb, name, tenant, as_json)

    _command.__doc__ = _help
    campaign_group.command(_verb)(json_flag(tenant_option(click.argument("name")(_command))))


@campaign_group.command("stop")
@click.argument("name")
@tenant_option
@click.option("--cancel-running", is_flag=True,
              help="Cancel the runs already running too (else they finish).")
@json_flag
def _stop(name: str, tenant: str | None, cancel_running: bool, as_json: bool) -> None:
    """Stop: no more dispatch, queued runs cancelled (CAMPAIGN_STOPPED); running runs
    finish, or are cancelled with --cancel-running (or the file's stop.cancel_running)."""
    _move("stop", name, tenant, as_json, cancel_running=cancel_running)


def register(app: click.Group) -> None:
    app.add_command(campaign_group)
