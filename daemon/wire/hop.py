"""Outbound hop: one long-lived gRPC bidi stream from this stage to the next.

A unary call per token would pay connection and call setup every step; one stream
per hop carries every activation of every request in order. Writes are serialised
with a lock; a broken stream is reopened once per write before the error is
reported to the caller.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from ringlet.daemon.errors import one_line
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.transport import TransportConfig, make_channel

log = logging.getLogger(__name__)

class HopLink:
    """The stream to the next stage at ``address`` (``host:port``)."""

    def __init__(self, address: str, transport: TransportConfig):
        self.address = address
        self._transport = transport
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._lock = asyncio.Lock()
        self.sent = 0

    async def _open(self) -> None:
        if self._channel is None:
            self._channel = make_channel(self._transport, self.address)
        stub = pb_grpc.RingStub(self._channel)
        self._call = stub.Hop()

    async def send(self, message: pb.Activation) -> None:
        """Write one activation to the next stage.

        Raises:
            grpc.aio.AioRpcError / ConnectionError: the next stage is unreachable
                even after reopening the stream.
        """
        async with self._lock:
            for attempt in (0, 1):
                try:
                    if self._call is None or self._call.done():
                        await self._open()
                    await self._call.write(message)
                    self.sent += 1
                    return
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                    log.debug("hop to %s broke (%s); reopening", self.address, exc)
                    self._call = None
                    if attempt == 1:
                        raise ConnectionError(f"next stage {self.address} is unreachable: {one_line(exc)}") from None

    async def close(self) -> None:
        """Half-close the stream and close the channel."""
        call, self._call = self._call, None
        if call is not None and not call.done():
            try:
                await call.done_writing()
            except Exception as exc:  # noqa: BLE001 - closing a broken stream
                log.debug("closing hop to %s: %s", self.address, exc)
            call.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
