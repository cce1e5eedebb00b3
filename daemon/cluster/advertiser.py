"""This node's own mDNS advert: register it, re-announce it, re-sign it, follow the addresses.

One service instance per daemon, named ``<node_id>-<incarnation>._ringlet._tcp.local.``.
The name is unique by construction (the incarnation is random per process), so
registration skips mDNS probing (``cooperating_responders=True``): about 1-4 ms
instead of ~1.1 s (measured, issue 4). Even two nodes with the same node id (a
cloned disk) get distinct names, which is how the clone is seen (see
:class:`~ringlet.daemon.cluster.discovery.Discovery`'s ``on_conflict``).

The advert is rebuilt and re-multicast when the interface addresses change
(polled, :data:`ADDRESS_POLL_S`) and, with a secret, re-signed every
:data:`RESIGN_INTERVAL_S`. The TXT record itself is :mod:`ringlet.daemon.cluster.advert`'s.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

from zeroconf.asyncio import AsyncServiceInfo

from ringlet.daemon.cluster.addresses import interface_addresses, is_ipv4
from ringlet.daemon.cluster.advert import SERVICE_TYPE, Advert, encode_txt
from ringlet.daemon.cluster.discovery_base import DiscoveryBase
from ringlet.daemon.cluster.identity import PROTOCOL_VERSION

__all__ = ["ADDRESS_POLL_S", "RESIGN_INTERVAL_S", "AdvertiserMixin"]

# All of discovery logs under one name (its parts live in several modules).
log = logging.getLogger("ringlet.daemon.cluster.discovery")

#: With a secret, the advert is re-signed (new ``ts``) and re-announced this often, seconds.
#: Well under :data:`~ringlet.daemon.cluster.advert.SIGNATURE_WINDOW_S`, so a cached advert is at most this old
#: and clocks may differ by up to ``SIGNATURE_WINDOW_S - RESIGN_INTERVAL_S``.
RESIGN_INTERVAL_S = 60
#: With ``interfaces=None`` or interface names, local addresses are polled this often
#: (seconds) and the advert is re-announced when they change. psutil gives no
#: change notification on Linux or macOS; polling ``net_if_addrs`` is cheap (<1 ms).
ADDRESS_POLL_S = 5.0


class AdvertiserMixin(DiscoveryBase):
    """The advertising half of :class:`~ringlet.daemon.cluster.discovery.Discovery`: this node's own advert."""

    @property
    def advert(self) -> Advert:
        """This node's own advert (unsigned fields)."""
        return Advert(
            node_id=self._node_id,
            protocol_version=PROTOCOL_VERSION,
            grpc_port=self._grpc_port,
            api_port=self._api_port,
            cluster_id=self._cluster_id,
            incarnation=self._incarnation,
            started_at_ms=self._started_at_ms,
            addresses=tuple(self._addresses),
        )

    # -- own advert --------------------------------------------------------------

    def _build_info(self) -> AsyncServiceInfo:
        adv = self.advert
        self._last_signed = time.monotonic()
        label = adv.instance_name[: -len(SERVICE_TYPE) - 1]
        return AsyncServiceInfo(
            SERVICE_TYPE,
            adv.instance_name,
            addresses=[socket.inet_aton(a) for a in self._addresses],
            port=self._grpc_port,
            properties=encode_txt(adv, self._secret),
            server=f"ringlet-{label}.local.",
        )

    async def _register(self) -> None:
        assert self._aiozc is not None  # noqa: S101 - internal invariant (only called after start), not input checking
        self._info = self._build_info()
        t0 = time.perf_counter()
        done = await self._aiozc.async_register_service(self._info, cooperating_responders=True)
        self.registration_s = time.perf_counter() - t0
        self._track(done)  # the announcements go on in the background

    async def _reannounce(self) -> None:
        """Rebuild the advert (addresses, signature) and multicast it."""
        if self._aiozc is None or self._info is None:
            return
        self._info = self._build_info()
        self._track(await self._aiozc.async_update_service(self._info))

    # -- addresses and re-signing ---------------------------------------------------

    def _needs_maintenance(self) -> bool:
        dynamic = self._interfaces is None or not all(is_ipv4(s) for s in self._interfaces)
        return dynamic or self._secret is not None

    async def _maintain(self) -> None:
        dynamic = self._interfaces is None or not all(is_ipv4(s) for s in self._interfaces)
        period = min(
            self._address_poll_s if dynamic else float("inf"),
            self._resign_s if self._secret else float("inf"),
        )
        while True:
            await asyncio.sleep(period)
            try:
                changed = await self.update_addresses() if dynamic else False
                if (
                    not changed
                    and self._secret is not None
                    and time.monotonic() - self._last_signed >= 0.9 * self._resign_s
                ):
                    await self._reannounce()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("mDNS: maintenance failed; will retry")

    async def update_addresses(self) -> bool:
        """Re-read the interface addresses; on a change, rebind and re-announce. Returns True if changed.

        Runs every :data:`ADDRESS_POLL_S` by itself when ``interfaces`` is
        ``None`` or holds names; the daemon may also call it on a network
        change event. When every address is gone the old advert is kept
        (nobody can reach it anyway) until a new address appears.
        """
        if self._aiozc is None:
            return False
        new = interface_addresses(self._interfaces)
        if set(new) == set(self._addresses):
            return False
        if not new:
            self._log_once(
                "self",
                "no_address",
                logging.WARNING,
                "mDNS: no usable IPv4 address left; keeping the old advert",
            )
            return False
        self._logged.discard(("self", "no_address"))
        old = self._addresses
        self._addresses = new
        await self._aiozc.async_update_interfaces(interfaces=list(new))
        await self._reannounce()
        log.info("mDNS: addresses changed %s -> %s; re-announced", old, new)
        return True
