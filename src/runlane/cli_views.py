"""``runlane workers list|drain``, ``runlane queues list``, ``runlane tenants list`` and
``runlane policy versions``: the fleet views, thin over the facade (api_views.py). The
CLI holds the database's own credentials: it is the operator and sees everything."""

from __future__ import annotations

import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from rich.table import Column, Table

from runlane.api_views import MAX_PAGE
from runlane.cli import (
    _lane,
    _print_json,
    json_flag,
    out,
    policy_app,
    run_document,
    runs_app,
)
from runlane.domain.policy import MAX_COUNT
from runlane.domain.states import RunStatus
from runlane.domain.tasks import TaskInvalid, valid_name

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_moment(flag: str, value: str | None, now: datetime) -> datetime | None:
    """``--since``/``--until``: an ISO 8601 date or time (without a zone: UTC), or a
    duration back from now (``90s``, ``30m``, ``12h``, ``7d``, ``2w``)."""
    if value is None:
        return None
    text = value.strip()
    ago = _AGO.match(text)
    if ago:
        return now - timedelta(seconds=float(ago.group(1)) * _UNIT[ago.group(2)])
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise TaskInvalid(flag, f"{value!r} is neither an ISO 8601 time (2026-12-01, "
                          "2026-12-01T08:00:00Z) nor a duration back from now (30m, 12h, "
                          "7d)") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _limits(limits: list[Any]) -> str:
    return ", ".join(f"{lim.scope} {'?' if lim.active is None else lim.active}/"
                     f"{lim.max_active}" for lim in limits)


# --- runs ------------------------------------------------------------------------------


@click.command("list")
@click.option("--status", help="Only runs in this status.")
@click.option("--tenant", help="Only runs of this tenant.")
@click.option("--queue", help="Only runs of this queue.")
@click.option("--repo", help="Only runs of this repository (any spelling of it).")
@click.option("--since", help="Only runs created at or after this time: ISO 8601 (UTC "
              "unless it says), or a duration back from now (30m, 12h, 7d).")
@click.option("--until", help="Only runs created before this time (as --since).")
@click.option("--newest-first", is_flag=True, help="Newest first (default: oldest first).")
@click.option("--cursor", help="Continue after the last run listed before (the cursor a "
              "cut listing prints on stderr).")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_COUNT), default=1000,
              show_default=True)
@click.option("--unroutable", is_flag=True,
              help="Only waiting runs that no live worker can serve (queue or capabilities).")
@json_flag
def runs_list(status: str | None, tenant: str | None, queue: str | None, repo: str | None,
              since: str | None, until: str | None, newest_first: bool, cursor: str | None,
              limit: int, unroutable: bool, as_json: bool) -> None:
    """List runs, oldest first: at most --limit of them (a line on stderr says when
    more exist, with the --cursor that continues)."""
    if tenant is not None and not valid_name(tenant):
        raise TaskInvalid("--tenant", f"{tenant!r} is not a tenant name")
    if status is not None:
        status = status.upper()
        if status not in RunStatus.__members__:
            raise TaskInvalid("--status", f"unknown status; one of {', '.join(RunStatus)}")
        if unroutable and status != RunStatus.QUEUED.value:
            # Not ignored: `--unroutable --status SUCCEEDED` listed queued runs.
            raise TaskInvalid("--status", "--unroutable lists QUEUED runs only")
    if queue is not None and not valid_name(queue):
        raise TaskInvalid("--queue", f"{queue!r} is not a queue name")
    now = datetime.now(UTC)
    created_after = parse_moment("--since", since, now)
    created_before = parse_moment("--until", until, now)
    if unroutable and (queue or repo or since or until or cursor or newest_first):
        raise TaskInvalid("--unroutable", "takes only --tenant and --limit")
    with _lane() as lane:
        if unroutable:
            # One more than asked for tells whether the limit cut the list.
            rows = lane.store.unroutable_runs(tenant=tenant, limit=min(limit + 1, MAX_COUNT))
            more = len(rows) > limit
            documents = [run_document(r) | {"unroutable_because": r["unroutable_because"]}
                         for r in rows[:limit]]
        else:  # the facade's pages, as the HTTP API reads them
            documents = []
            while len(documents) < limit:
                page = lane.runs_page(
                    status=status, tenant=tenant, queue=queue, repo=repo,
                    created_after=created_after, created_before=created_before,
                    cursor=cursor, newest_first=newest_first,
                    limit=min(MAX_PAGE, limit - len(documents)))
                documents += [item.model_dump(mode="json") for item in page.items]
                cursor = page.next
                if cursor is None:
                    break
            more = cursor is not None
    if more:
        sys.stderr.write(f"runlane: only the {'newest' if newest_first else 'oldest'} "
                         f"{limit} matching runs are listed (--limit); more exist: raise "
                         "--limit or narrow with --status or --tenant"
                         + ("" if unroutable else f", or continue with --cursor {cursor}")
                         + "\n")
    if as_json:
        _print_json(documents)
        return
    # Whole run ids, whatever the terminal's width (`runs show RUN_ID` takes them from
    # here): the other columns fold onto more lines instead, losing nothing either.
    run_column = Column("run", no_wrap=True,
                        min_width=max((len(r["run_id"]) for r in documents), default=3))
    table = Table(run_column, *(Column(name, overflow="fold") for name in (
        "tenant", "status", "prio", "attempts", "reason", "updated",
        *(["why unroutable"] if unroutable else []))))
    for r in documents:
        table.add_row(r["run_id"], r["tenant"], r["status"], str(r["priority"]),
                      f"{r['attempt_count']}/{r['max_attempts']}", r["reason_code"] or "",
                      r["updated_at"], *([r["unroutable_because"]] if unroutable else []))
    out.print(table)


