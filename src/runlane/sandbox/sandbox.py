"""The sandbox around every agent and verify command: what to start, and whether it
can start at all on this machine.

:meth:`Sandbox.prepare` turns a command into a :class:`Spawn`: the argv, environment
and file descriptors the runner hands to ``subprocess.Popen``, and the way to find
and stop every process it becomes. With ``SANDBOX=bwrap`` that is::

    bwrap --unshare-pid --unshare-ipc --unshare-uts --unshare-cgroup-try
          [--unshare-net] --die-with-parent --new-session --cap-drop ALL
          --info-fd N --block-fd M  <the view: sandbox/view.py>  --chdir WORKSPACE
          [--perms 0400 --ro-bind-data FD /run/secrets/NAME]...
          --remount-ro /  /bin/sh -c COMMAND

``--die-with-parent``: bwrap gets SIGKILL when the worker (the thread that started
it) dies, and the namespace's PID 1 when bwrap does; the kernel then kills every
process of the PID namespace, including one that called ``setsid`` and forked twice.
``--cap-drop ALL`` with bwrap's ``no_new_privs``: no capability, even as root, and
none regained by executing anything. ``--info-fd`` tells the runner the namespace
(runlane.sandbox.processes); ``--block-fd`` holds the command until the guard
(runlane.sandbox.guard) watches it.

Secrets never go on an argv (``/proc/PID/cmdline`` is readable by every process of
the host): bwrap copies each from a memfd into a read-only file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import structlog

from runlane.sandbox.environment import agent_environment, check_pass_name, code_host_token
from runlane.sandbox.processes import Members, Namespace, ProcessGroup
from runlane.sandbox.view import HOME, SECRETS_DIR, View, mount_args
from runlane.settings import SettingsInvalid

log = structlog.get_logger("runlane.sandbox")

Mode = Literal["bwrap", "off"]
MODES: tuple[Mode, ...] = ("bwrap", "off")
PROBE_TIMEOUT_SECONDS = 30.0
NAMESPACES = ("--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")
OFF_WARNING = ("SANDBOX=off: agent and verify commands run without a sandbox, as the "
               "worker's user, seeing everything it sees (its files, its processes, the "
               "network); for development only")
INSTALL_HINT = ("install bubblewrap (apt-get install -y bubblewrap, dnf install bubblewrap), "
                "or set SANDBOX=off to run agents without a sandbox")


class SandboxUnavailable(SettingsInvalid):
    """``SANDBOX=bwrap`` on a machine where a sandbox cannot start (exit 2)."""


def worker_python_paths() -> tuple[str, ...]:
    """The worker's own Python installation and the directory holding the ``runlane``
    package: what ``python -m runlane.demo_agent`` (or the fault harness's agent) needs."""
    package_parent = Path(__file__).resolve().parents[2]  # above runlane/sandbox/sandbox.py
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             str(package_parent)}
    return tuple(sorted(p for p in paths if p))


def default_hidden_paths(environ: Mapping[str, str]) -> tuple[str, ...]:
    """Hidden from every agent whatever the settings: the worker's home directory
    (``~/.git-credentials``, ``~/.ssh``, cloud credentials) and ``runlane.toml`` of its
    working directory."""
    paths = [str(Path.home()), str(Path("runlane.toml").absolute())]
    if environ.get("HOME"):
        paths.append(environ["HOME"])
    return tuple(paths)


@dataclass(frozen=True)
class SandboxConfig:
    """``mode``: ``SANDBOX``; ``read_only_paths``: ``SANDBOX_READ_ONLY_PATHS``;
    ``pass_env``: ``SANDBOX_PASS_ENV``; ``hidden_paths``: masked wherever they lie under
    a visible path (the database file, the forge, the workspace and artifacts roots),
    on top of :func:`default_hidden_paths`."""

    mode: Mode = "bwrap"
    read_only_paths: tuple[str, ...] = ()
    pass_env: tuple[str, ...] = ()
    hidden_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SettingsInvalid(f"SANDBOX {self.mode!r}: one of {', '.join(MODES)}")
        for name in self.pass_env:
            try:
                check_pass_name(name)
            except ValueError as exc:
                raise SettingsInvalid(f"SANDBOX_PASS_ENV: {exc}") from None


