"""The route rules (issue 18), pure: which of a member's addresses may be dialled, which is
preferred, and which addresses a plan names. Every expected value is worked out by hand
from the records written here."""

from __future__ import annotations

from ringlet.daemon.cluster.addresses import dial_addresses
from ringlet.daemon.cluster.proposal import readdress, routes_moved
from ringlet.daemon.cluster.routes import (
    RouteOption,
    better,
    candidates,
    common_address,
    describe,
    route_digest,
    stage_addresses,
    status_lines,
    unreachable_routes,
)
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.serving_plan import ServingPlan, StageSpec

SHARED = "192.168.50.1:7100"  # a private bridge address both hosts hold
DOCKER = "172.17.0.1:7100"


def test_an_address_two_nodes_hold_is_never_a_candidate():
    records = {
        "a": {"addresses": [SHARED, "10.201.0.1:7100", "10.202.0.1:7100"]},
        "b": {"addresses": [SHARED, DOCKER, "10.201.0.2:7100", "10.202.0.2:7100"]},
        "c": {"addresses": [DOCKER, "10.201.0.3:7100"]},
    }
    # b's own order, without the two addresses another node lists too; then where we reached it
    assert candidates("b", records, ["10.202.0.2:7100", "10.9.9.9:7100"]) == [
        "10.201.0.2:7100", "10.202.0.2:7100", "10.9.9.9:7100"]
    assert candidates("c", records) == ["10.201.0.3:7100"]
    # where this node reached it is dropped too when another node holds it
    assert candidates("a", records, [DOCKER]) == ["10.201.0.1:7100", "10.202.0.1:7100"]
    # two daemons on one machine share a host, not a host:port
    local = {"x": {"addresses": ["127.0.0.1:7100"]}, "y": {"addresses": ["127.0.0.1:7101"]}}
    assert candidates("y", local) == ["127.0.0.1:7101"]
    # no record yet: where it was reached
    assert candidates("z", {}, ["10.0.0.5:7100"]) == ["10.0.0.5:7100"]


def test_the_fastest_kind_wins_then_throughput_with_hysteresis():
    tb = RouteOption("169.254.1.2:7100", "thunderbolt", 300e6)  # a slower figure than the Ethernet's
    eth = RouteOption("10.0.0.2:7100", "ethernet", 900e6)
    wifi = RouteOption("192.168.1.2:7100", "wifi", 2e9)
    assert better(None, [eth, wifi, tb]) == tb
    assert better(eth.address, [eth, tb]) == tb  # a faster kind replaces the route in use
    assert better(tb.address, [eth, tb, wifi]) == tb
    # same kind: 150 MB/s is 1.5x the 100 MB/s in use, under SWITCH_FACTOR (2): kept
    now, faster = RouteOption("10.0.0.2:7100", "ethernet", 100e6), RouteOption("10.1.0.2:7100", "ethernet", 150e6)
    much = RouteOption("10.2.0.2:7100", "ethernet", 250e6)
    assert better(now.address, [now, faster]) == now
    assert better(now.address, [now, much]) == much  # 2.5x: replaced
    assert better(now.address, [faster]) == faster  # the one in use did not answer
    assert better(now.address, []) is None


def test_a_stage_stands_where_every_member_reaches_it_and_its_hop_on_the_neighbours_fastest_link():
    """Three Macs in a Thunderbolt ring without a bridge (a cable per pair, each end its own
    169.254 address) and all on one Ethernet switch, ring order a -> b -> c -> a."""
    eth = {n: f"10.0.0.{k}:7100" for k, n in enumerate("abc", start=1)}
    tb = {("a", "b"): "169.254.1.2:7100", ("b", "c"): "169.254.2.3:7100", ("c", "a"): "169.254.3.1:7100",
          ("b", "a"): "169.254.1.1:7100", ("c", "b"): "169.254.2.2:7100", ("a", "c"): "169.254.3.3:7100"}

    def route(src: str, dst: str) -> dict:  # src's cable to dst reaches dst's end only from src
        return {"address": tb[(src, dst)], "kind": "thunderbolt", "reachable": sorted([eth[dst], tb[(src, dst)]]),
                "unreachable": {tb[(o, dst)]: "DEADLINE_EXCEEDED" for o in "abc" if o not in (src, dst)}}

    records = {n: {"addresses": [eth[n], *(tb[(o, n)] for o in "abc" if o != n)],
                   "routes": {o: route(n, o) for o in "abc" if o != n}} for n in "abc"}
    got = stage_addresses(["a", "b", "c"], ["a", "b", "c"], records, lambda i: "fallback")
    # the only address both others reach is the Ethernet one; the hop is the previous stage's cable
    assert got == {"a": (eth["a"], tb[("c", "a")]), "b": (eth["b"], tb[("a", "b")]), "c": (eth["c"], tb[("b", "c")])}
    # two members without a ring (a tensor plan): each stands where the other dials it (its cable end)
    assert stage_addresses(["a", "b"], [], records, lambda i: "x") == {"a": (tb[("b", "a")], ""),
                                                                       "b": (tb[("a", "b")], "")}
    # a member that has not said where it reaches the others: the fallback
    records["c"].pop("routes")
    assert stage_addresses(["a", "b", "c"], ["a", "b", "c"], records, lambda i: f"fb-{i}")["a"] == ("fb-a", "")


