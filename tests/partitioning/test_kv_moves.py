"""Move or recompute a re-plan's KV, by predicted cost per cached token. Costs by hand:
4 layers, 1,536 KV bytes per token and layer, 10 MFLOP per token and layer; nodes of
1 TFLOP/s recompute a layer's token in 10 us."""

from __future__ import annotations

import pytest

from ringlet.partitioning import LinkSpec, ModelSpec, NodeSpec, Policy
from ringlet.partitioning.kv_moves import kv_sources

MODEL = ModelSpec(layer_bytes=(1_000_000,) * 4, embedding_bytes=0, head_bytes=0,
                  kv_bytes_per_token_per_layer=(1536,) * 4, context_tokens=1024, flops_per_token_per_layer=(1e7,) * 4)
NODES = {n: NodeSpec(n, memory_bytes=10**10, bandwidth_bytes_per_s=10**11, flops=1e12) for n in "abc"}
POLICY = Policy(fallback_bandwidth_bytes_per_s=125e6)


def decide(previous, stages, bandwidth=None, lost=None):
    links = [LinkSpec(a, b, bandwidth, 1e-4) for a, b in (("a", "b"), ("b", "c"), ("a", "c"))] if bandwidth else []
    return kv_sources(previous, stages, MODEL, NODES, links, POLICY, lost or {})


def test_a_fast_link_moves_and_a_slow_one_recomputes():
    # b's [2, 4) goes to c: move 2 x 1,536 B; recompute 2 x 10 us = 20 us a token
    previous, stages = [("a", 0, 2), ("b", 2, 4)], [("a", 0, 2), ("c", 2, 4)]
    fast = decide(previous, stages, bandwidth=1e9)[1]  # 3,072 B / 1 GB/s = 3.072 us < 20 us
    assert not fast.rebuild and fast.move_s_per_token == pytest.approx(3.072e-6)
    assert fast.recompute_s_per_token == pytest.approx(20e-6) and fast.why.startswith("moved: 3.1 us/token")
    slow = decide(previous, stages, bandwidth=1e6)[1]  # 3,072 B / 1 MB/s = 3,072 us > 20 us
    assert slow.rebuild and slow.why == "recomputed: 20.0 us/token predicted, against 3072.0 us/token to move it"
    # no measured link: the policy's fallback (125 MB/s: 24.6 us > 20 us) is a guess, and a
    # guess never chooses recomputing
    unmeasured = decide(previous, stages)[1]
    assert not unmeasured.rebuild and unmeasured.why.startswith("moved: no measured link from its holder to c")


def test_a_lost_holder_is_rebuilt_and_a_kept_range_is_not_moved():
    previous, stages = [("a", 0, 2), ("b", 2, 4)], [("a", 0, 3), ("c", 3, 4)]
    out = decide(previous, stages, bandwidth=1e9, lost={"b": "missed heartbeats"})
    assert [(s.node_id, s.rebuild) for s in out] == [("a", False), ("b", True)]
    assert out[0].why == "kept by its holder" and out[1].why.startswith("lost (missed heartbeats)")


def test_a_holder_that_keeps_part_of_its_range_moves_the_rest_whatever_the_link():
    # a keeps [0, 1) and gives [1, 2) to b: the states entering 1 exist only inside a's stage
    out = decide([("a", 0, 2), ("b", 2, 4)], [("a", 0, 1), ("b", 1, 4)], bandwidth=1e3)
    assert not out[0].rebuild and out[0].why.startswith("its holder keeps part of it")


def test_two_takers_add_up_their_costs():
    # c's [2, 4) split between a [2, 3) and b [3, 4): move 1,536 B to each over 1 MB/s
    out = decide([("b", 0, 2), ("c", 2, 4)], [("a", 0, 3), ("b", 3, 4)], bandwidth=1e6)
    c = out[1]
    assert c.move_s_per_token == pytest.approx(2 * 1536 / 1e6) and c.recompute_s_per_token == pytest.approx(20e-6)
    assert c.rebuild
