"""``make_plan``: from nodes, links, model, previous plan and policy to a :class:`Plan`.

Steps (all deterministic on inputs sorted by node id, so the plan does not depend
on the order the inputs arrive in):

1. validate: types, duplicate node ids (``ValueError`` naming the field);
2. leave out nodes that cannot serve: zero memory, bandwidth or compute; too small
   for any single layer; not in a pinned ring order -- each with a reason (with more
   nodes than layers, the policy's split leaves the surplus out, also with a reason);
3. ring order candidates from the links (:mod:`.ring`); with a reusable previous
   plan, the old ring with the new nodes inserted (:mod:`.stability`), kept unless
   re-choosing the ring beats it by more than RING_RECHOOSE_GAIN (5 %; the tolerance when
   larger) -- and kept anyway when the
   re-chosen ring would have a node hold its previous stage and the bytes it loads beyond
   its memory while it prepares (a node whose memory limit was lowered shrinks in place);
4. the policy picks an order and a split (:mod:`.policies`);
5. predictions: per-stage time, memory, bytes to load; hops; latency; throughput.

If nothing fits, :class:`~.errors.Infeasible` says by how much and at which
context length the model would fit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from . import split as splits
from .costs import CostModel
from .errors import Infeasible
from .plan import ExcludedNode, Hop, Plan, Stage
from .policies import Choice, Context, choose
from .ring import Route, Topology
from .spec import LinkSpec, ModelSpec, NodeSpec, Policy
from .stability import holdings, insertion_orders


def make_plan(
    nodes: Iterable[NodeSpec],
    links: Iterable[LinkSpec],
    model: ModelSpec,
    previous: Plan | None = None,
    policy: Policy | None = None,
) -> Plan:
    """Plan a pipeline ring for ``model`` over ``nodes``.

    Args:
        nodes: candidate machines (any order; ids unique).
        links: measured direct links (any order); pairs without one use the default
            network (``policy.fallback_*``). Links naming unknown nodes are ignored.
        model: the model, with the target context length.
        previous: the plan currently served; weights it placed are reused when the
            new plan is within ``policy.tolerance`` of the best.
        policy: ``Policy()`` (balanced) by default.

    Returns:
        A frozen :class:`Plan`; it passes :func:`~.validate.validate_plan`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: duplicate node ids, or a pinned ring order naming an unknown node.
        Infeasible: the model does not fit (a ValueError with ``shortfall_bytes``,
            ``max_context_tokens`` and a message).

    Complexity: ring order O(2^n n^2) exact for n <= 10 nodes (O(n^2) beyond);
    balanced split O(c k L^2) for c candidate orders, k nodes and L layers;
    latency split O(c (k^2 L^2 + k^3 L)) up to 10 nodes, O(c (k L^2 + k^2 L)) beyond.
    64 nodes x 128 layers plans in about 15 ms (see bench/bench_planner.py).
    """
    policy = Policy() if policy is None else policy
    nodes = list(nodes)
    links = list(links)
    _check_types(nodes, links, model, previous, policy)
    by_id: dict[str, NodeSpec] = {}
    for n in nodes:
        if n.node_id in by_id:
            raise ValueError(f"nodes: duplicate node_id {n.node_id!r}")
        by_id[n.node_id] = n
    if policy.ring_order is not None:
        unknown = [x for x in policy.ring_order if x not in by_id]
        if unknown:
            raise ValueError(f"Policy.ring_order names unknown node {unknown[0]!r}")

    notes: list[str] = []
    n_unknown = sum(1 for link in links if link.a not in by_id or link.b not in by_id)
    if n_unknown:
        notes.append(f"ignored {n_unknown} link(s) naming nodes that are not candidates")

    cost = CostModel(model)
    excluded: dict[str, ExcludedNode] = {}
    capable, usable = _usable_nodes(sorted(by_id.values(), key=lambda n: n.node_id), cost, policy, excluded)
    usable_ids = [n.node_id for n in usable]

    if not usable:
        raise _infeasible_over(model, capable, links, policy, excluded)

    topo = Topology(usable_ids, links, policy, model.activation_bytes_per_token)
    prev = holdings(previous, model.fingerprint)
    if previous is not None and prev is None:
        notes.append("the previous plan was for another model; nothing is reused")
    ctx = Context({n.node_id: n for n in usable}, cost, topo, policy, prev)

    if policy.ring_order is not None:
        top_orders = [tuple(x for x in policy.ring_order if x in ctx.nodes)]
    else:
        top_orders = topo.candidate_orders(lambda x: ctx.nodes[x].signature)
    choice = _choose_with_previous(ctx, previous, top_orders, notes) if prev is not None else choose(ctx, top_orders)
    if choice is None:
        if len(capable) == len(usable):
            raise _infeasible(model, usable, top_orders, excluded)
        raise _infeasible_over(model, capable, links, policy, excluded)
    return _build_plan(ctx, model, choice, excluded, notes)


def _check_types(nodes, links, model, previous, policy) -> None:
    for i, n in enumerate(nodes):
        if not isinstance(n, NodeSpec):
            raise TypeError(f"nodes[{i}] must be a NodeSpec, got {type(n).__name__}")
    for i, link in enumerate(links):
        if not isinstance(link, LinkSpec):
            raise TypeError(f"links[{i}] must be a LinkSpec, got {type(link).__name__}")
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be a ModelSpec, got {type(model).__name__}")
    if previous is not None and not isinstance(previous, Plan):
        raise TypeError(f"previous must be a Plan or None, got {type(previous).__name__}")
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy or None, got {type(policy).__name__}")
    if not nodes:
        raise ValueError("nodes: at least one node is required")


def _usable_nodes(nodes, cost: CostModel, policy: Policy, excluded: dict) -> tuple[list, list]:
    """(capable, usable): nodes with memory, bandwidth and compute (and pinned, if pinning);
    of those, the ones that can hold at least one layer. Others are recorded in ``excluded``."""
    smallest = cost.smallest_stage_bytes()
    pinned = None if policy.ring_order is None else set(policy.ring_order)
    capable, usable = [], []
    for n in nodes:
        if n.memory_bytes == 0:
            excluded[n.node_id] = ExcludedNode(n.node_id, "zero_memory", "no usable memory (0 bytes)")
        elif n.bandwidth_bytes_per_s == 0:
            excluded[n.node_id] = ExcludedNode(n.node_id, "zero_bandwidth", "memory bandwidth is 0 bytes/s")
        elif n.flops == 0:
            excluded[n.node_id] = ExcludedNode(n.node_id, "zero_compute", "compute is 0 FLOP/s")
        elif pinned is not None and n.node_id not in pinned:
            excluded[n.node_id] = ExcludedNode(
                n.node_id, "not_in_ring_order", "not in the pinned ring order (Policy.ring_order)"
            )
        elif n.memory_bytes < smallest:
            capable.append(n)
            excluded[n.node_id] = ExcludedNode(
                n.node_id,
                "too_small",
                f"cannot hold a single layer: the smallest stage needs {_fmt_bytes(smallest)}, "
                f"the node has {_fmt_bytes(n.memory_bytes)}",
            )
        else:
            capable.append(n)
            usable.append(n)
    return capable, usable


#: The previous ring is dropped for its links only when the best ring's slowest forward
#: link is at least this many times faster than the kept ring's. Measured bandwidths of
#: one link differ from probe to probe, and a ring re-chosen on that noise moves layers
#: and KV back and forth (seen on loopback: three plans in 2 s after a join, each
#: swapping two stages). The same 2x as the rule for switching a peer's route
#: (``SWITCH_FACTOR`` in ``daemon/cluster/routes.py``).
RING_SWITCH_FACTOR = 2.0

#: The previous ring is dropped for a better objective only when the best ring beats it by
#: more than this fraction (or the policy's tolerance, when larger). Orders of one set of
#: nodes differ in which node serves which stage (and which links the hops use), and a
#: node's measured speed moves by a few percent on a loaded machine: past the 1 % tolerance,
#: a ring re-chosen on that noise swapped two stages right after a join (seen on CI: epoch
#: 3 re-read 425 MB to gain nothing). A real change (a node twice as slow) clears 5 %.
RING_RECHOOSE_GAIN = 0.05


def _choose_with_previous(ctx: Context, previous: Plan, top_orders, notes: list[str]) -> Choice | None:
    """Keep the old ring (new nodes inserted) unless re-choosing it is better by more than the
    tolerance, or its slowest link is :data:`RING_SWITCH_FACTOR` times slower than the best ring's."""
    top = choose(ctx, top_orders)
    if ctx.policy.ring_order is not None:
        return top
    ins = insertion_orders(previous.ring_order, ctx.nodes, ctx.policy.max_insertion_orders)
    if ins is None:
        notes.append("the ring was re-chosen: no node of the previous ring remains")
        return top
    best_bw = ctx.topology.key(top_orders[0]).bottleneck_bytes_per_s
    admissible = [o for o in ins if ctx.topology.key(o).bottleneck_bytes_per_s * RING_SWITCH_FACTOR > best_bw]
    if not admissible:
        notes.append(f"the ring was re-chosen: keeping the previous order would use a link at least "
                     f"{RING_SWITCH_FACTOR:g}x slower")
        return top
    kept = choose(ctx, admissible)
    if kept is None:
        return top
    gain = max(ctx.policy.tolerance, RING_RECHOOSE_GAIN)
    if top is not None and ctx.policy.name != "memory" and top.best * (1.0 + gain) < kept.best:
        if _overfills_while_preparing(ctx, top) and not _overfills_while_preparing(ctx, kept):
            notes.append("the previous order was kept: in the best plan a node would load layers it does not "
                         "hold beside the ones it serves until the commit, beyond its memory")
            return kept
        notes.append(
            f"the ring was re-chosen: the best plan keeping the previous order is "
            f"{kept.best / top.best - 1:.1%} worse than the best plan (more than {gain:.1%})"
        )
        return top
    return kept


