"""Structural checks of a plan, for plans built here or received from a peer."""

from __future__ import annotations

from collections.abc import Iterable

from .errors import InvalidPlan
from .plan import Plan, compute_plan_id


def validate_plan(plan: Plan, num_layers: int, node_ids: Iterable[str] | None = None) -> None:
    """Check that ``plan`` is a usable pipeline for a model with ``num_layers`` layers.

    Checks, in order: the layer count matches; there is at least one stage; every
    stage is non-empty and inside ``[0, num_layers)``; the stages are contiguous in
    ring order, start at 0 and end at ``num_layers`` (every layer exactly once); no
    node appears twice, or both in the ring and among the excluded; the hops join
    consecutive stages and the last returns to the first; when ``node_ids`` is given,
    every stage's node is one of them; ``plan_id`` matches the content.

    Args:
        plan: the plan.
        num_layers: decoder layers of the model the caller is serving.
        node_ids: optional set of known member ids.

    Raises:
        InvalidPlan: naming the first problem found. O(stages + hops + excluded).
    """
    if num_layers != plan.num_layers:
        raise InvalidPlan(f"plan is for {plan.num_layers} layers, the model has {num_layers}")
    if not plan.stages:
        raise InvalidPlan("plan has no stages")
    expected = 0
    seen: set[str] = set()
    known = None if node_ids is None else set(node_ids)
    for i, s in enumerate(plan.stages):
        where = f"stage {i} ({s.node_id!r})"
        if s.start != expected:
            kind = "gap" if s.start > expected else "overlap"
            raise InvalidPlan(f"{where} starts at layer {s.start}, expected {expected} ({kind})")
        if s.end <= s.start:
            raise InvalidPlan(f"{where} is empty or reversed: [{s.start}, {s.end})")
        if s.end > num_layers:
            raise InvalidPlan(f"{where} ends at layer {s.end}, beyond the model's {num_layers} layers")
        if s.node_id in seen:
            raise InvalidPlan(f"{where}: node appears twice in the ring")
        if known is not None and s.node_id not in known:
            raise InvalidPlan(f"{where}: unknown node")
        seen.add(s.node_id)
        expected = s.end
    if expected != num_layers:
        raise InvalidPlan(f"the stages stop at layer {expected}; layers [{expected}, {num_layers}) are not served")
    for x in plan.excluded:
        if x.node_id in seen:
            raise InvalidPlan(f"node {x.node_id!r} is both in the ring and excluded")
    ring = plan.ring_order
    k = len(ring)
    want = [(ring[i], ring[i + 1], False) for i in range(k - 1)] + ([(ring[-1], ring[0], True)] if k > 1 else [])
    got = [(h.src, h.dst, h.returns) for h in plan.hops]
    if got != want:
        raise InvalidPlan(f"hops {got} do not follow the ring order {list(ring)}")
    for h in plan.hops:
        if not h.path or h.path[0] != h.src or h.path[-1] != h.dst:
            raise InvalidPlan(f"hop {h.src}->{h.dst} has path {list(h.path)} that does not join them")
    if compute_plan_id(plan) != plan.plan_id:
        raise InvalidPlan("plan_id does not match the plan's content")
