"""The agent's environment: built from an allowlist, never the worker's whole one.

The worker's environment holds what runlane runs on: ``RUNLANE_DATABASE_URL`` (with
its password), the code host's token, and whatever else its operator exported (cloud
credentials, other services' keys). An agent gets only what it needs to run
programs (``PATH``, the locale, the time zone, the terminal), the variables an
operator names in ``SANDBOX_PASS_ENV``, and the contract's per-run ``RUNLANE_*``
variables, which the runner adds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Passed as they are in the worker's environment (plus every LC_* variable).
ALLOWED = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "COLORTERM", "NO_COLOR", "USER", "LOGNAME")
ALLOWED_PREFIXES = ("LC_",)
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class NotPassable(ValueError):
    """A variable name that may not be passed to agents."""


def check_pass_name(name: str) -> str:
    """A name ``SANDBOX_PASS_ENV`` (or a policy's ``secrets``) may give; raises
    NotPassable. ``RUNLANE_*`` are runlane's own settings (the database URL, the code
    host's token): never an agent's."""
    if not NAME.match(name):
        raise NotPassable(f"{name!r} is not an environment variable name")
    if name.upper().startswith("RUNLANE_"):
        raise NotPassable(f"{name}: RUNLANE_* variables are runlane's own settings "
                          "and are never given to agents")
    return name


def code_host_token(worker_env: Mapping[str, str]) -> str | None:
    """The code host token runlane itself uses (codehost/factory.py)."""
    return worker_env.get("RUNLANE_GITHUB_TOKEN") or worker_env.get("GITHUB_TOKEN") or None


def agent_environment(worker_env: Mapping[str, str], pass_env: Iterable[str] = ()
                      ) -> dict[str, str]:
    """What the agent inherits from the worker: the allowlist and ``pass_env``, never a
    ``RUNLANE_*`` variable nor the code host's token runlane uses (``GITHUB_TOKEN``
    named in ``pass_env`` passes only when it is not that token). With those an agent
    could write runs, or push and open pull requests itself, outside the fencing tokens
    and the side-effect ledger. The runner adds ``HOME`` and the contract's per-run
    ``RUNLANE_*`` variables."""
    token = code_host_token(worker_env)
    wanted = set(ALLOWED) | set(pass_env)
    return {k: v for k, v in worker_env.items()
            if (k in wanted or k.startswith(ALLOWED_PREFIXES))
            and not k.upper().startswith("RUNLANE_") and not (token is not None and v == token)}
