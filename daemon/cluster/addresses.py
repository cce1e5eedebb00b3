"""Interface selection for discovery: the IPv4 addresses to bind and advertise (mDNS here is IPv4 only).

Without ``--interface``, container and VM bridges, their veth ports and VPN tunnels are
skipped (:data:`VIRTUAL_PREFIXES`): every Docker, Podman or libvirt host has the same
``docker0`` 172.17.0.1 (or ``virbr0`` 192.168.122.1), so a node that advertised it would
hand its peers an address that is every host's own (exo #858). ``--interface`` names any
of them on purpose. macOS's ``bridge0`` (the Thunderbolt Bridge) is kept.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from ringlet.daemon.errors import RingletError

log = logging.getLogger(__name__)

__all__ = ["VIRTUAL_PREFIXES", "advertised_host", "dial_addresses", "interface_addresses", "is_ipv4", "is_wildcard",
           "log_skipped_interfaces", "no_address_reason", "public_host", "skipped_interfaces", "virtual_kind"]

#: Interface name prefixes skipped without ``--interface``, and what they are: container
#: and VM bridges and their ports (Docker, Podman, CNI, flannel, libvirt), VPN tunnels
#: (Tailscale, macOS ``utun``) and Apple's peer-to-peer Wi-Fi (``awdl``, ``llw``).
VIRTUAL_PREFIXES: tuple[tuple[str, str], ...] = (
    ("docker", "a Docker bridge"), ("br-", "a Docker network bridge"), ("veth", "a container's veth port"),
    ("virbr", "a libvirt bridge"), ("cni", "a CNI bridge"), ("flannel", "a flannel overlay"),
    ("podman", "a Podman bridge"), ("tailscale", "a Tailscale tunnel"), ("utun", "a VPN tunnel"),
    ("awdl", "Apple Wireless Direct Link"), ("llw", "Apple low-latency Wi-Fi"),
)


def interface_addresses(
    interfaces: Sequence[str] | None,
    *,
    if_addrs: Mapping[str, Sequence[Any]] | None = None,
    if_stats: Mapping[str, Any] | None = None,
) -> list[str]:
    """Resolve an interface selection to the IPv4 addresses to bind and advertise.

    Args:
        interfaces: ``None`` means every interface that is up, multicast-capable,
            not loopback and not a container or VM bridge or tunnel
            (:func:`virtual_kind`; its IPv4 addresses, link-local included: a
            Thunderbolt bridge often has only 169.254.x.x). Otherwise a list
            whose entries are IPv4 addresses (used as given, e.g. ``127.0.0.1``
            for one-machine clusters) or interface names (``en0``, ``lo``:
            their IPv4 addresses now; names absent or without IPv4 give none).
        if_addrs, if_stats: ``psutil.net_if_addrs()``/``net_if_stats()``
            results to use instead (tests).

    Returns:
        addresses in first-seen order, without duplicates (possibly empty).

    Raises:
        ValueError: an entry is empty, not a string, or an IPv6 address (mDNS
            here is IPv4 only).
    """
    if interfaces is not None:
        for spec in interfaces:
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"bad interface {spec!r}: want an IPv4 address or an interface name")
            if ":" in spec:
                raise ValueError(f"interface {spec!r}: IPv6 is not supported, give an IPv4 address or a name")
        if all(is_ipv4(s) for s in interfaces):
            return list(dict.fromkeys(str(ipaddress.IPv4Address(s)) for s in interfaces))
    addrs = psutil.net_if_addrs() if if_addrs is None else if_addrs
    out: list[str] = []
    if interfaces is None:
        stats = psutil.net_if_stats() if if_stats is None else if_stats
        for name, entries in addrs.items():
            st = stats.get(name)
            if st is None or not st.isup or virtual_kind(name):
                continue
            flags = set(filter(None, str(getattr(st, "flags", "") or "").split(",")))
            if "loopback" in flags or (flags and "multicast" not in flags):
                continue
            out.extend(
                e.address
                for e in entries
                if e.family == socket.AF_INET and not ipaddress.IPv4Address(e.address).is_loopback
            )
    else:
        for spec in interfaces:
            if is_ipv4(spec):
                out.append(str(ipaddress.IPv4Address(spec)))
            else:
                out.extend(e.address for e in addrs.get(spec, ()) if e.family == socket.AF_INET)
    return list(dict.fromkeys(out))


def virtual_kind(name: str) -> str | None:
    """What interface ``name`` is when it is skipped by default (e.g. ``"a Docker bridge"``),
    else ``None``."""
    return next((kind for prefix, kind in VIRTUAL_PREFIXES if name.startswith(prefix)), None)


def skipped_interfaces(
    *,
    if_addrs: Mapping[str, Sequence[Any]] | None = None,
    if_stats: Mapping[str, Any] | None = None,
) -> list[tuple[str, list[str], str]]:
    """The interfaces with IPv4 addresses that :func:`interface_addresses` skips without
    ``--interface``: ``(name, addresses, what it is)`` each (for the log and ``doctor``)."""
    addrs = psutil.net_if_addrs() if if_addrs is None else if_addrs
    stats = psutil.net_if_stats() if if_stats is None else if_stats
    out = []
    for name, entries in addrs.items():
        kind = virtual_kind(name)
        st = stats.get(name)
        ipv4 = [e.address for e in entries if e.family == socket.AF_INET]
        if kind and ipv4 and st is not None and st.isup:
            out.append((name, ipv4, kind))
    return out


def is_ipv4(s: str) -> bool:
    try:
        ipaddress.IPv4Address(s)
    except ValueError:
        return False
    return True


def is_wildcard(host: str) -> bool:
    """Whether ``host`` (a ``--host``) binds every interface."""
    return host in ("0.0.0.0", "")  # noqa: S104 - comparison only


def advertised_host(advertise_host: str | None, host: str, interfaces: Sequence[str] | None,
                    prefer: str | None = None) -> str | None:
    """The address peers dial: ``--advertise-host``, else ``--host`` unless it is a
    wildcard, else a non-loopback IPv4 address of the mDNS ``interfaces``
    (:func:`interface_addresses`: container and VM bridges skipped when none are named):
    ``prefer`` (the one advertised so far) while it is still there, else the first.
    ``None`` when there is none yet (a daemon started before its network: it waits)."""
    if advertise_host:
        return advertise_host
    if not is_wildcard(host):
        return host
    addresses = [a for a in interface_addresses(interfaces) if not a.startswith("127.")]
    if prefer in addresses:
        return prefer
    return addresses[0] if addresses else None


def public_host(advertise_host: str | None, host: str, interfaces: Sequence[str] | None) -> str:
    """:func:`advertised_host`, required now.

    Raises:
        RingletError: a wildcard ``--host`` and no usable address to advertise.
    """
    public = advertised_host(advertise_host, host, interfaces)
    if public is None:
        raise RingletError("--host 0.0.0.0 needs --advertise-host (no non-loopback IPv4 address found)")
    return public


def no_address_reason(
    interfaces: Sequence[str] | None,
    *,
    if_addrs: Mapping[str, Sequence[Any]] | None = None,
    if_stats: Mapping[str, Any] | None = None,
) -> str:
    """Why :func:`advertised_host` finds no address, in one line naming each interface it
    looked at: ``"eth0: down"``, ``"eth0: up, no carrier yet"`` (Linux sets a link
    *running* about a second after ``ip link set up``), ``"eth0: no IPv4 address"``,
    ``"docker0: skipped (a Docker bridge)"``; ``if_addrs``/``if_stats`` as for
    :func:`interface_addresses` (tests)."""
    addrs = psutil.net_if_addrs() if if_addrs is None else if_addrs
    stats = psutil.net_if_stats() if if_stats is None else if_stats
    names = [s for s in interfaces if not is_ipv4(s)] if interfaces is not None else list(
        dict.fromkeys([*stats, *addrs]))
    states = []
    for name in names:
        st = stats.get(name)
        flags = set(filter(None, str(getattr(st, "flags", "") or "").split(",")))
        ipv4 = [e.address for e in addrs.get(name, ()) if e.family == socket.AF_INET]
        if "loopback" in flags or (st is None and name not in addrs and interfaces is None):
            continue
        if st is None and name not in addrs:
            states.append(f"{name}: no such interface")
        elif interfaces is None and (kind := virtual_kind(name)):
            states.append(f"{name}: skipped ({kind})")
        elif st is not None and flags and "up" not in flags:
            states.append(f"{name}: down")
        elif st is not None and not st.isup:
            states.append(f"{name}: up, no carrier yet")
        elif not ipv4:
            states.append(f"{name}: no IPv4 address")
        elif interfaces is None and flags and "multicast" not in flags:
            states.append(f"{name}: not multicast-capable")
        else:
            states.append(f"{name}: loopback address only")
    where = "the interfaces given (--interface)" if interfaces is not None else "any interface that is up"
    return f"no non-loopback IPv4 address on {where} ({'; '.join(states) or 'none but loopback'})"


def dial_addresses(public: str, host: str, interfaces: Sequence[str] | None, port: int) -> list[str]:
    """Every ``host:port`` peers may dial this node at: the advertised address ``public``
    first, then, when the gRPC server binds every interface (a wildcard ``host``), the other
    addresses of the mDNS ``interfaces`` (:func:`interface_addresses`; loopback ones only
    when ``public`` is loopback). A node bound to one address has only that one."""
    out = [f"{public}:{port}"]
    if is_wildcard(host):
        loop = public.startswith("127.")
        out += [f"{a}:{port}" for a in interface_addresses(interfaces) if loop or not a.startswith("127.")]
    return list(dict.fromkeys(out))


def log_skipped_interfaces() -> None:
    """Say once which container/VM bridges and tunnels discovery and the advertised address skip."""
    for name, addresses, kind in skipped_interfaces():
        log.info("not advertising %s (%s): %s, the same on many hosts; --interface %s uses it",
                 name, ", ".join(addresses), kind, name)
