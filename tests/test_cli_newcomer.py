"""The CLI as a newcomer meets it (issue 26): listings for people and for pipes, the
submits that can never succeed refused, a reused idempotency key named, retry and
either id, prompts from stdin, global options anywhere, `runlane info`, `up`'s crash
loop. In process (click's CliRunner) where the terminal does not matter; real
subprocesses for the terminal's width, a real pipe and `up`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from runlane.api import Runlane
from runlane.cli import app
from runlane.cli_run import run_command
from runlane.errors import Conflict
from runlane.settings import Settings

from .conftest import migrated_sqlite
from .support import bare_remote, cli_env

DENY = """
[[rules]]
name = "suspended"
when = { tenant = "evil" }
action = "deny"
reason_code = "TENANT_SUSPENDED"
"""


class Result:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.code, self.stdout, self.stderr = code, stdout, stderr

    def json(self) -> Any:
        return json.loads(self.stdout)


def rl(url: str | None, *args: str, stdin: str | None = None, code: int | None = 0,
       env: dict[str, str] | None = None) -> Result:
    """`runlane [--database-url URL] ARGS` in this process, as `main` runs it (its
    exit code and one-line errors); stdout is not a terminal, as in a pipe."""
    argv = ["runlane", *(["--database-url", url] if url else []), *args]
    runner = CliRunner()
    saved = sys.argv
    with runner.isolation(input=stdin, env={"COLUMNS": "80", **(env or {})}) as streams:
        sys.argv = argv
        try:
            run_command(app, "runlane")
            exit_code = 0
        except SystemExit as exc:
            exit_code = int(exc.code or 0)
        finally:
            sys.argv = saved
            sys.stdout.flush()
            sys.stderr.flush()
        result = Result(exit_code, streams[0].getvalue().decode(),
                        streams[1].getvalue().decode())
    if code is not None:
        assert result.code == code, (result.code, result.stdout, result.stderr)
    return result


def _auth(lane: Runlane, tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {lane.create_token(role='submit', tenant=tenant).token}"}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return migrated_sqlite(tmp_path / "runlane.db")


@pytest.fixture
def repo(tmp_path: Path) -> str:
    return str(bare_remote(tmp_path))


def _submit(url: str, repo: str, *args: str, tenant: str = "acme", prompt: str = "p",
            code: int = 0) -> Any:
    return rl(url, "submit", "--tenant", tenant, "--repo", repo, "--prompt", prompt,
              *args, "--json", code=code).json()


# --- 1. output for people and for scripts -----------------------------------------------


def test_runlane_alone_prints_help_and_exits_0() -> None:
    done = rl(None)
    assert "Usage: runlane" in done.stdout and "submit" in done.stdout
    assert done.stderr == ""


def test_plain_is_the_default_in_a_pipe_grep_and_cut_read_it(db_url: str, repo: str,
                                                             tmp_path: Path) -> None:
    """`runs list | grep -c QUEUED` printed 0 with runs queued: the table split every
    cell at 80 columns. Piped, a listing is tab-separated with a header line."""
    runs = [_submit(db_url, repo, prompt=f"p{i}")["run_id"] for i in range(3)]
    runlane = f"{sys.executable} -m runlane --database-url '{db_url}'"
    shell = (f"{runlane} runs list | grep -c QUEUED; "
             f"{runlane} runs list | cut -f1,5")
    done = subprocess.run(shell, shell=True, capture_output=True, text=True, cwd=tmp_path,
                          env=cli_env(tmp_path, COLUMNS="80"), timeout=60)
    count, *table = done.stdout.splitlines()
    assert count == "3", done
    assert table[0] == "run_id\tstatus"
    assert table[1:] == [f"{r}\tQUEUED" for r in reversed(runs)]  # newest first


def test_the_80_column_table_keeps_every_id_whole(tmp_path: Path, repo: str) -> None:
    """Ids, statuses and long tenants at COLUMNS=80: columns are dropped or cut with
    an ellipsis, never an id (run ids were split over two lines, `QUEU`/`ED`)."""
    url = migrated_sqlite(tmp_path / "t.db")
    rl(url, "policy", "apply", _policy(tmp_path))
    runs = [_submit(url, repo, tenant="a-tenant-with-a-rather-long-name")["run_id"],
            _submit(url, repo, tenant="evil", code=1)["run_id"]]
    token = rl(url, "tokens", "create", "--role", "admin", "--json").json()["info"]
    env = cli_env(tmp_path, COLUMNS="80")
    shown = {}
    for args, ids in ((("runs", "list"), runs), (("tokens", "list"), [token["token_id"]])):
        done = subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args,
                               "--output", "table"], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=60)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert all(len(line) <= 80 for line in lines), done.stdout
        for some_id in ids:
            assert any(some_id in line for line in lines), done.stdout
        shown[args[0]] = done.stdout
    # Statuses whole too (they read `QUEU`/`ED`); the tenant is cut with an ellipsis.
    assert "POLICY_DENIED" in shown["runs"] and "QUEUED" in shown["runs"], shown["runs"]
    assert "a-tenant-with-a-rather-long-name" not in shown["runs"]


def _policy(tmp_path: Path) -> str:
    path = tmp_path / "policy.toml"
    path.write_text(DENY)
    return str(path)


def test_empty_listings_say_so_and_json_is_unchanged(sqlite_url: str) -> None:
    assert rl(sqlite_url, "runs", "list", "-o", "table").stdout.strip() == "no runs"
    plain = rl(sqlite_url, "runs", "list")
    assert plain.stdout.startswith("run_id\t") and plain.stdout.count("\n") == 1
    assert plain.stderr.strip() == "no runs"
    assert rl(sqlite_url, "runs", "list", "--json").json() == []
    assert rl(sqlite_url, "runs", "list", "-o", "json").json() == []
    for group in ("tokens", "workers", "queues", "tenants", "prs"):
        assert rl(sqlite_url, group, "list", "-o", "table").stdout.startswith("no "), group
    assert "contradict" in rl(sqlite_url, "runs", "list", "--json", "-o", "plain",
                              code=2).stderr


def test_runs_show_is_a_summary_with_secrets_masked(db_url: str, tmp_path: Path) -> None:
    url_repo = "https://someone:s3cret@github.com/acme/app.git"
    sub = _submit(db_url, url_repo, "--require", "gpu=1", prompt="x" * 1000)
    shown = rl(db_url, "runs", "show", sub["run_id"], "--utc").stdout
    assert "s3cret" not in shown and "https://***@github.com/acme/app.git" in shown
    assert "None" not in shown
    assert "xxx… (600 more characters: --full-prompt)" in shown
    assert "gpu" in shown and "QUEUED" in shown
    assert "+00:00" in shown  # a whole time, with its zone
    whole = rl(db_url, "runs", "show", sub["run_id"], "--full-prompt").stdout
    assert "x" * 1000 in whole.replace("\n", "")


# --- 2. refused at submit --------------------------------------------------------------


def test_submits_that_can_never_succeed_are_refused(sqlite_url: str) -> None:
    """The README's first example (`https://git.example.com/...`) was accepted and
    every run failed at the worker: TASK_CONTRACT_INVALID."""
    unknown = rl(sqlite_url, "submit", "--tenant", "a", "--repo",
                 "https://user:pw@git.example.com/acme/app.git", "--prompt", "p", code=2)
    assert "no configured code host serves" in unknown.stderr
    assert "GitHub" in unknown.stderr and "RUNLANE_GITHUB_API_URL" in unknown.stderr
    assert "user:pw" not in unknown.stderr
    missing = rl(sqlite_url, "submit", "--tenant", "a", "--repo", "/no/such/repo.git",
                 "--prompt", "p", code=2)
    assert "does not exist" in missing.stderr
    assert rl(sqlite_url, "runs", "list", "--json").json() == []


def test_a_denied_submit_exits_1_and_a_batch_counts_denials(db_url: str, repo: str,
                                                            tmp_path: Path) -> None:
    rl(db_url, "policy", "apply", _policy(tmp_path))
    denied = rl(db_url, "submit", "--tenant", "evil", "--repo", repo, "--prompt", "p",
                code=1)
    assert denied.stdout.startswith("denied: run ")
    assert "denied: TENANT_SUSPENDED" in denied.stderr
    rows = "".join(json.dumps({"tenant": t, "repo": repo, "prompt": t, "idempotency_key": t})
                   + "\n" for t in ("acme", "evil"))
    batch = rl(db_url, "submit", "--batch", "-", stdin=rows, code=1)
    assert "2 task(s): 1 created, 0 already present, 1 denied" in batch.stdout
    again = rl(db_url, "submit", "--batch", "-", stdin=rows.splitlines()[0] + "\n")
    assert "1 task(s): 0 created, 1 already present, 0 denied" in again.stdout


def test_a_reused_key_with_another_request_names_the_field(db_url: str, repo: str) -> None:
    """The same key with another prompt silently returned the first (FAILED) task."""
    _submit(db_url, repo, "--idempotency-key", "k1", prompt="first")
    conflict = rl(db_url, "submit", "--tenant", "acme", "--repo", repo, "--prompt",
                  "second", "--idempotency-key", "k1", code=2)
    assert "idempotency key 'k1'" in conflict.stderr and "'prompt'" in conflict.stderr
    queue = rl(db_url, "submit", "--tenant", "acme", "--repo", repo, "--prompt", "first",
               "--idempotency-key", "k1", "--queue", "other", code=2)
    assert "'queue'" in queue.stderr
    with Runlane(settings=Settings(database_url=db_url)) as lane:
        with pytest.raises(Conflict) as raised:
            lane.submit("acme", repo, "first", idempotency_key="k1", requires={"gpu": 1})
        assert raised.value.field == "requires"


def test_the_http_api_answers_the_conflict_409_naming_the_field(db_url: str,
                                                                repo: str) -> None:
    from fastapi.testclient import TestClient

    from runlane.http.app import create_app

    with Runlane(settings=Settings(database_url=db_url)) as lane, \
            TestClient(create_app(lane)) as client:
        auth = _auth(lane, "acme")
        body = {"repo": repo, "prompt": "p", "idempotency_key": "k"}
        assert client.post("/v1/tasks", json=body, headers=auth).status_code == 201
        answer = client.post("/v1/tasks", json={**body, "prompt": "q"}, headers=auth)
        assert answer.status_code == 409, answer.text
        assert "'prompt'" in answer.json()["detail"]


# --- 3. retry, and either id -----------------------------------------------------------


def test_retry_and_either_id_where_either_makes_sense(db_url: str, repo: str) -> None:
    sub = _submit(db_url, repo)
    cancelled = rl(db_url, "cancel", sub["run_id"])  # a run's id: its task
    assert f"task {sub['task_id']} (of run {sub['run_id']})" in cancelled.stdout
    retried = rl(db_url, "retry", sub["run_id"], "--json").json()
    assert retried["retry_of_run_id"] == sub["run_id"] and retried["status"] == "QUEUED"
    listed = rl(db_url, "runs", "list", "--task", sub["task_id"], "--json").json()
    assert [r["run_id"] for r in listed] == [retried["run_id"], sub["run_id"]]
    newest = rl(db_url, "runs", "show", sub["task_id"], "--json").json()  # a task's id
    assert newest["run_id"] == retried["run_id"]
    shown = rl(db_url, "runs", "show", sub["task_id"]).stdout
    assert f"retry of     {sub['run_id']}" in shown
    token = rl(db_url, "tokens", "create", "--role", "admin", "--json").json()["info"]
    wrong = rl(db_url, "runs", "show", token["token_id"], code=3)
    assert "it is an API token's id, not a run's or a task's" in wrong.stderr
    wrong = rl(db_url, "tokens", "revoke", sub["run_id"], code=3)
    assert "it is a run's id, not a token's" in wrong.stderr
    assert rl(db_url, "tasks", "show", sub["run_id"], "--json").json()["task_id"] == \
        sub["task_id"]
    assert "no run 'nope' (nor a task of that id)" in rl(db_url, "runs", "show", "nope",
                                                         code=3).stderr


def test_http_retry_by_a_run_id_is_404_for_another_tenant(db_url: str, repo: str) -> None:
    from fastapi.testclient import TestClient

    from runlane.http.app import create_app

    with Runlane(settings=Settings(database_url=db_url)) as lane, \
            TestClient(create_app(lane)) as client:
        theirs = lane.submit("acme", repo, "p")
        lane.cancel(theirs.task_id)
        other, mine = _auth(lane, "globex"), _auth(lane, "acme")
        for some_id in (theirs.task_id, theirs.run_id):
            refused = client.post(f"/v1/tasks/{some_id}/retry", headers=other)
            assert refused.status_code == 404, refused.text
        done = client.post(f"/v1/tasks/{theirs.run_id}/retry", headers=mine)
        assert done.status_code == 201, done.text
        assert done.json()["retry_of_run_id"] == theirs.run_id


# --- 4. prompts from stdin, global options, listing order, info ------------------------


def test_a_1_mb_prompt_from_stdin(db_url: str, repo: str) -> None:
    """A 200 KB prompt failed with `Argument list too long`."""
    prompt = "fix it " * 150_000  # 1.05 MB
    sub = rl(db_url, "submit", "--tenant", "acme", "--repo", repo, "--prompt-file", "-",
             "--json", stdin=prompt).json()
    with Runlane(settings=Settings(database_url=db_url)) as lane:
        assert lane.run(sub["run_id"]).prompt == prompt.strip()
    both = rl(db_url, "submit", "--tenant", "acme", "--repo", repo, "--prompt", "p",
              "--prompt-file", "-", stdin="q", code=2)
    assert "not both" in both.stderr


def test_global_options_after_the_subcommand(sqlite_url: str, tmp_path: Path) -> None:
    rl(None, "runs", "list", "--database-url", sqlite_url)
    rl(None, "runs", "list", f"--database-url={sqlite_url}", "--limit", "5")
    info = rl(None, "info", "--database-url", sqlite_url, "--lease-ttl-seconds", "90",
              "--json").json()
    assert info["settings"]["lease_ttl_seconds"] == {"value": 90.0, "source": "flag"}
    assert info["schema"]["ok"] is True and info["database"].endswith("runlane.db")
    assert info["code_hosts"] and "available" in info["sandbox"]
    # submit's own --max-attempts is submit's, not the setting MAX_ATTEMPTS.
    repo = str(bare_remote(tmp_path))
    sub = rl(None, "submit", "--tenant", "a", "--repo", repo, "--prompt", "p",
             "--max-attempts", "2", "--database-url", sqlite_url, "--json").json()
    assert rl(sqlite_url, "runs", "show", sub["run_id"], "--json").json()["max_attempts"] == 2


def test_default_paths_are_absolute_whatever_the_directory(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The default database and artifacts were relative to the current directory: the
    `runlane db upgrade` advice, run from another one, made a second empty database."""
    for name in [k for k in os.environ if k.startswith("RUNLANE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    seen = set()
    for where in (tmp_path, tmp_path / "elsewhere"):
        where.mkdir(exist_ok=True)
        monkeypatch.chdir(where)
        settings = Settings()
        seen.add((settings.database_url, settings.artifacts_dir))
    assert seen == {(f"sqlite:///{tmp_path}/state/runlane/runlane.db",
                     tmp_path / "state" / "runlane" / "artifacts")}
    rl(None, "db", "upgrade")  # the default's directory is made; `info` finds it after
    assert (tmp_path / "state" / "runlane" / "runlane.db").is_file()
    monkeypatch.chdir(tmp_path)
    assert rl(None, "info", "--json").json()["schema"]["ok"] is True
    relative = Settings(database_url="sqlite:///rel.db", artifacts_dir=Path("arts"))
    assert relative.database_url == f"sqlite:///{tmp_path}/rel.db"
    assert relative.artifacts_dir == tmp_path / "arts"


def test_runs_list_newest_first_with_before_and_since(db_url: str, repo: str) -> None:
    runs = [_submit(db_url, repo, prompt=f"p{i}")["run_id"] for i in range(4)]
    cut = rl(db_url, "runs", "list", "--limit", "2", "--json")
    assert [r["run_id"] for r in cut.json()] == runs[:1:-1]
    assert f"--before {runs[2]}" in cut.stderr
    rest = rl(db_url, "runs", "list", "--before", runs[2], "--json").json()
    assert [r["run_id"] for r in rest] == runs[1::-1]
    assert len(rl(db_url, "runs", "list", "--since", "1h", "--json").json()) == 4
    assert rl(db_url, "runs", "list", "--until", "1h", "--json").json() == []


# --- 5. up and the worker --------------------------------------------------------------


def test_up_stops_with_the_workers_error_on_a_crash_loop(sqlite_url: str,
                                                         tmp_path: Path) -> None:
    """With workers that could not start, `up` restarted them forever, no backoff."""
    env = cli_env(tmp_path, RUNLANE_FAULT_CRASH_AT="worker_start")
    done = subprocess.run(
        [sys.executable, "-m", "runlane", "--database-url", sqlite_url, "--sandbox", "off",
         "up", "--workers", "1", "--agent-command", "true", "--restart-backoff-seconds",
         "0.05", "--crash-loop-limit", "2"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a worker died 2 times in a row"), done.stderr[-2000:]


def test_up_exits_when_idle_once_every_worker_has(sqlite_url: str, tmp_path: Path) -> None:
    """`up --exit-when-idle`: a worker that exits 0 (nothing left it can serve) is not
    restarted, and `up` ends, 0, once all have."""
    env = cli_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "runlane", "--database-url", sqlite_url, "--sandbox", "off",
         "up", "--workers", "2", "--agent-command", "true", "--exit-when-idle"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr[-2000:])
    assert "worker_died" not in done.stderr  # exited, not died: none restarted


def test_the_pool_reports_the_workers_own_error_with_backoff() -> None:
    from runlane.services.supervisor import Backoff, WorkerCrashLoop, WorkerPool

    pool = WorkerPool([], 1, database_url="sqlite://",
                      backoff=Backoff(base_seconds=0.02, crash_loop_limit=3))
    pool.command = [sys.executable, "-c",
                    "import sys; sys.stderr.write('error: setting X: bad\\n'); sys.exit(2)"]
    assert [Backoff(base_seconds=1).delay(n) for n in (1, 2, 3, 10)] == [1, 2, 4, 60]
    import time

    pool.start()
    deadline = time.monotonic() + 20
    with pytest.raises(WorkerCrashLoop, match=r"3 times in a row.*error: setting X: bad"):
        while time.monotonic() < deadline:
            pool.supervise()
            time.sleep(0.01)
    assert pool.restarts == 2
    pool.stop(1)


def test_worker_exit_when_idle_says_what_it_leaves_and_why(db_url: str, repo: str,
                                                           tmp_path: Path) -> None:
    _submit(db_url, repo, "--require", "gpu=1")
    _submit(db_url, repo, "--queue", "other")
    served = _submit(db_url, repo)
    env = cli_env(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "runlane", "--database-url", db_url, "--sandbox", "off",
         "worker", "--agent-command", "echo x > x.txt", "--exit-when-idle"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if "left that this worker" in line]
    assert said and "2 queued run(s)" in said[0], done.stderr[-2000:]
    assert "gpu" in said[0] and "--queue other" in said[0]
    # `runs show` of a run that ran: its attempt, worker, token, stages, log.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", env["XDG_STATE_HOME"])
        shown = rl(db_url, "runs", "show", served["run_id"]).stdout
    assert "SUCCEEDED" in shown and "fencing token 1" in shown and "None" not in shown
    assert "stages CLAIMED → PREPARING_SANDBOX → RUNNING" in shown, shown
    log = Path(env["XDG_STATE_HOME"]) / "runlane" / "artifacts" / served["run_id"] / "1"
    assert f"log {log / 'agent.log'}" in shown.replace("\n", ""), shown
    assert "pull request" in shown and "branch agent/" in shown
