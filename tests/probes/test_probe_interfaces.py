"""Interfaces and which one reaches a peer (longest-prefix match)."""

from __future__ import annotations

import ipaddress
from collections import namedtuple

from ringlet.daemon.probes import interfaces as ifmod
from ringlet.daemon.probes.interfaces import (
    IfAddress,
    NetInterface,
    candidate_interfaces_for_peer,
    interface_for_peer,
    list_interfaces,
)


def iface(name: str, *addrs: str, up: bool = True) -> NetInterface:
    out = []
    for a in addrs:
        ipi = ipaddress.ip_interface(a)
        out.append(IfAddress("ipv4" if ipi.version == 4 else "ipv6", str(ipi.ip), ipi.network.prefixlen))
    return NetInterface(name=name, is_up=up, speed_bytes_per_s=None, addresses=tuple(out))


IFACES = [
    iface("lo", "127.0.0.1/8", "::1/128"),
    iface("eth0", "192.168.1.10/24", "10.0.0.5/8", "fd00::2/64", "fe80::1/64"),
    iface("en3", "10.25.0.1/16"),  # more specific than eth0's 10/8
    iface("en5", "169.254.7.1/16"),
    iface("en6", "169.254.9.1/16"),  # two Thunderbolt ports, both link-local /16
    iface("en9", "172.16.0.1/12", up=False),
]


def test_longest_prefix_wins():
    assert interface_for_peer("10.25.3.4", IFACES) == "en3"
    assert interface_for_peer("10.3.3.3", IFACES) == "eth0"
    assert interface_for_peer("192.168.1.77", IFACES) == "eth0"
    assert interface_for_peer("127.0.0.1", IFACES) == "lo"
    assert interface_for_peer("fd00::99", IFACES) == "eth0"


def test_unreachable_down_and_garbage():
    assert interface_for_peer("8.8.8.8", IFACES) is None  # behind a router
    assert interface_for_peer("172.16.0.9", IFACES) is None  # en9 is down
    assert interface_for_peer("not an ip", IFACES) is None
    assert interface_for_peer("", IFACES) is None


def test_ambiguous_link_local_and_scope():
    assert candidate_interfaces_for_peer("169.254.200.2", IFACES) == ("en5", "en6")
    assert interface_for_peer("169.254.200.2", IFACES) == "en5"  # first by name; the caller must disambiguate
    assert interface_for_peer("fe80::abcd%eth0", IFACES) == "eth0"  # scope names the interface
    assert interface_for_peer("fe80::abcd", IFACES) == "eth0"


def test_real_interfaces_on_this_machine():
    ifs = list_interfaces()
    lo = next(i for i in ifs if i.is_loopback)
    assert any(a.address == "127.0.0.1" and a.prefixlen == 8 for a in lo.addresses)
    assert interface_for_peer("127.0.0.1") == lo.name
    for i in ifs:  # every up interface reaches another host of its own IPv4 subnets
        for a in i.addresses:
            if not i.is_up or a.family != "ipv4" or a.prefixlen >= 31:
                continue
            net = ipaddress.ip_interface(f"{a.address}/{a.prefixlen}").network
            neighbour = next(h for h in net.hosts() if str(h) != a.address)
            assert i.name in candidate_interfaces_for_peer(str(neighbour), ifs)


def test_speed_conversion_from_psutil(monkeypatch):
    stats = namedtuple("snicstats", "isup duplex speed mtu flags")
    addr = namedtuple("snicaddr", "family address netmask broadcast ptp")
    monkeypatch.setattr(
        ifmod.psutil,
        "net_if_stats",
        lambda: {
            "en2": stats(True, 2, 10000, 9000, "up,broadcast,running"),
            "lo0": stats(True, 0, 0, 16384, "up,loopback"),
        },
    )
    monkeypatch.setattr(
        ifmod.psutil,
        "net_if_addrs",
        lambda: {
            "en2": [
                addr(ifmod.socket.AF_INET, "169.254.3.4", "255.255.0.0", None, None),
                addr(ifmod.socket.AF_INET6, "fe80::1%en2", "ffff:ffff:ffff:ffff::", None, None),
            ]
        },
    )
    en2, lo0 = list_interfaces()
    assert en2.speed_bytes_per_s == 1_250_000_000  # 10000 Mb/s * 125_000
    assert en2.mtu == 9000 and en2.addresses == (IfAddress("ipv4", "169.254.3.4", 16), IfAddress("ipv6", "fe80::1", 64))
    assert lo0.speed_bytes_per_s is None and lo0.is_loopback


def test_psutil_failure_is_logged_once(monkeypatch, caplog):
    def boom():
        raise OSError("no netlink")

    monkeypatch.setattr(ifmod.psutil, "net_if_stats", boom)
    assert list_interfaces() == ()
    assert len([r for r in caplog.records if r.name == "ringlet.daemon.probes"]) == 1
