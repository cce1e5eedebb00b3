"""Tensor-parallel planning and MLX host configuration on topology fixtures, values written by hand.

Fixtures:
- full mesh with RDMA: three Mac Studios, every pair cabled with Thunderbolt 5, RDMA on;
- ring only: four Mac minis cabled in a square (plus a 1 GbE switch the ring must avoid);
- daisy chain: a - b - c, no cable from c back to a;
- two RDMA pairs joined only by Ethernet (hybrid);
- the real M5 Max MBP <-> M3 Ultra Studio captures (tests/fixtures/macos) through the probes.

Formats (checked against MLX's source, see daemon/tensor/planning/mlx_hosts.py): ring ``MLX_HOSTFILE`` = JSON
list per rank of ``"ip:port"``, rank i listening on its IP on the cable from rank i-1;
jaccl ``MLX_IBV_DEVICES`` = JSON matrix ``[i][j] = "rdma_<iface of i towards j>"`` with
``null`` on the diagonal, ``MLX_JACCL_COORDINATOR`` = rank 0's ``ip:port``.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from ringlet.daemon.tensor.planning.decision import TPRefused, decide
from ringlet.daemon.tensor.planning.inputs import TPLink, TPMember, TPModelSpec, tensor_refusal, tp_spec_from_config
from ringlet.daemon.tensor.planning.links import lan_links, links_from_thunderbolt, loopback_links
from ringlet.daemon.tensor.planning.mlx_hosts import HostConfig, decision_host_configs, host_config
from ringlet.daemon.tensor.planning.topology import find_ring

GiB = 1 << 30

# ---------------------------------------------------------------- fixture: full mesh with RDMA

MESH_MEMBERS = [
    TPMember("studio-a", "10.0.0.11", 200 * GiB, 800e9),
    TPMember("studio-b", "10.0.0.12", 200 * GiB, 800e9),
    TPMember("studio-c", "10.0.0.13", 200 * GiB, 800e9),
]
MESH_LINKS = [  # Thunderbolt 5 at 80 Gb/s = 10e9 bytes/s, RDMA both ways
    TPLink("studio-a", "studio-b", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en2", iface_b="en2"),
    TPLink("studio-a", "studio-c", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en3", iface_b="en2"),
    TPLink("studio-b", "studio-c", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en3", iface_b="en3"),
]
# 24 heads, 6 kv heads, MLP 18432: divides by 2, 3, 6
BIG = TPModelSpec(
    num_heads=24,
    num_kv_heads=6,
    num_layers=40,
    total_bytes=60 * 10**9,
    replicated_bytes=2 * 10**9,
    hidden_size=6144,
    intermediate_size=18432,
    name="big",
)


def test_full_rdma_mesh_is_tensor_over_jaccl():
    d = decide(MESH_MEMBERS, MESH_LINKS, BIG)
    assert (d.mode, d.backend, d.ranks) == ("tensor", "jaccl", ("studio-a", "studio-b", "studio-c"))
    assert d.groups == (("studio-a", "studio-b", "studio-c"),) and d.group_backends == ("jaccl",)
    assert d.reason.startswith("tensor: 3 ranks over jaccl (every pair has an RDMA Thunderbolt link)")
    # weights: (2e9 + 58e9/3) / 800e9 = 26.67 ms; 81 all-reduces of 24576 B: 4 x (10 us + 0.82 us) each
    assert d.predicted["tensor"] == pytest.approx(0.026667 + 81 * 4 * (10e-6 + 24576 / 3 / 10e9), rel=1e-3)
    assert d.predicted["pipeline"] == pytest.approx(0.075 + 3 * 10e-6, rel=1e-3)

    (hc,) = decision_host_configs(d, MESH_MEMBERS, MESH_LINKS, base_port=40000)
    assert hc.backend == "jaccl"
    assert json.loads(hc.files["mlx_ibv_devices.json"]) == [
        [None, "rdma_en2", "rdma_en3"],
        ["rdma_en2", None, "rdma_en3"],
        ["rdma_en2", "rdma_en3", None],
    ]
    assert hc.env(2, "/run/ringlet/tp") == {
        "MLX_IBV_DEVICES": "/run/ringlet/tp/mlx_ibv_devices.json",
        "MLX_JACCL_COORDINATOR": "10.0.0.11:40000",
        "MLX_RANK": "2",
    }
    assert hc.launch_hostfile == {
        "backend": "jaccl",
        "envs": [],
        "hosts": [
            {"ssh": "10.0.0.11", "ips": ["10.0.0.11"], "rdma": [None, "rdma_en2", "rdma_en3"]},
            {"ssh": "10.0.0.12", "ips": ["10.0.0.12"], "rdma": ["rdma_en2", None, "rdma_en3"]},
            {"ssh": "10.0.0.13", "ips": ["10.0.0.13"], "rdma": ["rdma_en2", "rdma_en3", None]},
        ],
    }


def test_leader_is_rank_zero_and_matrix_follows_rank_order():
    d = decide(MESH_MEMBERS, MESH_LINKS, BIG, leader="studio-b")
    assert d.ranks == ("studio-b", "studio-a", "studio-c")
    hc = host_config(d.ranks, d.backend, MESH_MEMBERS, MESH_LINKS, base_port=40000)
    assert json.loads(hc.files["mlx_ibv_devices.json"]) == [
        [None, "rdma_en2", "rdma_en3"],  # studio-b: en2 to a, en3 to c
        ["rdma_en2", None, "rdma_en3"],  # studio-a: en2 to b, en3 to c
        ["rdma_en3", "rdma_en2", None],  # studio-c: en3 to b, en2 to a
    ]
    assert hc.env(0, "/d")["MLX_JACCL_COORDINATOR"] == "10.0.0.12:40000"


def test_two_cables_per_pair_give_device_lists():
    doubled = MESH_LINKS + [
        TPLink("studio-a", "studio-b", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en4", iface_b="en4"),
        TPLink("studio-a", "studio-c", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en5", iface_b="en4"),
        TPLink("studio-b", "studio-c", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en5", iface_b="en5"),
    ]
    hc = host_config(("studio-a", "studio-b", "studio-c"), "jaccl", MESH_MEMBERS, doubled, base_port=40000)
    assert json.loads(hc.files["mlx_ibv_devices.json"]) == [
        [None, ["rdma_en2", "rdma_en4"], ["rdma_en3", "rdma_en5"]],
        [["rdma_en2", "rdma_en4"], None, ["rdma_en3", "rdma_en5"]],
        [["rdma_en2", "rdma_en4"], ["rdma_en3", "rdma_en5"], None],
    ]


def test_launch_hostfile_parses_with_mlx_own_reader(tmp_path):
    common = pytest.importorskip("mlx._distributed_utils.common")
    (hc,) = decision_host_configs(decide(MESH_MEMBERS, MESH_LINKS, BIG), MESH_MEMBERS, MESH_LINKS)
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hc.launch_hostfile))
    parsed = common.Hostfile.from_file(path)
    assert parsed.backend == "jaccl"
    assert [(h.rank, h.ssh_hostname, h.ips, h.rdma) for h in parsed.hosts] == [
        (0, "10.0.0.11", ["10.0.0.11"], [None, "rdma_en2", "rdma_en3"]),
        (1, "10.0.0.12", ["10.0.0.12"], ["rdma_en2", None, "rdma_en3"]),
        (2, "10.0.0.13", ["10.0.0.13"], ["rdma_en2", "rdma_en3", None]),
    ]
    assert parsed.to_json() == hc.launch_hostfile


# ---------------------------------------------------------------- fixture: ring only

SQUARE = ["mini-a", "mini-b", "mini-c", "mini-d"]
SQUARE_MEMBERS = [TPMember(n, f"10.0.1.{i + 1}", 24 * GiB, 120e9) for i, n in enumerate(SQUARE)]
SQUARE_LINKS = [  # Thunderbolt 4 (40 Gb/s = 5e9 B/s), point-to-point /30 subnets as mlx.distributed_config assigns
    TPLink(
        "mini-a",
        "mini-b",
        "thunderbolt",
        bandwidth=5e9,
        iface_a="en1",
        iface_b="en2",
        ip_a="192.168.0.1",
        ip_b="192.168.0.2",
    ),
    TPLink(
        "mini-b",
        "mini-c",
        "thunderbolt",
        bandwidth=5e9,
        iface_a="en1",
        iface_b="en2",
        ip_a="192.168.0.5",
        ip_b="192.168.0.6",
    ),
    TPLink(
        "mini-c",
        "mini-d",
        "thunderbolt",
        bandwidth=5e9,
        iface_a="en1",
        iface_b="en2",
        ip_a="192.168.0.9",
        ip_b="192.168.0.10",
    ),
    TPLink(
        "mini-d",
        "mini-a",
        "thunderbolt",
        bandwidth=5e9,
        iface_a="en1",
        iface_b="en2",
        ip_a="192.168.0.13",
        ip_b="192.168.0.14",
    ),
]
MID = TPModelSpec(
    num_heads=32,
    num_kv_heads=8,
    num_layers=32,
    total_bytes=16 * 10**9,
    replicated_bytes=10**9,
    hidden_size=4096,
    intermediate_size=14336,
    name="mid",
)

SQUARE_HOSTFILE = [
    ["192.168.0.14:40000"],  # mini-a on the cable from mini-d
    ["192.168.0.2:40001"],  # mini-b on the cable from mini-a
    ["192.168.0.6:40002"],  # mini-c on the cable from mini-b
    ["192.168.0.10:40003"],  # mini-d on the cable from mini-c
]


@pytest.mark.parametrize("with_lan", [False, True])
def test_ring_only_is_tensor_over_ring_along_the_cables(with_lan):
    links = SQUARE_LINKS + (list(lan_links(SQUARE)) if with_lan else [])  # a 1 GbE switch must not win
    d = decide(SQUARE_MEMBERS, links, MID)
    assert (d.mode, d.backend, d.ranks) == ("tensor", "ring", ("mini-a", "mini-b", "mini-c", "mini-d"))
    assert "thunderbolt links form a ring mini-a -> mini-b -> mini-c -> mini-d -> mini-a" in d.reason
    (hc,) = decision_host_configs(d, SQUARE_MEMBERS, links, base_port=40000)
    assert json.loads(hc.files["mlx_hostfile.json"]) == SQUARE_HOSTFILE
    assert hc.env(3, "/tmp/ep1") == {"MLX_HOSTFILE": "/tmp/ep1/mlx_hostfile.json", "MLX_RANK": "3"}
    assert [h["ips"] for h in hc.launch_hostfile["hosts"]] == [
        ["192.168.0.14"],
        ["192.168.0.2"],
        ["192.168.0.6"],
        ["192.168.0.10"],
    ]


def test_rdma_ring_without_diagonals_is_still_ring_backend():
    links = [replace(x, rdma=True, bandwidth=10e9) for x in SQUARE_LINKS]
    d = decide(SQUARE_MEMBERS, links, MID)
    assert (d.mode, d.backend, d.ranks) == ("tensor", "ring", ("mini-a", "mini-b", "mini-c", "mini-d"))
    with pytest.raises(ValueError, match="missing: mini-a-mini-c, mini-b-mini-d"):
        host_config(d.ranks, "jaccl", SQUARE_MEMBERS, links)


def test_two_members_one_cable_is_a_ring():
    links = SQUARE_LINKS[:1]
    d = decide(SQUARE_MEMBERS[:2], links, MID, mode="tensor")
    assert (d.mode, d.backend, d.ranks) == ("tensor", "ring", ("mini-a", "mini-b"))
    hc = host_config(d.ranks, "ring", SQUARE_MEMBERS, links, base_port=50000)
    assert json.loads(hc.files["mlx_hostfile.json"]) == [["192.168.0.1:50000"], ["192.168.0.2:50001"]]


# ---------------------------------------------------------------- fixture: daisy chain

CHAIN_MEMBERS = SQUARE_MEMBERS[:3]
CHAIN_LINKS = SQUARE_LINKS[:2]  # a-b, b-c; nothing closes c -> a


def test_daisy_chain_stays_on_the_pipeline():
    d = decide(CHAIN_MEMBERS, CHAIN_LINKS, BIG)  # 24 heads divide by 3: only the cabling is missing
    assert (d.mode, d.backend, d.ranks, d.groups) == ("pipeline", "none", ("mini-a", "mini-b", "mini-c"), ())
    assert d.reason == (
        "pipeline: tensor not possible (no backend for 3 members: the links form no ring "
        "(no Hamiltonian cycle) and not every pair has RDMA)"
    )
    assert decision_host_configs(d, CHAIN_MEMBERS, CHAIN_LINKS) == ()
    with pytest.raises(TPRefused, match="tensor mode refused: no backend for 3 members"):
        decide(CHAIN_MEMBERS, CHAIN_LINKS, BIG, mode="tensor")
    assert find_ring(["mini-a", "mini-b", "mini-c"], CHAIN_LINKS) is None


# ---------------------------------------------------------------- heads, modes, hybrid

SMOL = TPModelSpec(
    num_heads=9,
    num_kv_heads=3,
    num_layers=30,
    total_bytes=538_000_000,
    replicated_bytes=113_000_000,
    hidden_size=576,
    intermediate_size=1536,
    name="smollm2-135m",
)


def test_heads_that_do_not_divide_are_refused_with_the_reason():
    ids = ["r0", "r1"]
    members = [TPMember(i, "127.0.0.1", 8 * GiB) for i in ids]
    msg = (
        "tensor mode refused: smollm2-135m: 9 attention heads and 3 key/value heads do not divide by 2 ranks; "
        "group sizes that work: 3"
    )
    with pytest.raises(TPRefused) as err:
        decide(members, loopback_links(ids), SMOL, mode="tensor")
    assert str(err.value) == msg
    d = decide(members, loopback_links(ids), SMOL)
    assert (d.mode, d.backend) == ("pipeline", "none") and "do not divide by 2 ranks" in d.reason
    assert tensor_refusal(SMOL, 3) is None
    assert tensor_refusal(replace(SMOL, num_kv_heads=2, num_heads=6), 3) == (
        "smollm2-135m: 2 key/value heads do not divide by 3 ranks; group sizes that work: 2"
    )
    assert "MLP width 100" in tensor_refusal(replace(SMOL, num_heads=6, num_kv_heads=6, intermediate_size=100), 3)
    assert "no model.shard()" in tensor_refusal(replace(SMOL, shardable=False), 3)
    # a model without attention heads (a config of rwkv7.py's, or mamba.py's), no num_hidden_layers
    # (nemotron_h.py derives it from its block list): refused, not a crash at start-up
    rwkv = tp_spec_from_config({"model_type": "rwkv7", "hidden_size": 64, "vocab_size": 160}, 1000, num_layers=4)
    assert (rwkv.num_heads, rwkv.num_layers) == (0, 4)
    assert tensor_refusal(rwkv, 2) == "rwkv7: it has no attention heads to split across ranks"
    q = replace(SMOL, num_heads=12, num_kv_heads=6, head_dim=64, intermediate_size=1536, quant_group_size=64)
    assert tensor_refusal(q, 6) is None  # 1536/6 = 256 and 768/6 = 128 are multiples of 64
    assert tensor_refusal(replace(q, intermediate_size=1344), 6) == (
        "smollm2-135m: quantized MLP width 1344/6 = 224 is not a multiple of the group size 64"
    )


def test_three_loopback_ranks_run_the_default_model_in_tensor_mode():
    ids = ["rank0", "rank1", "rank2"]
    members = [TPMember(i, "127.0.0.1", 8 * GiB, 8e9) for i in ids]
    d = decide(members, loopback_links(ids), SMOL, mode="tensor")
    assert (d.mode, d.backend, d.ranks) == ("tensor", "ring", tuple(ids))
    assert d.reason == "--mode tensor: 3 ranks over ring: loopback links form a ring rank0 -> rank1 -> rank2 -> rank0"
    hc = host_config(d.ranks, "ring", members, loopback_links(ids), base_port=32323)
    assert json.loads(hc.files["mlx_hostfile.json"]) == [["127.0.0.1:32323"], ["127.0.0.1:32324"], ["127.0.0.1:32325"]]


def test_mode_overrides():
    d = decide(MESH_MEMBERS, MESH_LINKS, BIG, mode="pipeline")
    assert (d.mode, d.backend, d.reason) == ("pipeline", "none", "--mode pipeline")
    d = decide(MESH_MEMBERS, MESH_LINKS, BIG, mode="tensor")
    assert (d.mode, d.backend) == ("tensor", "jaccl") and d.reason.startswith("--mode tensor: 3 ranks over jaccl")
    with pytest.raises(TPRefused, match="hybrid mode refused"):
        decide(MESH_MEMBERS, MESH_LINKS, BIG, mode="hybrid")
    with pytest.raises(ValueError, match="--mode must be one of"):
        decide(MESH_MEMBERS, MESH_LINKS, BIG, mode="tensr")
    one = decide(MESH_MEMBERS[:1], [], BIG)
    assert (one.mode, one.ranks, one.reason) == ("pipeline", ("studio-a",), "one member: nothing to split")
    with pytest.raises(TPRefused, match="needs at least 2 ranks"):
        decide(MESH_MEMBERS[:1], [], BIG, mode="tensor")


def test_slow_links_keep_the_pipeline():
    """Wi-Fi between two fast machines: 81 all-reduces x 2 x 3 ms lose to one machine's 75 ms."""
    members = MESH_MEMBERS[:2]
    d = decide(members, lan_links(["studio-a", "studio-b"], kind="wifi"), BIG)
    assert (d.mode, d.backend) == ("pipeline", "none")
    assert d.reason.startswith("pipeline: predicted faster") and d.predicted["tensor"] > d.predicted["pipeline"]


