"""``runlane info``: what this runlane is and what it would use, from here: version,
database and its schema, every setting with where it came from, the sandbox, the
code hosts. Nothing is written; a database that is missing or down is reported, not
an error (this is where one looks first)."""

from __future__ import annotations

import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import click

from runlane.cli_common import json_flag, out, state
from runlane.cli_output import print_json


def _sources() -> dict[str, str]:
    """Where each setting came from: the documented order (a flag, else RUNLANE_<NAME>,
    else runlane.toml, else the default)."""
    from runlane.settings import CONFIG_FILE, Settings

    try:
        in_file = set(tomllib.loads(Path(CONFIG_FILE).read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        in_file = set()
    flags = set(state.settings) | ({"database_url"} if state.database_url else set())
    env = {k.upper() for k in os.environ}
    found = {}
    for name in Settings.model_fields:
        found[name] = ("flag" if name in flags else
                       f"RUNLANE_{name.upper()}" if f"RUNLANE_{name.upper()}" in env else
                       CONFIG_FILE if name in in_file else "default")
    return found


def _shown(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_shown(v) for v in value]
    return value


@click.command("info")
@json_flag
def info_command(as_json: bool) -> None:
    """Version, database and schema, every setting and its source, the sandbox and
    the code hosts: what the other commands would use, run from here."""
    from sqlalchemy.engine import make_url

    from runlane.api import Runlane, shown_url
    from runlane.codehost.factory import configured_hosts
    from runlane.settings import load_settings
    from runlane.store import migrate
    from runlane.version import __version__

    settings = load_settings(database_url=state.database_url, **state.settings)
    sources = _sources()
    lane = Runlane(settings=settings)
    try:
        url = shown_url(lane.store.engine.url)
        try:
            lane.check_schema()
            schema: dict[str, Any] = {"current": migrate.head_revision(), "ok": True}
        except Exception as exc:  # missing, down, behind or newer: said, not raised
            schema = {"current": None, "ok": False, "problem": str(exc)}
        schema["needed"] = migrate.head_revision()
        sandbox: dict[str, Any] = {"mode": settings.sandbox}
        if settings.sandbox == "off":
            sandbox.update(available=False, problem="SANDBOX=off: agents run unsandboxed")
        else:
            with tempfile.TemporaryDirectory(prefix="runlane-info-") as probe:
                try:
                    lane.sandbox(Path(probe), Path(probe)).check(
                        workspace_root=Path(probe), artifacts_root=Path(probe))
                    sandbox["available"] = True
                except Exception as exc:
                    sandbox.update(available=False, problem=str(exc))
    finally:
        lane.close()
    document: dict[str, Any] = {
        "version": __version__,
        "database": url,
        "schema": schema,
        "settings": {name: {"value": url if name == "database_url" else
                            shown_url(make_url(value)) if name == "listen_database_url"
                            and value else _shown(value),
                            "source": sources[name]}
                     for name, value in settings.model_dump().items()},
        "sandbox": sandbox,
        "code_hosts": configured_hosts(),
    }
    if as_json:
        print_json(document)
        return
    out.print(f"runlane {__version__}", highlight=False)
    out.print(f"database: {url}", soft_wrap=True, highlight=False, markup=False)
    out.print("schema: " + (f"{schema['current']} (up to date)" if schema["ok"]
                            else f"{schema['problem']}"), soft_wrap=True, highlight=False,
              markup=False)
    out.print("sandbox: " + (f"{sandbox['mode']} (works)" if sandbox.get("available")
                             else f"{sandbox['mode']}, unavailable: {sandbox['problem']}"),
              soft_wrap=True, highlight=False, markup=False)
    out.print("code hosts:", highlight=False)
    for host in document["code_hosts"]:
        out.print(f"  {host}", soft_wrap=True, highlight=False, markup=False)
    out.print("settings (value, source):", highlight=False)
    for name, entry in document["settings"].items():
        value = entry["value"]
        text = (",".join(map(str, value)) if isinstance(value, list) else
                "not set" if value is None else value)
        out.print(f"  {name.upper()} = {text}  ({entry['source']})", soft_wrap=True,
                  highlight=False, markup=False)
