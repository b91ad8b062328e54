"""The runs listing (``Runlane.runs_page``, ``runlane runs list``) on both engines:
keyset pages that neither skip nor repeat a run, also among runs sharing one
``created_at``; every filter; a tenant's principal sees its own runs only; the page is
an index walk with no sort on PostgreSQL (EXPLAIN)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from runlane.api import InvalidArgument, Runlane
from runlane.api_views import encode_cursor
from runlane.clock import ManualClock
from runlane.domain.access import Principal, Role
from runlane.models.listing import RunPage, RunSummary
from runlane.store import views_sql

from .conftest import T0
from .support import cli_env

ACME = Principal(role=Role.READ, tenant="acme", token_id="t-acme")
BETA = Principal(role=Role.SUBMIT, tenant="beta", token_id="t-beta")


@pytest.fixture
def lane(db_url: str, clock: ManualClock) -> Iterator[Runlane]:
    """A facade on the pinned clock: every run submitted without moving it shares one
    ``created_at``."""
    with Runlane(db_url, clock=clock) as lane:
        yield lane


def submit(lane: Runlane, n: int, **fields: Any) -> list[str]:
    rows = [{"tenant": "acme", "repo": "/srv/git/app.git", "prompt": f"task {i}", **fields}
            for i in range(n)]
    return [s.run_id for s in lane.submit_batch(rows)]


def every_page(lane: Runlane, *, limit: int, **filters: Any) -> tuple[list[RunSummary], int]:
    """Every run the listing gives, page after page, and the number of pages."""
    items: list[RunSummary] = []
    cursor = None
    pages = 0
    while True:
        page = lane.runs_page(limit=limit, cursor=cursor, **filters)
        pages += 1
        items += page.items
        assert len(page.items) <= limit
        if page.next is None:
            return items, pages
        assert len(page.items) == limit  # a cursor only after a full page
        cursor = page.next


def order_key(run: RunSummary) -> tuple[datetime, str]:
    return run.created_at, run.run_id


@pytest.mark.parametrize("newest_first", [True, False])
def test_equal_timestamps_at_page_boundaries_are_neither_skipped_nor_repeated(
        lane: Runlane, clock: ManualClock, newest_first: bool) -> None:
    early = submit(lane, 7)
    clock.advance(1)
    same = submit(lane, 40)  # one created_at for all 40: every boundary falls among them
    clock.advance(1)
    late = submit(lane, 6, tenant="beta")
    items, pages = every_page(lane, limit=9, newest_first=newest_first)
    ids = [r.run_id for r in items]
    assert len(ids) == len(set(ids)) == 53
    assert set(ids) == set(early + same + late)
    assert pages == 6
    assert items == sorted(items, key=order_key, reverse=newest_first)
    assert len({r.created_at for r in items if r.run_id in same}) == 1
    # Oldest first ends with the last submitted; newest first starts with it.
    assert (ids[0] if newest_first else ids[-1]) in late


def test_a_last_full_page_has_no_next(lane: Runlane) -> None:
    submit(lane, 6)
    first = lane.runs_page(limit=3)
    second = lane.runs_page(limit=3, cursor=first.next)
    assert first.next is not None and len(second.items) == 3
    assert second.next is None
    assert lane.runs_page(limit=6).next is None
    assert lane.runs_page(limit=100).next is None


def test_filters(lane: Runlane, clock: ManualClock) -> None:
    at_start = datetime.fromtimestamp(T0, UTC)
    gh = submit(lane, 2, repo="https://github.com/Acme/App.git")  # T0
    clock.advance(10)
    urgent = submit(lane, 3, queue="urgent")  # T0 + 10
    clock.advance(10)
    other = submit(lane, 4, tenant="beta")  # T0 + 20
    cancelled = lane.store.get_run(urgent[0])["task_id"]
    lane.cancel(cancelled)

    def ids(**filters: Any) -> set[str]:
        return {r.run_id for r in every_page(lane, limit=2, **filters)[0]}

    assert ids(tenant="beta") == set(other)
    assert ids(queue="urgent") == set(urgent)
    assert ids(status="CANCELLED") == {urgent[0]}
    assert ids(status="queued", tenant="acme") == set(gh + urgent[1:])
    # Any spelling of the repository: it is compared in its canonical form.
    assert ids(repo="git@github.com:acme/app") == set(gh)
    assert ids(repo="https://github.com/ACME/app/") == set(gh)
    # created_after inclusive, created_before exclusive; datetimes or epoch seconds.
    assert ids(created_after=T0 + 10) == set(urgent + other)
    assert ids(created_before=T0 + 10) == set(gh)
    assert ids(created_after=at_start.replace(tzinfo=None), created_before=T0 + 20) \
        == set(gh + urgent)
    assert ids(tenant="acme", queue="urgent", status="QUEUED", created_after=T0 + 5) \
        == set(urgent[1:])
    assert ids(tenant="nobody") == set()


def test_a_run_summary_is_the_run_object_of_the_contract(lane: Runlane) -> None:
    [run_id] = submit(lane, 1, repo="https://user:s3cret@github.com/acme/app")
    [item] = lane.runs_page().items
    document = item.model_dump(mode="json")
    for name in ("run_id", "task_id", "tenant", "repo", "queue", "status", "priority",
                 "attempt_count", "created_at", "updated_at", "reason_code", "outcome",
                 "cost_usd"):
        assert name in document
    assert document["run_id"] == run_id
    assert document["repo"] == "https://github.com/acme/app"  # canonical: no credentials
    assert "s3cret" not in json.dumps(document)
    assert document["created_at"] == "2027-01-15T08:00:00.000+00:00"


def test_a_tenant_principal_lists_its_own_runs_only(lane: Runlane) -> None:
    mine = submit(lane, 5)
    theirs = submit(lane, 5, tenant="beta")
    assert {r.run_id for r in every_page(lane, limit=2, principal=ACME)[0]} == set(mine)
    assert {r.run_id for r in every_page(lane, limit=2, principal=BETA)[0]} == set(theirs)
    # A filter naming another tenant lists nothing: an empty page, as for a tenant
    # without runs, never the other tenant's runs.
    assert lane.runs_page(principal=ACME, tenant="beta") == RunPage(items=[], next=None)
    assert lane.runs_page(principal=ACME, tenant="nobody") == RunPage(items=[], next=None)
    # A cursor is no key to other rows: past one of the operator's pages (or a forged
    # one), a tenant still sees only its own.
    operator = lane.runs_page(limit=1)
    assert operator.next is not None
    assert {r.tenant for r in lane.runs_page(principal=ACME, cursor=operator.next).items} \
        <= {"acme"}
    forged = encode_cursor(T0 + 1, "~", newest_first=True)
    assert {r.run_id for r in lane.runs_page(principal=BETA, cursor=forged).items} \
        == set(theirs)


@pytest.mark.parametrize("arguments, says", [
    ({"limit": 0}, "limit 0"),
    ({"limit": 1001}, "limit 1001"),
    ({"limit": True}, "limit True"),
    ({"status": "QUEUD"}, "status 'QUEUD' is unknown"),
    ({"tenant": ""}, "is not a tenant name"),
    ({"queue": "a b"}, "is not a queue name"),
    ({"repo": " "}, "is not a repository"),
    ({"created_after": "yesterday"}, "is not a datetime or epoch seconds"),
    ({"created_before": float("nan")}, "is not a datetime or epoch seconds"),
    ({"cursor": "abc"}, "is not the `next` of a page"),
    ({"cursor": encode_cursor(T0, "x", newest_first=False)}, "other order"),
    ({"cursor": "W10"}, "is not the `next` of a page"),  # base64 of []
])
def test_bad_arguments_are_refused_as_bad_input(lane: Runlane, arguments: dict[str, Any],
                                               says: str) -> None:
    submit(lane, 1)
    with pytest.raises(InvalidArgument, match="^" + "|".join([".*" + says])):
        lane.runs_page(**arguments)
    assert InvalidArgument("x").exit_code == 2


# --- the CLI ---------------------------------------------------------------------------


def runlane(db_url: str, tmp_path: Path, *args: str, code: int = 0
            ) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "runlane", "--database-url", db_url, *args],
                            capture_output=True, text=True, env=cli_env(tmp_path), timeout=60)
    assert result.returncode == code, (result.stdout, result.stderr)
    return result


def test_cli_runs_list_keeps_its_array_order_and_limit_and_continues_with_a_cursor(
        db_url: str, lane: Runlane, clock: ManualClock, tmp_path: Path) -> None:
    first = submit(lane, 3)
    clock.advance(1)
    rest = submit(lane, 3, queue="urgent")
    listed = runlane(db_url, tmp_path, "runs", "list", "--oldest-first", "--limit", "4",
                     "--json")
    documents = json.loads(listed.stdout)
    assert isinstance(documents, list)
    assert [d["run_id"] for d in documents][:3] == sorted(first)  # oldest first
    assert len(documents) == 4
    assert set(documents[0]) >= {"run_id", "task_id", "tenant", "repo", "queue", "status",
                                 "priority", "attempt_count", "max_attempts", "created_at",
                                 "updated_at", "reason_code", "outcome", "cost_usd"}
    [note] = listed.stderr.strip().splitlines()
    assert "4 runs listed (--limit), newer ones exist" in note, note
    cursor = note.rsplit("--cursor ", 1)[1].rstrip(")")
    more = json.loads(runlane(db_url, tmp_path, "runs", "list", "--oldest-first", "--cursor",
                              cursor, "--json").stdout)
    after = json.loads(runlane(db_url, tmp_path, "runs", "list", "--after",
                               documents[-1]["run_id"], "--json").stdout)
    assert after == more
    assert [d["run_id"] for d in documents + more] == sorted(first) + sorted(rest)
    urgent = json.loads(runlane(db_url, tmp_path, "runs", "list", "--queue", "urgent",
                                "--newest-first", "--since", "2027-01-15T08:00:00.5",
                                "--json").stdout)
    assert [d["run_id"] for d in urgent] == sorted(rest, reverse=True)
    bad = runlane(db_url, tmp_path, "runs", "list", "--until", "someday", code=2)
    assert bad.stderr.startswith("error: --until") and "Traceback" not in bad.stderr


# --- the plan on PostgreSQL ------------------------------------------------------------


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def test_a_page_of_one_tenant_in_one_status_is_an_index_walk_without_a_sort(
        lane: Runlane) -> None:
    """60,000 runs of 50 tenants in 4 statuses: a page reads its own rows from
    ix_runs_listing_tenant_status, from the cursor on, and sorts nothing."""
    if not lane.store.is_postgres:
        pytest.skip("the plan is PostgreSQL's (SQLite: tests above)")
    with lane.store.engine.begin() as conn:
        conn.execute(text("""
            INSERT INTO runs (run_id, task_id, tenant, repo, queue, priority, status,
                              max_attempts, visible_at, created_at, updated_at)
            SELECT 'r' || lpad(g::text, 7, '0'), 't' || g, 'tenant' || (g % 50),
                   '/srv/app', 'default', 100,
                   (ARRAY['QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED'])[1 + g / 7 % 4],
                   3, 1e9 + g / 3, 1e9 + g / 3, 1e9 + g / 3
            FROM generate_series(1, 60000) AS g"""))
        conn.execute(text("ANALYZE runs"))
    first = lane.runs_page(tenant="tenant7", status="SUCCEEDED", limit=50)
    assert len(first.items) == 50 and first.next is not None
    statement = views_sql.runs_page_sql(("tenant", "status"), newest_first=True, cursor=True)
    cursor = lane.runs_page(tenant="tenant7", status="SUCCEEDED", limit=50,
                            cursor=first.next)
    assert len(cursor.items) == 50
    last = first.items[-1]
    with lane.store.engine.connect() as conn:
        [[plan]] = conn.execute(text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement), {
            "tenant": "tenant7", "status": "SUCCEEDED", "limit": 51,
            "cursor_created_at": last.created_at.timestamp(), "cursor_run_id": last.run_id,
        }).one()
    nodes = list(_plan_nodes(plan["Plan"]))
    kinds = [n["Node Type"] for n in nodes]
    assert "Sort" not in kinds and "Incremental Sort" not in kinds, kinds
    [scan] = [n for n in nodes if n["Node Type"].startswith("Index")]
    assert scan["Index Name"] == "ix_runs_listing_tenant_status", scan
    assert scan["Actual Rows"] <= 51 and scan.get("Rows Removed by Filter", 0) == 0, scan
    assert "created_at" in scan["Index Cond"] and "run_id" in scan["Index Cond"], scan


@pytest.mark.parametrize("filters, index", [
    (("tenant", "status"), "ix_runs_listing_tenant_status"),
    (("tenant",), "ix_runs_listing_tenant"),
    ((), "ix_runs_listing"),
])
@pytest.mark.parametrize("newest_first", [True, False])
def test_sqlite_walks_the_listing_indexes_without_a_sort(
        tmp_path: Path, filters: tuple[str, ...], index: str, newest_first: bool) -> None:
    from .conftest import migrated_sqlite

    url = migrated_sqlite(tmp_path / "plan.db")
    with Runlane(url) as lane, lane.store.engine.connect() as conn:
        statement = views_sql.runs_page_sql(filters, newest_first=newest_first, cursor=True)
        plan = [row[-1] for row in conn.execute(text("EXPLAIN QUERY PLAN " + statement), {
            "tenant": "acme", "status": "QUEUED", "limit": 51, "cursor_created_at": T0,
            "cursor_run_id": "x"})]
    assert len(plan) == 1 and f"USING INDEX {index} " in plan[0], plan
    assert "(created_at,run_id)" in plan[0], plan  # the cursor bounds the walk
    assert not any("TEMP B-TREE" in step for step in plan), plan


@pytest.mark.parametrize("call", [
    lambda lane: lane.runs_page(), lambda lane: lane.workers(), lambda lane: lane.queues(),
    lambda lane: lane.tenants(), lambda lane: lane.policy(),
    lambda lane: lane.policy_versions(), lambda lane: lane.drain_worker("w"),
])
def test_a_database_never_upgraded_is_said_so(tmp_path: Path, call: Any) -> None:
    from runlane.errors import SchemaOutdated

    with Runlane(f"sqlite:///{tmp_path / 'none.db'}") as lane, \
            pytest.raises(SchemaOutdated, match="runlane db upgrade"):
        call(lane)
