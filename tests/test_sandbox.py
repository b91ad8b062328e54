"""The sandbox around agent and verify commands (docs/sandbox.md), with real bubblewrap,
real worker processes and real signals, on SQLite and PostgreSQL: what an agent can
read, write and reach, its secrets, a machine where no sandbox can start, and that
nothing of an agent outlives its worker (SIGKILLed) or its lease (worker SIGSTOPped)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from runlane.agents.base import AttemptLimits
from runlane.agents.command import CommandRunner
from runlane.api import Runlane
from runlane.chaos.agent import STAMPS_FILE
from runlane.chaos.checks import _agent_overlaps
from runlane.codehost.local_forge import LocalForge
from runlane.domain.policy import parse_policy
from runlane.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from runlane.settings import Settings
from runlane.store.store import Store

from .support import (
    attempts_of,
    bare_remote,
    cli_env,
    one_line_error,
    processes_in,
    run_row,
    spec,
)
from .test_worker import (  # noqa: F401 - fixtures
    WorkerProcess,
    forge_dir,
    status_of,
    wait_until,
    workers,
)

MARK = secrets.token_hex(8)  # in everything an agent must not see
PY = sys.executable


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker`` (wherever their cwd is)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# --- what an agent sees -----------------------------------------------------------------

PROBE = r'''
import json, os, sys

def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError as exc:
        return "ERROR " + type(exc).__name__

def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        return "ERROR " + type(exc).__name__

def write(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "written"
    except OSError as exc:
        return "ERROR " + type(exc).__name__

targets = TARGETS
report = {
    "env": dict(os.environ),
    "ppid": os.getppid(),
    "ppid_environ": read("/proc/%d/environ" % os.getppid()),
    "ppid_cmdline": read("/proc/%d/cmdline" % os.getppid()),
    "pid1_environ": read("/proc/1/environ"),
    "pid1_cmdline": read("/proc/1/cmdline"),
    "every_process": {p: [read("/proc/%s/environ" % p), read("/proc/%s/cmdline" % p)]
                      for p in os.listdir("/proc") if p.isdigit()},
    "reads": {name: read(path) for name, path in targets["read"].items()},
    "lists": {name: listing(path) for name, path in targets["list"].items()},
    "writes": {name: write(path) for name, path in targets["write"].items()},
    "status": read("/proc/self/status"),
}
with open(os.path.join(os.environ["RUNLANE_ARTIFACTS_DIR"], "probe.json"), "w") as f:
    json.dump(report, f)
'''


@pytest.fixture
def machine(tmp_path: Path) -> dict[str, Path]:
    """A worker's machine under ``tmp_path``, every secret holding MARK: its home
    (~/.git-credentials), its working directory (runlane.toml), the forge, another run's
    live workspace and its artifacts, and a file in the host's /tmp."""
    paths = {name: tmp_path / name for name in ("home", "cwd", "forge", "workspaces",
                                                 "artifacts", "tools")}
    for path in paths.values():
        path.mkdir()
    (paths["home"] / ".git-credentials").write_text(f"https://u:{MARK}@github.com\n")
    (paths["cwd"] / "runlane.toml").write_text(f"# {MARK}\nheartbeat_seconds = 1\n")
    (paths["forge"] / "pr.json").write_text(MARK)
    other = paths["workspaces"] / "other-run-1"
    other.mkdir()
    (other / "secret.txt").write_text(MARK)
    (paths["artifacts"] / "other-run" / "1").mkdir(parents=True)
    (paths["artifacts"] / "other-run" / "1" / "agent.log").write_text(MARK)
    paths["host_tmp"] = Path(f"/tmp/runlane-sandbox-test-{MARK}")
    paths["host_tmp"].write_text(MARK)
    return paths


