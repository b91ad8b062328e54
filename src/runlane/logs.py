"""Structured JSON logs on stderr; every line carries the ids bound by the caller."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "INFO", json: bool = True) -> None:
    # JSON lines carry a logged exception's traceback as a string ("exception");
    # the console renderer prints it itself.
    renderer: list[structlog.types.Processor] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()] if json
        else [structlog.dev.ConsoleRenderer()]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def log_to_stderr_unless_configured() -> None:
    """Used as a library, runlane is quiet: only warnings and errors reach stderr (a
    program's own output is never mixed with runlane's INFO lines), never stdout
    (structlog's default). An application that configured structlog keeps its
    configuration; one that wants runlane's INFO lines calls
    ``runlane.logs.configure_logging("INFO")``."""
    if not structlog.is_configured():
        configure_logging("WARNING", json=False)
