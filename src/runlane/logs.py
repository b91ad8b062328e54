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
    """Used as a library, runlane logs to stderr at INFO, as the README says, not on
    stdout at every level (structlog's default), mixed into the program's own output.
    An application that configured structlog keeps its configuration, and one that
    configures it later replaces this one."""
    if not structlog.is_configured():
        configure_logging("INFO", json=False)
