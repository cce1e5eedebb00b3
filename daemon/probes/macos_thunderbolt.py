"""macOS Thunderbolt probe: which receptacle, which ``enN``, which peer, how fast.

Format facts (all from /work/shared/fixtures/SOURCES.md, which documents the
captures and how ml-explore/mlx ``_distributed_utils/config.py`` and exo
``info_gatherer`` parse them):

``system_profiler SPThunderboltDataType -json`` (:func:`parse_spthunderbolt_json`)
  - one element per bus, listed in reverse (bus_5 ... bus_0);
  - port id = ``receptacle_1_tag.receptacle_id_key`` ("1".."6"), not ``_name``;
  - own id = the bus's ``domain_uuid_key``;
  - peer = ``domain_uuid_key`` of the first item under ``_items``, searched
    depth first (a peer behind a dock sits at ``_items[0]._items[0]``,
    Knurlogic fixture; exo PR #2063). Docks, SSDs and hubs have no
    ``domain_uuid_key`` (OWC Envoy Ultra, ThunderBay Flex 8) and are skipped;
  - ``current_speed_key``: "80 Gb/s" live TB5, "40 Gb/s" TB4/dock, "Up to 120
    Gb/s" idle (``link_status_key`` 0x100);
  - the peer advertises RDMA when one of its ``services_title`` has
    ``protocol_id_key`` 64087 (``_name`` "unknown_xd_service").
``system_profiler SPThunderboltDataType`` plain text (:func:`parse_spthunderbolt_text`)
  - indentation tree; "Thunderbolt/USB4 Bus N:" sections with "Domain UUID:",
    a "Port:" section ("Receptacle:", "Speed:", "Link Status:", "Status:") and
    device sections; RDMA = "Protocol ID: 64087" / "Service Key: rdma"
    (exo issue #1390 fixture, truncated after Bus 1 "Port:").
``networksetup -listallhardwareports`` (:func:`parse_hardware_ports`)
  - blocks "Hardware Port: X" / "Device: enN" / "Ethernet Address: ..."
    (sometimes trimmed); the port of receptacle N is the one named exactly
    "Thunderbolt N" -- never "Thunderbolt Bridge", never by position
    (MBP M4/M5 Max: Thunderbolt 1/2/3 -> en1/en6/en2).
``networksetup -listallnetworkservices`` (:func:`parse_network_services`)
  - a header line "An asterisk (*) denotes that a network service is
    disabled." then one service name per line, "*" prefix = disabled.
``ifconfig bridge0`` (:func:`parse_ifconfig_macos`)
  - BSD ifconfig: "name: flags=<hex><NAMES> mtu N", tab-indented
    "ether", "inet A netmask 0xffffff00 broadcast B", "member: enN flags=3<...>",
    "Address cache:" entries "MAC VlanN enN ...", "status: active".
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .common import (
    ProbeParseError,
    ThunderboltPort,
    excerpt,
    normalize_uuid,
    parse_int,
    parse_tb_speed,
    require_text,
    run_probe,
)

#: XDomain protocol id of Apple's RDMA-over-Thunderbolt service (SOURCES.md §1, "How mlx and exo parse").
RDMA_PROTOCOL_ID = 64087
#: Service names macOS shows for host-to-host (XDomain) services; used only to
#: recognise a peer host that has no ``domain_uuid_key`` (trimmed captures).
_HOST_SERVICE_NAMES = frozenset({"service_ip", "unknown_xd_service"})
_TB_PORT_RE = re.compile(r"^Thunderbolt (\d{1,3})$")


@dataclass(frozen=True)
class SPThunderbolt:
    """``system_profiler SPThunderboltDataType`` parsed: one port per bus, in output order.

    ``interface`` is ``None`` until :func:`join_interfaces`.
    """

    ports: tuple[ThunderboltPort, ...]


# --------------------------------------------------------------------------- SP JSON


def _s(d: dict, key: str) -> str | None:
    v = d.get(key)
    return v if isinstance(v, str) else None


def _items(d: dict) -> list[dict]:
    v = d.get("_items")
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _receptacle(bus: dict) -> dict:
    """The bus's ``receptacle_1_tag`` (or the first ``receptacle_N_tag`` with an id)."""
    tag = bus.get("receptacle_1_tag")
    if isinstance(tag, dict):
        return tag
    for k, v in bus.items():
        if isinstance(k, str) and re.fullmatch(r"receptacle_\d+_tag", k) and isinstance(v, dict):
            if "receptacle_id_key" in v:
                return v
    return {}


