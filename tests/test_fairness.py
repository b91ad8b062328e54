"""Stride sharing (domain/fairness.py): the bound the claim walks lanes to."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, text

from runlane.domain.fairness import LaneState, flows_of, share_bounds, share_slots
from runlane.store import claim_sql
from runlane.store.engine import build_engine

LANES = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0, 1000.0]),
                           st.one_of(st.floats(0, 50), st.floats(1e5, 1e6),
                                     st.integers(0, 4).map(float)),  # ties
                           st.integers(1, 60)),
                 min_size=1, max_size=40)


def page_of(lanes: list[tuple[int, float, float, int]],
            tenants: list[str] | None = None) -> list[LaneState]:
    """Lanes in fair order, as a page of lanes comes from the database (each lane its
    own tenant unless ``tenants`` says whose it is)."""
    return sorted((LaneState(i, p, w, pass_, q, tenants[i] if tenants else str(i))
                   for i, (p, w, pass_, q) in enumerate(lanes)),
                  key=lambda lane: (lane.priority, lane.pass_, lane.lane_id))


@given(lanes=LANES, data=st.data())
def test_no_share_exceeds_its_bound(lanes: list[tuple[int, float, float, int]],
                                    data: st.DataObject) -> None:
    page = page_of(lanes)
    slots = data.draw(st.integers(1, len(page) + 3), label="slots")
    bounds = share_bounds(page, slots)
    for lane_id, share in share_slots(page, slots):
        assert share <= bounds.get(lane_id, 0), (lane_id, share, bounds)


def test_bounds_are_tight_for_equal_lanes() -> None:
    """Ten lanes of one weight at one pass, 4 slots: the first four lanes get one run
    each, so each is walked for one run and the rest not at all."""
    page = page_of([(0, 1.0, 3.0, 100)] * 10)
    assert share_bounds(page, 4) == {0: 1, 1: 1, 2: 1, 3: 1}
    # Fewer lanes than slots: the lanes take turns, two each.
    assert share_bounds(page[:2], 4) == {0: 2, 1: 2}
    assert dict(share_slots(page[:2], 4)) == {0: 2, 1: 2}
    # Eight tenants and a claim of 10: two each at most, not 10 each.
    assert share_bounds(page[:8], 10) == {i: 2 for i in range(8)}
    # A lane that runs out hands its turns to the others.
    page = page_of([(0, 1.0, 3.0, 1), (0, 1.0, 3.0, 100)])
    assert share_bounds(page, 4) == {0: 1, 1: 3}
    assert dict(share_slots(page, 4)) == {0: 1, 1: 3}
    # A lane of a better priority takes every turn it can before the others get any.
    page = page_of([(0, 1.0, 9.0, 3), (1, 1.0, 0.0, 100)])
    assert share_bounds(page, 4) == {0: 3, 1: 1}
    # A lane of weight 2 half a stride ahead gets the extra turn it is due.
    page = page_of([(0, 2.0, 0.0, 100), (0, 1.0, 0.5, 100), (0, 1.0, 0.5, 100)])
    assert share_bounds(page, 3) == {0: 2, 1: 1, 2: 1}
    assert dict(share_slots(page, 3)) == {0: 2, 1: 1}


# Any weights, and passes with exact ties among them (whole numbers and quarters): both
# sides compute a turn as pass + k / weight, so near-ties break alike.
SQL_LANES = st.lists(st.tuples(st.integers(0, 2),
                               st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 7.0, 10.0, 1000.0]),
                               st.one_of(st.floats(0, 50), st.integers(0, 40).map(
                                   lambda quarter: quarter / 4)),
                               st.integers(1, 12)),
                     min_size=1, max_size=20)
# The page's own lanes (``picked``) and its companions (its flows' lanes beyond its end,
# claim_sql.PAGE_COMPANIONS): the page's end is its own last lane, its flows are of both.
SHARES_OF_PAGE = text(
    "WITH given AS (SELECT * FROM unnest(CAST(:lane_ids AS bigint[]), "
    "CAST(:priorities AS integer[]), CAST(:passes AS double precision[]), "
    "CAST(:weights AS double precision[]), CAST(:queued AS integer[]), "
    "CAST(:tenants AS text[]), CAST(:picked AS boolean[])) "
    "AS g(lane_id, priority, pass_, weight, queued_count, tenant, picked)), "
    "pick AS (SELECT lane_id, priority, pass_, weight, queued_count, tenant FROM given "
    "WHERE picked)," + claim_sql.PAGE_END + ", page AS (SELECT lane_id, priority, pass_, weight, "
    "queued_count, tenant FROM given)," + claim_sql.FLOWS + "," + claim_sql.SHARE_TURNS
    + " SELECT lane_id, share FROM shares WHERE share > 0")


@pytest.fixture(scope="module")
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = build_engine(pg_url)
    yield engine
    engine.dispose()


@settings(max_examples=300, deadline=None)
@given(lanes=SQL_LANES, data=st.data())
def test_the_one_statement_claim_deals_what_share_slots_deals(
        pg_engine: Engine, lanes: list[tuple[int, float, float, int]], data: st.DataObject) -> None:
    """CLAIM_ONE_TRIP_PG deals a page's shares in SQL (claim_sql.SHARE_TURNS): for any page of
    lanes (a full page: no turn after its last lane, and its flows' lanes beyond it) and
    claim size, the same shares as share_slots, which the transaction's claim deals in
    Python."""
    # A tenant's lanes (one per route) are one flow: one pass and one weight, as the
    # store keeps them (lanes_sql.FLOW_CLAIMED, lanes_sql._FLOW_PASS).
    shared = data.draw(st.booleans(), label="tenants with several lanes")
    tenants = [str(i) for i in range(len(lanes))]
    if shared:
        tenants = [data.draw(st.sampled_from("abc"), label="tenant") for _ in lanes]
        first = {t: lanes[tenants.index(t)] for t in tenants}
        lanes = [(p, first[t][1], first[t][2], q)
                 for t, (p, _, _, q) in zip(tenants, lanes, strict=True)]
    page = page_of(lanes, tenants)
    size = data.draw(st.sampled_from([len(page), len(page) + 1, 16]), label="page size")
    size = max(size, len(page))
    wanted = data.draw(st.integers(1, size), label="wanted")
    last = page[-1]
    until = (last.priority, last.pass_, last.lane_id) if len(page) == size else None
    # A full page brings its flows' lanes beyond its end (at its end's priority, after
    # its last lane: a later lane_id, a pass no lower than the end's).
    companions: list[LaneState] = []
    if until is not None:
        for tenant in sorted({lane.tenant for lane in page if lane.priority == last.priority}):
            if data.draw(st.booleans(), label=f"a lane of {tenant} beyond the page"):
                flow = [lane for lane in page if lane.tenant == tenant]
                companions.append(LaneState(
                    len(lanes) + len(companions), last.priority, flow[0].weight,
                    max(min(lane.pass_ for lane in flow), last.pass_)
                    + data.draw(st.sampled_from([0.0, 0.25, 3.0]), label="ahead"),
                    data.draw(st.integers(1, 12), label="queued"), tenant))
    given_lanes = [*page, *companions]
    flows, _ = flows_of(given_lanes)
    expected = dict(share_slots(flows, wanted, until=until))
    with pg_engine.connect() as conn:
        got: dict[int, int] = {r.lane_id: r.share for r in conn.execute(SHARES_OF_PAGE, {
            "lane_ids": [lane.lane_id for lane in given_lanes],
            "priorities": [lane.priority for lane in given_lanes],
            "passes": [lane.pass_ for lane in given_lanes],
            "weights": [lane.weight for lane in given_lanes],
            "queued": [lane.queued for lane in given_lanes],
            "tenants": [lane.tenant for lane in given_lanes],
            "picked": [lane in page for lane in given_lanes], "wanted": wanted,
            "limit": size})}
    assert got == expected, (page, companions, wanted, size)



def test_a_near_tie_breaks_as_in_sql() -> None:
    """Weight 10 at pass 0 (lane 2) and weight 1 at pass 1.0 (lane 1), 11 slots: lane
    2's eleventh turn (0 + 10 / 10) ties lane 1's first, which goes first by lane_id.
    Added turn by turn, 0.1 ten times is 0.9999999999999999 and lane 2 took all 11;
    SQL deals 10 and 1 (a review of 2026-12-01)."""
    page = [LaneState(2, 0, 10.0, 0.0, 20), LaneState(1, 0, 1.0, 1.0, 20)]
    assert dict(share_slots(page, 11)) == {2: 10, 1: 1}


def test_a_tenants_lanes_of_one_priority_are_one_flow() -> None:
    """Two lanes of tenant a (two routes) and one of b, one weight and pass: a claim of
    4 deals the flows a and b two each, not a 2 + 1 + b 1 (a lane each)."""
    page = page_of([(0, 1.0, 3.0, 10), (0, 1.0, 3.0, 10), (0, 1.0, 3.0, 10)], ["a", "a", "b"])
    flows, members = flows_of(page)
    assert [(flow.lane_id, flow.tenant, flow.queued) for flow in flows] == [(0, "a", 20),
                                                                            (2, "b", 10)]
    assert members == {0: [0, 1], 2: [2]}
    assert dict(share_slots(flows, 4)) == {0: 2, 2: 2}
    # Another priority of the same tenant is another flow.
    flows, members = flows_of(page_of([(0, 1.0, 3.0, 10), (1, 1.0, 3.0, 10)], ["a", "a"]))
    assert members == {0: [0], 1: [1]}
