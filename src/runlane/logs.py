"""Structured logs on stderr: JSON lines (or the console format, for a person at a
terminal), every line carrying the ids bound by the caller (docs/tracing.md).

Keys are snake_case (``run_id``, ``fencing_token``): the seed's camelCase example
(``runId``) is written runlane's way, as in every JSON document runlane prints. A JSON
line starts with ``event``.

With ``capture_stdlib`` (the CLI) the standard library's records (SQLAlchemy, httpx,
uvicorn) go through the same processors and renderer (structlog's
ProcessorFormatter), with the name of their logger as ``logger``: one format on stderr.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

FORMATS = ("json", "console")
# Libraries whose INFO lines are every SQL statement, every HTTP request or the migration
# context of each schema check: shown from --log-level DEBUG only (their own DEBUG,
# result rows and wire bytes, never).
CHATTY = ("sqlalchemy", "alembic", "httpx", "httpcore", "urllib3")
_OURS = "_runlane_handler"  # marks the root handler configure_logging installed
# The filtering wrapper class configure_logging installed, and its level.
_installed: tuple[type, int] | None = None


class _Stderr:
    """sys.stderr for log lines, which a closed reader does not make fatal: a worker
    whose supervisor was killed (it read the worker's stderr) gets SIGTERM and must
    still drain and record STOPPED, writing lines no one reads. Once a write finds the
    pipe broken, lines go nowhere."""

    def __init__(self) -> None:
        self._broken = False

    def write(self, text: str) -> int:
        if self._broken:
            return len(text)
        try:
            return sys.stderr.write(text)
        except (BrokenPipeError, ValueError):  # ValueError: stderr closed
            self._broken = True
            return len(text)

    def flush(self) -> None:
        if not self._broken:
            try:
                sys.stderr.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True


def _event_first(_logger: Any, _name: str, event: MutableMapping[str, Any]
                 ) -> MutableMapping[str, Any]:
    return {"event": event.pop("event", None), **event}


def configure_logging(level: str = "INFO", json: bool = True, *,
                      capture_stdlib: bool = False) -> None:
    numeric = getattr(logging, level.upper())
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    # JSON lines carry a logged exception's traceback as a string ("exception");
    # the console renderer prints it itself.
    renderer: list[structlog.types.Processor] = (
        [structlog.processors.format_exc_info, _event_first, structlog.processors.JSONRenderer()]
        if json else [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    )
    global _installed
    wrapper = structlog.make_filtering_bound_logger(numeric)
    _installed = (wrapper, numeric)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            *renderer,
        ],
        wrapper_class=wrapper,
        # One write per line (a PrintLogger writes the newline apart): a line of the
        # standard library's handler never lands inside one of these.
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    if capture_stdlib:
        _capture_stdlib(numeric, timestamper, renderer)


def _capture_stdlib(level: int, timestamper: structlog.types.Processor,
                    renderer: list[structlog.types.Processor]) -> None:
    """The root logger's one handler (replacing an earlier one of ours) renders every
    record as runlane's own lines are rendered."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.contextvars.merge_contextvars,
                           structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
                           timestamper],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer])
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(formatter)
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.INFO if level <= logging.DEBUG
                                         else max(level, logging.WARNING))


def enabled_for(level: int, logger: Any) -> bool:
    """Whether ``logger`` (a structlog logger) writes lines at ``level``: read from the
    level configure_logging installed while its configuration stands (about 1 µs),
    else asked of the logger (about 8 µs on a lazy proxy, which builds a logger per
    call): for the lines of every run transition, looked at once per transaction."""
    ours = _installed
    if ours is not None and structlog.get_config()["wrapper_class"] is ours[0]:
        return level >= ours[1]
    return bool(logger.is_enabled_for(level))


def log_to_stderr_unless_configured() -> None:
    """Used as a library, runlane is quiet: only warnings and errors reach stderr (a
    program's own output is never mixed with runlane's INFO lines), never stdout
    (structlog's default). An application that configured structlog keeps its
    configuration; one that wants runlane's INFO lines calls
    ``runlane.logs.configure_logging("INFO")``. The standard library's logging is the
    application's: left alone."""
    if not structlog.is_configured():
        configure_logging("WARNING", json=False)