# --- workers ---------------------------------------------------------------------------


@click.group("workers")
def workers_group() -> None:
    """Workers: their status, heartbeat and leases; drain one remotely."""


@workers_group.command("list")
@click.option("--all", "include_stopped", is_flag=True, help="Also the stopped workers.")
@json_flag
def workers_list(include_stopped: bool, as_json: bool) -> None:
    """Workers, newest first: status, version, queues, capabilities, heartbeat age and
    the leases each holds now."""
    with _lane() as lane:
        found = lane.workers(include_stopped=include_stopped)
    if as_json:
        _print_json([w.model_dump(mode="json") for w in found])
        return
    if not found:
        out.print("no workers" + ("" if include_stopped else " running (--all: stopped too)"))
        return
    table = Table(Column("worker", no_wrap=True, min_width=max(len(w.worker_id) for w in found)),
                  *(Column(name, overflow="fold") for name in (
                      "status", "version", "queues", "heartbeat", "leases", "capabilities")))
    for w in found:
        table.add_row(w.worker_id, w.status + (" (drain asked)" if w.drain_requested_at
                                               and w.status == "READY" else ""),
                      w.version, ",".join(w.queues), _age(w.heartbeat_age_seconds) + " ago",
                      str(w.leases_held),
                      ",".join(f"{k}={v}" for k, v in sorted(w.capabilities.items())))
    out.print(table)


@workers_group.command("drain")
@click.argument("worker_id")
@json_flag
def workers_drain(worker_id: str, as_json: bool) -> None:
    """Ask a worker to drain: at its next heartbeat it stops claiming, lets its runs
    finish within its grace period and gives the rest back for retry, as on SIGTERM."""
    with _lane() as lane:
        found = lane.drain_worker(worker_id)
    if as_json:
        _print_json(found.model_dump(mode="json"))
        return
    out.print(f"worker {found.worker_id} asked to drain ({found.status}, "
              f"{found.leases_held} lease(s) held); it drains at its next heartbeat",
              markup=False, highlight=False)


# --- queues and tenants ----------------------------------------------------------------


@click.group("queues")
def queues_group() -> None:
    """Queues: backlog, oldest ready run, active runs against their limits."""


@queues_group.command("list")
@json_flag
def queues_list(as_json: bool) -> None:
    """Every queue with runs: queued, age of its oldest ready run, active, limits."""
    with _lane() as lane:
        found = lane.queues()
    if as_json:
        _print_json([q.model_dump(mode="json") for q in found])
        return
    table = Table("queue", "queued", "oldest ready", "active", "limits")
    for q in found:
        table.add_row(q.queue, str(q.queued), _age(q.oldest_ready_age_seconds),
                      str(q.active), _limits(q.limits))
    out.print(table)


@click.group("tenants")
def tenants_group() -> None:
    """Tenants: backlog, active runs against limits, fair share, spend against budget."""


@tenants_group.command("list")
@json_flag
def tenants_list(as_json: bool) -> None:
    """Every tenant with runs, spend today or terms in the policy."""
    with _lane() as lane:
        found = lane.tenants()
    if as_json:
        _print_json([t.model_dump(mode="json") for t in found])
        return
    table = Table("tenant", "queued", "oldest ready", "active", "weight", "spent today")
    for t in found:
        table.add_row(
            t.tenant, str(t.queued) + ("" if t.max_queued is None else f"/{t.max_queued}"),
            _age(t.oldest_ready_age_seconds),
            str(t.active) + ("" if t.max_active is None else f"/{t.max_active}"),
            f"{t.weight:g}", f"${t.spent_today_usd:.2f}" + (
                "" if t.daily_budget_usd is None else f" of ${t.daily_budget_usd:.2f}"))
    out.print(table)


# --- policy versions -------------------------------------------------------------------


@policy_app.command("versions")
@json_flag
def policy_versions(as_json: bool) -> None:
    """Every stored version of the policy, newest first (`policy show`: the one in force)."""
    with _lane() as lane:
        found = lane.policy_versions()
    if as_json:
        _print_json([v.model_dump(mode="json") for v in found])
        return
    if not found:
        out.print("no policy applied: every run is admitted, no limits")
        return
    table = Table("version", "applied", "source", "in force")
    for v in found:
        table.add_row(str(v.version), v.created_at.isoformat(timespec="seconds"),
                      v.source or "", "yes" if v.in_force else "")
    out.print(table)


def register(app: click.Group) -> None:
    runs_app.add_command(runs_list)
    for group in (workers_group, queues_group, tenants_group):
        app.add_command(group)
