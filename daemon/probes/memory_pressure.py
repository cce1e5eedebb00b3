"""Memory pressure from outside the daemon: the kernel's own signals that memory is short.

Sources, read in one poll (:func:`read_pressure`), each optional:

- Linux PSI (pressure stall information, ``Documentation/accounting/psi.rst``): the
  share of the last 10 s some task stalled waiting for memory, ``some avg10=`` of the
  cgroup's own ``memory.pressure`` (cgroup v2), else the machine's ``/proc/pressure/memory``.
- cgroup v2 ``memory.events``: ``high`` (the cgroup was throttled over ``memory.high``),
  ``max`` (it hit ``memory.max`` and reclaimed) and ``oom`` counters; a counter that grew
  since the last poll is pressure.
- The cgroup's memory without page cache against its limit (v1 and v2): anonymous memory
  at :data:`NEAR_LIMIT_FRACTION` of the limit or more leaves the kernel only the daemon
  to reclaim from.
- Without a cgroup: the machine's available memory below :data:`LOW_AVAILABLE_FRACTION`
  of its RAM.
- macOS: ``sysctl -n kern.memorystatus_vm_pressure_level`` (xnu's
  ``kVMPressureNormal`` 1, ``kVMPressureWarning`` 2, ``kVMPressureUrgent`` 3,
  ``kVMPressureCritical`` 4); 2 or more is pressure.

:func:`pressure_reason` turns two successive readings into a reason in words, or ``None``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from .cgroup_memory import CgroupMemory, read_cgroup_memory
from .common import ProbeParseError, parse_int, require_text, run_probe

__all__ = ["LOW_AVAILABLE_FRACTION", "NEAR_LIMIT_FRACTION", "PSI_SOME_PERCENT", "PressureReading",
           "parse_macos_pressure_level", "parse_memory_events", "parse_psi", "pressure_reason", "read_pressure"]

#: PSI ``some avg10`` (per cent of the last 10 s) at or above which memory is under pressure.
PSI_SOME_PERCENT = 10.0
#: A cgroup's memory without page cache at or above this share of its limit is pressure.
NEAR_LIMIT_FRACTION = 0.9
#: Without a cgroup: available memory below this share of the machine's RAM is pressure.
LOW_AVAILABLE_FRACTION = 0.05

_PSI_RE = re.compile(r"^(some|full)\s+avg10=([\d.]+)\s+avg60=([\d.]+)\s+avg300=([\d.]+)\s+total=(\d+)\s*$")


def parse_psi(text: str) -> dict[str, float]:
    """A PSI file (``/proc/pressure/memory``, a cgroup's ``memory.pressure``) as
    ``{"some_avg10": %, "some_avg60": %, "full_avg10": %, ...}``.

    Raises:
        ProbeParseError: a line that is not ``some|full avg10=… avg60=… avg300=… total=…``.
    """
    text = require_text(text, "memory pressure")
    out: dict[str, float] = {}
    for line in text.strip().splitlines():
        m = _PSI_RE.match(line.strip())
        if not m:
            raise ProbeParseError(f"memory pressure: unexpected line {line.strip()[:80]!r}")
        kind = m.group(1)
        out.update({f"{kind}_avg10": float(m.group(2)), f"{kind}_avg60": float(m.group(3)),
                    f"{kind}_avg300": float(m.group(4))})
    return out


def parse_memory_events(text: str) -> dict[str, int]:
    """cgroup v2 ``memory.events`` (``low 0\\nhigh 12\\nmax 0\\noom 0\\noom_kill 0``) as a dict.

    Raises:
        ProbeParseError: a line that is not ``name count``.
    """
    out: dict[str, int] = {}
    for line in require_text(text, "memory.events").strip().splitlines():
        parts = line.split()
        if len(parts) != 2:
            raise ProbeParseError(f"memory.events: unexpected line {line[:80]!r}")
        out[parts[0]] = parse_int(parts[1], f"memory.events {parts[0]}")
    return out


def parse_macos_pressure_level(text: str) -> int:
    """``sysctl -n kern.memorystatus_vm_pressure_level`` (``1``; or with the name,
    ``kern.memorystatus_vm_pressure_level: 2``) as its level.

    Raises:
        ProbeParseError: not a level.
    """
    value = require_text(text, "kern.memorystatus_vm_pressure_level").strip().rsplit(":", 1)[-1].strip()
    return parse_int(value, "kern.memorystatus_vm_pressure_level")


@dataclass(frozen=True)
class PressureReading:
    """One poll's signals (``None``: not available here).

    Attributes:
        psi_some_avg10: PSI ``some avg10``, per cent.
        psi_source: the PSI file read (the cgroup's or the machine's).
        events: cgroup v2 ``memory.events`` counters.
        used_bytes: the limiting cgroup's memory without page cache, bytes.
        limit_bytes: that cgroup's limit, bytes.
        available_bytes, total_bytes: the machine's, bytes (used without a cgroup limit).
        macos_level: ``kern.memorystatus_vm_pressure_level``.
    """

    psi_some_avg10: float | None = None
    psi_source: str = ""
    events: dict[str, int] = field(default_factory=dict)
    used_bytes: int | None = None
    limit_bytes: int | None = None
    available_bytes: int | None = None
    total_bytes: int | None = None
    macos_level: int | None = None


def _psi(path: Path) -> float | None:
    try:
        return parse_psi(path.read_text()).get("some_avg10")
    except (OSError, ProbeParseError):
        return None


def read_pressure(root: Path | str = "/", platform: str | None = None,
                  cgroup: CgroupMemory | None = None) -> PressureReading:
    """Read every signal available here now (``root``: where ``/proc`` and ``/sys`` are;
    ``cgroup``: this process's, read anew when not given). Never raises."""
    platform = platform or sys.platform
    root = Path(root)
    if platform == "darwin":
        level = run_probe(["sysctl", "-n", "kern.memorystatus_vm_pressure_level"], parse_macos_pressure_level,
                          timeout=5.0)
        return PressureReading(macos_level=level)
    cgroup = cgroup if cgroup is not None else read_cgroup_memory(root)
    psi, source, events = None, "", {}
    if cgroup is not None and cgroup.version == 2:
        own = root / cgroup.directory.lstrip("/")
        if (psi := _psi(own / "memory.pressure")) is not None:
            source = f"{cgroup.directory}/memory.pressure"
        try:
            events = parse_memory_events((own / "memory.events").read_text())
        except (OSError, ProbeParseError):
            events = {}
    if psi is None and (psi := _psi(root / "proc/pressure/memory")) is not None:
        source = "/proc/pressure/memory"
    vm = psutil.virtual_memory()
    return PressureReading(psi_some_avg10=psi, psi_source=source, events=events,
                           used_bytes=cgroup.used_bytes if cgroup is not None else None,
                           limit_bytes=cgroup.limit_bytes if cgroup is not None else None,
                           available_bytes=int(vm.available), total_bytes=int(vm.total))


def pressure_reason(now: PressureReading, before: PressureReading | None) -> str | None:
    """Why memory is under pressure by ``now`` (and the counters' growth since ``before``),
    in words, or ``None``: the first signal that holds, in the order of the module docstring."""
    if now.psi_some_avg10 is not None and now.psi_some_avg10 >= PSI_SOME_PERCENT:
        return f"tasks stalled on memory {now.psi_some_avg10:.0f}% of the last 10 s ({now.psi_source})"
    for name in ("oom", "max", "high"):
        grew = now.events.get(name, 0) - (before.events.get(name, 0) if before is not None else now.events.get(name, 0))
        if grew > 0:
            return f"the cgroup's memory.events {name} grew by {grew}"
    if now.used_bytes is not None and now.limit_bytes:
        if now.used_bytes >= NEAR_LIMIT_FRACTION * now.limit_bytes:
            return (f"the cgroup holds {now.used_bytes / now.limit_bytes:.0%} of its limit without page cache "
                    f"({now.used_bytes / 2**20:.0f} of {now.limit_bytes / 2**20:.0f} MiB)")
        return None
    if now.available_bytes is not None and now.total_bytes:
        if now.available_bytes < LOW_AVAILABLE_FRACTION * now.total_bytes:
            return (f"the machine has {now.available_bytes / 2**20:.0f} MiB available of "
                    f"{now.total_bytes / 2**30:.1f} GiB")
    if now.macos_level is not None and now.macos_level >= 2:
        return f"macOS memory pressure level {now.macos_level} (kern.memorystatus_vm_pressure_level)"
    return None