def _overfills_while_preparing(ctx: Context, choice: Choice) -> bool:
    """Whether a node of ``choice`` would load bytes beyond its memory: a node keeps serving
    its previous stage while it loads the new one, so for that time it holds the previous
    stage and what it loads. (A node whose memory shrank below its previous stage holds no
    more than before when its new range is inside the old one: it loads nothing.)"""
    for node_id, (s, e) in zip(choice.order, choice.split, strict=True):
        h = ctx.holding(node_id)
        if s == e or h.layers is None:
            continue
        load = ctx.cost.stage_load(h.layers, h.embedding, h.head, s, e)
        if load and ctx.cost.stage_memory(*h.layers) + load > ctx.nodes[node_id].memory_bytes:
            return True
    return False


def _build_plan(ctx: Context, model: ModelSpec, choice: Choice, excluded: dict, notes: list[str]) -> Plan:
    cost, topo = ctx.cost, ctx.topology
    stages = []
    k, L = len(ctx.nodes), cost.L
    for node_id, (s, e) in zip(choice.order, choice.split, strict=True):
        node = ctx.nodes[node_id]
        if s == e:
            if k > L:
                excluded[node_id] = ExcludedNode(
                    node_id,
                    "too_many_nodes",
                    f"more usable nodes ({k}) than layers ({L}); " + _not_needed_reason(ctx.policy.name),
                )
            else:
                excluded[node_id] = ExcludedNode(node_id, "not_needed", _not_needed_reason(ctx.policy.name))
            continue
        h = ctx.holding(node_id)
        emb, head = cost.needs(s, e)
        stages.append(
            Stage(
                node_id=node_id,
                start=s,
                end=e,
                time_s=cost.stage_time(node, s, e),
                memory_bytes=cost.stage_memory(s, e),
                capacity_bytes=node.memory_bytes,
                load_bytes=cost.stage_load(h.layers, h.embedding, h.head, s, e),
                embeds=emb,
                heads=head,
            )
        )
    ring = [s.node_id for s in stages]
    hops = []
    for a, b in zip(ring, ring[1:], strict=False):
        hops.append(_hop(topo.forward(a, b), model.activation_bytes_per_token, False))
    if len(ring) > 1:
        hops.append(_hop(topo.back(ring[-1], ring[0]), ctx.policy.token_bytes, True))
    latency = sum(s.time_s for s in stages) + sum(h.time_s for h in hops)
    busiest = max([s.time_s for s in stages] + [h.occupancy_s for h in hops])
    return Plan(
        policy=ctx.policy.name,
        model_name=model.name,
        model_fingerprint=model.fingerprint,
        num_layers=model.num_layers,
        context_tokens=model.context_tokens,
        stages=tuple(stages),
        hops=tuple(hops),
        excluded=tuple(excluded[k] for k in sorted(excluded)),
        latency_s=latency,
        throughput_tokens_per_s=(1.0 / busiest) if busiest > 0 else None,
        notes=tuple(notes) + choice.notes,
    )


