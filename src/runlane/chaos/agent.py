"""The chaos agent: a scripted agent for the fault harness, speaking the agent-command
protocol (README). What it does is written in its task's prompt by the harness
(``chaos#00017 kind=flaky reason=PROVIDER_RATE_LIMIT fails=1 sleep=0.30 dwell=-``)
and decided per attempt by :func:`plan`, so the checks know what each attempt did.

Standard library only, and run as a script (``python -I -S .../agent.py``): it
starts in milliseconds instead of importing runlane. ``--verify`` makes it the
verify command.

It stamps its own life into ``agent.stamps`` in its artifacts directory (``start``,
``alive`` every :data:`ALIVE_SECONDS` while it works, ``stop``; a SIGKILLed agent's
last stamp is an ``alive``), from which the checks prove no two agents of one run
were ever alive at once. Ending it with its worker is the sandbox's job (a PID
namespace and ``--die-with-parent``); without one (``SANDBOX=off``) it also exits on
its own once it sees its worker process gone.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Behaviours, and how each attempt of them ends.
KINDS = ("change", "nochange", "slow", "flaky", "exhaust", "fatal", "verify_fail", "hang",
         "hang_once", "stubborn")
# Retryable reasons an agent may report (the documented defaults, plus the code host one).
RETRYABLE = ("PROVIDER_RATE_LIMIT", "SANDBOX_START_TIMEOUT", "GIT_CLONE_FAILED_TRANSIENT",
             "TIMEOUT", "CODE_HOST_FAILED_TRANSIENT")
# Non-retryable ends: AGENT_FAILED is a bare non-zero exit; LEASE_RELEASED is a code only
# runlane may record (recorded as AGENT_FAILED); "malformed" prints a broken control line.
FATAL = ("AGENT_FAILED", "TASK_CONTRACT_INVALID", "JUDGE_REJECTED", "LIMIT_EXCEEDED",
         "LEASE_RELEASED", "malformed")
STAGES = ("CLAIMED", "PREPARING_SANDBOX", "VERIFYING", "FINALIZING")
HANG_CAP_SECONDS = 120.0
CHANGE_FILE = "CHAOS.md"
DWELL_ENV = "RUNLANE_CHAOS_DWELL"
STAMPS_FILE = "agent.stamps"
ALIVE_SECONDS = 0.1


@dataclass(frozen=True)
class Behaviour:
    number: int
    kind: str
    reason: str | None = None
    fails: int = 0  # flaky: attempts that fail before one succeeds
    sleep: float = 0.2
    dwell: str | None = None  # a stage the worker lingers in (see chaos.hooks)
    # The fault "pr_crash": the worker is SIGKILLed after the code host opened this
    # attempt's pull request, before the ledger recorded it (drill 4); 0: never.
    crash: int = 0

    def prompt(self) -> str:
        text = (f"chaos#{self.number:05d} kind={self.kind} reason={self.reason or '-'} "
                f"fails={self.fails} sleep={self.sleep:.2f} dwell={self.dwell or '-'}")
        return text + (f" crash={self.crash}" if self.crash else "")


def parse_prompt(prompt: str) -> Behaviour | None:
    """The behaviour a prompt written by :meth:`Behaviour.prompt` carries, else None."""
    words = prompt.split()
    if not words or not words[0].startswith("chaos#"):
        return None
    try:
        fields = dict(w.split("=", 1) for w in words[1:])
        number = int(words[0][len("chaos#"):])
        kind = fields["kind"]
        if kind not in KINDS:
            return None
        return Behaviour(number=number, kind=kind,
                         reason=None if fields.get("reason", "-") == "-" else fields["reason"],
                         fails=int(fields.get("fails", "0")),
                         sleep=float(fields.get("sleep", "0.2")),
                         dwell=None if fields.get("dwell", "-") == "-" else fields["dwell"],
                         crash=int(fields.get("crash", "0")))
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Step:
    """What one attempt's agent does, and the reason runlane must record for it."""

    action: str  # change | nochange | fail | exit | malformed | hang | stubborn
    reason: str | None = None  # the reason on the fail control line
    recorded: str | None = None  # the attempt's expected reason code (None: succeeds)
    retry_after: float | None = None


def plan(b: Behaviour, attempt: int) -> Step:
    kind = b.kind
    if kind == "nochange":
        return Step("nochange")
    if kind == "flaky" and attempt > b.fails:
        return Step("change")
    if kind in ("flaky", "exhaust"):
        retry_after = 1.0 if b.reason == "PROVIDER_RATE_LIMIT" else None
        return Step("fail", b.reason, b.reason, retry_after)
    if kind == "fatal":
        if b.reason == "AGENT_FAILED":
            return Step("exit", None, "AGENT_FAILED")
        if b.reason == "malformed":
            return Step("malformed", None, "AGENT_FAILED")
        if b.reason == "LEASE_RELEASED":
            return Step("fail", b.reason, "AGENT_FAILED")
        return Step("fail", b.reason, b.reason)
    if kind == "verify_fail":
        return Step("change", None, "VERIFIER_FAILED")
    if kind == "hang" or (kind == "hang_once" and attempt == 1):
        return Step("hang", None, "TIMEOUT")
    if kind == "stubborn":
        return Step("stubborn", None, "TIMEOUT")
    return Step("change")  # change, slow, hang_once after its first attempt


