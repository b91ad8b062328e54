"""``runlane approvals list``, ``runlane approve RUN_ID``, ``runlane reject RUN_ID``:
the runs an approval gate of the policy holds (docs/policy.md, "Approval gates"). A
task's id names its newest run. The CLI holds the database's own credentials: it is the
operator, and records itself as ``cli:<login name>`` unless ``--by`` names someone."""

from __future__ import annotations

import click

from runlane.cli_common import _lane, json_flag, out
from runlane.cli_output import Col, chosen_output, output_options, print_json, render
from runlane.domain.tasks import TaskInvalid, valid_name
from runlane.models.approvals import ApprovalResult


@click.group("approvals")
def approvals_group() -> None:
    """Runs waiting for a person's approval (an approval gate of the policy)."""


@approvals_group.command("list")
@click.option("--tenant", help="Only this tenant's runs.")
@click.option("--limit", type=click.IntRange(min=1, max=10_000), default=500,
              show_default=True, help="At most this many runs, oldest first.")
@output_options
def approvals_list(tenant: str | None, limit: int, output: str | None,
                   as_json: bool) -> None:
    """Runs waiting for approval, oldest first, with when each expires."""
    if tenant is not None and not valid_name(tenant):
        raise TaskInvalid("--tenant", "is not a tenant name")
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        pending = lane.approvals(tenant=tenant, limit=limit)
    columns = (
        Col("run", lambda p: p.run_id, ident=True, key="run_id"),
        Col("tenant", lambda p: p.tenant),
        Col("risk", lambda p: p.risk_class, drop=3, key="risk_class"),
        Col("est. cost", lambda p: p.estimated_cost_usd, drop=2, right=True,
            key="estimated_cost_usd"),
        Col("expires", lambda p: p.expires_at, key="expires_at"),
        Col("queue", lambda p: p.queue, drop=6),
        Col("repo", lambda p: p.repo, drop=4),
        Col("why", lambda p: p.message, drop=5, key="message"),
    )
    render(pending, columns, fmt,
           json_document=lambda: [p.model_dump(mode="json") for p in pending],
           empty="no runs waiting for approval", console=out)


def _decided(result: ApprovalResult, as_json: bool) -> None:
    if as_json:
        print_json(result.model_dump(mode="json"))
        return
    verb = result.decision.lower()
    again = " (already: nothing changed)" if result.repeated else ""
    out.print(f"run {result.run_id} {verb} by {result.actor}{again}; "
              f"it is {result.status}")


_note = click.option("--note", help="Why, for the record (shown with the run).")
_by = click.option("--by", help="Who decides, for the record (default: cli:<login name>).")


@click.command("approve")
@click.argument("run_id")
@_note
@_by
@json_flag
def approve_command(run_id: str, note: str | None, by: str | None, as_json: bool) -> None:
    """Approve a run waiting for approval: it is admitted again under the policy in
    force (queued, deferred or denied). Approving it again changes nothing."""
    with _lane() as lane:
        _decided(lane.approve(lane.run_id_of(run_id), note=note, by=by), as_json)


@click.command("reject")
@click.argument("run_id")
@_note
@_by
@json_flag
def reject_command(run_id: str, note: str | None, by: str | None, as_json: bool) -> None:
    """Reject a run waiting for approval: it ends POLICY_DENIED (APPROVAL_REJECTED) and
    never starts. Rejecting it again changes nothing."""
    with _lane() as lane:
        _decided(lane.reject(lane.run_id_of(run_id), note=note, by=by), as_json)


def register(app: click.Group) -> None:
    app.add_command(approvals_group)
    app.add_command(approve_command)
    app.add_command(reject_command)
