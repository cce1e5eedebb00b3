"""Shared pieces of the probes: the one error type, the command runner, unit
conversions, the OS-neutral Thunderbolt port record and a JSON round trip for
frozen dataclasses.

Contract of every ``parse_*`` function in this package: it takes the text a
command printed, returns a frozen dataclass, and raises nothing but
:class:`ProbeParseError` (a ``ValueError``) on input it cannot make sense of.
Runners (:func:`run_probe`, :func:`read_probe_file`) turn every failure --
missing binary, non-zero exit, timeout, garbage -- into ``None`` plus exactly
one log line, so the daemon keeps running.

Units: bytes, bytes/s, FLOP/s, seconds. Thunderbolt speeds are printed in
decimal gigabits per second ("80 Gb/s"); 1 Gb/s = 10**9 bit/s = 125_000_000
bytes/s (:func:`gbit_to_bytes_per_s`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import subprocess
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("ringlet.daemon.probes")

T = TypeVar("T")

#: bytes/s in one decimal gigabit per second (10**9 bit/s / 8).
BYTES_PER_S_PER_GBIT = 125_000_000

_UUID_RE = re.compile(r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$")


class ProbeParseError(ValueError):
    """A probe's output could not be parsed (empty, garbage, truncated, wrong shape).

    The only exception a ``parse_*`` function raises.
    """


def gbit_to_bytes_per_s(gbit_per_s: float) -> int:
    """Decimal Gb/s (10**9 bit/s) -> bytes/s: ``80`` -> ``10_000_000_000``."""
    return round(gbit_per_s * BYTES_PER_S_PER_GBIT)


def normalize_uuid(value: object) -> str | None:
    """Upper-case an 8-4-4-4-12 hex UUID; anything else -> ``None``.

    macOS prints domain UUIDs upper case (``domain_uuid_key``), Linux sysfs
    ``unique_id`` prints them lower case (``%pUb``, drivers/thunderbolt/xdomain.c,
    SOURCES.md §5); both are compared in upper case.
    """
    if not isinstance(value, str):
        return None
    v = value.strip()
    if not _UUID_RE.match(v):
        return None
    return v.upper()


def parse_int(text: str, what: str, base: int = 10) -> int:
    """``int(text, base)`` that raises only :class:`ProbeParseError`."""
    t = text.strip()
    if not t or len(t) > 40:
        raise ProbeParseError(f"{what}: not an integer: {excerpt(t)}")
    try:
        return int(t, base)
    except ValueError:
        raise ProbeParseError(f"{what}: not an integer: {excerpt(t)}") from None


def require_text(text: object, what: str) -> str:
    """Reject non-str and blank input (every probe prints something when it works)."""
    if not isinstance(text, str):
        raise ProbeParseError(f"{what}: expected text, got {type(text).__name__}")
    if not text.strip():
        raise ProbeParseError(f"{what}: empty output")
    return text


def excerpt(text: str | bytes, limit: int = 80) -> str:
    """One-line, bounded ``repr`` of some output, for log lines and errors."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    r = repr(text[:limit])
    return r + ("..." if len(text) > limit else "")


# --------------------------------------------------------------------------- runners


def run_probe(
    argv: Sequence[str],
    parser: Callable[[str], T],
    *,
    timeout: float = 10.0,
    name: str | None = None,
) -> T | None:
    """Run ``argv`` (no shell), parse its stdout, or return ``None`` + one log line.

    ``None`` (and exactly one WARNING on logger ``ringlet.daemon.probes``) when
    the binary is missing or not executable, it runs longer than ``timeout``
    seconds (it is killed), it exits non-zero, or ``parser`` rejects the output.
    stdout is decoded as UTF-8 with replacement, so random bytes reach the
    parser as text; stderr is only used for the log line (``system_profiler``
    logs ``hw.cpufamily`` noise there on macOS 26.4, SOURCES.md §3).
    No exception escapes.
    """
    label = name or " ".join(argv)
    try:
        proc = subprocess.run(list(argv), capture_output=True, timeout=timeout, check=False)  # noqa: S603 - probe commands are fixed argv lists, no shell
    except FileNotFoundError:
        log.warning("probe %s: command not found", label)
        return None
    except subprocess.TimeoutExpired:
        log.warning("probe %s: timed out after %.1f s", label, timeout)
        return None
    except (OSError, ValueError) as e:  # PermissionError, bad argv (NUL byte), ...
        log.warning("probe %s: cannot run: %s", label, excerpt(str(e)))
        return None
    if proc.returncode != 0:
        log.warning("probe %s: exit status %d: %s", label, proc.returncode, excerpt(proc.stderr.strip()))
        return None
    return _parse_or_log(label, parser, proc.stdout.decode("utf-8", errors="replace"))


def read_probe_file(path: Path | str, parser: Callable[[str], T], *, name: str | None = None) -> T | None:
    """Read a text file (``/proc/cpuinfo``) and parse it; ``None`` + one log line on failure."""
    label = name or str(path)
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        log.warning("probe %s: cannot read: %s", label, excerpt(str(e)))
        return None
    return _parse_or_log(label, parser, text)


def _parse_or_log(label: str, parser: Callable[[str], T], text: str) -> T | None:
    try:
        return parser(text)
    except ProbeParseError as e:
        log.warning("probe %s: unparsable output (%s): %s", label, excerpt(str(e), 120), excerpt(text))
        return None
    except Exception as e:  # a parser bug must not take the daemon down either
        log.warning("probe %s: parser failed (%s): %s", label, type(e).__name__, excerpt(str(e), 120))
        return None


