"""After the run: every invariant, from the database (``store.invariants``), the
remotes, the forge, the workload's own expectations, the fault record and the logs."""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from sqlalchemy import text

from runlane.chaos.agent import STAMPS_FILE, parse_prompt, plan, read_stamps
from runlane.chaos.harness import EXIT_DATABASE_UNAVAILABLE, Outcome
from runlane.chaos.profiles import PROFILES, ChaosConfig
from runlane.chaos.report import Report
from runlane.codehost.base import branch_name
from runlane.codehost.local_forge import LocalForge
from runlane.domain.retry import MAX_FINALIZE_ONLY_ATTEMPTS
from runlane.services.evidence_audit import remote_audit
from runlane.store import invariants

MARKER = re.compile(r"<!-- agent-run-id: (\S+) -->")
# Reasons only the chaos agent produces here (the worker itself never records them
# in this set-up), so each must be the one its behaviour planned for that attempt.
AGENT_ONLY_REASONS = frozenset({"PROVIDER_RATE_LIMIT", "SANDBOX_START_TIMEOUT",
                                "JUDGE_REJECTED", "AGENT_FAILED", "VERIFIER_FAILED"})
# Reasons the harness's faults cause by design (a run drained past its cap of
# uncharged releases is charged: LEASE_RELEASED_OVER_CAP; a finalize-only attempt that
# finds nothing follows a worker's death before its push landed).
FAULT_REASONS = frozenset({"WORKER_LOST", "LEASE_RELEASED", "LEASE_RELEASED_OVER_CAP",
                           "CANCELLED_BY_USER", "NOTHING_TO_FINALIZE"})
RESTART_SETTLE_SECONDS = 3.0


def _violation(check: str, run_id: str | None, detail: str) -> dict[str, Any]:
    return {"check": check, "run_id": run_id, "detail": detail}


def _rows(outcome: Outcome, statement: str) -> list[Any]:
    assert outcome.store is not None
    with outcome.store.engine.connect() as conn:
        return list(conn.execute(text(statement)))


def evaluate(outcome: Outcome) -> Report:
    c = outcome.config
    store = outcome.store
    assert store is not None
    violations = [_violation(v.check, v.run_id,
                             v.detail if v.run_id is not None else f"{v.subject}: {v.detail}")
                  for v in invariants.check_database(store)]
    runs = {r.run_id: r for r in _rows(outcome, invariants.RUNS_WITH_TASKS)}
    attempts: dict[str, list[Any]] = defaultdict(list)
    for a in _rows(outcome, invariants.ATTEMPTS):
        attempts[a.run_id].append(a)
    notes = list(c.notes)

    violations += _submissions(outcome, runs)
    opened = {r.run_id for r in _rows(outcome, invariants.PULL_REQUESTS_BEGUN)}
    expected, unplanned = _expectations(runs, attempts, opened)
    violations += expected
    code_host, pr_count, branch_count, left_behind = _code_host(outcome, runs)
    violations += code_host
    if left_behind:
        notes.append(f"{left_behind} run(s) that did not succeed left a branch or a pull "
                     "request (pushed before a cancel, or before the last attempt was lost); "
                     "each is recorded in its ledger and none is open (checked)")
    reclaim, reclaim_violations = _reclaim(outcome, attempts)
    violations += reclaim_violations
    log_errors, log_violations = _logs(outcome)
    violations += log_violations
    violations += _exits(outcome, notes)
    violations += _agent_overlaps(outcome, notes)
    if log_errors.get("deadlock_detected"):
        notes.append(f"PostgreSQL broke {log_errors['deadlock_detected']} deadlock(s) between "
                     "runlane sessions (logs: DeadlockDetected); the loser was retried")
    if outcome.stray_agents:
        notes.append(f"{outcome.stray_agents} agent process(es) of killed workers were "
                     "still alive at the end and were killed")
    if outcome.stopped_early:
        notes.append(f"the harness stopped waiting: {outcome.stopped_early}")
    if len(outcome.plans) < outcome.workload:
        violations.append(_violation(
            "workload_not_submitted", None,
            f"only {len(outcome.plans)} of {outcome.workload} tasks were submitted before "
            f"the harness stopped ({outcome.stopped_early or 'no reason'})"))
    campaigns = _campaigns(outcome)
    violations += [_violation("duplicate_campaign_created", None, m)
                   for m in outcome.harness_errors if m.startswith("duplicate campaign")]

    reasons = Counter(a.reason_code or a.status for rows in attempts.values() for a in rows)
    cancels = Counter(r.from_status for r in _rows(outcome, invariants.USER_CANCELS))
    behaviours = Counter(p.behaviour.kind for p in outcome.plans)
    faults = {k: outcome.counts[k] for k in ("kill", "stop", "terminate", "restart",
                                             "duplicate_submit", "duplicate_wakeup",
                                             "duplicate_delivery", "duplicate_campaign",
                                             "cancel", "pr_crash")
              if k in outcome.counts}
    return Report(
        seed=c.seed, profile=c.profile, engine=c.engine, database=outcome.database,
        runs=len(runs), planned=c.runs, workers=c.workers, concurrency=c.concurrency, faults=faults,
        faults_enabled=sorted(c.faults), violations=violations,
        wall_seconds=round(outcome.wall_seconds, 2),
        runs_by_state=dict(Counter(r.status for r in runs.values())),
        outcomes=dict(Counter(r.outcome for r in runs.values() if r.outcome)),
        behaviours=dict(behaviours),
        attempts=sum(len(rows) for rows in attempts.values()),
        attempts_by_reason=dict(reasons), cancels_by_stage=dict(cancels),
        pull_requests=pr_count, branches=branch_count, reclaim=reclaim,
        log_errors=log_errors, unplanned_failures=unplanned, notes=notes, plant=c.plant,
        replay=replay_command(c), campaigns=campaigns)


