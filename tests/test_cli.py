"""The CLI as users script it: real subprocesses, JSON on stdout, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runlane.store import migrate
from runlane.store.store import Store

from .support import execute, spec


class CLI:
    def __init__(self, url: str, cwd: Path) -> None:
        self.url = url
        self.cwd = cwd

    def __call__(self, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        result = subprocess.run([sys.executable, "-m", "runlane", "--database-url", self.url,
                                 *args], capture_output=True, text=True, cwd=self.cwd, env=env,
                                timeout=60)
        assert result.returncode == code, (result.stdout, result.stderr)
        if code not in (0, 1):
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
            assert "Traceback" not in result.stderr
        return result

    def json(self, *args: str, code: int = 0) -> Any:
        return json.loads(self(*args, "--json", code=code).stdout)


@pytest.fixture
def cli(db_url: str, tmp_path: Path) -> CLI:
    return CLI(db_url, tmp_path)


def test_db_upgrade_is_repeatable(cli: CLI) -> None:
    head = migrate.head_revision()
    assert cli.json("db", "upgrade") == {"from": head, "to": head, "changed": False}


def test_submit_show_list_cancel(cli: CLI) -> None:
    sub = cli.json("submit", "--no-repo-check",
                   "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "p",
                   "--priority", "high", "--idempotency-key", "k1")
    assert sub["status"] == "QUEUED" and sub["created"]
    again = cli.json("submit", "--no-repo-check",
                     "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "p",
                     "--priority", "high", "--idempotency-key", "k1")
    assert (again["run_id"], again["created"]) == (sub["run_id"], False)
    [run] = cli.json("runs", "list")
    for field in ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
                  "attempt_count", "created_at", "updated_at", "reason_code", "outcome",
                  "cost_usd"):
        assert field in run
    assert run["priority"] == 50
    shown = cli.json("runs", "show", sub["run_id"])
    assert shown["attempts"] == [] and shown["events"][0]["to_status"] == "QUEUED"
    assert cli.json("runs", "list", "--status", "CANCELLED") == []
    cancelled = cli.json("cancel", sub["task_id"])
    assert cancelled["runs"] == [{"run_id": sub["run_id"], "status": "CANCELLED"}]
    assert [r["status"] for r in cli.json("runs", "list", "--tenant", "acme")] == ["CANCELLED"]
    assert cli.json("audit") == {"ok": True, "violations": []}


def test_batch_submit_is_all_or_nothing(cli: CLI, tmp_path: Path) -> None:
    good = {"tenant": "acme", "repo": "/srv/git/a.git", "prompt": "p"}
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({**good, "prompt": f"p{i}"}) for i in range(3))
                    + "\n" + json.dumps({**good, "priority": "soon"}) + "\n")
    result = cli("submit", "--no-repo-check", "--batch", str(path), code=2)
    assert "line 4: priority" in result.stderr
    assert cli.json("runs", "list") == []
    path.write_text("\n".join(json.dumps({**good, "prompt": f"p{i}"}) for i in range(3)))
    assert len(cli.json("submit", "--no-repo-check", "--batch", str(path))) == 3
    assert len(cli.json("runs", "list")) == 3


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (("runs", "show", "nope"), 3, "no run 'nope'"),
        (("cancel", "nope"), 3, "no task 'nope'"),
        (("runs", "list", "--bogus"), 2, "--bogus"),
        (("runs", "list", "--status", "DONE"), 2, "--status"),
        (("submit", "--no-repo-check",
          "--tenant", "", "--repo", "/x", "--prompt", "p"), 2, "tenant"),
        (("submit", "--no-repo-check",
          "--tenant", "a", "--repo", "ftp://h/x", "--prompt", "p"), 2, "repo"),
        (("submit", "--no-repo-check",
          "--tenant", "a", "--repo", "/x", "--prompt", "p", "--priority", "x"), 2,
         "priority"),
        (("submit", "--no-repo-check", "--tenant", "a", "--repo", "/x"), 2, "--prompt"),
        (("submit", "--no-repo-check", "--batch", "/no/such/file"), 2, "cannot read"),
        (("submit", "--no-repo-check",
          "--tenant", "a", "--repo", "/x", "--prompt", "p", "--require", "jdk>=x"),
         2, "--require"),
        (("submit", "--no-repo-check",
          "--tenant", "a", "--repo", "/x", "--prompt", "p", "--depends-on", "nope"),
         2, "no task 'nope'"),
        (("policy", "apply", "/no/such/policy.toml"), 2, "/no/such/policy.toml"),
        (("worker", "--agent-command", "true", "--capability", "=x"), 2, "--capability"),
    ],
)
def test_errors_are_one_line_with_a_trustworthy_exit_code(cli: CLI, args: tuple[str, ...],
                                                          code: int, says: str) -> None:
    assert says in cli(*args, code=code).stderr


def test_bad_database_urls_are_bad_input(tmp_path: Path) -> None:
    for url in ("foo", "mysql://u@h/db"):
        assert "DATABASE_URL" in CLI(url, tmp_path)("runs", "list", code=2).stderr
    assert "cannot upgrade" in CLI(f"sqlite:///{tmp_path}/no/such/dir/x.db", tmp_path)(
        "db", "upgrade", code=4).stderr


def test_unreachable_database_and_missing_schema(tmp_path: Path) -> None:
    down = CLI("postgresql://postgres@127.0.0.1:1/nothing", tmp_path)
    assert "cannot reach the database" in down("runs", "list", code=4).stderr
    empty = CLI(f"sqlite:///{tmp_path / 'new.db'}", tmp_path)
    assert "runlane db upgrade" in empty("runs", "list", code=4).stderr
    assert not (tmp_path / "new.db").exists()


def test_audit_exits_1_and_lists_violations(cli: CLI, db_url: str) -> None:
    store = Store(db_url)
    [sub] = store.submit([spec()])
    store.claim("w1")
    execute(store, "UPDATE runs SET status = 'SUCCEEDED' WHERE run_id = :r", r=sub.run_id)
    store.close()
    report = cli.json("audit", code=1)
    assert report["ok"] is False
    assert {v["check"] for v in report["violations"]} == {"terminal_run_with_live_lease"}
    assert cli.json("maintain", "--once")["terminal_leases_revoked"] == 1
    assert cli.json("audit") == {"ok": True, "violations": []}


def test_settings_come_from_env_and_file(tmp_path: Path) -> None:
    (tmp_path / "runlane.toml").write_text(f'database_url = "sqlite:///{tmp_path}/f.db"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    up = subprocess.run([sys.executable, "-m", "runlane", "db", "upgrade"], cwd=tmp_path,
                        env=env, capture_output=True, text=True)
    assert up.returncode == 0 and (tmp_path / "f.db").exists()
    env["RUNLANE_DATABASE_URL"] = f"sqlite:///{tmp_path}/e.db"
    subprocess.run([sys.executable, "-m", "runlane", "db", "upgrade"], cwd=tmp_path, env=env,
                   check=True, capture_output=True)
    assert (tmp_path / "e.db").exists()
    env["RUNLANE_LEASE_TTL_SECONDS"] = "-1"
    bad = subprocess.run([sys.executable, "-m", "runlane", "runs", "list"], cwd=tmp_path,
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "LEASE_TTL_SECONDS" in bad.stderr
    env["RUNLANE_LEASE_TTL_SECONDS"] = "10"
    env["RUNLANE_HEARTBEAT_SECONDS"] = "4"
    bad = subprocess.run([sys.executable, "-m", "runlane", "runs", "list"], cwd=tmp_path,
                         env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "at most a third of LEASE_TTL_SECONDS" in bad.stderr


def test_policy_apply_show_and_admission_on_the_cli(cli: CLI, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[tenants.acme]\nweight = -1\n")
    error = cli("policy", "apply", str(bad), code=2).stderr
    assert f"{bad}: tenants.acme.weight:" in error and "Traceback" not in error
    assert cli.json("policy", "show")["version"] == 0
    good = tmp_path / "policy.toml"
    good.write_text('''
[[repositories]]
match = "*/payments*"
autonomous_agents = false
message = "analysis only"
[concurrency]
per_tenant_max_active = 2
''')
    assert cli.json("policy", "apply", str(good)) == {
        "version": 1, "digest": cli.json("policy", "show")["digest"], "created": True}
    assert cli.json("policy", "apply", str(good))["created"] is False
    shown = cli.json("policy", "show")
    assert shown["version"] == 1 and shown["policy"]["concurrency"]["per_tenant_max_active"] == 2
    denied = cli.json("submit", "--no-repo-check",
                      "--tenant", "acme", "--repo", "/srv/git/payments.git",
                      "--prompt", "p", code=1)  # a denied submit exits 1
    assert (denied["status"], denied["reason_code"]) == (
        "POLICY_DENIED", "REPOSITORY_POLICY_BLOCKS_AUTONOMOUS_AGENT")
    parent = cli.json("submit", "--no-repo-check",
                      "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "p",
                      "--require", "jdk>=21", "--require", "tools=git,maven",
                      "--user", "ann", "--estimated-cost", "0.5")
    child = cli.json("submit", "--no-repo-check",
                     "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "r",
                     "--depends-on", parent["task_id"], "--parent", parent["task_id"])
    assert child["status"] == "ADMITTED"
    shown = cli.json("runs", "show", child["run_id"])
    assert shown["depends_on"] == [parent["task_id"]]
    assert shown["parent_task_id"] == parent["task_id"]
    assert shown["admission"]["decision"] == "ADMIT" and shown["policy_version"] == 1
    unroutable = cli.json("runs", "list", "--unroutable")
    assert [r["run_id"] for r in unroutable] == [parent["run_id"]]
    assert "no live worker" in unroutable[0]["unroutable_because"]
    assert json.loads(unroutable[0]["route_key"]) == {"jdk": ">=21", "tools": ["git", "maven"]}
    # A new version: `maintain` admits the queued run again, and `runs show` says so.
    good.write_text(good.read_text().replace("per_tenant_max_active = 2",
                                             "per_tenant_max_active = 3"))
    assert cli.json("policy", "apply", str(good))["version"] == 2
    assert cli.json("maintain", "--once")["queued_readmitted"] == 1
    shown = cli.json("runs", "show", parent["run_id"])
    assert shown["policy_version"] == 2
    assert shown["admission"]["concurrency"]["tenant:acme"] == 3
    assert shown["admission"]["first_policy_version"] == 1
    assert "ADMIT under policy v2, first admitted under v1" in \
        cli("runs", "show", parent["run_id"]).stdout