def _services_rdma(services: Any) -> bool:
    if not isinstance(services, list):
        return False
    for s in services:
        if not isinstance(s, dict):
            continue
        pid = s.get("protocol_id_key")
        if pid == RDMA_PROTOCOL_ID and not isinstance(pid, bool):
            return True
        if isinstance(pid, str) and pid.strip() == str(RDMA_PROTOCOL_ID):
            return True
    return False


def _looks_like_host(item: dict) -> bool:
    services = item.get("services_title")
    if not isinstance(services, list):
        return False
    return any(isinstance(s, dict) and s.get("_name") in _HOST_SERVICE_NAMES for s in services)


def _walk(items: list[dict]) -> list[tuple[dict, tuple[str, ...]]]:
    """Depth-first, pre-order, iterative (no recursion limit): ``(item, names of its ancestors)``."""
    out: list[tuple[dict, tuple[str, ...]]] = []
    stack: list[tuple[dict, tuple[str, ...]]] = [(it, ()) for it in reversed(items)]
    while stack:
        item, path = stack.pop()
        out.append((item, path))
        name = _s(item, "_name") or "?"
        stack.extend((child, (*path, name)) for child in reversed(_items(item)))
    return out


def _port_from_bus(bus: dict) -> ThunderboltPort:
    rec = _receptacle(bus)
    speed_text = _s(rec, "current_speed_key")
    live, cap = parse_tb_speed(speed_text)
    walked = _walk(_items(bus))
    peer: dict | None = None
    via: tuple[str, ...] = ()
    # mlx/exo rule: first item with a domain_uuid_key, here searched depth first.
    for item, path in walked:
        if normalize_uuid(item.get("domain_uuid_key")):
            peer, via = item, path
            break
    if peer is None:  # trimmed captures: a host without UUID is still recognisable by its services
        for item, path in walked:
            if _looks_like_host(item):
                peer, via = item, path
                break
    rid = rec.get("receptacle_id_key")
    return ThunderboltPort(
        port_id=rid.strip() if isinstance(rid, str) and rid.strip() else None,
        interface=None,
        own_domain_uuid=normalize_uuid(bus.get("domain_uuid_key")),
        peer_domain_uuid=normalize_uuid(peer.get("domain_uuid_key")) if peer else None,
        link_speed_bytes_per_s=live,
        max_speed_bytes_per_s=cap,
        speed_text=speed_text,
        peer_rdma=_services_rdma(peer.get("services_title")) if peer else False,
        peer_name=_s(peer, "_name") if peer else None,
        peer_model=_s(peer, "device_name_key") if peer else None,
        via=via,
        devices=tuple(_s(it, "_name") or "?" for it, _ in walked),
        bus_name=_s(bus, "_name"),
        source="spthunderbolt_json",
    )


def parse_spthunderbolt_json(text: str) -> SPThunderbolt:
    """``system_profiler SPThunderboltDataType -json`` -> one :class:`ThunderboltPort` per bus.

    Buses without ``domain_uuid_key`` are kept (``own_domain_uuid=None``) so
    the port list is complete; :func:`links.match_links` ignores them, as
    mlx and exo do. ``{"SPThunderboltDataType": []}`` (no Thunderbolt) -> no
    ports. Not JSON / no such key -> :class:`ProbeParseError`.
    """
    text = require_text(text, "SPThunderboltDataType")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProbeParseError(f"SPThunderboltDataType: not JSON ({type(e).__name__})") from None
    buses = doc.get("SPThunderboltDataType") if isinstance(doc, dict) else None
    if not isinstance(buses, list):
        raise ProbeParseError("SPThunderboltDataType: missing bus list")
    return SPThunderbolt(ports=tuple(_port_from_bus(b) for b in buses if isinstance(b, dict)))


