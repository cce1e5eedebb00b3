"""Policies: exo's expected values (memory), exo's legacy failure cases, balanced and
latency on hand-worked instances, and the structured Infeasible error.

Every expected number below comes from the issue (exo's own tests) or is worked out
by hand in the comment next to it.
"""

import pytest

from ringlet.partitioning import (
    Infeasible,
    LinkSpec,
    ModelSpec,
    NodeSpec,
    Policy,
    make_plan,
    validate_plan,
)

GB = 10**9


def model(layers, layer_bytes=1, **kw):
    kw.setdefault("embedding_bytes", 0)
    kw.setdefault("head_bytes", 0)
    kw.setdefault("kv_bytes_per_token_per_layer", 0)
    kw.setdefault("context_tokens", 0)
    kw.setdefault("flops_per_token_per_layer", 0)
    return ModelSpec(layer_bytes=(layer_bytes,) * layers, **kw)


def node(node_id, memory, bandwidth=1.0, flops=1.0):
    return NodeSpec(node_id, memory, bandwidth, flops)


def counts(plan):
    return {s.node_id: s.num_layers for s in plan.stages}


# --- memory policy: exo parity ----------------------------------------------------------


@pytest.mark.parametrize(
    ("memories", "layers", "expected"),
    [
        ((250, 250, 250, 250), 12, (3, 3, 3, 3)),  # four nodes at 0.25 each
        ((500, 500, 1000), 12, (3, 3, 6)),
        ((312, 518, 1024), 12, (2, 3, 7)),
        ((7800, 100, 100), 20, (18, 1, 1)),  # 0.975 / 0.0125 / 0.0125
    ],
)
def test_memory_policy_matches_exo(memories, layers, expected):
    nodes = [node(chr(ord("A") + i), m) for i, m in enumerate(memories)]
    plan = make_plan(nodes, [], model(layers), policy=Policy(name="memory"))
    validate_plan(plan, layers)
    assert counts(plan) == {n.node_id: c for n, c in zip(nodes, expected, strict=True)}


def test_memory_policy_falls_back_when_the_proportional_split_overflows():
    # 10 layers of 10 B, embedding 20 B (first stage). A has 95 B, B has 30 B.
    # exo's counts in order A, B: 10 * 95/125 = 7.6 -> 8 and 2: A needs 20 + 80 = 100 > 95.
    # In order B, A: 2 and 8: B needs 20 + 20 = 40 > 30. exo would fail.
    # Memory-balanced split in order A, B: A [0, e) needs 20 + 10e <= 95 -> e <= 7;
    # B needs 10 (10 - e) <= 30 -> e >= 7. So A 7 layers, B 3.
    m = model(10, 10, embedding_bytes=20)
    plan = make_plan([node("A", 95), node("B", 30)], [], m, policy=Policy(name="memory"))
    assert counts(plan) == {"A": 7, "B": 3}
    assert any("overflows" in n for n in plan.notes)


def test_memory_policy_is_proportional_regardless_of_speed():
    # exo ignores speed: a 10x faster node with the same memory still gets the same share.
    nodes = [node("A", 100, bandwidth=10.0), node("B", 100, bandwidth=1.0)]
    plan = make_plan(nodes, [], model(10), policy=Policy(name="memory"))
    assert counts(plan) == {"A": 5, "B": 5}


# --- exo's legacy failure cases -----------------------------------------------------------


@pytest.mark.parametrize("policy", ["balanced", "memory", "latency"])
def test_512_8_8_gb_with_16_layers_gives_a_plan(policy):
    # 16 layers of 20 GB: the 8 GB nodes cannot hold one layer; the 512 GB node holds all 320 GB.
    nodes = [node("big", 512 * GB), node("s1", 8 * GB), node("s2", 8 * GB)]
    plan = make_plan(nodes, [], model(16, 20 * GB), policy=Policy(name=policy))
    validate_plan(plan, 16)
    assert plan.ranges == (("big", 0, 16),)
    assert {x.node_id: x.code for x in plan.excluded} == {"s1": "too_small", "s2": "too_small"}
    assert all(x.reason for x in plan.excluded)


