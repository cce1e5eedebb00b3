"""Memory probe: how many bytes this node can give to model weights and KV cache.

Sources:
- total/available: ``psutil.virtual_memory()`` (bytes).
- macOS GPU wired limit: ``sysctl iogpu.wired_limit_mb`` (0 = not set, the
  default). The unit is MiB (2**20 bytes): mlx-lm's wired-limit warning
  (mlx_lm/generate.py ``wired_limit``) divides byte counts by ``2**20`` when it
  tells users which ``iogpu.wired_limit_mb`` to set.
- MLX ``mx.device_info()`` (older mlx: ``mx.metal.device_info()``, which
  mlx 0.32 still has but marks deprecated): keys ``device_name, architecture, max_buffer_length,
  max_recommended_working_set_size, memory_size (= sysctl hw.memsize),
  resource_limit`` (mlx/backend/metal/device_info.cpp, SOURCES.md "How mlx and
  exo parse"). The old 3-key format (mlx PR #1060) has only
  ``max_recommended_working_set_size, max_buffer_length, architecture``. The CPU
  build on Linux returns only ``architecture`` and ``device_name``.

Usable-memory rule (:func:`usable_memory_bytes`), in order:
1. ``iogpu.wired_limit_mb`` > 0 -> that many MiB (the user raised or lowered
   the GPU wired limit on purpose);
2. else ``max_recommended_working_set_size`` -> Metal's recommendation (what
   mlx-lm wires by default);
3. else 80 % of total RAM (no GPU working-set limit known: Linux, CPU MLX),
   leaving room for the OS, page cache and the daemon.
Always capped at total RAM. ``available`` is deliberately not used: it drops as
the daemon itself loads weights, so a plan based on it would shrink itself.

Then the daemon's own memory cgroup (Linux, :mod:`.cgroup_memory`), when it binds lower
(:func:`usable_with_cgroup`): 80 % of its lowest limit (the same margin as for the host's
RAM), less what the limit holds besides the model: the daemon's own runtime (its anonymous
memory at the first probe, before any weights: Python, MLX, gRPC, a few hundred MB that a
small limit feels where 20 % of a host's RAM absorbs it; plus :data:`SERVING_RUNTIME_BYTES`,
what it grows by once it serves) and what the cgroup's other
processes hold without page cache (its use without page cache less this process's own
anonymous memory now, so the daemon's own weights never shrink the figure). ``--memory-limit``
(applied by the runner) can only lower the result. ``usable_source`` says, in words, which
rule set the figure.
"""

from __future__ import annotations

import ast
import logging
import re
import sys
import warnings
from dataclasses import dataclass, replace
from typing import Any

import psutil

from .cgroup_memory import CgroupMemory, read_cgroup_memory
from .common import ProbeParseError, excerpt, parse_int, require_text, run_probe

log = logging.getLogger("ringlet.daemon.probes")

MIB = 1 << 20
#: Fraction of total RAM considered usable when no GPU limit is known.
DEFAULT_USABLE_FRACTION = 0.8
#: Fraction of a cgroup's memory limit considered usable (the same margin).
CGROUP_USABLE_FRACTION = 0.8
#: What the daemon's own memory grows by once it serves, beyond its stores and the
#: activations it plans for: gRPC and HTTP buffers, the threads' malloc arenas, modules
#: imported at the first request. Measured in a memory cgroup (x86-64 Linux, a 1,024-wide
#: llama at a 256-token context): 23-25 MB between the first probe and a request that
#: fills the context, beyond MLX's own peak.
SERVING_RUNTIME_BYTES = 32 * MIB


@dataclass(frozen=True)
class DeviceInfo:
    """``mx.device_info()`` as parsed. Sizes in bytes; any key may be missing (``None``)."""

    device_name: str | None = None
    architecture: str | None = None
    max_recommended_working_set_size: int | None = None
    memory_size: int | None = None
    max_buffer_length: int | None = None
    resource_limit: int | None = None


@dataclass(frozen=True)
class WiredLimit:
    """``sysctl iogpu.wired_limit_mb``: ``mib`` as printed, 0 = default (not set)."""

    mib: int

    @property
    def bytes(self) -> int | None:
        """The limit in bytes (MiB * 2**20), or ``None`` when not set (0)."""
        return self.mib * MIB if self.mib > 0 else None


@dataclass(frozen=True)
class MemoryInfo:
    """What the daemon advertises about memory (all bytes).

    ``usable_memory_bytes`` follows the rule in the module docstring;
    ``usable_rule`` names the branch taken, ``usable_source`` says it for people (with the
    figures); ``cgroup_limit_bytes`` is the cgroup's lowest limit (``None``: none or not
    Linux), ``cgroup_others_bytes`` what the cgroup's other processes hold and
    ``runtime_bytes`` the daemon's own memory at the first probe, before any model (counted
    against a cgroup's limit, which holds it too).
    """

    total_bytes: int
    available_bytes: int
    usable_memory_bytes: int
    usable_rule: str
    wired_limit_bytes: int | None = None
    max_recommended_working_set_bytes: int | None = None
    device_memory_bytes: int | None = None
    device_name: str | None = None
    architecture: str | None = None
    usable_source: str = ""
    cgroup_limit_bytes: int | None = None
    cgroup_others_bytes: int | None = None
    runtime_bytes: int | None = None


