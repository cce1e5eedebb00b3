"""The control protocol between a tensor group's supervisor and its ranks.

Every rank holds one TCP connection to the supervisor (:mod:`ringlet.daemon.tensor.group`):
it sends ``hello`` (rank, pid, the epoch's secret from :data:`TOKEN_ENV`), ``loaded``,
``ready``, heartbeats and its answers; the supervisor sends ``init``, requests and
``shutdown``.

Frames: a 4-byte big-endian length and UTF-8 JSON; a message with ``"bin": n`` is followed
by one more length-prefixed frame of ``n`` raw bytes (hidden states and logits, float32,
C order). :func:`recv_frame` reads them on a rank's blocking socket, :func:`read_frame` on
the supervisor's asyncio stream.

Health: a heartbeat thread (:func:`heartbeat`) sends ``hb`` (step count, seconds spent in
the current step) every ``--hb-interval``; MLX releases the GIL while it computes or waits,
so heartbeats keep flowing from a rank stuck in a dead ring -- the supervisor sees the step
not finishing (mlx issue #3862). If the control socket closes the rank exits at once
(``os._exit``), even from inside a hung collective.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

MAX_FRAME = 256 << 20
#: Environment variable carrying the group epoch's secret (the supervisor checks it in "hello").
TOKEN_ENV = "RINGLET_TP_TOKEN"  # noqa: S105 - the name of a variable, not a secret


# ---------------------------------------------------------------------------------------- framing


def encode_frame(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return struct.pack(">I", len(data)) + data


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def encode_message(obj: dict, data: bytes | None = None) -> bytes:
    """A control message, with ``data`` (raw bytes) attached as a second frame when given."""
    if data is None:
        return encode_frame(obj)
    return encode_frame({**obj, "bin": len(data)}) + struct.pack(">I", len(data)) + data


def _recv_raw(sock: socket.socket) -> bytes | None:
    head = recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError(f"control frame of {n} bytes is too large")
    return recv_exact(sock, n)


def recv_frame(sock: socket.socket) -> Any | None:
    """The next control message (``None`` at end of stream); an attachment is put in ``msg["_data"]``."""
    body = _recv_raw(sock)
    if body is None:
        return None
    msg = json.loads(body)
    if isinstance(msg, dict) and msg.get("bin") is not None:
        data = _recv_raw(sock)
        if data is None:
            return None
        msg["_data"] = data
    return msg


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The supervisor's end of :func:`recv_frame`: the next message from a rank's control
    connection (``None`` at end of stream), an attachment in ``msg["_data"]``."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError("control frame too large")
    msg = json.loads(await reader.readexactly(n))
    if isinstance(msg, dict) and msg.get("bin") is not None:  # an attachment: raw bytes
        (m,) = struct.unpack(">I", await reader.readexactly(4))
        if m > MAX_FRAME:
            raise ValueError("control frame too large")
        msg["_data"] = await reader.readexactly(m)
    return msg


class Control:
    """The rank's end of the control socket: a reader thread feeding a queue and a
    locked writer shared by the main and heartbeat threads."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="tp-control-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                msg = recv_frame(self.sock)
                if msg is None:
                    break
                self.inbox.put(msg)
        except (OSError, ValueError):
            pass
        # The supervisor is gone: leave now, even if the main thread is stuck in a collective.
        os._exit(3)

    def send(self, obj: Any, data: bytes | None = None) -> None:
        frame = encode_message(obj, data)
        with self._lock:
            try:
                self.sock.sendall(frame)
            except OSError:
                os._exit(3)


# ---------------------------------------------------------------------------------------- health


@dataclass
class Health:
    """What a rank is doing (its heartbeat reports it): steps done, the current one's start, phase."""

    step: int = 0
    busy_since: float | None = None
    phase: str = "starting"

    def begin(self) -> None:
        self.busy_since = time.monotonic()

    def end(self) -> None:
        self.step += 1
        self.busy_since = None



def heartbeat(ctrl: Control, health: Health, rank: int, interval: float) -> None:
    """Send ``hb`` every ``interval`` seconds, forever (run it in a daemon thread)."""
    while True:
        since = health.busy_since
        ctrl.send(
            {
                "t": "hb",
                "rank": rank,
                "step": health.step,
                "phase": health.phase,
                "busy_for": (time.monotonic() - since) if since is not None else 0.0,
            }
        )
        time.sleep(interval)