def test_512_8_8_gb_when_small_nodes_fit_a_layer():
    # 16 layers of 4 GB. exo's counts: 512/528 * 16 = 15.52 -> floors 15, 0, 0; the spare layer
    # goes to the largest remainder (0.52) -> 16, 0, 0; each 0 takes one from the largest -> 14, 1, 1.
    nodes = [node("big", 512 * GB), node("s1", 8 * GB), node("s2", 8 * GB)]
    mem = make_plan(nodes, [], model(16, 4 * GB), policy=Policy(name="memory"))
    assert counts(mem) == {"big": 14, "s1": 1, "s2": 1}
    # Balanced (equal speeds): a small node holds at most 2 layers (8 GB / 4 GB), so the
    # best largest stage is 16 - 2 - 2 = 12 layers on the big node.
    bal = make_plan(nodes, [], model(16, 4 * GB))
    assert max(counts(bal).values()) == 12
    assert bal.max_stage_time_s == 12 * 4 * GB / 1.0
    assert bal.max_stage_time_s < mem.max_stage_time_s


@pytest.mark.parametrize("policy", ["balanced", "memory", "latency"])
def test_a_node_with_zero_memory_is_left_out(policy):
    nodes = [node("A", 100), node("Z", 0), node("B", 100)]
    plan = make_plan(nodes, [], model(6), policy=Policy(name=policy))
    validate_plan(plan, 6)
    assert "Z" not in plan.ring_order
    (z,) = [x for x in plan.excluded if x.node_id == "Z"]
    assert z.code == "zero_memory"


@pytest.mark.parametrize("policy", ["balanced", "memory", "latency"])
def test_five_equal_nodes_three_layers(policy):
    nodes = [node(f"n{i}", 100) for i in range(5)]
    plan = make_plan(nodes, [], model(3), policy=Policy(name=policy))
    validate_plan(plan, 3)
    if policy != "latency":  # latency may legitimately use fewer nodes (fewer hops)
        assert len(plan.stages) == 3
        assert all(s.num_layers == 1 for s in plan.stages)
    # Every node left out is there because there are more nodes than layers.
    assert [x.code for x in plan.excluded] == ["too_many_nodes"] * (5 - len(plan.stages))
    assert all("more usable nodes (5) than layers (3)" in x.reason for x in plan.excluded)


@pytest.mark.parametrize("policy", ["balanced", "memory", "latency"])
def test_all_memory_zero_is_a_clear_error(policy):
    nodes = [node("A", 0), node("B", 0)]
    m = model(4, 10, embedding_bytes=5, head_bytes=3, kv_bytes_per_token_per_layer=2, context_tokens=10)
    with pytest.raises(Infeasible) as err:
        make_plan(nodes, [], m, policy=Policy(name=policy))
    e = err.value
    assert isinstance(e, ValueError)
    # Required: 4 x 10 + 5 + 3 + 4 layers x 2 B x 10 tokens = 128 bytes, none available.
    assert e.required_bytes == 128
    assert e.shortfall_bytes == 128
    assert e.available_bytes == 0
    assert e.max_context_tokens == 0
    assert "does not fit" in str(e) and "zero_memory" in str(e)


# --- Infeasible: shortfall and the largest context that fits -------------------------------


def test_infeasible_reports_shortfall_and_max_context():
    # 2 layers of 60 B, KV 1 B per token per layer, target context 20 tokens: a stage of one
    # layer needs 80 B. Two nodes of 75 B: one layer each needs 80 > 75 (5 short each, 10 in
    # total); one node holding both needs 160 (85 short). Shortfall = 10.
    # Largest context c with 60 + c <= 75: c = 15.
    m = model(2, 60, kv_bytes_per_token_per_layer=1, context_tokens=20)
    with pytest.raises(Infeasible) as err:
        make_plan([node("A", 75), node("B", 75)], [], m)
    e = err.value
    assert e.shortfall_bytes == 10
    assert e.max_context_tokens == 15
    assert e.required_bytes == 160
    assert e.available_bytes == 150
    assert "15 tokens" in e.message


def test_infeasible_when_the_weights_alone_do_not_fit():
    # 3 layers of 60 B on two 100 B nodes: one node must hold two layers (120 B, 20 short).
    m = model(3, 60, kv_bytes_per_token_per_layer=1, context_tokens=4)
    with pytest.raises(Infeasible) as err:
        make_plan([node("A", 100), node("B", 100)], [], m)
    # With 4 tokens: stages of 64 B per layer; best split 1 + 2 layers: 128 - 100 = 28 short.
    assert err.value.shortfall_bytes == 28
    assert err.value.max_context_tokens == 0
    assert "weights alone" in err.value.message


