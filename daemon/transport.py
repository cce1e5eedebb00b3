"""gRPC transport: every ringlet server and channel is made here.

One place decides message limits, keepalive and (with a cluster secret) the
security of every RPC, so no call path can bypass it.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

#: Default largest gRPC message, bytes. gRPC's own default receive limit (4 MiB) is
#: too small for prefill hidden states.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class TransportConfig:
    """Settings shared by a node's server and channels.

    Attributes:
        max_message_bytes: largest message sent or received, bytes.
        keepalive_s: seconds between HTTP/2 keepalive pings; a peer silent for
            ``keepalive_s + keepalive_timeout_s`` is declared dead by gRPC.
        keepalive_timeout_s: seconds to wait for a ping acknowledgement.
        secret: the cluster secret, or ``None`` to run open.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    keepalive_s: float = 2.0
    keepalive_timeout_s: float = 2.0
    secret: bytes | None = None


def options(config: TransportConfig) -> list[tuple[str, int]]:
    """gRPC channel/server arguments (grpc core ``GRPC_ARG_*``; times in ms)."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.keepalive_s * 500)),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(config.keepalive_s * 500)),
    ]


def make_server(config: TransportConfig, address: str) -> grpc.aio.Server:
    """A gRPC aio server bound to ``address`` (``host:port``); not started.

    Raises:
        OSError: the address cannot be bound.
    """
    server = grpc.aio.server(options=options(config))
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot bind the gRPC port {address} (in use?)")
    return server


def make_channel(config: TransportConfig, address: str) -> grpc.aio.Channel:
    """A gRPC aio channel to a peer at ``address`` (``host:port``)."""
    return grpc.aio.insecure_channel(address, options=options(config))