# --------------------------------------------------------------------------- Thunderbolt


@dataclass(frozen=True)
class ThunderboltPort:
    """One local Thunderbolt port and what is cabled to it, on either OS.

    This is what :func:`ringlet.daemon.probes.links.match_links` consumes.

    - ``port_id``: macOS ``receptacle_1_tag.receptacle_id_key`` ("1"..."6"; the
      plain-text "Receptacle:"), Linux the XDomain device name ("0-3"). ``None``
      if the output did not say (truncated text).
    - ``interface``: the network interface of that port: macOS the device of
      hardware port "Thunderbolt <port_id>" in ``networksetup
      -listallhardwareports`` (joined by name, never by position: the M4/M5 Max
      MBP maps Thunderbolt 1/2/3 to en1/en6/en2, SOURCES.md gotchas); Linux
      the ``thunderbolt-net`` netdev ("thunderbolt0").
    - ``own_domain_uuid`` / ``peer_domain_uuid``: upper-case UUIDs; a link exists
      when A.own == B.peer and B.own == A.peer (SOURCES.md "Link graph").
    - ``link_speed_bytes_per_s``: live link speed ("80 Gb/s" -> 10_000_000_000);
      ``None`` when the port is idle ("Up to 120 Gb/s") or the speed is unknown.
    - ``max_speed_bytes_per_s``: the idle capability ("Up to 120 Gb/s" -> 15e9).
    - ``peer_rdma``: the *peer* advertises the RDMA XDomain service
      (``unknown_xd_service`` with ``protocol_id_key`` 64087; plain text
      ``Service Key: rdma``). Always False on Linux.
    - ``peer_name`` / ``peer_model``: e.g. "Mac Studio" / "Mac15,14".
    - ``via``: names of devices between the port and the peer (a dock).
    - ``devices``: every device name found below the port, depth first.
    - ``source``: which parser produced it.
    """

    port_id: str | None
    interface: str | None
    own_domain_uuid: str | None
    peer_domain_uuid: str | None
    link_speed_bytes_per_s: int | None
    max_speed_bytes_per_s: int | None = None
    speed_text: str | None = None
    peer_rdma: bool = False
    peer_name: str | None = None
    peer_model: str | None = None
    via: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    bus_name: str | None = None
    source: str = ""

    @property
    def connected(self) -> bool:
        """A live link (a speed without "Up to") -- to a host or to any device."""
        return self.link_speed_bytes_per_s is not None


_SPEED_RE = re.compile(r"^(Up to )?(\d{1,6}(?:\.\d{1,6})?) Gb/s$")


def parse_tb_speed(text: str | None) -> tuple[int | None, int | None]:
    """``current_speed_key`` -> ``(live bytes/s, idle capability bytes/s)``.

    "80 Gb/s" -> (10_000_000_000, None): a live link. "Up to 120 Gb/s" ->
    (None, 15_000_000_000): an idle port (``link_status_key`` 0x100).
    Unknown text -> (None, None). Source: SOURCES.md gotchas; exo reads the
    same key as ``ThunderboltIdentifier.link_speed``.
    """
    if not isinstance(text, str):
        return None, None
    m = _SPEED_RE.match(text.strip())
    if not m:
        return None, None
    b = gbit_to_bytes_per_s(float(m.group(2)))
    return (None, b) if m.group(1) else (b, None)


# --------------------------------------------------------------------------- JSON round trip


def to_jsonable(obj: Any) -> Any:
    """Frozen dataclass (nested, tuples, Optional, str/int/float/bool) -> JSON-safe dict/list."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"non-finite float {obj!r} is not JSON-safe")
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def from_jsonable(cls: type[T], data: Any, path: str = "$") -> T:
    """Inverse of :func:`to_jsonable`, validating every field.

    The data may come from another node over gRPC, so it is checked: wrong types,
    missing required fields, non-finite floats -> :class:`ProbeParseError`.
    Unknown keys are ignored (a newer peer may send more fields); missing
    fields that have a default take it.
    """
    return _from(cls, data, path)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        _HINTS[cls] = h
    return h


def _from(tp: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _from(a, data, path)
            except ProbeParseError as e:
                errors.append(str(e))
        raise ProbeParseError("; ".join(errors) or f"{path}: unexpected null")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(data, list | tuple):
            raise ProbeParseError(f"{path}: expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise ProbeParseError(f"{path}: expected {len(args)} items")
        return tuple(_from(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data, strict=True)))
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ProbeParseError(f"{path}: expected an object for {tp.__name__}")
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            if f.name in data:
                kwargs[f.name] = _from(hints[f.name], data[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProbeParseError(f"{path}: missing field {f.name!r}")
        try:
            return tp(**kwargs)
        except (TypeError, ValueError) as e:
            raise ProbeParseError(f"{path}: {e}") from None
    if tp is bool:
        if isinstance(data, bool):
            return data
        raise ProbeParseError(f"{path}: expected a boolean")
    if tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
        raise ProbeParseError(f"{path}: expected an integer")
    if tp is float:
        if isinstance(data, int | float) and not isinstance(data, bool) and math.isfinite(data):
            return float(data)
        raise ProbeParseError(f"{path}: expected a finite number")
    if tp is str:
        if isinstance(data, str):
            return data
        raise ProbeParseError(f"{path}: expected a string")
    raise TypeError(f"from_jsonable: unsupported type {tp!r}")
