"""``TopSnapshot`` as Rich renderables: ``frame`` fills the screen (each table cut to
the rows its region holds, "+N more" saying what was cut), ``tables`` prints every row
(``runlane top --once``). Pure: no I/O, no clock but the ``now`` it is given."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.layout import Layout
from rich.padding import Padding
from rich.table import Column, Table
from rich.text import Text

from runlane.models.top import TopSnapshot

# Below this width the queues and tenants tables are stacked, not side by side.
SIDE_BY_SIDE_WIDTH = 120
# A tenant at or above this share of its daily budget is shown in red.
BUDGET_WARNING = 0.9


@dataclass(frozen=True)
class Stale:
    """The source stopped answering at ``since``: the frame shows the last figures."""

    since: datetime
    error: str


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _clock(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%H:%M:%S")


def _of(value: int | None, limit: int | None) -> str:
    shown = "?" if value is None else str(value)
    return shown if limit is None else f"{shown}/{limit}"


def _rate(per_minute: float) -> str:
    return "0" if per_minute == 0 else f"{per_minute:.1f}" if per_minute < 100 \
        else f"{per_minute:.0f}"


def _table(title: str, *columns: Column | str, expand: bool = False) -> Table:
    """One line per row (cut with an ellipsis, never wrapped): a region's rows fit."""
    found = [c if isinstance(c, Column) else Column(c) for c in columns]
    for c in found:
        c.no_wrap = True
        c.overflow = "ellipsis"
    return Table(*found, title=title, title_justify="left", title_style="bold",
                 box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=expand)


def _cut(table: Table, rows: list[tuple[RenderableType, ...]], limit: int | None,
         empty: str) -> Table:
    """``rows`` into ``table``, at most ``limit`` lines of them (one says what was cut)."""
    if not rows:
        table.add_row(Text(empty, style="dim"))
        return table
    if limit is not None and len(rows) > limit:
        shown = max(limit - 1, 0)
        for row in rows[:shown]:
            table.add_row(*row)
        table.add_row(Text(f"+{len(rows) - shown} more", style="dim"))
        return table
    for row in rows:
        table.add_row(*row)
    return table


def queues_table(snap: TopSnapshot, limit: int | None = None, width: int = 160
                 ) -> Table:
    table = _table(f"Queues (claims per minute over {age(snap.claim_span_seconds)})",
                   "queue", Column("depth", justify="right"),
                   Column("oldest ready", justify="right"),
                   Column("claims/min", justify="right"), Column("active", justify="right"))
    return _cut(table, [(q.queue, str(q.queued), age(q.oldest_ready_age_seconds),
                         _rate(q.claims_per_minute), _of(q.active, q.max_active))
                        for q in snap.queues], limit, "no queued or active runs")


def _spend(spent: float, budget: float | None) -> Text:
    if budget is None:
        return Text(f"${spent:.2f}")
    over = (budget > 0 and spent / budget >= BUDGET_WARNING) or spent >= budget
    return Text(f"${spent:.2f} of ${budget:.2f}", style="bold red" if over else "")


def tenants_table(snap: TopSnapshot, limit: int | None = None, width: int = 160
                  ) -> Table:
    table = _table("Tenants", "tenant", Column("queued", justify="right"),
                   Column("active", justify="right"), Column("weight", justify="right"),
                   Column("share", justify="right"), Column("spent today", justify="right"))
    return _cut(table, [(t.tenant, str(t.queued), _of(t.active, t.max_active),
                         f"{t.weight:g}",
                         "-" if t.fair_share is None else f"{t.fair_share:.0%}",
                         _spend(t.spent_today_usd, t.daily_budget_usd))
                        for t in snap.tenants], limit, "no tenants")


def workers_table(snap: TopSnapshot, limit: int | None = None, width: int = 160
                  ) -> Table:
    width = max((len(w.worker_id) for w in snap.workers), default=6)
    table = _table("Workers", Column("worker", min_width=min(width, 60)), "status",
                   Column("heartbeat", justify="right"), Column("leases", justify="right"),
                   "draining")
    style = {"DEAD": "bold red", "DRAINING": "yellow", "STOPPED": "dim"}
    return _cut(table, [(w.worker_id, Text(w.status, style=style.get(w.status, "")),
                         age(w.heartbeat_age_seconds) + " ago", str(w.leases_held),
                         Text("yes", style="yellow") if w.draining else "")
                        for w in snap.workers], limit, "no workers running")


_FAILURE_STATUS = {"FAILED_RETRYABLE": "retried", "FAILED": "failed",
                   "POLICY_DENIED": "denied"}


