"""Stride sharing (domain/fairness.py): the bound the claim walks lanes to."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runlane.domain.fairness import LaneState, share_bounds, share_slots

LANES = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0, 1000.0]),
                           st.one_of(st.floats(0, 50), st.floats(1e5, 1e6),
                                     st.integers(0, 4).map(float)),  # ties
                           st.integers(1, 60)),
                 min_size=1, max_size=40)


def page_of(lanes: list[tuple[int, float, float, int]]) -> list[LaneState]:
    """Lanes in fair order, as a page of lanes comes from the database."""
    return sorted((LaneState(i, p, w, pass_, q) for i, (p, w, pass_, q) in enumerate(lanes)),
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
