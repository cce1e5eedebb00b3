"""The gRPC server's port: one daemon per port.

grpc enables SO_REUSEPORT on Linux by default, so a second server on a port in use
would bind it as well and the kernel would hand it half of the new connections (hops
and heartbeats meant for the first daemon); seen in the suite as a request that
waited 30 s for a token, when a test's node drew a port another test's daemon held.
"""

from __future__ import annotations

import asyncio

import pytest

from ringlet.daemon.wire.ports import free_ports
from ringlet.daemon.wire.transport import TransportConfig, make_server


def test_a_second_server_on_a_port_in_use_is_refused_naming_the_address():
    async def main():
        address = f"127.0.0.1:{free_ports(1)[0]}"
        first = make_server(TransportConfig(), address)
        await first.start()
        try:
            with pytest.raises(OSError, match=f"cannot bind the gRPC port {address} \\(in use\\?\\)"):
                make_server(TransportConfig(), address)
        finally:
            await first.stop(None)

    asyncio.run(main())
