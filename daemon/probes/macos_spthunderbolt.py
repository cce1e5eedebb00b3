"""macOS ``system_profiler SPThunderboltDataType`` parsers: each bus's receptacle, own and peer UUIDs, speed, RDMA.

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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .common import (
    ProbeParseError,
    ThunderboltPort,
    excerpt,
    normalize_uuid,
    parse_tb_speed,
    require_text,
)

__all__ = ["RDMA_PROTOCOL_ID", "SPThunderbolt", "parse_spthunderbolt_json", "parse_spthunderbolt_text"]

#: XDomain protocol id of Apple's RDMA-over-Thunderbolt service (SOURCES.md §1, "How mlx and exo parse").
RDMA_PROTOCOL_ID = 64087
#: Service names macOS shows for host-to-host (XDomain) services; used only to
#: recognise a peer host that has no ``domain_uuid_key`` (trimmed captures).
_HOST_SERVICE_NAMES = frozenset({"service_ip", "unknown_xd_service"})


@dataclass(frozen=True)
class SPThunderbolt:
    """``system_profiler SPThunderboltDataType`` parsed: one port per bus, in output order.

    ``interface`` is ``None`` until
    :func:`~ringlet.daemon.probes.macos_thunderbolt.join_interfaces`.
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
