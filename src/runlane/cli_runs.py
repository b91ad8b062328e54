"""``runlane runs list``, ``runs show`` and ``cancel``: a run or task given by either
id (a task's id means its newest run where a run is wanted, a run's id its task where
a task is)."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text

from runlane.api_views import MAX_PAGE
from runlane.cli_common import _lane, json_flag, out, run_document
from runlane.cli_output import Col, chosen_output, full_time, output_options, print_json, render
from runlane.cli_views import parse_moment
from runlane.domain.policy import MAX_COUNT
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskInvalid, valid_name
from runlane.errors import redact_credentials

# What a decision's retry_after is, in `runs show` (a DEFER's: when to try again).
_AFTER = {"REQUIRE_APPROVAL": "approval expires"}
# A prompt longer than this is cut in `runs show` (--full-prompt: whole).
PROMPT_SHOWN = 400


def _t(key: str) -> Any:
    return lambda r: _when(r.get(key))


def _when(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


RUN_COLUMNS = (
    Col("run", lambda r: r["run_id"], ident=True, key="run_id"),
    Col("task", lambda r: r["task_id"], ident=True, drop=9, key="task_id"),
    Col("tenant", lambda r: r["tenant"]),
    Col("queue", lambda r: r["queue"], drop=6),
    Col("status", lambda r: r["status"], ident=True),
    Col("prio", lambda r: r["priority"], drop=5, right=True, key="priority"),
    Col("tries", lambda r: f"{r['attempt_count']}/{r['max_attempts']}", drop=3,
        key="attempts"),
    Col("reason", lambda r: r["reason_code"], drop=2, key="reason_code"),
    Col("cost", lambda r: r["cost_usd"], drop=7, right=True, key="cost_usd"),
    Col("created", _t("created_at"), drop=4, key="created_at"),
    Col("updated", _t("updated_at"), drop=8, key="updated_at"),
    Col("repo", lambda r: r["repo"], drop=10),
)


@click.command("list")
@click.option("--status", help="Only runs in this status.")
@click.option("--tenant", help="Only runs of this tenant.")
@click.option("--queue", help="Only runs of this queue.")
@click.option("--repo", help="Only runs of this repository (any spelling of it).")
@click.option("--task", "task", help="Only the runs of this task (a retry adds one); a "
              "run's id means its task.")
@click.option("--since", help="Only runs created at or after this time: a duration back "
              "from now (30m, 12h, 7d) or ISO 8601 (UTC unless it says).")
@click.option("--until", help="Only runs created before this time (as --since).")
@click.option("--before", "before", metavar="RUN_ID",
              help="Only runs created before this run: the next page of a listing cut by "
              "--limit (newest first).")
@click.option("--after", "after", metavar="RUN_ID",
              help="Only runs created after this run, oldest first (what came since).")
@click.option("--oldest-first", is_flag=True, help="Oldest first (default: newest first).")
@click.option("--newest-first", is_flag=True, hidden=True)  # the default now; still taken
@click.option("--cursor", help="Continue a listing from the cursor a cut JSON listing "
              "printed on stderr.")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_COUNT), default=1000,
              show_default=True, help="At most this many runs; a line on stderr says when "
              "more exist and how to list them.")
@click.option("--unroutable", is_flag=True,
              help="Only waiting runs that no live worker can serve (queue or capabilities).")
@output_options
def runs_list(status: str | None, tenant: str | None, queue: str | None, repo: str | None,
              task: str | None, since: str | None, until: str | None, before: str | None,
              after: str | None, oldest_first: bool, newest_first: bool, cursor: str | None,
              limit: int, unroutable: bool, output: str | None, as_json: bool) -> None:
    """List runs, newest first (--unroutable: route by route, oldest first)."""
    fmt = chosen_output(output, as_json)
    if tenant is not None and not valid_name(tenant):
        raise TaskInvalid("--tenant", f"{tenant!r} is not a tenant name")
    if status is not None:
        status = status.upper()
        if status not in RunStatus.__members__:
            raise TaskInvalid("--status", f"unknown status; one of {', '.join(RunStatus)}")
        if unroutable and status != RunStatus.QUEUED.value:
            raise TaskInvalid("--status", "--unroutable lists QUEUED runs only")
    if queue is not None and not valid_name(queue):
        raise TaskInvalid("--queue", f"{queue!r} is not a queue name")
    if oldest_first and newest_first:
        raise TaskInvalid("--oldest-first", "contradicts --newest-first")
    if sum(x is not None for x in (before, after, cursor)) > 1:
        raise TaskInvalid("--before", "give one of --before, --after and --cursor")
    if after is not None and newest_first:
        raise TaskInvalid("--after", "lists oldest first (what came after the run)")
    now = datetime.now(UTC)
    created_after = parse_moment("--since", since, now)
    created_before = parse_moment("--until", until, now)
    if unroutable and (queue or repo or since or until or cursor or before or after
                       or task or oldest_first):
        raise TaskInvalid("--unroutable", "takes only --tenant and --limit")
    newest = not (oldest_first or after is not None)
    with _lane() as lane:
        if unroutable:
            rows = lane.store.unroutable_runs(tenant=tenant, limit=min(limit + 1, MAX_COUNT))
            more = len(rows) > limit
            documents = [run_document(r) | {"unroutable_because": r["unroutable_because"]}
                         for r in rows[:limit]]
        else:
            if before is not None or after is not None:
                cursor = lane.run_cursor(str(before or after), newest_first=newest)
            documents = []
            while len(documents) < limit:
                page = lane.runs_page(
                    status=status, tenant=tenant, queue=queue, repo=repo, task_id=task,
                    created_after=created_after, created_before=created_before,
                    cursor=cursor, newest_first=newest,
                    limit=min(MAX_PAGE, limit - len(documents)))
                documents += [item.model_dump(mode="json") for item in page.items]
                cursor = page.next
                if cursor is None:
                    break
            more = cursor is not None
    if more:
        last = documents[-1]["run_id"]
        how = ("narrow with --status or --tenant" if unroutable else
               f"continue with --{'before' if newest else 'after'} {last}"
               + (f" (or --cursor {cursor})" if fmt == "json" else ""))
        sys.stderr.write(f"runlane: {limit} runs listed (--limit), {'older' if newest else 'newer'}"
                         f" ones exist: {how}\n")
    columns = RUN_COLUMNS + ((Col("why unroutable", lambda r: r["unroutable_because"],
                                  key="unroutable_because"),) if unroutable else ())
    render(documents, columns, fmt, json_document=lambda: documents,
           empty="no runs" + (" that no worker can serve" if unroutable else ""),
           console=out)


@click.command("show")
@click.argument("run_id")
@click.option("--utc", is_flag=True, help="Times in UTC (default: the local time zone).")
@click.option("--full-prompt", is_flag=True, help="The whole prompt (default: its first "
              f"{PROMPT_SHOWN} characters).")
@click.option("--events", "with_events", is_flag=True, help="Also every status change.")
@json_flag
def runs_show(run_id: str, utc: bool, full_prompt: bool, with_events: bool,
              as_json: bool) -> None:
    """One run (a task's id: its newest run): what was asked, the policy's decision,
    its attempts, cost, pull request, artifacts."""
    with _lane() as lane:
        run = lane.run(lane.run_id_of(run_id))
        task = lane.task(run.task_id)
        artifacts = Path(lane.settings.artifacts_dir).expanduser().absolute()
    if as_json:
        print_json(run.model_dump(mode="json"))
        return
    summary(run, task, artifacts, utc=utc, full_prompt=full_prompt,
            with_events=with_events)


def _line(label: str, value: Any) -> None:
    text = Text.assemble((f"{label:<13}", "bold"), "-" if value in (None, "") else str(value))
    out.print(text, soft_wrap=True, highlight=False)


def summary(run: Any, task: Any, artifacts: Path, *, utc: bool, full_prompt: bool,
            with_events: bool) -> None:
    """``runs show`` for people: label and value, one per line, then the attempts."""
    def when(moment: datetime | None) -> str:
        return full_time(moment, utc=utc)

    _line("run", f"{run.run_id}  {run.status}")
    _line("task", task.task_id)
    _line("tenant", run.tenant + (f" (user {run.user_id})" if run.user_id else ""))
    _line("queue", f"{run.queue}, priority {run.priority}"
          + (f", provider {run.provider}" if run.provider else ""))
    repo = redact_credentials(task.repo)
    _line("repo", run.repo + ("" if repo == run.repo else f" (submitted as {repo})"))
    prompt = run.prompt
    if not full_prompt and len(prompt) > PROMPT_SHOWN:
        prompt = (prompt[:PROMPT_SHOWN] + f"… ({len(run.prompt) - PROMPT_SHOWN} more "
                  "characters: --full-prompt)")
    _line("prompt", prompt)
    _line("requires", task.requires or "nothing")
    admission = run.admission or {}
    if admission:
        first = admission.get("first_policy_version")
        version = admission.get("policy_version")
        _line("policy", f"{admission.get('decision')} "
              + (f"under policy v{version}" if version else "(no policy applied)")
              + (f", first admitted under v{first}" if first is not None else "")
              + (f" ({admission.get('reason_code')}"
                 + (f": {admission['message']}" if admission.get("message") else "") + ")"
                 if admission.get("reason_code") else "")
              + (f", {_AFTER.get(str(admission.get('decision')), 'retry after')} "
                 f"{when(_when(admission['retry_after']))}"
                 if admission.get("retry_after") else ""))
    else:
        _line("policy", "no policy in force" if not run.policy_version
              else f"v{run.policy_version}")
    if run.approval is not None:
        a = run.approval
        _line("approval", f"{a.decision} by {a.actor} at {when(a.decided_at)} under policy "
              f"v{a.policy_version}" + (f": {a.note}" if a.note else ""))
    elif run.status == "AWAITING_APPROVAL":
        _line("approval", f"waiting, until {when(run.visible_at)} "
              "(runlane approve / runlane reject)")
    outcome = run.reason_code or run.outcome
    _line("outcome", (outcome or "") + (f": {run.message}" if run.message else ""))
    _line("attempts", f"{run.attempt_count} of {run.max_attempts}")
    cost = f"${run.cost_usd:.4f}"
    if run.estimated_cost_usd is not None:
        cost += f" (estimated ${run.estimated_cost_usd:.4f})"
    if run.late_cost_usd:
        cost += f", ${run.late_cost_usd:.4f} reported late"
    if run.input_tokens or run.output_tokens:
        cost += f", {run.input_tokens} tokens in, {run.output_tokens} out"
    if run.cost_exceeded_at is not None:
        cost += f"; over its limit since {when(run.cost_exceeded_at)}"
    _line("cost", cost)
    _line("created", when(run.created_at))
    _line("updated", when(run.updated_at))
    _line("ended", when(run.ended_at) if run.ended_at else "not yet")
    pr = run.pull_request
    _line("pull request", (f"{pr.url or '#' + str(pr.number)} (branch {pr.branch})"
                           + (", adopted" if pr.adopted else "")) if pr else "none")
    if run.attempts:
        _line("artifacts", f"{artifacts / run.run_id}/N/ for attempt N (agent.log, "
              "verify.log; on the worker's machine)")
    if run.retry_of_run_id:
        _line("retry of", run.retry_of_run_id)
    if run.retried_by_run_id:
        _line("retried by", run.retried_by_run_id)
    if len(task.runs) > 1:
        _line("task's runs", ", ".join(f"{r.run_id} {r.status}" for r in task.runs))
    for a in run.attempts:  # one block each: readable at any width
        stages = " → ".join(stage.status for stage in a.stages) or a.status
        _line(f"attempt {a.attempt_no}",
              f"{a.status}" + (f": {a.reason_code}" if a.reason_code else "")
              + f", worker {a.worker_id}, fencing token {a.fencing_token}, "
              f"${a.cost_usd:.4f}"
              + (f" (over the cost limit at {when(a.cost_exceeded_at)})"
                 if a.cost_exceeded_at else ""))
        _line("", f"stages {stages}")
        _line("", f"{when(a.started_at)} to "
              + (when(a.ended_at) if a.ended_at else f"now (lease {a.lease_status})"))
        if a.message:
            _line("", a.message)
        _line("", f"log {artifacts / run.run_id / str(a.attempt_no) / 'agent.log'}")
    if with_events:
        events = Table("at", "actor", "from", "to", "reason", "token", title="events",
                       title_justify="left")
        for e in run.events:
            events.add_row(when(e.at), e.actor, e.from_status or "-", e.to_status,
                           e.reason_code or "", str(e.fencing_token or ""))
        out.print(events)


@click.command()
@click.argument("task_id")
@json_flag
def cancel(task_id: str, as_json: bool) -> None:
    """Cancel a task (or the task of a run id): queued runs stop now, running ones
    before their next side effect."""
    with _lane() as lane:
        result = lane.cancel(task_id)
    if as_json:
        print_json({"task_id": result.task_id,
                    "runs": [{"run_id": r, "status": s} for r, s in result.runs.items()]})
        return
    if result.task_id != task_id:
        out.print(f"task {result.task_id} (of run {task_id}):", highlight=False, soft_wrap=True)
    for run_id, status in result.runs.items():
        out.print(f"run {run_id}: {status}", highlight=False, soft_wrap=True)


def register(app: click.Group, runs: click.Group) -> None:
    """`cancel` on the top-level command, `list` and `show` on its `runs` group."""
    runs.add_command(runs_list)
    runs.add_command(runs_show)
    app.add_command(cancel)
