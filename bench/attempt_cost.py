"""CPU per attempt and per worker start, by stage, for several runlane builds in one run.

Why: the fault harness's long profile (8 workers x 2 slots, a SIGKILL every ~2 s on 2
cores) is CPU-bound, so what an attempt and a worker's start cost in CPU seconds, user
and system, decides how many runs it ends.

Configurations (``--config LABEL=TREE:SANDBOX``, repeatable; default this checkout with
``SANDBOX=bwrap`` and with ``SANDBOX=off``): TREE is a checkout with its own venv
(``TREE/.venv/bin/python``, ``PYTHONPATH=TREE/src``), so an older commit is measured
from a worktree of it (``git worktree add ../base COMMIT``, then its ``make .venv...``).
SANDBOX ``-`` leaves the setting out (a build before it existed).

Per configuration and round, one fresh process (the build's Python) on a fresh SQLite
database, a local bare repository and the local forge:

* ``attempts``: N tasks, one ``Runlane.worker`` (the ``runlane worker`` object, one
  slot, exiting when idle) in this process, an agent that changes one file
  (``echo $RUNLANE_RUN_ID > change.txt``) and a verify command ``true``, so every
  attempt walks clone, the worker's git-dir copy, agent, verify, commit, push and
  pull request. CPU per attempt is the process's own CPU plus that of every child it
  reaped (git, bwrap, the shells) over the worker's run, divided by N; the worker's
  guard process (a child it only reaps at exit) is read from ``/proc``. Stages are
  the worker's own methods wrapped in this process (exclusive time: the attempt
  thread's CPU plus the children reaped meanwhile); "rest" is the total minus the
  stages (the claim loop, the store, the heartbeat, the thread's own bookkeeping).
* ``start``: ``python -m runlane worker --exit-when-idle`` on an empty queue, as the
  harness starts one after every SIGKILL: the time to its ``worker_started`` line (the
  first claim follows at once) and its CPU with its children's (the start-up sandbox
  probe, the guard: this process is their subreaper). Also, alone: the imports of
  ``runlane.cli``, the probe (``Sandbox.check``) and the guard's start.

Rounds alternate the configurations (A B C A B C), medians are reported::

    .venv/bin/python bench/attempt_cost.py --config main-bwrap=.:bwrap \\
        --config main-off=.:off --config 2c075ca=../perf-base:- --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

START, END = "<!-- attempt-cost:start -->", "<!-- attempt-cost:end -->"
AGENT = 'echo "$RUNLANE_RUN_ID" > change.txt'
VERIFY = "true"
PR_SET_CHILD_SUBREAPER = 36
TICK = os.sysconf("SC_CLK_TCK")


# --- in the measured build's process ---------------------------------------------------


def _cpu_now() -> tuple[float, float]:
    """(user, sys) of this process and of every child it has reaped."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def _thread_and_children() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_THREAD), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return me.ru_utime + kids.ru_utime, me.ru_stime + kids.ru_stime


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(user, sys) of a live process, from /proc (with the children it reaped)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return (utime + cutime) / TICK, (stime + cstime) / TICK


