"""Several models in pooled memory (``place_models``, issue #45): hand-worked placements,
the reasons a model is left out, the per-model overhead, stickiness, and properties over
generated clusters (the memory invariant, priority, and the rule itself).

In the hand-worked examples every layer weighs 100 bytes and reads 100 bytes, there is
no KV cache, no embedding or head and no compute term, and every node reads 1 byte/s: a
stage of n layers takes 100 n seconds per token and 100 n bytes, so the balanced policy
minimises the largest number of layers on one node, within each node's memory.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringlet.partitioning import (
    Infeasible,
    LinkSpec,
    ModelSpec,
    NodeSpec,
    Placement,
    Plan,
    Policy,
    make_plan,
    place_models,
    validate_plan,
)

LAYER = 100  # bytes per layer in the hand-worked examples


def model(name, layers):
    return ModelSpec(
        layer_bytes=(LAYER,) * layers,
        embedding_bytes=0,
        head_bytes=0,
        kv_bytes_per_token_per_layer=0,
        context_tokens=0,
        flops_per_token_per_layer=0,
        name=name,
    )


def nodes(**memory):
    return [NodeSpec(node_id, m, 1.0, 1.0) for node_id, m in memory.items()]


def layout(plan):
    """node -> (layers, memory bytes, capacity bytes): independent of the ring's rotation."""
    return {s.node_id: (s.num_layers, s.memory_bytes, s.capacity_bytes) for s in plan.stages}


def test_the_second_model_gets_what_the_first_leaves():
    # X (4 layers) on A (1000 B) and B (600 B): 2 + 2 layers (largest stage 2; 3 + 1 is worse),
    # 200 B each -- the plan X gets alone. Left: A 800, B 400.
    # Y (12 layers) on the remainder: B holds at most 4 layers (400 B), so A holds at least
    # 8 (800 B, all it has left); 8 + 4 is the only split. Left: A 0, B 0.
    pool = nodes(A=1000, B=600)
    p = place_models(pool, [], [model("x", 4), model("y", 12)])
    assert p.priority == ("x", "y") and list(p.plans) == ["x", "y"] and p.left_out == {}
    assert layout(p.plans["x"]) == {"A": (2, 200, 1000), "B": (2, 200, 600)}
    assert p.plans["x"].plan_id == make_plan(pool, [], model("x", 4)).plan_id
    assert layout(p.plans["y"]) == {"A": (8, 800, 800), "B": (4, 400, 400)}
    assert p.memory_bytes == {"A": 1000, "B": 600}
    assert p.memory_left == {"A": 0, "B": 0}
    assert p.used_bytes("y") == {"A": 800, "B": 400}


def test_a_node_the_first_model_fills_is_left_out_of_the_second_ring():
    # X (9 layers) on A, B (1000 B) and C (300 B): 3 + 3 + 3 layers, 300 B each; C is full.
    # Y (10 layers) on A (700 left) and B (700 left): 5 + 5 layers, 500 B each; C offers 0
    # and is left out as a node without memory. Left: A 200, B 200, C 0.
    p = place_models(nodes(A=1000, B=1000, C=300), [], [model("x", 9), model("y", 10)])
    assert layout(p.plans["x"]) == {"A": (3, 300, 1000), "B": (3, 300, 1000), "C": (3, 300, 300)}
    assert layout(p.plans["y"]) == {"A": (5, 500, 700), "B": (5, 500, 700)}
    assert [(x.node_id, x.code) for x in p.plans["y"].excluded] == [("C", "zero_memory")]
    assert p.memory_left == {"A": 200, "B": 200, "C": 0}


def test_the_overhead_is_charged_on_every_node_a_model_runs_on():
    # 100 B per model per node. X is offered A 900, B 500: 2 + 2 layers (200 B each), using
    # 300 B on each node. Left: A 700, B 300. Y (8 layers) is offered A 600, B 200: B holds
    # at most 2 layers, A at most 6: 6 + 2. Uses A 700, B 300. Left: A 0, B 0.
    p = place_models(nodes(A=1000, B=600), [], [model("x", 4), model("y", 8)], per_model_overhead_bytes=100)
    assert layout(p.plans["x"]) == {"A": (2, 200, 900), "B": (2, 200, 500)}
    assert layout(p.plans["y"]) == {"A": (6, 600, 600), "B": (2, 200, 200)}
    assert p.used_bytes("x") == {"A": 300, "B": 300} and p.used_bytes("y") == {"A": 700, "B": 300}
    assert p.memory_left == {"A": 0, "B": 0} and p.overhead_bytes == 100


