"""macOS Thunderbolt parsers on the real captures in tests/fixtures/macos (see tests/fixtures/SOURCES.md).

Every expected value below was written by hand from reading the fixture file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ringlet.daemon.probes.common import ProbeParseError, ThunderboltPort
from ringlet.daemon.probes.macos_ifconfig import BridgeCacheEntry, IPv4Address, parse_ifconfig_macos
from ringlet.daemon.probes.macos_networksetup import parse_hardware_ports, parse_network_services
from ringlet.daemon.probes.macos_spthunderbolt import parse_spthunderbolt_json, parse_spthunderbolt_text
from ringlet.daemon.probes.macos_thunderbolt import (
    active_thunderbolt_interfaces,
    bridge_loop_warning,
    join_interfaces,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "macos"

STUDIO_JSON = "spthunderbolt_json_macstudio_m3ultra_cabled_to_macbookpro_m5max__studio-a_side.json"
MBP_JSON = "spthunderbolt_json_macbookpro_m5max_cabled_to_macstudio_m3ultra__mbp-a_side.json"
KNURL_STUDIO_JSON = "spthunderbolt_json_TRIMMED_macstudio_m3ultra_two_cables_to_macbookpro_m4max.json"
KNURL_MBP_JSON = "spthunderbolt_json_TRIMMED_macbookpro_m4max_two_cables_to_macstudio_m3ultra.json"
SP_TEXT = "spthunderbolt_text_PARTIAL_macmini_cabled_to_macstudio_m4max__exo-issue-1390.txt"
NS_M3 = "networksetup_listallhardwareports_macstudio_m3ultra__knurlogic_trimmed.txt"
NS_M4 = "networksetup_listallhardwareports_macbookpro_m4max__knurlogic_trimmed.txt"
NS_MAC_A = "networksetup_listallhardwareports_macstudio_6tb__d-inference_macA.txt"
NS_MAC_B = "networksetup_listallhardwareports_macbookpro_3tb_with_bridge0__d-inference_macB.txt"
NS_NONOCAST = "networksetup_listallhardwareports_PARTIAL_mac_2tb_with_bridge0__nonocast.txt"
NS_SERVICES = "networksetup_listallnetworkservices_macmini_m1_thunderbolt_peer__chrisbergeron.txt"
BRIDGE_MLX = "ifconfig_bridge0_macmini_3tb_members_mtu9000__mlx-issue-1903.txt"
BRIDGE_CB = "ifconfig_bridge0_macmini_m1_2tb_members_peer_linux_in_address_cache__chrisbergeron.txt"

G = 1_000_000_000  # 1 GB/s in bytes/s; 80 Gb/s = 10 GB/s, 40 Gb/s = 5 GB/s, 120 Gb/s = 15 GB/s


def fx(name: str) -> str:
    return (FIX / name).read_text(encoding="utf-8")


def uuid(prefix: str, tail: str) -> str:
    return f"{prefix}-0000-4000-8000-{tail}"


# --------------------------------------------------------------------------- SP JSON, Studio side


def test_studio_json_all_six_buses_in_output_order():
    ports = parse_spthunderbolt_json(fx(STUDIO_JSON)).ports
    # bus_5 ... bus_0 = receptacle 6 ... 1 (the JSON lists buses in reverse)
    assert [p.port_id for p in ports] == ["6", "5", "4", "3", "2", "1"]
    assert [p.bus_name for p in ports] == [f"thunderboltusb4_bus_{i}" for i in (5, 4, 3, 2, 1, 0)]
    assert [p.own_domain_uuid for p in ports] == [uuid("55555555", f"00000000500{i}") for i in (5, 4, 3, 2, 1, 0)]
    assert all(p.interface is None for p in ports)  # not joined yet
    assert all(p.source == "spthunderbolt_json" for p in ports)


def test_studio_json_cabled_port_is_receptacle_2_with_rdma_peer():
    by_id = {p.port_id: p for p in parse_spthunderbolt_json(fx(STUDIO_JSON)).ports}
    p = by_id["2"]  # bus_1: "80 Gb/s", _items[0] = "MacBook Pro" Mac17,7, domain A000
    assert p.own_domain_uuid == "55555555-0000-4000-8000-000000005001"
    assert p.peer_domain_uuid == "AAAAAAAA-0000-4000-8000-00000000A000"
    assert p.peer_name == "MacBook Pro" and p.peer_model == "Mac17,7"
    assert p.speed_text == "80 Gb/s"
    assert p.link_speed_bytes_per_s == 10 * G and p.max_speed_bytes_per_s is None
    assert p.peer_rdma is True  # services_title has unknown_xd_service, protocol_id_key 64087
    assert p.via == () and p.devices == ("MacBook Pro",)
    assert p.connected


def test_studio_json_ssd_port_has_no_peer_and_idle_ports_have_capability_only():
    by_id = {p.port_id: p for p in parse_spthunderbolt_json(fx(STUDIO_JSON)).ports}
    ssd = by_id["4"]  # bus_3: OWC Envoy Ultra, live 80 Gb/s, no domain_uuid_key
    assert ssd.devices == ("Envoy Ultra",)
    assert ssd.peer_domain_uuid is None and ssd.peer_name is None and ssd.peer_rdma is False
    assert ssd.link_speed_bytes_per_s == 10 * G
    for rid in ("1", "3", "5", "6"):  # "Up to 120 Gb/s", link_status_key 0x100
        idle = by_id[rid]
        assert idle.speed_text == "Up to 120 Gb/s"
        assert idle.link_speed_bytes_per_s is None and idle.max_speed_bytes_per_s == 15 * G
        assert idle.peer_domain_uuid is None and idle.devices == () and not idle.connected


# --------------------------------------------------------------------------- SP JSON, MBP side


def test_mbp_json_cabled_port_is_receptacle_1_peer_without_rdma():
    ports = parse_spthunderbolt_json(fx(MBP_JSON)).ports
    assert [p.port_id for p in ports] == ["3", "2", "1"]
    assert [p.own_domain_uuid for p in ports] == [uuid("AAAAAAAA", f"00000000A00{i}") for i in (2, 1, 0)]
    p = ports[2]  # bus_0, receptacle 1
    assert p.peer_domain_uuid == "55555555-0000-4000-8000-000000005001"
    assert p.peer_name == "Mac Studio" and p.peer_model == "Mac15,14"
    assert p.link_speed_bytes_per_s == 10 * G
    assert p.peer_rdma is False  # the Studio only advertises service_ip (protocol_id_key 1)
    assert [q.link_speed_bytes_per_s for q in ports[:2]] == [None, None]


# --------------------------------------------------------------------------- SP JSON, Knurlogic (trimmed)


def test_knurlogic_studio_nesting_dock_and_no_uuids():
    ports = parse_spthunderbolt_json(fx(KNURL_STUDIO_JSON)).ports
    assert [p.port_id for p in ports] == ["6", "5", "4", "3", "2", "1"]
    assert all(p.own_domain_uuid is None and p.peer_domain_uuid is None for p in ports)  # trimmed
    by_id = {p.port_id: p for p in ports}
    direct = by_id["6"]  # TB5 80 Gb/s straight to the MBP (Mac16,5)
    assert (direct.peer_name, direct.peer_model, direct.via) == ("MacBook Pro", "Mac16,5", ())
    assert direct.link_speed_bytes_per_s == 10 * G
    docked = by_id["3"]  # TB4 40 Gb/s through the ThunderBay Flex 8; peer at _items[0]._items[0]
    assert (docked.peer_name, docked.peer_model) == ("MacBook Pro", "Mac16,5")
    assert docked.via == ("ThunderBay Flex 8",)
    assert docked.devices == ("ThunderBay Flex 8", "MacBook Pro")
    assert docked.link_speed_bytes_per_s == 5 * G
    helios = by_id["2"]  # a Mercury Helios 3S enclosure: a device, not a host
    assert helios.devices == ("Mercury Helios 3S",) and helios.peer_name is None
    assert helios.link_speed_bytes_per_s == 5 * G
    # unknown_xd_service is listed but its protocol_id_key was trimmed: RDMA is not claimed
    assert not any(p.peer_rdma for p in ports)


def test_knurlogic_mbp_side_joined_by_name():
    sp = parse_spthunderbolt_json(fx(KNURL_MBP_JSON))
    ports = {p.port_id: p for p in join_interfaces(sp, parse_hardware_ports(fx(NS_M4)))}
    # SOURCES.md: MBP receptacle 2 / en2 at 80 Gb/s, receptacle 3 / en3 at 40 Gb/s, both to the Studio
    assert (ports["2"].interface, ports["2"].link_speed_bytes_per_s, ports["2"].peer_model) == (
        "en2",
        10 * G,
        "Mac15,14",
    )
    assert (ports["3"].interface, ports["3"].link_speed_bytes_per_s, ports["3"].peer_model) == (
        "en3",
        5 * G,
        "Mac15,14",
    )
    assert ports["1"].interface == "en1" and not ports["1"].connected


def test_knurlogic_studio_side_joined_by_name():
    sp = parse_spthunderbolt_json(fx(KNURL_STUDIO_JSON))
    ports = {p.port_id: p for p in join_interfaces(sp, parse_hardware_ports(fx(NS_M3)))}
    # SOURCES.md: Studio receptacle 6 / en7 (80 Gb/s) and receptacle 3 / en4 (40 Gb/s, dock)
    assert ports["6"].interface == "en7" and ports["3"].interface == "en4"


def test_json_edge_shapes():
    assert parse_spthunderbolt_json('{"SPThunderboltDataType": []}').ports == ()
    # non-dict buses are skipped, a bus without receptacle still parses
    ports = parse_spthunderbolt_json('{"SPThunderboltDataType": [1, "x", {"_name": "b"}]}').ports
    assert len(ports) == 1 and ports[0].port_id is None and ports[0].bus_name == "b"
    # an invalid UUID string is not a UUID
    ports = parse_spthunderbolt_json('{"SPThunderboltDataType": [{"domain_uuid_key": "nope"}]}').ports
    assert ports[0].own_domain_uuid is None
    for bad in ("", "   ", "[]", '{"other": []}', '{"SPThunderboltDataType": {}}', fx(STUDIO_JSON)[:700], "\x00\xff"):
        with pytest.raises(ProbeParseError):
            parse_spthunderbolt_json(bad)


# --------------------------------------------------------------------------- SP plain text (PARTIAL)


def test_text_partial_exo_1390():
    ports = parse_spthunderbolt_text(fx(SP_TEXT)).ports
    assert len(ports) == 2
    bus2, bus1 = ports
    assert bus2.bus_name == "Thunderbolt/USB4 Bus 2"
    assert bus2.port_id == "3"  # "Receptacle: 3"
    assert bus2.own_domain_uuid == "CCCCCCCC-0000-4000-8000-00000000C002"
    assert bus2.peer_domain_uuid == "99999999-0000-4000-8000-000000009000"
    assert (bus2.peer_name, bus2.peer_model) == ("Mac Studio", "Mac16,9")
    assert bus2.link_speed_bytes_per_s == 10 * G  # "Speed: 80 Gb/s"
    assert bus2.peer_rdma is True  # "Protocol ID: 64087" / "Service Key: rdma"
    # Bus 1 is cut off right after "Port:": own UUID known, nothing else
    assert bus1.own_domain_uuid == "CCCCCCCC-0000-4000-8000-00000000C001"
    assert bus1.port_id is None and bus1.link_speed_bytes_per_s is None and bus1.peer_domain_uuid is None


def test_text_rejects_non_thunderbolt():
    for bad in ("", "hello: world", "Wi-Fi:\n  Status: on\n", "\x00\x01"):
        with pytest.raises(ProbeParseError):
            parse_spthunderbolt_text(bad)
    assert parse_spthunderbolt_text("Thunderbolt/USB4:\n").ports == ()


# --------------------------------------------------------------------------- networksetup


@pytest.mark.parametrize(
    ("name", "count", "tb", "bridge"),
    [
        (NS_M3, 14, {str(i): f"en{i + 1}" for i in range(1, 7)}, None),
        (NS_MAC_A, 9, {str(i): f"en{i + 1}" for i in range(1, 7)}, None),
        (NS_M4, 8, {"1": "en1", "2": "en2", "3": "en3"}, None),
        (NS_MAC_B, 7, {"1": "en1", "2": "en6", "3": "en2"}, "bridge0"),  # not in order!
        (NS_NONOCAST, 6, {"1": "en1", "2": "en2"}, "bridge0"),
    ],
)
def test_hardware_ports(name, count, tb, bridge):
    hw = parse_hardware_ports(fx(name))
    assert len(hw.ports) == count
    assert hw.thunderbolt_interfaces() == tb  # "Thunderbolt Bridge" never counts as a port
    assert hw.device_of("Thunderbolt Bridge") == bridge


def test_hardware_ports_macs_and_trimmed_lines():
    hw = parse_hardware_ports(fx(NS_NONOCAST))
    assert [p.name for p in hw.ports] == [
        "Wi-Fi",
        "iPhone USB",
        "Bluetooth PAN",
        "Thunderbolt 1",
        "Thunderbolt 2",
        "Thunderbolt Bridge",
    ]
    by = {p.name: p for p in hw.ports}
    assert by["Thunderbolt Bridge"].mac == by["Thunderbolt 1"].mac == "02:00:00:00:10:01"
    assert all(p.mac is None for p in parse_hardware_ports(fx(NS_M3)).ports)  # Knurlogic trimmed them
    assert parse_hardware_ports(fx(NS_MAC_B)).ports[0].name == "Ethernet Adapter (en3)"  # leading blank line


def test_hardware_ports_garbage():
    for bad in ("", "VLAN Configurations\n===\n", "Device: en0\n", "random words"):
        with pytest.raises(ProbeParseError):
            parse_hardware_ports(bad)


def test_network_services():
    services = parse_network_services(fx(NS_SERVICES))
    assert services.names() == (
        "Ethernet",
        "Ethernet Adaptor (en4)",
        "Ethernet Adaptor (en5)",
        "USB 10/100/1000 LAN",
        "Wi-Fi",
        "Bluetooth PAN",
        "Thunderbolt Ethernet Slot 1",
        "iPhone USB",
        "Thunderbolt Bridge",
    )
    assert all(s.enabled for s in services.services)
    disabled = parse_network_services("An asterisk (*) denotes that a network service is disabled.\n*Wi-Fi\nEthernet\n")
    assert [(s.name, s.enabled) for s in disabled.services] == [("Wi-Fi", False), ("Ethernet", True)]
    with pytest.raises(ProbeParseError):
        parse_network_services("Ethernet\nWi-Fi\n")


# --------------------------------------------------------------------------- ifconfig bridge0


def test_ifconfig_bridge0_mlx_1903():
    b = parse_ifconfig_macos(fx(BRIDGE_MLX))
    assert b.name == "bridge0" and b.mtu == 9000 and b.up
    assert b.flags == ("UP", "BROADCAST", "SMART", "RUNNING", "SIMPLEX", "MULTICAST")
    assert b.mac == "36:00:00:00:b0:80"
    assert b.ipv4 == (IPv4Address("10.25.0.1", "255.255.255.0", "10.25.0.255"),)  # netmask 0xffffff00
    assert b.ipv6 == ("fe80::1111:2222:3333:4444%bridge0",)
    assert b.members == ("en2", "en3", "en4")
    assert b.status == "active" and b.address_cache == ()


def test_ifconfig_bridge0_chrisbergeron_address_cache():
    b = parse_ifconfig_macos(fx(BRIDGE_CB))
    assert b.mtu == 1500 and b.mac == "36:00:00:00:0c:40"
    assert b.ipv4 == (IPv4Address("10.10.10.2", "255.255.255.0", "10.10.10.255"),)
    assert b.members == ("en2", "en3")
    assert b.address_cache == (
        BridgeCacheEntry("12:00:00:00:0a:01", "Vlan1", "en3"),  # the Linux peer's thunderbolt0 MAC
        BridgeCacheEntry("36:00:00:00:0b:0", "Vlan1", "en2"),
        BridgeCacheEntry("2:00:00:00:0a:01", "Vlan1", "en2"),
    )
    linux = (FIX.parent / "linux" / "linux_ifconfig_thunderbolt0_to_macmini_m1__chrisbergeron.txt").read_text()
    assert "ether 12:00:00:00:0a:01" in linux  # the same peer, seen from the Linux side


def test_ifconfig_garbage():
    for bad in ("", "bridge0 does not exist", "ifconfig: interface bridge0 does not exist\n", "x: flags=zz<> mtu 1"):
        with pytest.raises(ProbeParseError):
            parse_ifconfig_macos(bad)


# --------------------------------------------------------------------------- Thunderbolt Bridge loop warning


def _port(iface: str, live: bool) -> ThunderboltPort:
    return ThunderboltPort(
        port_id=iface, interface=iface, own_domain_uuid=None, peer_domain_uuid=None,
        link_speed_bytes_per_s=10 * G if live else None,
    )  # fmt: skip


def test_bridge_loop_warning_rules():
    bridge = parse_ifconfig_macos(fx(BRIDGE_MLX))  # up, members en2, en3, en4
    two_live = [_port("en2", True), _port("en3", True), _port("en4", False)]
    msg = bridge_loop_warning(bridge, two_live, machines_cabled=3)
    assert msg is not None and "en2, en3" in msg and "bridge0" in msg
    assert bridge_loop_warning(bridge, two_live, machines_cabled=2) is None  # 2 machines: no ring
    one_live = [_port("en2", True), _port("en3", False), _port("en4", False)]
    assert bridge_loop_warning(bridge, one_live, machines_cabled=4) is None
    assert bridge_loop_warning(None, two_live, machines_cabled=3) is None
    down = parse_ifconfig_macos(fx(BRIDGE_MLX).replace("<UP,", "<", 1))
    assert bridge_loop_warning(down, two_live, machines_cabled=3) is None


def test_bridge_loop_warning_with_fixture_ports():
    # Synthetic combination of two real captures (different Macs!): the Knurlogic Studio's
    # ports joined with its networksetup have live links on receptacles 6/en7 (Mac), 3/en4 (dock
    # to Mac) and 2/en3 (Helios enclosure); the mlx-1903 bridge0 bridges en2, en3, en4.
    ports = join_interfaces(parse_spthunderbolt_json(fx(KNURL_STUDIO_JSON)), parse_hardware_ports(fx(NS_M3)))
    assert active_thunderbolt_interfaces(ports) == {"en7", "en4", "en3"}
    msg = bridge_loop_warning(parse_ifconfig_macos(fx(BRIDGE_MLX)), ports, machines_cabled=3)
    assert msg is not None and "2 active Thunderbolt ports (en3, en4)" in msg
