"""The rules mixed releases follow, without daemons: which features a plan uses, which
members a model may be planned on, whether its head drafts, when tensor groups form, and
how a node of another protocol version is kept out (the daemons' tests:
``node/test_rolling_upgrade.py`` (two releases in one ring as well),
``cluster/test_incompatible_version.py``)."""

from __future__ import annotations

import json

import pytest

from ringlet.daemon.cluster import features
from ringlet.daemon.cluster.advert import IncompatibleVersion, parse_txt
from ringlet.daemon.cluster.incompatible import Incompatible
from ringlet.daemon.tensor.serving.mode import decide_mode
from ringlet.daemon.wire import versions
from ringlet.daemon.wire.serving_plan import ServingPlan, StageSpec
from ringlet.partitioning import LinkSpec, ModelSpec, NodeSpec, make_plan

NEW = versions.record_fields()
OLD: dict = {}  # a 0.1.0 record: no release, no capabilities


def two_stage_plan():
    nodes = [NodeSpec(node_id=i, memory_bytes=10**9, bandwidth_bytes_per_s=10**10, flops=10**11) for i in ("a", "b")]
    model = ModelSpec(name="m", layer_bytes=(10**6,) * 4, embedding_bytes=10**5, head_bytes=10**5,
                      kv_bytes_per_token_per_layer=100, context_tokens=64, flops_per_token_per_layer=2 * 10**6)
    plan = make_plan(nodes, [LinkSpec(a="a", b="b", bandwidth_bytes_per_s=10**9, latency_s=1e-4)], model)
    assert [s.node_id for s in plan.stages] == ["a", "b"]
    return plan


def test_a_plan_uses_what_every_node_taking_part_speaks():
    plan = two_stage_plan()
    assert features.plan_features({"a": NEW, "b": NEW}, plan) == versions.CAPABILITIES
    assert features.plan_features({"a": NEW, "b": OLD}, plan) == frozenset()
    partial = {**NEW, versions.RECORD_CAPABILITIES: [versions.DRAFTS, "a_future_one"]}
    assert features.plan_features({"a": NEW, "b": partial}, plan) == {versions.DRAFTS}
    # a member left out of the plan does not count; a tensor plan's ranks do
    assert features.plan_features({"a": NEW, "b": NEW, "c": OLD}, plan) == versions.CAPABILITIES
    mode = {"mode": "tensor", "ranks": ["a", "c"]}
    assert features.plan_features({"a": NEW, "b": NEW, "c": OLD}, plan, mode) == frozenset()


def test_the_features_travel_in_the_plan_json_which_release_0_1_0_reads_as_before():
    plan = two_stage_plan()
    body = json.loads(features.plan_body(plan, [versions.DRAFTS, versions.KV_KINDS]))
    assert features.features_of(body) == {versions.DRAFTS, versions.KV_KINDS}
    assert type(plan).from_dict(body).plan_id == plan.plan_id  # the extra key is ignored (as 0.1.0's reader does)
    assert features.features_of(plan.to_dict()) == frozenset()  # a 0.1.0 proposer: the baseline
    assert features.features_of({"features": "drafts"}) == frozenset()
    assert features.features_of({"features": ["drafts", "from_the_future", 3]}) == {versions.DRAFTS}


def test_drafts_need_every_node_and_in_groups_their_trims():
    stages = (StageSpec("h:1", 0, 2, "a"), StageSpec("h:2", 2, 4, "b"))
    plan = ServingPlan(epoch=1, stages=stages, plan_id="p")
    assert plan.drafts  # a static plan: this build's nodes
    assert ServingPlan(1, stages, "p", features=versions.CAPABILITIES).drafts
    assert not ServingPlan(1, stages, "p", features=frozenset()).drafts
    hybrid = {"mode": "hybrid"}
    assert not ServingPlan(1, stages, "p", tp=hybrid, features=frozenset({versions.DRAFTS})).drafts
    assert ServingPlan(1, stages, "p", tp=hybrid, features=frozenset({versions.DRAFTS, versions.TENSOR_TRIMS})).drafts


