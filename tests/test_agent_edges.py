"""The worker's edges with the agent: what the agent is given (its artifacts directory,
its environment), what a misconfigured worker or an empty remote does to the queue, the
in-process agents' protocol checks, and the worker's bookkeeping of a run's attempts.
From the documentation and maintenance reviews of 2026-12-02; each test failed before
its fix. Real git repositories (a bare repository is the remote) and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from runlane import Runlane
from runlane.agents.python import AgentContext, AgentFailed, PythonAgentRunner
from runlane.clock import ManualClock
from runlane.settings import Settings, SettingsInvalid
from runlane.store.store import Store

from .conftest import POLICY, migrated_sqlite
from .support import cli_env, submit


def _cli(tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runlane", *args], cwd=tmp_path,
                          env=cli_env(tmp_path, **extra), capture_output=True, text=True,
                          timeout=120)


def _git(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def _remote(tmp_path: Path, name: str = "app.git", *, empty: bool = False) -> Path:
    bare = tmp_path / name
    _git("init", "-q", "--bare", "-b", "main", str(bare))
    if not empty:
        seed = tmp_path / f"seed-{name}"
        _git("clone", "-q", str(bare), str(seed))
        (seed / "README").write_text("hi\n")
        _git("add", ".", cwd=seed)
        _git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "init", cwd=seed)
        _git("push", "-q", "origin", "main", cwd=seed)
    return bare


def _submit(tmp_path: Path, repo: Path, prompt: str, **extra: str) -> dict[str, str]:
    done = _cli(tmp_path, "submit", "--tenant", "acme", "--repo", str(repo), "--prompt", prompt,
                "--max-attempts", "1", "--json", **extra)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def _show(tmp_path: Path, run_id: str, **extra: str) -> dict[str, Any]:
    done = _cli(tmp_path, "runs", "show", run_id, "--json", **extra)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


# --- the agent's artifacts directory ----------------------------------------------------


def test_artifacts_dir_given_to_the_agent_is_usable_from_its_workspace(tmp_path: Path) -> None:
    """With the default ARTIFACTS_DIR (once `runlane-artifacts`, relative) the agent was given
    a relative RUNLANE_ARTIFACTS_DIR while it runs in the workspace: what it wrote "into
    the artifacts directory" landed in the repository and was committed and pushed."""
    repo = _remote(tmp_path)
    assert _cli(tmp_path, "db", "upgrade").returncode == 0
    sub = _submit(tmp_path, repo, "write a report")
    agent = ('mkdir -p "$RUNLANE_ARTIFACTS_DIR" && echo report > "$RUNLANE_ARTIFACTS_DIR/r.txt"'
             ' && echo "$RUNLANE_ARTIFACTS_DIR" > seen.txt')
    done = _cli(tmp_path, "worker", "--agent-command", agent, "--exit-when-idle")
    assert done.returncode == 0, done.stderr
    branch = f"agent/{sub['task_id']}/{sub['run_id']}"
    seen = _git("show", f"{branch}:seen.txt", cwd=repo).strip()
    files = _git("ls-tree", "-r", "--name-only", branch, cwd=repo).split()
    assert Path(seen).is_absolute(), f"RUNLANE_ARTIFACTS_DIR was {seen!r}"
    assert files == ["README", "seen.txt"], files
    # Where the README says: under ARTIFACTS_DIR, in the user's state directory.
    assert Path(seen) == tmp_path / "state" / "runlane" / "artifacts" / sub["run_id"] / "1"
    assert (Path(seen) / "r.txt").read_text() == "report\n"
    assert (Path(seen) / "agent.log").exists()


# --- what the agent inherits from the worker ---------------------------------------------


