"""Edge cases a platform engineer scripting against runlane hits (a review, 2026-12-02).

Every test here failed before its fix: each asserts what a user
should get (CONTRACT.md, README "Errors are one line with an exit code scripts can
trust: 1 refused, 2 bad input, 3 not found, 4 database, 70 internal error"), not
what the code does now.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runlane.store.store import Store

from .support import one_line_error
from .test_cli import CLI, cli  # noqa: F401  (the fixture)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update(extra)
    return env


def _run(url: str, cwd: Path, *args: str, timeout: float = 60,
         **env: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                              capture_output=True, text=True, cwd=cwd, env=_env(**env),
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"`runlane {' '.join(args)}` still running after {timeout} s; "
                    f"stderr: {(err or '')[-1500:]}")


def _strict_json(text: str) -> Any:
    """RFC 8259 JSON: NaN / Infinity are not JSON (jq, JavaScript, Go reject them)."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


# --- idempotency key ------------------------------------------------------------------


def test_empty_idempotency_key_is_refused_not_a_shared_key(cli: CLI) -> None:  # noqa: F811
    """`--idempotency-key "$TICKET"` with an empty variable: today every such submit
    (any repo, any prompt) silently returns the first task ever submitted with ''."""
    first = cli("submit", "--no-repo-check",
                "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "one",
                "--idempotency-key", "", "--json", code=2)
    assert "idempotency_key" in first.stderr
    assert cli.json("runs", "list") == []


# --- non-finite and out-of-range numbers ------------------------------------------------


def test_infinite_estimated_cost_is_bad_input(cli: CLI) -> None:  # noqa: F811
    """SQLite: accepted, and every later --json prints `"estimated_cost_usd": Infinity`
    (not JSON). PostgreSQL: exit 4 'database: invalid input syntax for type json'."""
    result = cli("submit", "--no-repo-check",
                 "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "p",
                 "--estimated-cost", "inf", "--json", code=2)
    assert "estimated_cost" in result.stderr
    _strict_json(cli("runs", "list", "--json").stdout)


def test_infinite_policy_weight_is_refused(cli: CLI, tmp_path: Path) -> None:  # noqa: F811
    """`weight = inf` is applied; then `policy show --json` and `runs show --json` print
    `"weight": Infinity`, which no JSON parser but Python's accepts."""
    policy = tmp_path / "policy.toml"
    policy.write_text("[tenants.acme]\nweight = inf\ndaily_model_budget_usd = inf\n")
    result = cli("policy", "apply", str(policy), code=2)
    assert "tenants.acme" in result.stderr
    _strict_json(cli("policy", "show", "--json").stdout)


def test_policy_limit_beyond_the_database_integer_is_refused(cli: CLI,  # noqa: F811
                                                             tmp_path: Path) -> None:
    """Today applied (exit 0); from then on every claim of every worker fails
    (SQLite: OverflowError, PostgreSQL: NumericValueOutOfRange) and nothing runs."""
    policy = tmp_path / "policy.toml"
    policy.write_text("[concurrency]\nper_tenant_max_active = 99999999999999999999\n")
    result = cli("policy", "apply", str(policy), code=2)
    assert "per_tenant_max_active" in result.stderr


