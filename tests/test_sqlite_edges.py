"""The embedded SQLite database as users open it from shells (a review, 2026-12-02):
real `runlane` processes on one file. Every test here failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import migrated_sqlite
from .support import one_line_error


def _runlane(url: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNLANE_")}
    return subprocess.run([sys.executable, "-m", "runlane", "--database-url", url, *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=60)


def test_a_read_only_uri_filename_reads_and_refuses_writes_clearly(tmp_path: Path) -> None:
    """SQLAlchemy's documented read-only URL, ``sqlite:///file:PATH?mode=ro&uri=true``
    (a dashboard, a script that must never write): the schema check took
    ``file:PATH`` for the file's path and refused every command with "no database at
    file:…: run `runlane db upgrade`" although the file was there."""
    path = tmp_path / "runlane.db"
    url = migrated_sqlite(path)
    submitted = _runlane(url, tmp_path, "submit", "--no-repo-check", "--tenant", "acme", "--repo",
                         "/srv/git/a.git", "--prompt", "p", "--json")
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["run_id"]

    read_only = f"sqlite:///file:{path}?mode=ro&uri=true"
    listed = _runlane(read_only, tmp_path, "runs", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["run_id"] for r in json.loads(listed.stdout)] == [run_id]
    shown = _runlane(read_only, tmp_path, "runs", "show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["run_id"] == run_id
    audited = _runlane(read_only, tmp_path, "audit", "--json")
    assert (audited.returncode, json.loads(audited.stdout)["ok"]) == (0, True), audited.stderr

    # Writing through it: one clear line, exit 4 (database), no traceback, naming the
    # URL as written (SQLAlchemy renders the ':' of 'file:' as '%3A').
    one_line_error(_runlane(read_only, tmp_path, "submit", "--no-repo-check",
                                                 "--tenant", "acme", "--repo",
                             "/srv/git/a.git", "--prompt", "q"), 4,
                    f"database {read_only}: attempt to write a readonly database")
    # A read-only URI of a file that is not there: the usual fix-it message, naming the
    # file, not the URI.
    missing = tmp_path / "missing.db"
    one_line_error(_runlane(f"sqlite:///file:{missing}?mode=ro&uri=true", tmp_path,
                             "runs", "list"), 4, f"no database at {missing}:")


def test_the_wal_file_is_cut_back_after_a_long_reader_let_it_grow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader holding a snapshot (a backup, a shell) keeps checkpoints from resetting
    the WAL, which grows with every write meanwhile. Once the reader is gone and a
    checkpoint copied it all, runlane's connections cut the file back to the limit
    (journal_size_limit); without one it kept its largest size on disk for good."""
    import sqlite3

    from runlane.store import engine as engine_module
    from runlane.store.engine import build_engine

    monkeypatch.setattr(engine_module, "SQLITE_WAL_SIZE_LIMIT_BYTES", 64 * 1024)
    path = tmp_path / "wal.db"
    engine = build_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE filler (body TEXT)")
        reader = sqlite3.connect(path)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM filler").fetchone()  # holds its snapshot
        for _ in range(40):
            with engine.begin() as conn:
                conn.exec_driver_sql("INSERT INTO filler VALUES (?)", ("x" * 50_000,))
        wal = path.with_name("wal.db-wal")
        grown = wal.stat().st_size
        assert grown > 1_000_000
        reader.rollback()
        reader.close()
        raw = engine.raw_connection()  # a pooled connection, outside a transaction
        try:
            raw.cursor().execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            raw.close()
        with engine.begin() as conn:  # the first write after a full checkpoint resets it
            conn.exec_driver_sql("INSERT INTO filler VALUES ('y')")
        assert wal.stat().st_size <= 64 * 1024, (grown, wal.stat().st_size)
    finally:
        engine.dispose()