def test_embedding_and_head_count_on_the_end_stages():
    # 4 layers of 10 B, embedding 30 B, head 20 B, two equal nodes of 70 B.
    # A stage [0, e) holds 30 + 10e, a stage [s, 4) holds 10 (4 - s) + 20.
    # Split 2 + 2: 50 and 40 -> fits; times (bandwidth 1, bytes read = layers + head) 20 and 40.
    # Split 3 + 1: 60 and 30 (time 30, 30) -> largest time 30 < 40: balanced picks 3 + 1.
    m = model(4, 10, embedding_bytes=30, head_bytes=20)
    plan = make_plan([node("A", 70), node("B", 70)], [], m)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 3), (3, 4)]
    assert [s.memory_bytes for s in plan.stages] == [60, 30]
    assert [s.time_s for s in plan.stages] == [30.0, 30.0]
    assert plan.stages[0].embeds and not plan.stages[0].heads
    assert plan.stages[1].heads and not plan.stages[1].embeds


def test_tied_embedding_is_copied_to_the_last_stage():
    # Tied: the last stage also holds (and reads) the 30 B embedding as its head.
    # Two nodes of 100 B, 4 layers of 10 B. Stage [0, e): 30 + 10e. Stage [s, 4): 10(4-s) + 30.
    # Times (read): first 10e (embedding rows are not read), last 10(4-s) + 30.
    # e = 3: times 30, 40; e = 4 (one node): 40 + 30 = 70 -> best is 3 + 1 with max 40.
    m = model(4, 10, embedding_bytes=30, tie_word_embeddings=True)
    plan = make_plan([node("A", 100), node("B", 100)], [], m)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 3), (3, 4)]
    assert [s.memory_bytes for s in plan.stages] == [60, 40]
    assert plan.max_stage_time_s == 40.0
    assert plan.stages[1].embeds and plan.stages[1].heads


# --- balanced ----------------------------------------------------------------------------


def test_balanced_follows_bandwidth():
    # 12 layers of 1 B; bandwidths 3 and 1: times 3k... best split 9 + 3 -> 3 s each.
    plan = make_plan([node("fast", 100, bandwidth=3.0), node("slow", 100, bandwidth=1.0)], [], model(12))
    assert counts(plan) == {"fast": 9, "slow": 3}
    assert plan.max_stage_time_s == 3.0


def test_balanced_counts_compute():
    # Layers: 1 B read and 4 FLOPs. Node A: 1 B/s, 1 FLOP/s -> 5 s/layer; B: 1 B/s, 4 FLOP/s -> 2 s/layer.
    # 7 layers: A 2 (10 s) + B 5 (10 s) -> max 10; A 1 + B 6 -> 12; A 3 + B 4 -> 15. Best 10.
    nodes = [node("A", 100, 1.0, 1.0), node("B", 100, 1.0, 4.0)]
    plan = make_plan(nodes, [], model(7, flops_per_token_per_layer=4.0))
    assert counts(plan) == {"A": 2, "B": 5}
    assert plan.max_stage_time_s == 10.0


def test_balanced_respects_memory_with_kv_cache():
    # 10 layers of 10 B with 2 B/token/layer KV at 5 tokens: 20 B per layer in memory.
    # The fast node (10 B/s) has 60 B: at most 3 layers. Slow node (1 B/s) takes the rest.
    nodes = [node("fast", 60, bandwidth=10.0), node("slow", 1000, bandwidth=1.0)]
    m = model(10, 10, kv_bytes_per_token_per_layer=2, context_tokens=5)
    plan = make_plan(nodes, [], m)
    assert counts(plan) == {"fast": 3, "slow": 7}
    assert plan.stage_for("fast").memory_bytes == 60


def test_balanced_leaves_out_a_node_that_does_not_help():
    # Two layers of 1 B. A (1 B/s) holds both in 2 s; the slow B (0.1 B/s) would take 10 s
    # for a single layer, so the best largest stage time (2 s) does not use it.
    plan = make_plan([node("A", 10), node("B", 10, bandwidth=0.1)], [], model(2))
    assert plan.ranges == (("A", 0, 2),)
    assert [x.code for x in plan.excluded] == ["not_needed"]


# --- latency -----------------------------------------------------------------------------


