"""Settings: a flag, else ``RUNLANE_<NAME>``, else ``runlane.toml``, else the default."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from runlane.domain.retry import DEFAULT_MAX_UNCHARGED_RELEASES, RetryPolicy
from runlane.errors import RunlaneError
from runlane.store.engine import (
    IDLE_IN_TRANSACTION_TIMEOUT_SECONDS,
    DatabaseUrlInvalid,
    dialect_of,
    pooler_of,
)

CONFIG_FILE = "runlane.toml"


class SettingsInvalid(RunlaneError):
    exit_code = 2


# The longest duration a setting may give, in seconds (a year): longer ones are
# typos, and past ~9e9 s a thread cannot wait that long (OverflowError in the
# maintenance and heartbeat threads, which died while the process ran on).
MAX_SECONDS = 365 * 24 * 3600.0


def state_dir() -> Path:
    """runlane's own directory for this user, whatever the current directory:
    ``$XDG_STATE_HOME/runlane``, else ``~/.local/state/runlane``. (A fixed directory
    under /tmp could be made first by another user, who then owned every clone.)
    Without a home directory: ``<tmp>/runlane-<uid>``, which the worker's owner check
    refuses if another user made it."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(state):  # the XDG spec: a relative path is ignored
        return Path(state) / "runlane"
    try:
        return Path.home() / ".local" / "state" / "runlane"
    except (RuntimeError, KeyError):
        return Path(tempfile.gettempdir()) / f"runlane-{os.geteuid()}"


def default_workspace_dir() -> Path:
    """The worker's clones: ``<state_dir>/workspaces``."""
    return state_dir() / "workspaces"


def default_artifacts_dir() -> Path:
    """Each attempt's logs and files: ``<state_dir>/artifacts``."""
    return state_dir() / "artifacts"


def default_database_url() -> str:
    """SQLite in ``<state_dir>/runlane.db``: the same database from any directory."""
    return f"sqlite:///{state_dir() / 'runlane.db'}"


