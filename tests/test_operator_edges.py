"""What an operator hits deploying and scripting runlane (reviews of migrations, the
maintenance command, the Python API and the docs, 2026-12-02). Each test failed
before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import DBAPIError

from runlane import Runlane
from runlane.errors import RunlaneError
from runlane.store import migrate
from runlane.store.engine import build_engine

from .conftest import _libpq, migrated_sqlite

TAG = f"{os.getpid()}"
HEAD = migrate.head_revision()
SRC = str(Path(__file__).resolve().parents[1] / "src")
PY = sys.executable


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"PYTHONPATH": SRC, **extra})
    return env


def _popen(url: str, *args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "runlane", "--database-url", url, *args], env=_env(),
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _run(url: str, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "runlane", "--database-url", url, *args], cwd=cwd,
                          env=_env(**env), capture_output=True, text=True, timeout=120)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.dispose()


@pytest.fixture
def pg_db(pg_databases: Callable[[str], str]) -> Callable[[str], str]:
    """Empty PostgreSQL databases named fixc_<case>_<pid>, dropped after the test."""
    return lambda case: pg_databases(f"fixc_{case}_{TAG}")


# --- 1, 2: `runlane db upgrade` from several hosts at once ------------------------------


def test_pg_three_db_upgrades_at_once_all_succeed(pg_db: Callable[[str], str],
                                                  engines: list[Engine]) -> None:
    """Three deploy hosts run `runlane db upgrade` on one new PostgreSQL database at
    once ("safe to repeat"): each must exit 0 with the schema at head."""
    url = pg_db("race")
    procs = [_popen(url, "db", "upgrade", "--json") for _ in range(3)]
    results = [(p.wait(120), p.stdout.read(), p.stderr.read())  # type: ignore[union-attr]
               for p in procs]
    engine = build_engine(url)
    engines.append(engine)
    assert migrate.current_revision(engine) == HEAD
    assert [r[0] for r in results] == [0, 0, 0], [r[2] for r in results]
    assert sum(json.loads(r[1])["changed"] for r in results) == 1, [r[1] for r in results]


def _populate_tasks(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
            " context, truncated_sections, payload_bytes, created_at, parent_task_id) "
            "SELECT 't' || g, 'acme', '/r', 'p', 'default', 1, 3, '{}', '[]', 2, g, 't1' "
            "FROM generate_series(1, 100) g"))


def test_pg_db_upgrade_during_an_online_build_does_not_break_it(
        pg_db: Callable[[str], str], engines: list[Engine]) -> None:
    """0011 builds ix_tasks_parent CONCURRENTLY on a populated table. While that build
    waits for a writer the index exists INVALID; a second `db upgrade` took it for an
    interrupted build and dropped it, and the first failed ("deadlock detected")."""
    url = pg_db("cic")
    engine = build_engine(url)
    engines.append(engine)
    migrate.upgrade(engine, "0010")
    _populate_tasks(engine)
    engine.dispose()
    writer = psycopg.connect(_libpq(url))
    try:
        writer.execute("UPDATE tasks SET prompt = 'q' WHERE task_id = 't5'")
        first = _popen(url, "db", "upgrade", "--json")
        time.sleep(2.0)  # the first build now waits for the writer, its index INVALID
        second = _popen(url, "db", "upgrade", "--json")
        time.sleep(2.0)
        writer.rollback()
        results = [(p.wait(120), p.stderr.read()) for p in (first, second)]  # type: ignore[union-attr]
    finally:
        writer.close()
    assert migrate.current_revision(engine) == HEAD
    assert [r[0] for r in results] == [0, 0], [r[1] for r in results]


def test_pg_db_upgrade_keeps_an_operators_online_build_in_progress(
        pg_db: Callable[[str], str], engines: list[Engine]) -> None:
    """An operator pre-builds 0011's index by hand (CREATE INDEX CONCURRENTLY) and runs
    `db upgrade` while the build waits for a writer: the upgrade waits for that build
    and keeps its index, instead of dropping it as an interrupted one."""
    url = pg_db("manual")
    engine = build_engine(url)
    engines.append(engine)
    migrate.upgrade(engine, "0010")
    _populate_tasks(engine)
    writer = psycopg.connect(_libpq(url))
    manual = psycopg.connect(_libpq(url), autocommit=True)
    errors: list[BaseException] = []

    def build() -> None:
        try:
            manual.execute("CREATE INDEX CONCURRENTLY ix_tasks_parent ON tasks "
                           "(parent_task_id) WHERE parent_task_id IS NOT NULL")
        except BaseException as exc:
            errors.append(exc)

    try:
        writer.execute("UPDATE tasks SET prompt = 'q' WHERE task_id = 't5'")
        builder = threading.Thread(target=build)
        builder.start()
        time.sleep(1.5)  # the manual build waits for the writer, its index INVALID
        upgrade = _popen(url, "db", "upgrade", "--json")
        time.sleep(2.5)
        writer.rollback()
        builder.join(60)
        code, err = upgrade.wait(120), upgrade.stderr.read()  # type: ignore[union-attr]
    finally:
        writer.close()
        manual.close()
    assert errors == [], errors
    assert code == 0, err
    assert migrate.current_revision(engine) == HEAD
    with engine.connect() as conn:
        assert conn.execute(text("SELECT indisvalid FROM pg_index i JOIN pg_class c ON "
                                 "c.oid = i.indexrelid WHERE c.relname = 'ix_tasks_parent'")
                            ).scalar_one() is True


# --- 3: 0004 interrupted during its online build ----------------------------------------


def _populate_0003(conn: Any, n: int = 40) -> None:
    for i in range(n):
        queued = i % 2 == 0
        conn.execute(text(
            "INSERT INTO tasks (task_id, tenant, repo, prompt, queue, priority, max_attempts,"
            " context, truncated_sections, payload_bytes, created_at) VALUES "
            "(:t, :ten, '/srv/git/app.git', 'p', 'default', 100, 3, '{}', '[]', 2, :c)"),
            {"t": f"t{i}", "ten": f"tenant{i % 3}", "c": 1700000000 + i})
        conn.execute(text(
            "INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,"
            " attempt_count, max_attempts, fencing_token, visible_at, created_at, updated_at)"
            " VALUES (:r, :t, :ten, '/srv/git/app.git', 'default', 100, :s, 0, 3, 0, :c, :c,"
            " :c)"),
            {"r": f"r{i}", "t": f"t{i}", "ten": f"tenant{i % 3}",
             "s": "QUEUED" if queued else "CANCELLED", "c": 1700000000 + i})


def test_pg_0004_interrupted_concurrent_build_can_be_resumed(
        pg_db: Callable[[str], str], engines: list[Engine]) -> None:
    """0004 builds ix_runs_waiting CONCURRENTLY on a populated runs table; Alembic's
    autocommit_block commits what 0004 did so far (columns added) while
    alembic_version still says 0003. A build that fails (a writer holds it past
    lock_timeout, as a killed deploy pod would) must leave a database that `db
    upgrade` finishes when run again (it failed with DuplicateColumn)."""
    url = pg_db("resume")
    engine = build_engine(url)
    engines.append(engine)
    migrate.upgrade(engine, "0003")
    with engine.begin() as conn:
        _populate_0003(conn)
    writer_conn = psycopg.connect(_libpq(url))
    armed = {"on": True}

    def hook(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if armed["on"] and statement.lstrip().upper().startswith("CREATE INDEX CONCURRENTLY"):
            armed["on"] = False
            writer_conn.execute("UPDATE runs SET updated_at = updated_at WHERE run_id = 'r0'")
            cursor.execute("SET lock_timeout = '300ms'")

    event.listen(engine, "before_cursor_execute", hook)
    with pytest.raises(DBAPIError, match="lock timeout"):
        migrate.upgrade(engine)
    writer_conn.rollback()
    writer_conn.close()
    event.remove(engine, "before_cursor_execute", hook)
    engine.dispose()  # the session that had lock_timeout set
    assert migrate.current_revision(engine) == "0003"

    assert migrate.upgrade(engine)[1] == HEAD
    with engine.connect() as conn:
        lanes = conn.execute(text("SELECT tenant, queued_count FROM lanes ORDER BY tenant")
                             ).all()
        assert conn.execute(text("SELECT COUNT(*) FROM routes")).scalar_one() == 1
        assert conn.execute(text("SELECT COUNT(*) FROM runs WHERE lane_id IS NULL")
                            ).scalar_one() == 0
    assert [tuple(r) for r in lanes] == [("tenant0", 7), ("tenant1", 6), ("tenant2", 7)]


# --- 4, 5: maintain and up ---------------------------------------------------------------


def test_maintain_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """`runlane worker` drains on SIGTERM and `runlane up` stops on it; `runlane
    maintain` was killed outright (exit -15), a pass in flight cut wherever it was."""
    url = migrated_sqlite(tmp_path / "m.db")
    proc = subprocess.Popen([PY, "-m", "runlane", "maintain"], cwd=tmp_path,
                            env=_env(RUNLANE_DATABASE_URL=url,
                                     RUNLANE_REAPER_INTERVAL_SECONDS="0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(3.0)  # started, passes running
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, proc.stderr.read() if proc.stderr else ""


def test_up_can_declare_worker_capabilities(tmp_path: Path) -> None:
    """examples/policy.toml requires `tools = ["git"]` of every run and `runlane up` is
    "everything on one machine"; `up` had no --capability, so its workers served none
    of those runs. Now its workers declare them and run such a run."""
    url = migrated_sqlite(tmp_path / "up.db")
    bad = _run(url, tmp_path, "up", "--agent-command", "true", "--capability", "no-equals")
    assert bad.returncode == 2, bad.stderr
    assert "--capability" in bad.stderr
    bare = tmp_path / "app.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    seed = tmp_path / "seed"
    subprocess.run(["git", "clone", "-q", str(bare), str(seed)], check=True,
                   capture_output=True)
    (seed / "README").write_text("hi\n")
    for args in (["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm",
                                "init"], ["push", "-q", "origin", "main"]):
        subprocess.run(["git", *args], cwd=seed, check=True, capture_output=True)
    sub = _run(url, tmp_path, "submit", "--no-repo-check",
                              "--tenant", "acme", "--repo", str(bare), "--prompt",
               "p", "--require", "tools=git", "--json")
    assert sub.returncode == 0, sub.stderr
    run_id = json.loads(sub.stdout)["run_id"]
    env = _env(RUNLANE_FORGE_DIR=str(tmp_path / "forge"),
               RUNLANE_WORKSPACE_DIR=str(tmp_path / "ws"))
    proc = subprocess.Popen([PY, "-m", "runlane", "--database-url", url, "up", "--workers",
                             "1", "--agent-command", "true", "--capability", "tools=git"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        status = "QUEUED"
        while time.monotonic() < deadline:
            shown = _run(url, tmp_path, "runs", "show", run_id, "--json")
            status = json.loads(shown.stdout)["status"]
            if status in ("SUCCEEDED", "FAILED"):
                break
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert status == "SUCCEEDED", status


# --- 6, 7: the Python API ---------------------------------------------------------------


@pytest.fixture
def lane(tmp_path: Path) -> Iterator[Runlane]:
    lane = Runlane(f"sqlite:///{tmp_path / 'api.db'}")
    lane.upgrade_schema()
    lane.submit(tenant="acme", repo="/srv/git/app.git", prompt="p")
    yield lane
    lane.close()


def test_api_on_a_database_without_schema_says_so(tmp_path: Path) -> None:
    """On a database never upgraded lane.runs() raised sqlalchemy's OperationalError
    ('no such table: runs' with the SQL), not SchemaOutdated with the fix."""
    from runlane.errors import SchemaOutdated

    lane = Runlane(f"sqlite:///{tmp_path / 'fresh.db'}")
    with pytest.raises(SchemaOutdated, match="runlane db upgrade"):
        lane.runs()
    with pytest.raises(SchemaOutdated):
        lane.submit(tenant="acme", repo="/srv/git/app.git", prompt="p")
    lane.upgrade_schema()  # the fix it names works, and the lane is usable after it
    assert lane.runs() == []


def test_api_on_an_unreachable_database_says_so() -> None:
    from runlane.errors import DatabaseUnavailable

    lane = Runlane("postgresql://postgres@127.0.0.1:1/x")
    with pytest.raises(DatabaseUnavailable):
        lane.runs()


def test_api_runs_accepts_the_status_names_the_cli_does(lane: Runlane) -> None:
    assert len(lane.runs(status="QUEUED")) == 1
    assert len(lane.runs(status="queued")) == 1, "the CLI accepts 'queued'"


def test_api_runs_typo_status_is_an_error(lane: Runlane) -> None:
    with pytest.raises(ValueError, match="QUEUD"):
        lane.runs(status="QUEUD")


@pytest.mark.parametrize("limit", [-1, 0, True, 2**40])
def test_api_runs_bad_limit_is_an_error(lane: Runlane, limit: int) -> None:
    """lane.runs(limit=-1) returned every run (SQLite reads LIMIT -1 as none)."""
    with pytest.raises(ValueError):
        lane.runs(limit=limit)


def test_api_runs_bad_tenant_is_an_error(lane: Runlane) -> None:
    with pytest.raises(ValueError):
        lane.runs(tenant="")


@pytest.mark.parametrize("concurrency", [0, -1, 10**6])
def test_api_worker_refuses_a_bad_concurrency(lane: Runlane, concurrency: int) -> None:
    """lane.worker(concurrency=0) built a worker that never claims and, with
    exit_when_idle, never exits."""
    with pytest.raises(ValueError):
        lane.worker(agent_command="true", concurrency=concurrency)


@pytest.mark.parametrize("queues", ["default", [], ["ok", ""], [None]])
def test_api_worker_refuses_bad_queues(lane: Runlane, queues: Any) -> None:
    """lane.worker(queues="default") served nothing, silently (each character a
    queue)."""
    with pytest.raises(ValueError):
        lane.worker(agent_command="true", queues=queues)


def test_api_errors_are_runlane_errors(lane: Runlane) -> None:
    with pytest.raises(RunlaneError):
        lane.runs(status="nope")


# --- 8, 9: runs show / runs list ----------------------------------------------------------


def test_runs_show_gives_every_time_in_one_format(tmp_path: Path) -> None:
    """`runs show` rendered every *_at field as ISO 8601 but each event's `at` and
    admission.retry_after as epoch floats (in --json and in the table)."""
    url = migrated_sqlite(tmp_path / "t.db")
    policy = tmp_path / "p.toml"
    policy.write_text('[[rules]]\nwhen = { tenant = "later" }\naction = "defer"\n')
    assert _run(url, tmp_path, "policy", "apply", str(policy)).returncode == 0
    sub = _run(url, tmp_path, "submit", "--no-repo-check",
                              "--tenant", "later", "--repo", "/srv/app.git",
               "--prompt", "p", "--json")
    run_id = json.loads(sub.stdout)["run_id"]
    shown = json.loads(_run(url, tmp_path, "runs", "show", run_id, "--json").stdout)
    iso = shown["created_at"]
    assert isinstance(iso, str) and iso.endswith("+00:00"), iso
    assert shown["events"] and all(isinstance(e["at"], str) and e["at"].endswith("+00:00")
                                   for e in shown["events"]), shown["events"]
    retry = shown["admission"]["retry_after"]
    assert isinstance(retry, str) and retry.endswith("+00:00"), retry
    table = _run(url, tmp_path, "runs", "show", run_id, "--utc", "--events",
                 COLUMNS="200").stdout
    # People read local time (here UTC, --utc) to the second, with its offset.
    assert shown["events"][0]["at"][:19].replace("T", " ") + "+00:00" in table, table
    assert retry[:19].replace("T", " ") + "+00:00" in table, table


def test_runs_list_says_when_the_limit_cut_it_and_shows_whole_ids(tmp_path: Path) -> None:
    """`runs list` returned the oldest --limit runs (1000 by default) without a word,
    and its table cut run ids at 80 columns, so `runs show` could not take them."""
    url = migrated_sqlite(tmp_path / "l.db")
    subs = [json.loads(_run(url, tmp_path, "submit", "--no-repo-check",
                                           "--tenant", "acme", "--repo",
                            "/srv/app.git", "--prompt", f"p{i}", "--json").stdout)
            for i in range(3)]
    cut = _run(url, tmp_path, "runs", "list", "--limit", "2", "--json")
    assert len(json.loads(cut.stdout)) == 2
    assert "--limit" in cut.stderr, cut.stderr
    whole = _run(url, tmp_path, "runs", "list", "--limit", "3", "--json")
    assert whole.stderr == "", whole.stderr
    table = _run(url, tmp_path, "runs", "list", COLUMNS="80")
    assert table.returncode == 0, table.stderr
    for s in subs:
        assert s["run_id"] in table.stdout, table.stdout


# --- 10: the docs ------------------------------------------------------------------------


README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_agent_command_example_survives_the_users_shell() -> None:
    """In double quotes, `$RUNLANE_PROMPT` is expanded by the user's shell (empty) before
    runlane ever sees it."""
    assert '"my-agent --task \\"$RUNLANE_PROMPT\\""' not in README
    assert "'my-agent --task \"$RUNLANE_PROMPT\"'" in README


def test_batch_lines_take_the_flag_names_too(tmp_path: Path) -> None:
    """CONTRACT.md: a batch line has "the same fields as the flags, snake_case"; the
    keys accepted were `requires` (an object), `estimated_cost_usd`, `parent_task_id`.
    The flags' names are now accepted too."""
    url = migrated_sqlite(tmp_path / "b.db")
    parent = json.loads(_run(url, tmp_path, "submit", "--no-repo-check",
                                            "--tenant", "acme", "--repo",
                             "/srv/app.git", "--prompt", "p", "--json").stdout)
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"tenant": "acme", "repo": "/srv/app.git", "prompt": "q",
                                 "require": ["tools=git"], "estimated_cost": 0.5,
                                 "parent": parent["task_id"]}) + "\n")
    done = _run(url, tmp_path, "submit", "--no-repo-check", "--batch", str(batch), "--json")
    assert done.returncode == 0, done.stderr
    run_id = json.loads(done.stdout)[0]["run_id"]
    shown = json.loads(_run(url, tmp_path, "runs", "show", run_id, "--json").stdout)
    assert shown["estimated_cost_usd"] == 0.5
    assert shown["parent_task_id"] == parent["task_id"]
    assert shown["route_key"], shown
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"tenant": "acme", "repo": "/srv/app.git", "prompt": "q",
                                "parent": "x", "parent_task_id": "y"}) + "\n")
    done = _run(url, tmp_path, "submit", "--no-repo-check", "--batch", str(both))
    assert done.returncode == 2, done.stderr
