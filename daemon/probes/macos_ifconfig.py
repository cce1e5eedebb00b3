"""macOS (BSD) ``ifconfig <if>`` parser, used for the Thunderbolt Bridge (``bridge0``): flags, addresses, members.

Format facts (all from /work/shared/fixtures/SOURCES.md, which documents the
captures and how ml-explore/mlx ``_distributed_utils/config.py`` and exo
``info_gatherer`` parse them):

``ifconfig bridge0`` (:func:`parse_ifconfig_macos`)
  - BSD ifconfig: "name: flags=<hex><NAMES> mtu N", tab-indented
    "ether", "inet A netmask 0xffffff00 broadcast B", "member: enN flags=3<...>",
    "Address cache:" entries "MAC VlanN enN ...", "status: active".
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from .common import ProbeParseError, excerpt, parse_int, require_text

__all__ = ["BridgeCacheEntry", "IPv4Address", "MacIfconfig", "parse_ifconfig_macos"]


@dataclass(frozen=True)
class IPv4Address:
    address: str
    netmask: str  # dotted quad ("255.255.255.0"); BSD prints it in hex
    broadcast: str | None = None


@dataclass(frozen=True)
class BridgeCacheEntry:
    """A bridge "Address cache:" entry: a MAC learnt on member ``interface``."""

    mac: str
    vlan: str
    interface: str


@dataclass(frozen=True)
class MacIfconfig:
    """``ifconfig <name>`` on macOS (first interface in the output)."""

    name: str
    flags: tuple[str, ...]
    mtu: int
    mac: str | None = None
    ipv4: tuple[IPv4Address, ...] = ()
    ipv6: tuple[str, ...] = ()
    members: tuple[str, ...] = ()  # bridge members, "member: en2 flags=3<LEARNING,DISCOVER>"
    status: str | None = None  # "active" / "inactive"
    address_cache: tuple[BridgeCacheEntry, ...] = ()

    @property
    def up(self) -> bool:
        return "UP" in self.flags


_IF_HEAD_RE = re.compile(r"^(\S+): flags=([0-9a-fA-F]{1,8})<([^>]*)> mtu (\d{1,7})")
_CACHE_RE = re.compile(r"^([0-9a-fA-F]{1,2}(?::[0-9a-fA-F]{1,2}){5}) (\S+) (\S+)")


def _hex_netmask(s: str) -> str:
    if s.lower().startswith("0x"):
        v = parse_int(s[2:], "netmask", 16)
        if v >= 1 << 32:
            raise ProbeParseError(f"netmask out of range: {excerpt(s)}")
        return str(ipaddress.IPv4Address(v))
    try:
        return str(ipaddress.IPv4Address(s))
    except ValueError:
        raise ProbeParseError(f"bad netmask {excerpt(s)}") from None


def parse_ifconfig_macos(text: str) -> MacIfconfig:
    """``ifconfig bridge0`` (or any BSD ``ifconfig <if>``) -> :class:`MacIfconfig`."""
    text = require_text(text, "ifconfig")
    lines = text.splitlines()
    m = _IF_HEAD_RE.match(lines[0].strip()) if lines else None
    if not m:
        raise ProbeParseError(f"ifconfig: no 'name: flags=...<...> mtu N' header in {excerpt(text)}")
    name, flags, mtu = m.group(1), tuple(f for f in m.group(3).split(",") if f), int(m.group(4))
    mac = status = None
    ipv4: list[IPv4Address] = []
    ipv6: list[str] = []
    members: list[str] = []
    cache: list[BridgeCacheEntry] = []
    in_cache = False
    for raw in lines[1:]:
        if raw and not raw[0].isspace():  # the next interface's header
            break
        parts = raw.split()
        if not parts:
            continue
        head = parts[0]
        if in_cache:
            cm = _CACHE_RE.match(raw.strip())
            if cm:
                cache.append(BridgeCacheEntry(mac=cm.group(1).lower(), vlan=cm.group(2), interface=cm.group(3)))
                continue
            in_cache = False
        if head == "ether" and len(parts) >= 2:
            mac = parts[1].lower()
        elif head == "inet" and len(parts) >= 2:
            try:
                addr = str(ipaddress.IPv4Address(parts[1]))
            except ValueError:
                raise ProbeParseError(f"ifconfig: bad inet address {excerpt(parts[1])}") from None
            netmask = _hex_netmask(parts[parts.index("netmask") + 1]) if "netmask" in parts[:-1] else "255.255.255.255"
            bcast = parts[parts.index("broadcast") + 1] if "broadcast" in parts[:-1] else None
            ipv4.append(IPv4Address(address=addr, netmask=netmask, broadcast=bcast))
        elif head == "inet6" and len(parts) >= 2:
            ipv6.append(parts[1])
        elif head == "member:" and len(parts) >= 2:
            members.append(parts[1])
        elif head == "status:" and len(parts) >= 2:
            status = parts[1]
        elif raw.strip() == "Address cache:":
            in_cache = True
    return MacIfconfig(
        name=name,
        flags=flags,
        mtu=mtu,
        mac=mac,
        ipv4=tuple(ipv4),
        ipv6=tuple(ipv6),
        members=tuple(members),
        status=status,
        address_cache=tuple(cache),
    )
