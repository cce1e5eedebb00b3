"""Machine probe: chip, model name, core counts, RAM.

One parser per command output:
- :func:`parse_sphardware_json` -- ``system_profiler SPHardwareDataType -json``
  (fixture: patchd M2 Ultra Mac Studio, SOURCES.md §3). ``physical_memory`` "64
  GB" is binary (GiB): the same Mac's ``hw.memsize`` is 68719476736 = 64 * 2**30.
  ``number_processors`` "proc 24:16:8:0" = total:performance:efficiency:<4th
  field, meaning not documented, kept raw>.
- :func:`parse_sphardware_text` -- plain ``system_profiler SPHardwareDataType``
  (what exo reads: first "Model Name" / "Chip" lines split on ": "), including
  grepped output mixed with stderr noise lines ``2026-04-28 08:52:35.280
  system_profiler[29046:41174793] hw.cpufamily: 0x17d5b93a`` (macOS 26.4,
  XcodeBenchmark #664), which are skipped.
- :func:`parse_sysctl_hw_values` -- ``sysctl -n hw.memsize hw.ncpu
  machdep.cpu.brand_string``: three lines, bytes / count / text.
- :func:`parse_sysctl` -- ``sysctl name...`` "key: value" lines, e.g. ``sysctl
  hw`` with ``hw.perflevelN.*`` (perflevel0 = the highest-performance cluster;
  fixture UNATTRIBUTED, M3 Ultra 20P+8E).
- :func:`parse_proc_cpuinfo` -- Linux ``/proc/cpuinfo``.
"""

from __future__ import annotations

import json
import platform as _platform
import re
import sys
from dataclasses import dataclass

from .common import ProbeParseError, excerpt, parse_int, read_probe_file, require_text, run_probe

_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


@dataclass(frozen=True)
class MacHardware:
    """SPHardwareDataType, JSON or text. ``memory_bytes`` in bytes (binary GB)."""

    model_name: str | None = None  # "Mac Studio"
    model_identifier: str | None = None  # "Mac14,14"
    chip: str | None = None  # "Apple M2 Ultra" (Intel: processor name)
    memory_bytes: int | None = None
    cpu_count: int | None = None
    performance_cores: int | None = None
    efficiency_cores: int | None = None
    model_number: str | None = None
    number_processors: str | None = None  # raw, e.g. "proc 24:16:8:0"


@dataclass(frozen=True)
class SysctlHwValues:
    """``sysctl -n hw.memsize hw.ncpu machdep.cpu.brand_string``."""

    memsize_bytes: int
    ncpu: int
    brand_string: str


@dataclass(frozen=True)
class PerfLevel:
    """One ``hw.perflevelN`` CPU cluster. Cache sizes in bytes."""

    index: int
    name: str | None = None
    physicalcpu: int | None = None
    logicalcpu: int | None = None
    l1icachesize: int | None = None
    l1dcachesize: int | None = None
    l2cachesize: int | None = None
    cpusperl2: int | None = None


@dataclass(frozen=True)
class SysctlValues:
    """``sysctl`` "key: value" output; the well-known keys pulled out."""

    brand_string: str | None = None
    memsize_bytes: int | None = None
    ncpu: int | None = None
    physicalcpu: int | None = None
    perflevels: tuple[PerfLevel, ...] = ()
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class LinuxCpu:
    """``/proc/cpuinfo``: ``logical_cpus`` = number of ``processor`` entries;
    ``physical_cores`` = distinct (physical id, core id) pairs, when present."""

    model_name: str | None
    vendor_id: str | None
    logical_cpus: int
    physical_cores: int | None = None
    hardware_model: str | None = None  # ARM boards: "Model : Raspberry Pi 4 ..."


@dataclass(frozen=True)
class MachineInfo:
    """The OS-neutral summary the daemon advertises."""

    os: str  # sys.platform: "darwin", "linux"
    arch: str  # platform.machine(): "arm64", "x86_64"
    chip: str | None = None
    model_name: str | None = None
    model_identifier: str | None = None
    cpu_count: int | None = None
    performance_cores: int | None = None
    efficiency_cores: int | None = None
    memory_bytes: int | None = None


def _size_to_bytes(text: str) -> int | None:
    m = re.match(r"^\s*(\d{1,9})\s*(KB|MB|GB|TB)\s*$", text)
    return int(m.group(1)) * _UNITS[m.group(2)] if m else None


