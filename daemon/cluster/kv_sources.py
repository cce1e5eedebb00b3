"""Where a re-plan's KV comes from: moved from the layers' previous holder, or rebuilt by
their new holders from the boundary activations entering them.

The proposer decides once, for every stage of the plan it replaces, and the proposal
carries the decision (``LayerRange.rebuild``, ``why``), so every member follows the same
one: the new holders of a rebuilt range compute it in chain, each starting from what the
one before it computed, and need each other to agree.

A holder that is gone took its KV with it: its range is rebuilt. A holder that stopped
(``SIGTERM``, a graceful leave) hands its KV over, so its range moves, unless recomputing
it is predicted to be faster (:mod:`ringlet.partitioning.kv_moves`: the KV bytes over the
measured link against the new holders' FLOP/s).
"""

from __future__ import annotations

import logging

from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.partitioning import LinkSpec, ModelSpec, NodeSpec, Policy
from ringlet.partitioning.costs import CostModel
from ringlet.partitioning.kv_moves import kv_sources

log = logging.getLogger(__name__)


def mark_rebuilds(previous: list[pb.LayerRange], stages: list[tuple[str, int, int]], model: ModelSpec,
                  nodes: list[NodeSpec], links: list[LinkSpec], policy: Policy, alive: set[str],
                  departed: dict[str, str]) -> list[pb.LayerRange]:
    """``previous`` (the stages the cluster serves now) with ``rebuild`` and ``why`` set by
    :func:`ringlet.partitioning.kv_moves.kv_sources`: a stage whose node is no longer a
    member and did not leave gracefully is lost and rebuilt; any other is rebuilt when
    recomputing its layers is predicted to beat moving their KV over the measured link.

    Args:
        previous: the serving plan's stages (modified in place and returned).
        stages: the new plan's stages, ``(node id, start, end)``.
        model, nodes, links, policy: the planner's inputs for the new plan.
        alive: the members the new plan is made for.
        departed: node id -> why it left (``"stopped"``: a graceful leave, its KV moves).
    """
    lost = {s.node_id: departed.get(s.node_id, "not a member") for s in previous
            if s.node_id and s.node_id not in alive and departed.get(s.node_id, "") != "stopped"}
    decided = kv_sources([(s.node_id, s.start, s.end) for s in previous], stages, model,
                         {n.node_id: n for n in nodes}, links, policy, lost)
    for stage, choice in zip(previous, decided, strict=True):
        stage.rebuild, stage.why, stage.lost = choice.rebuild, choice.why, stage.node_id in lost
        if choice.rebuild or choice.recompute_s_per_token is not None:
            log.info("KV of layers [%d, %d) held by %s: %s", stage.start, stage.end, stage.node_id[:8], choice.why)
    return previous


def rebuilt_spans(previous, num_layers: int) -> list[tuple[int, int]]:
    """The maximal runs ``[a, b)`` of adjacent previous stages marked ``rebuild``."""
    spans: list[tuple[int, int]] = []
    for s in sorted(previous, key=lambda s: s.start):
        if not s.rebuild:
            continue
        if spans and spans[-1][1] == s.start:
            spans[-1] = (spans[-1][0], s.end)
        else:
            spans.append((s.start, s.end))
    return [(a, min(b, num_layers)) for a, b in spans]


def boundary_source(lo: int, span: tuple[int, int], previous, stages):
    """Who holds the states entering layer ``lo`` of the rebuilt ``span``: the previous
    stage that ended at the span's start (it sent them on), or at layer 0 (the input is
    the token ids) the previous stage right after the span (it knows the sequences it
    holds); inside the span, the new stage holding layer ``lo - 1`` (it rebuilds the layers
    before). Returns ``(stage, from_previous_plan)``, or ``(None, False)``: nobody can."""
    a, b = span
    if lo == a:
        want = (lambda s: s.end == a) if a > 0 else (lambda s: s.start == b)
        found = next((s for s in previous if want(s) and not s.rebuild), None)
        return found, True
    holder = next((s for s in stages if s.start <= lo - 1 < s.end), None)
    return holder, False


def room_refusal(model: ModelSpec, start: int, end: int, tokens: int, usable: int) -> str | None:
    """Why a node cannot take layers ``[start, end)`` with the KV of ``tokens`` tokens in
    flight (they arrive with the layers; at least the planner's context is counted, as
    it plans), or ``None``: it can. ``usable`` is the memory the node offers the planner,
    bytes (its boundary-activation budget already taken off)."""
    context = max(model.context_tokens, tokens)
    need = CostModel(model, context_tokens=context).stage_memory(start, end)
    if need <= usable:
        return None
    return (f"no room for layers [{start}, {end}) with the KV of {tokens} token(s) in flight: they need "
            f"{need / 1e9:.2f} GB with a {context}-token KV cache, this node offers {usable / 1e9:.2f} GB")