def _hop(route: Route, payload: int, returns: bool) -> Hop:
    return Hop(
        src=route.path[0],
        dst=route.path[-1],
        path=route.path,
        kind=route.kind,
        payload_bytes=payload,
        bandwidth_bytes_per_s=route.bandwidth_bytes_per_s,
        latency_s=route.latency_s,
        time_s=route.time_s,  # computed by the topology for this hop's payload
        returns=returns,
    )


def _not_needed_reason(policy: str) -> str:
    if policy == "latency":
        return "left out: one request's time per token is lower without its extra hop"
    if policy == "memory":
        return "left out: the nodes with more memory hold the model"
    return "not needed: the largest stage time per token is no lower with it"


# --- infeasibility ------------------------------------------------------------------


def _infeasible_over(model: ModelSpec, capable: list, links, policy: Policy, excluded: dict) -> Infeasible:
    """:func:`_infeasible` over every node with memory, including those too small at this
    context (at a shorter context they may hold layers)."""
    if not capable:
        return _infeasible(model, [], [], excluded)
    topo = Topology([n.node_id for n in capable], links, policy, model.activation_bytes_per_token)
    sig = {n.node_id: n.signature for n in capable}
    return _infeasible(model, capable, topo.candidate_orders(sig.__getitem__), excluded)