@pytest.mark.parametrize("token_variable", ["RUNLANE_GITHUB_TOKEN", "GITHUB_TOKEN"])
def test_the_agent_does_not_inherit_the_workers_credentials(tmp_path: Path,
                                                            token_variable: str) -> None:
    """The agent got the worker's whole environment: the code host's token (the one
    runlane uses, RUNLANE_GITHUB_TOKEN or else GITHUB_TOKEN) and RUNLANE_DATABASE_URL
    (with its password), so it could push, open pull requests or write runs directly,
    outside the ledger and the fencing tokens. Now it gets an allowlist (PATH, the
    locale, ...), the variables SANDBOX_PASS_ENV names, and the contract's variables:
    nothing else of the worker's environment, and never the code host's token, even
    when SANDBOX_PASS_ENV names it."""
    repo = _remote(tmp_path)
    url = f"sqlite:///{tmp_path / 'runlane.db'}"
    assert _cli(tmp_path, "db", "upgrade", RUNLANE_DATABASE_URL=url).returncode == 0
    sub = _submit(tmp_path, repo, "p", RUNLANE_DATABASE_URL=url)
    done = _cli(tmp_path, "worker", "--agent-command", "env > env.txt", "--exit-when-idle",
                RUNLANE_DATABASE_URL=url, RUNLANE_HEARTBEAT_SECONDS="5",
                RUNLANE_SANDBOX_PASS_ENV=f"PROVIDER_API_KEY,{token_variable.removeprefix('RUNLANE_')}",
                PROVIDER_API_KEY="sk-provider", CLOUD_SECRET="not-the-agents",
                **{token_variable: "ghp_secret"})
    assert done.returncode == 0, done.stderr
    text = _git("show", f"agent/{sub['task_id']}/{sub['run_id']}:env.txt", cwd=repo)
    env = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    assert "ghp_secret" not in text and "not-the-agents" not in text
    assert not {"RUNLANE_DATABASE_URL", "RUNLANE_HEARTBEAT_SECONDS", "RUNLANE_FORGE_DIR",
                "RUNLANE_WORKSPACE_DIR", "RUNLANE_SANDBOX_PASS_ENV", "PYTHONPATH",
                token_variable} & set(env), sorted(env)
    assert env["PROVIDER_API_KEY"] == "sk-provider"  # named in SANDBOX_PASS_ENV
    assert env["RUNLANE_RUN_ID"] == sub["run_id"] and env["RUNLANE_TASK_ID"] == sub["task_id"]
    assert {k for k in env if k.startswith("RUNLANE_")} == {
        "RUNLANE_TASK_ID", "RUNLANE_RUN_ID", "RUNLANE_ATTEMPT", "RUNLANE_TENANT",
        "RUNLANE_REPO", "RUNLANE_PROMPT", "RUNLANE_WORKSPACE", "RUNLANE_ARTIFACTS_DIR"}


def test_a_github_token_of_the_agents_own_is_kept_when_passed() -> None:
    """GITHUB_TOKEN is withheld when it is runlane's token; with RUNLANE_GITHUB_TOKEN set
    for runlane, a different GITHUB_TOKEN is the agent's own and reaches it when
    SANDBOX_PASS_ENV names it (and only then: it is not in the allowlist)."""
    from runlane.agents.command import agent_environment

    worker = {"RUNLANE_GITHUB_TOKEN": "ghp_runlane", "GITHUB_TOKEN": "ghp_agent", "PATH": "/bin"}
    assert agent_environment(worker) == {"PATH": "/bin"}
    assert agent_environment(worker, ["GITHUB_TOKEN"]) == {"GITHUB_TOKEN": "ghp_agent",
                                                          "PATH": "/bin"}
    same = agent_environment({"RUNLANE_GITHUB_TOKEN": "ghp_x", "GITHUB_TOKEN": "ghp_x"},
                             ["GITHUB_TOKEN"])
    assert same == {}


# --- a misconfigured worker ----------------------------------------------------------------


