"""`runlane top` in a real terminal: tmux runs it at 160x50 over a real database
(SQLite and PostgreSQL) or a real `runlane serve` with a tenant's token; the test reads
the screen with `capture-pane` until the frame shows, checks its figures against the
database, watches it refresh, then quits with `q` (or Ctrl-C, or SIGTERM) and checks that the
process ended and the terminal is as it was: the same stty settings, the alternate
screen left, the cursor shown. A server that goes away leaves the last figures on the
screen under a "STALE since" line."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.api import Runlane

from .http_support import make_token, serve, wait_until
from .support import cli_env

WORKER = "host-7/w-top"
SCREEN_SECONDS = 60.0  # a loaded machine: the first frame of a fresh interpreter


@dataclass
class Terminal:
    """A tmux server of its own (its own socket) with one 160x50 window running ``sh``
    on a script: the terminal's settings before and after the command, its exit code."""

    socket: Path
    env: dict[str, str]
    files: Path

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", str(self.socket), *args], check=True,
                              capture_output=True, text=True, env=self.env,
                              timeout=30).stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def show(self, what: str) -> str:
        return self.tmux("display-message", "-p", "-t", "top", what).strip()

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def wait_for(self, check: Any, what: str) -> str:
        """The screen, once ``check(screen)`` holds."""
        found: list[str] = []

        def shown() -> bool:
            found[:] = [self.screen()]
            return bool(check(found[0]))

        try:
            wait_until(shown, what, timeout=SCREEN_SECONDS, interval=0.05)
        except AssertionError:
            raise AssertionError(f"{what}; the screen:\n{found[0] if found else ''}\n"
                                 f"{self.log()}") from None
        return found[0]

    def exit_code(self) -> int:
        done = self.files / "rc"
        wait_until(lambda: done.exists() and done.read_text().strip(), "top to exit",
                   timeout=SCREEN_SECONDS)
        return int(done.read_text())

    def log(self) -> str:
        err = self.files / "stderr"
        return err.read_text(errors="replace")[-3000:] if err.exists() else ""

    def assert_restored(self) -> None:
        """The terminal as before top: settings, main screen, cursor shown."""
        before = (self.files / "before").read_text()
        assert before and (self.files / "after").read_text() == before
        # alternate screen off, cursor shown
        assert (self.files / "screen").read_text().split() == ["0", "1"]


@contextmanager
def terminal(tmp_path: Path, *args: str, env: dict[str, str] | None = None
             ) -> Iterator[Terminal]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is missing: apt-get install -y tmux (make test does)")
    files = tmp_path / "term"
    files.mkdir()
    command = shlex.join([sys.executable, "-m", "runlane", *args])
    script = files / "top.sh"
    # The shell outlives top whatever ends it (a trapped SIGINT runs its command; top
    # gets the default back, as every child of a shell), then records the terminal as
    # top left it: its settings, and from tmux its alternate screen and cursor.
    script.write_text(f"cd {shlex.quote(str(tmp_path))}\n"
                      "trap true INT\n"
                      f"stty -g > {files / 'before'}\n"
                      f"{command} 2> {files / 'stderr'}\n"
                      f"code=$?\n"
                      f"stty -g > {files / 'after'}\n"
                      "tmux display-message -p '#{alternate_on} #{cursor_flag}' "
                      f"> {files / 'screen'}\n"
                      f"echo $code > {files / 'rc'}\n")
    # The pane's size as the environment says it too: a top started while tmux still
    # sizes a detached window would otherwise draw at its 80x24 default.
    term = Terminal(files / "tmux.sock",
                    cli_env(tmp_path, COLUMNS="160", LINES="50", **(env or {})), files)
    term.tmux("new-session", "-d", "-x", "160", "-y", "50", "-s", "top", f"sh {script}")
    term.tmux("set-option", "-t", "top", "remain-on-exit", "on")
    try:
        yield term
    finally:
        subprocess.run(["tmux", "-S", str(term.socket), "kill-server"], capture_output=True,
                       env=term.env, timeout=30)


def submit(lane: Runlane, n: int, **fields: Any) -> list[str]:
    rows = [{"tenant": "acme", "repo": "/srv/git/app.git", "prompt": f"task {i}", **fields}
            for i in range(n)]
    return [s.run_id for s in lane.submit_batch(rows)]


def fleet(db_url: str) -> str:
    """acme: 3 runs queued in q-alpha and one that failed (JUDGE_REJECTED); beta: one
    run queued and one running in q-beta, on the registered worker. The failed run."""
    with Runlane(db_url) as lane:
        [failed] = submit(lane, 1, queue="q-alpha", max_attempts=1)
        lane.store.register_worker(WORKER, version="9.9", queues=["q-alpha", "q-beta"],
                                   capabilities={})
        [lease] = lane.store.claim(WORKER, "q-alpha", lease_ttl=600)
        lane.store.fail(lease, "JUDGE_REJECTED", message="the judge said no")
        submit(lane, 3, queue="q-alpha")
        submit(lane, 2, queue="q-beta", tenant="beta")
        assert len(lane.store.claim(WORKER, "q-beta", lease_ttl=600)) == 1
    return failed


