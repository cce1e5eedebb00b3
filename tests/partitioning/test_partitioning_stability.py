"""Re-sharding stability: the hand-worked join example, a leave, and a brute-force check
that among plans within the tolerance the planner loads the fewest bytes."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringlet.partitioning import ModelSpec, NodeSpec, Policy, make_plan, validate_plan

LAYER = 1000  # bytes per layer in the hand-worked examples


def model(layer_bytes):
    return ModelSpec(
        layer_bytes=tuple(layer_bytes),
        embedding_bytes=0,
        head_bytes=0,
        kv_bytes_per_token_per_layer=0,
        context_tokens=0,
        flops_per_token_per_layer=0,
    )


def equal(ids, memory=10**9):
    return [NodeSpec(i, memory, 1.0, 1.0) for i in ids]


@pytest.fixture
def abc_plan():
    """A, B, C hold 30 equal layers as [0, 10), [10, 20), [20, 30)."""
    plan = make_plan(equal("ABC"), [], model([LAYER] * 30), policy=Policy(ring_order=("A", "B", "C")))
    assert plan.ranges == (("A", 0, 10), ("B", 10, 20), ("C", 20, 30))
    return plan


def test_join_worked_example(abc_plan):
    # D joins. Best largest stage: ceil(30 / 4) = 8 layers. Keeping A [0, 8) and C [22, 30),
    # D between two old nodes takes 6 new layers and its neighbour loads 2: 8 layers in total.
    plan = make_plan(equal("ABCD"), [], model([LAYER] * 30), previous=abc_plan)
    validate_plan(plan, 30)
    assert max(s.num_layers for s in plan.stages) == 8
    assert plan.load_bytes == 8 * LAYER
    order = plan.ring_order
    assert order.index("D") not in (0, 3), "D is inserted between two existing nodes"
    assert [x for x in order if x != "D"] == ["A", "B", "C"]
    d = plan.stage_for("D")
    assert d.num_layers == 6 and d.load_bytes == 6 * LAYER
    assert sorted(s.load_bytes for s in plan.stages if s.node_id != "D") == [0, 0, 2 * LAYER]
    assert plan.stage_for("A").load_bytes == 0 and plan.stage_for("C").load_bytes == 0


def test_join_with_d_appended_loads_at_least_12_layers(abc_plan):
    # Old order with D appended: A [0, 8) 0, B [8, 16) loads 8-9, C [16, 24) loads 16-19,
    # D [24, 30) loads 6: 12 layers, the least possible in that order.
    pinned = Policy(ring_order=("A", "B", "C", "D"))
    plan = make_plan(equal("ABCD"), [], model([LAYER] * 30), previous=abc_plan, policy=pinned)
    assert plan.load_bytes >= 12 * LAYER
    assert plan.load_bytes == 12 * LAYER
    assert max(s.num_layers for s in plan.stages) == 8


def test_without_previous_everything_loads(abc_plan):
    plan = make_plan(equal("ABCD"), [], model([LAYER] * 30))
    assert plan.load_bytes == 30 * LAYER


def test_leave_keeps_the_survivors_in_place():
    # A, B, C, D hold 32 layers, 8 each; C leaves. Best largest stage: ceil(32 / 3) = 11.
    # A [0, a), B [a, b), D [b, 32): D needs b >= 21, B needs b - a <= 11, A needs a <= 11.
    # Loads: (a - 8) + (b - 16) + (24 - b) = a with a >= b - 11 >= 10: 10 layers at least,
    # reached by A [0, 10), B [10, 21), D [21, 32).
    prev = make_plan(equal("ABCD"), [], model([LAYER] * 32), policy=Policy(ring_order=tuple("ABCD")))
    assert [s.num_layers for s in prev.stages] == [8, 8, 8, 8]
    plan = make_plan(equal("ABD"), [], model([LAYER] * 32), previous=prev)
    assert plan.ranges == (("A", 0, 10), ("B", 10, 21), ("D", 21, 32))
    assert plan.load_bytes == 10 * LAYER


def test_previous_plan_for_another_model_reuses_nothing(abc_plan):
    other = ModelSpec(
        layer_bytes=(LAYER,) * 30, embedding_bytes=0, head_bytes=0, kv_bytes_per_token_per_layer=0,
        context_tokens=0, flops_per_token_per_layer=0, name="other",
    )
    plan = make_plan(equal("ABCD"), [], other, previous=abc_plan)
    assert plan.load_bytes == 30 * LAYER
    assert any("another model" in n for n in plan.notes)


def test_same_cluster_replans_to_the_same_plan(abc_plan):
    again = make_plan(equal("ABC"), [], model([LAYER] * 30), previous=abc_plan)
    assert again.plan_id == abc_plan.plan_id
    assert again.load_bytes == 0


# --- brute force ----------------------------------------------------------------------------


def _bf_splits(k, L, fits):
    """Every way to cut [0, L) into k contiguous (possibly empty) ranges, with pruning by ``fits``."""

    def rec(j, s):
        if j == k - 1:
            if fits(j, s, L):
                yield [(s, L)]
            return
        for e in range(s, L + 1):
            if not fits(j, s, e):
                break  # longer ranges only cost more
            for rest in rec(j + 1, e):
                yield [(s, e), *rest]

    yield from rec(0, 0)


def _brute_force(prev, nodes, layer_bytes, tol):
    """Over insertion orders (joiners anywhere in the old ring) and all contiguous splits:
    (best largest stage time, least bytes loaded among splits within the tolerance)."""
    by_id = {n.node_id: n for n in nodes}
    kept = list(prev.ring_order)
    joiners = sorted(set(by_id) - set(kept))
    orders = [tuple(kept)]
    for j in joiners:
        orders = [o[:i] + (j,) + o[i:] for o in orders for i in range(len(o) + 1)]
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    L = len(layer_bytes)
    held = {s.node_id: (s.start, s.end) for s in prev.stages}

    def stage_time(n, s, e):
        return (prefix[e] - prefix[s]) / n.bandwidth_bytes_per_s

    def load(nid, s, e):
        p, q = held.get(nid, (0, 0))
        lo, hi = max(s, p), min(e, q)
        return prefix[e] - prefix[s] - (prefix[hi] - prefix[lo] if hi > lo else 0)

    def splits(order, limit):
        """Every split of ``order`` whose stages fit in memory and take at most limit() each."""
        ns = [by_id[x] for x in order]

        def fits(j, s, e):
            return prefix[e] - prefix[s] <= ns[j].memory_bytes and stage_time(ns[j], s, e) <= limit()

        return ns, _bf_splits(len(order), L, fits)

    bound = [float("inf")]  # the best largest stage time so far (prunes the enumeration)
    for order in orders:
        ns, candidates = splits(order, lambda: bound[0])
        for sp in candidates:
            worst = max(stage_time(n, s, e) for n, (s, e) in zip(ns, sp, strict=True) if s < e)
            bound[0] = min(bound[0], worst)
    best = bound[0]
    window = best * (1.0 + tol)
    least = None
    for order in orders:
        _, candidates = splits(order, lambda: window)
        for sp in candidates:
            total = sum(load(x, s, e) for x, (s, e) in zip(order, sp, strict=True))
            least = total if least is None else min(least, total)
    return best, least


@st.composite
def join_instances(draw):
    n_old = draw(st.integers(1, 4))
    L = draw(st.integers(n_old + 1, 24))
    layer_bytes = draw(st.lists(st.integers(1, 9), min_size=L, max_size=L))
    total = sum(layer_bytes)
    ids = [f"n{i}" for i in range(n_old + 1)]
    nodes = [
        NodeSpec(
            i,
            draw(st.sampled_from([total, max(layer_bytes) * 3, total // 2 + 9])),
            float(draw(st.integers(1, 4))),
            1.0,
        )
        for i in ids
    ]
    order = draw(st.permutations(ids[:n_old]))
    tol = draw(st.sampled_from([0.0, 0.01, 0.1, 0.25]))
    prev_policy = draw(st.sampled_from(["memory", "balanced"]))
    return nodes, tuple(order), layer_bytes, tol, prev_policy


@settings(max_examples=60, deadline=None)
@given(join_instances())
def test_join_matches_brute_force(instance):
    nodes, old_order, layer_bytes, tol, prev_policy = instance
    m = model(layer_bytes)
    old = [n for n in nodes if n.node_id in old_order]
    try:
        prev = make_plan(old, [], m, policy=Policy(name=prev_policy, ring_order=old_order))
    except ValueError:
        return  # the old cluster could not hold the model: nothing to re-shard
    plan = make_plan(nodes, [], m, previous=prev, policy=Policy(tolerance=tol))
    validate_plan(plan, len(layer_bytes))
    best, least = _brute_force(prev, nodes, layer_bytes, tol)
    if any("re-chosen" in n for n in plan.notes):
        # Re-choosing the ring is only allowed when it beats every kept-ring plan by more than tol.
        assert plan.max_stage_time_s < best
    else:
        assert plan.max_stage_time_s <= best * (1.0 + tol)
        assert plan.load_bytes == least


def test_join_brute_force_40_layers_5_nodes():
    rng = random.Random(5)
    layer_bytes = [rng.randint(1, 9) for _ in range(40)]
    nodes = [NodeSpec(f"n{i}", 10**6, float(b), 1.0) for i, b in enumerate([2, 3, 1, 2, 4])]
    m = model(layer_bytes)
    prev = make_plan(nodes[:4], [], m, policy=Policy(name="memory", ring_order=("n2", "n0", "n3", "n1")))
    for tol in (0.0, 0.05):
        plan = make_plan(nodes, [], m, previous=prev, policy=Policy(tolerance=tol))
        best, least = _brute_force(prev, nodes, layer_bytes, tol)
        if not any("re-chosen" in n for n in plan.notes):
            assert plan.max_stage_time_s <= best * (1 + tol)
            assert plan.load_bytes == least


def test_brute_force_helper_enumerates_every_split():
    # 3 ranges over 4 layers (empty allowed): C(4 + 2, 2) = 15 splits.
    assert len(list(_bf_splits(3, 4, lambda j, s, e: True))) == 15
    assert sum(1 for _ in itertools.combinations_with_replacement(range(5), 2)) == 15


def test_insertion_orders():
    from ringlet.partitioning.stability import insertion_orders

    # One joiner: every position of the kept ring, front first.
    assert insertion_orders(("a", "b"), {"a", "b", "x"}, cap=720) == [("x", "a", "b"), ("a", "x", "b"), ("a", "b", "x")]
    # Two joiners into two kept nodes: 3 x 4 = 12 interleavings, all distinct, kept order preserved.
    two = insertion_orders(("a", "b"), {"a", "b", "x", "y"}, cap=720)
    assert len(two) == len(set(two)) == 12
    assert all([n for n in o if n in "ab"] == ["a", "b"] for o in two)
    # Over the cap: the joiners move as one block.
    assert insertion_orders(("a", "b"), {"a", "b", "x", "y"}, cap=11) == [
        ("x", "y", "a", "b"), ("a", "x", "y", "b"), ("a", "b", "x", "y")]
    # Nobody left from the old ring.
    assert insertion_orders(("a",), {"x"}, cap=720) is None


@pytest.mark.parametrize(("b_to_c", "kept"), [(7e9, True), (5.1e9, True), (4.9e9, False)])
def test_the_ring_is_kept_unless_its_slowest_link_is_twice_as_slow(b_to_c, kept):
    """A re-measured link changes the best ring only when the kept ring's slowest forward
    link is at least 2x slower: A-B and A-C at 10 GB/s; the kept ring A, B, C runs over
    B-C, the ring B, A, C avoids it (bottleneck 10 GB/s: 1.43x, 1.96x and 2.04x B-C's, by hand)."""
    from ringlet.partitioning import LinkSpec

    nodes = [NodeSpec(i, 10**6, 1.0, 1.0) for i in "ABC"]
    m = model([1] * 12)
    prev = make_plan(nodes, [], m, policy=Policy(ring_order=("A", "B", "C")))
    links = [LinkSpec("A", "B", 10e9, 1e-4), LinkSpec("A", "C", 10e9, 1e-4), LinkSpec("B", "C", b_to_c, 1e-4)]
    plan = make_plan(nodes, links, m, previous=prev)
    validate_plan(plan, 12)
    if kept:
        assert plan.ring_order == ("A", "B", "C") and not any("re-chosen" in n for n in plan.notes), plan.notes
    else:
        assert plan.ring_order != ("A", "B", "C")
        assert any("at least 2x slower" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize(("c_speed", "kept"), [(0.97, True), (0.8, False)])
def test_the_ring_is_kept_through_a_few_percent_of_measurement_noise(c_speed, kept):
    """A node re-measured a few percent slower must not swap stages (CI saw a ring re-chosen
    right after a join on 1-2 % of probe noise: 425 MB re-read to gain nothing); a node
    really slower does. Three layers of 100 B, a 10 B head read by the last stage, bandwidth
    1 B/s except C's. Kept ring A, B, C: C reads 110 B, max(100, 100, 110 / c). The best ring
    puts C first: max(100 / c, 100, 110). By hand: c = 0.97 -> 113.40 against 110.00, 3.1 %
    worse (under the 5 % a re-chosen ring must gain); c = 0.8 -> 137.5 against 125, 10 %."""
    m = ModelSpec(layer_bytes=(100, 100, 100), embedding_bytes=0, head_bytes=10,
                  kv_bytes_per_token_per_layer=0, context_tokens=0, flops_per_token_per_layer=0)
    policy = Policy(prefill_share=0.0)
    prev = make_plan(equal("ABC", 10**6), [], m, policy=Policy(ring_order=("A", "B", "C"), prefill_share=0.0))
    assert prev.ranges == (("A", 0, 1), ("B", 1, 2), ("C", 2, 3))
    nodes = [NodeSpec("A", 10**6, 1.0, 1.0), NodeSpec("B", 10**6, 1.0, 1.0), NodeSpec("C", 10**6, c_speed, 1.0)]
    plan = make_plan(nodes, [], m, previous=prev, policy=policy)
    validate_plan(plan, 3)
    if kept:
        assert plan.ranges == prev.ranges and plan.load_bytes == 0, plan.notes
        assert plan.max_stage_time_s == pytest.approx(110 / c_speed)
    else:
        assert plan.ring_order[0] == "C", plan.notes
        assert plan.max_stage_time_s == pytest.approx(125.0)
        assert any("10.0% worse than the best plan (more than 5.0%)" in n for n in plan.notes), plan.notes