def _proc_counts(raw: str) -> tuple[int | None, int | None, int | None]:
    """ "proc 24:16:8:0" -> (24, 16, 8)."""
    m = re.match(r"^proc (\d{1,6}):(\d{1,6}):(\d{1,6})(?::\d{1,6})*$", raw.strip())
    if not m:
        return None, None, None
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _str(d: dict, key: str) -> str | None:
    v = d.get(key)
    return v if isinstance(v, str) else None


def parse_sphardware_json(text: str) -> MacHardware:
    """``system_profiler SPHardwareDataType -json`` -> :class:`MacHardware`."""
    text = require_text(text, "SPHardwareDataType")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProbeParseError(f"SPHardwareDataType: not JSON ({type(e).__name__})") from None
    items = doc.get("SPHardwareDataType") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items or not isinstance(items[0], dict):
        raise ProbeParseError("SPHardwareDataType: no hardware_overview item")
    d = items[0]
    chip = _str(d, "chip_type") or _str(d, "cpu_type")
    mem = _str(d, "physical_memory")
    nproc = d.get("number_processors")
    total = perf = eff = None
    raw_nproc = None
    if isinstance(nproc, str):
        raw_nproc = nproc
        total, perf, eff = _proc_counts(nproc)
    elif isinstance(nproc, int) and not isinstance(nproc, bool) and 0 < nproc < 1 << 20:  # Intel: a count
        total = nproc
    hw = MacHardware(
        model_name=_str(d, "machine_name"),
        model_identifier=_str(d, "machine_model"),
        chip=chip,
        memory_bytes=_size_to_bytes(mem) if mem else None,
        cpu_count=total,
        performance_cores=perf,
        efficiency_cores=eff,
        model_number=_str(d, "model_number"),
        number_processors=raw_nproc,
    )
    if hw.model_name is None and hw.model_identifier is None and hw.chip is None:
        raise ProbeParseError("SPHardwareDataType: no model or chip")
    return hw


_NOISE_RE = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d+ \S+\[\d+:\d+\] ")
_CORES_RE = re.compile(r"^(\d{1,6})(?:\s*\((\d{1,6}) [Pp]erformance and (\d{1,6}) [Ee]fficiency\))?")


def parse_sphardware_text(text: str) -> MacHardware:
    """Plain (possibly grepped) ``system_profiler SPHardwareDataType``; stderr log lines skipped.

    The first occurrence of each label wins, as in exo's parser.
    """
    text = require_text(text, "SPHardwareDataType text")
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if _NOISE_RE.match(line):
            continue
        key, sep, value = line.strip().partition(": ")
        if sep and value.strip():
            fields.setdefault(key.strip(), value.strip())
    total = perf = eff = None
    cores = fields.get("Total Number of Cores")
    if cores and (m := _CORES_RE.match(cores)):
        total = int(m.group(1))
        if m.group(2):
            perf, eff = int(m.group(2)), int(m.group(3))
    mem = fields.get("Memory")
    hw = MacHardware(
        model_name=fields.get("Model Name"),
        model_identifier=fields.get("Model Identifier"),
        chip=fields.get("Chip") or fields.get("Processor Name"),
        memory_bytes=_size_to_bytes(mem) if mem else None,
        cpu_count=total,
        performance_cores=perf,
        efficiency_cores=eff,
        model_number=fields.get("Model Number"),
    )
    if hw.model_name is None and hw.model_identifier is None and hw.chip is None:
        raise ProbeParseError("SPHardwareDataType text: no Model Name, Model Identifier or Chip line")
    return hw


def parse_sysctl_hw_values(text: str) -> SysctlHwValues:
    """``sysctl -n hw.memsize hw.ncpu machdep.cpu.brand_string``: three lines, in that order."""
    text = require_text(text, "sysctl -n hw.memsize hw.ncpu machdep.cpu.brand_string")
    lines = [ln.strip() for ln in text.strip().splitlines()]
    if len(lines) != 3 or not lines[2]:
        raise ProbeParseError(f"sysctl -n: expected 3 lines, got {excerpt(text)}")
    mem = parse_int(lines[0], "hw.memsize")
    ncpu = parse_int(lines[1], "hw.ncpu")
    if mem <= 0 or ncpu <= 0:
        raise ProbeParseError("sysctl -n: hw.memsize and hw.ncpu must be positive")
    return SysctlHwValues(memsize_bytes=mem, ncpu=ncpu, brand_string=lines[2])