def _campaigns(outcome: Outcome) -> dict[str, dict[str, Any]]:
    """Each campaign of the workload as it ended: status, planned end, batches released,
    counted finishes, targets by state (``+run``: with a run), stop reason. Its
    invariants are named SQL (``store.invariants``: ``campaign_*``)."""
    found: dict[str, dict[str, Any]] = {
        p.name: {"targets": len(p.targets), "expected": p.expect, "status": None,
                 "by_state": {}} for p in outcome.campaigns}
    for r in _rows(outcome, invariants.CAMPAIGN_SUMMARY):
        entry = found.setdefault(r.name, {"targets": 0, "expected": None, "by_state": {}})
        entry.update(status=r.status, batches_released=int(r.released_batch) + 1,
                     counted_finishes=int(r.finishes), stop_reason=r.stop_reason)
        key = r.state + ("+run" if r.has_run else "")
        entry["by_state"][key] = entry["by_state"].get(key, 0) + int(r.n)
    return found


def replay_command(c: ChaosConfig) -> str:
    """The command that runs the same workload and fault schedule again."""
    base = PROFILES[c.profile]
    parts = ["runlane", "chaos", "--profile", c.profile, "--seed", str(c.seed)]
    for flag, name in (("--engine", "engine"), ("--runs", "runs"), ("--workers", "workers"),
                       ("--concurrency", "concurrency"), ("--kill-every", "kill_every"),
                       ("--stop-every", "stop_every"), ("--terminate-every", "terminate_every"),
                       ("--restarts", "restarts"), ("--lease-ttl", "lease_ttl")):
        value = getattr(c, name)
        if value != getattr(base, name):
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if c.faults != base.faults:
        parts += ["--faults", ",".join(sorted(c.faults)) or "none"]
    if c.pgbouncer:
        parts.append("--pgbouncer")
    if c.plant:
        parts += ["--plant", c.plant]
    if c.agent_sleep is not None:
        parts += ["--agent-sleep", f"{c.agent_sleep:g}"]
    return shlex.join(parts)


