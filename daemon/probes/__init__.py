"""Probes: what this node is (memory, chip, speed) and how it is cabled (Thunderbolt, interfaces).

The daemon calls :func:`probe_local` at start (and when it wants a refresh);
the result travels to peers as JSON (:meth:`LocalProbe.to_dict` /
:meth:`LocalProbe.from_dict`). Peers' Thunderbolt ports are matched with
:func:`ringlet.daemon.probes.links.match_links`.

Every OS command has its own parser module; see each module's docstring for
the format facts and their sources (/work/shared/fixtures/SOURCES.md). A
missing or failing command leaves its part empty/``None`` and logs one line;
:func:`probe_local` itself does not raise.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import ProbeParseError, ThunderboltPort, from_jsonable, to_jsonable
from .interfaces import NetInterface, candidate_interfaces_for_peer, interface_for_peer, list_interfaces
from .links import ThunderboltLink, machines_cabled, match_links
from .machine import MachineInfo, probe_machine
from .macos_ifconfig import MacIfconfig
from .macos_thunderbolt import bridge_loop_warning
from .memory import MemoryInfo, probe_memory
from .speed import SpeedResult, load_or_measure, machine_key

__all__ = [
    "LocalProbe",
    "MachineInfo",
    "MacIfconfig",
    "MemoryInfo",
    "NetInterface",
    "ProbeParseError",
    "SpeedResult",
    "ThunderboltLink",
    "ThunderboltPort",
    "bridge_loop_warning",
    "candidate_interfaces_for_peer",
    "interface_for_peer",
    "machines_cabled",
    "match_links",
    "probe_local",
]

log = logging.getLogger("ringlet.daemon.probes")

#: Bumped when LocalProbe's JSON changes incompatibly.
PROBE_FORMAT = 1


@dataclass(frozen=True)
class LocalProbe:
    """Everything this node knows about itself. Units: bytes, bytes/s, FLOP/s."""

    machine: MachineInfo
    memory: MemoryInfo
    speed: SpeedResult | None
    thunderbolt: tuple[ThunderboltPort, ...]
    interfaces: tuple[NetInterface, ...]
    bridge: MacIfconfig | None = None  # macOS Thunderbolt Bridge (ifconfig bridge0)
    probed_at: float = 0.0  # unix time
    format: int = PROBE_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (only dict/list/str/int/float/bool/None; ``json.dumps`` works)."""
        return to_jsonable(self)

    @classmethod
    def from_dict(cls, data: Any) -> LocalProbe:
        """Inverse of :meth:`to_dict`; validates (data may come from a peer) and raises
        :class:`ProbeParseError` on a wrong shape or an unknown ``format``."""
        if not isinstance(data, dict) or data.get("format", PROBE_FORMAT) != PROBE_FORMAT:
            raise ProbeParseError("LocalProbe: not an object of a known format")
        return from_jsonable(cls, data)


def probe_local(data_dir: Path | str, *, measure_speed: bool = True, platform: str | None = None) -> LocalProbe:
    """Probe this node with the parsers for its OS; never raises.

    - darwin: psutil, ``sysctl``, ``system_profiler`` (hardware, Thunderbolt),
      ``networksetup``, ``ifconfig <Thunderbolt Bridge>``, ``mx.device_info()``;
    - linux: psutil, ``/proc/cpuinfo``, ``/sys/bus/thunderbolt/devices``;
    - speed: cached in ``data_dir`` (measured on first call, ~0.6 s), skipped
      when ``measure_speed`` is False and no cache exists.
    """
    platform = platform or sys.platform
    machine = probe_machine(platform)
    memory = probe_memory(platform)
    key = machine_key(
        machine.os,
        machine.arch,
        machine.chip,
        machine.model_identifier,
        machine.cpu_count,
        memory.total_bytes,
        _blas_key(),  # the matmul figure is that of the BLAS in use
    )
    if measure_speed:
        speed = load_or_measure(data_dir, key)
    else:
        from .speed import CACHE_FILE, read_cache

        speed = read_cache(Path(data_dir) / CACHE_FILE, key)
    ports: tuple[ThunderboltPort, ...] = ()
    bridge = None
    if platform == "darwin":
        from .macos_thunderbolt import probe_macos_thunderbolt

        mac_tb = probe_macos_thunderbolt()
        if mac_tb is not None:
            ports, bridge = mac_tb.ports, mac_tb.bridge
    elif platform.startswith("linux"):
        from .linux_thunderbolt import read_linux_thunderbolt

        ports = read_linux_thunderbolt().ports()
    return LocalProbe(
        machine=machine,
        memory=memory,
        speed=speed,
        thunderbolt=ports,
        interfaces=list_interfaces(),
        bridge=bridge,
        probed_at=time.time(),
    )


def _blas_key() -> str:
    """The BLAS MLX's CPU backend uses here (kind and library), for the speed cache key."""
    from .blas import report

    r = report()
    return f"blas={r.kind}:{r.library or ''}"
