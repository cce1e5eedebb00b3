"""The memory limit of this process's own cgroup, and what the cgroup uses without page cache.

Where the daemon runs under Docker ``--memory``, systemd ``MemoryMax=``/``MemoryHigh=``,
a Kubernetes limit or a hand-made cgroup, that limit binds long before the host's RAM
does: the kernel reclaims, then OOM-kills, at the cgroup's limit.

How the cgroup is found (the kernel's documented formats, man 7 cgroups and
Documentation/filesystems/proc.rst; the fixtures are in tests/fixtures/linux/cgroup):

- ``/proc/self/cgroup``: one line per hierarchy, ``hierarchy-ID:controller-list:cgroup-path``.
  cgroup v1: ``4:memory:/docker/<id>``; cgroup v2: one line ``0::/system.slice/x.service``.
  A v1 line naming ``memory`` wins over the v2 line (a hybrid host, as systemd sets up with
  ``/sys/fs/cgroup/unified``, keeps the memory controller on v1).
- ``/proc/self/mountinfo``: ``id parent major:minor root mount-point options [optional...] -
  fstype source super-options``. A cgroup hierarchy is mounted with fstype ``cgroup`` (v1, the
  controllers in the super options: ``rw,memory``) or ``cgroup2``. ``root`` is the cgroup the
  mount shows at its mount point: ``/`` on a host and inside a container's cgroup namespace
  (where the cgroup path also reads ``/``), ``/docker/<id>`` in a v1 container without one.
  The cgroup's directory is ``mount-point + (cgroup-path - root)``; its parents are walked up
  to the mount point (a parent's limit binds its children too); ancestors above the mount
  are not visible (v1 still reports their effect: ``hierarchical_memory_limit``).

Limits, the lowest wins (``None`` = no limit):

- v2: ``memory.max`` (the hard limit: OOM beyond it) and ``memory.high`` (the throttle: the
  kernel reclaims hard above it), each ``max`` or bytes; the root cgroup has neither file.
- v1: ``memory.limit_in_bytes``, and ``hierarchical_memory_limit`` in ``memory.stat`` (the
  lowest limit of the cgroup and all its ancestors, visible or not). "Unlimited" reads
  ``PAGE_COUNTER_MAX * PAGE_SIZE`` (9223372036854771712 with 4 KiB pages, ~2**63): any value
  of at least :data:`UNLIMITED_BYTES` (1 EiB) is taken as no limit. Written limits are
  rounded down to a page (300000000 reads back 299999232).

Use without page cache (what the cgroup's processes hold; the kernel reclaims the cache
first when the cgroup nears its limit, so counting it as used would shrink the figure for
nothing, the error ollama #15474 made): v2 ``memory.current`` less ``file`` (page cache,
which includes tmpfs/shmem) plus ``shmem`` (which cannot be dropped); v1
``memory.usage_in_bytes`` less ``total_cache`` plus ``total_shmem``. Where those keys are
missing, the kernel's ``inactive_file`` (``total_inactive_file``) is taken off instead (the
"working set" docker stats and the kubelet report).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .common import ProbeParseError, excerpt, parse_int, require_text

log = logging.getLogger("ringlet.daemon.probes")

#: Limits of at least this many bytes (1 EiB) mean "no limit" (v1's unlimited is ~2**63).
UNLIMITED_BYTES = 1 << 60

__all__ = ["UNLIMITED_BYTES", "CgroupLine", "CgroupLocation", "CgroupMemory", "CgroupMount", "locate",
           "memory_of", "parse_limit", "parse_memory_stat", "parse_mountinfo", "parse_proc_cgroup",
           "read_cgroup_memory", "used_without_cache"]


@dataclass(frozen=True)
class CgroupLine:
    """One line of ``/proc/<pid>/cgroup``: ``hierarchy`` id, its ``controllers`` (empty for
    v2's ``0::`` line; ``name=systemd`` kept as written) and the cgroup ``path``."""

    hierarchy: int
    controllers: tuple[str, ...]
    path: str


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup filesystem in ``/proc/<pid>/mountinfo``: ``fstype`` ``cgroup`` (v1) or
    ``cgroup2``, the cgroup ``root`` it shows at ``mount_point``, and its super options
    (v1: the controllers, e.g. ``("rw", "memory")``)."""

    fstype: str
    root: str
    mount_point: str
    super_options: tuple[str, ...]


@dataclass(frozen=True)
class CgroupLocation:
    """Where this process's memory cgroup is: ``version`` 1 or 2, its ``path`` as
    ``/proc/self/cgroup`` gives it, and ``directories``: its own directory first, then each
    visible parent up to the mount point (absolute paths on this machine)."""

    version: int
    path: str
    directories: tuple[str, ...]


@dataclass(frozen=True)
class CgroupMemory:
    """This process's cgroup memory, bytes.

    Attributes:
        version: 1 or 2.
        path: the cgroup path (``/proc/self/cgroup``).
        directory: the cgroup's own directory.
        limit_bytes: the lowest limit that binds it, or ``None`` (no limit anywhere visible).
        limit_file: the file that set ``limit_bytes`` (e.g. ``memory.high``,
            ``memory.limit_in_bytes``, ``memory.stat hierarchical_memory_limit``), else ``None``.
        limit_directory: the cgroup directory of ``limit_file`` (a parent's limit binds too).
        used_bytes: what the limiting cgroup (else its own) holds without page cache, or
            ``None`` when unreadable.
        page_cache_bytes: the page cache left out of ``used_bytes`` (``None``: unknown).
    """

    version: int
    path: str
    directory: str
    limit_bytes: int | None = None
    limit_file: str | None = None
    limit_directory: str | None = None
    used_bytes: int | None = None
    page_cache_bytes: int | None = None

    def describe(self) -> str:
        """Which rule set the limit, e.g. ``cgroup v1 memory.limit_in_bytes (/sys/fs/cgroup/memory/a)``."""
        return f"cgroup v{self.version} {self.limit_file or 'no limit'} ({self.limit_directory or self.directory})"


def parse_proc_cgroup(text: str) -> tuple[CgroupLine, ...]:
    """Parse ``/proc/<pid>/cgroup`` (``ID:controllers:path`` per line; the path may hold colons).

    Raises:
        ProbeParseError: empty input or a line without two colons or a numeric id.
    """
    lines = []
    for raw in require_text(text, "/proc/self/cgroup").splitlines():
        if not raw.strip():
            continue
        parts = raw.split(":", 2)
        if len(parts) != 3:
            raise ProbeParseError(f"/proc/self/cgroup: not ID:controllers:path: {excerpt(raw)}")
        controllers = tuple(c for c in parts[1].split(",") if c)
        lines.append(CgroupLine(parse_int(parts[0], "/proc/self/cgroup hierarchy id"), controllers, parts[2]))
    return tuple(lines)


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as ``\\ooo`` octal."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> tuple[CgroupMount, ...]:
    """The ``cgroup`` and ``cgroup2`` mounts of ``/proc/<pid>/mountinfo``; other lines are skipped.

    Raises:
        ProbeParseError: empty input, or a cgroup line without the ``-`` separator's fields.
    """
    mounts = []
    for raw in require_text(text, "/proc/self/mountinfo").splitlines():
        fields = raw.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3 or fields[sep + 1] not in ("cgroup", "cgroup2"):
            continue
        options = tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else ()
        mounts.append(CgroupMount(fields[sep + 1], _unescape(fields[3]), _unescape(fields[4]), options))
    return tuple(mounts)


def _under(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` (``""`` when equal), or ``None`` when it is not under it."""
    if root in ("", "/"):
        return path.strip("/")
    root = root.rstrip("/")
    if path == root:
        return ""
    return path[len(root) + 1:].strip("/") if path.startswith(root + "/") else None


def locate(proc_cgroup: str, mountinfo: str) -> CgroupLocation | None:
    """This process's memory cgroup from the texts of ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo``; ``None`` when no memory cgroup is mounted.

    A cgroup path outside every mount's root (a process whose cgroup lies outside its
    namespace's view) maps to the mount point itself.

    Raises:
        ProbeParseError: either text cannot be parsed.
    """
    lines, mounts = parse_proc_cgroup(proc_cgroup), parse_mountinfo(mountinfo)
    candidates = [(1, ln, [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options])
                  for ln in lines if "memory" in ln.controllers]
    candidates += [(2, ln, [m for m in mounts if m.fstype == "cgroup2"])
                   for ln in lines if ln.hierarchy == 0 and not ln.controllers]
    for version, line, found in candidates:
        if not found:
            continue
        matches = [(m, rel) for m in found if (rel := _under(line.path, m.root)) is not None]
        mount, rel = max(matches, key=lambda mr: len(mr[0].root)) if matches else (found[0], "")
        top = PurePosixPath(mount.mount_point)
        parts = PurePosixPath(rel).parts if rel else ()
        dirs = [str(top.joinpath(*parts[:k])) for k in range(len(parts), -1, -1)]
        return CgroupLocation(version, line.path, tuple(dirs))
    return None


def parse_limit(text: str, what: str = "memory limit") -> int | None:
    """A limit file's value in bytes: ``max`` (v2) or at least :data:`UNLIMITED_BYTES` -> ``None``.

    Raises:
        ProbeParseError: neither ``max`` nor a non-negative integer.
    """
    value = require_text(text, what).strip()
    if value == "max":
        return None
    n = parse_int(value, what)
    if n < 0:
        raise ProbeParseError(f"{what}: negative: {excerpt(value)}")
    return None if n >= UNLIMITED_BYTES else n


def parse_memory_stat(text: str) -> dict[str, int]:
    """``memory.stat`` (``key value`` per line, bytes or counts) as a dict; odd lines are skipped.

    Raises:
        ProbeParseError: empty input.
    """
    stat = {}
    for raw in require_text(text, "memory.stat").splitlines():
        parts = raw.split()
        if len(parts) == 2 and parts[1].isdigit():
            stat[parts[0]] = int(parts[1])
    return stat


def used_without_cache(version: int, usage: int, stat: dict[str, int]) -> tuple[int, int | None]:
    """``(used bytes without page cache, the page cache taken off)`` from a cgroup's usage
    (v2 ``memory.current``, v1 ``memory.usage_in_bytes``) and its ``memory.stat`` (module
    docstring: file pages less shmem, else inactive file pages)."""
    file_key, shmem_key, inactive_key = (("file", "shmem", "inactive_file") if version == 2 else
                                         ("total_cache", "total_shmem", "total_inactive_file"))
    if file_key not in stat and version == 1:  # a kernel without the hierarchical totals
        file_key, shmem_key, inactive_key = "cache", "shmem", "inactive_file"
    if file_key in stat:
        cache = max(0, stat[file_key] - stat.get(shmem_key, 0))
    elif inactive_key in stat:
        cache = stat[inactive_key]
    else:
        return usage, None
    return max(0, usage - cache), cache


def _read(directory: str, name: str, root: Path) -> str | None:
    """The text of ``directory/name`` under ``root`` (``None`` when missing or unreadable)."""
    try:
        return (root / directory.lstrip("/") / name).read_text()
    except OSError:
        return None


def memory_of(location: CgroupLocation, root: Path = Path("/")) -> CgroupMemory:
    """Read the limits and use of the cgroup at ``location`` (files under ``root``, ``/`` on a
    live machine; a fixture tree in tests). A file that is missing or unparsable is skipped."""
    v, own = location.version, location.directories[0]
    limits: list[tuple[int, str, str]] = []  # (bytes, file, directory)
    names = ("memory.max", "memory.high") if v == 2 else ("memory.limit_in_bytes",)
    for directory in location.directories:
        for name in names:
            text = _read(directory, name, root)
            try:
                value = parse_limit(text, name) if text is not None else None
            except ProbeParseError as exc:
                log.info("cgroup: %s/%s: %s", directory, name, exc)
                continue
            if value is not None:
                limits.append((value, name, directory))
    stat = _stat(own, root)
    hierarchical = stat.get("hierarchical_memory_limit") if v == 1 else None
    if hierarchical is not None and hierarchical < UNLIMITED_BYTES:
        limits.append((hierarchical, "memory.stat hierarchical_memory_limit", own))
    limit = min(limits, key=lambda t: (t[0], t[1] == "memory.stat hierarchical_memory_limit")) if limits else None
    where = limit[2] if limit else own
    usage_text = _read(where, "memory.current" if v == 2 else "memory.usage_in_bytes", root)
    used = cache = None
    if usage_text is not None and usage_text.strip().isdigit():
        used, cache = used_without_cache(v, int(usage_text), stat if where == own else _stat(where, root))
    return CgroupMemory(version=v, path=location.path, directory=own, limit_bytes=limit[0] if limit else None,
                        limit_file=limit[1] if limit else None, limit_directory=limit[2] if limit else None,
                        used_bytes=used, page_cache_bytes=cache)


def _stat(directory: str, root: Path) -> dict[str, int]:
    text = _read(directory, "memory.stat", root)
    try:
        return parse_memory_stat(text) if text is not None else {}
    except ProbeParseError:
        return {}


def read_cgroup_memory(root: Path | str = "/", pid: str = "self") -> CgroupMemory | None:
    """This process's cgroup memory (``root``: where ``/proc`` and ``/sys`` are, ``/`` on a
    live machine); ``None`` where there is no memory cgroup (not Linux, no cgroup mounted).
    Never raises: an unreadable or odd file logs one line and counts as absent."""
    root = Path(root)
    try:
        proc = (root / "proc" / pid / "cgroup").read_text()
        mountinfo = (root / "proc" / pid / "mountinfo").read_text()
    except OSError:
        return None
    try:
        location = locate(proc, mountinfo)
    except ProbeParseError as exc:
        log.warning("cgroup: cannot read this process's cgroup: %s", exc)
        return None
    return memory_of(location, root) if location is not None else None


def cgroup_peak_bytes(root: Path | str = "/") -> int | None:
    """The most this process's own cgroup has held since it was made (or its peak was
    reset), bytes, page cache included: v1 ``memory.max_usage_in_bytes``, v2
    ``memory.peak`` (Linux 5.19 and later; the root cgroup has none). ``None`` outside a
    memory cgroup, at v1's root (whose figure is the whole machine's), or where the kernel
    keeps no peak. Never raises."""
    root = Path(root)
    try:
        location = locate((root / "proc/self/cgroup").read_text(), (root / "proc/self/mountinfo").read_text())
    except (OSError, ProbeParseError):
        return None
    if location is None or (location.version == 1 and location.path in ("", "/")):
        return None
    name = "memory.peak" if location.version == 2 else "memory.max_usage_in_bytes"
    text = _read(location.directories[0], name, root)
    return int(text) if text is not None and text.strip().isdigit() else None
