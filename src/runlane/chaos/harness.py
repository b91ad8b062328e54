"""The fault harness: a workload on real ``runlane worker`` and ``runlane maintain``
processes, real git remotes and the local forge, with faults injected on a schedule
drawn from the seed; then every invariant is checked (``chaos.checks``).

The seed fixes the workload (tasks, behaviours, cancellations) and the fault
schedule (intervals and victims chosen in order); the interleaving with the
processes is the machine's, so a replay reproduces the conditions, not every
microsecond.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import SQLAlchemyError

from runlane.chaos import agent as agent_module
from runlane.chaos.agent import DWELL_ENV
from runlane.chaos.env import PLANT_ENV, PR_CRASH_ENV, PR_CRASH_MARK
from runlane.chaos.pgbouncer import PgBouncer, database_settings
from runlane.chaos.pgbouncer import start as start_pgbouncer
from runlane.chaos.pgcluster import PrivateCluster
from runlane.chaos.profiles import ChaosConfig
from runlane.chaos.workload import CampaignPlan, TaskPlan, build_workload, split_campaigns
from runlane.domain.campaigns import campaign_from_document
from runlane.domain.retry import RetryPolicy
from runlane.domain.states import TERMINAL
from runlane.domain.tasks import parse_task
from runlane.errors import RunlaneError
from runlane.services.supervisor import SUPERVISOR_ENV
from runlane.store import invariants
from runlane.store.engine import build_engine, normalize_url
from runlane.store.migrate import upgrade
from runlane.store.store import Store

OWN_APPLICATION = "runlane-chaos"
TERMINAL_VALUES = frozenset(s.value for s in TERMINAL)
CAMPAIGN_ENDS = frozenset({"COMPLETED", "STOPPED"})
CANCELLING_VALUES = frozenset({"CANCEL_REQUESTED", "CANCELLING"})
DB_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, RunlaneError, OSError)
# How long the workers may take to start and register (six Python processes starting
# at once on a busy two-core machine take several seconds each).
STARTUP_SECONDS = 60.0
# Exit code of `runlane worker` when the database cannot be reached at start.
EXIT_DATABASE_UNAVAILABLE = 4


class SetupFailed(RunlaneError):
    exit_code = 4


@dataclass
class Fault:
    kind: str
    at: float  # wall clock (time.time(), comparable with the database's clock here)
    pid: int | None = None
    detail: str = ""


@dataclass
class Proc:
    role: str  # worker | maintainer
    slot: int
    popen: subprocess.Popen[bytes]
    log: Path
    started: float
    resume_at: float | None = None  # SIGSTOPped until then (monotonic)
    ready: bool = False  # registered in the workers table: it claims from now on
    expected_exit: bool = False  # we SIGKILLed it


@dataclass
class Outcome:
    """What the run produced, for the checks and the report."""

    config: ChaosConfig
    directory: Path
    database: str
    plans: list[TaskPlan]
    run_of_key: dict[str, str]
    campaigns: list[CampaignPlan]
    workload: int  # the plain tasks planned (the profile's runs less the campaigns' targets)
    remotes: list[Path]
    forge: Path
    faults: list[Fault]
    counts: Counter[str]
    restart_windows: list[tuple[float, float]]
    # SQLite: the windows a SIGSTOPped worker held the database's write lock (no writer,
    # the reaper included, can go on until it resumes: SQLite has no way to break it).
    lock_stall_windows: list[tuple[float, float]]
    exits: list[tuple[str, int, int, str]]  # role, pid, exit code, last log line
    harness_errors: list[str]
    logs: list[Path]
    wall_seconds: float
    stopped_early: str | None  # why the harness stopped waiting, if it did
    store: Store | None = None
    stray_agents: int = 0  # agent processes still alive at the end, killed


def _git(*args: str, cwd: Path | None = None) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "chaos", "GIT_AUTHOR_EMAIL": "chaos@local",
           "GIT_COMMITTER_NAME": "chaos", "GIT_COMMITTER_EMAIL": "chaos@local"}
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, env=env)


def make_remotes(root: Path, count: int) -> list[Path]:
    """Bare repositories with one commit on main: the remotes the workers push to."""
    root.mkdir(parents=True, exist_ok=True)
    remotes = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(count):
            seed = Path(scratch) / f"service-{i}"
            _git("init", "-q", "-b", "main", str(seed))
            (seed / "README.md").write_text(f"# service {i}\n")
            _git("add", "README.md", cwd=seed)
            _git("commit", "-q", "-m", "initial commit", cwd=seed)
            bare = root / f"service-{i}.git"
            _git("clone", "-q", "--bare", str(seed), str(bare))
            remotes.append(bare)
    return remotes


def _errline(exc: BaseException) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = path.read_text(errors="replace").strip().splitlines()
        if lines:
            return lines[-1][-300:]
    return ""


class Harness:
    def __init__(self, config: ChaosConfig,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.c = config
        self.progress = progress or (lambda _: None)
        self.rng = random.Random(f"{config.seed}:faults")
        # Some of the profile's runs are a campaign's targets instead: the scheduler
        # pass dispatches them, so the profile's run count, and its time, stay the same.
        self.plans, self.campaigns = split_campaigns(build_workload(
            config.seed, config.runs, repos=config.repos,
            agent_faults="agent" in config.faults, cancels="cancel" in config.faults,
            agent_sleep=config.agent_sleep, pr_crashes="pr_crash" in config.faults))
        self.created_campaigns: set[str] = set()
        self.campaign_status: dict[str, str] = {}
        self.faults: list[Fault] = []
        self.counts: Counter[str] = Counter()
        self.procs: list[Proc] = []
        self.current: dict[tuple[str, int], Proc] = {}  # the latest process of each slot
        self.spawned: Counter[tuple[str, int]] = Counter()
        self.exits: list[tuple[str, int, int, str]] = []
        self.errors: list[str] = []
        self.restart_windows: list[tuple[float, float]] = []
        self.lock_stall_windows: list[tuple[float, float]] = []
        self.run_of_key: dict[str, str] = {}
        self.plan_of_run: dict[str, TaskPlan] = {}
        self.task_of_run: dict[str, str] = {}
        self.status: dict[str, tuple[str, int]] = {}
        self.cancel_done: dict[str, int] = {}  # run -> cancels sent
        self.next_plan = 0
        self.active = self.ended = 0  # runs not ended / ended, as of the last poll
        self.withdrawals = 0  # runs due a withdrawal, as of the last poll
        self.cluster: PrivateCluster | None = None
        self.bouncer: PgBouncer | None = None
        # The URL the workers and maintenance are given (--pgbouncer: PgBouncer's).
        self.process_url = ""
        self.store: Store | None = None
        self.reader: Engine | None = None
        self.db_down_until = 0.0
        self.restart_pending: float | None = None
        self.restarts_done = 0
        self.last_event = -1
        self.last_change = time.monotonic()
        self.directory: Path | None = None
        self.stray_agents = 0
        self.timers: list[threading.Timer] = []

    @property
    def workdir(self) -> Path:
        assert self.directory is not None
        return self.directory

    def close(self) -> None:
        """Release the harness's connections and delete its private cluster."""
        if self.store is not None:
            self.store.close()
        if self.reader is not None:
            self.reader.dispose()
        if self.bouncer is not None:
            self.bouncer.stop()
        if self.cluster is not None:
            self.cluster.destroy()

    # --- set-up -----------------------------------------------------------------

    def _setup(self) -> None:
        c = self.c
        directory = (c.directory.resolve() if c.directory else
                     Path(tempfile.mkdtemp(prefix="runlane-chaos-")))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "logs").mkdir(exist_ok=True)
        self.directory = directory
        self.remotes = make_remotes(directory / "remotes", c.repos)
        self.forge = directory / "forge"
        if c.database_url:
            self.url = c.database_url
            self.database = "given with --database-url"
        elif c.engine == "sqlite":
            self.url = f"sqlite:///{self.workdir / 'runlane.db'}"
            self.database = "one file in the work directory"
        else:
            self.cluster = PrivateCluster()
            self.url = self.cluster.start()
            self.database = f"private cluster on port {self.cluster.port}"
        self.process_url = self.url
        if c.pgbouncer:  # the harness's own connections stay direct
            database_settings(self.url, idle_in_transaction_seconds=c.lease_ttl / 2)
            self.bouncer = start_pgbouncer(self.url)
            self.process_url = self.bouncer.url_for(self.url)
            self.database += (f", workers and maintenance through PgBouncer (transaction "
                              f"pooling) on port {self.bouncer.port}")
        engine = build_engine(self.url)
        try:
            upgrade(engine)
        except SQLAlchemyError as exc:
            raise SetupFailed(f"cannot prepare the database: {_errline(exc)}") from None
        finally:
            engine.dispose()
        self.store = Store(self.url, engine=self._engine(), rng=random.Random(c.seed),
                           retry_policy=RetryPolicy(base_seconds=0.1, max_seconds=0.2))
        self.reader = self._engine(read_only=True)

    def _engine(self, read_only: bool = False) -> Engine:
        """The harness's own connections: named, so no fault terminates them; on
        SQLite, reads that take no write lock."""
        if self.c.engine == "sqlite":
            if not read_only:
                return build_engine(self.url)
            path = self.url.removeprefix("sqlite:///")
            return create_engine(f"sqlite:///file:{path}?mode=ro&uri=true",
                                 connect_args={"timeout": 30, "check_same_thread": False})
        # Bounded waits: a paused worker may hold a row lock a statement here needs.
        return create_engine(normalize_url(self.url), pool_pre_ping=True,
                             connect_args={"application_name": OWN_APPLICATION,
                                           "connect_timeout": 5,
                                           "options": "-c lock_timeout=5000 "
                                                      "-c statement_timeout=20000"})

    # --- processes --------------------------------------------------------------------

    def _command(self, role: str) -> list[str]:
        hooked = (self.c.plant is not None or "cancel" in self.c.faults
                  or "pr_crash" in self.c.faults)
        module = "runlane.chaos.hooks" if hooked else "runlane"
        base = [sys.executable, "-m", module, "--database-url", self.process_url]
        if role == "maintainer":
            return [*base, "maintain"]
        script = shlex.quote(agent_module.__file__ or "agent.py")
        python = shlex.quote(sys.executable)
        # The verify command lingers in VERIFYING itself; runlane gives no RUNLANE_*
        # setting of the worker's to the commands it runs, so it is set here.
        return [*base, "worker", "--agent-command", f"{python} -I -S {script}",
                "--verify-command", f"{DWELL_ENV}={self._dwell()} {python} -I -S {script} --verify",
                "--concurrency", str(self.c.concurrency),
                "--timeout-seconds", f"{self.c.agent_timeout:g}"]

    def _dwell(self) -> str:
        return f"{self.c.dwell:g}" if "cancel" in self.c.faults else "0"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
        env.update(self.c.worker_env())
        env.update({
            "RUNLANE_FORGE_DIR": str(self.forge),
            "RUNLANE_ARTIFACTS_DIR": str(self.workdir / "artifacts"),
            "RUNLANE_WORKSPACE_DIR": str(self.workdir / "workspaces"),
            "RUNLANE_LOG_LEVEL": "WARNING",
            SUPERVISOR_ENV: str(os.getpid()),  # they drain if the harness dies
            DWELL_ENV: self._dwell(),
        })
        if self.bouncer is not None:  # LISTEN cannot go through a transaction pooler
            env["RUNLANE_LISTEN_DATABASE_URL"] = self.url
        if self.c.plant:
            env[PLANT_ENV] = self.c.plant
        if "pr_crash" in self.c.faults:
            env[PR_CRASH_ENV] = "1"
        return env

    def _spawn(self, role: str, slot: int) -> Proc:
        n = self.spawned[(role, slot)]
        self.spawned[(role, slot)] += 1
        log = self.workdir / "logs" / f"{role}-{slot}.{n}.log"
        with log.open("wb") as out:  # the child keeps its own descriptor
            popen = subprocess.Popen(self._command(role), env=self._env(), cwd=self.workdir,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=out)
        proc = Proc(role, slot, popen, log, time.time())
        self.procs.append(proc)
        self.current[(role, slot)] = proc
        return proc

    def _live(self, role: str = "worker") -> list[Proc]:
        return [p for (r, _), p in sorted(self.current.items())
                if r == role and p.popen.poll() is None]

    def _supervise(self) -> None:
        for (role, slot), p in list(self.current.items()):
            code = p.popen.poll()
            if code is None:
                continue
            crash_at = _planned_crash(p.log) if code == -signal.SIGKILL else None
            if crash_at is not None:  # the fault pr_crash: it killed itself, as planned
                self.faults.append(Fault("pr_crash", crash_at, p.popen.pid))
                self.counts["pr_crash"] += 1
            elif not p.expected_exit:
                self.exits.append((role, p.popen.pid, code, _tail(p.log)))
            self._spawn(role, slot)

    def _resume(self, now: float, force: bool = False) -> None:
        for p in self.current.values():
            if p.resume_at is not None and (force or now >= p.resume_at):
                _continue(p.popen.pid)
                p.resume_at = None
        if force:
            for timer in self.timers:
                timer.cancel()

    # --- the database, tolerant of its outages ------------------------------------------

    def _db(self, what: str, work: Callable[[], Any]) -> Any:
        if time.monotonic() < self.db_down_until:
            return None
        try:
            return work()
        except DB_ERRORS as exc:
            message = _errline(exc)
            if "database is locked" in message:
                self.counts["database_locked"] += 1
                self.errors.append(f"{what}: {message}")
            self.counts["harness_db_errors"] += 1
            return None

    def _read(self, statement: str, **params: Any) -> list[Any]:
        assert self.reader is not None
        with self.reader.connect() as conn:
            return list(conn.execute(text(statement), params))

    # --- workload ------------------------------------------------------------------------

    def _submit(self, plans: list[TaskPlan]) -> bool:
        assert self.store is not None
        store = self.store
        rows = [parse_task(p.submission(str(self.remotes[p.repo]))) for p in plans]
        result = self._db("submit", lambda: store.submit(rows))
        if result is None:
            return False
        for plan, sub in zip(plans, result, strict=True):
            known = self.run_of_key.get(plan.key)
            if known is not None and (sub.created or sub.run_id != known):
                self.errors.append(f"duplicate submit of {plan.key} gave run {sub.run_id}, "
                                   f"created={sub.created}; first run {known}")
                self.counts["duplicate_submit_created"] += 1
            if known is None:
                self.run_of_key[plan.key] = sub.run_id
                self.plan_of_run[sub.run_id] = plan
                self.task_of_run[sub.run_id] = sub.task_id
                self.status[sub.run_id] = (sub.status, 0)
        return True

    def _submit_more(self) -> None:
        if self.next_plan and not self.campaigns_created:  # with the first plain runs
            self._create_campaigns()
        if self.next_plan >= len(self.plans):
            return
        # Feed the workers that can take work now (running, not paused, booted), and
        # leave headroom: a recovered run is then claimed at once, not after a queue.
        usable = sum(1 for p in self._live() if p.resume_at is None and p.ready)
        room = round(usable * self.c.concurrency * self.c.backlog) - self.active
        if room <= 0:
            return
        batch = self.plans[self.next_plan:self.next_plan + min(room, 25)]
        if not self._submit(batch):
            return
        first = self.next_plan == 0
        self.next_plan += len(batch)
        self.active += len(batch)
        self.last_change = time.monotonic()
        self.counts["submitted"] += len(batch)
        # The same batch again creates nothing.
        if first and "duplicate" in self.c.faults and self._submit(batch):
            self.counts["duplicate_submit"] += len(batch)
        for plan in batch:
            if plan.cancel_at == "QUEUED":
                self._cancel(self.run_of_key[plan.key])

    def _create_campaigns(self) -> None:
        """Create the workload's campaigns (again: a duplicate that must create nothing)."""
        assert self.store is not None
        store = self.store
        paths = [str(r) for r in self.remotes]
        for plan in self.campaigns:
            campaign = campaign_from_document(plan.document(paths), f"chaos:{plan.name}")
            made = self._db("campaign", functools.partial(store.create_campaign, campaign))
            if made is None:
                continue
            if plan.name in self.created_campaigns and made.created:
                self.errors.append(f"duplicate campaign create of {plan.name} created it again")
                self.counts["duplicate_campaign_created"] += 1
            self.created_campaigns.add(plan.name)

    @property
    def campaigns_created(self) -> bool:
        return len(self.created_campaigns) == len(self.campaigns)

    def _cancel(self, run_id: str) -> None:
        assert self.store is not None
        store, task = self.store, self.task_of_run[run_id]
        if self._db("cancel", lambda: store.cancel(task)) is not None:
            self.cancel_done[run_id] = self.cancel_done.get(run_id, 0) + 1
            self.counts["cancel"] += 1

    def _poll(self) -> None:
        starting = {str(p.popen.pid): p for p in self._live() if not p.ready}
        if starting:
            workers = self._db("poll", lambda: self._read(invariants.WORKERS)) or []
            for w in workers:
                parts = str(w.worker_id).split("/")
                if len(parts) >= 3 and parts[-2] in starting:
                    starting[parts[-2]].ready = True
        rows = self._db("poll", lambda: self._read(invariants.RUN_STATUSES))
        if rows is None:
            return
        due = self._db("poll", lambda: self._read(invariants.WITHDRAWALS_PENDING))
        if due is not None:
            self.withdrawals = int(due[0][0])
        for r in rows:
            self.status[r.run_id] = (r.status, r.attempt_count)
        self.ended = sum(1 for s, _ in self.status.values() if s in TERMINAL_VALUES)
        self.active = len(self.status) - self.ended
        last = self._db("poll", lambda: self._read(invariants.LAST_EVENT))
        if last:
            value = int(last[0][0])
            if value != self.last_event:
                self.last_event, self.last_change = value, time.monotonic()
        if self.campaigns:
            found = self._db("poll", lambda: self._read(invariants.CAMPAIGN_STATUSES))
            if found is not None:
                self.campaign_status = {str(r.name): str(r.status) for r in found}
        if "cancel" in self.c.faults:
            self._cancels()

    def _cancels(self) -> None:
        for run_id, (status, attempts) in list(self.status.items()):
            plan = self.plan_of_run.get(run_id)
            if plan is None or plan.cancel_at is None:
                continue
            sent = self.cancel_done.get(run_id, 0)
            target = plan.cancel_at
            due = False
            if target == "QUEUED":
                due = sent == 0 and status == "QUEUED"
            elif target == "RETRY_WAIT":
                due = sent == 0 and status == "QUEUED" and attempts >= 1
            elif target == "TERMINAL":
                due = sent == 0 and status in TERMINAL_VALUES
            elif target == "CANCEL_REQUESTED":
                due = (sent == 0 and status == "RUNNING") or (
                    sent == 1 and status in CANCELLING_VALUES)
            else:
                due = sent == 0 and status == target
            if due:
                self._cancel(run_id)

    def _done(self) -> bool:
        # Every run ended, and every withdrawal (a pull request of a run that ended
        # without success, closed by a worker) done: the checks then see the code host
        # as runlane leaves it.
        if self.next_plan < len(self.plans) or self.active or self.withdrawals:
            return False
        # Every campaign completed or stopped (its last batch may still be undispatched
        # while no run is active).
        if self.campaigns and (not self.campaigns_created or any(
                self.campaign_status.get(p.name) not in CAMPAIGN_ENDS for p in self.campaigns)):
            return False
        for run_id, (status, _) in self.status.items():
            if status not in TERMINAL_VALUES:
                return False
            plan = self.plan_of_run.get(run_id)
            if plan is not None and plan.cancel_at == "TERMINAL" and \
                    "cancel" in self.c.faults and not self.cancel_done.get(run_id):
                return False
        return True

    # --- faults ---------------------------------------------------------------------------

    def _every(self, kind: str) -> float:
        return {"kill": self.c.kill_every, "stop": self.c.stop_every,
                "terminate": self.c.terminate_every,
                "duplicate": self.c.duplicate_every}[kind]

    def _schedule(self, kind: str, now: float) -> None:
        every = self._every(kind)
        self.next_fault[kind] = now + every * self.rng.uniform(0.5, 1.5) if every > 0 \
            else float("inf")

    def _inject(self, now: float) -> None:
        for kind in ("kill", "stop", "terminate", "duplicate"):
            if kind in self.c.faults and now >= self.next_fault[kind]:
                self._schedule(kind, now)
                getattr(self, f"_fault_{kind}")()
        if "restart" in self.c.faults and self.cluster is not None:
            self._fault_restart(now)

    def _victim(self) -> Proc | None:
        """A random running, registered worker, among those holding a lease if any do."""
        candidates = sorted((p for p in self._live() if p.resume_at is None and p.ready),
                            key=lambda p: p.slot)
        rows = self._db("holders", lambda: self._read(invariants.LEASE_HOLDERS)) or []
        pids = {str(r.worker_id).split("/")[-2] for r in rows
                if str(r.worker_id).count("/") >= 2}
        holders = [p for p in candidates if str(p.popen.pid) in pids]
        pool = holders or candidates
        return self.rng.choice(pool) if pool else None

    def _fault_kill(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        victim.expected_exit = True
        self.faults.append(Fault("kill", time.time(), victim.popen.pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.popen.pid, signal.SIGKILL)
        self.counts["kill"] += 1

    def _fault_stop(self) -> None:
        victim = self._victim()
        if victim is None:
            return
        self.faults.append(Fault("stop", time.time(), victim.popen.pid))
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.popen.pid, signal.SIGSTOP)
        victim.resume_at = time.monotonic() + self.c.stop_seconds
        # SIGCONT from a timer, not from the loop: the paused worker may hold a lock the
        # loop's next statement waits for.
        timer = threading.Timer(self.c.stop_seconds, _continue, args=(victim.popen.pid,))
        timer.daemon = True
        timer.start()
        self.timers.append(timer)
        self.counts["stop"] += 1
        if self.c.engine == "sqlite":
            paused_at = time.time()
            threading.Thread(target=self._probe_write_lock, daemon=True,
                             args=(paused_at, paused_at + self.c.stop_seconds)).start()

    def _probe_write_lock(self, paused_at: float, resumes_at: float) -> None:
        """Whether the worker just paused holds SQLite's write lock: if no write
        transaction can begin within a second (the others hold it for milliseconds),
        every writer waits for its SIGCONT, and that window is recorded."""
        path = self.url.removeprefix("sqlite:///")
        try:
            conn = sqlite3.connect(path, timeout=1.0, isolation_level=None)
        except sqlite3.Error as exc:
            self.errors.append(f"write lock probe: {exc}")
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc):
                self.errors.append(f"write lock probe: {exc}")
                return
            self.lock_stall_windows.append((paused_at, resumes_at))
            self.counts["stop_holding_write_lock"] += 1
        finally:
            conn.close()

    def _fault_terminate(self) -> None:
        if self.c.engine != "postgresql":
            return

        def work() -> int:
            assert self.store is not None
            with self.store.engine.begin() as conn:
                sessions = list(conn.execute(text(invariants.SESSIONS),
                                             {"own": OWN_APPLICATION}))
                if not sessions:
                    return 0
                chosen = self.rng.sample(sessions, min(len(sessions), self.rng.randint(1, 2)))
                for s in chosen:
                    conn.execute(text(invariants.TERMINATE), {"pid": s.pid})
                return len(chosen)

        n = self._db("terminate", work)
        if n:
            self.faults.append(Fault("terminate", time.time(), detail=str(n)))
            self.counts["terminate"] += n

    def _fault_duplicate(self) -> None:
        assert self.store is not None
        store = self.store
        submitted = self.plans[:self.next_plan]
        if self.campaigns_created:  # the same campaigns again create nothing
            self._create_campaigns()
            self.counts["duplicate_campaign"] += len(self.campaigns)
        if submitted:
            again = self.rng.sample(submitted, min(len(submitted), self.rng.randint(1, 3)))
            if self._submit(again):
                self.counts["duplicate_submit"] += len(again)
        running = sorted(r for r, (s, _) in self.status.items() if s == "RUNNING")
        if self.c.engine == "postgresql":
            def notify() -> bool:
                with store.engine.begin() as conn:
                    for _ in range(3):
                        conn.execute(text(invariants.NOTIFY),
                                     {"channel": "runlane_wakeup", "payload": "default"})
                    if running:
                        conn.execute(text(invariants.NOTIFY),
                                     {"channel": "runlane_cancel",
                                      "payload": self.rng.choice(running)})
                return True

            if self._db("notify", notify):
                self.counts["duplicate_wakeup"] += 1
        if running:  # a second delivery of a run that is already leased
            run_id = self.rng.choice(running)
            leases = self._db("deliver", lambda: store.claim(
                f"chaos-duplicate/{os.getpid()}/{run_id}", run_id=run_id,
                lease_ttl=self.c.lease_ttl))
            self.counts["duplicate_delivery"] += 1
            for lease in leases or []:  # it was requeued meanwhile: give it back
                self.counts["duplicate_delivery_claimed"] += 1
                self._db("release", functools.partial(
                    store.release, lease, message="chaos harness: duplicate delivery"))

    def _fault_restart(self, now: float) -> None:
        assert self.cluster is not None
        if self.restart_pending is not None:
            if now >= self.restart_pending:
                stopped_at = self.restart_windows[-1][0]
                try:
                    self.cluster.start_again()
                except RunlaneError as exc:
                    self.errors.append(f"restart: {exc}")
                    self.restart_pending = now + 1.0
                    return
                self.restart_windows[-1] = (stopped_at, time.time())
                self.restart_pending = None
                self.db_down_until = 0.0
            return
        if self.restarts_done >= self.c.restarts:
            return
        point = (self.restarts_done + 1) / (self.c.restarts + 1)
        if self.ended < point * len(self.plans):
            return
        try:
            self.cluster.stop_immediately()
        except RunlaneError as exc:
            self.errors.append(f"restart: {exc}")
            return
        self.restarts_done += 1
        self.counts["restart"] += 1
        down = self.rng.uniform(0.5, 1.5)
        self.faults.append(Fault("restart", time.time(), detail=f"{down:.2f}s down"))
        self.restart_windows.append((time.time(), time.time() + down))
        self.restart_pending = now + down
        self.db_down_until = now + down

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> Outcome:
        started = time.monotonic()
        stopped_early: str | None = None
        try:
            self._setup()
            for slot in range(self.c.maintainers):
                self._spawn("maintainer", slot)
            for slot in range(self.c.workers):
                self._spawn("worker", slot)
            now = self.last_change = time.monotonic()
            self.next_fault: dict[str, float] = {}
            for kind in ("kill", "stop", "terminate", "duplicate"):
                self._schedule(kind, now + 2.0)
            last_poll = last_progress = 0.0
            poll_every = 0.1 if self.c.engine == "postgresql" else 0.2
            while True:
                now = time.monotonic()
                self._resume(now)
                self._supervise()
                if now - last_poll >= poll_every:
                    last_poll = now
                    self._submit_more()
                    self._poll()
                    if self._done():
                        break
                self._inject(now)
                if now - last_progress >= 1.0:
                    last_progress = now
                    self.progress(self._progress(now - started))
                if now - started > self.c.max_seconds:
                    stopped_early = f"gave up after {self.c.max_seconds:g}s"
                    break
                if self.next_plan == 0 and now - self.last_change > STARTUP_SECONDS:
                    stopped_early = f"no worker registered within {STARTUP_SECONDS:g}s"
                    break
                if self.next_plan and now - self.last_change > self.c.stall_seconds and \
                        self.restart_pending is None:
                    stopped_early = f"no run changed state for {self.c.stall_seconds:g}s"
                    break
                time.sleep(0.05)
        finally:
            self._shutdown()
        return Outcome(
            config=self.c, directory=self.workdir, database=self.database,
            plans=self.plans[:self.next_plan], run_of_key=dict(self.run_of_key),
            campaigns=self.campaigns, workload=len(self.plans),
            remotes=self.remotes, forge=self.forge, faults=self.faults, counts=self.counts,
            restart_windows=self.restart_windows,
            lock_stall_windows=list(self.lock_stall_windows), exits=self.exits,
            harness_errors=self.errors, logs=[p.log for p in self.procs],
            wall_seconds=time.monotonic() - started, stopped_early=stopped_early,
            store=self.store, stray_agents=self.stray_agents)

    def _progress(self, elapsed: float) -> dict[str, Any]:
        states = Counter(s for s, _ in self.status.values())
        return {"elapsed": elapsed, "submitted": self.next_plan, "runs": len(self.plans),
                "states": dict(states), "faults": {k: self.counts[k] for k in
                                                    ("kill", "stop", "terminate", "restart",
                                                     "cancel", "duplicate_submit", "pr_crash")
                                                    if self.counts[k]},
                "workers": len(self._live())}

    def _shutdown(self) -> None:
        """SIGCONT the paused, drain the workers, stop maintenance, end stray agents,
        and make sure the database is up for the checks."""
        if self.directory is None:
            return
        self._resume(0.0, force=True)
        if self.cluster is not None and self.restart_pending is not None:
            with contextlib.suppress(RunlaneError):
                self.cluster.start_again()
            self.restart_pending = None
        live = [p for p in self.current.values() if p.popen.poll() is None]
        for p in live:
            p.expected_exit = True
            if p.role == "worker":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in live:
            if p.role != "worker":
                continue
            try:
                p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.exits.append((p.role, p.popen.pid, -1, "did not drain within 15s"))
                p.popen.kill()
                p.popen.wait()
        for p in live:
            if p.role == "maintainer":
                p.popen.terminate()
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
        for p in self.current.values():  # earlier ones were waited on by _supervise
            if p.popen.poll() is None:
                p.popen.kill()
                p.popen.wait()
        self.stray_agents = end_stray_agents(self.workdir / "workspaces")


def _planned_crash(log: Path) -> float | None:
    """When a worker that died of SIGKILL killed itself for the fault pr_crash (the time
    its log line gives), else None."""
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(PR_CRASH_MARK):
                fields = dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)
                with contextlib.suppress(KeyError, ValueError):
                    return float(fields["at"])
                return time.time()
    return None


def _continue(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def end_stray_agents(workspaces: Path) -> int:
    """SIGKILL the chaos agents still alive in this harness's workspaces: orphans of
    killed workers, which a sandbox never leaves (its PID namespace dies with the
    worker) but unsandboxed agents may, until they notice. Found by their working
    directory, as seen from the host: a pid an agent could report from inside its
    PID namespace means nothing here, and other harnesses' agents are not ours."""
    root = str(workspaces.resolve())
    ended = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            cwd = os.readlink(f"/proc/{entry}/cwd").removesuffix(" (deleted)")
            if not cwd.startswith(root + "/"):
                continue
            if b"chaos/agent.py" in Path(f"/proc/{entry}/cmdline").read_bytes():
                os.kill(int(entry), signal.SIGKILL)
                ended += 1
    return ended


def remove_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
