"""Matching Thunderbolt ports across machines by domain UUID, on the real two-machine captures.

Pairing of SP JSON with networksetup output (SOURCES.md §2 and "Validation"): the M3 Ultra Studio
capture is read with an M3 Ultra / 6-port Studio networksetup (Knurlogic PORTS_M3 or d-inference
Mac A: Thunderbolt N -> en(N+1)), the M5 Max MBP capture with an MBP networksetup (d-inference
Mac B: Thunderbolt 1/2/3 -> en1/en6/en2, or Knurlogic PORTS_M4: en1/en2/en3).

Read by hand from the files:
- studio-a: bus_1, receptacle "2", own 55555555-...-5001, peer AAAAAAAA-...-A000, "80 Gb/s",
  peer advertises unknown_xd_service protocol 64087 (the MBP has RDMA on);
  networksetup "Thunderbolt 2" -> en3.
- mbp-a: bus_0, receptacle "1", own AAAAAAAA-...-A000, peer 55555555-...-5001, "80 Gb/s",
  peer advertises service_ip only (the Studio has no RDMA service);
  networksetup "Thunderbolt 1" -> en1.
=> exactly one link: mbp-a port 1 / en1 <-> studio-a port 2 / en3, 80 Gb/s = 10e9 bytes/s,
   rdma_both False. The Studio's other live port (receptacle 4, OWC Envoy Ultra SSD) is no link.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from ringlet.daemon.probes.common import ThunderboltPort
from ringlet.daemon.probes.links import ThunderboltLink, machines_cabled, match_links
from ringlet.daemon.probes.macos_networksetup import parse_hardware_ports
from ringlet.daemon.probes.macos_spthunderbolt import parse_spthunderbolt_json
from ringlet.daemon.probes.macos_thunderbolt import join_interfaces

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "macos"

STUDIO_JSON = "spthunderbolt_json_macstudio_m3ultra_cabled_to_macbookpro_m5max__studio-a_side.json"
MBP_JSON = "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json"
STUDIO_NS = [
    "networksetup_listallhardwareports_macstudio_m3ultra__knurlogic_trimmed.txt",
    "networksetup_listallhardwareports_macstudio_6tb__d-inference_macA.txt",
]
MBP_NS = [
    "networksetup_listallhardwareports_macbookpro_3tb_with_bridge0__d-inference_macB.txt",
    "networksetup_listallhardwareports_macbookpro_m4max__knurlogic_trimmed.txt",
]

EXPECTED = ThunderboltLink(
    node_a="mbp-a",
    port_a="1",
    iface_a="en1",
    node_b="studio-a",
    port_b="2",
    iface_b="en3",
    speed_bytes_per_s=10_000_000_000,
    rdma_both=False,
    uuid_a="AAAAAAAA-0000-4000-8000-00000000A000",
    uuid_b="55555555-0000-4000-8000-000000005001",
)


def ports(sp_name: str, ns_name: str) -> tuple[ThunderboltPort, ...]:
    sp = parse_spthunderbolt_json((FIX / sp_name).read_text())
    return join_interfaces(sp, parse_hardware_ports((FIX / ns_name).read_text()))


@pytest.mark.parametrize(("studio_ns", "mbp_ns"), list(itertools.product(STUDIO_NS, MBP_NS)))
def test_studio_mbp_pair_yields_exactly_one_link(studio_ns, mbp_ns):
    studio, mbp = ports(STUDIO_JSON, studio_ns), ports(MBP_JSON, mbp_ns)
    assert match_links({"studio-a": studio, "mbp-a": mbp}) == (EXPECTED,)


def test_link_recovered_from_both_sides():
    studio, mbp = ports(STUDIO_JSON, STUDIO_NS[0]), ports(MBP_JSON, MBP_NS[0])
    # Each side, on its own, points at the other: the Studio's port 2 names the MBP's bus, and back.
    s2 = next(p for p in studio if p.port_id == "2")
    m1 = next(p for p in mbp if p.port_id == "1")
    assert s2.peer_domain_uuid == m1.own_domain_uuid and m1.peer_domain_uuid == s2.own_domain_uuid
    # Whichever node runs the matching, and in whatever order the records arrive: the same link.
    assert match_links({"mbp-a": mbp, "studio-a": studio}) == (EXPECTED,)
    assert match_links({"studio-a": tuple(reversed(studio)), "mbp-a": tuple(reversed(mbp))}) == (EXPECTED,)
    # One side alone is no link (the claim must be reciprocal).
    assert match_links({"studio-a": studio}) == ()
    assert match_links({"mbp-a": mbp}) == ()


def test_renamed_nodes_keep_orientation_sorted():
    studio, mbp = ports(STUDIO_JSON, STUDIO_NS[0]), ports(MBP_JSON, MBP_NS[0])
    (link,) = match_links({"a-studio": studio, "z-mbp": mbp})
    assert (link.node_a, link.port_a, link.iface_a) == ("a-studio", "2", "en3")
    assert (link.node_b, link.port_b, link.iface_b) == ("z-mbp", "1", "en1")


def test_rdma_both_needs_both_ends():
    studio, mbp = ports(STUDIO_JSON, STUDIO_NS[0]), ports(MBP_JSON, MBP_NS[0])
    # Pretend the Studio also turned RDMA on: the MBP would then see the 64087 service.
    mbp_rdma = tuple(replace(p, peer_rdma=True) if p.port_id == "1" else p for p in mbp)
    (link,) = match_links({"studio-a": studio, "mbp-a": mbp_rdma})
    assert link.rdma_both is True


def test_one_sided_claim_is_no_link():
    studio, mbp = ports(STUDIO_JSON, STUDIO_NS[0]), ports(MBP_JSON, MBP_NS[0])
    # The MBP's port now names another bus of the Studio (stale capture): not reciprocal.
    stale = tuple(
        replace(p, peer_domain_uuid="55555555-0000-4000-8000-000000005002") if p.port_id == "1" else p for p in mbp
    )
    assert match_links({"studio-a": studio, "mbp-a": stale}) == ()


def test_duplicate_own_uuid_is_ignored(caplog):
    studio, mbp = ports(STUDIO_JSON, STUDIO_NS[0]), ports(MBP_JSON, MBP_NS[0])
    clone = tuple(p for p in mbp)  # a cloned record under another node id claims the same buses
    assert match_links({"studio-a": studio, "mbp-a": mbp, "mbp-clone": clone}) == ()
    assert any("more than one port" in r.getMessage() for r in caplog.records)


def test_speed_when_only_one_side_reports_it():
    studio, mbp = ports(STUDIO_JSON, STUDIO_NS[0]), ports(MBP_JSON, MBP_NS[0])
    mbp_nospeed = tuple(replace(p, link_speed_bytes_per_s=None) for p in mbp)
    (link,) = match_links({"studio-a": studio, "mbp-a": mbp_nospeed})
    assert link.speed_bytes_per_s == 10_000_000_000
    mbp_slow = tuple(replace(p, link_speed_bytes_per_s=5_000_000_000) for p in mbp)
    (link,) = match_links({"studio-a": studio, "mbp-a": mbp_slow})
    assert link.speed_bytes_per_s == 5_000_000_000  # the lower of the two


def test_knurlogic_trimmed_pair_has_no_link_but_parses():
    studio = ports(
        "spthunderbolt_json_TRIMMED_macstudio_m3ultra_two_cables_to_macbookpro_m4max.json",
        "networksetup_listallhardwareports_macstudio_m3ultra__knurlogic_trimmed.txt",
    )
    mbp = ports(
        "spthunderbolt_json_TRIMMED_macbookpro_m4max_two_cables_to_macstudio_m3ultra.json",
        "networksetup_listallhardwareports_macbookpro_m4max__knurlogic_trimmed.txt",
    )
    # Both cables are visible as live ports with a Mac at the other end ...
    assert {(p.port_id, p.interface) for p in studio if p.peer_model == "Mac16,5"} == {("6", "en7"), ("3", "en4")}
    assert {(p.port_id, p.interface) for p in mbp if p.peer_model == "Mac15,14"} == {("2", "en2"), ("3", "en3")}
    # ... but the authors trimmed domain_uuid_key, so nothing can be matched.
    assert match_links({"studio": studio, "mbp": mbp}) == ()


def test_three_node_ring_and_machines_cabled():
    def port(own: str, peer: str) -> ThunderboltPort:
        return ThunderboltPort(
            port_id=own[-1], interface=f"en{own[-1]}", own_domain_uuid=own, peer_domain_uuid=peer,
            link_speed_bytes_per_s=10_000_000_000, peer_rdma=True,
        )  # fmt: skip

    u = {n: f"00000000-0000-4000-8000-00000000000{n}" for n in range(1, 7)}
    nodes = {
        "a": [port(u[1], u[2]), port(u[6], u[5])],
        "b": [port(u[2], u[1]), port(u[3], u[4])],
        "c": [port(u[4], u[3]), port(u[5], u[6])],
        "d": [],
    }
    links = match_links(nodes)
    assert [(lk.node_a, lk.node_b) for lk in links] == [("a", "b"), ("a", "c"), ("b", "c")]
    assert all(lk.rdma_both for lk in links)
    assert machines_cabled(links, "a") == 3
    assert machines_cabled(links, "d") == 1
