"""``runlane retry TASK_ID`` and ``runlane tasks show TASK_ID``."""

from __future__ import annotations

import click
from rich.table import Column, Table
from rich.text import Text

from runlane.cli_common import _lane, json_flag, out
from runlane.cli_output import print_json


@click.command("retry")
@click.argument("task_id")
@json_flag
def retry_command(task_id: str, as_json: bool) -> None:
    """A new run of a finished task, linked to its last run and admitted under the
    policy in force; refused (exit 2) while the task's run is still on its way."""
    with _lane() as lane:
        result = lane.retry(task_id)
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        why = f": {result.reason_code}" if result.reason_code else ""
        out.print(f"retried: task {result.task_id} run {result.run_id} ({result.status}{why}),"
                  f" retrying run {result.retry_of_run_id}", soft_wrap=True)


@click.group("tasks")
def tasks_group() -> None:
    """Inspect tasks."""


@tasks_group.command("show")
@click.argument("task_id")
@json_flag
def tasks_show(task_id: str, as_json: bool) -> None:
    """One task (or the task of a run id): what was asked, its runs (a retry adds one),
    its parent and children."""
    with _lane() as lane:
        task = lane.task(lane.task_id_of(task_id))
    document = task.model_dump(mode="json")
    if as_json:
        print_json(document)
        return
    for key in ("task_id", "tenant", "repo", "queue", "priority", "max_attempts",
                "idempotency_key", "user_id", "depends_on", "created_at",
                "cancel_requested_at"):
        out.print(f"[bold]{key}[/bold]: {document[key]}", soft_wrap=True)
    out.print(Text.assemble(("prompt", "bold"), ": ", task.prompt), soft_wrap=True)
    parent = document["parent"]
    out.print("[bold]parent[/bold]: "
              + (f"{parent['task_id']} ({parent['latest_status']})" if parent else "none"))
    # Whole run ids (`runs show RUN_ID` takes them from here); the rest folds.
    runs = Table(Column("run", no_wrap=True), *(Column(name, overflow="fold") for name in (
        "status", "attempts", "reason", "outcome", "retry of", "created")))
    for r in document["runs"]:
        runs.add_row(r["run_id"], r["status"], f"{r['attempt_count']}/{r['max_attempts']}",
                     r["reason_code"] or "", r["outcome"] or "", r["retry_of_run_id"] or "",
                     r["created_at"])
    out.print(runs)
    if document["children"]:
        children = Table("child task", "latest run", "status", "created")
        for c in document["children"]:
            children.add_row(c["task_id"], c["latest_run_id"] or "", c["latest_status"] or "",
                             c["created_at"])
        out.print(children)
