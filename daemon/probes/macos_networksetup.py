"""macOS ``networksetup`` parsers: hardware ports (which ``enN`` is "Thunderbolt N") and network services.

Format facts (all from /work/shared/fixtures/SOURCES.md, which documents the
captures and how ml-explore/mlx ``_distributed_utils/config.py`` and exo
``info_gatherer`` parse them):

``networksetup -listallhardwareports`` (:func:`parse_hardware_ports`)
  - blocks "Hardware Port: X" / "Device: enN" / "Ethernet Address: ..."
    (sometimes trimmed); the port of receptacle N is the one named exactly
    "Thunderbolt N" -- never "Thunderbolt Bridge", never by position
    (MBP M4/M5 Max: Thunderbolt 1/2/3 -> en1/en6/en2).
``networksetup -listallnetworkservices`` (:func:`parse_network_services`)
  - a header line "An asterisk (*) denotes that a network service is
    disabled." then one service name per line, "*" prefix = disabled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .common import ProbeParseError, excerpt, require_text

__all__ = [
    "HardwarePort",
    "HardwarePorts",
    "NetworkService",
    "NetworkServices",
    "parse_hardware_ports",
    "parse_network_services",
]

_TB_PORT_RE = re.compile(r"^Thunderbolt (\d{1,3})$")


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

    def wifi_devices(self) -> tuple[str, ...]:
        """Devices of the Wi-Fi hardware ports ("Wi-Fi"; "AirPort" on older macOS)."""
        return tuple(p.device for p in self.ports if p.device and p.name in ("Wi-Fi", "AirPort"))

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
