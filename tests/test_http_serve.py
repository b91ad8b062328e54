"""`runlane up --serve` serves the API beside maintenance and workers (and stops with
them); `runlane serve` on a port already in use exits 1 with one line."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from runlane.api import Runlane

from .conftest import migrated_sqlite
from .http_support import free_port, make_token, wait_until

REPO = "/srv/git/app.git"


def test_up_serve_runs_the_api_beside_workers_and_stops_with_them(tmp_path: Path) -> None:
    db = migrated_sqlite(tmp_path / "runlane.db")
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "runlane", "--database-url", db, "--sandbox", "off",
             "--workspace-dir", str(tmp_path / "ws"), "up", "--workers", "1",
             "--agent-command", "true", "--serve", "--port", str(port)],
            stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert up.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/readyz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, "the API of runlane up --serve", timeout=60)
        token = make_token(db, "admin")
        with Runlane(db) as lane:
            lane.submit("acme", REPO, "seen through the API")
        runs = httpx.get(f"{url}/v1/runs", headers={"Authorization": f"Bearer {token}"})
        assert runs.status_code == 200 and len(runs.json()["items"]) == 1
        assert f"HTTP API on http://127.0.0.1:{port}" in log.read_text()
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()
    try:
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        raise AssertionError("the API outlived runlane up")
    except httpx.TransportError:
        pass


def test_serve_on_a_port_in_use_exits_1(tmp_path: Path) -> None:
    db = migrated_sqlite(tmp_path / "runlane.db")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "runlane", "--database-url", db, "serve", "--port",
             str(port)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1
    assert "address already in use" in done.stderr.lower(), done.stderr
    assert "Traceback" not in done.stderr