_INT_KEYS = ("max_recommended_working_set_size", "memory_size", "max_buffer_length", "resource_limit")
_STR_KEYS = ("device_name", "architecture")


def device_info_from_mapping(d: Any) -> DeviceInfo:
    """Validate a ``device_info`` dict; ignore unknown keys; wrong types -> ProbeParseError."""
    if not isinstance(d, dict):
        raise ProbeParseError("device_info: not a dict")
    kw: dict[str, Any] = {}
    for k in _INT_KEYS:
        v = d.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ProbeParseError(f"device_info: {k} is not a non-negative integer: {excerpt(repr(v))}")
        kw[k] = v
    for k in _STR_KEYS:
        v = d.get(k)
        if v is None:
            continue
        if not isinstance(v, str):
            raise ProbeParseError(f"device_info: {k} is not a string")
        kw[k] = v
    if not kw:
        raise ProbeParseError("device_info: none of the known keys")
    return DeviceInfo(**kw)


def parse_device_info(text: str) -> DeviceInfo:
    """Parse a printed ``mx.device_info()`` dict (Python repr), optionally after ``NAME =``.

    Accepts both fixtures: the 3-key ``{'max_recommended_working_set_size': ...}``
    (mlx PR #1060) and the 6-key pasted ``DEVICE_INFO = {...}`` (ember-ml).
    Uses ``ast.literal_eval`` (no code runs).
    """
    text = require_text(text, "device_info")
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ProbeParseError("device_info: no {...} dict")
    try:
        with warnings.catch_warnings():  # junk escapes ("\\p") warn while compiling
            warnings.simplefilter("ignore")
            value = ast.literal_eval(text[start : end + 1])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ProbeParseError(f"device_info: not a Python dict literal ({type(e).__name__})") from None
    return device_info_from_mapping(value)


_SYSCTL_WIRED_RE = re.compile(r"^\s*(?:iogpu\.wired_limit_mb\s*[:=]\s*)?(\d+)\s*$")


def parse_sysctl_wired_limit(text: str) -> WiredLimit:
    """``sysctl iogpu.wired_limit_mb`` ("iogpu.wired_limit_mb: 0") or with ``-n`` ("0")."""
    text = require_text(text, "iogpu.wired_limit_mb")
    m = _SYSCTL_WIRED_RE.match(text.strip())
    if not m:
        raise ProbeParseError(f"iogpu.wired_limit_mb: unexpected output {excerpt(text)}")
    return WiredLimit(parse_int(m.group(1), "iogpu.wired_limit_mb"))


def usable_memory_bytes(
    total_bytes: int, wired_limit_bytes: int | None, max_recommended_working_set_bytes: int | None
) -> tuple[int, str]:
    """Apply the usable-memory rule (module docstring). Returns ``(bytes, rule name)``."""
    if wired_limit_bytes:
        return min(wired_limit_bytes, total_bytes), "iogpu.wired_limit_mb"
    if max_recommended_working_set_bytes:
        return min(max_recommended_working_set_bytes, total_bytes), "max_recommended_working_set_size"
    return int(total_bytes * DEFAULT_USABLE_FRACTION), f"{DEFAULT_USABLE_FRACTION:.0%} of total"


def size_text(n: float) -> str:
    """Bytes in binary units, as ``ringlet status`` and ``doctor`` print them (``ops.format.fmt_bytes``):
    ``3.2 GiB``, ``85.3 MiB``, ``287 MiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 100 else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def host_source(total_bytes: int, usable: int, rule: str) -> str:
    """The host rule's figure in words, e.g. ``80% of total RAM (25.28 GB): 20.22 GB``."""
    if rule == "iogpu.wired_limit_mb":
        return f"iogpu.wired_limit_mb (GPU wired limit): {size_text(usable)}"
    if rule == "max_recommended_working_set_size":
        return f"Metal's recommended working set: {size_text(usable)}"
    return f"{rule} RAM ({size_text(total_bytes)}): {size_text(usable)}"