# --------------------------------------------------------------------------- SP plain text


@dataclass
class _Node:
    name: str
    indent: int
    value: str | None = None
    children: list[_Node] | None = None  # None for "key: value" lines
    child_indent: int | None = None  # indent of the first child

    def attr(self, key: str) -> str | None:
        for c in self.children or ():
            if c.value is not None and c.name == key:
                return c.value
        return None

    def sections(self) -> list[_Node]:
        return [c for c in self.children or () if c.children is not None]


def _indent_tree(text: str) -> _Node:
    """Indentation tree of "Section:" / "Key: Value" lines.

    A line belongs to the nearest open section that is less indented *and*
    whose children are not more indented than the line: in system_profiler
    output a device section ("Mac Studio:", indent 8) follows the "Port:"
    section's values (indent 10) and belongs to the bus (indent 4), not to "Port:"
    (indent 6).
    """
    root = _Node("", -1, children=[])
    stack = [root]
    for raw in text.splitlines():
        line = raw.expandtabs(8).rstrip()
        stripped = line.lstrip(" ")
        if not stripped:
            continue
        indent = len(line) - len(stripped)
        while len(stack) > 1 and (
            stack[-1].indent >= indent or (stack[-1].child_indent is not None and indent < stack[-1].child_indent)
        ):
            stack.pop()
        parent = stack[-1]
        if parent.child_indent is None:
            parent.child_indent = indent
        assert parent.children is not None  # noqa: S101 - parser invariant (every stacked node has children), not input checking
        if stripped.endswith(":"):
            node = _Node(stripped[:-1].strip(), indent, children=[])
            parent.children.append(node)
            stack.append(node)
        else:
            key, sep, value = stripped.partition(": ")
            if sep:
                parent.children.append(_Node(key.strip(), indent, value=value.strip()))

    return root


_BUS_RE = re.compile(r"^Thunderbolt(?:/USB4)? Bus \d{1,3}$")


def _text_rdma(device: _Node) -> bool:
    for sec in device.sections():
        if sec.name != "Services":
            continue
        for svc in sec.sections():
            if svc.attr("Protocol ID") == str(RDMA_PROTOCOL_ID) or (svc.attr("Service Key") or "") == "rdma":
                return True
    return False


def _text_port(bus: _Node) -> ThunderboltPort:
    port_sec = next((s for s in bus.sections() if s.name.startswith("Port")), None)
    speed_text = port_sec.attr("Speed") if port_sec else None
    live, cap = parse_tb_speed(speed_text)
    # device sections below the bus, depth first; "Port*" and "Services" are not devices
    walked: list[tuple[_Node, tuple[str, ...]]] = []
    stack: list[tuple[_Node, tuple[str, ...]]] = [
        (s, ()) for s in reversed(bus.sections()) if not s.name.startswith("Port")
    ]
    while stack:
        node, path = stack.pop()
        walked.append((node, path))
        kids = [s for s in node.sections() if s.name != "Services" and not s.name.startswith("Port")]
        stack.extend((k, (*path, node.name)) for k in reversed(kids))
    peer = next(((n, p) for n, p in walked if normalize_uuid(n.attr("Domain UUID"))), None)
    rid = port_sec.attr("Receptacle") if port_sec else None
    return ThunderboltPort(
        port_id=rid or None,
        interface=None,
        own_domain_uuid=normalize_uuid(bus.attr("Domain UUID")),
        peer_domain_uuid=normalize_uuid(peer[0].attr("Domain UUID")) if peer else None,
        link_speed_bytes_per_s=live,
        max_speed_bytes_per_s=cap,
        speed_text=speed_text,
        peer_rdma=_text_rdma(peer[0]) if peer else False,
        peer_name=peer[0].name if peer else None,
        peer_model=peer[0].attr("Device Name") if peer else None,
        via=peer[1] if peer else (),
        devices=tuple(n.name for n, _ in walked),
        bus_name=bus.name,
        source="spthunderbolt_text",
    )