class Stages:
    """Exclusive CPU per stage, from wrappers around the worker's own methods."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}
        self.calls: dict[str, int] = {}
        self._local = threading.local()

    def wrap(self, owner: Any, name: str, stage: str | Callable[[Any], str],
             after: Callable[[], None] | None = None) -> None:
        original = owner.__dict__[name]
        func = original.__func__ if isinstance(original, classmethod | staticmethod) else original
        stages, then = self, after

        def timed(*args: Any, **kwargs: Any) -> Any:
            label = stage(args[0]) if callable(stage) else stage
            stack = getattr(stages._local, "stack", None)
            if stack is None:
                stack = stages._local.stack = []
            stack.append([0.0, 0.0])  # CPU of nested stages, to subtract
            before = _thread_and_children()
            try:
                return func(*args, **kwargs)
            finally:
                if then is not None:
                    then()
                after = _thread_and_children()
                nested = stack.pop()
                used = [after[0] - before[0], after[1] - before[1]]
                if stack:
                    stack[-1][0] += used[0]
                    stack[-1][1] += used[1]
                total = stages.cpu.setdefault(label, [0.0, 0.0])
                total[0] += used[0] - nested[0]
                total[1] += used[1] - nested[1]
                stages.calls[label] = stages.calls.get(label, 0) + 1

        wrapped: Any = timed
        if isinstance(original, classmethod):
            wrapped = classmethod(timed)
        elif isinstance(original, staticmethod):
            wrapped = staticmethod(timed)
        setattr(owner, name, wrapped)


def _scratch_repo(root: Path) -> Path:
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b",
           "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@b"}
    seed = root / "seed"
    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True, env=env)
    for i in range(20):  # a small project, not an empty one
        (seed / f"file{i}.txt").write_text("line\n" * 50)
    subprocess.run(["git", "add", "."], cwd=seed, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=seed, check=True, env=env)
    bare = root / "repo.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(seed), str(bare)], check=True)
    return bare


def _environment(root: Path, sandbox: str) -> None:
    for key in [k for k in os.environ if k.startswith("RUNLANE_")]:
        del os.environ[key]
    os.environ.update({
        "RUNLANE_DATABASE_URL": f"sqlite:///{root / 'runlane.db'}",
        "RUNLANE_WORKSPACE_DIR": str(root / "workspaces"),
        "RUNLANE_ARTIFACTS_DIR": str(root / "artifacts"),
        "RUNLANE_FORGE_DIR": str(root / "forge"), "RUNLANE_LOG_LEVEL": "WARNING"})
    if sandbox != "-":
        os.environ["RUNLANE_SANDBOX"] = sandbox


def commands(agent: str) -> tuple[str, str]:
    """The agent and verify commands: a shell's, or the worker's Python's (``-I -S``, as
    the fault harness's agent starts)."""
    if agent == "shell":
        return AGENT, VERIFY
    python = shlex.quote(sys.executable)
    return (f"{python} -I -S -c \"import os; open('change.txt', 'w')"
            f".write(os.environ['RUNLANE_RUN_ID'])\"", f"{python} -I -S -c pass")


def child_attempts(attempts: int, sandbox: str, agent: str) -> dict[str, Any]:
    from runlane import workspace as ws_module
    from runlane.agents.command import CommandRunner
    from runlane.api import Runlane
    from runlane.codehost.local_forge import LocalForge
    from runlane.logs import configure_logging
    from runlane.workspace import Workspace

    configure_logging("WARNING")
    _subreaper()
    with tempfile.TemporaryDirectory(prefix="runlane-bench-attempt-") as scratch:
        root = Path(scratch)
        _environment(root, sandbox)
        repo = _scratch_repo(root)
        stages = Stages()
        lane = Runlane()
        lane.upgrade_schema()
        for i in range(attempts):
            lane.submit("bench", str(repo), f"change {i}")
        agent_command, verify_command = commands(agent)
        worker = lane.worker(agent_command=agent_command, verify_command=verify_command,
                             concurrency=1,
                             exit_when_idle=True)
        verifier = worker.driver.verifier
        stages.wrap(Workspace, "clone", "clone (git)")
        if hasattr(ws_module, "_copy_git_dir"):
            stages.wrap(ws_module, "_copy_git_dir", "worker's git-dir copy")
        stages.wrap(CommandRunner, "run",
                    lambda runner: "verify (sandbox + command)" if runner is verifier
                    else "agent (sandbox + command)", after=_reap_sandboxed)
        for name in ("keep_agent_tree", "check_limits", "has_changes"):
            stages.wrap(Workspace, name, "changes and limits (git)")
        stages.wrap(Workspace, "commit_all", "commit (git)")
        for name in ("remote_branch_sha", "remote_commit_carries"):
            stages.wrap(Workspace, name, "remote look-ups (ls-remote)")
        stages.wrap(Workspace, "push", "push (git)")
        for name in ("open_pull_request", "find_pull_request"):
            stages.wrap(LocalForge, name, "pull request (local forge)")
        stages.wrap(Workspace, "remove", "workspace removal")
        guard_before = _guard_cpu()
        before, wall = _cpu_now(), time.monotonic()
        worker.run()
        after, wall = _cpu_now(), time.monotonic() - wall
        guard_after = _guard_cpu()
        succeeded = sum(1 for outcome in worker.outcomes if outcome == "pull_request")
        return {"attempts": attempts, "succeeded": succeeded, "outcomes":
                sorted({str(o) for o in worker.outcomes}),
                "wall": wall, "user": after[0] - before[0], "sys": after[1] - before[1],
                "guard": [guard_after[0] - guard_before[0], guard_after[1] - guard_before[1]],
                "stages": stages.cpu, "calls": stages.calls}


