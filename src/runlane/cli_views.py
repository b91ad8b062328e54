"""``runlane workers list|drain``, ``runlane queues list``, ``runlane tenants list`` and
``runlane policy versions``: the fleet views, thin over the facade (api_views.py). The
CLI holds the database's own credentials: it is the operator and sees everything."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from runlane.cli_common import _lane, json_flag, out
from runlane.cli_output import Col, chosen_output, output_options, print_json, render
from runlane.domain.tasks import TaskInvalid

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


# --- workers ---------------------------------------------------------------------------


@click.group("workers")
def workers_group() -> None:
    """Workers: their status, heartbeat and leases; drain one remotely."""


@workers_group.command("list")
@click.option("--all", "include_stopped", is_flag=True, help="Also the stopped workers.")
@output_options
def workers_list(include_stopped: bool, output: str | None, as_json: bool) -> None:
    """Workers, newest first: status, version, queues, capabilities, heartbeat age and
    the leases each holds now."""
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        found = lane.workers(include_stopped=include_stopped)
    columns = (
        Col("worker", lambda w: w.worker_id, ident=True, key="worker_id"),
        Col("status", lambda w: w.status + (" (drain asked)" if w.drain_requested_at
                                            and w.status == "READY" else ""), ident=True),
        Col("leases", lambda w: w.leases_held, right=True, key="leases_held"),
        Col("heartbeat", lambda w: w.heartbeat_age_seconds,
            short=lambda w: _age(w.heartbeat_age_seconds) + " ago", drop=1,
            key="heartbeat_age_seconds"),
        Col("queues", lambda w: ",".join(w.queues), drop=2),
        Col("version", lambda w: w.version, drop=4),
        Col("capabilities", lambda w: ",".join(f"{k}={v}" for k, v in
                                               sorted(w.capabilities.items())), drop=3),
    )
    render(found, columns, fmt, json_document=lambda: [w.model_dump(mode="json")
                                                       for w in found],
           empty="no workers" + ("" if include_stopped else " running (--all: stopped too)"),
           console=out)


@workers_group.command("drain")
@click.argument("worker_id")
@json_flag
def workers_drain(worker_id: str, as_json: bool) -> None:
    """Ask a worker to drain: at its next heartbeat it stops claiming, lets its runs
    finish within its grace period and gives the rest back for retry, as on SIGTERM."""
    with _lane() as lane:
        found = lane.drain_worker(worker_id)
    if as_json:
        print_json(found.model_dump(mode="json"))
        return
    out.print(f"worker {found.worker_id} asked to drain ({found.status}, "
              f"{found.leases_held} lease(s) held); it drains at its next heartbeat",
              markup=False, highlight=False, soft_wrap=True)


# --- queues and tenants ----------------------------------------------------------------


@click.group("queues")
def queues_group() -> None:
    """Queues: backlog, oldest ready run, active runs against their limits."""


@queues_group.command("list")
@output_options
def queues_list(output: str | None, as_json: bool) -> None:
    """Every queue with runs: queued, age of its oldest ready run, active, limits."""
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        found = lane.queues()
    columns = (
        Col("queue", lambda q: q.queue, ident=True),
        Col("queued", lambda q: q.queued, right=True),
        Col("oldest ready", lambda q: q.oldest_ready_age_seconds,
            short=lambda q: _age(q.oldest_ready_age_seconds), drop=1,
            key="oldest_ready_age_seconds"),
        Col("active", lambda q: q.active, right=True),
        Col("limits", lambda q: _limits(q.limits), drop=2),
    )
    render(found, columns, fmt, json_document=lambda: [q.model_dump(mode="json")
                                                       for q in found],
           empty="no queues with runs", console=out)


@click.group("tenants")
def tenants_group() -> None:
    """Tenants: backlog, active runs against limits, fair share, spend against budget."""


@tenants_group.command("list")
@output_options
def tenants_list(output: str | None, as_json: bool) -> None:
    """Every tenant with runs, spend today or terms in the policy."""
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        found = lane.tenants()
    columns = (
        Col("tenant", lambda t: t.tenant, ident=True),
        Col("queued", lambda t: t.queued,
            short=lambda t: str(t.queued) + ("" if t.max_queued is None
                                             else f"/{t.max_queued}"), right=True),
        Col("oldest ready", lambda t: t.oldest_ready_age_seconds,
            short=lambda t: _age(t.oldest_ready_age_seconds), drop=1,
            key="oldest_ready_age_seconds"),
        Col("active", lambda t: t.active,
            short=lambda t: str(t.active) + ("" if t.max_active is None
                                             else f"/{t.max_active}"), right=True),
        Col("weight", lambda t: t.weight, drop=2),
        Col("spent today", lambda t: t.spent_today_usd,
            short=lambda t: f"${t.spent_today_usd:.2f}" + (
                "" if t.daily_budget_usd is None else f" of ${t.daily_budget_usd:.2f}"),
            key="spent_today_usd"),
    )
    render(found, columns, fmt, json_document=lambda: [t.model_dump(mode="json")
                                                       for t in found],
           empty="no tenants with runs", console=out)


# --- policy versions -------------------------------------------------------------------


@click.command("versions")
@output_options
def policy_versions(output: str | None, as_json: bool) -> None:
    """Every stored version of the policy, newest first (`policy show`: the one in force)."""
    fmt = chosen_output(output, as_json)
    with _lane() as lane:
        found = lane.policy_versions()
    columns = (
        Col("version", lambda v: v.version, ident=True),
        Col("applied", lambda v: v.created_at, key="created_at"),
        Col("in force", lambda v: v.in_force, key="in_force"),
        Col("source", lambda v: v.source, drop=1),
    )
    render(found, columns, fmt, json_document=lambda: [v.model_dump(mode="json")
                                                       for v in found],
           empty="no policy applied: every run is admitted, no limits", console=out)


def register(app: click.Group, policy: click.Group) -> None:
    """The groups on the top-level command, `versions` on its `policy` group."""
    for group in (workers_group, queues_group, tenants_group):
        app.add_command(group)
    policy.add_command(policy_versions)