def parse_spthunderbolt_text(text: str) -> SPThunderbolt:
    """Plain-text ``system_profiler SPThunderboltDataType``; tolerates truncation.

    A bus cut off before its "Receptacle:" line gives a port with
    ``port_id=None`` (it cannot be joined to an interface). Output with neither
    a "Thunderbolt..." header nor a bus section -> :class:`ProbeParseError`.
    """
    text = require_text(text, "SPThunderboltDataType text")
    root = _indent_tree(text)
    buses: list[_Node] = []
    header = False
    stack = list(reversed(root.sections()))
    while stack:
        node = stack.pop()
        if _BUS_RE.match(node.name):
            buses.append(node)
            continue
        if node.name.startswith("Thunderbolt"):
            header = True
        stack.extend(reversed(node.sections()))
    if not buses and not header:
        raise ProbeParseError(f"SPThunderboltDataType text: no Thunderbolt bus in {excerpt(text)}")
    return SPThunderbolt(ports=tuple(_text_port(b) for b in buses))


# --------------------------------------------------------------------------- networksetup


@dataclass(frozen=True)
class HardwarePort:
    """One ``networksetup -listallhardwareports`` block."""

    name: str  # "Thunderbolt 1", "Thunderbolt Bridge", "Wi-Fi"
    device: str | None  # "en2", "bridge0"
    mac: str | None = None  # "Ethernet Address" (absent in trimmed captures)


@dataclass(frozen=True)
class HardwarePorts:
    ports: tuple[HardwarePort, ...]

    def thunderbolt_interfaces(self) -> dict[str, str]:
        """``{"1": "en2", ...}``: receptacle id -> device of hardware port "Thunderbolt <id>" exactly."""
        out: dict[str, str] = {}
        for p in self.ports:
            m = _TB_PORT_RE.match(p.name)
            if m and p.device:
                out.setdefault(str(int(m.group(1))), p.device)
        return out

    def device_of(self, name: str) -> str | None:
        """Device of the hardware port called ``name`` ("Thunderbolt Bridge" -> "bridge0")."""
        return next((p.device for p in self.ports if p.name == name), None)


def parse_hardware_ports(text: str) -> HardwarePorts:
    """``networksetup -listallhardwareports`` -> :class:`HardwarePorts` (output order).

    Values are what follows the first ": " (mlx slices ``line[15:]`` / ``line[8:]``,
    exo splits on ": "; identical here). Stops at "VLAN Configurations".
    No "Hardware Port:" line at all -> :class:`ProbeParseError`.
    """
    text = require_text(text, "networksetup -listallhardwareports")
    ports: list[HardwarePort] = []
    cur: dict[str, str | None] | None = None

    def flush() -> None:
        if cur is not None and cur["name"]:
            ports.append(HardwarePort(name=cur["name"], device=cur["device"], mac=cur["mac"]))

    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("VLAN Configurations"):
            break
        key, sep, value = line.partition(":")
        if not sep:
            continue
        value = value.strip() or None
        if key == "Hardware Port":
            flush()
            cur = {"name": value, "device": None, "mac": None}
        elif cur is not None and key == "Device":
            cur["device"] = value
        elif cur is not None and key == "Ethernet Address":
            cur["mac"] = value
    flush()
    if not ports:
        raise ProbeParseError(f"networksetup: no 'Hardware Port:' blocks in {excerpt(text)}")
    return HardwarePorts(ports=tuple(ports))


@dataclass(frozen=True)
class NetworkService:
    name: str
    enabled: bool


@dataclass(frozen=True)
class NetworkServices:
    """``networksetup -listallnetworkservices``, in service order."""

    services: tuple[NetworkService, ...]

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.services)


