"""Logs (issue 24): `runlane worker`, `maintain` and `up` log each claim (`run_claimed`,
the seed's line) and each run transition at INFO by default, with the ids of the run's
chain; JSON when stderr is not a terminal, the console format when it is or when asked;
the standard library's records (SQLAlchemy's) come out through the same renderer; the
other commands, and runlane imported as a library, stay quiet. Real CLI processes on
SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection
from structlog.testing import capture_logs

from runlane.domain.states import RunStatus
from runlane.store.store import Store

from .http_support import wait_until
from .support import bare_remote, cli_env, spec

IDS = ("run_id", "task_id", "queue", "worker_id", "lease_id", "fencing_token", "attempt_no")


def runlane(db_url: str, tmp_path: Path, *args: str, **env: str
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlane", "--database-url", db_url, *args],
        env=cli_env(tmp_path, RUNLANE_ARTIFACTS_DIR=str(tmp_path / "artifacts"), **env),
        capture_output=True, text=True, timeout=120)


def json_lines(stderr: str) -> list[dict[str, Any]]:
    """Every line of ``stderr`` as JSON (fails on a line that is not)."""
    lines = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    assert all(isinstance(line, dict) and next(iter(line)) == "event" for line in lines)
    return lines


def test_a_worker_logs_its_claims_and_transitions_at_info_as_json(
        db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    [sub] = store.submit([spec(repo=str(bare_remote(tmp_path)))])
    store.close()
    done = runlane(db_url, tmp_path, "worker", "--agent-command", "echo x > x.txt",
                   "--exit-when-idle")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = json_lines(done.stderr)  # not a terminal: JSON, every line
    [claimed] = [e for e in lines if e["event"] == "run_claimed"]
    worker_id = claimed["worker_id"]
    assert {k: claimed[k] for k in IDS} == {
        "run_id": sub.run_id, "task_id": sub.task_id, "queue": "default",
        "worker_id": worker_id, "lease_id": f"{sub.run_id}/1", "fencing_token": 1,
        "attempt_no": 1}
    assert claimed["level"] == "info" and worker_id.count("/") == 2
    moves = [e for e in lines if e["event"] == "run_transition"]
    assert [(e["from_status"], e["to_status"]) for e in moves] == [
        ("CLAIMED", "PREPARING_SANDBOX"), ("PREPARING_SANDBOX", "RUNNING"),
        ("RUNNING", "FINALIZING"), ("FINALIZING", "SUCCEEDED")]
    for move in moves:
        assert {k: move[k] for k in IDS} == {k: claimed[k] for k in IDS}
        assert move["actor"] == worker_id and move["level"] == "info"
    # Libraries' INFO lines (alembic's migration context, SQL) stay out at INFO.
    assert not [e for e in lines if "logger" in e], lines


def test_the_reaper_logs_the_recovery_with_the_dead_workers_ids(
        db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    [sub] = store.submit([spec()])
    [lease] = store.claim("host/1/dead", lease_ttl=0.05)  # a worker that died at once
    store.close()
    wait_until(lambda: time.time() > lease.expires_at + 0.05, "the lease to expire")
    done = runlane(db_url, tmp_path, "maintain", "--once", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["expired_leases"] == 1
    moves = [e for e in json_lines(done.stderr) if e["event"] == "run_transition"]
    assert [(e["from_status"], e["to_status"]) for e in moves] == [
        ("CLAIMED", "STALE_LEASE"), ("STALE_LEASE", "FAILED_RETRYABLE"),
        ("FAILED_RETRYABLE", "QUEUED")]
    for move in moves:
        assert {k: move[k] for k in IDS} == {
            "run_id": sub.run_id, "task_id": sub.task_id, "queue": "default",
            "worker_id": "host/1/dead", "lease_id": f"{sub.run_id}/1", "fencing_token": 1,
            "attempt_no": 1}
        assert (move["actor"], move["reason_code"]) == ("reaper", "WORKER_LOST")


def test_console_format_when_asked_and_on_a_terminal(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    [sub] = store.submit([spec(repo=str(bare_remote(tmp_path)))])
    store.close()
    done = runlane(db_url, tmp_path, "--log-format", "console", "worker", "--agent-command",
                   "true", "--exit-when-idle")
    assert done.returncode == 0, done.stderr[-3000:]
    claimed = [line for line in done.stderr.splitlines() if "run_claimed" in line]
    assert len(claimed) == 1, done.stderr
    assert f"run_id={sub.run_id}" in claimed[0] and "fencing_token=1" in claimed[0]
    assert not claimed[0].lstrip().startswith("{") and "\x1b[" not in done.stderr
    # Nothing said: a terminal gets the console format (colours, for a person).
    output = on_a_terminal(db_url, tmp_path, "worker", "--agent-command", "true",
                           "--exit-when-idle")
    started = [line for line in output.splitlines() if "worker_started" in line]
    assert len(started) == 1 and not started[0].lstrip().startswith("{"), output


def on_a_terminal(db_url: str, tmp_path: Path, *args: str) -> str:
    """What the command writes to stderr when stderr is a terminal (a pty)."""
    main, tty = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "runlane", "--database-url", db_url, *args],
        env=cli_env(tmp_path, RUNLANE_ARTIFACTS_DIR=str(tmp_path / "artifacts")),
        stdout=subprocess.DEVNULL, stderr=tty, stdin=subprocess.DEVNULL)
    os.close(tty)
    output = b""
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 60)
            if not ready:
                raise AssertionError(f"no output for 60 s: {output!r}")
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: the other side is closed
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(main)
        assert process.wait(timeout=60) == 0, output
    return output.decode(errors="replace")


def test_other_commands_are_quiet_and_stdlib_records_share_the_format(
        db_url: str, tmp_path: Path) -> None:
    quiet = runlane(db_url, tmp_path, "runs", "list", "--json")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = runlane(db_url, tmp_path, "--log-level", "DEBUG", "runs", "list", "--json")
    assert loud.returncode == 0, loud.stderr[-3000:]
    records = [e for e in json_lines(loud.stderr) if e.get("logger", "").startswith(
        "sqlalchemy.engine")]
    assert any("SELECT" in str(e["event"]) for e in records), loud.stderr[-3000:]
    assert all(e["level"] in ("info", "debug") and "timestamp" in e for e in records)
    assert json.loads(loud.stdout) == []  # stdout is still the data alone


def test_runlane_imported_as_a_library_leaves_the_standard_logging_alone(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import logging, runlane, runlane.cli; "
         "print(len(logging.getLogger().handlers), logging.getLogger().level)"],
        env=cli_env(tmp_path), capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["0", str(30)], done.stdout  # no handler, WARNING


def test_a_move_is_announced_once_committed_never_when_rolled_back(store: Store) -> None:
    [sub] = store.submit([spec()])

    def cancel_then_fail(conn: Connection) -> None:
        assert store._set_status(conn, run_id=sub.run_id, source=RunStatus.QUEUED,
                                 path=[RunStatus.CANCELLED], run_token=0, actor="user",
                                 now=None)
        raise RuntimeError("rolled back after the move")

    with capture_logs() as logs:
        with pytest.raises(RuntimeError):
            store._transaction(cancel_then_fail)
        assert [e for e in logs if e["event"] == "run_transition"] == []
        store.cancel(sub.task_id)
    [move] = [e for e in logs if e["event"] == "run_transition"]
    assert {k: move[k] for k in (*IDS, "from_status", "to_status", "actor")} == {
        "run_id": sub.run_id, "task_id": sub.task_id, "queue": "default", "worker_id": None,
        "lease_id": None, "fencing_token": None, "attempt_no": None,
        "from_status": "QUEUED", "to_status": "CANCELLED", "actor": "user"}