def test_memory_too_small_for_a_rank():
    small = [replace(m, usable_memory=10 * GiB) for m in MESH_MEMBERS]  # each rank needs 21.3 GB
    with pytest.raises(TPRefused, match="each rank needs 19.87 GiB of weights"):
        decide(small, MESH_LINKS, BIG, mode="tensor")


PAIRS = ["a", "b", "c", "d"]
PAIR_MEMBERS = [TPMember(n, f"10.0.2.{i + 1}", 128 * GiB, 400e9) for i, n in enumerate(PAIRS)]
PAIR_LINKS = [
    TPLink("a", "b", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en2", iface_b="en2"),
    TPLink("c", "d", "thunderbolt", rdma=True, bandwidth=10e9, iface_a="en2", iface_b="en2"),
    *lan_links(PAIRS),  # 1 GbE between everyone
]
HYB = TPModelSpec(
    num_heads=6,
    num_kv_heads=2,
    num_layers=60,
    total_bytes=120 * 10**9,
    replicated_bytes=2 * 10**9,
    hidden_size=8192,
    intermediate_size=24576,
    name="hyb",
)  # heads divide by 2, not by 4


def test_two_rdma_pairs_form_a_hybrid_plan():
    d = decide(PAIR_MEMBERS, PAIR_LINKS, HYB)
    assert (d.mode, d.backend) == ("hybrid", "jaccl")
    assert d.groups == (("a", "b"), ("c", "d")) and d.group_backends == ("jaccl", "jaccl")
    assert d.ranks == ("a", "b", "c", "d")
    assert d.reason.startswith("hybrid: 2 groups of 2 over jaccl/jaccl")
    hcs = decision_host_configs(d, PAIR_MEMBERS, PAIR_LINKS, base_port=40000)
    assert [json.loads(h.files["mlx_ibv_devices.json"]) for h in hcs] == [
        [[None, "rdma_en2"], ["rdma_en2", None]],
        [[None, "rdma_en2"], ["rdma_en2", None]],
    ]
    assert [h.env(0, "/x")["MLX_JACCL_COORDINATOR"] for h in hcs] == ["10.0.2.1:40000", "10.0.2.3:40064"]
    with pytest.raises(TPRefused, match="6 attention heads and 2 key/value heads do not divide by 4"):
        decide(PAIR_MEMBERS, PAIR_LINKS, HYB, mode="tensor")


def test_decision_ignores_input_order():
    rng = random.Random(7)
    want = decide(SQUARE_MEMBERS, SQUARE_LINKS + list(lan_links(SQUARE)), MID)
    for _ in range(5):
        members = rng.sample(SQUARE_MEMBERS, len(SQUARE_MEMBERS))
        links = [
            replace(x, a=x.b, b=x.a, iface_a=x.iface_b, iface_b=x.iface_a, ip_a=x.ip_b, ip_b=x.ip_a)
            if rng.random() < 0.5
            else x
            for x in SQUARE_LINKS + list(lan_links(SQUARE))
        ]
        rng.shuffle(links)
        assert decide(members, links, MID) == want
        assert host_config(want.ranks, "ring", members, links, base_port=40000).files == {
            "mlx_hostfile.json": json.dumps(SQUARE_HOSTFILE)
        }


def test_host_config_write_and_env(tmp_path):
    hc = host_config(("mini-a", "mini-b"), "ring", SQUARE_MEMBERS, SQUARE_LINKS[:1], base_port=41000)
    assert isinstance(hc, HostConfig) and hc.size == 2
    (path,) = hc.write(tmp_path / "epoch-1")
    assert json.loads(path.read_text()) == [["192.168.0.1:41000"], ["192.168.0.2:41001"]]
    assert hc.env(1, path.parent) == {"MLX_HOSTFILE": str(path), "MLX_RANK": "1"}
    with pytest.raises(ValueError, match="rank 2 out of range"):
        hc.env(2, tmp_path)
    with pytest.raises(ValueError, match="no MLX host configuration for backend 'none'"):
        host_config(("mini-a",), "none", SQUARE_MEMBERS, [])


# ---------------------------------------------------------------- real captures through the probes

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "macos"


def _captured_ports():
    from ringlet.daemon.probes.macos_networksetup import parse_hardware_ports
    from ringlet.daemon.probes.macos_spthunderbolt import parse_spthunderbolt_json
    from ringlet.daemon.probes.macos_thunderbolt import join_interfaces

    def ports(sp: str, ns: str):
        return join_interfaces(
            parse_spthunderbolt_json((FIX / sp).read_text()), parse_hardware_ports((FIX / ns).read_text())
        )

    studio = ports(
        "spthunderbolt_json_macstudio_m3ultra_cabled_to_macbookpro_m5max__studio-a_side.json",
        "networksetup_listallhardwareports_macstudio_m3ultra__knurlogic_trimmed.txt",
    )
    mbp = ports(
        "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json",
        "networksetup_listallhardwareports_macbookpro_3tb_with_bridge0__d-inference_macB.txt",
    )
    return studio, mbp


CAPTURE_MEMBERS = [
    TPMember("mbp-a", "192.168.1.20", 100 * GiB, 500e9),
    TPMember("studio-a", "192.168.1.10", 200 * GiB, 800e9),
]


def test_real_captures_give_a_ring_over_the_cable():
    """The Studio does not advertise RDMA in its capture: TCP ring over the one 80 Gb/s cable."""
    from ringlet.daemon.probes import match_links

    studio, mbp = _captured_ports()
    links = links_from_thunderbolt(match_links({"studio-a": studio, "mbp-a": mbp}))
    assert links == (
        TPLink("mbp-a", "studio-a", "thunderbolt", rdma=False, bandwidth=10e9, iface_a="en1", iface_b="en3"),
    )
    d = decide(CAPTURE_MEMBERS, links, BIG, mode="tensor")
    assert (d.mode, d.backend, d.ranks) == ("tensor", "ring", ("mbp-a", "studio-a"))
    hc = host_config(d.ranks, d.backend, CAPTURE_MEMBERS, links, base_port=40000)
    assert json.loads(hc.files["mlx_hostfile.json"]) == [["192.168.1.20:40000"], ["192.168.1.10:40001"]]
    # With the cable's own addresses known, the ring runs over it
    links_ip = links_from_thunderbolt(
        match_links({"studio-a": studio, "mbp-a": mbp}),
        ips={("mbp-a", "en1"): "169.254.10.1", ("studio-a", "en3"): "169.254.10.2"},
    )
    hc = host_config(d.ranks, d.backend, CAPTURE_MEMBERS, links_ip, base_port=40000)
    assert json.loads(hc.files["mlx_hostfile.json"]) == [["169.254.10.1:40000"], ["169.254.10.2:40001"]]


def test_real_captures_with_rdma_on_both_ends_give_jaccl():
    from ringlet.daemon.probes import match_links

    studio, mbp = _captured_ports()
    mbp = tuple(replace(p, peer_rdma=True) if p.port_id == "1" else p for p in mbp)  # the Studio turned RDMA on
    links = links_from_thunderbolt(match_links({"studio-a": studio, "mbp-a": mbp}))
    d = decide(CAPTURE_MEMBERS, links, BIG)
    assert (d.mode, d.backend, d.ranks) == ("tensor", "jaccl", ("mbp-a", "studio-a"))
    (hc,) = decision_host_configs(d, CAPTURE_MEMBERS, links, base_port=40000)
    assert json.loads(hc.files["mlx_ibv_devices.json"]) == [[None, "rdma_en1"], ["rdma_en3", None]]
    assert hc.env(1, "/d") == {
        "MLX_IBV_DEVICES": "/d/mlx_ibv_devices.json",
        "MLX_JACCL_COORDINATOR": "192.168.1.20:40000",
        "MLX_RANK": "1",
    }


def test_default_model_spec_from_the_gguf(default_location):
    from ringlet.daemon.tensor.group import model_tp_spec

    spec = model_tp_spec(default_location, "float32")
    assert (spec.num_heads, spec.num_kv_heads, spec.num_layers, spec.hidden_size) == (9, 3, 30, 576)
    assert spec.intermediate_size == 1536 and spec.shardable and spec.quant_group_size is None
    assert spec.replicated_bytes == 49152 * 576 * 4 + 576 * 4  # tied embedding + final norm
    assert tensor_refusal(spec, 2).startswith("smollm2-135m: 9 attention heads and 3 key/value heads do not divide")
    assert tensor_refusal(spec, 3) is None
    q = model_tp_spec(default_location, None)  # Q4_1 kept quantized: MLX group size 32
    assert q.quant_group_size == 32 and tensor_refusal(q, 3) is None