def parse_network_services(text: str) -> NetworkServices:
    """``networksetup -listallnetworkservices``; the header line is required, "*" = disabled."""
    text = require_text(text, "networksetup -listallnetworkservices")
    lines = text.splitlines()
    start = next((i + 1 for i, ln in enumerate(lines) if ln.strip().startswith("An asterisk (*) denotes")), None)
    if start is None:
        raise ProbeParseError(f"networksetup -listallnetworkservices: no header in {excerpt(text)}")
    services = []
    for line in lines[start:]:
        name = line.strip()
        if not name:
            continue
        disabled = name.startswith("*")
        name = name.lstrip("*").strip()
        if name:
            services.append(NetworkService(name=name, enabled=not disabled))
    return NetworkServices(services=tuple(services))


def join_interfaces(sp: SPThunderbolt, hardware_ports: HardwarePorts) -> tuple[ThunderboltPort, ...]:
    """Fill each port's ``interface`` from "Thunderbolt <port_id>" (``None`` if absent, no KeyError)."""
    tb = hardware_ports.thunderbolt_interfaces()
    return tuple(replace(p, interface=tb.get(p.port_id) if p.port_id else None) for p in sp.ports)


# --------------------------------------------------------------------------- ifconfig (BSD)


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


def bridge_loop_warning(
    bridge: MacIfconfig | None, ports: Sequence[ThunderboltPort], machines_cabled: int
) -> str | None:
    """The Thunderbolt Bridge loop warning, or ``None``.

    Warn when ``machines_cabled`` (machines joined by Thunderbolt, this one
    included -- from the cluster's link graph) is 3 or more, ``bridge`` is up
    and has at least 2 members that are *active* Thunderbolt ports (a live
    link speed in ``ports``): frames then circle the cable ring. mlx's
    configurator takes bridge0 down before using the ports for the same reason
    (SOURCES.md "How mlx and exo parse").
    """
    if bridge is None or not bridge.up or machines_cabled < 3:
        return None
    active = active_thunderbolt_interfaces(ports)
    looping = [m for m in bridge.members if m in active]
    if len(looping) < 2:
        return None
    return (
        f"Thunderbolt Bridge {bridge.name} bridges {len(looping)} active Thunderbolt ports "
        f"({', '.join(looping)}) while {machines_cabled} machines are cabled: this can loop traffic; "
        f"take {bridge.name} down or remove the Thunderbolt ports from the Thunderbolt Bridge service"
    )


def active_thunderbolt_interfaces(ports: Iterable[ThunderboltPort]) -> frozenset[str]:
    """Interfaces of ports with a live link (a speed without "Up to")."""
    return frozenset(p.interface for p in ports if p.connected and p.interface)


# --------------------------------------------------------------------------- runners


@dataclass(frozen=True)
class MacThunderbolt:
    """What :func:`probe_macos_thunderbolt` found: ports joined to interfaces, and the bridge."""

    ports: tuple[ThunderboltPort, ...]
    bridge: MacIfconfig | None = None


def probe_macos_thunderbolt(timeout: float = 20.0) -> MacThunderbolt | None:
    """Run ``system_profiler SPThunderboltDataType -json``, ``networksetup -listallhardwareports``
    and, when a "Thunderbolt Bridge" hardware port exists, ``ifconfig <its device>``.

    ``None`` (one log line per failing command) if either of the first two
    fails: without the hardware-port map no port can be tied to an interface.
    A failing ``ifconfig`` only leaves ``bridge=None``.
    """
    sp = run_probe(["system_profiler", "SPThunderboltDataType", "-json"], parse_spthunderbolt_json, timeout=timeout)
    if sp is None:
        return None
    hw = run_probe(["networksetup", "-listallhardwareports"], parse_hardware_ports, timeout=timeout)
    if hw is None:
        return None
    bridge_dev = hw.device_of("Thunderbolt Bridge")
    bridge = run_probe(["ifconfig", bridge_dev], parse_ifconfig_macos, timeout=5.0) if bridge_dev else None
    return MacThunderbolt(ports=join_interfaces(sp, hw), bridge=bridge)