def test_the_overhead_leaves_out_a_node_with_less_left():
    # X (6 layers) on A (1000 B) and B (250 B), overhead 100: B is offered 150, one layer;
    # A is offered 900. Largest stage: A 5 + B 1 (B cannot take 3). Uses A 600, B 200; left
    # A 400, B 50. Y (2 layers): B offers max(0, 50 - 100) = 0 and is left out; A (300
    # offered) holds both layers, 200 B. Left: A 100, B 50.
    p = place_models(nodes(A=1000, B=250), [], [model("x", 6), model("y", 2)], per_model_overhead_bytes=100)
    assert layout(p.plans["x"]) == {"A": (5, 500, 900), "B": (1, 100, 150)}
    assert layout(p.plans["y"]) == {"A": (2, 200, 300)}
    assert p.memory_left == {"A": 100, "B": 50}


def test_a_lower_model_that_does_not_fit_is_left_out_and_a_smaller_one_still_placed():
    # X: 2 + 2 layers as above, left A 800, B 400 (1200 B). Y (14 layers, 1400 B) does not
    # fit there: with a layers on A and 14 - a on B the overflow is max(0, 100 a - 800) +
    # max(0, 100 (14 - a) - 400), least at a = 8, 9 or 10: 200 B short. On the whole pool
    # (1000 + 600) it fits (10 + 4). Y takes nothing; Z (2 layers) gets 1 + 1 of the 800 /
    # 400 left. Left: A 700, B 300.
    p = place_models(nodes(A=1000, B=600), [], [model("x", 4), model("y", 14), model("z", 2)])
    assert list(p.plans) == ["x", "z"] and list(p.left_out) == ["y"]
    reason = p.left_out["y"]
    assert reason.startswith("model 'y' does not fit beside 'x': it needs 1.40 kB")
    assert "the 2 usable node(s) have 1.20 kB; 200 B short" in reason
    assert reason.endswith("It fits on the whole pool: it would fit if the models before it left 200 B more "
                           "on the nodes it needs")
    assert layout(p.plans["z"]) == {"A": (1, 100, 800), "B": (1, 100, 400)}
    assert p.memory_left == {"A": 700, "B": 300}


def test_a_model_too_big_even_alone_says_so():
    # Y (17 layers, 1700 B) > A + B (1600 B): at most 10 + 6 layers, 100 B short even alone.
    p = place_models(nodes(A=1000, B=600), [], [model("x", 4), model("y", 17)])
    reason = p.left_out["y"]
    assert reason.startswith("model 'y' does not fit: it needs 1.70 kB")
    assert "the 2 usable node(s) have 1.60 kB; 100 B short" in reason
    assert reason.endswith("(even without the models before it)")


def test_a_higher_model_is_never_left_out_for_a_lower_one():
    # X (17 layers) does not fit the pool; it is left out with the single-model planner's
    # message (no model before it), and Y gets the whole pool: 2 + 2 of 1000 / 600.
    pool = nodes(A=1000, B=600)
    p = place_models(pool, [], [model("x", 17), model("y", 4)])
    with pytest.raises(Infeasible) as alone:
        make_plan(pool, [], model("x", 17))
    assert p.left_out == {"x": alone.value.message}
    assert layout(p.plans["y"]) == {"A": (2, 200, 1000), "B": (2, 200, 600)}
    assert p.memory_left == {"A": 800, "B": 400}


def test_previous_plans_keep_every_ring_on_an_unchanged_cluster():
    # On three equal nodes every ring order ties, so the previous rings (pinned when they
    # were made: C B A for x, B A C for y) are kept and nothing is loaded: 2 + 2 + 2 layers
    # each, in the same ranges.
    pool = nodes(A=1000, B=1000, C=1000)
    x, y = model("x", 6), model("y", 6)
    before = {"x": make_plan(pool, [], x, policy=Policy(ring_order=("C", "B", "A"))),
              "y": make_plan(pool, [], y, policy=Policy(ring_order=("B", "A", "C")))}
    p = place_models(pool, [], [x, y], previous=before)
    assert p.plans["x"].ranges == (("C", 0, 2), ("B", 2, 4), ("A", 4, 6))
    assert p.plans["y"].ranges == (("B", 0, 2), ("A", 2, 4), ("C", 4, 6))
    assert p.plans["x"].load_bytes == 0 and p.plans["y"].load_bytes == 0
    again = place_models(pool, [], [x, y], previous=p.plans)
    assert [q.plan_id for q in again.plans.values()] == [q.plan_id for q in p.plans.values()]


def test_to_dict_round_trips_through_json():
    p = place_models(nodes(A=1000, B=600), [], [model("x", 4), model("y", 14), model("z", 2)],
                     per_model_overhead_bytes=10)
    data = json.loads(json.dumps(p.to_dict()))
    assert data["priority"] == ["x", "y", "z"] and set(data["plans"]) == {"x", "z"}
    assert Placement.from_dict(data) == p


