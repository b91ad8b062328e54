"""Weighted fair sharing of free slots among lanes (stride scheduling).

A lane is one (queue, route, priority, tenant); the unit of sharing is a flow, one
(queue, priority, tenant): a tenant's lanes of one priority, one per requirement
set (route), share one virtual time (``pass``), which advances by ``1 / weight``
per run the flow is given; the next slot goes to the flow with the best priority,
then the lowest pass, and within a flow to its oldest run, whatever its route. A tenant of weight 2
gets two runs for each one of a tenant of weight 1, and a tenant that arrives
late joins at the current virtual time (the store sees to that), so it waits at
most one claim per free slot however long the others' backlog is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Absorbs float rounding between a pass advanced turn by turn (share_slots) and one
# computed as pass + k / weight (the bounds, here and in SQL): an extra run walked is
# harmless, a missing one would make a lane look short.
TURN_SLACK = 1e-6


@dataclass(frozen=True)
class LaneState:
    lane_id: int
    priority: int
    weight: float
    pass_: float
    queued: int
    tenant: str = ""  # with the claim's queue and the priority: the lane's flow

    @property
    def flow(self) -> tuple[int, str]:
        return (self.priority, self.tenant)


def flows_of(lanes: Sequence[LaneState]) -> tuple[list[LaneState], dict[int, list[int]]]:
    """Merge a page's lanes into flows: one per (priority, tenant), named by its lowest
    lane_id, at its lowest pass (a flow's lanes share one; the lowest is the safe
    reading), with the queued runs of all its lanes. Returns the flows in fair order
    and each flow's lanes (page order). A tenant whose runs need two requirement sets
    has two lanes but one share (claim_sql.FLOWS deals the same flows)."""
    members: dict[tuple[int, str], list[LaneState]] = {}
    for lane in lanes:
        members.setdefault(lane.flow, []).append(lane)
    flows = sorted((LaneState(min(lane.lane_id for lane in group), priority,
                              min(lane.weight for lane in group),
                              min(lane.pass_ for lane in group),
                              sum(lane.queued for lane in group), tenant)
                    for (priority, tenant), group in members.items()),
                   key=lambda flow: (flow.priority, flow.pass_, flow.lane_id))
    return flows, {flow.lane_id: [lane.lane_id for lane in members[flow.flow]]
                   for flow in flows}


def share_slots(lanes: Sequence[LaneState], slots: int,
                until: tuple[int, float, int] | None = None) -> list[tuple[int, int]]:
    """Hand ``slots`` runs out among ``lanes``; returns ``(lane_id, runs)`` in the
    order the lanes first received one. With ``until`` (priority, pass, lane_id), no
    turn due after it is given: the lanes are one page, and a later turn may belong
    to a lane of the next page."""
    # A lane's k-th turn is at pass + k / weight, computed so (not by adding 1 / weight
    # k times): the claim's one statement deals the same turns in SQL (claim_sql.SHARE_TURNS),
    # and repeated additions broke near-ties differently (weight 10 at pass 0 against
    # weight 1 at pass 1.0: the tenth turn, 0 + 10 / 10, ties the second lane's first).
    heap = [(lane.priority, lane.pass_, lane.lane_id, lane) for lane in lanes
            if lane.queued > 0 and lane.weight > 0]
    heapq.heapify(heap)
    given: dict[int, int] = {}
    while slots > 0 and heap:
        if until is not None and heap[0][:3] > until:
            break
        priority, _, lane_id, lane = heapq.heappop(heap)
        given[lane_id] = given.get(lane_id, 0) + 1
        slots -= 1
        if given[lane_id] < lane.queued:
            heapq.heappush(heap, (priority, lane.pass_ + given[lane_id] / lane.weight,
                                  lane_id, lane))
    return list(given.items())


def share_bounds(lanes: Sequence[LaneState], slots: int) -> dict[int, int]:
    """The most runs ``share_slots(lanes, slots)`` can give each lane, known before
    the lanes' runs are read (``lanes`` in fair order, as a page of lanes comes). The
    claim walks each lane this far in the statement that picks the lanes
    (``PICK_AND_WALK_PG``): every row walked is locked, so a loose bound costs locks
    other claimers skip.

    First a cap per lane: only the first ``slots`` lanes get any (each has its first
    turn before a later lane's), and when there are that many, a lane's k-th extra
    turn comes at pass + k / weight, never past the last of them (the edge) at the
    same priority. Then the turns those caps allow, in fair order: the ``slots``-th
    of them is as late as the last turn dealt can be (the real turns include them),
    so no lane gets a turn after it. Without that second step, 8 equal lanes and 10
    slots walked 10 runs per lane for 10 runs in all; with it, 2."""
    if slots <= 0:
        return {}
    edge = lanes[slots - 1] if len(lanes) >= slots else None
    caps: dict[int, int] = {}
    for lane in lanes[:slots]:
        if edge is None or lane.priority < edge.priority:
            most = slots
        else:
            most = 1 + math.floor((edge.pass_ - lane.pass_) * lane.weight + TURN_SLACK)
        caps[lane.lane_id] = max(0, min(slots, lane.queued, most))
    turns = sorted((lane.priority, lane.pass_ + k / lane.weight)
                   for lane in lanes[:slots] for k in range(caps[lane.lane_id]))
    if len(turns) < slots:
        return caps
    last_priority, last_turn = turns[slots - 1]
    bounds: dict[int, int] = {}
    for lane in lanes[:slots]:
        if lane.priority < last_priority:
            most = caps[lane.lane_id]
        elif lane.priority > last_priority:
            most = 0
        else:
            most = min(caps[lane.lane_id],
                       1 + math.floor((last_turn - lane.pass_) * lane.weight + TURN_SLACK))
        bounds[lane.lane_id] = max(0, most)
    return bounds
