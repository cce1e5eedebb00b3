"""A re-plan never has a node load layers it does not hold beyond its memory while it keeps
serving its previous stage (#43): a node loads its new stage beside the old one until the
commit, so a ring re-chosen for speed is kept as it was when the re-chosen one would overfill
a node for that time. Worked by hand: 12 layers of 100 bytes and a 600-byte head; A reads 10
bytes/s, B 1. The previous plan (A first, A's memory 1100) is A [0, 11), B [11, 12) + head.
The best ring puts the fast A last: A [1, 12) + head, 1700 bytes, 700 of them loaded beside
the 1100 it holds: 1800 bytes while it prepares."""

from __future__ import annotations

from ringlet.partitioning import ModelSpec, NodeSpec, Policy, make_plan, validate_plan

MODEL = ModelSpec(layer_bytes=(100,) * 12, embedding_bytes=0, head_bytes=600, kv_bytes_per_token_per_layer=0,
                  context_tokens=0, flops_per_token_per_layer=0)


def nodes(a_memory: int) -> list[NodeSpec]:
    return [NodeSpec("A", a_memory, 10.0, 1.0), NodeSpec("B", 10**6, 1.0, 1.0)]


def test_the_ring_is_re_chosen_only_where_the_transition_fits():
    prev = make_plan(nodes(1100), [], MODEL, policy=Policy(ring_order=("A", "B")))
    assert prev.ranges == (("A", 0, 11), ("B", 11, 12))
    room = make_plan(nodes(1800), [], MODEL, previous=prev)  # 1100 held + 700 loaded: fits exactly
    assert room.ranges == (("B", 0, 1), ("A", 1, 12))
    assert {s.node_id: s.load_bytes for s in room.stages} == {"A": 700, "B": 100}
    assert any("re-chosen" in n for n in room.notes), room.notes
    tight = make_plan(nodes(1799), [], MODEL, previous=prev)
    validate_plan(tight, 12)
    assert tight.ranges == prev.ranges and tight.load_bytes == 0
    assert any("the previous order was kept" in n for n in tight.notes), tight.notes
