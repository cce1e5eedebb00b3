"""Static peers (``--peers``): gRPC endpoints given by hand, for networks without multicast."""

from __future__ import annotations

import ipaddress
import re

__all__ = ["parse_peers"]

_RE_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def parse_peers(spec: str) -> list[tuple[str, int]]:
    """Parse ``--peers``: comma-separated ``host:port`` (gRPC ports), for networks without multicast.

    Hosts are names, IPv4 addresses, or IPv6 addresses in brackets
    (``[fe80::1%en0]:50051``). Whitespace around entries is ignored; an empty
    ``spec`` gives ``[]``; duplicates are dropped (first kept). Returns
    ``(host, port)`` pairs, IPv6 without brackets.

    Raises:
        ValueError: naming the bad entry: empty entry, missing port, port not
            decimal 1..65535, bad host name, IPv6 without brackets.
    """
    if not isinstance(spec, str):
        raise ValueError(f"--peers must be a string, got {type(spec).__name__}")
    if not spec.strip():
        return []
    out: list[tuple[str, int]] = []
    for i, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        where = f"--peers entry {i} {entry!r}"
        if not entry:
            raise ValueError(f"--peers entry {i} is empty (stray comma?)")
        if entry.startswith("["):
            close = entry.find("]")
            if close < 0 or not entry[close + 1 :].startswith(":"):
                raise ValueError(f"{where}: want [ipv6]:port")
            host, port_s = entry[1:close], entry[close + 2 :]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"{where}: {host!r} is not an IPv6 address") from None
        else:
            if entry.count(":") > 1:
                raise ValueError(f"{where}: IPv6 addresses need brackets, e.g. [::1]:50051")
            host, sep, port_s = entry.partition(":")
            if not sep:
                raise ValueError(f"{where}: missing ':port'")
            if not host:
                raise ValueError(f"{where}: missing host")
            if not _RE_HOSTNAME.fullmatch(host):
                raise ValueError(f"{where}: {host!r} is not a valid host name or IPv4 address")
        if not re.fullmatch(r"[0-9]{1,5}", port_s) or not 1 <= int(port_s) <= 65535:
            raise ValueError(f"{where}: port {port_s!r} is not a number in 1..65535")
        pair = (host, int(port_s))
        if pair not in out:
            out.append(pair)
    return out
