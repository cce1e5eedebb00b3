"""Ring order from the link graph: daisy chains, bottleneck links, exactness, determinism."""

import itertools
import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringlet.partitioning import LinkSpec, ModelSpec, NodeSpec, Policy, make_plan
from ringlet.partitioning.ring import Topology

TB5 = 10e9  # 80 Gb/s in bytes/s
TB4 = 5e9  # 40 Gb/s


def model(layers=8, activation=14336):
    return ModelSpec(
        layer_bytes=(100,) * layers,
        embedding_bytes=0,
        head_bytes=0,
        kv_bytes_per_token_per_layer=0,
        context_tokens=0,
        flops_per_token_per_layer=0,
        activation_bytes_per_token=activation,
    )


def nodes(ids, memory=10_000):
    return [NodeSpec(i, memory, 1e9, 1e12) for i in ids]


def forward_bandwidths(plan):
    return [h.bandwidth_bytes_per_s for h in plan.hops if not h.returns]


def test_daisy_chain_gives_the_chain_order():
    links = [LinkSpec("C", "B", TB5, 5e-5, "tb5"), LinkSpec("A", "B", TB5, 5e-5, "tb5"),
             LinkSpec("D", "C", TB5, 5e-5, "tb5")]
    plan = make_plan(nodes("DBAC"), links, model())
    assert plan.ring_order in (("A", "B", "C", "D"), ("D", "C", "B", "A"))
    assert [h.kind for h in plan.hops] == ["direct", "direct", "direct", "routed"]
    back = plan.hops[-1]
    # The token goes back along the chain (3 x 50 us) rather than over the 1 ms default network.
    assert back.path == tuple(reversed(plan.ring_order))
    assert back.latency_s == pytest.approx(3 * 5e-5)


def test_slowest_link_is_maximised():
    # Two TB5 links (A-B, B-C) and one TB4 link (A-C). The forward hops must both be TB5
    # (A-B-C or C-B-A); the TB4 link may only carry the token back.
    links = [LinkSpec("A", "B", TB5, 5e-5, "tb5"), LinkSpec("B", "C", TB5, 5e-5, "tb5"),
             LinkSpec("A", "C", TB4, 5e-5, "tb4")]
    plan = make_plan(nodes("ABC"), links, model())
    assert plan.ring_order in (("A", "B", "C"), ("C", "B", "A"))
    assert min(forward_bandwidths(plan)) == TB5
    assert plan.hops[-1].kind == "direct" and plan.hops[-1].bandwidth_bytes_per_s == TB4


def test_bandwidth_beats_latency():
    # The TB4 link has a lower latency, but using it forward would make it the bottleneck.
    links = [LinkSpec("A", "B", TB5, 1e-4, "tb5"), LinkSpec("B", "C", TB5, 1e-4, "tb5"),
             LinkSpec("C", "D", TB5, 1e-4, "tb5"), LinkSpec("A", "C", TB4, 1e-6, "tb4"),
             LinkSpec("B", "D", TB4, 1e-6, "tb4")]
    plan = make_plan(nodes("ABCD"), links, model())
    assert min(forward_bandwidths(plan)) == TB5
    assert plan.ring_order in (("A", "B", "C", "D"), ("D", "C", "B", "A"))


def test_tb5_cycle_beats_cycles_through_tb4_chords():
    # A TB5 4-cycle A-B-C-D-A plus two TB4 chords (A-C, B-D) with lower latency. The Hamiltonian
    # cycles through a chord use a TB4 link; the planner keeps every hop, the return included, on TB5.
    links = [LinkSpec(a, b, TB5, 1e-4, "tb5") for a, b in ("AB", "BC", "CD", "DA")]
    links += [LinkSpec("A", "C", TB4, 1e-6, "tb4"), LinkSpec("B", "D", TB4, 1e-6, "tb4")]
    plan = make_plan(nodes("ABCD"), links, model())
    assert [h.bandwidth_bytes_per_s for h in plan.hops] == [TB5] * 4
    assert all(h.kind == "direct" for h in plan.hops)