def absolute_sqlite_url(url: str) -> str:
    """A SQLite URL whose file is a relative path, with the path made absolute (once,
    here: every process and every later chdir then means the same file). Other URLs,
    in-memory and URI-filename databases are returned as given."""
    if not url.startswith("sqlite:///") or url.startswith("sqlite:////"):
        return url
    database, sep, query = url[len("sqlite:///"):].partition("?")
    if not database or database == ":memory:" or database.startswith("file:"):
        return url
    return f"sqlite:///{Path(database).expanduser().absolute()}{sep}{query}"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="RUNLANE_", toml_file=CONFIG_FILE, extra="forbid", case_sensitive=False,
        allow_inf_nan=False,
    )

    database_url: str = Field(default_factory=default_database_url)
    # PostgreSQL: where LISTEN connects when DATABASE_URL goes through a transaction
    # pooler (`?pooler=transaction`), which cannot keep a session listening: the server
    # itself. Unset there, workers and the scheduler poll (one warning). store/wakeup.py
    listen_database_url: str | None = None
    lease_ttl_seconds: float = Field(60.0, gt=0, le=MAX_SECONDS)
    heartbeat_seconds: float = Field(10.0, gt=0, le=MAX_SECONDS)
    retry_base_seconds: float = Field(30.0, ge=0, le=MAX_SECONDS)
    retry_max_seconds: float = Field(1800.0, ge=0, le=MAX_SECONDS)
    max_attempts: int = Field(3, ge=1, le=100)
    reaper_interval_seconds: float = Field(5.0, gt=0, le=MAX_SECONDS)
    # Extensions to the contract's table (documented in the README).
    payload_cap_bytes: int = Field(4 * 1024 * 1024, gt=0)
    max_attempt_seconds: float = Field(7200.0, gt=0, le=MAX_SECONDS)
    # Finished runs older than this are pruned by `runlane maintain`; 0 keeps them forever.
    retention_days: float = Field(30.0, ge=0)
    max_run_seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)
    max_run_cost_usd: float | None = Field(None, ge=0)
    workspace_dir: Path = Field(default_factory=default_workspace_dir)
    artifacts_dir: Path = Field(default_factory=default_artifacts_dir)
    drain_grace_seconds: float = Field(30.0, ge=0, le=MAX_SECONDS)
    # Sandboxes one worker process may have at once (its host's capacity): the worker
    # runs at most min(concurrency, sandbox_slots) attempts, each in its sandbox.
    # Unset: no bound beyond --concurrency.
    sandbox_slots: int | None = Field(None, ge=1, le=1000)
    agent_term_grace_seconds: float = Field(10.0, ge=0, le=MAX_SECONDS)
    # PostgreSQL ends a session idle inside a transaction this long (a frozen process
    # holding row locks); 0 never does. See store/engine.py.
    idle_in_transaction_timeout_seconds: float = Field(
        IDLE_IN_TRANSACTION_TIMEOUT_SECONDS, ge=0, le=MAX_SECONDS)
    # Releases of one run not charged against its attempts (drain, local lease
    # deadline); the next one is charged (LEASE_RELEASED_OVER_CAP). 0 charges every one.
    max_uncharged_releases: int = Field(DEFAULT_MAX_UNCHARGED_RELEASES, ge=0, le=1000)
    # The sandbox of agent and verify commands (runlane.sandbox, docs/sandbox.md).
    # A list setting is a TOML array, or in a flag or RUNLANE_* variable a string:
    # paths separated by ":" (as PATH), names by ",".
    sandbox: Literal["bwrap", "off"] = "bwrap"
    sandbox_read_only_paths: Annotated[tuple[Path, ...], NoDecode] = ()
    sandbox_pass_env: Annotated[tuple[str, ...], NoDecode] = ()
    # How often `runlane serve`'s event stream looks at the event table without a
    # wake-up: SQLite's only wake-up; on PostgreSQL, besides LISTEN/NOTIFY, what
    # delivers events a long transaction held back (docs/http-api.md).
    events_poll_seconds: float = Field(0.5, gt=0, le=60)
    # SQLite's change signal (store/wakeup.py): how often a worker and the event stream
    # read PRAGMA data_version to notice another process's commit (a submit, a cancel).
    # A read of shared memory, no write: an idle worker's whole cost is about 0.1% of a
    # core at the default (docs/benchmarks.md). No effect on PostgreSQL (LISTEN/NOTIFY).
    change_poll_seconds: float = Field(0.05, ge=0.005, le=10)
    # An idle worker's poll (1 s after work) grows fourfold after each look that found
    # nothing, up to this, while its wake-ups work (LISTEN on PostgreSQL, the change signal on
    # SQLite); without them it stays at 1 s. A backoff a look saw still ends on time.
    idle_poll_max_seconds: float = Field(20.0, ge=1, le=300)
    # Metrics (docs/metrics.md): off, nothing is counted (a benchmark's baseline); the
    # database's gauges are read at most once per METRICS_CACHE_SECONDS whatever the
    # scrapers; `--metrics-port` listens on METRICS_HOST (unauthenticated: keep it local
    # or on a network only the scraper reaches).
    metrics: bool = True
    metrics_cache_seconds: float = Field(5.0, ge=0, le=3600)
    metrics_host: str = "127.0.0.1"

    @field_validator("database_url")
    @classmethod
    def _absolute_database(cls, value: str) -> str:
        return absolute_sqlite_url(value)

    @field_validator("listen_database_url")
    @classmethod
    def _direct_postgres(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            dialect = dialect_of(value)
        except DatabaseUrlInvalid:
            dialect = None
        if dialect != "postgresql":
            raise ValueError("must be a postgresql:// URL (LISTEN is PostgreSQL's)")
        if pooler_of(value) is not None:
            raise ValueError("must reach PostgreSQL directly, not through a pooler")
        return value

    @field_validator("workspace_dir", "artifacts_dir")
    @classmethod
    def _absolute_dir(cls, value: Path) -> Path:
        return Path(value).expanduser().absolute()

    @field_validator("sandbox_read_only_paths", mode="before")
    @classmethod
    def _paths(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(":") if part.strip()]
        if isinstance(value, list | tuple):
            return tuple(Path(str(p)).expanduser().absolute() for p in value)
        return value

    @field_validator("sandbox_pass_env", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        from runlane.sandbox.environment import check_pass_name

        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, list | tuple):
            return tuple(check_pass_name(str(name)) for name in value)
        return value

    @model_validator(mode="after")
    def _heartbeat_well_inside_the_lease(self) -> Settings:
        """A lease must survive one failed heartbeat, and an agent told to stop when
        its lease is about to run out must be gone before it does."""
        ttl, beat, grace = (self.lease_ttl_seconds, self.heartbeat_seconds,
                            self.agent_term_grace_seconds)
        if beat * 3 > ttl:
            raise ValueError(
                f"HEARTBEAT_SECONDS ({beat:g}) must be at most a third of "
                f"LEASE_TTL_SECONDS ({ttl:g}), so that a lease survives a failed heartbeat")
        if grace >= ttl - 2 * beat:
            raise ValueError(
                f"AGENT_TERM_GRACE_SECONDS ({grace:g}) must be less than LEASE_TTL_SECONDS "
                f"minus two heartbeats ({ttl - 2 * beat:g}), so that an agent stopped for a "
                "lost lease is gone before another worker gets the run")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            base_seconds=self.retry_base_seconds,
            max_seconds=self.retry_max_seconds,
            max_attempts=self.max_attempts,
            max_total_run_seconds=self.max_run_seconds,
            max_cost_usd=self.max_run_cost_usd,
        )


def load_settings(**flags: Any) -> Settings:
    """Build settings from flags (None means "not given") over env, file and defaults."""
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(p) for p in first["loc"]).upper()
        if not name:  # a rule across settings
            raise SettingsInvalid(first["msg"].removeprefix("Value error, ")) from None
        source = f" (from {CONFIG_FILE} or RUNLANE_{name})" if name not in {
            k.upper() for k in given} else ""
        message = first["msg"].removeprefix("Value error, ")
        raise SettingsInvalid(f"setting {name}{source}: {message}") from None
    except Exception as exc:  # a malformed runlane.toml
        if Path(CONFIG_FILE).exists():
            raise SettingsInvalid(f"{CONFIG_FILE}: {exc}") from None
        raise
