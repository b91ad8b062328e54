"""What the commands of the ``runlane`` CLI share (cli.py and the cli_*.py modules it
registers): the console, the --json flag, the top-level options as given, the facade
over them, and how a run and a point in time are printed. Below every command module:
nothing here imports one of them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
from rich.console import Console

from runlane.api import Runlane
from runlane.settings import load_settings

out = Console()
F = TypeVar("F", bound=Callable[..., Any])


def json_flag(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print exactly one JSON document on stdout.")(fn)


class State:
    database_url: str | None = None
    settings: dict[str, str] = {}  # the other settings given as flags, by name
    logging: dict[str, str] = {}  # --log-level and --log-format as given (for up's workers)


state = State()

# Pooled PostgreSQL connections of `maintain`'s (and `up`'s) maintenance services: four
# threads, each pass a few short transactions; the scheduler's LISTEN is one more.
MAINTENANCE_CONNECTIONS = 2


def _lane(check_schema: bool = True, connections: int | None = None) -> Runlane:
    """The facade over the settings given; ``connections`` bounds its pool (Runlane)."""
    lane = Runlane(settings=load_settings(database_url=state.database_url, **state.settings),
                   connections=connections)
    if check_schema:
        lane.check_schema()
    return lane


def _iso(value: Any) -> Any:
    if isinstance(value, float):
        return datetime.fromtimestamp(value, UTC).isoformat(timespec="milliseconds")
    return value


# Fields holding a point in time (epoch seconds in the database) that are not named
# *_at: an event's `at`, an admission's `retry_after`.
TIME_FIELDS = frozenset({"at", "retry_after"})


def _times(row: dict[str, Any]) -> dict[str, Any]:
    """Every point in time of ``row`` as ISO 8601 UTC, one format for all of them."""
    return {k: (_iso(v) if k.endswith("_at") or k in TIME_FIELDS else v)
            for k, v in row.items()}


RUN_FIELDS = ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
              "attempt_count", "max_attempts", "fencing_token", "visible_at", "created_at",
              "updated_at", "ended_at", "reason_code", "message", "outcome", "cost_usd",
              "estimated_cost_usd", "user_id", "risk_class", "route_key", "policy_version")


def run_document(run: dict[str, Any]) -> dict[str, Any]:
    return _times({k: run.get(k) for k in RUN_FIELDS})


def _stop_on_sigterm() -> threading.Event:
    """An event SIGTERM sets (a deploy's or a supervisor's stop), instead of killing the
    process wherever it is."""
    import signal as signals

    stop = threading.Event()
    signals.signal(signals.SIGTERM, lambda *_: stop.set())
    return stop


def _start_maintenance(lane: Runlane, stop: threading.Event) -> list[threading.Thread]:
    """The maintenance services, each on a thread, while this node is the database's
    maintenance leader (services/leader.py), until ``stop`` is set."""
    leader = lane.maintenance_leader()
    thread = threading.Thread(target=leader.run_forever, args=(stop,), daemon=True,
                              name="runlane-maintenance-leader")
    thread.start()
    return [thread]


def _join(threads: list[threading.Thread]) -> None:
    """Let each service finish the pass it is in: a pass is a few short transactions,
    and one cut short by the exit would only be redone by the next, but stopping
    between passes leaves nothing to redo and the logs tell the truth."""
    for t in threads:
        t.join()
