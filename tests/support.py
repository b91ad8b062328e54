"""Small builders shared by the tests."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

from runlane.api import Runlane
from runlane.domain.tasks import TaskSpec, parse_task
from runlane.settings import Settings
from runlane.store import history
from runlane.store.records import Submission
from runlane.store.store import Store
from runlane.store.wakeup import libpq_url

from . import pgbouncer


def spec(**fields: Any) -> TaskSpec:
    raw = {"tenant": "acme", "repo": "/srv/git/app.git", "prompt": "fix the flaky test"}
    raw.update(fields)
    return parse_task(raw)


def submit(store: Store, n: int = 1, **fields: Any) -> list[Submission]:
    return store.submit([spec(**fields) for _ in range(n)])


def run_row(store: Store, run_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(text("SELECT * FROM runs WHERE run_id = :r"), {"r": run_id}).one()


def attempts_of(store: Store, run_id: str) -> list[Any]:
    with store.engine.connect() as conn:
        return list(conn.execute(
            text("SELECT * FROM attempts WHERE run_id = :r ORDER BY attempt_no"), {"r": run_id}))


def events_of(store: Store, run_id: str) -> list[tuple[str | None, str]]:
    """The run's transitions as (from, to): its composed history (store/history.py)."""
    with store.engine.connect() as conn:
        return [(r.from_status, r.to_status) for r in conn.execute(
            text(history.RUN_HISTORY), {"run_id": run_id})]


def execute(store: Store, sql: str, **params: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(text(sql), params)


def wait_for_a_lock_wait(url: str, statement_part: str, what: str, *,
                         sessions: int = 1) -> None:
    """Poll until ``sessions`` sessions of the database wait for a lock while running a
    statement that contains ``statement_part`` (``what``: what they should be waiting
    for, for the message)."""
    deadline = time.monotonic() + 30.0  # a loaded machine (xdist beside a busy test)
    with psycopg.connect(libpq_url(url), autocommit=True) as watch:
        while time.monotonic() < deadline:
            waiting = watch.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query LIKE %s",
                (f"%{statement_part}%",)).fetchone()
            if waiting and waiting[0] >= sessions:
                return
            time.sleep(0.01)
    raise AssertionError(f"no session waited for {what}")


def assert_planned_once(conn: Any, statement_part: str) -> None:
    """The session's one prepared statement containing ``statement_part`` settled on
    its generic plan (planned once, not at every execution) after its first custom
    plans (PostgreSQL tries five)."""
    plans = conn.execute(text(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
        "WHERE statement LIKE :part"), {"part": f"%{statement_part}%"}).all()
    assert len(plans) == 1, plans
    generic, custom = plans[0]
    assert generic > 0 and custom <= 5, plans


def bare_remote(tmp_path: Path) -> Path:
    """A bare repository with one commit on main: a real remote."""
    seed = tmp_path / "seed"
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True, env=env)
    (seed / "README.md").write_text("hello\n")
    subprocess.run(["git", "add", "."], cwd=seed, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=seed, check=True, env=env)
    bare = tmp_path / "repo.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(bare)], check=True)
    return bare


SRC = str(Path(__file__).resolve().parents[1] / "src")


def cli_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout's code, none of the caller's
    RUNLANE_* settings or token, forge and workspaces under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RUNLANE_") and k != "GITHUB_TOKEN"}
    env.update({"PYTHONPATH": SRC, "RUNLANE_FORGE_DIR": str(tmp_path / "forge"),
                "XDG_STATE_HOME": str(tmp_path / "state"),
                "RUNLANE_WORKSPACE_DIR": str(tmp_path / "ws"), **extra})
    return env


def one_line_error(result: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    """A CLI failure as CONTRACT.md wants it: the exit code, one `error: ...` line
    saying ``says``, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert says in result.stderr, result.stderr


def processes_in(directory: Path) -> list[int]:
    """Host pids of the processes whose working directory is ``directory`` or below it:
    an agent and everything it started, inside a sandbox or not (a pid an agent reports
    from inside its PID namespace means nothing on the host)."""
    root = os.path.realpath(directory)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if cwd == root or cwd.startswith(root + "/"):
            found.append(int(entry))
    return found


def database_state(url: str) -> dict[str, list[str]]:
    """Every row of every table of the schema, as text, in a stable order: equal
    before and after a refused call means the call changed nothing."""
    from runlane.store import schema
    from runlane.store.engine import build_engine

    engine = build_engine(url)
    try:
        with engine.connect() as conn:
            return {table.name: sorted(repr(tuple(row)) for row in
                                       conn.execute(text(f"SELECT * FROM {table.name}")))
                    for table in schema.metadata.sorted_tables}
    finally:
        engine.dispose()


@contextmanager
def fast_lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    """The facade of the in-process worker tests: workspaces and artifacts under
    ``tmp_path``, short heartbeats, TERM grace and retry backoff."""
    settings = Settings(database_url=db_url, workspace_dir=tmp_path / "workspaces",
                        artifacts_dir=tmp_path / "artifacts", heartbeat_seconds=0.2,
                        agent_term_grace_seconds=0.5, retry_base_seconds=0.05,
                        retry_max_seconds=0.1, listen_database_url=pgbouncer.listen_url(db_url))
    with Runlane(settings=settings) as lane:
        yield lane


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check`` every 20 ms until it returns something true (returned), or fail
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