@pytest.mark.parametrize("setting", ["WORKSPACE_DIR", "ARTIFACTS_DIR", "--artifacts-dir"])
def test_a_worker_that_cannot_make_workspaces_does_not_fail_the_queue(tmp_path: Path,
                                                                      setting: str) -> None:
    """With WORKSPACE_DIR (or ARTIFACTS_DIR) a path that cannot be created, `runlane
    worker` started, claimed, and ended every run it took FAILED WORKER_ERROR (not
    retryable; with --artifacts-dir a traceback too): one misconfigured worker emptied
    the queue. It refuses to start now (bad input, exit 2), before claiming anything."""
    repo = _remote(tmp_path)
    assert _cli(tmp_path, "db", "upgrade").returncode == 0
    sub = _submit(tmp_path, repo, "p")
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "dir")
    if setting.startswith("--"):
        done = _cli(tmp_path, setting, bad, "worker", "--agent-command", "true",
                    "--exit-when-idle")
    else:
        done = _cli(tmp_path, "worker", "--agent-command", "true", "--exit-when-idle",
                    **{f"RUNLANE_{setting}": bad})
    shown = _show(tmp_path, sub["run_id"])
    assert shown["status"] == "QUEUED", (done.returncode, shown["status"], shown["message"])
    assert shown["attempt_count"] == 0
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    name = setting.removeprefix("--").replace("-", "_").upper()
    assert done.stderr.startswith(f"error: {name} {bad}: "), done.stderr


def test_the_python_api_refuses_a_worker_whose_directories_are_unusable(tmp_path: Path
                                                                        ) -> None:
    (tmp_path / "a-file").write_text("")
    with Runlane(f"sqlite:///{tmp_path / 'api.db'}") as lane:
        lane.upgrade_schema()  # a lane checks the schema on first use
    for field in ("workspace_dir", "artifacts_dir"):
        settings = Settings(database_url=f"sqlite:///{tmp_path / 'api.db'}",
                            **{field: tmp_path / "a-file" / "x"})  # type: ignore[arg-type]
        with Runlane(settings=settings) as lane, pytest.raises(SettingsInvalid) as caught:
            lane.worker(agent_command="true")
        assert str(caught.value).startswith(f"{field.upper()} {tmp_path / 'a-file' / 'x'}: ")
        assert caught.value.exit_code == 2
    ok = Settings(database_url=f"sqlite:///{tmp_path / 'api.db'}",
                  workspace_dir=tmp_path / "new" / "ws", artifacts_dir=tmp_path / "new" / "art")
    with Runlane(settings=ok) as lane:
        lane.worker(agent_command="true")
    assert (tmp_path / "new" / "ws").is_dir() and (tmp_path / "new" / "art").is_dir()


# --- an empty remote ------------------------------------------------------------------------


def test_an_empty_remote_pushes_nothing_and_fails_as_a_contract_problem(tmp_path: Path
                                                                          ) -> None:
    """A remote with no branch at all (a fresh `git init --bare`) ran the agent, pushed a
    root commit to agent/{task}/{run}, then failed WORKER_ERROR (the pull request had no
    base branch). README: a remote without a default branch is TASK_CONTRACT_INVALID."""
    repo = _remote(tmp_path, "empty.git", empty=True)
    assert _cli(tmp_path, "db", "upgrade").returncode == 0
    sub = _submit(tmp_path, repo, "write x")
    done = _cli(tmp_path, "worker", "--agent-command", "echo ran > \"$RUNLANE_ARTIFACTS_DIR/ran\""
                "; echo x > x.txt", "--exit-when-idle")
    assert done.returncode == 0, done.stderr
    shown = _show(tmp_path, sub["run_id"])
    branches = _git("for-each-ref", "--format=%(refname)", "refs/heads/", cwd=repo).split()
    assert branches == [], f"pushed {branches} and then failed {shown['reason_code']}"
    assert (shown["status"], shown["reason_code"]) == ("FAILED", "TASK_CONTRACT_INVALID"), \
        shown["message"]
    assert "no branch" in shown["message"], shown["message"]
    assert not (tmp_path / "runlane-artifacts" / sub["run_id"] / "1" / "ran").exists()


