"""The daemon's mode decision (tensor.serving.mode): members and links from membership records, the
auto rules on top of planning.decide, and the checks a member applies to a proposal's decision.
Pure functions; expected values written by hand."""

from __future__ import annotations

import pytest
from conftest import ringlet

from ringlet.daemon.tensor.planning.inputs import TPLink, TPMember, TPModelSpec
from ringlet.daemon.tensor.serving.mode import check_tp_dict, cluster_inputs, decide_mode, group_of, hybrid_layer_ranges

GiB = 1 << 30

SMOL = TPModelSpec(num_heads=9, num_kv_heads=3, num_layers=30, total_bytes=538_000_000,
                   replicated_bytes=113_000_000, hidden_size=576, intermediate_size=1536, name="smollm2-135m")
# 32 heads / 8 kv heads: 2 ranks work. Pipeline: 16 GB / 100 GB/s = 160 ms a token; tensor on 2 ranks:
# (1 GB + 15 GB / 2) / 100 GB/s = 85 ms plus 65 all-reduces of ~0.12 ms over Thunderbolt.
MID = TPModelSpec(num_heads=32, num_kv_heads=8, num_layers=32, total_bytes=16 * 10**9, replicated_bytes=10**9,
                  hidden_size=4096, intermediate_size=14336, name="mid")
# 6 heads / 2 kv heads: groups of 2, never 4 ranks.
HYB = TPModelSpec(num_heads=6, num_kv_heads=2, num_layers=60, total_bytes=120 * 10**9,
                  replicated_bytes=2 * 10**9, hidden_size=8192, intermediate_size=24576, name="hyb")


def records(ids, usable=64 * GiB, links=None):
    return {i: {"usable_memory_bytes": usable, "links": (links or {}).get(i, {})} for i in ids}


def test_members_and_links_from_records():
    ids = ["a", "b", "c"]
    addresses = {"a": "10.0.0.1:7100", "b": "10.0.0.2:7100", "c": "10.0.0.1:7101"}
    recs = records(ids, links={"b": {"a": {"kind": "thunderbolt", "bandwidth_bytes_per_s": 5e9, "rtt_s": 0.001}}})
    recs["a"]["memory_bandwidth_bytes_per_s"] = 400e9
    members, links = cluster_inputs(ids, recs, addresses)
    assert members == [TPMember("a", "10.0.0.1", 64 * GiB, 400e9), TPMember("b", "10.0.0.2", 64 * GiB, None),
                       TPMember("c", "10.0.0.1", 64 * GiB, None)]
    assert links == [
        TPLink("a", "b", "thunderbolt", bandwidth=5e9),  # measured (by b), latency left to the kind
        TPLink("a", "c", "loopback"),  # same host, not measured yet
        TPLink("b", "c", "ethernet"),  # two hosts, not measured yet
    ]


def test_auto_keeps_the_pipeline_when_members_share_a_machine():
    ids = ["a", "b", "c"]
    addresses = {i: f"127.0.0.1:{7100 + k}" for k, i in enumerate(ids)}
    recs = records(ids)
    for r in recs.values():  # this machine's figure: 538 MB / 3.7 GB/s = 145 ms a token on the pipeline,
        r["memory_bandwidth_bytes_per_s"] = 3.7e9  # (113 MB + 425 MB / 3) / 3.7 GB/s = 69 ms on 3 ranks
    d = decide_mode("auto", ids, recs, addresses, SMOL, "a")
    assert (d["mode"], d["backend"], d["ranks"], d["requested"]) == ("pipeline", "none", [], "auto")
    assert d["reason"].startswith("pipeline: members share a machine (a-b, a-c, b-c over loopback)")
    assert d["reason"].endswith("--mode tensor forces it")
    # with 100 GB/s per member the pipeline is predicted faster anyway
    fast = decide_mode("auto", ids, records(ids), addresses, SMOL, "a")
    assert (fast["mode"], fast["ranks"]) == ("pipeline", []) and fast["reason"].startswith("pipeline: predicted faster")
    forced = decide_mode("tensor", ids, records(ids), addresses, SMOL, "a")
    assert (forced["mode"], forced["backend"], forced["ranks"]) == ("tensor", "ring", ["a", "b", "c"])
    assert forced["reason"] == "--mode tensor: 3 ranks over ring: loopback links form a ring a -> b -> c -> a"


def test_forced_tensor_that_cannot_run_serves_the_pipeline_and_says_why():
    ids = ["a", "b"]
    addresses = {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}
    d = decide_mode("tensor", ids, records(ids), addresses, SMOL, "a")
    why = ("tensor mode refused: smollm2-135m: 9 attention heads and 3 key/value heads do not divide by 2 ranks; "
           "group sizes that work: 3")
    assert d == {"mode": "pipeline", "backend": "none", "ranks": [], "requested": "tensor", "refused": why,
                 "reason": f"{why}; serving the pipeline"}
    assert decide_mode("pipeline", ids, records(ids), addresses, SMOL, "a") == {
        "mode": "pipeline", "backend": "none", "ranks": [], "reason": "--mode pipeline", "requested": "pipeline"}


