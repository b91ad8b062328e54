"""What every named statement (the ``*_sql`` modules of this package) is rendered with.

Statements are written once with two placeholders filled per dialect:

* ``{now}``: the pinned ``:now`` if the caller passed one, else the database clock;
* ``{lock}``: ``FOR UPDATE … SKIP LOCKED`` on PostgreSQL; nothing on SQLite, where
  every transaction is ``BEGIN IMMEDIATE`` and so already holds the write lock.

Status writes are compare-and-set: their ``status IN :sources`` guard is computed
from the transition table by the store, never written by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import String, Table, TextClause, bindparam, text

NOW = {
    "postgresql": (
        "COALESCE(CAST(:now AS double precision), "
        "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision))"
    ),
    "sqlite": "COALESCE(:now, (julianday('now') - 2440587.5) * 86400.0)",
}
LOCK_SKIP = {"postgresql": "FOR UPDATE OF {alias} SKIP LOCKED", "sqlite": ""}
LOCK_SHARE_SKIP = {"postgresql": "FOR SHARE OF {alias} SKIP LOCKED", "sqlite": ""}
# Changes with every update of the row: PostgreSQL's xmin (the writing transaction);
# SQLite has one writer, whose transaction holds the file from BEGIN IMMEDIATE.
ROW_VERSION = {"postgresql": "CAST({alias}.xmin AS text)", "sqlite": "''"}
GREATEST = {"postgresql": "GREATEST", "sqlite": "MAX"}
LOCK_WAIT = {"postgresql": "FOR UPDATE OF {alias}", "sqlite": ""}
LOCK_SHARE = {"postgresql": "FOR SHARE OF {alias}", "sqlite": ""}
# The scopes of an ended attempt's slots that have a counter, NULL when none has: an
# attempt holds every scope of its run (domain.policy.run_scopes), and one without a
# counter is not limited, nothing to give back (a run under no limit ends in the one
# statement that ends it). A counter made after this statement's snapshot, which
# counted the attempt, keeps its slot until the reconciler's recount: one too many
# here. (A counter made while a claim commits can count one too few: the known gap of
# a policy that adds a limit, docs/architecture.md.)
# With no counter at all (no policy limits anything), not even the scopes are read:
# the uncorrelated EXISTS is evaluated once per statement.
COUNTED_SCOPES = {
    "postgresql": """CASE WHEN EXISTS (SELECT 1 FROM limit_counters) THEN (
        SELECT json_agg(s.scope) FROM json_array_elements_text({col}) AS s(scope)
        WHERE EXISTS (SELECT 1 FROM limit_counters c WHERE c.scope = s.scope)) END""",
    "sqlite": """CASE WHEN EXISTS (SELECT 1 FROM limit_counters) THEN (
        SELECT CASE WHEN COUNT(*) > 0 THEN json_group_array(s.value) END
        FROM json_each({col}) AS s
        WHERE EXISTS (SELECT 1 FROM limit_counters c WHERE c.scope = s.value)) END""",
}

# --- batched completion ---------------------------------------------------------------
#
# A batch of leases as rows ``b(run_id, token, source, attempt_no, actor)``: the same
# statement text for any batch size (one prepared statement). ``source`` is the status
# each lease last moved its run to. PostgreSQL: ``unnest`` of five arrays (``:run_ids``,
# ``:tokens``, ``:sources``, ``:attempt_nos``, ``:actors``), whose row estimate is the
# arrays' length (``json_to_recordset`` is estimated at 100 rows and made the planner
# hash-join a sequential scan of runs and attempts); SQLite: one JSON array of
# [run_id, token, source, attempt_no, actor] (``:leases``).
LEASE_BATCH = {
    "postgresql": ("unnest(CAST(:run_ids AS text[]), CAST(:tokens AS bigint[]), "
                   "CAST(:sources AS text[]), CAST(:attempt_nos AS integer[]), "
                   "CAST(:actors AS text[])) AS b(run_id, token, source, attempt_no, actor)"),
    "sqlite": ("(SELECT json_extract(value, '$[0]') AS run_id, "
               "json_extract(value, '$[1]') AS token, "
               "json_extract(value, '$[2]') AS source, "
               "json_extract(value, '$[3]') AS attempt_no, "
               "json_extract(value, '$[4]') AS actor FROM json_each(:leases)) AS b"),
}


# --- bulk inserts (PostgreSQL) -------------------------------------------------------


def bulk_insert_json(table: Table, columns: list[str], suffix: str = "") -> str:
    """``INSERT INTO t (cols) SELECT cols FROM json_populate_recordset(NULL::t, :rows)``:
    the rows as one JSON parameter, the same short text for any number of rows. The
    client's cost is one ``json.dumps`` (C) instead of dumping and quoting one array
    per column (psycopg's text array dumper ran a regex per element: a third of a
    1,000-run submit); the server maps keys to columns by name, with their types."""
    names = ", ".join(columns)
    return (f"INSERT INTO {table.name} ({names}) SELECT {names} "
            f"FROM json_populate_recordset(NULL::{table.name}, CAST(:rows AS json)) {suffix}")


# A "-- " comment: a whole line, or the end of one where no quote follows (so never
# inside a literal).
_COMMENT = re.compile(r"^\s*--\s[^\n]*$|\s+--\s[^'\n]*$", re.M)


def compact(sql: str) -> str:
    """The statement as sent: without its comments and indentation. psycopg caches
    its parsing of a statement only up to 4,096 characters; the comments are for the
    reader of this file."""
    lines = (line.strip() for line in _COMMENT.sub("", sql).splitlines())
    return "\n".join(line for line in lines if line)


@dataclass(frozen=True)
class Statements:
    """The statements above, rendered for one dialect."""

    dialect: str

    def render(self, sql: str, *expanding: str) -> TextClause:
        rendered = compact(sql).format(
            now=NOW[self.dialect],
            lock_r=LOCK_WAIT[self.dialect].format(alias="r"),
            lock_r_skip=LOCK_SKIP[self.dialect].format(alias="r"),
            lock_r_share=LOCK_SHARE[self.dialect].format(alias="r"),
            lock_a_skip=LOCK_SKIP[self.dialect].format(alias="a"),
            lock_l_skip=LOCK_SKIP[self.dialect].format(alias="l"),
            lock_c_share_skip=LOCK_SHARE_SKIP[self.dialect].format(alias="c"),
            row_version=ROW_VERSION[self.dialect].format(alias="l"),
            row_version_lanes=ROW_VERSION[self.dialect].format(alias="lanes"),
            lock_ra_skip=LOCK_SKIP[self.dialect].format(alias="r, a"),
            greatest=GREATEST[self.dialect],
            lease_batch=LEASE_BATCH[self.dialect],
            counted_limit_scopes=COUNTED_SCOPES[self.dialect].format(col="limit_scopes"),
            lock_for_update="FOR UPDATE" if self.dialect == "postgresql" else "",
        )
        clause = text(rendered)
        if expanding:
            clause = clause.bindparams(*(bindparam(name, expanding=True, type_=String())
                                         for name in expanding))
        return clause
