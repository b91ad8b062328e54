"""Campaign notifications through a real local HTTP server, on SQLite and PostgreSQL:
each notification written in the transaction of what it tells, sent once with its
delivery id, signed with HMAC-SHA256, retried with backoff after a failed POST."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from runlane.api import Runlane
from runlane.domain.states import RunStatus
from runlane.services.notifications import Notifier, NotifierConfig
from runlane.settings import Settings

SECRET = "s3cret-key"


class Receiver:
    def __init__(self, fail_first: int) -> None:
        self.fail_first = fail_first
        self.calls: list[tuple[dict[str, str], bytes, int]] = []
        self.lock = threading.Lock()


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    box = Receiver(fail_first=1)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            with box.lock:
                code = 500 if len(box.calls) < box.fail_first else 200
                box.calls.append((dict(self.headers), body, code))
            self.send_response(code)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield box, f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


@pytest.fixture
def lane(db_url: str, tmp_path: Path) -> Iterator[Runlane]:
    with Runlane(settings=Settings(database_url=db_url)) as lane:
        yield lane


def test_each_notification_arrives_once_signed(lane: Runlane, tmp_path: Path,
                                               receiver: tuple[Receiver, str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    box, url = receiver
    monkeypatch.setenv("RL_TEST_HOOK_SECRET", SECRET)
    log_file = tmp_path / "notifications.log"
    targets = "".join(f'[[targets]]\nrepo = "/srv/n{i}.git"\nowner = "dev{i}"\n'
                      for i in range(3))
    lane.create_campaign(text=(
        f'name = "told"\ntenant = "acme"\nowner = "lead"\nprompt = "x {{repo}}"\n{targets}'
        f'[rollout]\ncanary = 3\n[notify]\nwebhook_url = "{url}"\n'
        f'secret_env = "RL_TEST_HOOK_SECRET"\nlog_file = "{log_file}"\n'))
    lane.store.campaign_pass()
    leases = lane.store.claim("w", limit=3)
    lane.store.fail(leases[0], "VERIFIER_FAILED")
    for lease in leases[1:]:
        lane.store.advance(lease, RunStatus.RUNNING)
        lane.store.complete(lease, outcome="no_changes")
    notifier = Notifier(lane.store, NotifierConfig(backoff_base_seconds=0.0))
    counts = [notifier.run_once() for _ in range(4)]
    assert counts[0] == {"notifications_sent": 3, "notifications_failed": 1}
    assert sum(c["notifications_sent"] for c in counts) == 4
    assert counts[-1] == {"notifications_sent": 0, "notifications_failed": 0}
    delivered = [(h, b) for h, b, code in box.calls if code == 200]
    ids = [h["X-Runlane-Delivery"] for h, _ in delivered]
    assert len(ids) == len(set(ids)) == 4  # each once
    retried = [h["X-Runlane-Delivery"] for h, _, code in box.calls if code == 500]
    assert retried[0] in ids  # the failed POST was sent again, same id
    for headers, body in delivered:
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Runlane-Signature"], expected)
        assert json.loads(body)["id"] == headers["X-Runlane-Delivery"]
    kinds = sorted((json.loads(b)["kind"], json.loads(b)["recipient"]) for _, b in delivered)
    assert kinds == [("completed", "lead"), ("run_finished", "dev0"), ("run_finished", "dev1"),
                     ("run_finished", "dev2")]
    # The log file has a line per send (the failed webhook's too: at least once).
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert {line["id"] for line in lines} == set(ids)
    shown = lane.campaign("told")["notifications"]
    assert shown == {"total": 4, "delivered": 4}



SENDER = """
import sys
from runlane.services.notifications import Notifier, NotifierConfig
from runlane.store.store import Store
Notifier(Store(sys.argv[1]), NotifierConfig(backoff_base_seconds=0.0)).run_once()
"""


def test_a_sender_killed_after_its_post_sends_it_again_with_the_same_id(
        lane: Runlane, db_url: str, receiver: tuple[Receiver, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The outbox is at least once: a sender SIGKILLed between the POST and its record
    sends that notification again on the next pass, with the same delivery id, so the
    receiver that dedupes on it acts once on each; nothing else is sent twice."""
    import os
    import signal
    import subprocess
    import sys

    box, url = receiver
    box.fail_first = 0
    lane.create_campaign(text=(
        'name = "crash"\ntenant = "acme"\nprompt = "x"\n[[targets]]\nrepo = "/srv/c1.git"\n'
        '[[targets]]\nrepo = "/srv/c2.git"\n[rollout]\ncanary = 2\n'
        f'[notify]\nwebhook_url = "{url}"\n'))
    lane.store.campaign_pass()
    for lease in lane.store.claim("w", limit=2):
        lane.store.fail(lease, "AGENT_FAILED")
    died = subprocess.run([sys.executable, "-c", SENDER, db_url], check=False,
                          env={**os.environ, "RUNLANE_FAULT_CRASH_AT":
                               "campaign_notification_posted"})
    assert died.returncode == -signal.SIGKILL
    assert len(box.calls) == 1  # one POST made, its record lost with the process
    # Taken for the dead sender's timeout: due again once it passed (pinned here).
    from sqlalchemy import text
    with lane.store.engine.begin() as conn:
        conn.execute(text("UPDATE campaign_notifications SET next_at = 0"
                          " WHERE delivered_at IS NULL"))
    Notifier(lane.store, NotifierConfig(backoff_base_seconds=0.0)).run_once()
    ids = [h["X-Runlane-Delivery"] for h, _, _ in box.calls]
    with lane.store.engine.connect() as conn:
        outbox = {r[0] for r in conn.execute(text(
            "SELECT notification_id FROM campaign_notifications WHERE delivered_at IS NOT NULL"))}
    assert set(ids) == outbox and len(outbox) == 3  # two run ends and the completion
    assert len(ids) == 4 and ids.count(ids[0]) == 2  # only the one in flight, again