def test_an_agent_sees_nothing_of_its_worker(db_url: str, tmp_path: Path,
                                             machine: dict[str, Path]) -> None:
    """A real `runlane worker`, its secrets in its environment, on its command line,
    in its home, its working directory and its database, and every one of those under
    a path the agent may see (SANDBOX_READ_ONLY_PATHS is the whole tmp_path): the agent
    reads none of them, writes nowhere but its workspace, its artifacts and its /tmp,
    and holds no capability although it runs as root."""
    remote = bare_remote(tmp_path)
    url = db_url
    if url.startswith("postgresql"):  # trust authentication ignores it; argv shows it
        url = make_url(url).set(password=f"pw{MARK}").render_as_string(hide_password=False)
    store = Store(db_url)
    [sub] = store.submit([spec(repo=str(remote), idempotency_key=f"key-{MARK}")])
    store.close()
    workspace = machine["workspaces"] / f"{sub.run_id}-1"
    targets = {
        "read": {"credentials": str(machine["home"] / ".git-credentials"),
                 "toml": str(machine["cwd"] / "runlane.toml"),
                 "database": str(tmp_path / "runlane.db"),
                 "database_wal": str(tmp_path / "runlane.db-wal"),
                 "forge": str(machine["forge"] / "pr.json"),
                 "other_workspace": str(machine["workspaces"] / "other-run-1" / "secret.txt"),
                 "other_artifacts": str(machine["artifacts"] / "other-run" / "1" / "agent.log"),
                 "host_tmp": str(machine["host_tmp"]),
                 "shadow": "/etc/shadow", "ssl_private": "/etc/ssl/private"},
        "list": {"home": str(machine["home"]), "forge": str(machine["forge"]),
                 "workspaces": str(machine["workspaces"]),
                 "artifacts": str(machine["artifacts"]), "tmp": "/tmp", "etc_ssl": "/etc/ssl"},
        "write": {"tools": str(machine["tools"] / "x"), "usr": "/usr/x", "etc": "/etc/x",
                  "root": "/x", "home": str(machine["home"] / "x"),
                  "other_workspace": str(machine["workspaces"] / "other-run-1" / "x"),
                  "remote": str(remote / "x"),
                  "own_workspace": str(workspace / "probe.txt"),
                  "own_tmp": f"/tmp/probe-{MARK}"},
    }
    (machine["tools"] / "probe.py").write_text(PROBE.replace("TARGETS", repr(targets)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"HOME": str(machine["home"]), "RUNLANE_GITHUB_TOKEN": f"ghp_{MARK}",
                "CLOUD_API_KEY": MARK, "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
                "RUNLANE_FORGE_DIR": str(machine["forge"]),
                "RUNLANE_WORKSPACE_DIR": str(machine["workspaces"]),
                "RUNLANE_ARTIFACTS_DIR": str(machine["artifacts"]),
                "RUNLANE_SANDBOX_READ_ONLY_PATHS": str(tmp_path)})
    try:
        done = subprocess.run(
            [PY, "-m", "runlane", "--database-url", url, "worker", "--agent-command",
             f"{PY} {machine['tools'] / 'probe.py'}", "--exit-when-idle"],
            cwd=machine["cwd"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((machine["artifacts"] / sub.run_id / "1" / "probe.json").read_text())
    finally:
        machine["host_tmp"].unlink()
    seen = json.dumps(report)
    assert MARK not in seen, [k for k, v in report.items() if MARK in json.dumps(v)]
    for name, value in report["reads"].items():  # masked (empty) or not there at all
        assert value == "" or value.startswith("ERROR"), (name, value[:200])
    assert report["lists"]["workspaces"] == [f"{sub.run_id}-1"]  # only its own
    assert report["lists"]["artifacts"] == [sub.run_id]
    assert report["lists"]["home"] == [] and report["lists"]["forge"] == []
    assert report["lists"]["etc_ssl"] == ["certs", "openssl.cnf"]
    writes = report["writes"]
    assert {k for k, v in writes.items() if v == "written"} == {"own_workspace", "own_tmp"}
    assert not Path(f"/tmp/probe-{MARK}").exists()  # its /tmp was its own
    assert "CLOUD_API_KEY" not in report["env"] and report["env"]["HOME"] == "/tmp/home"
    # Its parent is bwrap (the sandbox's PID 1) or the shell, never the worker.
    assert report["ppid"] in (1, 2)
    capabilities = dict(line.split(":\t") for line in report["status"].splitlines()
                        if line.startswith("Cap"))
    assert capabilities["CapEff"] == capabilities["CapPrm"] == "0000000000000000"
    # No host process is visible: only the sandbox's own (bwrap, the shell, the probe).
    assert len(report["every_process"]) <= 3, sorted(report["every_process"])
    assert status_of_run(db_url, sub.run_id) == "SUCCEEDED"


def status_of_run(db_url: str, run_id: str) -> str:
    store = Store(db_url)
    try:
        return str(run_row(store, run_id).status)
    finally:
        store.close()


def test_masks_hide_what_lies_under_a_visible_path_and_deeper_paths_show_again(
        tmp_path: Path) -> None:
    """The most specific path decides: a hidden directory under a read-only one is empty,
    a hidden file cannot be opened (/dev/null on a nodev mount), a read-only path under
    a hidden directory shows (the worker's Python under its masked home), a symlinked
    read-only path shows at both its names, and a path that does not exist is left
    out."""
    visible = tmp_path / "visible"
    (visible / "home" / "venv").mkdir(parents=True)
    (visible / "home" / "secret").write_text(MARK)
    (visible / "home" / "venv" / "python").write_text("python here\n")
    (visible / "runlane.db").write_text(MARK)
    (visible / "plain").write_text("plain\n")
    (tmp_path / "real-tools").mkdir()
    (tmp_path / "real-tools" / "tool").write_text("tool\n")
    (tmp_path / "tools-link").symlink_to(tmp_path / "real-tools")
    sandbox = Sandbox(SandboxConfig(
        read_only_paths=(str(visible), str(visible / "home" / "venv"),
                         str(tmp_path / "tools-link"), str(tmp_path / "missing")),
        hidden_paths=(str(visible / "home"), str(visible / "runlane.db"))))
    (tmp_path / "ws").mkdir()
    result = CommandRunner(
        f"cat {visible}/plain {visible}/home/venv/python {tmp_path}/tools-link/tool "
        f"{tmp_path}/real-tools/tool; ls -a {visible}/home; cat {visible}/runlane.db; "
        f"cat {visible}/home/secret", sandbox=sandbox).run(
        workspace=tmp_path / "ws", artifacts_dir=tmp_path / "art", env={},
        control=_Quiet(), limits=AttemptLimits())
    log = (tmp_path / "art" / "agent.log").read_text()
    assert MARK not in log
    assert log.splitlines()[:7] == ["plain", "python here", "tool", "tool", ".", "..", "venv"]
    assert f"{visible}/runlane.db: Permission denied" in log
    assert f"{visible}/home/secret: No such file" in log and result.exit_code == 1


class _Quiet:
    def stop_reason(self) -> None:
        return None

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None:
        pass

    def progress(self, message: str) -> None:
        pass


# --- the network ------------------------------------------------------------------------

NET_PROBE = ("import os, socket, sys\n"
             "for port in sys.argv[1:]:\n"
             "    try:\n"
             "        socket.create_connection(('127.0.0.1', int(port)), timeout=3).close()\n"
             "        result = 'connected'\n"
             "    except OSError as exc:\n"
             "        result = type(exc).__name__\n"
             "    open(os.environ['RUNLANE_ARTIFACTS_DIR'] + '/port-' + port, 'w')"
             ".write(result)\n")


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    tools = tmp_path / "tools"
    tools.mkdir()
    settings = Settings(database_url=db_url, workspace_dir=tmp_path / "workspaces",
                        artifacts_dir=tmp_path / "artifacts", heartbeat_seconds=0.2,
                        agent_term_grace_seconds=0.5, sandbox_read_only_paths=(tools,))
    with Runlane(settings=settings) as lane:
        yield lane


def _reaches(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("network", [False, True])
def test_the_network_is_the_policys(lane: Runlane, tmp_path: Path, network: bool) -> None:
    """`network = false`: a socket to 127.0.0.1:5432 (the database server) fails, as to
    any other port of the host; `network = true`: the host's network, both connect."""
    remote = bare_remote(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    probe = tmp_path / "tools" / "net.py"
    probe.write_text(NET_PROBE)
    lane.store.apply_policy(parse_policy(
        f"[defaults.limits]\nnetwork = {str(network).lower()}\n", "p.toml"), source="test")
    run_id = lane.submit("acme", str(remote), "reach the database").run_id
    try:
        worker = lane.worker(agent_command=f"{PY} {probe} 5432 {port}", exit_when_idle=True,
                             code_host_for=lambda repo: LocalForge(tmp_path / "forge"))
        worker.run()
    finally:
        listener.close()
    assert lane.run(run_id)["limits"]["network"] is network  # recorded on the run
    artifacts = tmp_path / "artifacts" / run_id / "1"
    mine = (artifacts / f"port-{port}").read_text()
    assert (mine == "connected") is network, mine
    if _reaches(5432):
        database = (artifacts / "port-5432").read_text()
        assert (database == "connected") is network, database


# --- secrets -----------------------------------------------------------------------------

SECRET_AGENT = (
    'cat "$RUNLANE_SECRETS_DIR/MODEL_API_KEY" > "$RUNLANE_ARTIFACTS_DIR/key"; '
    'env > "$RUNLANE_ARTIFACTS_DIR/env"; touch "$RUNLANE_ARTIFACTS_DIR/ready"; '
    'while [ ! -e "$RUNLANE_ARTIFACTS_DIR/go" ]; do sleep 0.02; done; echo x > x.txt')
# The repository's own code runs in the verify stage: no secret there.
SECRET_VERIFY = ('test -z "${RUNLANE_SECRETS_DIR:-}" && test ! -e /run/secrets/MODEL_API_KEY '
                 '&& ! env | grep -q MODEL_API_KEY')


@pytest.mark.parametrize("mode", ["bwrap", "off"])
def test_a_secret_the_policy_names_is_a_file_on_no_command_line(
        lane: Runlane, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`secrets = ["MODEL_API_KEY"]`: the worker's variable of that name reaches the agent
    as $RUNLANE_SECRETS_DIR/MODEL_API_KEY (/run/secrets in the sandbox), not as a
    variable, and on no process's command line (readable by every process of the host)
    while the agent runs; the verify command does not get it."""
    monkeypatch.setattr(lane.settings, "sandbox", mode)
    key = f"sk-{MARK}"
    monkeypatch.setenv("MODEL_API_KEY", key)
    remote = bare_remote(tmp_path)
    lane.store.apply_policy(parse_policy('[defaults.limits]\nsecrets = ["MODEL_API_KEY"]\n',
                                         "p.toml"), source="test")
    run_id = lane.submit("acme", str(remote), "use the model").run_id
    artifacts = tmp_path / "artifacts" / run_id / "1"
    worker = lane.worker(agent_command=SECRET_AGENT, verify_command=SECRET_VERIFY,
                         exit_when_idle=True,
                         code_host_for=lambda repo: LocalForge(tmp_path / "forge"))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: (artifacts / "ready").exists(), 30, "the agent to read its key")
        on_command_lines = [pid for pid in processes_with(key) if pid != os.getpid()]
        assert on_command_lines == []
        sandboxed = processes_in(tmp_path / "workspaces")
        assert sandboxed, "the agent runs"
        for pid in sandboxed:  # nor in the environment of any process of the agent
            try:
                environ = Path(f"/proc/{pid}/environ").read_text(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue  # a short-lived process of the agent ended since the listing
            assert key not in environ
    finally:
        (artifacts / "go").touch()
        thread.join(60)
    assert not thread.is_alive()
    assert (artifacts / "key").read_text() == key
    env = (artifacts / "env").read_text()
    assert "MODEL_API_KEY=" not in env and key not in env
    secrets_dir = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)[
        "RUNLANE_SECRETS_DIR"]
    assert secrets_dir == "/run/secrets" if mode == "bwrap" else not os.path.exists(secrets_dir)
    run = lane.run(run_id)
    assert (run["status"], run["outcome"]) == ("SUCCEEDED", "pull_request"), run["message"]
    assert run["limits"]["secrets"] == ["MODEL_API_KEY"]


def test_a_secret_the_worker_does_not_have_is_said_in_the_log(lane: Runlane, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    monkeypatch.delenv("MODEL_API_KEY", raising=False)
    monkeypatch.setenv("RUNLANE_GITHUB_TOKEN", "ghp_runlane")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_runlane")
    remote = bare_remote(tmp_path)
    lane.store.apply_policy(parse_policy(
        '[defaults.limits]\nsecrets = ["MODEL_API_KEY", "GITHUB_TOKEN"]\n', "p.toml"),
        source="test")
    run_id = lane.submit("acme", str(remote), "p").run_id
    lane.worker(agent_command='ls "${RUNLANE_SECRETS_DIR:-/run/secrets}"; echo x > x.txt',
                exit_when_idle=True,
                code_host_for=lambda repo: LocalForge(tmp_path / "forge")).run()
    log = (tmp_path / "artifacts" / run_id / "1" / "agent.log").read_text()
    assert "the secret MODEL_API_KEY the run's policy names is not set" in log
    assert "the secret GITHUB_TOKEN is the code host token runlane pushes with" in log
    assert "ghp_runlane" not in log


# --- a machine without a sandbox --------------------------------------------------------


def test_a_worker_refuses_to_start_without_a_sandbox(tmp_path: Path) -> None:
    """SANDBOX=bwrap (the default) and no bwrap on PATH: `runlane worker` and `runlane up`
    exit 2 before claiming anything, saying why and what to do; the Python API raises
    SandboxUnavailable (a SettingsInvalid)."""
    url = f"sqlite:///{tmp_path / 'runlane.db'}"

    def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PY, "-m", "runlane", "--database-url", url, *args],
                              cwd=tmp_path, env=cli_env(tmp_path, **env), capture_output=True,
                              text=True, timeout=60)

    assert cli("db", "upgrade").returncode == 0
    for command in (["worker", "--agent-command", "true", "--exit-when-idle"],
                    ["up", "--agent-command", "true"]):
        done = cli(*command, PATH="/nonexistent")
        one_line_error(done, 2, "bwrap (bubblewrap) is not on PATH")
        assert "apt-get install -y bubblewrap" in done.stderr
        assert "SANDBOX=off" in done.stderr
    missing = cli("worker", "--agent-command", "true", "--exit-when-idle",
                  RUNLANE_SANDBOX_READ_ONLY_PATHS=str(tmp_path / "nowhere"))
    one_line_error(missing, 2, f"SANDBOX_READ_ONLY_PATHS: {tmp_path / 'nowhere'} does not exist")
    off = cli("worker", "--agent-command", "true", "--exit-when-idle", PATH="/nonexistent",
              RUNLANE_SANDBOX="off")
    assert off.returncode == 0, off.stderr
    assert "WARNING: SANDBOX=off: agent and verify commands run without a sandbox" in off.stderr


def test_the_api_refuses_a_worker_without_a_sandbox(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'api.db'}",
                        workspace_dir=tmp_path / "ws", artifacts_dir=tmp_path / "art")
    with Runlane(settings=settings) as lane:
        lane.upgrade_schema()
        with pytest.raises(SandboxUnavailable) as caught:
            lane.worker(agent_command="true")
    assert caught.value.exit_code == 2 and "bwrap" in str(caught.value)


# --- nothing outlives its worker or its lease -----------------------------------------------

DOUBLE_FORK = r'''
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.chdir("/")
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", MARKER])
    os._exit(0)
os.wait()
open(os.path.join(os.environ["RUNLANE_ARTIFACTS_DIR"], "ready"), "w").close()
time.sleep(300)
'''


# The worker with one of the two mechanisms that end a dead worker's agents taken out
# (in its own process, as the fault harness plants its bugs): each alone must do.
VARIANT_WORKER = r'''
import sys
variant = sys.argv[1]
if variant == "without_guard":
    import runlane.agents.command as command
    command.guard = lambda members, control, grace: (control, None)
elif variant == "without_die_with_parent":
    from runlane.sandbox import sandbox
    bwrap_argv = sandbox.Sandbox._bwrap_argv
    sandbox.Sandbox._bwrap_argv = lambda self, *args: [
        a for a in bwrap_argv(self, *args) if a != "--die-with-parent"]
sys.argv = ["runlane", *sys.argv[2:]]
from runlane.cli import main
main()
'''


@pytest.mark.parametrize("variant", ["as_shipped", "without_guard", "without_die_with_parent"])
def test_a_setsid_double_forked_agent_is_gone_within_a_second_of_a_worker_sigkill(
        db_url: str, tmp_path: Path, variant: str) -> None:
    """The agent starts a grandchild that calls setsid, forks again and leaves the
    workspace (out of its process group, its session and its directory). SIGKILL the
    worker: within 1 s nothing of the agent is left, the grandchild included. Two
    mechanisms, each enough alone: bwrap's --die-with-parent (bwrap dies with the worker,
    the sandbox's PID namespace with bwrap) and the guard process (the worker's end of
    its pipe closes: it kills every sandbox it watches)."""
    marker = f"double-fork-{MARK}"
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "agent.py").write_text(DOUBLE_FORK.replace("MARKER", repr(marker)))
    (tools / "worker.py").write_text(VARIANT_WORKER)
    store = Store(db_url)
    [sub] = store.submit([spec(repo=str(bare_remote(tmp_path)))])
    store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env.update({"RUNLANE_FORGE_DIR": str(tmp_path / "forge"),
                "RUNLANE_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
                "RUNLANE_WORKSPACE_DIR": str(tmp_path / "workspaces"),
                "RUNLANE_SANDBOX_READ_ONLY_PATHS": str(tools)})
    worker = subprocess.Popen(
        [PY, str(tools / "worker.py"), variant, "--database-url", db_url, "worker",
         "--agent-command", f"{PY} {tools / 'agent.py'}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ready = tmp_path / "artifacts" / sub.run_id / "1" / "ready"
    try:
        wait_until(lambda: ready.exists() or worker.poll() is not None, 30,
                   "the agent to double-fork")
        assert worker.poll() is None, worker.stderr.read() if worker.stderr else ""
        # The grandchild, outside the workspace (once it has executed its command line).
        wait_until(lambda: len(processes_with(marker)) == 1, 10, "the grandchild")
        assert processes_in(tmp_path / "workspaces")  # the agent (and bwrap)
        worker.kill()
        worker.wait()
        gone_after = wait_until(lambda: not processes_with(marker)
                                and not processes_in(tmp_path / "workspaces"), 5,
                                "every process of the agent to be gone")
        assert gone_after < 1.0, f"the agent outlived its worker by {gone_after:.2f} s"
    finally:
        worker.kill()
        worker.wait()
        kill_all(processes_with(marker) + processes_in(tmp_path / "workspaces"))


def test_an_agent_of_a_paused_worker_is_gone_before_its_lease_expires(
        db_url: str, tmp_path: Path,
        workers: Callable[..., WorkerProcess]) -> None:  # noqa: F811
    """SIGSTOP the worker: it cannot stop its agent, its lease expires and another worker
    may start the run again. The guard process ends the agent at the worker's own local
    deadline: before the lease expires, so two agents of the run are never alive at
    once."""
    store = Store(db_url)
    [sub] = store.submit([spec(repo=str(bare_remote(tmp_path)))])
    worker = workers('touch "$RUNLANE_ARTIFACTS_DIR/started"; sleep 60')
    started = tmp_path / "artifacts" / sub.run_id / "1" / "started"
    workspace = tmp_path / "workspaces" / f"{sub.run_id}-1"
    try:
        wait_until(lambda: started.exists() and status_of(store, sub.run_id) == "RUNNING", 30,
                   "the agent to run")
        worker.signal(signal.SIGSTOP)
        wait_until(lambda: not processes_in(workspace), 10, "the paused worker's agent to end")
        gone_at = time.time()
        [attempt] = attempts_of(store, sub.run_id)
        assert attempt.lease_status == "ACTIVE"  # nobody has taken the run back yet
        assert gone_at < attempt.lease_expires_at, (
            f"the agent outlived its lease by {gone_at - attempt.lease_expires_at:.2f} s")
    finally:
        worker.signal(signal.SIGCONT)
        kill_all(processes_in(workspace))
        store.close()


# --- the fault harness's check --------------------------------------------------------------


def test_the_overlap_check_reads_the_agents_own_stamps(tmp_path: Path) -> None:
    """Two agents of one run alive at once are a violation (a killed one's life ends at
    its last alive stamp); one after the other, or of different runs, are not."""
    def stamps(run: str, attempt: int, *lines: str) -> None:
        directory = tmp_path / "artifacts" / run / str(attempt)
        directory.mkdir(parents=True)
        (directory / STAMPS_FILE).write_text("".join(f"{line}\n" for line in lines))

    stamps("r1", 1, "start 10.0", "alive 10.1", "alive 10.5")  # killed: no stop
    stamps("r1", 2, "start 10.3", "alive 10.4", "stop 11.0")  # started while 1 lived
    stamps("r2", 1, "start 10.0", "alive 10.1", "stop 10.2")
    stamps("r2", 2, "start 10.3", "stop 10.4", "alive 10.")  # a line cut by a kill
    stamps("r3", 1, "start 12.0", "stop 13.0")
    outcome: Any = type("Outcome", (), {"directory": tmp_path})()
    notes: list[str] = []
    violations = _agent_overlaps(outcome, notes)
    assert [(v["check"], v["run_id"]) for v in violations] == [("agents_overlapped", "r1")]
    assert "0.20 s of overlap" in violations[0]["detail"]
    assert notes == ["5 agent lifetimes from their own stamps, over 3 runs: 1 overlap(s)"]
