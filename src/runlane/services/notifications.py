"""Campaign notifications: the outbox (``campaign_notifications``) sent by the scheduler
pass as a webhook POST and/or a line in a log file.

Each notification was written in the transaction that recorded what it tells (a run's
end, the campaign's stop, pause, resume or completion), so a crash before that commit
sends nothing and one after it sends it on a later pass. A sender takes a notification
by pushing its ``next_at`` past the send's timeout (compare-and-set): two schedulers
never send one at once. A crash between the POST and its record sends it again: the
body's ``id`` and the ``X-Runlane-Delivery`` header are the same every time, so the
receiver dedupes on them. Failures are retried with exponential backoff.

The body is signed: ``X-Runlane-Signature: sha256=<hex HMAC-SHA256 of the body>``, with
the key in the environment variable the campaign's ``notify.secret_env`` names (read
here, never stored in the database).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from runlane.faults import crash_point
from runlane.store.store import Store

log = structlog.get_logger("runlane.notifications")
BACKOFF_BASE_SECONDS = 2.0
BACKOFF_MAX_SECONDS = 600.0
TIMEOUT_SECONDS = 10.0


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class NotifierConfig:
    batch: int = 50
    timeout_seconds: float = TIMEOUT_SECONDS
    backoff_base_seconds: float = BACKOFF_BASE_SECONDS


class Notifier:
    """Sends due notifications; ``run_once`` returns counts."""

    def __init__(self, store: Store, config: NotifierConfig | None = None) -> None:
        self.store = store
        self.config = config or NotifierConfig()

    def run_once(self) -> dict[str, int]:
        sent = failed = 0
        for item in self.store.due_notifications(limit=self.config.batch,
                                                 timeout=self.config.timeout_seconds * 3):
            try:
                self._send(item)
            except Exception as exc:
                failed += 1
                delay = min(self.config.backoff_base_seconds * 2 ** (item["attempts"] - 1),
                            BACKOFF_MAX_SECONDS)
                log.warning("notification_failed", notification_id=item["notification_id"],
                            attempts=item["attempts"], error=str(exc)[:200])
                self.store.notification_failed(item["notification_id"], str(exc), delay)
                continue
            crash_point("campaign_notification_posted")  # sent, not yet recorded: the drill
            self.store.notification_sent(item["notification_id"])
            sent += 1
        return {"notifications_sent": sent, "notifications_failed": failed}

    def _send(self, item: dict[str, Any]) -> None:
        notify = item["notify"]
        body = json.dumps(item["payload"], sort_keys=True).encode()
        if notify.get("log_file"):
            with Path(notify["log_file"]).open("a", encoding="utf-8") as out:
                out.write(body.decode() + "\n")
        url = notify.get("webhook_url")
        if not url:
            return
        headers = {"Content-Type": "application/json",
                   "X-Runlane-Delivery": item["notification_id"],
                   "X-Runlane-Event": item["kind"]}
        secret_env = notify.get("secret_env")
        if secret_env:
            secret = os.environ.get(secret_env)
            if not secret:
                raise RuntimeError(f"the webhook's key: ${secret_env} is not set")
            headers["X-Runlane-Signature"] = signature(secret, body)
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.config.timeout_seconds) as response:
            if not 200 <= response.status < 300:
                raise RuntimeError(f"webhook answered {response.status}")
