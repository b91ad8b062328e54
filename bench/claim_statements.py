"""Statements per claim, counted with SQLAlchemy's ``before_cursor_execute`` event, on
each claim path (SQLite; PostgreSQL's one-statement claim; PostgreSQL's transaction),
for a policy without providers and, when this runlane has them, a run naming a
provider the policy does not limit and one under a provider limit (issue 29: provider
checks add no statement to a claim when the policy has none).

Run it on two checkouts to compare them (it only uses what both have)::

    .venv/bin/python bench/claim_statements.py
    PYTHONPATH=/path/to/other/src .venv/bin/python bench/claim_statements.py

Prints one Markdown table; writes nothing. Each count is of the second claim after a
policy is applied (the first one reads the policy and makes the counters).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, text

from runlane.domain.policy import Policy, parse_policy
from runlane.domain.tasks import TaskSpec, parse_task
from runlane.store import migrate
from runlane.store.engine import build_engine
from runlane.store.store import Store

LIMITS = "[concurrency]\nglobal_max_active = 50\n"
PROVIDERS = "[providers.openai]\nmax_active = 2\n"
HAS_PROVIDERS = "provider" in TaskSpec.model_fields and "providers" in Policy.model_fields


def one_claim(store: Store, policy: str, provider: str | None) -> list[str]:
    with store.engine.begin() as conn:  # each round starts from an empty queue
        conn.execute(text("UPDATE runs SET status = 'CANCELLED' WHERE status = 'QUEUED'"))
        conn.execute(text("UPDATE lanes SET queued_count = 0"))
    store.apply_policy(parse_policy(policy), source=hashlib.sha1(policy.encode()).hexdigest())
    fields: dict[str, Any] = {"provider": provider} if provider else {}
    store.submit([parse_task({"tenant": "t1", "repo": "/srv/git/app.git",
                              "prompt": f"run {i}", **fields}) for i in range(4)])
    store.complete(store.claim("warm", limit=1, lease_ttl=60)[0])
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    [lease] = store.claim("w1", limit=1, lease_ttl=60)
    event.remove(store.engine, "before_cursor_execute", count)
    store.complete(lease)
    return statements


def scenarios() -> list[tuple[str, str, str | None]]:
    rounds = [("no provider", LIMITS, None)]
    if HAS_PROVIDERS:
        rounds += [("a provider the policy does not limit", LIMITS, "openai"),
                   ("a provider limit", LIMITS + PROVIDERS, "openai")]
    return rounds


def measure(url: str, *, one_trip: bool) -> list[tuple[str, int, str]]:
    store = Store(url)
    if not one_trip:
        store._claim_in_one_trip = lambda *a, **k: None  # type: ignore[method-assign]
    out = []
    for name, policy, provider in scenarios():
        one_claim(store, policy, provider)  # the first claim after a new version
        statements = one_claim(store, policy, provider)
        digest = hashlib.sha256("\n".join(statements).encode()).hexdigest()[:12]
        out.append((name, len(statements), digest))
    store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default=os.environ.get(
        "RUNLANE_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    args = parser.parse_args()
    rows: list[tuple[str, str, int, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'claims.db'}"
        migrate.upgrade(build_engine(url))
        rows += [("SQLite", *r) for r in measure(url, one_trip=False)]
    name = f"bench_claim_statements_{os.getpid()}"
    admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = args.pg.rsplit("/", 1)[0] + f"/{name}"
        migrate.upgrade(build_engine(url))
        rows += [("PostgreSQL, one statement", *r) for r in measure(url, one_trip=True)]
        rows += [("PostgreSQL, transaction", *r) for r in measure(url, one_trip=False)]
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    print("| claim path | runs | statements per claim | texts (sha256) |")
    print("| --- | --- | --- | --- |")
    for path, scenario, count, digest in rows:
        print(f"| {path} | {scenario} | {count} | `{digest}` |")


if __name__ == "__main__":
    main()