@dataclass
class Spawn:
    """What to hand to ``subprocess.Popen`` for one command, and how to stop it.

    Resource limits set in Popen's ``preexec_fn`` (agents/resources.py) hold for
    everything inside the sandbox. Call :meth:`started` right
    after Popen (it closes this process's copies of the descriptors the child took) and
    :meth:`close` once the command's processes are gone."""

    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    notes: list[str] = field(default_factory=list)  # for the attempt's log
    _info_read: int | None = None
    _release_write: int | None = None
    _child_fds: list[int] = field(default_factory=list)
    _cleanup: list[Callable[[], None]] = field(default_factory=list)
    _members: Members | None = None

    def started(self) -> None:
        for fd in self._child_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._child_fds.clear()

    @property
    def held(self) -> bool:
        """The command waits for :meth:`release` (bwrap's ``--block-fd``; never with
        ``SANDBOX=off``, where it runs from the start)."""
        return self._release_write is not None

    def release(self) -> None:
        """Let the command run: bwrap holds it (``--block-fd``) until told, so that the
        guard watches it before it runs a single instruction (a worker paused in between
        would otherwise leave an agent nobody ends)."""
        if self._release_write is not None:
            with contextlib.suppress(OSError):
                os.write(self._release_write, b"x")
            os.close(self._release_write)
            self._release_write = None

    def members(self, proc: subprocess.Popen[bytes]) -> Members:
        """The processes ``proc`` became, to watch and to signal."""
        if self._members is None:
            if self._info_read is not None:
                namespace = Namespace(proc, self._info_read)
                self._info_read = None
                self._cleanup.append(namespace.close)
                self._members = namespace
            else:  # start_new_session: the shell leads its own session and group
                self._members = ProcessGroup(proc.pid, proc.pid)
        return self._members

    def close(self) -> None:
        self.started()
        self.release()
        if self._info_read is not None:
            os.close(self._info_read)
            self._info_read = None
        for step in self._cleanup:
            with contextlib.suppress(OSError):
                step()
        self._cleanup.clear()


