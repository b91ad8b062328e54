"""How every listing prints: ``--output table|plain|json`` (``--json`` is short for
``--output json``). ``table`` is for people: it fits the terminal by dropping the
columns that matter least and cutting long cells with an ellipsis, never an id.
``plain`` is for scripts and pipes (the default when stdout is not a terminal): a
header line, then one record per line, fields separated by tabs, so ``grep``,
``cut -f`` and ``awk -F'\\t'`` work. ``json`` is one JSON document."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
from rich import box
from rich.console import Console
from rich.table import Table

F = TypeVar("F", bound=Callable[..., Any])
OUTPUTS = ("table", "plain", "json")


def output_options(fn: F) -> F:
    """``--output`` and its short form ``--json`` (a listing's two options)."""
    fn = click.option("--json", "as_json", is_flag=True,
                      help="Short for --output json: exactly one JSON document on stdout.")(fn)
    return click.option(
        "--output", "-o", "output", type=click.Choice(OUTPUTS, case_sensitive=False),
        default=None, help="table (for people; the default on a terminal), plain (a header "
        "line, then one tab-separated record per line; the default when stdout is not a "
        "terminal) or json.")(fn)


def chosen_output(output: str | None, as_json: bool) -> str:
    """The format asked for, else table on a terminal and plain otherwise."""
    if as_json:
        if output not in (None, "json"):
            raise click.UsageError(f"--json and --output {output} contradict each other")
        return "json"
    if output is not None:
        return output.lower()
    return "table" if sys.stdout.isatty() else "plain"


@dataclass(frozen=True)
class Col:
    """One column: its header, its value for plain output (full) and for the table
    (``short``, else the same), and when it goes if the table is too wide: ``drop``
    0 never, higher first. An ``ident`` column is never cut nor wrapped."""

    header: str
    value: Callable[[Any], Any]
    short: Callable[[Any], Any] | None = None
    drop: int = 0
    ident: bool = False
    right: bool = False
    key: str | None = None  # plain output's header (default: the table's, with _)

    @property
    def name(self) -> str:
        return self.key or self.header.replace(" ", "_")


def cell(value: Any) -> str:
    """A value as one field of plain output: no tab or newline inside, nothing for
    None (never Python's ``None``)."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="milliseconds")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value)
    return " ".join(str(value).split()) if any(c in str(value) for c in "\t\r\n") \
        else str(value)


def print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def render(rows: Sequence[Any], columns: Sequence[Col], output: str, *,
           json_document: Callable[[], Any], empty: str, console: Console | None = None,
           ) -> None:
    """Print ``rows`` as ``output`` asks. An empty listing says ``empty`` (a table;
    plain prints its header and says it on stderr, so a pipe counts nothing)."""
    if output == "json":
        print_json(json_document())
        return
    if output == "plain":
        lines = ["\t".join(c.name for c in columns)]
        lines += ["\t".join(cell(c.value(r)) for c in columns) for r in rows]
        sys.stdout.write("\n".join(lines) + "\n")
        if not rows:
            sys.stderr.write(f"{empty}\n")
        return
    console = console or Console()
    if not rows:
        console.print(empty, markup=False, highlight=False)
        return
    console.print(fitted_table(rows, columns, console.width))


def fitted_table(rows: Sequence[Any], columns: Sequence[Col], width: int) -> Table:
    """A table at most ``width`` wide: columns dropped (highest ``drop`` first) while
    what is left cannot fit, then the widest cells cut with an ellipsis; ids whole."""
    texts = [[_short(c, r) for c in columns] for r in rows]
    natural = [max([len(c.header), *(len(t[i]) for t in texts)]) for i, c in enumerate(columns)]
    keep = list(range(len(columns)))

    def needed(indexes: list[int]) -> int:
        # Each column: its text and one space each side; the table's two edges.
        return sum(_floor(columns[i], natural[i]) + 3 for i in indexes) + 1

    for i in sorted((i for i, c in enumerate(columns) if c.drop),
                    key=lambda i: (-columns[i].drop, -i)):
        if needed(keep) <= width:
            break
        keep.remove(i)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, expand=False)
    for i in keep:
        c = columns[i]
        if c.ident:
            table.add_column(c.header, no_wrap=True, min_width=natural[i])
        else:
            table.add_column(c.header, no_wrap=True, overflow="ellipsis",
                             justify="right" if c.right else "left",
                             min_width=min(natural[i], max(len(c.header), 3)))
    for t in texts:
        table.add_row(*(t[i] for i in keep))
    return table


def _floor(column: Col, natural: int) -> int:
    """The narrowest a column may become: an id never shrinks; others down to their
    header (a cell is cut with an ellipsis)."""
    return natural if column.ident else min(natural, max(len(column.header), 3))


def _short(column: Col, row: Any) -> str:
    value = (column.short or column.value)(row)
    return cell(value) if not isinstance(value, datetime) else local_short(value)


# --- times ------------------------------------------------------------------------------


def local_short(moment: datetime | None) -> str:
    """A point in time for a table cell: local time, the date only when not today."""
    if moment is None:
        return ""
    local = moment.astimezone()
    if local.date() == datetime.now().astimezone().date():
        return local.strftime("%H:%M:%S")
    return local.strftime("%Y-%m-%d %H:%M")


def full_time(moment: datetime | None, *, utc: bool = False) -> str:
    """A whole point in time, in the local time zone (or UTC), with its offset."""
    if moment is None:
        return "-"
    shown = moment.astimezone(UTC) if utc else moment.astimezone()
    return shown.isoformat(sep=" ", timespec="seconds")


def parse_time(value: Any) -> datetime | None:
    """An ISO 8601 text (as the JSON documents hold) or a datetime, as a datetime."""
    if value is None or isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None