def test_a_member_with_part_of_the_model_keeps_the_pipeline():
    ids = ["a", "b", "c"]
    addresses = {i: f"127.0.0.1:{7100 + k}" for k, i in enumerate(ids)}
    recs = records(ids)
    recs["b"]["whole_model"] = False
    why = "tensor mode refused: b hold(s) only part of the model (--fetch-model); every rank needs all of it"
    assert decide_mode("tensor", ids, recs, addresses, SMOL, "a") == {
        "mode": "pipeline", "backend": "none", "ranks": [], "requested": "tensor", "refused": why,
        "reason": f"{why}; serving the pipeline"}
    assert decide_mode("auto", ids, recs, addresses, SMOL, "a")["reason"] == f"{why}; serving the pipeline"


def test_auto_picks_tensor_across_machines_when_predicted_faster():
    ids = ["a", "b"]
    addresses = {"a": "10.0.0.1:7100", "b": "10.0.0.2:7100"}
    recs = records(ids, links={"a": {"b": {"kind": "thunderbolt", "bandwidth_bytes_per_s": 5e9, "rtt_s": 0.001}}})
    d = decide_mode("auto", ids, recs, addresses, MID, "b")
    assert (d["mode"], d["backend"], d["ranks"], d["requested"]) == ("tensor", "ring", ["b", "a"], "auto")
    assert d["reason"].startswith("tensor: 2 ranks over ring (thunderbolt links form a ring b -> a -> b)")
    assert check_tp_dict(d, ids, "b") is None
    assert group_of(d, "a") == (0, ["b", "a"], "ring", None)  # one group of every layer
    assert group_of(d, "z") is None


def test_auto_picks_hybrid_across_four_machines_for_a_model_that_needs_it():
    """HYB's 6 heads do not divide by 4, and its 120 GB do not fit a 2-rank group of 64 GiB members:
    2 groups of 2, each holding half the layers split two ways, chained as pipeline stages
    (60 layers: [0, 30) and [30, 60)), predicted faster than the 4-stage pipeline."""
    ids = ["a", "b", "c", "d"]
    addresses = {i: f"10.0.0.{k + 1}:7100" for k, i in enumerate(ids)}
    d = decide_mode("auto", ids, records(ids), addresses, HYB, "a")
    assert (d["mode"], d["backend"], d["ranks"], d["groups"], d["group_backends"], d["layer_ranges"]) == (
        "hybrid", "ring", ["a", "b", "c", "d"], [["a", "b"], ["c", "d"]], ["ring", "ring"], [[0, 30], [30, 60]])
    assert d["reason"].startswith("hybrid: 2 groups of 2 over ring/ring; predicted per token: hybrid")
    assert check_tp_dict(d, ids, "a", num_layers=60) is None
    assert group_of(d, "d") == (1, ["c", "d"], "ring", (30, 60))
    # members on one machine: auto keeps the pipeline, --mode hybrid forces it
    local = {i: f"127.0.0.1:{7100 + k}" for k, i in enumerate(ids)}
    kept = decide_mode("auto", ids, records(ids), local, HYB, "a")
    assert kept["mode"] == "pipeline" and kept["reason"].endswith("--mode hybrid forces it")
    assert decide_mode("hybrid", ids, records(ids), local, HYB, "a")["groups"] == [["a", "b"], ["c", "d"]]
    # 5 groups of 2 for a 4-layer model: more groups than layers
    tiny = TPModelSpec(num_heads=4, num_kv_heads=2, num_layers=4, total_bytes=10**6, hidden_size=64, name="tiny")
    ten = [f"n{k}" for k in range(10)]
    many = decide_mode("hybrid", ten, records(ten), {i: f"10.0.1.{k}:7100" for k, i in enumerate(ten)}, tiny, "n0")
    assert (many["mode"], many["refused"]) == ("pipeline", "hybrid mode refused: cannot split 4 layers into 5 groups")
    # three members cannot make equal groups
    three = decide_mode("hybrid", ids[:3], records(ids[:3]), local, HYB, "a")
    assert (three["mode"], three["refused"]) == ("pipeline", (
        "hybrid mode refused: no split of 3 members into equal tensor groups (of a size the heads divide by) "
        "where every group has a ring or RDMA mesh and memory for its share of the layers"))