def failures_table(snap: TopSnapshot, limit: int | None = None, width: int = 160) -> Table:
    """The run id whole; the other columns as the width allows (the message takes what
    is left)."""
    wide = {"status": width >= 100, "ago": width >= 110, "queue": width >= 125,
            "att": width >= 125, "repo": width >= 145}
    reason = max((len(f.reason_code or "-") for f in snap.failures), default=6)
    columns: list[Column | str] = [Column("when", min_width=8), Column("run", min_width=36),
                                   "tenant", Column("reason", min_width=min(reason, 30))]
    columns += [""] * wide["status"] + [Column("ago", justify="right")] * wide["ago"]
    columns += ["queue"] * wide["queue"] + [Column("att", justify="right")] * wide["att"]
    columns += [Column("repo", max_width=40)] * wide["repo"]
    table = _table("Latest failures", *columns, Column("message", ratio=1), expand=True)
    rows: list[tuple[RenderableType, ...]] = []
    for f in snap.failures:
        row: list[RenderableType] = [
            _clock(f.at), f.run_id, f.tenant, Text(f.reason_code or "-", style="bold red")]
        row += [_FAILURE_STATUS.get(f.status, f.status.lower())] * wide["status"]
        # The database's clock against this machine's: never a negative age.
        row += [age(max(0.0, (snap.taken_at - f.at).total_seconds()))] * wide["ago"]
        row += [f.queue] * wide["queue"]
        row += ["-" if f.attempt_no is None else str(f.attempt_no)] * wide["att"]
        row += [f.repo] * wide["repo"]
        rows.append((*row, (f.message or "").replace("\n", " ")))
    return _cut(table, rows, limit, "no failures")


def header(snap: TopSnapshot, *, interval: float | None, stale: Stale | None,
           now: datetime) -> Text:
    """Where the figures come from and when, how often and how to quit (``interval``
    None: a frame printed once); the totals; a red line while the source is down."""
    queued = sum(q.queued for q in snap.queues)
    active = sum(q.active for q in snap.queues)
    claims = sum(q.claims_per_minute for q in snap.queues)
    text = Text.assemble(
        ("runlane top", "bold"), f"  {snap.source}  {_clock(snap.taken_at)} UTC  ",
        ("" if interval is None else f"every {interval:g}s, q quits", "dim"), "\n",
        f"queued {queued}  "
        + (f"awaiting approval {snap.awaiting_approval}  " if snap.awaiting_approval else "")
        + f"active {active}  claims/min {_rate(claims)}  "
        f"workers {len(snap.workers)}",
        no_wrap=True, overflow="ellipsis")
    if stale is not None:
        text.append("\n")
        text.append(f"STALE since {_clock(stale.since)} UTC "
                    f"({age(max(0.0, (now - stale.since).total_seconds()))} ago): "
                    f"{stale.error}; "
                    "showing the last figures, retrying", style="bold white on red")
    return text


Build = Callable[[TopSnapshot, "int | None", int], Table]


class _Fitted:
    """A table built for the region it is drawn in: its width, and (in a Layout) its
    height, the rows cut to fit."""

    def __init__(self, build: Build, snap: TopSnapshot) -> None:
        self.build = build
        self.snap = snap

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width, height = options.max_width, options.height
        if height is None:
            yield self.build(self.snap, None, width)
            return
        empty = self.snap.model_copy(update={
            "queues": [], "tenants": [], "workers": [], "failures": []})
        chrome = len(console.render_lines(self.build(empty, None, width),
                                          options.update(height=None), pad=False)) - 1
        yield self.build(self.snap, max(height - chrome, 1), width)


def frame(snap: TopSnapshot, *, interval: float, stale: Stale | None, now: datetime,
          width: int) -> Layout:
    """The full screen: a header, queues and tenants (side by side when wide enough),
    workers, the latest failures."""
    root = Layout()
    top = Layout(name="fleet", ratio=3)
    queues = Layout(_Fitted(queues_table, snap), name="queues")
    tenants = Layout(_Fitted(tenants_table, snap), name="tenants")
    if width >= SIDE_BY_SIDE_WIDTH:
        top.split_row(queues, tenants)
    else:
        top.split_column(queues, tenants)
    root.split_column(
        Layout(header(snap, interval=interval, stale=stale, now=now), name="header",
               size=3 if stale is None else 4),
        top,
        Layout(_Fitted(workers_table, snap), name="workers", ratio=2),
        Layout(_Fitted(failures_table, snap), name="failures", ratio=3))
    return root


def tables(snap: TopSnapshot) -> Group:
    """Every row of every table, for a frame printed once."""
    parts: Iterable[RenderableType] = (
        header(snap, interval=None, stale=None, now=snap.taken_at),
        *(Padding(_Fitted(build, snap), (1, 0, 0, 0))
          for build in (queues_table, tenants_table, workers_table, failures_table)))
    return Group(*parts)
