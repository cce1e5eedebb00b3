"""One rule for a link's kind, the same on both ends and on every member (issue 21)."""

from __future__ import annotations

from pathlib import Path

from ringlet.daemon.cluster.linkprobe import combine_kinds, link_kind
from ringlet.daemon.cluster.topology import build_graph
from ringlet.daemon.probes.interfaces import interface_for_peer, list_interfaces, local_addresses, wireless_interfaces
from ringlet.daemon.probes.macos_networksetup import parse_hardware_ports

FIXTURES = Path(__file__).parent.parent / "fixtures" / "macos"


def test_a_peer_at_one_of_this_machines_own_addresses_is_loopback():
    """psutil's real addresses of this machine: every one of them (not only 127.x) is on
    this machine, so a peer advertised there is reached over loopback."""
    own = local_addresses()
    assert "127.0.0.1" in own
    for iface in list_interfaces():
        for a in iface.addresses:
            assert link_kind(a.address, set(), interface_for_peer, own) == "loopback", (iface.name, a.address)
    assert link_kind("127.0.0.1", set()) == "loopback"


def test_thunderbolt_wifi_and_ethernet_follow_the_interface_that_reaches_the_peer():
    reach = {"169.254.7.2": "bridge0", "192.168.1.9": "en0", "10.0.0.5": "eth0"}.get
    assert link_kind("169.254.7.2", {"bridge0"}, reach, frozenset(), frozenset({"en0"})) == "thunderbolt"
    assert link_kind("192.168.1.9", {"bridge0"}, reach, frozenset(), frozenset({"en0"})) == "wifi"
    assert link_kind("10.0.0.5", {"bridge0"}, reach, frozenset(), frozenset({"en0"})) == "ethernet"
    assert link_kind("10.9.9.9", {"bridge0"}, reach) == "ethernet"  # behind a router: no direct interface


def test_macos_wifi_device_comes_from_the_hardware_ports():
    """The captured ``networksetup -listallhardwareports`` of a Mac Studio: its Wi-Fi port
    is device en1 (read from the capture by hand)."""
    text = (FIXTURES / "networksetup_listallhardwareports_macstudio_6tb__d-inference_macA.txt").read_text()
    assert wireless_interfaces(hardware_ports=parse_hardware_ports(text)) == frozenset({"en1"})


def test_linux_wifi_interfaces_are_those_with_a_wireless_entry(tmp_path):
    for name, wireless in (("eth0", False), ("wlan0", True), ("wlp2s0", True), ("lo", False)):
        (tmp_path / name).mkdir()
        if wireless:
            (tmp_path / name / "wireless").mkdir()
    assert wireless_interfaces(tmp_path) == frozenset({"wlan0", "wlp2s0"})
    assert wireless_interfaces(tmp_path / "missing") == frozenset()


def test_ends_that_disagree_get_the_slower_kind_whoever_builds_the_graph():
    assert combine_kinds("thunderbolt", "ethernet") == combine_kinds("ethernet", "thunderbolt") == "ethernet"
    assert combine_kinds("loopback", "wifi") == "wifi"
    link = {"bandwidth_bytes_per_s": 1e9, "rtt_s": 1e-4}
    records = {"a": {"links": {"b": {**link, "kind": "thunderbolt"}}},
               "b": {"links": {"a": {**link, "kind": "ethernet"}}}}
    for order in (records, dict(reversed(records.items()))):
        assert build_graph(order).edges["a", "b"]["kind"] == "ethernet"
