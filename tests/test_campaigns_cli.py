"""`runlane campaign ...` as a user runs it (SQLite; the logic's tests on both engines
are in test_campaigns.py): README's commands on examples/campaign.toml, `--json`
documents, one-line errors with their exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .support import cli_env, one_line_error

ROOT = Path(__file__).resolve().parents[1]


def run(url: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                          capture_output=True, text=True, cwd=cwd, env=cli_env(cwd), timeout=60)


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, (result.stdout, result.stderr[-2000:])
    return result


def as_json(url: str, cwd: Path, *args: str) -> Any:
    return json.loads(ok(run(url, cwd, *args, "--json")).stdout)


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'runlane.db'}"
    ok(run(url, tmp_path, "db", "upgrade"))
    return url


def test_the_readme_commands_on_the_example_campaign(url: str, tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "campaign.toml").write_text(
        (ROOT / "examples" / "campaign.toml").read_text())
    made = as_json(url, tmp_path, "campaign", "create", "examples/campaign.toml")
    assert (made["name"], made["created"], made["targets"]) == ("migrate-api-x-to-y", True, 2)
    again = ok(run(url, tmp_path, "campaign", "create", "examples/campaign.toml"))
    assert "exists already (nothing created)" in again.stdout
    ok(run(url, tmp_path, "maintain", "--once"))  # the scheduler pass dispatches the canary
    shown = as_json(url, tmp_path, "campaign", "show", "migrate-api-x-to-y")
    assert shown["by_state"]["ACTIVE"] == 2 and shown["by_batch"][0]["size"] == 2
    assert as_json(url, tmp_path, "campaign", "pause", "migrate-api-x-to-y")["status"] \
        == "PAUSED"
    report = ok(run(url, tmp_path, "campaign", "report", "migrate-api-x-to-y")).stdout
    assert report.startswith("# Campaign migrate-api-x-to-y (platform)")
    assert report == ok(run(url, tmp_path, "campaign", "show", "migrate-api-x-to-y",
                            "--format", "markdown")).stdout
    stopped = as_json(url, tmp_path, "campaign", "stop", "migrate-api-x-to-y",
                      "--cancel-running")
    assert (stopped["status"], stopped["stop_reason"], stopped["cancelled_running"]) == (
        "STOPPED", "stopped by user", 0)
    runs = as_json(url, tmp_path, "runs", "list")
    assert {(r["status"], r["reason_code"]) for r in runs} == {("CANCELLED",
                                                                "CAMPAIGN_STOPPED")}


def test_bad_input_is_one_line(url: str, tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('name = "c"\ntenant = "acme"\nprompt = "x {team}"\n'
                                     '[[targets]]\nrepo = "/srv/a.git"\n')
    one_line_error(run(url, tmp_path, "campaign", "create", "c.toml"), 2,
                   "c.toml: targets[0]: /srv/a.git has no variable 'team'")
    (tmp_path / "d.toml").write_text('name = "d"\ntenant = "acme"\nprompt = "x"\n'
                                     'targets_file = "none.txt"\n')
    one_line_error(run(url, tmp_path, "campaign", "create", "d.toml"), 2,
                   "d.toml: targets_file: cannot read")
    one_line_error(run(url, tmp_path, "campaign", "pause", "nope"), 3, "no campaign 'nope'")