def _guard_cpu() -> tuple[float, float]:
    try:
        from runlane.sandbox.guard import _GUARD
    except ImportError:
        return 0.0, 0.0
    proc = _GUARD._proc
    if proc is None or proc.poll() is not None:
        return 0.0, 0.0
    return _proc_cpu(proc.pid)


def child_start(samples: int, sandbox: str) -> dict[str, Any]:
    from runlane.api import Runlane

    _subreaper()  # the guard and the probe's sandbox, orphaned, come to us
    with tempfile.TemporaryDirectory(prefix="runlane-bench-start-") as scratch:
        root = Path(scratch)
        _environment(root, sandbox)
        for name in ("workspaces", "artifacts"):
            (root / name).mkdir(mode=0o700)
        with Runlane() as lane:
            lane.upgrade_schema()
            parts = _start_parts(lane, root)
        env = {**os.environ, "RUNLANE_LOG_LEVEL": "INFO"}
        argv = [sys.executable, "-m", "runlane", "worker", "--agent-command", "true",
                "--verify-command", "true", "--exit-when-idle"]
        ready, cpu = [], []
        imports = []
        for _ in range(samples):
            imports.append(_spawn_cpu([sys.executable, "-c", "import runlane.cli"], env))
            started = time.monotonic()
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert proc.stderr is not None
            seen = None
            for line in proc.stderr:
                if seen is None and b"worker_started" in line:
                    seen = time.monotonic() - started
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0 or seen is None:
                raise SystemExit(f"the worker failed (exit {proc.returncode})")
            orphans = _reap_orphans()
            ready.append(seen)
            cpu.append([usage.ru_utime + orphans[0], usage.ru_stime + orphans[1]])
        return {"ready": ready, "cpu": cpu, "imports": imports, "parts": parts}


def _subreaper() -> None:
    """Make this process a child subreaper: the PID 1 of a bwrap sandbox is orphaned
    when bwrap exits (bwrap does not reap it), and with it the CPU of everything that
    ran in the sandbox would go to init, uncounted."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reap_sandboxed() -> None:
    """Reap the sandbox's PID 1, orphaned to this subreaper when bwrap exited (one slot:
    no other child of the worker has exited unwaited at this point)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if not _zombie_children():
                return
            time.sleep(0.005)


def _zombie_children() -> bool:
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] in ("Z", "X"):
                return True
    return False


def _spawn_cpu(argv: list[str], env: dict[str, str]) -> list[float]:
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    proc.returncode = 0
    return [usage.ru_utime, usage.ru_stime]


def _reap_orphans() -> tuple[float, float]:
    """Wait for every orphan handed to this subreaper (a worker's guard ends at the end
    of its input, once the worker has exited); their CPU."""
    user = system = 0.0
    while True:
        try:
            _, _, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return user, system
        user += usage.ru_utime
        system += usage.ru_stime


def _start_parts(lane: Any, root: Path) -> dict[str, list[float]]:
    """The start-up probe and the guard's start, alone, in this process (CPU with the
    children they reaped; the guard's own start read from /proc)."""
    parts: dict[str, list[float]] = {}
    sandbox = getattr(lane, "sandbox", None)
    if sandbox is None:
        return parts
    box = sandbox(root / "workspaces", root / "artifacts")
    if box.mode == "off":
        return parts
    probes = []
    for _ in range(5):
        before = _cpu_now()
        box.check(workspace_root=root / "workspaces", artifacts_root=root / "artifacts")
        _reap_sandboxed()
        after = _cpu_now()
        probes.append([after[0] - before[0], after[1] - before[1]])
    parts["start-up probe (Sandbox.check)"] = [statistics.median(p[0] for p in probes),
                                               statistics.median(p[1] for p in probes)]
    from runlane.sandbox.guard import _GUARD, start

    before = _cpu_now()
    start()
    after = _cpu_now()
    assert _GUARD._proc is not None
    guard = _proc_cpu(_GUARD._proc.pid)
    parts["guard start (worker side + guard's own)"] = [
        after[0] - before[0] + guard[0], after[1] - before[1] + guard[1]]
    assert _GUARD._stdin is not None
    _GUARD._stdin.close()  # the guard ends at the end of its input
    _GUARD._proc.wait()
    return parts


