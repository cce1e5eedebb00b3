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

A port checked free is still free only until someone binds it, and two processes on one
machine (two test workers, a node's lanes beside a local cluster) drawing from one pool
can both find the same port free before either binds it. So every port handed out is
also *held* for :data:`HOLD_S` in a small registry file shared by this user's processes
(``ringlet-ports-<uid>.json`` in the temporary directory, under an ``flock``): no other
ringlet process hands it out while its first holder starts, stops and restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

try:
    import fcntl
except ImportError:  # pragma: no cover - not on macOS or Linux: no registry, as before
    fcntl = None  # type: ignore[assignment]

#: Lowest port handed out: above the registered services most machines run (<10000).
LOWEST = 10000
#: The IANA dynamic (ephemeral) range, used where the kernel's cannot be read.
IANA_EPHEMERAL = (49152, 65535)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Seconds a port handed out stays held from every other ringlet process of this user.
HOLD_S = 600.0
_REGISTRY = Path(tempfile.gettempdir()) / f"ringlet-ports-{os.getuid() if hasattr(os, 'getuid') else 0}.json"


@contextlib.contextmanager
def _held() -> Iterator[dict[int, tuple[float, int]]]:
    """The registry's live holds ``{port: (until, pid)}`` (``time.time()`` seconds; the pid
    of the process that was handed it: a hold ends with that process, so a daemon restarted
    at once finds its own ports free), locked against every other process for the block;
    what the block leaves in the dict is written back.
    Without ``fcntl``, or where the file cannot be used, an empty dict that is not kept."""
    if fcntl is None:
        yield {}
        return
    try:
        fd = os.open(_REGISTRY, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield {}
        return
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        now = time.time()
        try:
            holds = {int(k): (float(v[0]), int(v[1])) for k, v in json.loads(f.read() or "{}").items()
                     if float(v[0]) > now and psutil.pid_exists(int(v[1]))}
        except (ValueError, TypeError, AttributeError):
            holds = {}  # a torn or foreign file: start over
        yield holds
        f.seek(0)
        f.truncate()
        f.write(json.dumps({str(k): v for k, v in holds.items() if v[0] > now}))
        f.flush()


def claim_port(port: int, host: str = "0.0.0.0") -> bool:  # noqa: S104 - a probe, closed at once
    """Whether ``port`` is free on ``host`` (bindable, ``SO_REUSEADDR`` as gRPC binds, and
    not held by another ringlet process: this process may claim its own port again, as a
    restarted child takes its port back); when it is, it is held as handed out.

    Args:
        port: a TCP port, 1..65535.
        host: the address to probe (default every IPv4 address).
    """
    with _held() as holds:
        held = holds.get(port)
        if (held is not None and held[1] != os.getpid()) or not _bindable(host, port, reuse=True):
            return False
        holds[port] = (time.time() + HOLD_S, os.getpid())
        return True


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


def _kernel_block(n: int, host: str, holds: dict[int, tuple[float, int]]) -> int:
    """A block of ``n`` ports around one the kernel picks (inside the ephemeral range:
    the fallback when nothing lies outside it), none of them in ``holds``."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n <= 65536 and not any(p in holds for p in range(base, base + n)) and all(
                _bindable(host, p) for p in range(base, base + n)):
            return base
    raise OSError(f"no block of {n} free TCP ports on {host}")


def _bindable(host: str, port: int, reuse: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A base port such that ``base .. base + n - 1`` can all be bound on ``host`` now,
    outside the ephemeral range, and none is held by another ringlet process; the block is
    then held for :data:`HOLD_S`.

    Raises:
        OSError: no such block was found in ``tries`` random draws.
    """
    pool = _candidates(n)
    with _held() as holds:
        base = _kernel_block(n, host, holds) if not pool else _draw(pool, n, host, tries, holds)
        holds.update(dict.fromkeys(range(base, base + n), (time.time() + HOLD_S, os.getpid())))
        return base


def _draw(pool: range, n: int, host: str, tries: int, holds: dict[int, tuple[float, int]]) -> int:
    """A block of ``n`` ports drawn at random from ``pool``, all bindable at once and none in
    ``holds``; raises OSError after ``tries`` draws."""
    for _ in range(tries):
        base = pool[secrets.randbelow(len(pool))]
        if any(p in holds for p in range(base, base + n)):
            continue
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
