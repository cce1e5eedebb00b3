"""Link measurement: round-trip time and throughput to a member, over ringlet's gRPC.

* RTT: the median of ``pings`` small ``Echo`` calls (seconds).
* Throughput: ``Echo`` calls carrying ``bulk_bytes`` of payload with ``echo=False``
  (the reply is empty), so one call moves the payload one way; throughput is
  ``bulk_bytes / (t - rtt)`` in bytes/s, the best of ``bulk_rounds`` calls.

These measure what ringlet's own traffic will see (gRPC framing included), which is
what the planner needs. On this machine Python gRPC moves ~0.5 GB/s on loopback,
so anything faster reads as ~0.5 GB/s.
"""

from __future__ import annotations

import ipaddress
import statistics
import time
from dataclasses import dataclass

import grpc

from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class LinkMeasurement:
    """One direction of a link as measured from this node.

    Attributes:
        rtt_s: median round trip of a small call, seconds.
        bandwidth_bytes_per_s: one-way bulk throughput, bytes/s.
        kind: ``loopback``, ``thunderbolt`` or ``ethernet``.
        measured_at: unix time.
    """

    rtt_s: float
    bandwidth_bytes_per_s: float
    kind: str
    measured_at: float

    def to_dict(self) -> dict:
        return {"rtt_s": self.rtt_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "kind": self.kind,
                "measured_at": self.measured_at}


def link_kind(peer_host: str, thunderbolt_interfaces: set[str], interface_for_peer=None) -> str:
    """Classify the link to ``peer_host``: loopback, thunderbolt (the local interface
    that reaches it is a Thunderbolt port or bridge), or ethernet (anything else)."""
    try:
        if ipaddress.ip_address(peer_host).is_loopback:
            return "loopback"
    except ValueError:
        pass
    if interface_for_peer is not None:
        iface = interface_for_peer(peer_host)
        if iface and iface in thunderbolt_interfaces:
            return "thunderbolt"
    return "ethernet"


async def measure(stub: pb_grpc.RingStub, kind: str, *, pings: int = 7, bulk_bytes: int = 2 * 1024 * 1024,
                  bulk_rounds: int = 2, timeout_s: float = 10.0) -> LinkMeasurement:
    """Measure RTT and throughput to the node behind ``stub``.

    Raises:
        grpc.aio.AioRpcError: the peer did not answer.
    """
    await stub.Echo(pb.Ping(payload=b"", echo=True), timeout=timeout_s)  # warm the connection
    rtts = []
    for _ in range(pings):
        t0 = time.perf_counter()
        await stub.Echo(pb.Ping(payload=b"x" * 64, echo=True), timeout=timeout_s)
        rtts.append(time.perf_counter() - t0)
    rtt = statistics.median(rtts)
    # Subtract the smallest round trip seen (the fixed cost of a call), not the median,
    # which load inflates; never let the subtraction eat more than half the call.
    fixed = min(rtts)
    payload = b"\0" * bulk_bytes
    best = 0.0
    for _ in range(bulk_rounds):
        t0 = time.perf_counter()
        await stub.Echo(pb.Ping(payload=payload, echo=False), timeout=timeout_s)
        took = time.perf_counter() - t0
        best = max(best, bulk_bytes / max(took - fixed, took / 2))
    return LinkMeasurement(rtt_s=rtt, bandwidth_bytes_per_s=best, kind=kind, measured_at=time.time())


async def measure_address(channel: grpc.aio.Channel, kind: str, **kwargs) -> LinkMeasurement:
    """:func:`measure` over an open channel."""
    return await measure(pb_grpc.RingStub(channel), kind, **kwargs)