def test_a_model_with_a_second_stream_is_planned_only_on_nodes_that_carry_it():
    assert features.required_by({"model_type": "llama"}) == frozenset()
    need = features.required_by({"model_type": "rwkv7"})
    assert need == {versions.SECOND_STREAM}
    out = features.unable({"a": NEW, "b": OLD}, need, "rwkv7-x")
    assert list(out) == ["b"]
    assert "b runs ringlet 0.1.0" in out["b"] and f"upgrade b to ringlet {versions.RELEASE}" in out["b"]
    records = {"a": NEW, "b": OLD}
    assert features.split_refusal(records.get, ["a", "b"], need, "rwkv7-x") == out["b"]  # an 0.1.0 proposer's split
    assert features.split_refusal(records.get, ["b"], need, "rwkv7-x") is None  # whole on one node: no hop
    assert features.split_refusal(records.get, ["a", "b"], frozenset(), "llama-x") is None


def test_members_of_several_releases_form_no_tensor_group():
    from ringlet.daemon.tensor.planning.inputs import TPModelSpec

    spec = TPModelSpec(num_heads=32, num_kv_heads=8, num_layers=32, total_bytes=16 * 10**9, replicated_bytes=10**9,
                       hidden_size=4096, intermediate_size=14336, name="mid")
    records = {"a": {**NEW, "whole_model": True}, "b": {"whole_model": True}}
    out = decide_mode("tensor", ["a", "b"], records, {"a": "10.0.0.1:1", "b": "10.0.0.2:1"}, spec, "a")
    assert out["mode"] == "pipeline" and "several releases" in out["refused"], out


def test_a_node_of_another_protocol_is_kept_out_once_with_the_reason():
    said = []
    kept = Incompatible(lambda kind, msg: said.append((kind, msg)))
    record = json.dumps({versions.RECORD_RELEASE: "9.0.0"})
    for _ in range(3):
        why = kept.seen("z9", "10.0.0.9:5", versions.PROTOCOL_VERSION + 1, record)
    assert f"z9 runs ringlet 9.0.0 with wire protocol {versions.PROTOCOL_VERSION + 1}" in why
    assert f"this node runs {versions.RELEASE} with protocol {versions.PROTOCOL_VERSION}" in why
    assert [k for k, _ in said] == ["incompatible"]  # one event, not one per handshake
    assert kept.info() == [{"node_id": "z9", "address": "10.0.0.9:5", "release": "9.0.0",
                            "protocol_version": versions.PROTOCOL_VERSION + 1, "reason": why}]
    kept.seen("z8", "x:1", 0, "")  # an older protocol, no record
    kept.admitted("z9")  # upgraded: no longer kept out
    assert [x["node_id"] for x in kept.info()] == ["z8"]
    assert "upgrade z8 to ringlet" in kept.info()[0]["reason"]


def test_an_advert_of_another_protocol_still_names_its_node():
    with pytest.raises(IncompatibleVersion) as e:
        parse_txt({b"v": str(versions.PROTOCOL_VERSION + 1).encode(), b"id": b"z9", b"c": b"0123456789abcdef"},
                  secret=None)
    assert (e.value.node_id, e.value.cluster_id) == ("z9", "0123456789abcdef")  # only this cluster's are dialled
    with pytest.raises(IncompatibleVersion) as e:
        parse_txt({b"v": b"7", b"id": b"NOT A VALID ID"}, secret=None)
    assert e.value.node_id == ""


def test_releases_sort_by_their_numbers_not_as_text():
    """One key orders releases for the wire check's descriptors and doctor's newest release:
    0.10.0 after 0.9.1 (as text it would sort before)."""
    key = versions.release_key
    assert sorted(["0.10.0", "0.2.0", "0.9.1", "0.1.0"], key=key) == ["0.1.0", "0.2.0", "0.9.1", "0.10.0"]
    assert key("1.0.0") > key("0.99.0")
