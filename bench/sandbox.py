"""What the sandbox adds to an attempt: a no-op agent (``true``) run by the worker's
command runner, in bubblewrap and with ``SANDBOX=off``, interleaved in one process.

Each sample is one ``CommandRunner.run`` from the spawn to the moment no process of
the agent is left: for bubblewrap its namespaces, its mounts (the view a worker
builds: its Python, the masks of its database file, forge and roots), the guard's
watch and the release, the shell, and the namespace's end. The two modes alternate,
in a rotating order (off first on even samples), each in a fresh workspace and
artifacts directory, so that load on the machine falls on both alike. The added cost
is each sample's bubblewrap time minus the ``off`` time next to it; p50 and p90 of
those differences. A real attempt also clones, verifies and finalizes: none of that
changes with the sandbox and none of it is here.

Progress goes to stderr, the Markdown section to stdout and, with ``--write``, into
that file::

    .venv/bin/python bench/sandbox.py --write docs/benchmarks.md
    .venv/bin/python bench/sandbox.py --samples 50     # a quick look
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import (
    display_command,
    load_average,
    memory_total,
    merge_section,
    percentile,
    progress,
    runlane_source,
    table,
)
from runlane.agents.base import AttemptLimits, StopReason
from runlane.agents.command import CommandRunner
from runlane.api import Runlane
from runlane.logs import configure_logging
from runlane.sandbox import Sandbox, SandboxConfig
from runlane.sandbox.guard import start as start_guard
from runlane.settings import Settings
from scheduler import lscpu

START, END = "<!-- sandbox-start:start -->", "<!-- sandbox-start:end -->"
TARGET_MS = 50.0
MODES = ("off", "bwrap", "bwrap-no-network")


class Control:
    """A worker's attempt as the runner sees it: never stopped, a lease deadline an
    hour away (so the guard watches the agent, as in a real attempt)."""

    def __init__(self) -> None:
        self.local_deadline = time.monotonic() + 3600.0

    def stop_reason(self) -> StopReason | None:
        return None

    def report_cost(self, usd: float, input_tokens: int, output_tokens: int) -> None:
        pass

    def progress(self, message: str) -> None:
        pass


def sandboxes(root: Path) -> dict[str, Sandbox]:
    """The worker's sandbox, built as `runlane worker` builds it (its hidden paths: the
    SQLite file, the forge, the roots), and the same with SANDBOX=off."""
    settings = Settings(database_url=f"sqlite:///{root / 'runlane.db'}",
                        workspace_dir=root / "workspaces", artifacts_dir=root / "artifacts")
    (root / "runlane.db").touch()
    for name in ("workspaces", "artifacts"):
        (root / name).mkdir()
    with Runlane(settings=settings) as lane:
        bwrap = lane.sandbox()
    off = Sandbox(SandboxConfig(**{**bwrap.config.__dict__, "mode": "off"}))
    return {"off": off, "bwrap": bwrap, "bwrap-no-network": bwrap}


def one(runner: CommandRunner, root: Path, n: int, network: bool) -> float:
    workspace = root / "workspaces" / f"run-{n}"
    workspace.mkdir(parents=True)
    started = time.perf_counter()
    result = runner.run(workspace=workspace, artifacts_dir=root / "artifacts" / f"run-{n}",
                        env={"RUNLANE_RUN_ID": f"run-{n}"}, control=Control(),
                        limits=AttemptLimits(network=network))
    elapsed = time.perf_counter() - started
    if result.exit_code != 0:
        raise SystemExit(f"the no-op agent failed: {result}")
    return elapsed


def measure(samples: int, warmup: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per sample and mode; and the worker's one-off costs."""
    with tempfile.TemporaryDirectory(prefix="runlane-bench-sandbox-") as scratch:
        root = Path(scratch)
        boxes = sandboxes(root)
        once: dict[str, float] = {}
        started = time.perf_counter()
        start_guard()
        once["guard start"] = time.perf_counter() - started
        checks = []
        for _ in range(5):
            started = time.perf_counter()
            boxes["bwrap"].check(workspace_root=root / "workspaces",
                                 artifacts_root=root / "artifacts")
            checks.append(time.perf_counter() - started)
        once["start-up check (median of 5)"] = statistics.median(checks)
        runners = {mode: CommandRunner("true", sandbox=box) for mode, box in boxes.items()}
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        n = 0
        for i in range(warmup + samples):
            order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
            for mode in order:
                n += 1
                elapsed = one(runners[mode], root, n, network=mode != "bwrap-no-network")
                if i >= warmup:
                    times[mode].append(elapsed)
            if (i + 1) % 50 == 0:
                progress(f"{i + 1 - warmup if i >= warmup else 0} of {samples} samples")
        return times, once


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def render(command: str, started: datetime, samples: int, environment: list[tuple[str, str]],
           times: dict[str, list[float]], once: dict[str, float], wall: float) -> str:
    rows = []
    for mode in MODES:
        values = times[mode]
        rows.append([f"`{mode}`", ms(percentile(values, 50)), ms(percentile(values, 90)),
                     ms(percentile(values, 99)), ms(statistics.mean(values))])
    added = {mode: [b - o for b, o in zip(times[mode], times["off"], strict=True)]
             for mode in MODES[1:]}
    added_rows = [[f"`{mode}` - `off`", ms(percentile(values, 50)), ms(percentile(values, 90))]
                  for mode, values in added.items()]
    p50 = percentile(added["bwrap"], 50)
    verdict = "within" if p50 * 1000 <= TARGET_MS else "over"
    lines = [START, "## Sandbox start cost per attempt: `bench/sandbox.py`", "",
             f"Produced by `{command}` on {started:%Y-%m-%d %H:%M} UTC ({wall / 60:.1f} min): "
             f"{samples} attempts of a no-op agent (`true`) per mode, the modes interleaved in "
             "a rotating order in one process. One sample is one `CommandRunner.run`, from "
             "the spawn until no process of the agent is left. `bwrap` is the worker's "
             "sandbox as `runlane worker` builds it (network on: risk low and medium); "
             "`bwrap-no-network` adds `--unshare-net` (risk high and critical); `off` is "
             "`SANDBOX=off`. `bench/sandbox.py` says how.", "",
             "|  |  |", "| :--- | :--- |"]
    lines += [f"| **{name}** | {value} |" for name, value in environment]
    lines += ["", f"**Added per attempt by the sandbox: p50 {ms(p50)} ms** (target: at most "
              f"{TARGET_MS:g} ms at p50, {verdict} it).", "",
              table(["Mode", "p50 ms", "p90 ms", "p99 ms", "mean ms"], rows, "lrrrr"), "",
              table(["Added (paired samples)", "p50 ms", "p90 ms"], added_rows, "lrr"), "",
              "Once per worker, not per attempt: "
              + "; ".join(f"{name} {ms(value)} ms" for name, value in once.items()) + ".",
              "", END, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=200, help="attempts per mode")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured rounds first")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="also put the Markdown section into PATH")
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    started = datetime.now(UTC)
    wall = time.monotonic()
    load_before = load_average()
    times, once = measure(args.samples, args.warmup)
    environment = [
        ("Machine", f"{lscpu()}; {memory_total()} RAM; Linux {platform.release()}"),
        ("bubblewrap", _bwrap_version()),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("runlane", runlane_source()),
        ("Load average (1/5/15 min)", f"{load_before} at start, {load_average()} at end"),
    ]
    section = render(display_command([sys.argv[0], *(argv or sys.argv[1:])]), started,
                     args.samples, environment, times, once, time.monotonic() - wall)
    sys.stdout.write(section)
    if args.write is not None:
        merge_section(args.write, section, START, END)
        progress(f"wrote {args.write}")
    return 0


def _bwrap_version() -> str:
    import subprocess

    try:
        return subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
