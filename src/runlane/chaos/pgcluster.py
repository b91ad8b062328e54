"""A private, throw-away PostgreSQL cluster for the harness: initdb into a temporary
directory, a free port on 127.0.0.1, a socket directory of its own. Restarting it
(immediate shutdown, then start) never touches any other server. As root, the
server runs as the ``postgres`` OS user (``runuser``)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from runlane.errors import RunlaneError
from runlane.extras import require

DATABASE = "runlane_chaos"


class ClusterError(RunlaneError):
    exit_code = 4


def find_bindir() -> Path:
    """The directory with initdb and pg_ctl: on PATH, else the newest under
    /usr/lib/postgresql."""
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found:
            bindir = Path(found).resolve().parent
            if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
                return bindir
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: [int(x) for x in p.split("/")[4].split(".")
                                       if x.isdigit()])
    if candidates:
        return Path(candidates[-1]).parent
    raise ClusterError("cannot find PostgreSQL's initdb and pg_ctl (install the server, or "
                       "give --database-url)")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateCluster:
    def __init__(self, *, bindir: Path | None = None) -> None:
        self.bindir = bindir or find_bindir()
        self.root = Path(tempfile.mkdtemp(prefix="runlane-chaos-pg-"))
        self.data = self.root / "data"
        self.logfile = self.root / "server.log"
        self.port = 0
        self.running = False
        self.restarts = 0
        self._as: list[str] = []
        if os.geteuid() == 0:  # the server refuses to run as root
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise ClusterError("running as root needs a 'postgres' OS user to run a "
                                   "private PostgreSQL cluster") from None
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, *args: str, timeout: float = 60) -> None:
        try:
            proc = subprocess.run([*self._as, *args], capture_output=True, text=True,
                                  timeout=timeout, check=False, cwd=self.root)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClusterError(f"{Path(args[0]).name}: {exc}") from None
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise ClusterError(f"{Path(args[0]).name} failed: "
                               f"{detail[-1] if detail else proc.returncode}")

    def start(self) -> str:
        """initdb, start, and create the harness's database; returns its URL."""
        psycopg = require("psycopg", "The fault harness's PostgreSQL profiles")
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres",
                  "-A", "trust", "-E", "UTF8", "--no-sync", "--no-instructions")
        for _ in range(3):
            self.port = free_port()
            try:
                self._start()
                break
            except ClusterError:
                if "could not bind" not in self.server_log_tail():
                    raise
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres",
                             autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
        return self.url

    def _start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c max_connections=300 -c shared_buffers=64MB "
                   "-c log_min_messages=fatal")
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile),
                  "-o", options, "-w", "-t", "60", "start", timeout=90)
        self.running = True

    def stop_immediately(self) -> None:
        """An immediate shutdown: every session dies, no checkpoint (a crash)."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                  "-w", "stop")
        self.running = False

    def start_again(self) -> None:
        self._start()
        self.restarts += 1

    def server_log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.logfile.read_text(errors="replace")[-2000:]
        return ""

    def destroy(self) -> None:
        """Stop the server (if it runs) and delete everything it had."""
        if self.data.exists():
            with contextlib.suppress(ClusterError):
                self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                          "immediate", "-w", "stop", timeout=30)
        self.running = False
        deadline = time.monotonic() + 5
        while True:
            shutil.rmtree(self.root, ignore_errors=True)
            if not self.root.exists() or time.monotonic() > deadline:
                return
            time.sleep(0.1)
