"""Weighted fair sharing of free slots among lanes (stride scheduling).

A lane is one (queue, route, priority, tenant). Each lane has a virtual time
(``pass``) that advances by ``1 / weight`` per run it is given; the next slot goes
to the lane with the best priority, then the lowest pass. A tenant of weight 2
gets two runs for each one of a tenant of weight 1, and a tenant that arrives
late joins at the current virtual time (the store sees to that), so it waits at
most one claim per free slot however long the others' backlog is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneState:
    lane_id: int
    priority: int
    weight: float
    pass_: float
    queued: int


def share_slots(lanes: Sequence[LaneState], slots: int,
                until: tuple[int, float, int] | None = None) -> list[tuple[int, int]]:
    """Hand ``slots`` runs out among ``lanes``; returns ``(lane_id, runs)`` in the
    order the lanes first received one. With ``until`` (priority, pass, lane_id), no
    turn due after it is given: the lanes are one page, and a later turn may belong
    to a lane of the next page."""
    heap = [(lane.priority, lane.pass_, lane.lane_id, lane) for lane in lanes
            if lane.queued > 0 and lane.weight > 0]
    heapq.heapify(heap)
    given: dict[int, int] = {}
    while slots > 0 and heap:
        if until is not None and heap[0][:3] > until:
            break
        priority, pass_, lane_id, lane = heapq.heappop(heap)
        given[lane_id] = given.get(lane_id, 0) + 1
        slots -= 1
        if given[lane_id] < lane.queued:
            heapq.heappush(heap, (priority, pass_ + 1.0 / lane.weight, lane_id, lane))
    return list(given.items())


def share_bounds(lanes: Sequence[LaneState], slots: int) -> dict[int, int]:
    """The most runs ``share_slots(lanes, slots)`` can give each lane, known before
    the lanes' runs are read (``lanes`` in fair order, as a page of lanes comes): only
    the first ``slots`` lanes get any (each has its first turn before a later lane's),
    and when there are that many, a lane's k-th extra turn comes at pass + k / weight,
    never past the last of them (the edge) at the same priority. The claim walks each
    lane this far in the statement that picks the lanes (``PICK_AND_WALK_PG``)."""
    if slots <= 0:
        return {}
    edge = lanes[slots - 1] if len(lanes) >= slots else None
    bounds: dict[int, int] = {}
    for lane in lanes[:slots]:
        if edge is None or lane.priority < edge.priority:
            most = slots
        else:
            most = 1 + math.floor((edge.pass_ - lane.pass_) * lane.weight + 1e-6)
        bounds[lane.lane_id] = min(slots, lane.queued, most)
    return bounds
