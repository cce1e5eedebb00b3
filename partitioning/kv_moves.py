"""Move or recompute: where a new plan's KV caches come from, by predicted cost.

When a plan replaces another, every layer range that changes holder has KV caches (of the
requests in flight and the cached prefixes) that the new holder needs. It can *move*
them from the old holder over their link, or *recompute* them from the hidden states
entering the range, which the stage before it kept (the boundary activations). Both
costs grow with the tokens cached, so they compare per token:

* move: ``sum(kv_bytes_per_token_per_layer[l] for l in the range) / link bandwidth``,
  one transfer per new holder, from the same old holder (their sum, since they share
  its link); the link must have been measured (a guess never chooses recomputing, which
  holds only the sequences whose states were kept);
* recompute: ``sum(flops_per_token_per_layer[l]) / flops`` of each new holder, in chain
  (their sum: the first chunk crosses them one after the other; later chunks overlap,
  so this is an upper bound).

A range whose holder is gone cannot move: it is recomputed. A range recomputes by choice
only when its holder keeps none of it (one that keeps part of it holds the states
entering the rest inside its own stage, where nobody records them). Adjacent recomputed
ranges form one chain, which starts from the states the stage before it kept (at layer
0, the token ids). What recomputes is what the kept states cover: the requests in
flight and the recent ones; a moved range brings every cached prefix too. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ringlet.partitioning.spec import LinkSpec, ModelSpec, NodeSpec, Policy


@dataclass(frozen=True)
class KVSource:
    """How one range of the replaced plan reaches its new holders.

    Attributes:
        node_id: the range's old holder.
        start, end: the range, half-open.
        rebuild: recomputed from the states entering ``start`` (else moved).
        why: the reason, for the log and ``/v1/cluster``.
        move_s_per_token, recompute_s_per_token: the predicted costs, seconds per
            cached token (``None`` where not computed: a lost holder, nothing to move).
    """

    node_id: str
    start: int
    end: int
    rebuild: bool
    why: str
    move_s_per_token: float | None = None
    recompute_s_per_token: float | None = None


def _bandwidth(a: str, b: str, links: Iterable[LinkSpec], policy: Policy) -> float:
    return _measured(a, b, links) or policy.fallback_bandwidth_bytes_per_s


def _measured(a: str, b: str, links: Iterable[LinkSpec]) -> float | None:
    for link in links:
        if {link.a, link.b} == {a, b}:
            return link.bandwidth_bytes_per_s
    return None


def kv_sources(previous: list[tuple[str, int, int]], stages: list[tuple[str, int, int]], model: ModelSpec,
               nodes: Mapping[str, NodeSpec], links: Iterable[LinkSpec], policy: Policy,
               lost: Mapping[str, str]) -> list[KVSource]:
    """Decide, for every range of the replaced plan, whether its KV moves or is recomputed.

    Args:
        previous: the replaced plan's stages, ``(node id, start, end)``, in ring order.
        stages: the new plan's stages, the same way.
        model: the model (KV bytes and FLOPs per token and layer).
        nodes: the new plan's members (their FLOP/s).
        links: measured links; other pairs use ``policy``'s fallback bandwidth.
        policy: the planner's policy (fallback bandwidth, bytes/s).
        lost: holders that are gone, with why (their KV went with them).

    Returns:
        One :class:`KVSource` per previous stage, in its order.
    """
    links = list(links)
    kv = model.kv_bytes_per_token_per_layer
    flops = model.flops_per_token_per_layer
    out: list[KVSource] = []
    for holder, a, b in previous:
        if holder in lost:
            out.append(KVSource(holder, a, b, True, f"lost ({lost[holder]}): its KV went with it"))
            continue
        takers = [(n, max(a, s), min(b, e)) for n, s, e in stages if n != holder and max(a, s) < min(b, e)]
        if not takers:
            out.append(KVSource(holder, a, b, False, "kept by its holder"))
            continue
        move = sum(sum(kv[lo:hi]) / _bandwidth(holder, n, links, policy) for n, lo, hi in takers)
        recompute = sum(sum(flops[lo:hi]) / nodes[n].flops if n in nodes else float("inf") for n, lo, hi in takers)
        if any(n == holder and max(a, s) < min(b, e) for n, s, e in stages):
            out.append(KVSource(holder, a, b, False, f"its holder keeps part of it: moved ({move * 1e6:.1f} "
                                "us/token)", move, recompute))
        elif unmeasured := [n for n, _, _ in takers if _measured(holder, n, links) is None]:
            out.append(KVSource(holder, a, b, False, f"moved: no measured link from its holder to "
                                f"{', '.join(sorted(unmeasured))} to weigh recomputing against", move, recompute))
        elif recompute < move:
            out.append(KVSource(holder, a, b, True, f"recomputed: {recompute * 1e6:.1f} us/token predicted, "
                                f"against {move * 1e6:.1f} us/token to move it", move, recompute))
        else:
            out.append(KVSource(holder, a, b, False, f"moved: {move * 1e6:.1f} us/token predicted, against "
                                f"{recompute * 1e6:.1f} us/token to recompute it", move, recompute))
    return out