def _infeasible(model: ModelSpec, usable: list, orders, excluded: dict) -> Infeasible:
    required = model.total_bytes()
    available = sum(n.memory_bytes for n in usable)
    if not usable:
        reasons = sorted({x.code for x in excluded.values()})
        msg = (
            f"model {model.name!r} does not fit: no node can hold any of it "
            f"({', '.join(reasons) or 'no nodes'}); it needs {_fmt_bytes(required)} at "
            f"{model.context_tokens} tokens of context"
        )
        return Infeasible(
            msg, shortfall_bytes=required, max_context_tokens=0, required_bytes=required, available_bytes=0
        )
    nodes = {n.node_id: n for n in usable}
    shortfall = _least_overflow(CostModel(model), nodes, orders)
    fits_at = _max_context(model, nodes, orders)
    if fits_at > 0:
        tail = f"it fits with a context of at most {fits_at} tokens"
    else:
        tail = "even the weights alone do not fit"
    msg = (
        f"model {model.name!r} does not fit: it needs {_fmt_bytes(required)} at {model.context_tokens} tokens "
        f"of context, the {len(usable)} usable node(s) have {_fmt_bytes(available)}; "
        f"{_fmt_bytes(shortfall)} short; {tail}"
    )
    return Infeasible(
        msg,
        shortfall_bytes=shortfall,
        max_context_tokens=fits_at,
        required_bytes=required,
        available_bytes=available,
    )


def _least_overflow(cost: CostModel, nodes: dict[str, NodeSpec], orders) -> int:
    """Fewest bytes that do not fit, over the orders and every contiguous split (exact DP)."""
    best = math.inf
    for order in orders:
        keys, allowed = [], []
        for n in order:
            cap = nodes[n].memory_bytes
            over = np.where(cost.valid, np.maximum(cost.memory - cap, 0.0), math.inf)
            keys.append([np.ceil(over)])
            allowed.append(cost.valid.copy())
        sp = splits.lexicographic(keys, allowed)
        if sp is None:  # pragma: no cover - every split is allowed
            continue
        total = sum(
            max(0, cost.stage_memory(s, e) - nodes[n].memory_bytes) for n, (s, e) in zip(order, sp, strict=True)
        )
        best = min(best, total)
    return int(best)


def _fits(cost: CostModel, nodes: dict[str, NodeSpec], orders) -> bool:
    for order in orders:
        mats = [np.where(cost.fits(nodes[n]) & cost.valid, 0.0, math.inf) for n in order]
        if math.isfinite(splits.min_max(mats)):
            return True
    return False


def _max_context(model: ModelSpec, nodes: dict[str, NodeSpec], orders) -> int:
    """The largest context (tokens) below the target at which some order fits; binary search."""
    if not _fits(CostModel(model, 0), nodes, orders):
        return 0
    lo, hi = 0, model.context_tokens  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(CostModel(model, mid), nodes, orders):
            lo = mid
        else:
            hi = mid
    return lo


def _fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
