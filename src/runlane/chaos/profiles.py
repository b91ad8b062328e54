"""Profiles of the fault harness and the settings they give its processes."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runlane.errors import RunlaneError

FAULTS = ("kill", "stop", "terminate", "restart", "duplicate", "cancel", "agent", "pr_crash")
POSTGRES_ONLY = frozenset({"terminate", "restart"})


class ChaosInvalid(RunlaneError):
    exit_code = 2


@dataclass(frozen=True)
class ChaosConfig:
    profile: str
    engine: str  # postgresql | sqlite
    runs: int
    workers: int
    concurrency: int
    maintainers: int
    faults: frozenset[str]
    kill_every: float  # seconds between SIGKILLs of a worker (on average)
    stop_every: float  # seconds between SIGSTOPs of a worker
    terminate_every: float  # seconds between pg_terminate_backend rounds
    restarts: int  # PostgreSQL immediate restarts, spread over the run
    duplicate_every: float  # seconds between rounds of duplicate submits and wake-ups
    lease_ttl: float = 2.0
    heartbeat: float = 0.5
    reaper_interval: float = 0.5
    agent_timeout: float = 3.0  # the workers' --timeout-seconds (hanging agents end TIMEOUT)
    dwell: float = 1.0  # how long a worker lingers in a stage a task names
    # Unfinished runs the harness keeps submitted, per slot of the workers that can take
    # work now: below 1 a slot is about always free, so a recovered run's next claim
    # measures recovery, not queueing.
    backlog: float = 0.75
    max_seconds: float = 150.0  # stop waiting for the runs after this long
    stall_seconds: float = 20.0  # ... or after this long without any run changing state
    seed: int = 0
    database_url: str | None = None
    directory: Path | None = None
    keep: bool = False
    plant: str | None = None
    agent_sleep: float | None = None  # every agent works this long (the planted-bug tests)
    repos: int = 4
    # Workers and maintenance reach PostgreSQL through a PgBouncer in transaction
    # pooling mode (their LISTEN directly, LISTEN_DATABASE_URL).
    pgbouncer: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def slots(self) -> int:
        return self.workers * self.concurrency

    @property
    def stop_seconds(self) -> float:
        """How long a SIGSTOPped worker stays paused: past its lease."""
        return 1.5 * self.lease_ttl

    @property
    def reclaim_budget(self) -> float:
        return self.lease_ttl + self.reaper_interval + 1.0

    def worker_env(self) -> dict[str, str]:
        return {
            "RUNLANE_LEASE_TTL_SECONDS": f"{self.lease_ttl:g}",
            "RUNLANE_HEARTBEAT_SECONDS": f"{self.heartbeat:g}",
            "RUNLANE_REAPER_INTERVAL_SECONDS": f"{self.reaper_interval:g}",
            # A short backoff: the death -> reclaim figure measures recovery, not policy.
            "RUNLANE_RETRY_BASE_SECONDS": "0.01",
            "RUNLANE_RETRY_MAX_SECONDS": "0.05",
            "RUNLANE_AGENT_TERM_GRACE_SECONDS": "0.5",
            "RUNLANE_DRAIN_GRACE_SECONDS": "2",
            "RUNLANE_MAX_ATTEMPT_SECONDS": "60",
            # Half the lease: a worker paused inside a transaction loses its session
            # (and its row locks) before its leases expire (defaults: lease 60 s, this 5 s).
            "RUNLANE_IDLE_IN_TRANSACTION_TIMEOUT_SECONDS": f"{self.lease_ttl / 2:g}",
        }


_ALL = frozenset(FAULTS)
PROFILES: dict[str, ChaosConfig] = {
    # CI: every fault on PostgreSQL, within three minutes.
    "short": ChaosConfig(profile="short", engine="postgresql", runs=300, workers=4,
                         concurrency=4, maintainers=2, faults=_ALL, kill_every=6.0,
                         stop_every=12.0, terminate_every=4.0, restarts=1,
                         duplicate_every=1.0, max_seconds=165.0),
    # docs/reliability.md: the long run.
    "long": ChaosConfig(profile="long", engine="postgresql", runs=2000, workers=8,
                        concurrency=2, maintainers=2, faults=_ALL, kill_every=2.0,
                        stop_every=10.0, terminate_every=5.0, restarts=2,
                        duplicate_every=1.0, max_seconds=1800.0, stall_seconds=30.0),
    # Eight worker processes on one SQLite file (about 90 s; 130 s at load average 14,
    # so it may wait longer than the PostgreSQL profile's three-minute bound).
    "sqlite": ChaosConfig(profile="sqlite", engine="sqlite", runs=200, workers=8,
                          concurrency=1, maintainers=1, faults=_ALL - POSTGRES_ONLY,
                          kill_every=6.0, stop_every=12.0, terminate_every=0.0, restarts=0,
                          duplicate_every=1.0, lease_ttl=3.0, max_seconds=240.0),
}


def parse_faults(value: str | None, default: frozenset[str]) -> frozenset[str]:
    if value is None or value == "all":
        return default if value is None else _ALL
    if value == "none":
        return frozenset()
    names = {v.strip() for v in value.split(",") if v.strip()}
    unknown = sorted(names - _ALL)
    if unknown:
        raise ChaosInvalid(f"--faults: unknown fault {unknown[0]!r}; known: "
                           f"{', '.join(FAULTS)}, or all, none")
    return frozenset(names)


def build_config(profile: str, *, seed: int, engine: str | None = None,
                 faults: str | None = None, database_url: str | None = None,
                 **overrides: Any) -> ChaosConfig:
    """A profile with the options given on the command line applied and checked."""
    if profile not in PROFILES:
        raise ChaosInvalid(f"--profile: unknown profile {profile!r}; one of "
                           f"{', '.join(PROFILES)}")
    base = PROFILES[profile]
    if database_url is not None:
        url_engine = "sqlite" if database_url.startswith("sqlite") else "postgresql"
        if engine is not None and engine != url_engine:
            raise ChaosInvalid(f"--engine {engine} does not match --database-url")
        engine = url_engine
    engine = engine or base.engine
    if engine == "sqlite" and base.engine != "sqlite":
        base = replace(PROFILES["sqlite"], profile=profile)
    explicit = faults is not None and faults not in ("all",)
    chosen = parse_faults(faults, base.faults)
    notes: list[str] = []
    if engine == "sqlite" and chosen & POSTGRES_ONLY:
        if explicit:
            raise ChaosInvalid("--faults: terminate and restart need PostgreSQL")
        chosen -= POSTGRES_ONLY
    if database_url is not None and engine == "postgresql" and "restart" in chosen:
        if explicit:
            raise ChaosInvalid("--faults restart: the harness restarts only its private "
                               "cluster; leave out --database-url")
        chosen -= {"restart"}
        notes.append("restart left out: the database was given with --database-url")
    given = {k: v for k, v in overrides.items() if v is not None}
    config = replace(base, engine=engine, faults=chosen, seed=seed,
                     database_url=database_url, notes=tuple(notes), **given)
    if config.agent_sleep is not None:  # a slow agent must not run into the timeout
        config = replace(config, agent_timeout=max(config.agent_timeout,
                                                   config.agent_sleep + 3.0))
    _validate(config)
    return config


def _validate(c: ChaosConfig) -> None:
    if c.pgbouncer and c.engine != "postgresql":
        raise ChaosInvalid("--pgbouncer needs PostgreSQL")
    if c.runs < 1 or c.workers < 1 or c.concurrency < 1:
        raise ChaosInvalid("--runs, --workers and --concurrency must be at least 1")
    if c.heartbeat * 3 > c.lease_ttl:
        raise ChaosInvalid("--heartbeat must be at most a third of --lease-ttl")
    if c.plant is not None and c.plant not in ("no_fencing", "no_lease_expiry"):
        raise ChaosInvalid(f"--plant: unknown planted bug {c.plant!r}")
