"""`runlane demo` (what `make demo` runs): it finishes, and its summary agrees with the
database it leaves behind."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from runlane.api import Runlane


def test_demo_summary_agrees_with_its_database(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "runlane", "demo", "--directory",
                             str(tmp_path), "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["violations"] == []
    assert summary["wall_seconds"] < 60
    lane = Runlane(f"sqlite:///{tmp_path / 'runlane.db'}")
    runs = lane.runs()
    assert dict(Counter(r["status"] for r in runs)) == summary["runs_by_state"]
    assert summary["runs_by_state"] == {"SUCCEEDED": 9, "CANCELLED": 1}
    attempts = [a for r in runs for a in lane.run(r["run_id"])["attempts"]]
    assert len(attempts) == summary["attempts"]
    reasons = Counter(a["reason_code"] for a in attempts if a["reason_code"])
    assert dict(reasons) == summary["attempts_by_reason"]
    # What the demo promises to show: a rate limit retried, a dead worker recovered,
    # a cancel delivered to a running worker, duplicate submits ignored.
    assert reasons["PROVIDER_RATE_LIMIT"] == 2
    assert reasons["WORKER_LOST"] == 1
    assert reasons["CANCELLED_BY_USER"] == 1
    assert summary["duplicate_submits_ignored"] == 2
    assert lane.audit() == []
    lane.close()