def test_a_policy_limit_of_three_billion_does_not_wedge_claims_on_postgresql(
        pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL casts the limits to `integer` in the claim: a limit over 2^31 - 1
    (3,000,000,000, a plausible "no limit") is applied, then no worker can claim."""
    from .conftest import truncate_pg
    truncate_pg(pg_url)
    policy = tmp_path / "policy.toml"
    policy.write_text("[concurrency]\nper_tenant_max_active = 3000000000\n")
    applied = _run(pg_url, tmp_path, "policy", "apply", str(policy))
    if applied.returncode == 2:  # refused with a clear error: also acceptable
        assert "per_tenant_max_active" in applied.stderr
        return
    assert applied.returncode == 0, applied.stderr
    submitted = _run(pg_url, tmp_path, "submit", "--no-repo-check", "--tenant", "acme", "--repo",
                     "/srv/git/a.git", "--prompt", "p", "--json")
    assert submitted.returncode == 0, submitted.stderr
    store = Store(pg_url)
    try:
        leases = store.claim("w1")
    finally:
        store.close()
    assert [lease.run_id for lease in leases] == [json.loads(submitted.stdout)["run_id"]]


def test_runs_list_huge_limit_is_bad_input(cli: CLI) -> None:  # noqa: F811
    """SQLite: exit 70 'internal error: OverflowError'; PostgreSQL: exit 4
    'database: bigint out of range'."""
    result = cli("runs", "list", "--limit", "99999999999999999999", code=2)
    assert "--limit" in result.stderr


def test_worker_huge_concurrency_is_bad_input(db_url: str, tmp_path: Path) -> None:
    """Today the worker logs a claim_loop_error (OverflowError / out of range) every
    second forever, even with --exit-when-idle."""
    result = _run(db_url, tmp_path, "worker", "--agent-command", "true", "--exit-when-idle",
                  "--concurrency", "99999999999999999999", timeout=20)
    one_line_error(result, 2, "--concurrency")


def test_worker_nan_timeout_is_bad_input(db_url: str, tmp_path: Path) -> None:
    """click's FloatRange(min=0, min_open=True) lets NaN through; a NaN timeout means
    "never times out" (an attempt with `sleep 3` and --timeout-seconds nan succeeded)."""
    result = _run(db_url, tmp_path, "worker", "--agent-command", "true", "--exit-when-idle",
                  "--timeout-seconds", "nan", timeout=30)
    one_line_error(result, 2, "--timeout-seconds")


def test_worker_empty_queue_is_bad_input(db_url: str, tmp_path: Path) -> None:
    """`submit --queue ''` is refused, so a worker on queue '' can never get work;
    `worker --queue "$Q"` with an empty variable silently serves nothing."""
    result = _run(db_url, tmp_path, "worker", "--agent-command", "true", "--exit-when-idle",
                  "--queue", "", timeout=30)
    one_line_error(result, 2, "--queue")


# --- settings -------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value"), [
    ("REAPER_INTERVAL_SECONDS", "inf"),
    ("REAPER_INTERVAL_SECONDS", "1e10"),
    ("HEARTBEAT_SECONDS", "1e10"),
])
def test_settings_that_threads_cannot_wait_are_refused(db_url: str, tmp_path: Path,
                                                       name: str, value: str) -> None:
    """Accepted today; then `maintain` / `worker` threads die with
    'OverflowError: timestamp out of range for platform time_t' tracebacks while the
    process keeps running (a maintain that reaps nothing, a worker with no heartbeat)."""
    extra = {f"RUNLANE_{name}": value}
    result = _run(db_url, tmp_path, "runs", "list", **extra)
    one_line_error(result, 2, name)


def test_maintain_with_an_infinite_interval_prints_no_traceback(db_url: str,
                                                                tmp_path: Path) -> None:
    result = _run(db_url, tmp_path, "maintain", timeout=8,
                  RUNLANE_REAPER_INTERVAL_SECONDS="inf")
    one_line_error(result, 2, "REAPER_INTERVAL_SECONDS")


def test_settings_come_from_flags_as_the_contract_says(db_url: str, tmp_path: Path) -> None:
    """CONTRACT.md: "Each setting comes from a flag, else RUNLANE_<NAME>, ...". Only
    --database-url exists: 'No such option: --lease-ttl-seconds' (the README's
    "Not yet" admits it)."""
    result = _run(db_url, tmp_path, "--lease-ttl-seconds", "30", "--heartbeat-seconds", "5",
                  "runs", "list", "--json")
    assert result.returncode == 0, result.stderr
    assert _strict_json(result.stdout) == []
    # The flag is the one read, over the environment: its bad value is the one refused.
    refused = _run(db_url, tmp_path, "--lease-ttl-seconds", "-1", "runs", "list",
                   RUNLANE_LEASE_TTL_SECONDS="60")
    one_line_error(refused, 2, "LEASE_TTL_SECONDS")


# --- files ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--batch", "--context"])
def test_a_file_that_is_not_utf8_is_bad_input(cli: CLI, tmp_path: Path,  # noqa: F811
                                              flag: str) -> None:
    """Today: exit 70 'internal error: UnicodeDecodeError' (`policy apply` says
    'is not UTF-8 text', exit 2)."""
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\xff\xfe{\x00")
    args = (["submit", "--no-repo-check", "--batch", str(path)] if flag == "--batch" else
            ["submit", "--no-repo-check",
             "--tenant", "a", "--repo", "/x", "--prompt", "p", "--context",
             str(path)])
    assert flag in cli(*args, code=2).stderr


def test_demo_directory_that_is_a_file_is_bad_input(tmp_path: Path) -> None:
    """Today: exit 70 'internal error: FileExistsError: [Errno 17] File exists'."""
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    result = subprocess.run([sys.executable, "-m", "runlane", "demo", "--directory",
                             str(target), "--json"], capture_output=True, text=True,
                            cwd=tmp_path, env=_env(), timeout=60)
    one_line_error(result, 2, str(target))


# --- schema ---------------------------------------------------------------------------


def test_a_schema_newer_than_this_runlane_is_reported_as_such(tmp_path: Path) -> None:
    """A database migrated by a newer runlane (a rolling deploy): `runs list` says
    'run `runlane db upgrade`', and `db upgrade` then fails with exit 70
    'internal error: CommandError: Can't locate revision identified by ...'."""
    from sqlalchemy import text

    from runlane.store import migrate
    from runlane.store.engine import build_engine

    url = f"sqlite:///{tmp_path / 'newer.db'}"
    engine = build_engine(url)
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    listed = _run(url, tmp_path, "runs", "list")
    one_line_error(listed, 4, "9999")
    assert "runlane db upgrade" not in listed.stderr  # upgrading cannot help
    upgraded = _run(url, tmp_path, "db", "upgrade")
    one_line_error(upgraded, 4, "9999")


# --- filters --------------------------------------------------------------------------


def test_runs_list_with_an_empty_tenant_does_not_list_every_tenant(cli: CLI) -> None:  # noqa: F811
    """`runs list --tenant "$T"` with an empty variable lists every tenant's runs
    (store.list_runs tests `if tenant:`); a tenant is never '' (submit refuses it)."""
    cli("submit", "--no-repo-check",
        "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "p")
    result = _run(cli.url, cli.cwd, "runs", "list", "--tenant", "", "--json")
    if result.returncode == 2:  # refused as bad input: also right
        one_line_error(result, 2, "--tenant")
        return
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_the_demo_never_empties_a_directory_it_did_not_make(tmp_path: Path) -> None:
    """`runlane demo --directory ~/src` deleted ~/src (rmtree, whatever it held). Now
    only an earlier demo's directory (its marker) or an empty one is used."""
    from runlane.demo import MARKER, DemoDirectoryInvalid, _fresh_directory

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(DemoDirectoryInvalid, match="holds files of its own"):
        _fresh_directory(mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    demo = _fresh_directory(tmp_path / "demo")
    (demo / "runlane.db").write_text("an earlier run's")
    assert _fresh_directory(demo) == demo  # an earlier demo's: emptied, used again
    assert sorted(p.name for p in demo.iterdir()) == [MARKER]
