"""MkDocs hook: the tables generated from the code, so the site cannot drift from it.

A page holds a marker line (``<!-- generated: NAME -->``); the build replaces it with
the table NAME renders from the source: ``transitions`` from
``runlane.domain.states.TRANSITIONS``, ``settings`` from ``runlane.settings.Settings``.
tests/test_docs.py builds the site and checks both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- generated: (\w+) -->$", re.MULTILINE)


def transitions_table() -> str:
    """Every status, where it may go next, and what kind of status it is."""
    from runlane.domain.states import INITIAL, LEASED, TERMINAL, TRANSITIONS, WAITING

    def kind(status: Any) -> str:
        kinds = []
        if status in INITIAL:
            kinds.append("initial")
        if status in WAITING:
            kinds.append("waiting")
        if status in LEASED:
            kinds.append("leased (a stage)")
        if status in TERMINAL:
            kinds.append("terminal")
        return ", ".join(kinds) or "transient"

    rows = ["| status | kind | may go to |", "| --- | --- | --- |"]
    for status, targets in TRANSITIONS.items():
        ordered = [t for t in TRANSITIONS if t in targets]  # the enum's order
        goes = ", ".join(f"`{t.value}`" for t in ordered) or "nothing (final)"
        rows.append(f"| `{status.value}` | {kind(status)} | {goes} |")
    return "\n".join(rows)


def _default(field: Any) -> str:
    if field.default_factory is not None:
        # Evaluated as for a user without XDG_STATE_HOME: the site shows the
        # default, not the building machine's setting.
        saved = os.environ.pop("XDG_STATE_HOME", None)
        try:
            value = field.default_factory()
        finally:
            if saved is not None:
                os.environ["XDG_STATE_HOME"] = saved
        if isinstance(value, Path):
            home = str(Path.home())
            text = str(value)
            return f"`{'~' + text[len(home):] if text.startswith(home) else text}`"
        return f"`{value}`"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return "empty" if not value else f"`{','.join(map(str, value))}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    return f"`{value}`"


def _bounds(field: Any) -> str:
    parts = []
    for item in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            bound = getattr(item, attr, None)
            if bound is not None:
                shown = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
                parts.append(f"{sign} {shown:,}" if isinstance(shown, int) else f"{sign} {shown}")
    return ", ".join(parts)


def settings_table() -> str:
    """Each setting: its flag, environment variable, default and bounds."""
    from runlane.settings import Settings

    rows = ["| setting | flag / environment variable | default | allowed |",
            "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        choices = getattr(field.annotation, "__args__", None)
        allowed = _bounds(field)
        if name == "sandbox" and choices:
            allowed = " or ".join(f"`{c}`" for c in choices)
        rows.append(f"| `{name.upper()}` | `{flag}` / `RUNLANE_{name.upper()}` | "
                    f"{_default(field)} | {allowed} |")
    return "\n".join(rows)


TABLES: dict[str, Callable[[], str]] = {
    "transitions": transitions_table,
    "settings": settings_table,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ValueError(f"unknown generated table {name!r}")
        return TABLES[name]()

    return MARKER.sub(replace, markdown)
