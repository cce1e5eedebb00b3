"""Free TCP ports for processes this one starts (local clusters, tensor ranks).

A port found by binding port 0 comes from the kernel's *ephemeral* range, the range it
also draws from for the local end of every outgoing connection. Between finding such a
port and the child process binding it (a daemon's start takes seconds) any client
connection on the machine may take it, and the child fails with "address in use".
Ports below the ephemeral range are never handed out that way, so they are chosen
there: at random, each checked free by binding it.

The range is Linux's ``net.ipv4.ip_local_port_range`` (default 32768-60999,
``Documentation/networking/ip-sysctl.rst``); elsewhere the IANA dynamic range
49152-65535 (RFC 6335, section 6), which macOS and the BSDs use.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

#: Lowest port handed out: above the registered services most machines run (<10000).
LOWEST = 10000
#: The IANA dynamic (ephemeral) range, used where the kernel's cannot be read.
IANA_EPHEMERAL = (49152, 65535)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range ``(first, last)``, inclusive."""
    try:
        first, last = (int(x) for x in _RANGE_FILE.read_text().split())
        return first, last
    except (OSError, ValueError):
        return IANA_EPHEMERAL


def _candidates(n: int) -> range:
    """Where blocks of ``n`` ports are drawn from: below the ephemeral range when it leaves
    room for that, else above it (ports there are never handed out either); empty when
    the range covers nearly every port."""
    first, last = ephemeral_range()
    if first - LOWEST >= 100 * n:
        return range(LOWEST, first - n + 1)
    return range(last + 1, 65536 - n + 1)


def _kernel_block(n: int, host: str) -> int:
    """A block of ``n`` ports around one the kernel picks (inside the ephemeral range:
    the fallback when nothing lies outside it)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n <= 65536 and all(_bindable(host, p) for p in range(base, base + n)):
            return base
    raise OSError(f"no block of {n} free TCP ports on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A base port such that ``base .. base + n - 1`` can all be bound on ``host`` now,
    outside the ephemeral range.

    Raises:
        OSError: no such block was found in ``tries`` random draws.
    """
    pool = _candidates(n)
    if not pool:
        return _kernel_block(n, host)
    for _ in range(tries):
        base = pool[secrets.randbelow(len(pool))]
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no block of {n} free TCP ports on {host} outside the ephemeral range")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now, outside the ephemeral range.

    Raises:
        OSError: not enough free ports were found.
    """
    ports: list[int] = []
    while len(ports) < n:
        port = free_port_block(1, host)
        if port not in ports:
            ports.append(port)
    return ports