# --- the parent ------------------------------------------------------------------------


def run_child(tree: Path, mode: str, sandbox: str, count: int,
              agent: str = "shell") -> dict[str, Any]:
    python = tree / ".venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    env["PYTHONPATH"] = str(tree / "src")
    done = subprocess.run([str(python), __file__, "--child", mode, "--count", str(count),
                           "--sandbox", sandbox, "--agent", agent], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree} {mode} {sandbox} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def progress(message: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def _revision(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "src"],
                           capture_output=True, text=True).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" + changes" if dirty else "")


def _med(values: Sequence[float]) -> float:
    return statistics.median(values)


def render(command: str, started: datetime, wall: float, configs: list[tuple[str, Path, str]],
           attempts: dict[str, list[dict[str, Any]]], starts: dict[str, list[dict[str, Any]]],
           environment: list[tuple[str, str]], n: int, agent: str) -> str:
    labels = [label for label, _, _ in configs]
    lines = [START, "## CPU per attempt and per worker start: `bench/attempt_cost.py`", "",
             f"Produced by `{command}` on {started:%Y-%m-%d %H:%M} UTC ({wall / 60:.1f} min). "
             f"Per configuration and round: {n} attempts through one `Runlane.worker` (one "
             "slot, SQLite, a local bare repository and the local forge; "
             + ("the agent is a shell that changes one file, the verify command `true`"
                if agent == "shell" else "agent and verify command are the worker's "
                "Python (`-I -S`, as the fault harness's agent), the agent changes one file")
             + "), and worker starts of `python -m "
             "runlane worker --exit-when-idle` on an empty queue. Rounds interleave the "
             "configurations; medians of the rounds. CPU is the worker process's own plus "
             "every child's (git, bwrap, the shells, the guard). `bench/attempt_cost.py` "
             "says how.", "", "|  |  |", "| :--- | :--- |"]
    lines += [f"| **{k}** | {v} |" for k, v in environment]
    lines += [f"| **{label}** | `{tree}` at {_revision(tree)}, SANDBOX "
              f"{'unset (no sandbox)' if box == '-' else box} |" for label, tree, box in configs]
    lines += ["", "### Per attempt (CPU ms, user + sys)", ""]
    header = ["Stage", *labels]
    stage_names: list[str] = []
    for label in labels:
        for sample in attempts[label]:
            for name in sample["stages"]:
                if name not in stage_names:
                    stage_names.append(name)

    def cell(user: float, system: float) -> str:
        return f"{(user + system) * 1000:.0f} ({user * 1000:.0f} + {system * 1000:.0f})"

    rows = []
    for name in stage_names:
        row = [name]
        for label in labels:
            samples = attempts[label]
            user = _med([s["stages"].get(name, [0, 0])[0] / s["attempts"] for s in samples])
            system = _med([s["stages"].get(name, [0, 0])[1] / s["attempts"] for s in samples])
            row.append(cell(user, system) if any(name in s["stages"] for s in samples) else "-")
        rows.append(row)
    rest_row, total_row, wall_row, guard_row = (["rest (claim loop, store, heartbeat)"],
                                                ["**total per attempt**"],
                                                ["wall per attempt, ms"],
                                                ["guard process"])
    for label in labels:
        samples = attempts[label]
        rest = [[s["user"] - sum(v[0] for v in s["stages"].values()) - s["guard"][0],
                 s["sys"] - sum(v[1] for v in s["stages"].values()) - s["guard"][1]]
                for s in samples]
        pairs = list(zip(rest, samples, strict=True))
        rest_row.append(cell(_med([r[0] / s["attempts"] for r, s in pairs]),
                             _med([r[1] / s["attempts"] for r, s in pairs])))
        guard_row.append(cell(_med([s["guard"][0] / s["attempts"] for s in samples]),
                              _med([s["guard"][1] / s["attempts"] for s in samples])))
        total_row.append("**" + cell(
            _med([(s["user"]) / s["attempts"] for s in samples]),
            _med([(s["sys"]) / s["attempts"] for s in samples])) + "**")
        wall_row.append(f"{_med([s['wall'] / s['attempts'] for s in samples]) * 1000:.0f}")
    rows += [guard_row, rest_row, total_row, wall_row]
    lines += [_table(header, rows), ""]
    lines += ["### Per worker start", ""]
    rows = []
    ready_row, cpu_row, import_row = (["`worker_started` after, ms"],
                                      ["CPU of a start and an idle exit, ms (user + sys)"],
                                      ["of which `import runlane.cli`, ms"])
    part_names: list[str] = []
    for label in labels:
        for sample in starts[label]:
            for name in sample["parts"]:
                if name not in part_names:
                    part_names.append(name)
    part_rows = [[f"of which {name}, ms"] for name in part_names]
    for label in labels:
        samples = starts[label]
        ready_row.append(f"{_med([v for s in samples for v in s['ready']]) * 1000:.0f}")
        cpu_row.append(cell(_med([c[0] for s in samples for c in s["cpu"]]),
                            _med([c[1] for s in samples for c in s["cpu"]])))
        import_row.append(cell(_med([c[0] for s in samples for c in s["imports"]]),
                               _med([c[1] for s in samples for c in s["imports"]])))
        for row, name in zip(part_rows, part_names, strict=True):
            have = [s["parts"][name] for s in samples if name in s["parts"]]
            row.append(cell(_med([h[0] for h in have]), _med([h[1] for h in have]))
                       if have else "-")
    rows = [ready_row, cpu_row, import_row, *part_rows]
    lines += [_table(["", *labels], rows), "", END, ""]
    return "\n".join(lines)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |",
           "| :--- | " + " | ".join("---:" for _ in header[1:]) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def _merge(path: Path, section: str) -> None:
    existing = path.read_text() if path.exists() else ""
    if START in existing and END in existing:
        head, _, rest = existing.partition(START)
        _, _, tail = rest.partition(END)
        text = head + section.rstrip("\n") + tail
    else:
        text = existing.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def _machine() -> str:
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.partition(":")[2].strip()
            break
    return f"{model}, {os.cpu_count()} CPUs; Linux {platform.release()}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", action="append", metavar="LABEL=TREE:SANDBOX",
                        help="a build to measure (repeatable); default this checkout, "
                             "bwrap and off")
    parser.add_argument("--attempts", type=int, default=20, help="attempts per round")
    parser.add_argument("--starts", type=int, default=3, help="worker starts per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agent", choices=("shell", "python"), default="shell",
                        help="the agent and verify commands: a shell (`echo ... > "
                             "change.txt`, `true`) or the worker's Python (`-I -S`)")
    parser.add_argument("--write", type=Path, metavar="PATH",
                        help="also put the Markdown section into PATH")
    parser.add_argument("--child", choices=("attempts", "start"), help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--sandbox", default="-", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "attempts":
        print(json.dumps(child_attempts(args.count, args.sandbox, args.agent)))
        return 0
    if args.child == "start":
        print(json.dumps(child_start(args.count, args.sandbox)))
        return 0
    here = Path(__file__).resolve().parent.parent
    configs = []
    for spec in args.config or [f"bwrap={here}:bwrap", f"off={here}:off"]:
        label, _, rest = spec.partition("=")
        tree, _, box = rest.rpartition(":")
        configs.append((label, Path(tree).resolve(), box))
    started, wall = datetime.now(UTC), time.monotonic()
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    attempts: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    starts: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for label, tree, box in order:
            result = run_child(tree, "attempts", box, args.attempts, args.agent)
            if result["succeeded"] != args.attempts:
                raise SystemExit(f"{label}: only {result['succeeded']} of {args.attempts} "
                                 f"attempts succeeded: {result['outcomes']}")
            attempts[label].append(result)
            starts[label].append(run_child(tree, "start", box, args.starts))
            progress(f"round {r + 1}/{args.rounds} {label}: "
                     f"{(result['user'] + result['sys']) / args.attempts * 1000:.0f} ms CPU "
                     "per attempt")
    environment = [("Machine", _machine()),
                   ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
                   ("Load average (1/5/15 min)", f"{load} at start, "
                    + " ".join(f"{v:.1f}" for v in os.getloadavg()) + " at end")]
    shown = "python bench/attempt_cost.py " + shlex.join(
        [a.replace(str(here) + "/", "").replace(str(here), ".") for a in
         (argv if argv is not None else sys.argv[1:])])
    section = render(shown, started, time.monotonic() - wall, configs, attempts, starts,
                     environment, args.attempts, args.agent)
    sys.stdout.write(section)
    if args.write is not None:
        _merge(args.write, section)
        progress(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