def usable_with_cgroup(host_usable: int, host_text: str, cgroup: CgroupMemory | None, own_bytes: int,
                       runtime_bytes: int | None = None) -> tuple[int, str, int | None]:
    """The lower of the host rule and the cgroup rule (module docstring).

    Args:
        host_usable: the host rule's bytes (:func:`usable_memory_bytes`).
        host_text: the host rule in words (:func:`host_source`).
        cgroup: this process's cgroup (:func:`~.cgroup_memory.read_cgroup_memory`), or ``None``.
        own_bytes: this process's own anonymous memory now (RSS less file-backed and shared), bytes.
        runtime_bytes: the daemon's runtime, which the cgroup's limit also holds (its own
            anonymous memory before it held any model, plus :data:`SERVING_RUNTIME_BYTES`),
            bytes; ``None``: ``own_bytes`` (the first probe, taken as it is).

    Returns:
        ``(usable bytes, which rule set it in words, bytes the cgroup's other processes hold
        or None)``.
    """
    if cgroup is None or cgroup.limit_bytes is None:
        return host_usable, host_text, None
    runtime = own_bytes if runtime_bytes is None else runtime_bytes
    others = max(0, cgroup.used_bytes - own_bytes) if cgroup.used_bytes is not None else 0
    usable = max(0, int(cgroup.limit_bytes * CGROUP_USABLE_FRACTION) - others - runtime)
    if usable >= host_usable:
        return host_usable, host_text, others
    text = f"{cgroup.describe()}: {CGROUP_USABLE_FRACTION:.0%} of {size_text(cgroup.limit_bytes)}"
    if others + runtime >= MIB:
        text += f" less {size_text(runtime)} the daemon's runtime"
        text += f" and {size_text(others)} its other processes hold" if others >= MIB else ""
    return usable, f"{text}: {size_text(usable)}", others


def own_anonymous_bytes() -> int:
    """This process's resident memory that is not file-backed or shared (Linux: RSS less
    ``shared``, i.e. RssAnon), bytes; 0 when psutil cannot tell."""
    try:
        info = psutil.Process().memory_info()
    except psutil.Error:
        return 0
    return max(0, int(info.rss) - int(getattr(info, "shared", 0)))


def mlx_device_info() -> DeviceInfo | None:
    """``mx.device_info()`` (older mlx: ``mx.metal.device_info()``); ``None`` + one log line."""
    try:
        import mlx.core as mx

        fn = getattr(mx, "device_info", None)
        if fn is None:  # older mlx
            fn = mx.metal.device_info
        return device_info_from_mapping(dict(fn()))
    except Exception as e:  # no mlx, no Metal, odd dict: the daemon keeps running
        log.warning("probe mx.device_info: unavailable (%s): %s", type(e).__name__, excerpt(str(e)))
        return None


def probe_memory(platform: str | None = None) -> MemoryInfo:
    """Measure memory now. On macOS also the wired limit and Metal's working set; on Linux
    also this process's cgroup (:func:`with_cgroup`)."""
    platform = platform or sys.platform
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    wired: int | None = None
    if platform == "darwin":
        wl = run_probe(["sysctl", "iogpu.wired_limit_mb"], parse_sysctl_wired_limit, timeout=5.0)
        wired = wl.bytes if wl else None
    info = mlx_device_info()
    max_rec = info.max_recommended_working_set_size if info else None
    usable, rule = usable_memory_bytes(total, wired, max_rec)
    host = MemoryInfo(
        total_bytes=total,
        available_bytes=available,
        usable_memory_bytes=usable,
        usable_rule=rule,
        wired_limit_bytes=wired,
        max_recommended_working_set_bytes=max_rec,
        device_memory_bytes=info.memory_size if info else None,
        device_name=info.device_name if info else None,
        architecture=info.architecture if info else None,
        usable_source=host_source(total, usable, rule),
    )
    return with_cgroup(host) if platform.startswith("linux") else host


def with_cgroup(memory: MemoryInfo, cgroup_root: str = "/") -> MemoryInfo:
    """``memory`` with the cgroup rule applied anew (the cgroup files are read now: a limit
    may change while the daemon runs; cheap, a few small files). The host rule is recomputed
    from ``memory``'s own figures, and the daemon's runtime is the one ``memory`` holds (the
    first call measures it: this process's anonymous memory then, plus
    :data:`SERVING_RUNTIME_BYTES`), so calling this again on its result is the same as on
    the first probe's. Never raises."""
    usable, rule = usable_memory_bytes(memory.total_bytes, memory.wired_limit_bytes,
                                       memory.max_recommended_working_set_bytes)
    cgroup = read_cgroup_memory(cgroup_root)
    own = own_anonymous_bytes() if cgroup is not None else 0
    runtime = memory.runtime_bytes
    if runtime is None and cgroup is not None:
        runtime = own + SERVING_RUNTIME_BYTES
    usable, source, others = usable_with_cgroup(usable, host_source(memory.total_bytes, usable, rule), cgroup, own,
                                                runtime)
    if source.startswith("cgroup") and cgroup is not None:
        rule = f"cgroup v{cgroup.version} {cgroup.limit_file}"
    return replace(memory, usable_memory_bytes=usable, usable_rule=rule, usable_source=source,
                   cgroup_limit_bytes=cgroup.limit_bytes if cgroup is not None else None, cgroup_others_bytes=others,
                   runtime_bytes=runtime)