@pytest.mark.parametrize(("layers", "groups", "ranges"), [
    (60, 2, [(0, 30), (30, 60)]),
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    (4, 2, [(0, 2), (2, 4)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
])
def test_hybrid_layer_ranges_split_evenly(layers, groups, ranges):
    assert hybrid_layer_ranges(layers, groups) == ranges


HYBRID = {"mode": "hybrid", "backend": "ring", "ranks": ["a", "b", "c", "d"], "groups": [["a", "b"], ["c", "d"]],
          "group_backends": ["ring", "ring"], "layer_ranges": [[0, 2], [2, 4]]}


@pytest.mark.parametrize(("change", "why"), [
    ({}, None),
    ({"groups": [["a", "c"], ["b", "d"]]}, "hybrid groups are not the ranks in order, in groups of 2 or more"),
    ({"groups": [["a", "b", "c", "d"]]}, "hybrid groups are not the ranks in order, in groups of 2 or more"),
    ({"group_backends": ["ring"]}, "unknown hybrid group backend"),
    ({"layer_ranges": [[0, 2], [3, 4]]}, "hybrid layer ranges do not cover every layer exactly once, in order"),
    ({"layer_ranges": [[0, 2], [2, 3]]}, "hybrid layer ranges do not cover every layer exactly once, in order"),
    ({"layer_ranges": [[0, 2], ["x", 4]]}, "hybrid layer ranges are not pairs of integers"),
])
def test_a_member_checks_a_hybrid_decision(change, why):
    assert check_tp_dict({**HYBRID, **change}, ["a", "b", "c", "d"], "a", num_layers=4) == why


@pytest.mark.parametrize(("decision", "why"), [
    ({"mode": "mixed"}, "mode decision is not pipeline, tensor or hybrid"),
    ("tensor", "mode decision is not pipeline, tensor or hybrid"),
    ({"mode": "tensor", "backend": "ring", "ranks": ["a", "b"]}, "tensor ranks are not exactly the members"),
    ({"mode": "tensor", "backend": "ring", "ranks": ["b", "a", "c"]}, "rank 0 of a tensor plan must be its proposer"),
    ({"mode": "tensor", "backend": "mpi", "ranks": ["a", "b", "c"]}, "unknown tensor backend 'mpi'"),
    ({"mode": "tensor", "backend": "ring", "ranks": ["a", "b", "c"]}, None),
    ({"mode": "pipeline"}, None),
])
def test_a_member_checks_the_decision_it_is_asked_to_prepare(decision, why):
    assert check_tp_dict(decision, ["a", "b", "c"], "a") == why


@pytest.mark.parametrize(("args", "message"), [
    (["--mode", "hybrid", "--plan", "127.0.0.1:7100=0:30"],
     "error: --mode hybrid needs negotiated plans; drop --plan (a static plan is a pipeline)"),
    (["--mode", "tensor", "--plan", "127.0.0.1:7100=0:30"],
     "error: --mode tensor needs negotiated plans; drop --plan (a static plan is a pipeline)"),
])
def test_run_refuses_modes_it_cannot_serve(args, message):
    proc = ringlet("run", "--no-dashboard", "--port", "0", *args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == message


def test_thunderbolt_cables_in_records_make_jaccl_possible():
    """The real MBP <-> Studio captures, published in each node's record: with RDMA on both
    ends the pair is a JACCL group (as planning decides from the probes directly)."""
    from dataclasses import replace

    from test_tp_config import BIG, _captured_ports

    from ringlet.daemon.tensor.serving.thunderbolt import thunderbolt_record

    studio, mbp = _captured_ports()
    ids = ["mbp-a", "studio-a"]
    addresses = {"mbp-a": "192.168.1.20:7100", "studio-a": "192.168.1.10:7100"}
    recs = {"mbp-a": {"usable_memory_bytes": 100 * GiB, "memory_bandwidth_bytes_per_s": 500e9,
                      "thunderbolt": thunderbolt_record(mbp)},
            "studio-a": {"usable_memory_bytes": 200 * GiB, "memory_bandwidth_bytes_per_s": 800e9,
                         "thunderbolt": thunderbolt_record(studio)}}
    _, links = cluster_inputs(ids, recs, addresses)
    assert links[1:] == [TPLink("mbp-a", "studio-a", "thunderbolt", rdma=False, bandwidth=10e9, iface_a="en1",
                                iface_b="en3")]
    d = decide_mode("auto", ids, recs, addresses, BIG, "mbp-a")
    assert (d["mode"], d["backend"], d["ranks"]) == ("tensor", "ring", ["mbp-a", "studio-a"])
    recs["mbp-a"]["thunderbolt"] = thunderbolt_record(
        tuple(replace(p, peer_rdma=True) if p.port_id == "1" else p for p in mbp))  # the Studio turned RDMA on
    d = decide_mode("auto", ids, recs, addresses, BIG, "mbp-a")
    assert (d["mode"], d["backend"], d["ranks"]) == ("tensor", "jaccl", ["mbp-a", "studio-a"])
    assert d["reason"].startswith("tensor: 2 ranks over jaccl (every pair has an RDMA Thunderbolt link)")
