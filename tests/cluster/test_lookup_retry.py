"""A peer whose mDNS lookup fails once is not lost for good (issue 36, point 1).

Real zeroconf on loopback (127.0.0.1 only). The peer is the test's own responder: it
registers a valid advert while *held* (everything it would send is dropped), lets only
its PTR record out, so the browser under test sees the name and looks it up while nobody
answers: the lookup fails after ``RESOLVE_TIMEOUT_MS``, as a busy node's answer did in
the soak of issue 36. Then the hold is released; the peer answers every query from then
on, but announces nothing by itself. Nothing is stubbed in the browser under test.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
from zeroconf import DNSOutgoing, DNSPointer, IPVersion
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from ringlet.daemon.cluster.advert import SERVICE_TYPE, Advert, encode_txt
from ringlet.daemon.cluster.discovery import Discovery
from ringlet.daemon.cluster.identity import PROTOCOL_VERSION, cluster_id, new_incarnation, new_node_id
from ringlet.daemon.cluster.peer_browser import RESOLVE_TIMEOUT_MS

LOOPBACK = ["127.0.0.1"]
_FLAGS_RESPONSE = 0x8400  # QR + AA (RFC 6762 section 18)
_CLASS_IN_UNIQUE = 0x0001  # a PTR record is shared: no cache-flush bit
_PTR_TTL_S = 4500  # zeroconf's default for PTR records


class HeldPeer:
    """A peer's mDNS responder that can be held: while held it sends nothing (answers,
    announcements, probes), as if its packets were lost or came too late."""

    def __init__(self, cluster: str) -> None:
        self.advert = Advert(new_node_id(), PROTOCOL_VERSION, 7345, 8345, cluster_id(cluster), new_incarnation(),
                             int(time.time() * 1000))
        self.held = True
        self.dropped = 0
        self.zc: AsyncZeroconf | None = None

    async def start(self) -> None:
        self.zc = AsyncZeroconf(interfaces=LOOPBACK, ip_version=IPVersion.V4Only)
        zc = self.zc.zeroconf
        self._send = zc.async_send

        def send(out, *args, **kwargs):
            if self.held:
                self.dropped += 1
                return None
            return self._send(out, *args, **kwargs)

        zc.async_send = send  # the instance's own sends: answers, announcements, probes
        info = AsyncServiceInfo(SERVICE_TYPE, self.advert.instance_name, addresses=[socket.inet_aton("127.0.0.1")],
                                port=self.advert.grpc_port, properties=encode_txt(self.advert, None),
                                server=f"{self.advert.node_id}.local.")
        await self.zc.async_register_service(info, cooperating_responders=True)

    def leak_pointer(self) -> None:
        """Let only the PTR record out (the rest of the announcement was lost)."""
        out = DNSOutgoing(_FLAGS_RESPONSE)
        out.add_answer_at_time(DNSPointer(SERVICE_TYPE, 12, _CLASS_IN_UNIQUE, _PTR_TTL_S,
                                          self.advert.instance_name), 0)
        self._send(out)

    async def close(self) -> None:
        self.held = True  # no goodbye: the peer vanishes as a killed node does
        if self.zc is not None:
            await self.zc.async_close()


def test_a_lookup_that_failed_is_retried_until_the_peer_answers(caplog: pytest.LogCaptureFixture) -> None:
    """The lookup of a new peer fails (its answers are held for 2.5 s); once the peer
    answers again it is reported within a few seconds, with no new advert from it."""
    caplog.set_level(logging.INFO, logger="ringlet.daemon.cluster.discovery")
    cluster = f"lookup-{new_node_id()[:8]}"

    async def scenario() -> tuple[float | None, int]:
        seen: dict[str, float] = {}
        me = Discovery(new_node_id(), cluster, 7346, 8346, LOOPBACK,
                       on_peer=lambda a: seen.setdefault(a.node_id, time.monotonic()))
        peer = HeldPeer(cluster)
        await me.start()
        try:
            await peer.start()
            peer.leak_pointer()
            t0 = time.monotonic()
            await asyncio.sleep(RESOLVE_TIMEOUT_MS / 1000 + 1.5)  # the lookup has failed by now
            assert peer.advert.node_id not in seen, "reported although nothing answered"
            peer.held = False
            released = time.monotonic()
            while peer.advert.node_id not in seen and time.monotonic() - released < 12.0:
                await asyncio.sleep(0.05)
            found = seen.get(peer.advert.node_id)
            return (found - released if found is not None else None), int((released - t0) * 1000)
        finally:
            await peer.close()
            await me.stop()

    after, held_ms = asyncio.run(asyncio.wait_for(scenario(), 40))
    failed = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert failed, "the held lookup did not fail: the test did not reproduce the lost answer"
    assert after is not None, (f"the peer was never reported in the 12 s after it answered again "
                               f"(its answers were held {held_ms} ms): {failed}")
    print(f"\nreported {after:.2f} s after the peer answered again ({held_ms} ms held)")
