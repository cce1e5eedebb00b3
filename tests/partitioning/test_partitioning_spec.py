"""Input validation, the Plan's JSON form and plan id, and validate_plan's checks."""

import dataclasses
import json
import math

import pytest

from ringlet.partitioning import (
    InvalidPlan,
    LinkSpec,
    ModelSpec,
    NodeSpec,
    Plan,
    Policy,
    make_plan,
    validate_plan,
)


def model(layers=6, **kw):
    base = dict(embedding_bytes=3, head_bytes=2, kv_bytes_per_token_per_layer=1, context_tokens=4,
                flops_per_token_per_layer=10.0)
    base.update(kw)
    return ModelSpec(layer_bytes=(10,) * layers, **base)


def nodes(*ids, memory=1000):
    return [NodeSpec(i, memory, 100.0, 1e3) for i in ids]


# --- input validation ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, "512GB", True, None])
def test_node_memory_must_be_a_finite_non_negative_number(bad):
    with pytest.raises(ValueError, match=r"NodeSpec\('m1'\)\.memory_bytes"):
        NodeSpec("m1", bad, 1.0, 1.0)


@pytest.mark.parametrize("field", ["bandwidth_bytes_per_s", "flops"])
@pytest.mark.parametrize("bad", [math.nan, -math.inf, -0.5])
def test_node_rates_are_checked(field, bad):
    kw = {"node_id": "m1", "memory_bytes": 1, "bandwidth_bytes_per_s": 1.0, "flops": 1.0, field: bad}
    with pytest.raises(ValueError, match=rf"NodeSpec\('m1'\)\.{field}"):
        NodeSpec(**kw)


def test_node_memory_float_is_rounded_down_and_id_required():
    assert NodeSpec("a", 10.9, 1, 1).memory_bytes == 10
    with pytest.raises(ValueError, match="node_id"):
        NodeSpec("", 1, 1, 1)


def test_link_validation():
    with pytest.raises(ValueError, match="two different nodes"):
        LinkSpec("a", "a", 1e9, 0.0)
    with pytest.raises(ValueError, match=r"LinkSpec\('a', 'b'\)\.bandwidth_bytes_per_s"):
        LinkSpec("a", "b", 0.0, 0.0)
    with pytest.raises(ValueError, match=r"LinkSpec\('a', 'b'\)\.latency_s"):
        LinkSpec("a", "b", 1e9, math.nan)


def test_model_validation_names_the_field_and_index():
    with pytest.raises(ValueError, match="layer_bytes must be a non-empty"):
        model(0)
    with pytest.raises(ValueError, match=r"ModelSpec\.layer_bytes\[2\]"):
        ModelSpec((1, 2, -3), 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"ModelSpec\.kv_bytes_per_token_per_layer has 2 entries"):
        ModelSpec((1, 2, 3), 0, 0, (1, 1), 0, 0)
    with pytest.raises(ValueError, match=r"ModelSpec\.flops_per_token_per_layer\[1\]"):
        ModelSpec((1, 2), 0, 0, 0, 0, (1.0, math.nan))
    with pytest.raises(ValueError, match=r"layer_read_bytes\[0\].*exceeds"):
        ModelSpec((1, 2), 0, 0, 0, 0, 0, layer_read_bytes=(5, 1))
    with pytest.raises(ValueError, match="context_tokens"):
        ModelSpec((1,), 0, 0, 0, 1.5, 0)


def test_model_scalars_expand_per_layer():
    m = ModelSpec((4, 5, 6), 1, 2, 3, 10, 7.0)
    assert m.kv_bytes_per_token_per_layer == (3.0, 3.0, 3.0)
    assert m.flops_per_token_per_layer == (7.0, 7.0, 7.0)
    assert m.layer_read_bytes == (4, 5, 6)
    assert m.total_bytes() == 15 + 1 + 2 + 3 * 3 * 10
    assert ModelSpec.from_dict(m.to_dict()) == m


def test_policy_validation():
    with pytest.raises(ValueError, match="Policy.name"):
        Policy(name="fastest")
    with pytest.raises(ValueError, match="Policy.tolerance"):
        Policy(tolerance=1.5)
    with pytest.raises(ValueError, match="Policy.fallback_bandwidth_bytes_per_s"):
        Policy(fallback_bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="Policy.ring_order lists a node twice"):
        Policy(ring_order=("a", "a"))
    assert Policy.from_dict(Policy(ring_order=("a", "b")).to_dict()) == Policy(ring_order=("a", "b"))


def test_duplicate_node_ids_are_rejected():
    with pytest.raises(ValueError, match="duplicate node_id 'a'"):
        make_plan(nodes("a", "b", "a"), [], model())


def test_empty_and_mistyped_arguments():
    with pytest.raises(ValueError, match="at least one node"):
        make_plan([], [], model())
    with pytest.raises(TypeError, match=r"nodes\[0\]"):
        make_plan([{"node_id": "a"}], [], model())
    with pytest.raises(TypeError, match="model"):
        make_plan(nodes("a"), [], {"layers": 3})
    with pytest.raises(ValueError, match="unknown node 'zz'"):
        make_plan(nodes("a", "b"), [], model(), policy=Policy(ring_order=("a", "zz")))


def test_zero_bandwidth_and_zero_compute_nodes_are_left_out():
    ns = nodes("a") + [NodeSpec("nobw", 1000, 0.0, 1e3), NodeSpec("noflops", 1000, 100.0, 0.0)]
    plan = make_plan(ns, [], model())
    assert {x.node_id: x.code for x in plan.excluded} == {"nobw": "zero_bandwidth", "noflops": "zero_compute"}


