"""macOS Thunderbolt probe: which receptacle, which ``enN``, which peer, how fast.

Three commands, each parsed in a module of its own (format facts and sources
there, and in /work/shared/fixtures/SOURCES.md):

* ``system_profiler SPThunderboltDataType -json`` / plain text:
  :mod:`ringlet.daemon.probes.macos_spthunderbolt` (receptacle, own and peer
  domain UUIDs, link speed, peer RDMA, per bus);
* ``networksetup -listallhardwareports`` / ``-listallnetworkservices``:
  :mod:`ringlet.daemon.probes.macos_networksetup` (receptacle N is the hardware
  port named exactly "Thunderbolt N", which names its ``enN``);
* ``ifconfig bridge0``: :mod:`ringlet.daemon.probes.macos_ifconfig` (the
  Thunderbolt Bridge and its members).

This module runs them (:func:`probe_macos_thunderbolt`), joins ports to
interfaces (:func:`join_interfaces`) and warns about a Thunderbolt Bridge that
loops a cable ring (:func:`bridge_loop_warning`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from .common import ThunderboltPort, run_probe
from .macos_ifconfig import MacIfconfig, parse_ifconfig_macos
from .macos_networksetup import HardwarePorts, parse_hardware_ports
from .macos_spthunderbolt import SPThunderbolt, parse_spthunderbolt_json

__all__ = [
    "MacThunderbolt",
    "active_thunderbolt_interfaces",
    "bridge_loop_warning",
    "join_interfaces",
    "probe_macos_thunderbolt",
]


def join_interfaces(sp: SPThunderbolt, hardware_ports: HardwarePorts) -> tuple[ThunderboltPort, ...]:
    """Fill each port's ``interface`` from "Thunderbolt <port_id>" (``None`` if absent, no KeyError)."""
    tb = hardware_ports.thunderbolt_interfaces()
    return tuple(replace(p, interface=tb.get(p.port_id) if p.port_id else None) for p in sp.ports)


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
