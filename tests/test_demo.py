"""`runlane demo` (what `make demo` runs): real worker processes, one SIGKILLed, one
task cancelled; it finishes in time and its summary agrees with what it leaves
behind (the database, the forge, the bare repositories)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from runlane.api import Runlane


def test_demo_summary_agrees_with_its_database(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "runlane", "demo", "--directory",
                             str(tmp_path / "demo"), "--json"], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["violations"] == []
    assert summary["wall_seconds"] < 60
    lane = Runlane(summary["database"])
    runs = lane.runs()
    assert dict(Counter(r["status"] for r in runs)) == summary["runs_by_state"]
    assert summary["runs_by_state"] == {"SUCCEEDED": 11, "CANCELLED": 1, "POLICY_DENIED": 1}
    assert summary["admission"] == {"ADMIT": 12,
                                    "DENY REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT": 1}
    # The policy's per-tenant limit held (and was reached) while workers raced.
    assert max(summary["peak_active_per_tenant"].values()) <= 3
    assert 3 in summary["peak_active_per_tenant"].values()
    attempts = [a for r in runs for a in lane.run(r["run_id"])["attempts"]]
    assert len(attempts) == summary["attempts"]
    reasons = Counter(a["reason_code"] for a in attempts if a["reason_code"])
    assert dict(reasons) == summary["attempts_by_reason"]
    # What the demo promises to show: rate limits retried, a killed worker's run
    # recovered by another worker, a cancel delivered to a running agent.
    assert reasons["PROVIDER_RATE_LIMIT"] >= 1  # 2 unless the killed worker held one
    assert reasons["WORKER_LOST"] >= 1
    assert reasons["CANCELLED_BY_USER"] == 1
    assert summary["worker_restarts"] >= 1
    recovered = lane.run(summary["recovered_run"])
    assert recovered["status"] == "SUCCEEDED"
    assert len({a["worker_id"] for a in recovered["attempts"]}) == 2
    # One branch and one pull request per run with changes, none for the rest.
    prs = lane.pull_requests()
    assert len(prs) == summary["pull_requests"] == summary["agent_branches"] == 10
    assert Counter(r["outcome"] for r in runs if r["outcome"]) == {"pull_request": 10,
                                                                 "no_changes": 1}
    assert len({p["run_id"] for p in prs}) == 10
    assert summary["duplicate_submits_ignored"] == 2
    assert lane.audit() == []
    # It ends with the command that serves this database and a token that signs in.
    dashboard = summary["dashboard"]
    assert dashboard["command"].endswith(f"--database-url {summary['database']} serve")
    assert lane.authenticate(dashboard["token"]).is_admin
    lane.close()
