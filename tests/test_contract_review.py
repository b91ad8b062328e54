"""The CLI against CONTRACT.md and the docs, checked as a user scripts it (a review,
2026-12-02): real subprocesses, one JSON document with ``--json``, and every error one
``error: ...`` line with the documented exit code (1 refused, 2 bad input, 3 not found,
4 database unreachable or schema outdated, 70 internal error).

Every test here failed before its fix.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .support import bare_remote, cli_env, one_line_error

ROOT = Path(__file__).resolve().parents[1]


def _run(url: str, cwd: Path, *args: str | bytes,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                              capture_output=True, text=True, cwd=cwd, env=cli_env(cwd),
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"`runlane {args!r}` still running after {timeout} s; "
                    f"stderr: {(err or '')[-1500:]}")


def _ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, (result.stdout, result.stderr[-2000:])
    return result


def _json(url: str, cwd: Path, *args: str) -> Any:
    return json.loads(_ok(_run(url, cwd, *args, "--json")).stdout)


@pytest.fixture
def url(db_url: str, tmp_path: Path) -> str:
    """A migrated database, SQLite and PostgreSQL (the conftest fixture's pattern)."""
    _ok(_run(db_url, tmp_path, "db", "upgrade"))
    return db_url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'runlane.db'}"
    _ok(_run(url, tmp_path, "db", "upgrade"))
    return url


BASE = ("submit", "--no-repo-check",
        "--tenant", "acme", "--repo", "/srv/git/a.git", "--prompt", "p")


# --- tasks named by an empty id -------------------------------------------------------


def test_an_empty_depends_on_is_bad_input_not_a_database_error(url: str,
                                                               tmp_path: Path) -> None:
    """`--depends-on "$DEP"` with DEP unset: the store skipped the empty id when it
    checked the named tasks, then the insert hit the foreign key: `error: database:
    FOREIGN KEY constraint failed`, exit 4 (the code for a database that is down)."""
    for value in ("", " "):
        one_line_error(_run(url, tmp_path, *BASE, "--depends-on", value), 2, "depends_on")
    assert _json(url, tmp_path, "runs", "list") == []


def test_an_empty_parent_is_refused_not_stored(url: str, tmp_path: Path) -> None:
    """`--parent ""` was stored as parent_task_id '' (a task that does not exist)."""
    one_line_error(_run(url, tmp_path, *BASE, "--parent", ""), 2, "parent_task_id")
    assert _json(url, tmp_path, "runs", "list") == []


# --- NUL characters ---------------------------------------------------------------------


def test_a_nul_character_is_bad_input_on_both_engines(url: str, tmp_path: Path) -> None:
    """JSON may carry "\\u0000"; PostgreSQL cannot store it: `error: database:
    unsupported Unicode escape sequence`, exit 4 (SQLite took it), for the prompt, a
    context section and the idempotency key alike."""
    good = {"tenant": "acme", "repo": "/srv/git/a.git", "prompt": "p"}
    for field, row in (("prompt", {**good, "prompt": "a\u0000b"}),
                       ("idempotency_key", {**good, "idempotency_key": "k\u0000"}),
                       ("context", {**good, "context": {"summary": "s\u0000"}})):
        path = tmp_path / "tasks.jsonl"
        path.write_text(json.dumps(row) + "\n")
        one_line_error(_run(url, tmp_path, "submit", "--no-repo-check", "--batch", str(path)), 2,
                        f"line 1: {field}")
    context = tmp_path / "context.json"
    context.write_text(json.dumps({"diff": "d\u0000"}))
    one_line_error(_run(url, tmp_path, *BASE, "--context", str(context)), 2,
                    "context: holds a NUL character (\\u0000) in 'diff'")
    assert _json(url, tmp_path, "runs", "list") == []


# --- ids and file names that are not UTF-8 ----------------------------------------------


def test_an_id_that_is_not_utf8_is_not_found_not_an_internal_error(url: str,
                                                                   tmp_path: Path) -> None:
    """`runs show $'\\xff'`: exit 70, `internal error: UnicodeEncodeError`."""
    one_line_error(_run(url, tmp_path, "runs", "show", b"\xff"), 3, "no run")
    one_line_error(_run(url, tmp_path, "cancel", b"\xff"), 3, "no task")


def test_a_policy_file_whose_name_is_not_utf8_can_be_applied(sqlite_url: str,
                                                             tmp_path: Path) -> None:
    """The file's name is recorded as the policy's source: exit 70 on the name."""
    name = os.fsdecode(b"policy-\xff.toml")
    (tmp_path / name).write_text("allow_unknown_tenants = false\n")
    applied = json.loads(_ok(_run(sqlite_url, tmp_path, "policy", "apply",
                                  os.fsencode(name), "--json")).stdout)
    assert applied["created"] and applied["version"] == 1
    assert _json(sqlite_url, tmp_path, "policy", "show")["source"].startswith("policy-")


# --- the agent and verify commands ---------------------------------------------------------


def test_an_empty_agent_command_is_bad_input(sqlite_url: str, tmp_path: Path) -> None:
    """`--agent-command "$AGENT"` with AGENT unset: `worker` exited 1 ("refused"), and
    `up` started, its workers died and were restarted forever."""
    for command in ("worker", "up"):
        one_line_error(_run(sqlite_url, tmp_path, command, "--agent-command", "",
                             timeout=20), 2, "--agent-command")
        one_line_error(_run(sqlite_url, tmp_path, command, "--agent-command", "  ",
                             timeout=20), 2, "--agent-command")