def test_more_nodes_than_layers_leaves_out_the_smallest():
    ns = [NodeSpec("big", 1000, 1.0, 1.0), NodeSpec("mid", 500, 1.0, 1.0), NodeSpec("small", 200, 1.0, 1.0)]
    plan = make_plan(ns, [], model(2, embedding_bytes=0, head_bytes=0, kv_bytes_per_token_per_layer=0))
    assert {x.node_id: x.code for x in plan.excluded} == {"small": "too_many_nodes"}


def test_links_to_unknown_nodes_are_ignored_with_a_note():
    plan = make_plan(nodes("a", "b"), [LinkSpec("a", "ghost", 1e9, 1e-4)], model())
    assert any("ignored 1 link" in n for n in plan.notes)


def test_pinned_ring_order_is_followed():
    plan = make_plan(nodes("a", "b", "c"), [], model(), policy=Policy(ring_order=("c", "a")))
    assert plan.ring_order == ("c", "a")
    assert [(x.node_id, x.code) for x in plan.excluded] == [("b", "not_in_ring_order")]


# --- Plan JSON and id ----------------------------------------------------------------------


def test_plan_json_round_trip():
    plan = make_plan(nodes("a", "b", "c"), [LinkSpec("a", "b", 1e10, 5e-5, "tb5")], model(9))
    text = json.dumps(plan.to_dict())  # strict JSON: no NaN / inf
    back = Plan.from_dict(json.loads(text))
    assert back == plan
    assert Plan.from_json(plan.to_json()) == plan
    assert back.plan_id == plan.plan_id


def test_plan_id_depends_on_the_assignment_only():
    a = make_plan(nodes("a", "b"), [], model(4))
    b = make_plan(nodes("a", "b"), [], model(4), policy=Policy(name="memory"))
    assert a.ranges == b.ranges and a.plan_id == b.plan_id
    c = make_plan(nodes("a", "b"), [], model(4, context_tokens=8))
    assert c.plan_id != a.plan_id
    assert len(a.plan_id) == 16 and int(a.plan_id, 16) >= 0


def test_from_dict_rejects_tampering_and_bad_fields():
    d = make_plan(nodes("a", "b"), [], model(4)).to_dict()
    tampered = json.loads(json.dumps(d))
    tampered["stages"][0]["end"] += 1
    with pytest.raises(ValueError, match="plan_id"):
        Plan.from_dict(tampered)
    missing = json.loads(json.dumps(d))
    del missing["stages"][1]["node_id"]
    with pytest.raises(ValueError, match=r"plan\.stages\[1\]\.node_id is missing"):
        Plan.from_dict(missing)
    wrong = json.loads(json.dumps(d))
    wrong["format"] = 99
    with pytest.raises(ValueError, match="format"):
        Plan.from_dict(wrong)
    with pytest.raises(ValueError, match="JSON object"):
        Plan.from_dict([1, 2])
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.from_json("{")


# --- validate_plan ---------------------------------------------------------------------------


@pytest.fixture
def plan3():
    p = make_plan(nodes("a", "b", "c"), [], model(9), policy=Policy(ring_order=("a", "b", "c")))
    assert p.ranges == (("a", 0, 3), ("b", 3, 6), ("c", 6, 9))
    return p


def _with_ranges(plan, ranges):
    stages = tuple(dataclasses.replace(s, start=r[0], end=r[1]) for s, r in zip(plan.stages, ranges, strict=True))
    return dataclasses.replace(plan, stages=stages)


def test_validate_plan_accepts_a_good_plan(plan3):
    validate_plan(plan3, 9, ["a", "b", "c"])


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        (((0, 3), (4, 6), (6, 9)), "gap"),
        (((0, 3), (2, 6), (6, 9)), "overlap"),
        (((0, 3), (3, 3), (3, 9)), "empty"),
        (((0, 3), (3, 6), (6, 8)), r"layers \[8, 9\) are not served"),
        (((0, 3), (3, 6), (6, 10)), "beyond"),
        (((1, 3), (3, 6), (6, 9)), "starts at layer 1, expected 0"),
    ],
)
def test_validate_plan_rejects_bad_ranges(plan3, ranges, message):
    with pytest.raises(InvalidPlan, match=message):
        validate_plan(_with_ranges(plan3, ranges), 9)


def test_validate_plan_other_checks(plan3):
    with pytest.raises(InvalidPlan, match="plan is for 9 layers, the model has 10"):
        validate_plan(plan3, 10)
    with pytest.raises(InvalidPlan, match="unknown node"):
        validate_plan(plan3, 9, ["a", "b"])
    dup = dataclasses.replace(plan3, stages=(plan3.stages[0], dataclasses.replace(plan3.stages[0], start=3, end=9)))
    with pytest.raises(InvalidPlan, match="twice"):
        validate_plan(dup, 9)
    forged = dataclasses.replace(plan3)
    object.__setattr__(forged, "plan_id", "0" * 16)
    with pytest.raises(InvalidPlan, match="plan_id"):
        validate_plan(forged, 9)
    no_hops = dataclasses.replace(plan3, hops=())
    with pytest.raises(InvalidPlan, match="hops"):
        validate_plan(no_hops, 9)
    assert issubclass(InvalidPlan, ValueError)