class Sandbox:
    """The sandbox of one worker's commands (see the module's docstring)."""

    def __init__(self, config: SandboxConfig | None = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config or SandboxConfig()
        self._environ = environ

    @property
    def mode(self) -> Mode:
        return self.config.mode

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    def prepare(self, command: str, *, workspace: Path, artifacts_dir: Path,
                env: Mapping[str, str], network: bool = True,
                secrets: Iterable[str] = ()) -> Spawn:
        """The spawn of ``/bin/sh -c command`` for one attempt. ``env``: the contract's
        per-run variables; ``network``: the run's policy; ``secrets``: names of the
        worker's environment variables the policy gives the agent, as files in
        ``$RUNLANE_SECRETS_DIR``."""
        worker_env = self.environ
        full = agent_environment(worker_env, self.config.pass_env)
        if self.mode == "off":
            for name in ("HOME", "TMPDIR"):  # nothing is contained: the worker's own
                if name in worker_env:
                    full[name] = worker_env[name]
        else:
            full.update({"HOME": HOME, "TMPDIR": "/tmp"})
        full.update(env)
        spawn = Spawn(argv=["/bin/sh", "-c", command], env=full)
        values = self._secret_values(secrets, spawn.notes)
        if self.mode == "off":
            self._secret_files(values, spawn)
            return spawn
        try:
            spawn.argv = self._bwrap_argv(command, workspace, artifacts_dir, network,
                                          values, spawn)
        except BaseException:
            spawn.close()
            raise
        if values:
            spawn.env["RUNLANE_SECRETS_DIR"] = SECRETS_DIR
        return spawn

    # --- bwrap ------------------------------------------------------------------------

    def _bwrap_argv(self, command: str, workspace: Path, artifacts_dir: Path, network: bool,
                    secrets: dict[str, str], spawn: Spawn) -> list[str]:
        read, write = os.pipe()
        spawn._info_read = read
        spawn._child_fds.append(write)
        block, release = os.pipe()
        spawn._release_write = release
        spawn._child_fds.append(block)
        argv = [shutil.which("bwrap", path=self.environ.get("PATH")) or "bwrap", *NAMESPACES]
        if not network:
            argv.append("--unshare-net")
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL",
                 "--info-fd", str(write), "--block-fd", str(block)]
        argv += mount_args(self.view(workspace, artifacts_dir))
        argv += ["--chdir", os.path.abspath(workspace)]
        for name, value in secrets.items():
            fd = os.memfd_create(f"runlane-secret-{name}", 0)
            spawn._child_fds.append(fd)
            os.write(fd, value.encode())
            os.lseek(fd, 0, os.SEEK_SET)
            argv += ["--perms", "0400", "--ro-bind-data", str(fd), f"{SECRETS_DIR}/{name}"]
        spawn.pass_fds = tuple(spawn._child_fds)
        return [*argv, "--remount-ro", "/", "/bin/sh", "-c", command]

    def view(self, workspace: Path, artifacts_dir: Path) -> View:
        return View(read_only=(*worker_python_paths(), *self.config.read_only_paths),
                    writable=(str(workspace), str(artifacts_dir)),
                    hidden=(*default_hidden_paths(self.environ), *self.config.hidden_paths))

    # --- secrets ----------------------------------------------------------------------

    def _secret_values(self, names: Iterable[str], notes: list[str]) -> dict[str, str]:
        worker_env = self.environ
        token = code_host_token(worker_env)
        values: dict[str, str] = {}
        for name in names:
            value = worker_env.get(name)
            if value is None:
                notes.append(f"WARNING the secret {name} the run's policy names is not set "
                             "in the worker's environment: not given to the agent")
                log.warning("secret_not_set", secret=name)
            elif token is not None and value == token:
                notes.append(f"WARNING the secret {name} is the code host token runlane "
                             "pushes with: never given to agents")
                log.warning("secret_is_code_host_token", secret=name)
            else:
                values[name] = value
        return values

    @staticmethod
    def _secret_files(values: dict[str, str], spawn: Spawn) -> None:
        """SANDBOX=off: the same files, in a private directory removed afterwards."""
        if not values:
            return
        directory = tempfile.mkdtemp(prefix="runlane-secrets-")
        spawn._cleanup.append(lambda: shutil.rmtree(directory, ignore_errors=True))
        for name, value in values.items():
            path = os.path.join(directory, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "w") as f:
                f.write(value)
        spawn.env["RUNLANE_SECRETS_DIR"] = directory

    # --- start-up check ---------------------------------------------------------------

    def check(self, *, workspace_root: Path, artifacts_root: Path) -> None:
        """Start one sandbox (network off, the real roots' places) and refuse, with the
        exact reason and the fix, when it cannot: a worker that cannot start sandboxes
        would fail every run it claims. ``SANDBOX=off`` is only logged, loudly."""
        if self.mode == "off":
            log.warning("sandbox_off", message=OFF_WARNING)
            return
        for path in self.config.read_only_paths:
            if not os.path.exists(path):
                raise SandboxUnavailable(
                    f"SANDBOX_READ_ONLY_PATHS: {path} does not exist (remove it from the "
                    "setting, or create it)")
        if shutil.which("bwrap", path=self.environ.get("PATH")) is None:
            raise SandboxUnavailable(
                "SANDBOX=bwrap but bwrap (bubblewrap) is not on PATH "
                f"({self.environ.get('PATH', '')}): {INSTALL_HINT}")
        with tempfile.TemporaryDirectory(dir=workspace_root, prefix=".sandbox-probe-") as ws, \
                tempfile.TemporaryDirectory(dir=artifacts_root,
                                            prefix=".sandbox-probe-") as art:
            spawn = self.prepare("exit 0", workspace=Path(ws), artifacts_dir=Path(art), env={},
                                 network=False)
            try:
                probe = subprocess.Popen(spawn.argv, env=spawn.env, pass_fds=spawn.pass_fds,
                                         cwd=ws, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as exc:
                spawn.close()
                raise SandboxUnavailable(
                    f"SANDBOX=bwrap but bwrap cannot be executed ({exc.strerror}); "
                    f"{INSTALL_HINT}") from None
            try:
                spawn.started()
                spawn.release()
                _, stderr = probe.communicate(timeout=PROBE_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                probe.kill()
                probe.communicate()
                raise SandboxUnavailable(
                    f"SANDBOX=bwrap but a test sandbox did not finish within "
                    f"{PROBE_TIMEOUT_SECONDS:g} s; {INSTALL_HINT}") from None
            finally:
                spawn.close()
        if probe.returncode != 0:
            message = (stderr.decode(errors="replace").strip().splitlines() or
                       [f"exit status {probe.returncode}"])[-1]
            raise SandboxUnavailable(f"SANDBOX=bwrap but a sandbox cannot start here: "
                                     f"{message}; {_fix(message)}")


def _fix(message: str) -> str:
    """What to do about bwrap's complaint."""
    lowered = message.lower()
    if any(s in lowered for s in ("namespace", "operation not permitted", "uid map",
                                  "permission denied")):
        return ("user namespaces are not available to this user: enable them "
                "(sysctl -w kernel.unprivileged_userns_clone=1 and user.max_user_namespaces"
                "=15000; on Ubuntu 23.10+ also kernel.apparmor_restrict_unprivileged_userns"
                "=0), run the worker as root, or in a container give it the rights bwrap "
                "needs (docker run --security-opt seccomp=unconfined --security-opt "
                "apparmor=unconfined --cap-add SYS_ADMIN); or set SANDBOX=off to run "
                "agents without a sandbox")
    if "unrecognized option" in lowered or "unknown option" in lowered:
        return "this bwrap is too old: runlane needs bubblewrap 0.5 or later"
    return "see bwrap's message above; or set SANDBOX=off to run agents without a sandbox"