def test_an_empty_verify_command_is_bad_input_not_no_verification(sqlite_url: str,
                                                                   tmp_path: Path) -> None:
    """`--verify-command "$VERIFY"` with VERIFY unset ran every run unverified."""
    for command in ("worker", "up"):
        one_line_error(_run(sqlite_url, tmp_path, command, "--agent-command", "true",
                             "--verify-command", "", "--exit-when-idle"
                             if command == "worker" else "--workers=1", timeout=20),
                        2, "--verify-command")


# --- output ------------------------------------------------------------------------------


def test_prs_list_shows_whole_run_ids(sqlite_url: str, tmp_path: Path) -> None:
    """`runs list` prints whole run ids for `runs show RUN_ID`; `prs list` cut them
    (`01a23610-5d28…`) on an 80-column terminal, so none could be used."""
    repo = bare_remote(tmp_path)
    sub = _json(sqlite_url, tmp_path, "submit", "--no-repo-check",
                                      "--tenant", "acme", "--repo", str(repo),
                "--prompt", "p")
    _ok(_run(sqlite_url, tmp_path, "worker", "--agent-command", "echo x > x.txt",
             "--exit-when-idle", timeout=120))
    [pr] = _json(sqlite_url, tmp_path, "prs", "list")
    assert pr["run_id"] == sub["run_id"]
    assert {"run_id", "repo", "branch", "number", "url"} <= pr.keys()
    table = _ok(_run(sqlite_url, tmp_path, "prs", "list")).stdout
    assert sub["run_id"] in table, table


def test_maintain_json_without_once_is_refused(sqlite_url: str, tmp_path: Path) -> None:
    """`maintain --json` ran forever and never printed a JSON document; only one pass
    (`--once`) has one to print."""
    one_line_error(_run(sqlite_url, tmp_path, "maintain", "--json", timeout=20), 2,
                    "--once")


def test_every_database_error_shows_the_url_as_written(tmp_path: Path) -> None:
    """The errors of a query show `sqlite:///file:/...`; those of `db upgrade` and of
    the schema check still showed SQLAlchemy's `sqlite:///file%3A/...`."""
    missing = f"sqlite:///file:{tmp_path}/no/such/dir/x.db?mode=rwc&uri=true"
    result = _run(missing, tmp_path, "db", "upgrade")
    one_line_error(result, 4, f"file:{tmp_path}/no/such/dir/x.db")
    (tmp_path / "junk.db").write_text("not a database\n" * 100)
    junk = f"sqlite:///file:{tmp_path}/junk.db?mode=ro&uri=true"
    one_line_error(_run(junk, tmp_path, "runs", "list"), 4, f"file:{tmp_path}/junk.db")
    assert "%3A" not in result.stderr


# --- README examples, copied -----------------------------------------------------------


def _doc_block(document: str, heading: str) -> list[str]:
    """The sh block under ``heading`` in ``document``, one command a line (continuations
    joined, comments dropped)."""
    text = (ROOT / document).read_text()
    block = text.split(heading, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line:
            commands.append(line)
    return commands


def test_the_policy_pages_example_is_admitted_under_the_example_policy(
        sqlite_url: str, tmp_path: Path) -> None:
    """The policy page's first block (once README's Scheduling block) applies
    examples/policy.toml and then submits for tenant `acme`, which that policy does not
    list: the example's run ended POLICY_DENIED (TENANT_NOT_ALLOWED)."""
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "policy.toml").write_text(
        (ROOT / "examples" / "policy.toml").read_text())
    apply, show, submit, unroutable, _worker = _doc_block("docs/policy.md",
                                                          "## What it decides")
    assert apply.startswith("runlane policy apply")
    _ok(_run(sqlite_url, tmp_path, *shlex.split(apply)[1:]))
    assert _json(sqlite_url, tmp_path, *shlex.split(show)[1:-1])["version"] == 1
    args = shlex.split(submit)[1:]
    tenant = args[args.index("--tenant") + 1]
    first = _json(sqlite_url, tmp_path, "submit", "--no-repo-check", "--tenant", tenant, "--repo",
                  "https://git.example.com/acme/app.git", "--prompt", "first")
    assert first["status"] == "QUEUED", first
    args = [first["task_id"] if a == "TASK_ID" else a for a in args]
    result = json.loads(_ok(_run(sqlite_url, tmp_path, *args)).stdout)
    assert result["status"] == "ADMITTED", result
    _ok(_run(sqlite_url, tmp_path, *shlex.split(unroutable)[1:]))


def test_runs_list_unroutable_does_not_ignore_status(sqlite_url: str, tmp_path: Path) -> None:
    """`runs list --unroutable --status SUCCEEDED` printed QUEUED runs: the filter was
    dropped without a word. --unroutable lists queued runs only."""
    sub = _json(sqlite_url, tmp_path, *BASE)
    one_line_error(_run(sqlite_url, tmp_path, "runs", "list", "--unroutable", "--status",
                         "SUCCEEDED"), 2, "--unroutable lists QUEUED runs only")
    [run] = _json(sqlite_url, tmp_path, "runs", "list", "--unroutable", "--status", "queued")
    assert run["run_id"] == sub["run_id"] and run["unroutable_because"]


def test_runs_list_unroutable_is_oldest_first_as_its_help_says(sqlite_url: str,
                                                               tmp_path: Path) -> None:
    """`runs list --help`: "List runs, oldest first: at most --limit of them". With
    --unroutable (and no live worker, every queued run is), the runs come route by
    route: the newer run of queue `aa` before the older one of queue `zz`, and
    `--limit 1` lists the newer."""
    old = _json(sqlite_url, tmp_path, *BASE, "--queue", "zz")
    _json(sqlite_url, tmp_path, *BASE, "--queue", "aa")
    [first] = _json(sqlite_url, tmp_path, "runs", "list", "--unroutable", "--limit", "1")
    assert first["run_id"] == old["run_id"]