_SYSCTL_LINE_RE = re.compile(r"^([A-Za-z0-9_.]+)\s*[:=]\s?(.*)$")
_PERF_KEY_RE = re.compile(r"^hw\.perflevel(\d{1,2})\.([a-z0-9_]+)$")
_PERF_INT_FIELDS = ("physicalcpu", "logicalcpu", "l1icachesize", "l1dcachesize", "l2cachesize", "cpusperl2")


def parse_sysctl(text: str) -> SysctlValues:
    """``sysctl key...`` output ("key: value" per line), e.g. ``sysctl hw``."""
    text = require_text(text, "sysctl")
    values: dict[str, str] = {}
    for line in text.splitlines():
        m = _SYSCTL_LINE_RE.match(line.strip())
        if m:
            values.setdefault(m.group(1), m.group(2).strip())
    if not values:
        raise ProbeParseError(f"sysctl: no 'key: value' lines in {excerpt(text)}")

    def opt_int(key: str) -> int | None:
        v = values.get(key)
        if v is None:
            return None
        return parse_int(v, key)

    levels: dict[int, dict[str, int | str]] = {}
    for k, v in values.items():
        m = _PERF_KEY_RE.match(k)
        if not m:
            continue
        idx, field = int(m.group(1)), m.group(2)
        if field == "name":
            levels.setdefault(idx, {})["name"] = v
        elif field in _PERF_INT_FIELDS:
            levels.setdefault(idx, {})[field] = parse_int(v, k)
    perflevels = tuple(PerfLevel(index=i, **levels[i]) for i in sorted(levels))  # type: ignore[arg-type]
    return SysctlValues(
        brand_string=values.get("machdep.cpu.brand_string"),
        memsize_bytes=opt_int("hw.memsize"),
        ncpu=opt_int("hw.ncpu"),
        physicalcpu=opt_int("hw.physicalcpu"),
        perflevels=perflevels,
        keys=tuple(values),
    )


def parse_proc_cpuinfo(text: str) -> LinuxCpu:
    """Linux ``/proc/cpuinfo`` ("key<TAB>: value", blank line between processors)."""
    text = require_text(text, "/proc/cpuinfo")
    logical = 0
    first: dict[str, str] = {}
    cores: set[tuple[str, str]] = set()
    cur: dict[str, str] = {}

    def flush() -> None:
        if "physical id" in cur and "core id" in cur:
            cores.add((cur["physical id"], cur["core id"]))

    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            flush()
            cur = {}
            logical += 1
        cur[key] = value
        first.setdefault(key, value)
    flush()
    if logical == 0:
        raise ProbeParseError("/proc/cpuinfo: no 'processor' entries")
    return LinuxCpu(
        model_name=first.get("model name") or None,
        vendor_id=first.get("vendor_id") or None,
        logical_cpus=logical,
        physical_cores=len(cores) or None,
        hardware_model=first.get("Model") or first.get("Hardware") or None,
    )


def probe_machine(platform: str | None = None) -> MachineInfo:
    """Probe this machine with the OS's own tools; fields the tools did not give stay ``None``."""
    platform = platform or sys.platform
    arch = _platform.machine()
    if platform == "darwin":
        hw = run_probe(["system_profiler", "SPHardwareDataType", "-json"], parse_sphardware_json, timeout=20.0)
        sc = run_probe(["sysctl", "hw", "machdep.cpu.brand_string"], parse_sysctl, timeout=5.0)
        perf = eff = None
        if sc and len(sc.perflevels) >= 2:
            perf, eff = sc.perflevels[0].physicalcpu, sc.perflevels[1].physicalcpu
        return MachineInfo(
            os=platform,
            arch=arch,
            chip=(hw.chip if hw else None) or (sc.brand_string if sc else None),
            model_name=hw.model_name if hw else None,
            model_identifier=hw.model_identifier if hw else None,
            cpu_count=(sc.ncpu if sc else None) or (hw.cpu_count if hw else None),
            performance_cores=(hw.performance_cores if hw else None) or perf,
            efficiency_cores=(hw.efficiency_cores if hw else None) or eff,
            memory_bytes=(sc.memsize_bytes if sc else None) or (hw.memory_bytes if hw else None),
        )
    import os

    import psutil

    cpu = read_probe_file("/proc/cpuinfo", parse_proc_cpuinfo) if platform.startswith("linux") else None
    return MachineInfo(
        os=platform,
        arch=arch,
        chip=(cpu.model_name if cpu else None) or _platform.processor() or None,
        model_name=cpu.hardware_model if cpu else None,
        cpu_count=(cpu.logical_cpus if cpu else None) or os.cpu_count(),
        memory_bytes=int(psutil.virtual_memory().total),
    )
