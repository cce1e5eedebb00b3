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
        kind: ``loopback``, ``thunderbolt``, ``wifi`` or ``ethernet`` (:func:`link_kind`).
        measured_at: unix time.
    """

    rtt_s: float
    bandwidth_bytes_per_s: float
    kind: str
    measured_at: float

    def to_dict(self) -> dict:
        return {"rtt_s": self.rtt_s, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "kind": self.kind,
                "measured_at": self.measured_at}


#: Link kinds from the slowest class to the fastest. A link whose two ends classify it
#: differently gets the slower kind (:func:`combine_kinds`), on every member alike.
KINDS = ("wifi", "ethernet", "thunderbolt", "loopback")


def link_kind(peer_host: str, thunderbolt_interfaces: set[str] | frozenset[str], interface_for_peer=None,
              local_addresses: frozenset[str] = frozenset(), wifi_interfaces: frozenset[str] = frozenset()) -> str:
    """Classify the link to ``peer_host`` by one rule, the same on both ends:

    1. ``loopback``: the peer's address is a loopback address or one of this
       machine's own (``local_addresses``): the traffic never leaves the machine;
    2. ``thunderbolt``: the local interface that reaches it (``interface_for_peer``)
       is a Thunderbolt port or bridge;
    3. ``wifi``: that interface is a Wi-Fi interface;
    4. ``ethernet``: anything else (a wired or virtual network).
    """
    try:
        if ipaddress.ip_address(peer_host).is_loopback or peer_host in local_addresses:
            return "loopback"
    except ValueError:
        pass
    if interface_for_peer is not None:
        iface = interface_for_peer(peer_host)
        if iface and iface in thunderbolt_interfaces:
            return "thunderbolt"
        if iface and iface in wifi_interfaces:
            return "wifi"
    return "ethernet"


def combine_kinds(a: str, b: str) -> str:
    """The kind of a link whose ends measured ``a`` and ``b``: the slower class of the
    two (:data:`KINDS`; an unknown kind counts as ``ethernet``)."""
    rank = {k: i for i, k in enumerate(KINDS)}
    return min((a, b), key=lambda k: rank.get(k, rank["ethernet"]))


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
