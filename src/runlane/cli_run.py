"""Running a click command the way every runlane command runs: one clear line on
stderr for every error and an exit code that says its kind. Below ``runlane.cli`` and
``runlane.chaos.cli``, which both run their commands through it."""

from __future__ import annotations

import os
import sys

import click
from rich.console import Console
from sqlalchemy.exc import DBAPIError

from runlane.domain.policy import PolicyInvalid
from runlane.domain.tasks import TaskInvalid
from runlane.errors import RunlaneError


def run_command(command: click.Command, prog_name: str) -> None:
    """Run a click command: one clear line on stderr for every error, never a
    traceback; the exit code says which kind (2 bad input, 4 database, 70 internal)."""
    err = Console(stderr=True, soft_wrap=True)
    try:
        code = command.main(standalone_mode=False, prog_name=prog_name)
        sys.exit(code if isinstance(code, int) else 0)
    except click.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        err.print(f"error: {exc.format_message()}{hint}", markup=False, highlight=False)
        sys.exit(2)
    except click.Abort:
        sys.exit(130)
    except (TaskInvalid, PolicyInvalid) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)
    except RunlaneError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except DBAPIError as exc:
        err.print(f"error: database: {str(exc.orig).strip().splitlines()[0]}", markup=False,
                  highlight=False)
        sys.exit(4)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("RUNLANE_DEBUG"):
            raise
        err.print(f"internal error: {type(exc).__name__}: {exc} (set RUNLANE_DEBUG=1 for the "
                  "traceback)", markup=False, highlight=False)
        sys.exit(70)