# --- in-process agents keep to the protocol's checks ------------------------------------------


def _inprocess(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agent: Any,
               prompt: str) -> dict[str, Any]:
    monkeypatch.setenv("RUNLANE_FORGE_DIR", str(tmp_path / "forge"))
    monkeypatch.setenv("RUNLANE_WORKSPACE_DIR", str(tmp_path / "ws"))
    monkeypatch.chdir(tmp_path)  # the default ARTIFACTS_DIR is relative
    repo = _remote(tmp_path)
    with Runlane(f"sqlite:///{tmp_path / 'inproc.db'}") as lane:
        lane.upgrade_schema()
        run_id = lane.submit(tenant="acme", repo=str(repo), prompt=prompt,
                             max_attempts=1).run_id
        lane.worker(agent=PythonAgentRunner(agent), exit_when_idle=True).run()
        return lane.run(run_id)


@pytest.mark.parametrize("usd", [-5.0, float("nan"), float("inf")])
def test_inprocess_agent_cannot_report_a_negative_cost(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       usd: float) -> None:
    """A `cost` line with a negative `usd` is refused as malformed; ctx.report_cost(-5)
    was taken and the run's cost became -5.0, lowering what MAX_RUN_COST_USD and the
    daily budgets see. The call now raises, as the line is refused; a huge figure is
    counted as at most what one line may count."""
    refused: list[str] = []

    def agent(ctx: AgentContext) -> None:
        try:
            ctx.report_cost(usd)
        except ValueError as exc:
            refused.append(str(exc))
        with pytest.raises(ValueError):
            ctx.report_cost(0.5, input_tokens=-1)
        ctx.report_cost(1e300, input_tokens=10**30)
        (ctx.workspace / "NOTES.md").write_text("x")

    run = _inprocess(tmp_path, monkeypatch, agent, "negative cost")
    assert len(refused) == 1 and "usd" in refused[0], refused
    assert run["status"] == "SUCCEEDED", run["message"]
    assert run["cost_usd"] == 1e9, run["cost_usd"]


@pytest.mark.parametrize(("code", "message"), [
    ("NOT_A_CODE", "unknown reason code 'NOT_A_CODE'"),
    ("LEASE_RELEASED", "a code only runlane may record"),
])
def test_inprocess_agent_failed_with_an_unknown_reason_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, message: str) -> None:
    """The command protocol ignores a `fail` line with an unknown reason_code (the exit
    status makes it AGENT_FAILED); AgentFailed("NOT_A_CODE") was recorded verbatim."""

    def agent(ctx: AgentContext) -> None:
        raise AgentFailed(code, "the model said no")

    run = _inprocess(tmp_path, monkeypatch, agent, "unknown code")
    assert (run["status"], run["reason_code"]) == ("FAILED", "AGENT_FAILED")
    assert message in run["message"], run["message"]