def test_bad_inputs():
    pool = nodes(A=1000)
    with pytest.raises(ValueError, match="duplicate model name 'x'"):
        place_models(pool, [], [model("x", 1), model("x", 2)])
    with pytest.raises(ValueError, match="duplicate node_id 'A'"):
        place_models(pool + pool, [], [model("x", 1)])
    with pytest.raises(ValueError, match="per_model_overhead_bytes"):
        place_models(pool, [], [model("x", 1)], per_model_overhead_bytes=-1)
    with pytest.raises(TypeError, match="models\\[0\\]"):
        place_models(pool, [], ["x"])
    with pytest.raises(TypeError, match="previous\\['x'\\]"):
        place_models(pool, [], [model("x", 1)], previous={"x": "plan"})
    assert place_models(pool, [], []).memory_left == {"A": 1000}


# --- properties ---------------------------------------------------------------------------

IDS = ["alpha", "bravo", "charlie", "delta"]


@st.composite
def clusters(draw):
    n = draw(st.integers(1, 4))
    pool = [NodeSpec(IDS[i], draw(st.sampled_from([0, 40, 150, 400, 1000])), float(draw(st.integers(1, 4))),
                     float(draw(st.sampled_from([10, 1000])))) for i in range(n)]
    links = [LinkSpec(IDS[i], IDS[j], draw(st.sampled_from([1e6, 1e9])), 1e-4)
             for i in range(n) for j in range(i + 1, n) if draw(st.booleans())]
    models = []
    for k in range(draw(st.integers(1, 3))):
        L = draw(st.integers(1, 8))
        models.append(ModelSpec(
            layer_bytes=tuple(draw(st.lists(st.integers(1, 60), min_size=L, max_size=L))),
            embedding_bytes=draw(st.integers(0, 20)),
            head_bytes=draw(st.integers(0, 20)),
            kv_bytes_per_token_per_layer=draw(st.integers(0, 2)),
            context_tokens=draw(st.integers(0, 8)),
            flops_per_token_per_layer=10.0,
            name=f"m{k}",
        ))
    overhead = draw(st.sampled_from([0, 5, 50]))
    return pool, links, models, overhead


def offered(pool, placement, names, overhead):
    """The nodes as model ``names[-1]`` is offered them: memory less what the placed models
    before it use, less the overhead (recomputed from the placement's plans)."""
    out = []
    for n in pool:
        used = sum(s.memory_bytes + overhead for name in names[:-1] if name in placement.plans
                   for s in placement.plans[name].stages if s.node_id == n.node_id)
        out.append(NodeSpec(n.node_id, max(0, n.memory_bytes - used - overhead), n.bandwidth_bytes_per_s, n.flops))
    return out


@settings(max_examples=80, deadline=None)
@given(clusters())
def test_placement_properties(cluster):
    pool, links, models, overhead = cluster
    p = place_models(pool, links, models, per_model_overhead_bytes=overhead)
    names = [m.name for m in models]
    assert p.priority == tuple(names)
    assert set(p.plans) | set(p.left_out) == set(names) and not set(p.plans) & set(p.left_out)
    assert list(p.plans) + list(p.left_out) != [] and all(r for r in p.left_out.values())

    # Every node holds at most its memory: the placed models' stages + overheads, summed.
    for n in pool:
        used = sum(p.used_bytes(name).get(n.node_id, 0) for name in p.plans)
        assert used <= n.memory_bytes
        assert p.memory_left[n.node_id] == n.memory_bytes - used >= 0

    # The rule: model i is planned by make_plan on what the placed models before it leave;
    # a model left out does not fit there (so it never yields to a lower-priority one).
    for i, m in enumerate(models):
        try:
            alone = make_plan(offered(pool, p, names[: i + 1], overhead), links, m)
        except Infeasible:
            assert m.name in p.left_out
            continue
        assert p.plans[m.name].plan_id == alone.plan_id
        validate_plan(p.plans[m.name], m.num_layers, [n.node_id for n in pool])

    # Removing lower-priority models changes nothing above them.
    for k in range(len(models)):
        head = place_models(pool, links, models[:k], per_model_overhead_bytes=overhead)
        assert {n: q.plan_id for n, q in head.plans.items()} == {
            n: q.plan_id for n, q in p.plans.items() if n in names[:k]}
        assert head.left_out == {n: r for n, r in p.left_out.items() if n in names[:k]}

    # The same for the nodes and links in any order; JSON round-trips.
    again = place_models(pool[::-1], links[::-1], models, per_model_overhead_bytes=overhead)
    assert again.to_dict() == p.to_dict()
    assert Placement.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert all(isinstance(q, Plan) for q in p.plans.values())
