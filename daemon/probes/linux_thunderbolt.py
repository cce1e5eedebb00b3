"""Linux Thunderbolt probe: XDomain (host-to-host) peers and their ``thunderbolt-net`` interfaces.

Format facts (SOURCES.md §5; kernel ``drivers/thunderbolt/xdomain.c``,
``xdomain_attrs[]``; the chrisbergeron fixtures):

- ``/sys/bus/thunderbolt/devices/`` holds symlinks: ``domain0``, routers
  ``0-0``, ``0-3`` ..., XDomains and their services ``0-3.0``.
- The only way to tell a host peer from a device is ``uevent``
  ``DEVTYPE=thunderbolt_xdomain`` (routers are ``thunderbolt_device``, services
  ``thunderbolt_service``, domains ``thunderbolt_domain``).
- XDomain attributes: ``device, device_name, maxhopid, rx_lanes, rx_speed,
  tx_lanes, tx_speed, unique_id, vendor, vendor_name``. ``rx_speed``/``tx_speed``
  print ``"%u.0 Gb/s\\n"`` **per lane**; ``*_lanes`` print 1 or 2. The total is
  per-lane * lanes, in decimal Gb/s (1 Gb/s = 125_000_000 bytes/s). Older
  kernels (the 5.13 of the fixture) have no ``*_lanes``: then 1 lane is
  assumed (a lower bound) and ``*_lanes`` is ``None``.
- ``unique_id`` is ``%pUb`` (lower case) of the *remote* host's UUID.
- The service child ``0-3.0`` binds to ``thunderbolt-net``; its netdev is
  ``0-3.0/net/thunderbolt0`` (dmesg: ``thunderbolt-net 0-3.0 thunderbolt0: ...``).
- This host's own UUID: the ``unique_id`` of the domain's root router
  ``<domain>-0`` (the kernel passes the root switch UUID as the local UUID when
  it allocates an XDomain, drivers/thunderbolt/tb.c). **Not verified on
  hardware**, nor is the assumption (SOURCES.md) that a Linux ``unique_id`` equals
  the Mac's own ``domain_uuid_key`` for that bus.

Parsers of captured text: :func:`parse_lane_speed` (one sysfs attribute),
:func:`parse_uevent`, :func:`parse_dmesg_thunderbolt`, :func:`parse_ifconfig_linux`
(net-tools ``ifconfig thunderbolt0``).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from .common import (
    ProbeParseError,
    ThunderboltPort,
    excerpt,
    gbit_to_bytes_per_s,
    normalize_uuid,
    parse_int,
    require_text,
)

log = logging.getLogger("ringlet.daemon.probes")

SYSFS_THUNDERBOLT_DEVICES = Path("/sys/bus/thunderbolt/devices")
_MAX_ATTR_BYTES = 4096


# --------------------------------------------------------------------------- attribute parsers

_LANE_SPEED_RE = re.compile(r"^(\d{1,5})(?:\.(\d{1,3}))? Gb/s$")


def parse_lane_speed(text: str) -> int:
    """``rx_speed``/``tx_speed`` ("20.0 Gb/s\\n") -> Gb/s per lane (int)."""
    text = require_text(text, "thunderbolt speed")
    m = _LANE_SPEED_RE.match(text.strip())
    if not m:
        raise ProbeParseError(f"thunderbolt speed: expected '%u.0 Gb/s', got {excerpt(text)}")
    return int(m.group(1))


_UEVENT_RE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


def parse_uevent(text: str) -> dict[str, str]:
    """A sysfs ``uevent`` file ("KEY=value" lines, upper-case keys) -> dict; anything else -> ProbeParseError."""
    text = require_text(text, "uevent")
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _UEVENT_RE.match(line.strip())
        if not m:
            raise ProbeParseError(f"uevent: not a KEY=value line: {excerpt(line)}")
        out[m.group(1)] = m.group(2)
    return out


# --------------------------------------------------------------------------- sysfs tree


@dataclass(frozen=True)
class XDomainPeer:
    """One host cabled to this one (sysfs ``DEVTYPE=thunderbolt_xdomain``).

    Speeds: ``*_gbps_per_lane`` as printed (decimal Gb/s per lane);
    ``*_bytes_per_s`` = per lane * lanes (1 lane assumed if lanes unknown) * 125e6.
    """

    name: str  # "0-3"
    unique_id: str | None  # remote host UUID, upper-cased
    local_uuid: str | None  # unique_id of root router "<domain>-0", upper-cased
    vendor_id: int | None = None
    vendor_name: str | None = None
    device_id: int | None = None
    device_name: str | None = None
    rx_gbps_per_lane: int | None = None
    rx_lanes: int | None = None
    tx_gbps_per_lane: int | None = None
    tx_lanes: int | None = None
    netdevs: tuple[str, ...] = ()  # thunderbolt-net interfaces of its services
    services: tuple[str, ...] = ()  # "0-3.0", ...

    @property
    def rx_bytes_per_s(self) -> int | None:
        return gbit_to_bytes_per_s(self.rx_gbps_per_lane * (self.rx_lanes or 1)) if self.rx_gbps_per_lane else None

    @property
    def tx_bytes_per_s(self) -> int | None:
        return gbit_to_bytes_per_s(self.tx_gbps_per_lane * (self.tx_lanes or 1)) if self.tx_gbps_per_lane else None

    def to_port(self) -> ThunderboltPort:
        """As an OS-neutral port; link speed = min(rx, tx)."""
        speeds = [s for s in (self.rx_bytes_per_s, self.tx_bytes_per_s) if s]
        return ThunderboltPort(
            port_id=self.name,
            interface=self.netdevs[0] if self.netdevs else None,
            own_domain_uuid=self.local_uuid,
            peer_domain_uuid=self.unique_id,
            link_speed_bytes_per_s=min(speeds) if speeds else None,
            speed_text=f"{self.rx_gbps_per_lane}.0 Gb/s x {self.rx_lanes or 1}" if self.rx_gbps_per_lane else None,
            peer_rdma=False,
            peer_name=self.vendor_name,
            peer_model=self.device_name,
            devices=(self.name,),
            bus_name=self.name.split("-")[0] if "-" in self.name else None,
            source="linux_sysfs",
        )


@dataclass(frozen=True)
class LinuxThunderbolt:
    """The sysfs tree read: ``present`` = the devices directory exists (module loaded)."""

    present: bool
    peers: tuple[XDomainPeer, ...] = ()
    routers: tuple[str, ...] = ()

    def ports(self) -> tuple[ThunderboltPort, ...]:
        return tuple(p.to_port() for p in self.peers)


def _read_attr(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return f.read(_MAX_ATTR_BYTES).decode("utf-8", errors="replace").strip()
    except OSError:
        return None


def _int_attr(path: Path, base: int = 0) -> int | None:
    v = _read_attr(path)
    if v is None:
        return None
    try:
        return parse_int(v, path.name, base)
    except ProbeParseError:
        log.debug("probe thunderbolt sysfs: bad %s: %s", path, excerpt(v))
        return None


def _speed_attr(path: Path) -> int | None:
    v = _read_attr(path)
    if not v:
        return None
    try:
        return parse_lane_speed(v)
    except ProbeParseError:
        log.debug("probe thunderbolt sysfs: bad %s: %s", path, excerpt(v))
        return None


def _devtype(dev: Path) -> str | None:
    text = _read_attr(dev / "uevent")
    if not text:
        return None
    try:
        return parse_uevent(text).get("DEVTYPE")
    except ProbeParseError:
        return None


def read_linux_thunderbolt(root: Path | str = SYSFS_THUNDERBOLT_DEVICES) -> LinuxThunderbolt:
    """Read XDomain peers from ``root`` (default ``/sys/bus/thunderbolt/devices``).

    Never raises: unreadable or odd entries are skipped (debug log), missing
    attributes stay ``None``. A missing ``root`` (no Thunderbolt, module not
    loaded) is normal: ``present=False`` and no log line.
    """
    root = Path(root)
    try:
        entries = sorted(p for p in root.iterdir())
    except OSError:
        return LinuxThunderbolt(present=False)
    types = {e.name: _devtype(e) for e in entries}
    peers = []
    for dev in entries:
        if types[dev.name] != "thunderbolt_xdomain":
            continue
        domain = dev.name.split("-", 1)[0]
        services = [e for e in entries if e.name.startswith(dev.name + ".")]
        netdevs: list[str] = []
        for svc in services:
            try:
                netdevs.extend(sorted(n.name for n in (svc / "net").iterdir()))
            except OSError:
                continue
        peers.append(
            XDomainPeer(
                name=dev.name,
                unique_id=normalize_uuid(_read_attr(dev / "unique_id")),
                local_uuid=normalize_uuid(_read_attr(root / f"{domain}-0" / "unique_id")),
                vendor_id=_int_attr(dev / "vendor"),
                vendor_name=_read_attr(dev / "vendor_name") or None,
                device_id=_int_attr(dev / "device"),
                device_name=_read_attr(dev / "device_name") or None,
                rx_gbps_per_lane=_speed_attr(dev / "rx_speed"),
                rx_lanes=_int_attr(dev / "rx_lanes", 10),
                tx_gbps_per_lane=_speed_attr(dev / "tx_speed"),
                tx_lanes=_int_attr(dev / "tx_lanes", 10),
                netdevs=tuple(netdevs),
                services=tuple(s.name for s in services),
            )
        )
    routers = tuple(n for n, t in types.items() if t == "thunderbolt_device")
    return LinuxThunderbolt(present=True, peers=tuple(peers), routers=routers)


# --------------------------------------------------------------------------- dmesg


@dataclass(frozen=True)
class DmesgEvent:
    """One Thunderbolt kernel log line.

    ``kind``: "host_found" (vendor_id/device_id set), "host_name" (``text`` =
    "<vendor_name> <device_name>", e.g. "Apple Inc. Macmini9,1" -- the split
    is ambiguous since both may contain spaces, so it is kept whole),
    "host_disconnected", "login_timeout", "link_ready", or "other".
    """

    kind: str
    timestamp: str | None
    device: str | None  # sysfs name "0-3" / "0-3.0"
    netdev: str | None = None  # "thunderbolt0"
    vendor_id: int | None = None
    device_id: int | None = None
    text: str = ""


@dataclass(frozen=True)
class DmesgThunderbolt:
    events: tuple[DmesgEvent, ...]

    def hosts(self) -> dict[str, str]:
        """sysfs device -> "<vendor_name> <device_name>" from the latest "host_name" line."""
        return {e.device: e.text for e in self.events if e.kind == "host_name" and e.device}


# "[timestamp] <driver> <device>: msg" (dev_info) or "[timestamp] IPv6: msg"
_DMESG_RE = re.compile(r"^(\[[^\]]*\])?\s*(thunderbolt-net|thunderbolt|IPv6:) (.*)$")
_FOUND_RE = re.compile(r"^(\d+-[0-9a-f]+): new host found, vendor=(0x[0-9a-fA-F]{1,8}) device=(0x[0-9a-fA-F]{1,8})$")
_NET_RE = re.compile(r"^(\d+-[0-9a-f]+\.\d+) (\S+): (.*)$")
_DEV_RE = re.compile(r"^(\d+-[0-9a-f]+(?:\.\d+)?): (.*)$")
_READY_RE = re.compile(r"^ADDRCONF\(NETDEV_CHANGE\): (\S+): link becomes ready$")


def parse_dmesg_thunderbolt(text: str) -> DmesgThunderbolt:
    """``dmesg [-T] | grep -i thunderbolt`` -> events. Lines that are not Thunderbolt lines are skipped;
    none at all -> :class:`ProbeParseError`. Formats: drivers/thunderbolt/xdomain.c ("new host
    found, vendor=%#x device=%#x", "%s %s" names, "host disconnected"), thunderbolt-net
    ("ThunderboltIP login timed out"), IPv6 addrconf ("link becomes ready")."""
    text = require_text(text, "dmesg")
    events = []
    for raw in text.splitlines():
        m = _DMESG_RE.match(raw.strip())
        if not m:
            continue
        ts = m.group(1)[1:-1].strip() if m.group(1) else None
        src, rest = m.group(2), m.group(3).strip()
        if src == "IPv6:":
            r = _READY_RE.match(rest)
            if r and r.group(1).startswith("thunderbolt"):
                events.append(DmesgEvent("link_ready", ts, None, netdev=r.group(1), text=rest))
            continue
        if src == "thunderbolt-net":
            n = _NET_RE.match(rest)
            if n:
                kind = "login_timeout" if "login timed out" in n.group(3) else "other"
                events.append(DmesgEvent(kind, ts, n.group(1), netdev=n.group(2), text=n.group(3)))
            continue
        f = _FOUND_RE.match(rest)
        if f:
            events.append(
                DmesgEvent("host_found", ts, f.group(1), vendor_id=int(f.group(2), 16), device_id=int(f.group(3), 16))
            )
            continue
        d = _DEV_RE.match(rest)
        if not d:
            continue
        msg = d.group(2).strip()
        if msg == "host disconnected":
            events.append(DmesgEvent("host_disconnected", ts, d.group(1), text=msg))
        elif events and events[-1].kind == "host_found" and events[-1].device == d.group(1):
            events.append(DmesgEvent("host_name", ts, d.group(1), text=msg))
        else:
            events.append(DmesgEvent("other", ts, d.group(1), text=msg))
    if not events:
        raise ProbeParseError(f"dmesg: no Thunderbolt lines in {excerpt(text)}")
    return DmesgThunderbolt(events=tuple(events))


# --------------------------------------------------------------------------- ifconfig (net-tools)


@dataclass(frozen=True)
class LinuxIfconfig:
    """net-tools ``ifconfig <if>``. Byte counters in bytes."""

    name: str
    flags: tuple[str, ...]
    mtu: int
    ipv4: str | None = None
    netmask: str | None = None
    broadcast: str | None = None
    ipv6: tuple[str, ...] = ()
    mac: str | None = None
    rx_packets: int | None = None
    rx_bytes: int | None = None
    tx_packets: int | None = None
    tx_bytes: int | None = None

    @property
    def up(self) -> bool:
        return "UP" in self.flags


_LIF_HEAD_RE = re.compile(r"^(\S+): flags=(\d{1,10})<([^>]*)>\s+mtu (\d{1,7})")
_COUNT_RE = re.compile(r"^(RX|TX) packets (\d{1,20})\s+bytes (\d{1,20})")


def _ip(value: str, what: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ProbeParseError(f"ifconfig: bad {what} {excerpt(value)}") from None


def parse_ifconfig_linux(text: str) -> LinuxIfconfig:
    """net-tools ``ifconfig thunderbolt0`` (flags decimal, e.g. 4163<UP,BROADCAST,RUNNING,MULTICAST>)."""
    text = require_text(text, "ifconfig")
    lines = text.splitlines()
    m = _LIF_HEAD_RE.match(lines[0].strip()) if lines else None
    if not m:
        raise ProbeParseError(f"ifconfig: no 'name: flags=N<...>  mtu N' header in {excerpt(text)}")
    kw: dict = {
        "name": m.group(1),
        "flags": tuple(f for f in m.group(3).split(",") if f),
        "mtu": int(m.group(4)),
    }
    ipv6: list[str] = []
    for raw in lines[1:]:
        if raw and not raw[0].isspace():
            break
        parts = raw.split()
        if not parts:
            continue
        if parts[0] == "inet" and len(parts) >= 2:
            kw["ipv4"] = _ip(parts[1], "inet")
            for key, field in (("netmask", "netmask"), ("broadcast", "broadcast")):
                if key in parts[:-1]:
                    kw[field] = _ip(parts[parts.index(key) + 1], key)
        elif parts[0] == "inet6" and len(parts) >= 2:
            ipv6.append(parts[1])
        elif parts[0] == "ether" and len(parts) >= 2:
            kw["mac"] = parts[1].lower()
        elif c := _COUNT_RE.match(raw.strip()):
            d = c.group(1).lower()
            kw[f"{d}_packets"], kw[f"{d}_bytes"] = int(c.group(2)), int(c.group(3))
    return LinuxIfconfig(ipv6=tuple(ipv6), **kw)
