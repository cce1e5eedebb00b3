"""Exactness of the split searches against exhaustive enumeration on small instances.

The ring order is pinned so that only the split is searched; every contiguous split
(nodes may hold nothing) is enumerated and scored with formulas written here from the
issue's definitions, independently of the planner's cost matrices.
"""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ringlet.partitioning import Infeasible, LinkSpec, ModelSpec, NodeSpec, Policy, make_plan
from ringlet.partitioning.ring import Topology


def all_splits(k, L):
    """Every way to cut [0, L) into k contiguous, possibly empty, ranges."""
    for cuts in itertools.combinations_with_replacement(range(L + 1), k - 1):
        bounds = (0, *cuts, L)
        yield [(bounds[i], bounds[i + 1]) for i in range(k)]


def stage(m: ModelSpec, n: NodeSpec, s: int, e: int):
    """(memory, seconds per token) of [s, e) on n: the issue's definitions."""
    L = m.num_layers
    kv = sum(m.kv_bytes_per_token_per_layer[i] * m.context_tokens for i in range(s, e))
    embeds = s == 0 or (m.tie_word_embeddings and e == L)
    memory = sum(m.layer_bytes[s:e]) + kv + (m.embedding_bytes if embeds else 0) + (m.head_bytes if e == L else 0)
    head_read = (m.head_bytes + (m.embedding_bytes if m.tie_word_embeddings else 0)) if e == L else 0
    read = sum(m.layer_read_bytes[s:e]) + kv + head_read
    flops = sum(m.flops_per_token_per_layer[s:e]) + (m.head_flops_per_token if e == L else 0)
    return memory, read / n.bandwidth_bytes_per_s + flops / n.flops


@st.composite
def small(draw):
    L = draw(st.integers(1, 9))
    tied = draw(st.booleans())
    m = ModelSpec(
        layer_bytes=tuple(draw(st.lists(st.integers(1, 20), min_size=L, max_size=L))),
        embedding_bytes=draw(st.integers(0, 15)),
        head_bytes=0 if tied else draw(st.integers(0, 15)),
        tie_word_embeddings=tied,
        kv_bytes_per_token_per_layer=draw(st.integers(0, 2)),
        context_tokens=draw(st.integers(0, 3)),
        flops_per_token_per_layer=draw(st.sampled_from([0.0, 8.0])),
        head_flops_per_token=draw(st.sampled_from([0.0, 20.0])),
        activation_bytes_per_token=draw(st.sampled_from([0, 4000])),
    )
    k = draw(st.integers(1, 4))
    ids = ["p", "q", "r", "s"][:k]
    nodes = [
        NodeSpec(i, draw(st.integers(10, 120)), float(draw(st.integers(1, 5))), float(draw(st.sampled_from([1, 4]))))
        for i in ids
    ]
    links = [
        LinkSpec(a, b, draw(st.sampled_from([1e3, 1e9])), draw(st.sampled_from([1e-4, 0.5])))
        for a, b in itertools.combinations(ids, 2)
        if draw(st.booleans())
    ]
    order = tuple(draw(st.permutations(ids)))
    return m, nodes, links, order


@settings(max_examples=150, deadline=None)
@given(small())
def test_balanced_is_the_exact_min_max(instance):
    m, nodes, links, order = instance
    by_id = {n.node_id: n for n in nodes}
    best = None
    for sp in all_splits(len(order), m.num_layers):
        costs = [stage(m, by_id[x], s, e) for x, (s, e) in zip(order, sp, strict=True) if s < e]
        if all(mem <= by_id[x].memory_bytes for x, (mem, _) in zip([x for x, (s, e) in zip(order, sp, strict=True)
                                                                     if s < e], costs, strict=True)):
            worst = max(t for _, t in costs)
            best = worst if best is None else min(best, worst)
    try:
        plan = make_plan(nodes, links, m, policy=Policy(ring_order=order))
    except Infeasible:
        assert best is None
        return
    assert best is not None
    assert plan.max_stage_time_s == best


@settings(max_examples=150, deadline=None)
@given(small())
def test_latency_is_the_exact_minimum(instance):
    m, nodes, links, order = instance
    by_id = {n.node_id: n for n in nodes}
    policy = Policy(name="latency", ring_order=order)
    # The return hop is routed through the cluster's usable nodes: those that can hold at
    # least one layer (the smallest stage is a single layer: every term of a stage's memory
    # is non-negative). A node too small for any layer is out of the plan, so routes avoid it.
    usable = [x for x in order
              if any(stage(m, by_id[x], i, i + 1)[0] <= by_id[x].memory_bytes for i in range(m.num_layers))]
    topo = Topology(usable or order, links, policy, m.activation_bytes_per_token)
    best = None
    for sp in all_splits(len(order), m.num_layers):
        used = [(x, s, e) for x, (s, e) in zip(order, sp, strict=True) if s < e]
        costs = [stage(m, by_id[x], s, e) for x, s, e in used]
        if any(mem > by_id[x].memory_bytes for (x, _, _), (mem, _) in zip(used, costs, strict=True)):
            continue
        total = sum(t for _, t in costs)
        ring = [x for x, _, _ in used]
        total += sum(topo.forward(a, b).time_s for a, b in zip(ring, ring[1:], strict=False))
        if len(ring) > 1:
            total += topo.back(ring[-1], ring[0]).time_s
        best = total if best is None else min(best, total)
    try:
        plan = make_plan(nodes, links, m, policy=policy)
    except Infeasible:
        assert best is None
        return
    # Hop costs enter the search in whole nanoseconds: equal up to that rounding.
    assert abs(plan.latency_s - best) <= 1e-9 * (len(order) + 1)