def test_a_run_whose_worker_is_sigkilled_is_told_once(
        db_url: str, tmp_path: Path, receiver: tuple[Receiver, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real worker process running a campaign's run is SIGKILLed mid-attempt; the
    reaper takes the lease back and another worker process finishes the run. The
    receiver gets the target's ``run_finished`` exactly once (and the completion
    once), each with a valid signature: the killed attempt wrote nothing to tell."""
    import contextlib
    import os
    import signal

    from sqlalchemy import text

    from runlane.domain.campaigns import parse_campaign
    from runlane.domain.retry import RetryPolicy
    from runlane.store.store import Store

    from .support import bare_remote, processes_in
    from .test_worker import WorkerProcess, reap_until, wait_until

    box, url = receiver
    box.fail_first = 0
    monkeypatch.setenv("RL_TEST_HOOK_SECRET", SECRET)
    remote, forge = bare_remote(tmp_path), tmp_path / "forge"
    store = Store(db_url, retry_policy=RetryPolicy(base_seconds=0.1, max_seconds=0.2))
    store.create_campaign(parse_campaign(
        f'name = "killed"\ntenant = "acme"\nowner = "lead"\nprompt = "change {{repo}}"\n'
        f'[[targets]]\nrepo = "{remote}"\nowner = "dev"\n[rollout]\ncanary = 1\n'
        f'[notify]\nwebhook_url = "{url}"\nsecret_env = "RL_TEST_HOOK_SECRET"\n'))
    assert store.campaign_pass()["campaign_runs_dispatched"] == 1
    with store.engine.connect() as conn:
        run_id = conn.execute(text("SELECT run_id FROM campaign_targets")).scalar_one()
    notifier = Notifier(store, NotifierConfig(backoff_base_seconds=0.0))
    agent = ('touch "$RUNLANE_ARTIFACTS_DIR/started"; '
             'if [ "$RUNLANE_ATTEMPT" = 1 ]; then sleep 60; fi; echo change > change.txt')
    victim = WorkerProcess(db_url, tmp_path, forge, agent)
    finisher: WorkerProcess | None = None
    try:
        started = tmp_path / "artifacts" / run_id / "1" / "started"
        wait_until(started.exists, 20, "attempt 1 to run")
        victim.signal(signal.SIGKILL)
        assert victim.wait() == -signal.SIGKILL
        reap_until(store, run_id, "QUEUED", 10)
        assert notifier.run_once()["notifications_sent"] == 0  # the lost attempt told nothing
        finisher = WorkerProcess(db_url, tmp_path, forge, agent, "--exit-when-idle")
        assert finisher.wait(60) == 0
    finally:
        victim.stop()
        if finisher is not None:
            finisher.stop()
        for pid in processes_in(tmp_path / "workspaces" / f"{run_id}-1"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # attempt 1's orphaned agent
    sent = [notifier.run_once()["notifications_sent"] for _ in range(3)]
    assert sent == [2, 0, 0]
    assert [c for _, _, c in box.calls] == [200, 200]
    bodies = []
    for headers, body, _ in box.calls:
        expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        assert hmac.compare_digest(headers["X-Runlane-Signature"], expected)
        bodies.append(json.loads(body))
    [told] = [b for b in bodies if b["kind"] == "run_finished"]
    assert (told["run_id"], told["status"], told["recipient"]) == (run_id, "SUCCEEDED", "dev")
    assert sorted(b["kind"] for b in bodies) == ["completed", "run_finished"]
    with store.engine.connect() as conn:
        attempts = conn.execute(text("SELECT reason_code FROM attempts WHERE run_id = :r "
                                     "ORDER BY attempt_no"), {"r": run_id}).scalars().all()
    assert attempts == ["WORKER_LOST", None]
    store.close()
