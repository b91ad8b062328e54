"""The harness's report: one JSON document, or tables for a person."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

# Which checks count as a lost, a doubled or a stuck run in the summary line.
LOST = frozenset({"task_without_run", "task_missing", "attempts_not_contiguous",
                  "unexpected_outcome"})
DOUBLED = frozenset({"two_active_leases", "overlapping_leases", "task_with_two_runs",
                     "two_pull_requests", "two_branches", "duplicate_submit_created",
                     "stale_token_write", "side_effect_with_stale_token",
                     "claimed_after_cancel", "attempt_after_end", "campaign_target_tasks",
                     "campaign_task_not_its_targets", "duplicate_campaign_created"})
STUCK = frozenset({"run_not_terminal", "workload_not_submitted", "attempt_left_open",
                   "never_reclaimed", "campaign_not_ended"})


@dataclass
class Report:
    seed: int
    profile: str
    engine: str
    database: str
    runs: int
    planned: int
    workers: int
    concurrency: int
    faults: dict[str, int]
    faults_enabled: list[str]
    violations: list[dict[str, Any]]
    wall_seconds: float
    runs_by_state: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    behaviours: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    attempts_by_reason: dict[str, int] = field(default_factory=dict)
    cancels_by_stage: dict[str, int] = field(default_factory=dict)
    pull_requests: int = 0
    branches: int = 0
    reclaim: dict[str, Any] = field(default_factory=dict)
    log_errors: dict[str, int] = field(default_factory=dict)
    unplanned_failures: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plant: str | None = None
    directory: str | None = None
    replay: str = ""
    campaigns: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> dict[str, int]:
        checks = Counter(v["check"] for v in self.violations)
        kinds = {"lost": LOST, "doubled": DOUBLED, "stuck": STUCK}
        counts = {k: sum(n for c, n in checks.items() if c in names)
                  for k, names in kinds.items()}
        counts["other"] = sum(checks.values()) - sum(counts.values())
        return counts

    def document(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["summary"] = self.summary()
        doc["ok"] = self.ok
        return doc


def _counts(title: str, counts: dict[str, int], key: str = "") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(key)
    table.add_column("n", justify="right")
    for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        table.add_row(name, str(n))
    return table


def render(report: Report, console: Console, *, limit: int = 25) -> None:
    s = report.summary()
    head = Table(title=f"runlane chaos - profile {report.profile}, seed {report.seed}",
                 title_justify="left", show_header=False)
    head.add_column()
    head.add_column()
    rows = [
        ("engine", f"{report.engine} ({report.database})"),
        ("processes", f"{report.workers} workers x {report.concurrency} slots"),
        ("runs", f"{report.runs} of {report.planned} planned in {report.wall_seconds:.1f}s, "
                 f"{report.attempts} attempts"),
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items())) or "none"),
        ("pull requests", f"{report.pull_requests} ({report.branches} agent branches)"),
        ("death -> reclaim", _reclaim_line(report.reclaim)),
        ("result", f"{s['lost']} lost, {s['doubled']} doubled, {s['stuck']} stuck, "
                   f"{s['other']} other: {len(report.violations)} violation(s)"),
    ]
    for name, cam in sorted(report.campaigns.items()):
        states = ", ".join(f"{k} {v}" for k, v in sorted(cam.get("by_state", {}).items()))
        rows.append((f"campaign {name}",
                     f"{cam.get('status')} (planned {cam.get('expected')}), "
                     f"{cam.get('batches_released', 0)} batch(es) released: {states}"))
    if report.plant:
        rows.insert(0, ("planted bug", report.plant))
    for name, value in rows:
        head.add_row(name, value)
    console.print(head)
    console.print(_counts("runs by state", report.runs_by_state, "state"))
    console.print(_counts("attempts ended by", report.attempts_by_reason, "reason"))
    if report.cancels_by_stage:
        console.print(_counts("cancels by the stage they found", report.cancels_by_stage,
                              "stage"))
    if report.unplanned_failures:
        console.print(_counts("failures the workload did not plan", report.unplanned_failures,
                              "reason: message"))
    for note in report.notes:
        console.print(f"note: {note}", soft_wrap=True, markup=False)
    if report.violations:
        table = Table(title="violations", title_justify="left")
        for column in ("check", "run", "detail"):
            table.add_column(column)
        for v in report.violations[:limit]:
            table.add_row(v["check"], str(v["run_id"] or ""), v["detail"])
        console.print(table)
        if len(report.violations) > limit:
            more = Counter(v["check"] for v in report.violations[limit:])
            console.print(f"... and {len(report.violations) - limit} more: "
                          + ", ".join(f"{k} {n}" for k, n in more.items()), markup=False)
        console.print("[red]invariants violated[/red]")
    else:
        console.print("[green]all invariants hold[/green]")
    console.print(f"replay: {report.replay}", soft_wrap=True, markup=False)
    if report.directory:
        console.print(f"kept: {report.directory}", soft_wrap=True, markup=False)


def _reclaim_line(reclaim: dict[str, Any]) -> str:
    if not reclaim.get("samples"):
        return "no samples"
    return (f"p50 {reclaim['p50']:.2f}s, p99 {reclaim['p99']:.2f}s, max {reclaim['max']:.2f}s "
            f"over {reclaim['samples']} (budget {reclaim['budget']:.2f}s)"
            + "".join(f"; {reclaim[key]} more {label}, max {reclaim[key + '_max']:.2f}s"
                      for key, label in (("during_restart", "within a restart"),
                                         ("during_lock_stall", "behind a paused writer"))
                      if reclaim.get(key)))