def test_the_common_address_is_the_one_most_members_use():
    records = {"x": {"addresses": ["10.201.0.1:7100", "10.202.0.1:7100"]},
               "y": {"routes": {"x": {"address": "10.202.0.1:7100",
                                      "reachable": ["10.201.0.1:7100", "10.202.0.1:7100"]}}},
               "z": {"routes": {"x": {"address": "10.202.0.1:7100",
                                      "reachable": ["10.201.0.1:7100", "10.202.0.1:7100"]}}}}
    assert common_address("x", ["y", "z"], records) == "10.202.0.1:7100"  # both use it, though listed second
    records["z"]["routes"]["x"]["address"] = "10.201.0.1:7100"
    assert common_address("x", ["y", "z"], records) == "10.201.0.1:7100"  # a tie: x's own order
    records["z"]["routes"]["x"]["reachable"] = ["10.201.0.1:7100"]
    assert common_address("x", ["y", "z"], records) == "10.201.0.1:7100"  # the only one both reach
    records["y"]["routes"]["x"]["reachable"] = ["10.202.0.1:7100"]
    assert common_address("x", ["y", "z"], records) is None


def test_an_unreachable_address_is_reported_with_where_from_and_the_flag():
    records = {"3f241d0b1ec9ab91": {"routes": {"3e6874abd9c8a300": {
        "address": "10.201.0.2:7100", "reachable": ["10.201.0.2:7100"], "broken": ["10.202.0.2:7100"],
        "unreachable": {"10.202.0.2:7100": "DEADLINE_EXCEEDED", "169.254.3.3:7100": "UNAVAILABLE"}}}},
        "3e6874abd9c8a300": {"routes": {"3f241d0b1ec9ab91": {"address": None, "reachable": [],
                                                             "unreachable": {"10.201.0.1:7100": "UNAVAILABLE"}}}}}
    got = unreachable_routes(records, {"10.202.0.2:7100"})
    assert [(e["from"][:4], e["to"][:4], e["address"], e["via"], e["in_plan"], e["broke"]) for e in got] == [
        ("3e68", "3f24", "10.201.0.1:7100", None, False, False),
        ("3f24", "3e68", "10.202.0.2:7100", "10.201.0.2:7100", True, True),
        ("3f24", "3e68", "169.254.3.3:7100", "10.201.0.2:7100", False, False)]
    assert describe(got[1]) == (
        "10.202.0.2:7100 of 3e6874ab (in the plan) from 3f241d0b: stopped answering (DEADLINE_EXCEEDED); reached at "
        "10.201.0.2:7100 instead (to pin an address: start 3e6874abd9c8a300 with --advertise-host ADDRESS (an "
        "address its peers reach) or --interface NAME)")
    assert describe(got[0]) == (
        "10.201.0.1:7100 of 3f241d0b from 3e6874ab: UNAVAILABLE; no other address of it answers: start "
        "3f241d0b1ec9ab91 with --advertise-host ADDRESS (an address its peers reach) or --interface NAME")
    # status: a line each for the two that matter; an address that never answered from there, while
    # another of the node's does, only in a summary line
    assert status_lines(got) == [f"unreachable: {describe(got[0])}", f"unreachable: {describe(got[1])}",
                                 "never reached (other addresses of these nodes serve): 169.254.3.3:7100 of 3e6874ab "
                                 "from 3f241d0b"]