def test_latency_drops_a_node_that_only_adds_a_hop():
    # Equal nodes, each able to hold the whole model: stage times sum to 6 s either way,
    # so one node (no hops at all) is fastest for a single request.
    nodes = [node("A", 100), node("B", 100)]
    plan = make_plan(nodes, [], model(6), policy=Policy(name="latency"))
    assert len(plan.stages) == 1 and plan.hops == ()
    assert plan.latency_s == 6.0
    assert [x.code for x in plan.excluded] == ["not_needed"]


def test_latency_uses_a_faster_node_as_much_as_memory_allows():
    # 6 layers of 1 B. fast: 10 B/s but room for 4 layers; slow: 1 B/s, room for all.
    # Best: fast 4 (0.4 s) + slow 2 (2 s) + a hop there and back (1 ms each by default).
    nodes = [node("fast", 4, bandwidth=10.0), node("slow", 100, bandwidth=1.0)]
    plan = make_plan(nodes, [], model(6), policy=Policy(name="latency"))
    assert counts(plan) == {"fast": 4, "slow": 2}
    assert plan.latency_s == pytest.approx(0.4 + 2.0 + 2 * 1e-3)


def test_latency_keeps_all_nodes_when_the_model_needs_them():
    nodes = [node("A", 3), node("B", 3)]
    plan = make_plan(nodes, [LinkSpec("A", "B", 1e9, 1e-4)], model(6), policy=Policy(name="latency"))
    assert counts(plan) == {"A": 3, "B": 3}


def test_predicted_latency_and_throughput():
    # 2 nodes, 4 layers of 1 B at 1 B/s: stages of 2 s; activation 1000 B over a 1000 B/s,
    # 0.5 s link: hop = 0.5 + 1 = 1.5 s; return carries 16 B: 0.5 + 0.016 = 0.516 s.
    # (The default network is made slower -- 100 B/s, 1 s -- so the link is the better path.)
    nodes = [node("A", 10), node("B", 10)]
    link = LinkSpec("A", "B", 1000.0, 0.5, "tb5")
    slow_net = Policy(fallback_bandwidth_bytes_per_s=100.0, fallback_latency_s=1.0)
    plan = make_plan(nodes, [link], model(4, activation_bytes_per_token=1000), policy=slow_net)
    assert plan.latency_s == pytest.approx(2 + 2 + 1.5 + 0.516)
    # Throughput: busiest resource is a stage (2 s) vs link occupancy 1000 / 1000 = 1 s.
    assert plan.throughput_tokens_per_s == pytest.approx(0.5)
    assert [h.kind for h in plan.hops] == ["direct", "direct"]
    assert plan.hops[-1].returns and plan.hops[-1].payload_bytes == 16


# --- balanced: prefill against decode (issue #35) ----------------------------------------


@pytest.mark.parametrize(("share", "first_stage_layers"), [(0.0, 7), (0.5, 6), (1.0, 5)])
def test_prefill_share_moves_layers_off_the_head_free_stage(share, first_stage_layers):
    # 10 layers, each 100 B read and 100 FLOPs a token; the head reads 400 B and does 400
    # FLOPs a decoded token, nothing for a prompt token. Two nodes at 1 B/s and 1 FLOP/s.
    # Decode: stage 0 with a layers costs 200a s, stage 1 200(10 - a) + 800; a prompt
    # token 100a and 100(10 - a). The whole model: 2,800 s a decoded token, 1,000 a prompt token.
    # share 0:   max(200a, 2800 - 200a) is least at a = 7 (1400 = 1400).
    # share 1:   max(100a, 1000 - 100a) at a = 5.
    # share 0.5: stage 0 = 0.5 * 200a / 2800 + 0.5 * 100a / 1000 = 0.0857a, stage 1 = 1 - 0.0857a:
    #            a = 5 gives max(0.429, 0.571), a = 6 max(0.514, 0.486): a = 6.
    spec = model(10, layer_bytes=100, head_bytes=400, flops_per_token_per_layer=100, head_flops_per_token=400)
    nodes = [node("A", 10**6), node("B", 10**6)]
    plan = make_plan(nodes, [], spec, policy=Policy(prefill_share=share, ring_order=("A", "B")))
    validate_plan(plan, 10)
    assert [(s.start, s.end) for s in plan.stages] == [(0, first_stage_layers), (first_stage_layers, 10)]


def test_prefill_share_must_be_a_fraction():
    with pytest.raises(ValueError, match="prefill_share"):
        Policy(prefill_share=1.5)