# --- submissions: nothing lost, nothing created twice -----------------------------------


def _submissions(outcome: Outcome, runs: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    by_key: dict[str, list[str]] = defaultdict(list)
    for r in runs.values():
        if r.idempotency_key:
            by_key[r.idempotency_key].append(r.run_id)
    for p in outcome.plans:
        if not by_key.get(p.key):
            found.append(_violation("task_missing", outcome.run_of_key.get(p.key),
                                    f"task {p.key} was submitted but is not in the database"))
    for message in outcome.harness_errors:
        if message.startswith("duplicate submit"):
            found.append(_violation("duplicate_submit_created", None, message))
    return found


# --- the workload: each attempt ended as its behaviour planned ---------------------------


def _expectations(runs: dict[str, Any], attempts: dict[str, list[Any]],
                  opened: set[str] | None = None
                  ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Violations, and failures the workload did not plan (faults' doing, or runlane's),
    counted by reason and the start of their message."""
    found = []
    unplanned: Counter[str] = Counter()
    for run_id, run in runs.items():
        b = parse_prompt(run.prompt)
        if b is None:
            continue
        clean_change = False
        if run_id in (opened or set()):
            found.extend(_pr_crash_expectation(run, b, attempts.get(run_id, [])))
        for a in attempts.get(run_id, []):
            step = plan(b, a.attempt_no)
            if step.action == "change" and step.recorded is None:
                clean_change = True
            if a.status == "SUCCEEDED":
                if run.outcome == "pull_request" and not clean_change:
                    found.append(_violation(
                        "unexpected_outcome", run_id,
                        f"attempt {a.attempt_no} opened a pull request; behaviour {b.kind} "
                        "never made a change that should succeed"))
                if run.outcome == "no_changes" and step.action != "nochange":
                    found.append(_violation(
                        "unexpected_outcome", run_id,
                        f"attempt {a.attempt_no} ended no_changes; behaviour {b.kind} "
                        f"planned {step.action} (work lost)"))
            elif a.status == "FAILED" and a.reason_code != step.recorded:
                if a.reason_code in AGENT_ONLY_REASONS:
                    found.append(_violation(
                        "unexpected_reason", run_id,
                        f"attempt {a.attempt_no} failed {a.reason_code}; behaviour {b.kind} "
                        f"planned {step.recorded or 'success'}"))
                elif a.reason_code not in FAULT_REASONS:
                    unplanned[f"{a.reason_code}: {(a.message or '')[:240]}"] += 1
    return found, dict(unplanned)


def _pr_crash_expectation(run: Any, b: Any, attempts: list[Any]) -> list[dict[str, Any]]:
    """A run whose worker died after the code host opened its pull request (the fault
    pr_crash, on its last attempt too) ends SUCCEEDED with that pull request recorded,
    through finalize-only attempts; unless the harness's own faults took every one of
    those it may get. Asked only of runs whose ledger holds a pull request: a harness
    fault that took attempt ``crash`` before it got that far (a SIGKILL, a SIGSTOP
    past the lease) leaves nothing to finish."""
    if not b.crash:
        return []
    died = [a for a in attempts if a.attempt_no == b.crash]
    if not died or died[0].reason_code != "WORKER_LOST":
        return []  # the crash did not happen (a fault came first): nothing planned
    if run.status == "SUCCEEDED" and run.outcome == "pull_request":
        return []
    later = [a for a in attempts if a.attempt_no > b.crash]
    lost = sum(1 for a in later if a.reason_code in ("WORKER_LOST", "LEASE_RELEASED"))
    if lost >= MAX_FINALIZE_ONLY_ATTEMPTS:
        return []
    return [_violation("pull_request_crash_not_finished", run.run_id,
                       f"attempt {b.crash} died after its pull request was opened; the run "
                       f"ended {run.status} {run.reason_code} after {len(later)} more "
                       "attempt(s), instead of SUCCEEDED with that pull request recorded")]


# --- remotes and forge ----------------------------------------------------------------------


def _branches(remote: Path) -> dict[str, str]:
    """agent/* branch name -> the message of its head commit."""
    out = subprocess.run(
        ["git", "--git-dir", str(remote), "for-each-ref",
         "--format=%(refname:lstrip=2)%00%(contents)%01", "refs/heads/agent/"],
        capture_output=True, text=True, check=True).stdout
    found = {}
    for record in out.split("\x01"):
        name, sep, message = record.strip("\n").partition("\x00")
        if sep:
            found[name] = message
    return found


def _code_host(outcome: Outcome, runs: dict[str, Any]
               ) -> tuple[list[dict[str, Any]], int, int, int]:
    found = []
    forge = LocalForge(outcome.forge)
    branches_of: dict[str, list[str]] = defaultdict(list)
    prs_of: dict[str, list[Any]] = defaultdict(list)
    n_branches = n_prs = 0
    for remote in outcome.remotes:
        for name, message in _branches(remote).items():
            n_branches += 1
            parts = name.split("/")
            run_id = parts[2] if len(parts) == 3 else ""
            run = runs.get(run_id)
            if run is None or branch_name(run.task_id, run_id) != name:
                found.append(_violation("branch_of_unknown_run", run_id or None,
                                        f"{remote.name}: {name}"))
                continue
            branches_of[run_id].append(name)
            if f"Agent-Run-ID: {run_id}" not in message:
                found.append(_violation("branch_without_trailer", run_id, name))
        for pr in forge.list_pull_requests(str(remote)):
            n_prs += 1
            markers = MARKER.findall(pr.body)
            run_id = markers[0] if markers else ""
            run = runs.get(run_id)
            if run is None or pr.head_branch != branch_name(run.task_id, run_id):
                found.append(_violation("pull_request_of_unknown_run", run_id or None,
                                        f"{remote.name}#{pr.number} from {pr.head_branch}"))
                continue
            prs_of[run_id].append(pr)
    assert outcome.store is not None
    recorded = {p["run_id"]: p for p in outcome.store.pull_requests()}
    left_behind = 0
    for run_id, run in runs.items():
        branches, prs = branches_of.get(run_id, []), prs_of.get(run_id, [])
        if len(branches) > 1:
            found.append(_violation("two_branches", run_id, ", ".join(branches)))
        if len(prs) > 1:
            found.append(_violation("two_pull_requests", run_id,
                                    ", ".join(f"#{p.number}" for p in prs)))
        if run.status == "SUCCEEDED" and run.outcome == "pull_request":
            if len(branches) != 1 or len(prs) != 1:
                found.append(_violation(
                    "succeeded_without_branch_or_pull_request", run_id,
                    f"{len(branches)} branch(es), {len(prs)} pull request(s)"))
            elif run_id in recorded and recorded[run_id]["number"] != prs[0].number:
                found.append(_violation(
                    "ledger_disagrees_with_forge", run_id,
                    f"ledger #{recorded[run_id]['number']}, forge #{prs[0].number}"))
        elif run.status == "SUCCEEDED" and (branches or prs):
            found.append(_violation("no_changes_with_branch_or_pull_request", run_id,
                                    f"{len(branches)} branch(es), {len(prs)} pull request(s)"))
        elif run.status != "SUCCEEDED" and (branches or prs):
            left_behind += 1
    # Runs that ended without success with a push or a pull request in their ledger:
    # none may leave an open pull request or a branch its ledger does not record
    # (``runlane audit --remote-checks``, the same code).
    evidence = remote_audit(outcome.store, lambda repo: LocalForge(outcome.forge),
                            limit=max(1, len(runs)))
    found.extend(_violation(v.check, v.run_id, v.detail) for v in evidence.violations)
    return found, n_prs, n_branches, left_behind


# --- death -> reclaim -----------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _reclaim(outcome: Outcome, attempts: dict[str, list[Any]]
             ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """For each SIGKILL or SIGSTOP, each lease the worker held at that instant: the
    time until the run's next attempt began (its claim)."""
    c = outcome.config
    budget = c.reclaim_budget
    registered: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for w in _rows(outcome, invariants.WORKERS):
        parts = str(w.worker_id).split("/")
        if len(parts) >= 3 and parts[-2].isdigit():
            registered[int(parts[-2])].append((float(w.started_at), w.worker_id))
    by_worker: dict[str, list[Any]] = defaultdict(list)
    for rows in attempts.values():
        for a in rows:
            by_worker[a.worker_id].append(a)
    next_attempt = {(a.run_id, a.attempt_no): a for rows in attempts.values() for a in rows}
    recovered = {(r.run_id, r.attempt_no): float(r.at)
                 for r in _rows(outcome, invariants.RECOVERIES)}
    samples: list[float] = []
    to_requeue: list[float] = []  # death -> the reaper took the lease back
    to_claim: list[float] = []  # ... -> the next claim (backoff, poll, a free slot)
    slowest: list[dict[str, Any]] = []
    during_restart: list[float] = []
    during_stall: list[float] = []
    ended_instead = 0
    found: list[dict[str, Any]] = []
    for fault in outcome.faults:
        if fault.kind not in ("kill", "stop", "pr_crash") or fault.pid is None:
            continue
        candidates = [wid for at, wid in sorted(registered.get(fault.pid, []))
                      if at <= fault.at + 1.0]
        if not candidates:
            continue  # killed before it registered: it held nothing
        for a in by_worker.get(candidates[-1], []):
            held = a.started_at <= fault.at and (a.lease_ended_at is None or
                                                 a.lease_ended_at > fault.at)
            if not held:
                continue
            later = next_attempt.get((a.run_id, a.attempt_no + 1))
            if later is None:
                if a.lease_status == "ACTIVE":
                    found.append(_violation("never_reclaimed", a.run_id,
                                            f"{fault.kind} of pid {fault.pid}: lease of "
                                            f"attempt {a.attempt_no} never taken back"))
                else:
                    ended_instead += 1
                continue
            latency = float(later.started_at) - fault.at
            near_restart = any(start - budget <= fault.at <= end + RESTART_SETTLE_SECONDS
                               for start, end in outcome.restart_windows)
            # A paused worker holding SQLite's write lock stops every writer, the
            # reaper too, until it resumes: a database outage, not a slow recovery.
            near_stall = not near_restart and any(
                start - budget <= fault.at <= end for start, end in outcome.lock_stall_windows)
            (during_restart if near_restart else
             during_stall if near_stall else samples).append(latency)
            back = recovered.get((a.run_id, a.attempt_no))
            if back is not None and not (near_restart or near_stall):
                to_requeue.append(back - fault.at)
                to_claim.append(float(later.started_at) - back)
            slowest.append({
                "run_id": a.run_id, "fault": fault.kind, "latency": round(latency, 3),
                "lease_expired_after": round(float(a.lease_expires_at) - fault.at, 3),
                "recovered_after": None if back is None else round(back - fault.at, 3),
                "near_restart": near_restart, "near_lock_stall": near_stall})
    reclaim: dict[str, Any] = {"samples": len(samples), "budget": budget,
                               "ended_without_reclaim": ended_instead,
                               "during_restart": len(during_restart),
                               "during_lock_stall": len(during_stall)}
    if samples:
        reclaim.update({"p50": round(_percentile(samples, 0.5), 3),
                        "p95": round(_percentile(samples, 0.95), 3),
                        "p99": round(_percentile(samples, 0.99), 3),
                        "max": round(max(samples), 3)})
        if reclaim["p99"] > budget:
            found.append(_violation(
                "reclaim_p99_over_budget", None,
                f"p99 {reclaim['p99']:.2f}s from a worker's death to its run's next claim; "
                f"budget {budget:.2f}s (lease TTL + reaper interval + 1 s)"))
    for name, values in (("death_to_recovery", to_requeue), ("recovery_to_claim", to_claim)):
        if values:
            reclaim[name] = {"p50": round(_percentile(values, 0.5), 3),
                             "p99": round(_percentile(values, 0.99), 3),
                             "max": round(max(values), 3)}
    if during_restart:
        reclaim["during_restart_max"] = round(max(during_restart), 3)
    if during_stall:
        reclaim["during_lock_stall_max"] = round(max(during_stall), 3)
    reclaim["slowest"] = sorted(slowest, key=lambda x: -x["latency"])[:5]
    return reclaim, found


# --- logs and processes ---------------------------------------------------------------------


def _logs(outcome: Outcome) -> tuple[dict[str, int], list[dict[str, Any]]]:
    errors: Counter[str] = Counter()
    found = []
    locked = outcome.counts.get("database_locked", 0)
    for message in outcome.harness_errors:
        if "database is locked" in message:
            found.append(_violation("database_locked", None, f"harness: {message}"))
    for path in outcome.logs:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if isinstance(entry, dict):
                if entry.get("level") in ("error", "critical"):
                    errors[str(entry.get("event"))] += 1
                if "deadlock detected" in line:  # resolved by the server, retried: a note
                    errors["deadlock_detected"] += 1
                if "database is locked" in line:
                    locked += 1
                    found.append(_violation("database_locked", None,
                                            f"{path.name}: {entry.get('event')}: "
                                            f"{str(entry.get('error', ''))[:200]}"))
            elif "database is locked" in line:
                found.append(_violation("database_locked", None, f"{path.name}: {line[:200]}"))
            elif line.startswith("Exception in thread") or line.startswith("Traceback"):
                found.append(_violation("uncaught_exception", None,
                                        f"{path.name}: {line[:200]}"))
    return dict(errors), found


def _agent_overlaps(outcome: Outcome, notes: list[str]) -> list[dict[str, Any]]:
    """No two agents of one run were ever alive at once (runlane's first promise, as
    the agents themselves tell it): each agent's life is its ``start`` stamp to its
    ``stop``, or to its last ``alive`` stamp when it was killed (it lived a little
    longer, by less than the stamp interval: an overlap shorter than that is missed,
    none is ever invented)."""
    lives: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for path in (outcome.directory / "artifacts").glob(f"*/*/{STAMPS_FILE}"):
        life = read_stamps(path)
        if life is not None:
            lives[path.parent.parent.name].append((*life, path.parent.name))
    violations = []
    for run_id, runs_lives in sorted(lives.items()):
        runs_lives.sort()
        alive_until, alive_attempt = runs_lives[0][1], runs_lives[0][2]
        for start, end, attempt in runs_lives[1:]:
            if start < alive_until:
                violations.append(_violation(
                    "agents_overlapped", run_id,
                    f"attempt {attempt}'s agent started while attempt {alive_attempt}'s was "
                    f"still alive ({alive_until - start:.2f} s of overlap, from their stamps)"))
            if end > alive_until:
                alive_until, alive_attempt = end, attempt
    notes.append(f"{sum(len(v) for v in lives.values())} agent lifetimes from their own "
                 f"stamps, over {len(lives)} runs: {len(violations)} overlap(s)")
    return violations


def _exits(outcome: Outcome, notes: list[str]) -> list[dict[str, Any]]:
    """A process that exited on its own is a violation, except a start that found the
    database unreachable (exit 4) while the harness was cutting sessions or restarting
    the server: it is started again."""
    found = []
    unavailable = 0
    db_faults = outcome.counts.get("terminate", 0) + outcome.counts.get("restart", 0)
    for role, pid, code, last in outcome.exits:
        if code == EXIT_DATABASE_UNAVAILABLE and db_faults:
            unavailable += 1
            continue
        found.append(_violation("process_exited", None,
                                f"{role} pid {pid} exited with {code}: {last}"))
    if unavailable:
        notes.append(f"{unavailable} process start(s) lost their database session to a "
                     "fault and exited 4; they were started again")
    return found
