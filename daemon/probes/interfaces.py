"""Network interfaces, their link speed, and which one reaches a given peer.

Sources: ``psutil.net_if_stats()`` (``speed`` in megabits per second, decimal:
1 Mb/s = 125_000 bytes/s; 0 when unknown, e.g. loopback, veth, most VMs) and
``psutil.net_if_addrs()`` (IPv6 addresses may carry a ``%scope`` suffix;
IPv6 netmasks are printed as masks, e.g. ``ffff:ffff:ffff:ffff::``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger("ringlet.daemon.probes")

BYTES_PER_S_PER_MBIT = 125_000


@dataclass(frozen=True)
class IfAddress:
    family: str  # "ipv4" | "ipv6"
    address: str  # without "%scope"
    prefixlen: int


@dataclass(frozen=True)
class NetInterface:
    """One local interface. ``speed_bytes_per_s`` = psutil Mb/s * 125_000; ``None`` if unknown (0)."""

    name: str
    is_up: bool
    speed_bytes_per_s: int | None
    mtu: int | None = None
    mac: str | None = None
    addresses: tuple[IfAddress, ...] = ()
    is_loopback: bool = False


def _prefixlen(family: str, netmask: str | None) -> int | None:
    if not netmask:
        return None
    try:
        if family == "ipv4":
            return ipaddress.IPv4Network(f"0.0.0.0/{netmask}").prefixlen
        mask = int(ipaddress.IPv6Address(netmask.split("/")[0]))
    except ValueError:
        return None
    n = bin(mask).count("1")
    # a valid mask is contiguous ones
    return n if mask == ((1 << 128) - 1) ^ ((1 << (128 - n)) - 1) else None


def list_interfaces() -> tuple[NetInterface, ...]:
    """All interfaces psutil sees, sorted by name. Never raises (returns ``()`` + one log line)."""
    try:
        stats = psutil.net_if_stats()
        addrs = psutil.net_if_addrs()
    except Exception as e:
        log.warning("probe interfaces: psutil failed (%s): %s", type(e).__name__, e)
        return ()
    out = []
    for name in sorted(set(stats) | set(addrs)):
        st = stats.get(name)
        mac = None
        addresses = []
        for a in addrs.get(name, ()):
            if a.family == socket.AF_INET:
                fam = "ipv4"
            elif a.family == socket.AF_INET6:
                fam = "ipv6"
            elif getattr(psutil, "AF_LINK", None) is not None and a.family == psutil.AF_LINK:
                mac = a.address.lower() if a.address else None
                continue
            else:
                continue
            address = a.address.split("%", 1)[0]
            plen = _prefixlen(fam, a.netmask)
            if plen is None:
                plen = 32 if fam == "ipv4" else 128
            addresses.append(IfAddress(family=fam, address=address, prefixlen=plen))
        flags = getattr(st, "flags", "") if st else ""
        out.append(
            NetInterface(
                name=name,
                is_up=bool(st.isup) if st else False,
                speed_bytes_per_s=st.speed * BYTES_PER_S_PER_MBIT if st and st.speed > 0 else None,
                mtu=st.mtu if st and st.mtu > 0 else None,
                mac=mac,
                addresses=tuple(addresses),
                is_loopback="loopback" in flags.split(",") or name.startswith("lo"),
            )
        )
    return tuple(out)


def candidate_interfaces_for_peer(peer_ip: str, interfaces: Sequence[NetInterface] | None = None) -> tuple[str, ...]:
    """All up interfaces whose subnet holds ``peer_ip`` with the longest prefix, sorted by name.

    More than one name means the routing is ambiguous, typically several
    Thunderbolt ports each with a 169.254.0.0/16 link-local address; the
    daemon then needs another clue (the Thunderbolt link graph).
    A ``%scope`` suffix on an IPv6 peer names the interface directly.
    Unparsable ``peer_ip`` -> ``()``.
    """
    if interfaces is None:
        interfaces = list_interfaces()
    addr_text, _, scope = peer_ip.strip().partition("%")
    try:
        peer = ipaddress.ip_address(addr_text)
    except ValueError:
        log.debug("interface_for_peer: not an IP address: %r", peer_ip[:80])
        return ()
    if scope and any(i.name == scope for i in interfaces):
        return (scope,)
    family = "ipv4" if peer.version == 4 else "ipv6"
    best, names = -1, set()
    for iface in interfaces:
        if not iface.is_up:
            continue
        for a in iface.addresses:
            if a.family != family:
                continue
            try:
                net = ipaddress.ip_interface(f"{a.address}/{a.prefixlen}").network
            except ValueError:
                continue
            if peer in net:
                if net.prefixlen > best:
                    best, names = net.prefixlen, {iface.name}
                elif net.prefixlen == best:
                    names.add(iface.name)
    return tuple(sorted(names))


def interface_for_peer(peer_ip: str, interfaces: Sequence[NetInterface] | None = None) -> str | None:
    """The local interface that reaches ``peer_ip`` directly (longest-prefix match over the
    local addresses/netmasks), or ``None`` when none does (the peer is behind a
    router, or ``peer_ip`` is not an address). With several equally long
    matches the first by name is returned; see :func:`candidate_interfaces_for_peer`.
    """
    names = candidate_interfaces_for_peer(peer_ip, interfaces)
    return names[0] if names else None


def wireless_interfaces(sys_class_net: Path = Path("/sys/class/net"), hardware_ports=None) -> frozenset[str]:
    """Names of this machine's Wi-Fi interfaces: on Linux those with a ``wireless`` (or
    ``phy80211``) entry under ``sys_class_net``; on macOS the devices of the Wi-Fi
    hardware ports (``hardware_ports``: a parsed ``networksetup -listallhardwareports``,
    run here when not given). Never raises (``frozenset()`` when unknown)."""
    if sys.platform == "darwin" or hardware_ports is not None:
        if hardware_ports is None:
            from .common import run_probe
            from .macos_networksetup import parse_hardware_ports

            hardware_ports = run_probe(["networksetup", "-listallhardwareports"], parse_hardware_ports, timeout=5.0)
        return frozenset(hardware_ports.wifi_devices()) if hardware_ports is not None else frozenset()
    try:
        return frozenset(d.name for d in sys_class_net.iterdir()
                         if (d / "wireless").exists() or (d / "phy80211").exists())
    except OSError:
        return frozenset()


def local_addresses(interfaces: Sequence[NetInterface] | None = None) -> frozenset[str]:
    """Every address of this machine (of its network namespace), any interface: a peer
    at one of them is on this machine, and its traffic goes over loopback."""
    if interfaces is None:
        interfaces = list_interfaces()
    return frozenset(a.address for iface in interfaces for a in iface.addresses)