def in_database(db_url: str, sql: str) -> dict[str, int]:
    with Runlane(db_url) as lane, lane.store.engine.connect() as conn:
        return {str(k): int(v) for k, v in conn.execute(text(sql))}


def queue_row(screen: str, queue: str) -> tuple[int, str, str, str] | None:
    """(depth, oldest ready, claims/min, active) of ``queue``'s row, if shown."""
    found = re.search(rf"^{re.escape(queue)}\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)", screen,
                      re.MULTILINE)
    return None if found is None else (int(found[1]), found[2], found[3], found[4])


DEPTHS = "SELECT queue, COUNT(*) FROM runs WHERE status = 'QUEUED' GROUP BY queue"
ACTIVE = ("SELECT r.queue, COUNT(*) FROM attempts a JOIN runs r ON r.run_id = a.run_id "
          "WHERE a.lease_status = 'ACTIVE' GROUP BY r.queue")


def test_top_shows_the_databases_figures_refreshes_and_quits_on_q(
        db_url: str, tmp_path: Path) -> None:
    failed = fleet(db_url)
    with terminal(tmp_path, "--database-url", db_url, "top", "--interval", "0.5") as term:
        screen = term.wait_for(lambda s: failed in s and WORKER in s, "the first frame")
        depths, active = in_database(db_url, DEPTHS), in_database(db_url, ACTIVE)
        assert depths == {"q-alpha": 3, "q-beta": 1} and active == {"q-beta": 1}
        for queue in ("q-alpha", "q-beta"):
            row = queue_row(screen, queue)
            assert row is not None, screen
            assert row[0] == depths[queue] and row[3] == str(active.get(queue, 0)), screen
        assert [(queue_row(screen, q) or ())[2:3] for q in ("q-alpha", "q-beta")] == [
            ("1.0",), ("1.0",)], screen
        worker = re.search(rf"^{re.escape(WORKER)}\s+(\S+)\s+\S+ ago\s+(\d+)", screen,
                           re.MULTILINE)
        assert worker is not None and worker.groups() == ("READY", "1"), screen
        reason = in_database(db_url, "SELECT reason_code, COUNT(*) FROM attempts "
                             "WHERE status = 'FAILED' GROUP BY reason_code")
        assert reason == {"JUDGE_REJECTED": 1}
        failure = re.search(rf"{failed}\s+acme\s+JUDGE_REJECTED\s+failed\s", screen)
        assert failure is not None, screen
        assert re.search(r"\bacme\s+3\s+0\s+1\s+50%", screen), screen

        # It refreshes: two more runs queued show within a refresh or two.
        with Runlane(db_url) as lane:
            submit(lane, 2, queue="q-alpha")
        screen = term.wait_for(lambda s: (queue_row(s, "q-alpha") or (0,))[0] == 5,
                               "the new depth")
        assert in_database(db_url, DEPTHS)["q-alpha"] == 5

        term.keys("q")
        assert term.exit_code() == 0, term.log()
        term.assert_restored()
        assert WORKER not in term.screen()  # the main screen is back, as it was
        assert term.log() == ""


@pytest.mark.parametrize("how, code", [("C-c", 130), ("SIGTERM", 143)])
def test_ctrl_c_or_sigterm_end_top_with_the_terminal_restored(
        tmp_path: Path, how: str, code: int) -> None:
    from .conftest import migrated_sqlite

    db_url = migrated_sqlite(tmp_path / "runlane.db")
    failed = fleet(db_url)
    with terminal(tmp_path, "--database-url", db_url, "top") as term:
        term.wait_for(lambda s: failed in s, "the first frame")
        if how == "C-c":
            term.keys("C-c")
        else:  # top is the one child of the pane's shell
            shell = int(term.show("#{pane_pid}"))
            [top] = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
            os.kill(int(top), signal.SIGTERM)
        assert term.exit_code() == code, term.log()
        term.assert_restored()
        assert "Traceback" not in term.log()


def test_top_over_the_api_shows_a_tenants_figures_and_goes_stale_when_it_stops(
        db_url: str, tmp_path: Path) -> None:
    failed = fleet(db_url)
    token = make_token(db_url, "read", "beta")
    with serve(db_url, tmp_path) as served, terminal(
            tmp_path, "top", "--url", served.url, "--interval", "0.5",
            env={"RUNLANE_API_TOKEN": token}) as term:
        screen = term.wait_for(lambda s: WORKER in s and "q-beta" in s, "the first frame")
        # beta's token: its queue, its tenant, the worker running its run; nothing of
        # acme (its queue, its failure, its name).
        row = queue_row(screen, "q-beta")
        assert row is not None and (row[0], row[2], row[3]) == (1, "1.0", "1"), screen
        assert "q-alpha" not in screen and "acme" not in screen and failed not in screen
        assert re.search(r"\bbeta\s+1\s+1\s+1\s+-\s", screen), screen
        assert "no failures" in screen

        # The server goes away: the last figures stay, under a STALE line.
        served.process.terminate()
        served.process.wait(timeout=30)
        screen = term.wait_for(lambda s: "STALE since" in s, "the stale line")
        assert "connect" in screen.lower(), screen
        assert queue_row(screen, "q-beta") is not None and WORKER in screen, screen

        term.keys("q")
        assert term.exit_code() == 0, term.log()
        term.assert_restored()