def test_inprocess_agent_exception_keeps_its_message(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception raised by the agent was recorded as "agent exited with status 1"."""

    def agent(ctx: AgentContext) -> None:
        raise RuntimeError("the provider's SDK broke")

    run = _inprocess(tmp_path, monkeypatch, agent, "crash")
    assert (run["status"], run["reason_code"]) == ("FAILED", "AGENT_FAILED")
    assert run["message"] == "RuntimeError: the provider's SDK broke", run["message"]


@pytest.mark.parametrize(("retry_after", "reason", "message"), [
    (5.0, "PROVIDER_RATE_LIMIT", "slow down"),
    (-3.0, "AGENT_FAILED", 'agent failed with "retry_after_seconds" must be a non-negative '
                           "number, got -3.0: slow down"),
])
def test_inprocess_agent_failed_is_checked_as_a_fail_line_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, retry_after: float, reason: str,
        message: str) -> None:
    """A known code classifies the failure; a negative retry-after makes it as
    unclassifiable as the `fail` line carrying it would be."""

    def agent(ctx: AgentContext) -> None:
        raise AgentFailed("PROVIDER_RATE_LIMIT", "slow down", retry_after_seconds=retry_after)

    run = _inprocess(tmp_path, monkeypatch, agent, "rate limited")
    assert (run["reason_code"], run["message"]) == (reason, message)


# --- the worker's bookkeeping of a run's attempts ------------------------------------------------


def test_an_ended_attempt_thread_does_not_drop_a_newer_attempt_of_its_run(
        tmp_path: Path, clock: ManualClock) -> None:
    """An attempt stopped on its local lease deadline gives its lease back (requeued at
    once); while its thread still cleans up, the same worker claims the run again. The
    old thread's ``finally`` popped ``_active[run_id]``, which was by then the *new*
    attempt: its lease was no longer heartbeated and the worker counted one slot fewer
    than it used."""
    from runlane.worker.attempt import AttemptState
    from runlane.worker.worker import Worker, WorkerConfig

    store = Store(migrated_sqlite(tmp_path / "w.db"), clock=clock, retry_policy=POLICY)
    [sub] = submit(store)
    [first] = store.claim("w1", lease_ttl=30.0)
    old_cleaning = threading.Event()
    finish_old = threading.Event()
    finish_new = threading.Event()

    class Driver:
        def run(self, state: AttemptState) -> str:
            if state.lease.fencing_token == 1:
                store.release(state.lease, message="local lease deadline passed")
                old_cleaning.set()
                finish_old.wait(10)  # removing its workspace
                return "lease_lost"
            finish_new.wait(10)  # the new attempt works on
            return "pull_request"

    worker = Worker(store, Driver(), WorkerConfig(concurrency=2, lease_ttl_seconds=30.0),  # type: ignore[arg-type]
                    worker_id="w1")

    def tokens() -> list[int]:
        with worker._lock:
            return sorted(s.lease.fencing_token for _, s in worker._active.values()
                          if s.lease.run_id == sub.run_id)

    worker._start(AttemptState(first, store))
    assert old_cleaning.wait(10)
    [second] = store.claim("w1", lease_ttl=30.0)  # what _claim_once does with its free slot
    assert second.run_id == sub.run_id and second.fencing_token == 2
    worker._start(AttemptState(second, store))
    assert tokens() == [1, 2] and worker._active_count() == 2  # both threads use a slot
    finish_old.set()
    for _ in range(500):
        if tokens() != [1, 2]:
            break
        threading.Event().wait(0.01)
    assert tokens() == [2], "the new attempt is no longer heartbeated"
    assert worker._active_count() == 1
    finish_new.set()
    for _ in range(500):
        if not tokens():
            break
        threading.Event().wait(0.01)
    assert tokens() == []
    store.close()


def test_the_library_is_quiet_unless_logging_is_configured(tmp_path: Path) -> None:
    """README: logs go to stderr. Used as a library (the README's Python example),
    runlane printed its structlog lines ('submitted', 'cancel_requested') on stdout,
    mixed into the calling program's output (a review of 2026-12-02); issue 23: the
    facade says nothing at all on stderr either unless the program configures logging,
    and then its INFO lines go there."""
    script = ("import sys\n"
              "from runlane import Runlane\n"
              "if sys.argv[1] == 'configured':\n"
              "    from runlane.logs import configure_logging\n"
              "    configure_logging('INFO')\n"
              f"lane = Runlane('sqlite:///{tmp_path / 'lib.db'}')\n"
              "lane.upgrade_schema()\n"
              "sub = lane.submit(tenant='acme', repo='/srv/git/app.git', prompt='p')\n"
              "lane.cancel(sub.task_id)\n"
              "lane.run(sub.run_id)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    for mode in ("quiet", "configured"):
        done = subprocess.run([sys.executable, "-c", script, mode], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "", done.stdout
        if mode == "quiet":
            assert done.stderr == "", done.stderr
        else:
            assert "submitted" in done.stderr and "cancel_requested" in done.stderr, \
                done.stderr