def test_full_cycle_prefers_direct_return():
    # A 4-cycle of TB5 links: every forward hop and the return are direct.
    links = [LinkSpec(a, b, TB5, 5e-5, "tb5") for a, b in ("AB", "BC", "CD", "DA")]
    plan = make_plan(nodes("ABCD"), links, model())
    assert all(h.kind == "direct" for h in plan.hops)
    assert plan.ring_order == ("A", "B", "C", "D")  # the id-smallest of the 8 equivalent orders


def test_a_slow_direct_link_loses_to_the_default_network():
    # A 1 MB/s cable is worse than the 1 GbE default network for 14 KB hidden states.
    links = [LinkSpec("A", "B", 1e6, 1e-5, "usb")]
    plan = make_plan(nodes("AB"), links, model())
    assert plan.hops[0].kind == "fallback"


def _brute_force_key(topo, ids):
    best = None
    for perm in itertools.permutations(ids):
        k = topo.key(perm)
        rank = (-k.bottleneck_bytes_per_s, k.total_ns)
        if best is None or rank < best:
            best = rank
    return best


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 6), seed=st.integers(0, 10**6))
def test_exact_ring_order_matches_brute_force(n, seed):
    rng = random.Random(seed)
    ids = [f"n{i}" for i in range(n)]
    links = [
        LinkSpec(a, b, rng.choice([TB4, TB5, 2e9]), rng.choice([5e-5, 1e-4, 3e-4]))
        for a, b in itertools.combinations(ids, 2)
        if rng.random() < 0.6
    ]
    topo = Topology(ids, links, Policy(), 14336)
    k = topo.key(topo.best_order())
    assert (-k.bottleneck_bytes_per_s, k.total_ns) == _brute_force_key(topo, ids)


def test_ring_order_is_deterministic_under_permutation():
    rng = random.Random(7)
    ids = [f"n{i}" for i in range(7)]
    links = [LinkSpec(a, b, rng.choice([TB4, TB5]), 5e-5) for a, b in itertools.combinations(ids, 2)
             if rng.random() < 0.5]
    first = make_plan(nodes(ids), links, model(14)).ring_order
    for _ in range(5):
        shuffled_ids = ids[:]
        rng.shuffle(shuffled_ids)
        shuffled_links = [LinkSpec(x.b, x.a, x.bandwidth_bytes_per_s, x.latency_s) for x in links]
        rng.shuffle(shuffled_links)
        assert make_plan(nodes(shuffled_ids), shuffled_links, model(14)).ring_order == first


def test_approximation_finds_a_cabled_ring_beyond_ten_nodes():
    # 14 nodes cabled in a ring in a scrambled id order; the default network is 1 GbE.
    rng = random.Random(3)
    ids = [f"n{i:02d}" for i in range(14)]
    cycle = ids[:]
    rng.shuffle(cycle)
    links = [LinkSpec(cycle[i], cycle[(i + 1) % 14], TB5, 5e-5, "tb5") for i in range(14)]
    plan = make_plan(nodes(ids), links, model(28))
    assert len(plan.stages) == 14
    assert min(forward_bandwidths(plan)) == TB5
    assert plan.hops[-1].kind == "direct"


def test_exact_ring_for_ten_nodes_is_fast():
    rng = random.Random(11)
    ids = [f"n{i}" for i in range(10)]
    links = [LinkSpec(a, b, rng.choice([TB4, TB5, 2e9]), rng.choice([5e-5, 1e-4]))
             for a, b in itertools.combinations(ids, 2) if rng.random() < 0.5]
    t = time.perf_counter()
    topo = Topology(ids, links, Policy(), 14336)
    order = topo.best_order()
    assert time.perf_counter() - t < 1.0
    assert sorted(order) == ids
    assert math.isfinite(topo.key(order).bottleneck_bytes_per_s)