# --- the process ------------------------------------------------------------------


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2:].split()  # state, ppid, pgrp, ... starttime at [19]


def _worker_ancestor() -> tuple[int, bytes] | None:
    """The nearest ancestor that is a ``runlane worker`` process, with its start time."""
    pid = os.getppid()
    for _ in range(4):
        fields = _stat(pid)
        if fields is None:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            return None
        if b"worker" in args and (b"runlane" in args or b"runlane.chaos.hooks" in args):
            return pid, fields[19]
        pid = int(fields[1])
        if pid <= 1:
            return None
    return None


class Stamps:
    """``agent.stamps``: one ``KIND EPOCH_SECONDS`` line per stamp, flushed at once."""

    def __init__(self, artifacts: str | None) -> None:
        self.path = Path(artifacts, STAMPS_FILE) if artifacts else None

    def stamp(self, kind: str) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(f"{kind} {time.time():.6f}\n")


def read_stamps(path: Path) -> tuple[float, float] | None:
    """(start, end) of one agent from its stamps: its ``stop``, else its last stamp."""
    try:
        lines = path.read_text().split("\n")
    except OSError:
        return None
    stamps = []
    for line in lines:
        kind, _, at = line.partition(" ")
        try:
            stamps.append((kind, float(at)))
        except ValueError:
            continue  # a line cut short by a kill
    starts = [at for kind, at in stamps if kind == "start"]
    if not starts:
        return None
    return starts[0], max(at for _, at in stamps)


class Watch:
    def __init__(self, stamps: Stamps | None = None) -> None:
        self.worker = _worker_ancestor()
        self.stamps = stamps or Stamps(None)

    def worker_gone(self) -> bool:
        if self.worker is None:
            return False
        fields = _stat(self.worker[0])
        return fields is None or fields[19] != self.worker[1] or fields[0] == b"Z"

    def sleep(self, seconds: float) -> None:
        """Sleep, but exit at once if the worker died (an orphan has no one to talk to)."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self.worker_gone():
                sys.exit(0)
            self.stamps.stamp("alive")
            time.sleep(min(left, ALIVE_SECONDS))


def control(kind: str, **fields: object) -> None:
    print(json.dumps({"runlane": kind, **fields}), flush=True)


def run_agent(env: dict[str, str]) -> int:
    stamps = Stamps(env.get("RUNLANE_ARTIFACTS_DIR"))
    stamps.stamp("start")
    try:
        return _work(env, stamps)
    finally:
        stamps.stamp("stop")


def _work(env: dict[str, str], stamps: Stamps) -> int:
    b = parse_prompt(env.get("RUNLANE_PROMPT", ""))
    if b is None:
        print("not a chaos prompt; nothing to do", flush=True)
        return 0
    attempt = int(env.get("RUNLANE_ATTEMPT", "1"))
    run_id = env.get("RUNLANE_RUN_ID", "?")
    rng = random.Random(f"{run_id}/{attempt}")
    watch = Watch(stamps)
    step = plan(b, attempt)
    print(f"chaos agent {b.number} attempt {attempt}: {step.action}", flush=True)
    control("progress", message=f"{b.kind} attempt {attempt}")
    if step.action in ("hang", "stubborn"):
        if step.action == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        watch.sleep(HANG_CAP_SECONDS)
        return 1
    watch.sleep(b.sleep)
    control("cost", usd=round(rng.uniform(0.001, 0.05), 4),
            input_tokens=rng.randint(100, 3000), output_tokens=rng.randint(10, 500))
    if step.action == "fail":
        message: dict[str, object] = {"reason_code": step.reason, "message": "chaos failure"}
        if step.retry_after is not None:
            message["retry_after_seconds"] = step.retry_after
        control("fail", **message)
        return 1
    if step.action == "exit":
        print("giving up", flush=True)
        return 3
    if step.action == "malformed":
        print('{"runlane": "explode", "reason_code": 7}', flush=True)
        return 2
    if step.action == "change":
        workspace = Path(env.get("RUNLANE_WORKSPACE", "."))
        with (workspace / CHANGE_FILE).open("a") as f:
            f.write(f"task {b.number} run {run_id} attempt {attempt}\n")
    print("done", flush=True)
    return 0


def run_verify(env: dict[str, str]) -> int:
    b = parse_prompt(env.get("RUNLANE_PROMPT", ""))
    if b is None:
        return 0
    if b.dwell == "VERIFYING":
        Watch().sleep(float(env.get(DWELL_ENV, "1.5")))
    if b.kind == "verify_fail":
        print("verification failed", flush=True)
        return 1
    return 0


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    return run_verify(env) if "--verify" in argv else run_agent(env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
