"""The demo's bundled scripted agent, speaking the agent-command
protocol: it edits a file in its workspace, reports cost and progress on
control lines, and its prompt decides how it misbehaves:

* ``rate-limit: …`` reports PROVIDER_RATE_LIMIT on its first attempt;
* ``slow: …`` works for a long while (long enough to be cancelled or killed);
* ``noop: …`` changes nothing (the run succeeds with outcome no_changes).

Run as ``python -m runlane.demo_agent``.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path


def control(kind: str, **fields: object) -> None:
    print(json.dumps({"runlane": kind, **fields}), flush=True)


def main() -> int:
    prompt = os.environ["RUNLANE_PROMPT"]
    attempt = int(os.environ["RUNLANE_ATTEMPT"])
    run_id = os.environ["RUNLANE_RUN_ID"]
    workspace = Path(os.environ["RUNLANE_WORKSPACE"])
    rng = random.Random(run_id)
    print(f"agent starting attempt {attempt} in {workspace}", flush=True)
    control("progress", message="reading the repository")
    if prompt.startswith("rate-limit") and attempt == 1:
        time.sleep(0.2)
        control("cost", usd=0.01, input_tokens=800, output_tokens=0)
        control("fail", reason_code="PROVIDER_RATE_LIMIT", retry_after_seconds=1,
                message="429 Too Many Requests from the model provider")
        return 1
    duration = float(os.environ.get("DEMO_AGENT_SLOW_SECONDS", "8")) if prompt.startswith(
        "slow") else rng.uniform(0.3, 1.0)
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
        print("thinking...", flush=True)
    control("cost", usd=round(rng.uniform(0.02, 0.3), 3), input_tokens=rng.randint(800, 5000),
            output_tokens=rng.randint(100, 900))
    if not prompt.startswith("noop"):
        notes = workspace / "AGENT_NOTES.md"
        with notes.open("a") as fh:
            fh.write(f"- {prompt} (run {run_id}, attempt {attempt})\n")
        control("progress", message=f"edited {notes.name}")
    print("agent done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
