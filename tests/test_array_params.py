"""Array parameters on PostgreSQL (``engine.array_literal_dumper()``): the fast path sends
every element quoted and escaped; whatever it is given, the server must read back
exactly the values sent."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from runlane.store.engine import array_literal_dumper, build_engine

AWKWARD = ["run-1", 'a "quoted" one', "back\\slash", "", "NULL", "null", " padded ",
           "{braces,comma}", "tab\there", "line\nbreak", "é ü 漢", None]


def test_arrays_round_trip_exactly(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL array parameters only")
    engine = build_engine(db_url)
    try:
        with engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            assert dbapi.adapters.get_dumper(list, "s") is array_literal_dumper()  # type: ignore[arg-type]
            row = conn.execute(text(
                "SELECT CAST(:texts AS text[]) AS texts, CAST(:ints AS bigint[]) AS ints, "
                "CAST(:floats AS double precision[]) AS floats, "
                "CAST(:nulls AS text[]) AS nulls, CAST(:empty AS integer[]) AS empty, "
                "CAST(:nested AS integer[]) AS nested"),
                {"texts": AWKWARD, "ints": [0, -7, None, 2**40], "floats": [1.5, float("-inf")],
                 "nulls": [None, None], "empty": [], "nested": [[1, 2], [3, 4]]}).one()
    finally:
        engine.dispose()
    assert row.texts == AWKWARD
    assert row.ints == [0, -7, None, 2**40]
    assert row.floats == [1.5, float("-inf")]  # not the fast path: psycopg's own
    assert (row.nulls, row.empty, row.nested) == ([None, None], [], [[1, 2], [3, 4]])
