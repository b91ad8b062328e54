"""Optional dependencies: imported where they are used, refused with an install hint.

runlane on SQLite with local repositories needs neither psycopg (PostgreSQL) nor httpx
(the GitHub code host; ``runlane top --url``), nor the web stack of ``runlane serve``.
They are extras of the package (``pip install 'runlane[postgres]'``, ``'runlane[github]'``,
``'runlane[remote]'``, ``'runlane[server]'``); a
feature that needs a missing one raises ``MissingDependency`` (exit 2, one line naming
the extra), never an ImportError's traceback.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from runlane.errors import RunlaneError

# The module each extra provides, and the extra's name.
EXTRAS = {"psycopg": "postgres", "httpx": "github"}


class MissingDependency(RunlaneError):
    """A feature needs a package that is not installed (an extra of runlane)."""

    exit_code = 2

    def __init__(self, module: str, extra: str, feature: str) -> None:
        super().__init__(f"{feature} needs the Python package {module!r}, which is not "
                         f"installed: pip install 'runlane[{extra}]'")
        self.module = module
        self.extra = extra


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """``module`` imported, or ``MissingDependency`` naming the extra that installs it
    (``extra``, else the one ``EXTRAS`` names).
    Only a missing top-level package is turned into the hint: a broken install (an
    ImportError from inside the package) is left to surface as it is."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.split(".")[0]:
            raise
        raise MissingDependency(module, extra or EXTRAS[module.split(".")[0]], feature) from None