def test_routes_moved_compares_addresses_and_hops_of_a_pipeline():
    committed = ServingPlan(epoch=3, plan_id="p", stages=(
        StageSpec("10.0.0.1:7100", 0, 10, "a"),
        StageSpec("10.0.0.2:7100", 10, 30, "b", hop_address="169.254.1.2:7100")))
    same = [pb.LayerRange(node_id="a", grpc_address="10.0.0.1:7100"),
            pb.LayerRange(node_id="b", grpc_address="10.0.0.2:7100", hop_address="169.254.1.2:7100")]
    assert not routes_moved(committed, same)
    assert not routes_moved(None, same)
    hop_gone = [same[0], pb.LayerRange(node_id="b", grpc_address="10.0.0.2:7100")]
    assert routes_moved(committed, hop_gone)
    moved = [pb.LayerRange(node_id="a", grpc_address="10.1.0.1:7100"), same[1]]
    assert routes_moved(committed, moved)


def test_the_kv_of_the_plan_replaced_is_fetched_where_its_holders_answer_now():
    previous = [pb.LayerRange(node_id="a", start=0, end=10, grpc_address="10.202.0.1:7100"),
                pb.LayerRange(node_id="gone", start=10, end=30, grpc_address="10.202.0.3:7100", rebuild=True)]
    now = [pb.LayerRange(node_id="a", grpc_address="10.201.0.1:7100"), pb.LayerRange(node_id="b", grpc_address="x")]
    got = readdress(previous, now)
    assert [(r.node_id, r.grpc_address, r.start, r.end, r.rebuild) for r in got] == [
        ("a", "10.201.0.1:7100", 0, 10, False), ("gone", "10.202.0.3:7100", 10, 30, True)]


def test_only_what_plans_depend_on_changes_the_digest():
    record = {"addresses": ["10.0.0.1:7100"], "links": {"b": {"bandwidth_bytes_per_s": 1e8}},
              "routes": {"b": {"address": "10.0.0.2:7100", "kind": "ethernet", "reachable": ["10.0.0.2:7100"]}}}
    remeasured = {**record, "links": {"b": {"bandwidth_bytes_per_s": 2e8}}}
    assert route_digest(record) == route_digest(remeasured)
    moved = {**record, "routes": {"b": {"address": "10.1.0.2:7100", "reachable": ["10.1.0.2:7100"]}}}
    assert route_digest(record) != route_digest(moved)


def test_a_node_bound_to_every_interface_may_be_dialled_at_each_of_them():
    assert dial_addresses("10.0.0.1", "0.0.0.0", ["10.0.0.1", "169.254.3.1"], 7100) == [  # noqa: S104
        "10.0.0.1:7100", "169.254.3.1:7100"]
    assert dial_addresses("10.0.0.1", "10.0.0.1", ["10.0.0.1", "169.254.3.1"], 7100) == ["10.0.0.1:7100"]
    assert dial_addresses("10.0.0.9", "0.0.0.0", ["127.0.0.1", "10.0.0.1"], 7100) == [  # noqa: S104
        "10.0.0.9:7100", "10.0.0.1:7100"]


def test_a_malformed_record_from_a_peer_is_ignored_not_raised():
    """Records come over the wire: wrong types anywhere give no route, never an exception."""
    records = {"a": {"addresses": [{"x": 1}, 7, "10.0.0.1:7100"], "routes": ["nope"]},
               "b": {"addresses": "10.0.0.2:7100",
                     "routes": {"a": {"address": {"h": 1}, "reachable": [[1], "10.0.0.1:7100"],
                                      "unreachable": ["10.0.0.9:7100"], "broken": 3}}},
               "c": None}
    assert candidates("a", records) == ["10.0.0.1:7100"]
    assert candidates("b", records, ["10.0.0.2:7100"]) == ["10.0.0.2:7100"]
    assert common_address("a", ["b"], records) == "10.0.0.1:7100"
    assert stage_addresses(["a", "b"], ["a", "b"], records, lambda i: f"fb-{i}") == {
        "a": ("10.0.0.1:7100", ""), "b": ("fb-b", "")}
    assert unreachable_routes(records) == []
    assert route_digest(records["b"]) == route_digest({"routes": {"a": {"address": {"h": 1},
                                                                         "reachable": ["10.0.0.1:7100"]}}})
