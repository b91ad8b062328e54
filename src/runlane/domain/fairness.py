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
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneState:
    lane_id: int
    priority: int
    weight: float
    pass_: float
    queued: int


def share_slots(lanes: Sequence[LaneState], slots: int) -> list[tuple[int, int]]:
    """Hand ``slots`` runs out among ``lanes``; returns ``(lane_id, runs)`` in the
    order the lanes first received one."""
    heap = [(lane.priority, lane.pass_, lane.lane_id, lane) for lane in lanes
            if lane.queued > 0 and lane.weight > 0]
    heapq.heapify(heap)
    given: dict[int, int] = {}
    while slots > 0 and heap:
        priority, pass_, lane_id, lane = heapq.heappop(heap)
        given[lane_id] = given.get(lane_id, 0) + 1
        slots -= 1
        if given[lane_id] < lane.queued:
            heapq.heappush(heap, (priority, pass_ + 1.0 / lane.weight, lane_id, lane))
    return list(given.items())
