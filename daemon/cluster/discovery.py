"""mDNS discovery: advertise this node and find peers (python-zeroconf, asyncio API).

Service type ``_ringlet._tcp.local.``; one service instance per daemon, named
``<node_id>-<incarnation>._ringlet._tcp.local.``. :class:`Discovery` puts the
parts together on one asyncio loop and one zeroconf instance:

* the advert and its TXT record, signing included: :mod:`ringlet.daemon.cluster.advert`;
* registering and re-announcing this node's advert: :mod:`ringlet.daemon.cluster.advertiser`;
* browsing, resolving and admitting peers: :mod:`ringlet.daemon.cluster.peer_browser`;
* which addresses to bind and advertise: :mod:`ringlet.daemon.cluster.addresses`;
* peers given by hand (``--peers``, no multicast): :mod:`ringlet.daemon.cluster.static_peers`.

Liveness is NOT decided here. A killed node's records stay in peers' caches
for ~19 min (PTR TTL floor); only a clean :meth:`Discovery.stop` sends a
goodbye, seen within milliseconds. Heartbeats over gRPC detect failures; after
a link comes back, call :meth:`Discovery.refresh` to re-learn who is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from zeroconf import DNSQuestionType, IPVersion
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from ringlet.daemon.cluster.addresses import interface_addresses
from ringlet.daemon.cluster.advert import SERVICE_TYPE, Advert, check_port, check_secret
from ringlet.daemon.cluster.advertiser import ADDRESS_POLL_S, RESIGN_INTERVAL_S, AdvertiserMixin
from ringlet.daemon.cluster.discovery_base import GoodbyeCallback, PeerCallback
from ringlet.daemon.cluster.identity import (
    INCARNATION_RE,
    NodeIdentity,
    cluster_id,
    new_incarnation,
    validate_node_id,
)
from ringlet.daemon.cluster.peer_browser import FRESH_ANSWER_WAIT_S, TYPE_PTR, BrowserMixin, HeardListener

log = logging.getLogger(__name__)

__all__ = ["Discovery", "DiscoveryError"]


class DiscoveryError(RuntimeError):
    """Discovery cannot run as configured (e.g. no usable interface address)."""


class Discovery(AdvertiserMixin, BrowserMixin):
    """Advertise this node over mDNS and report peers of the same cluster.

    Args:
        node_id: this node's id (:class:`~ringlet.daemon.cluster.identity.NodeIdentity`).
        cluster_name: the cluster name; only peers with the same
            :func:`~ringlet.daemon.cluster.identity.cluster_id` are reported.
        grpc_port, api_port: this node's ports, 1..65535.
        interfaces: ``None`` for every multicast-capable non-loopback IPv4
            interface, or a list of IPv4 addresses / interface names
            (:func:`~ringlet.daemon.cluster.addresses.interface_addresses`).
            ``["127.0.0.1"]`` for one-machine clusters and tests. With
            ``None`` or names, addresses are polled every ``address_poll_s``
            and changes re-announced.
        secret: cluster secret: adverts are signed, and peers' adverts must be.
        on_peer: called with an :class:`Advert` when a peer appears or its
            endpoint (addresses, ports, incarnation) changes, and for every
            peer that answers :meth:`refresh`. A reported peer may be dead
            (mDNS caches outlive crashes): confirm with a gRPC handshake.
        on_goodbye: called with a node id when the peer sent a goodbye (clean
            stop), or its advert became invalid. (If another incarnation of
            that id is still cached, it is first asked whether it is alive, for
            up to :data:`FRESH_ANSWER_WAIT_S`: a live one is reported through
            ``on_peer`` instead, a crashed earlier run is not.)
        on_conflict: called with the other node's :class:`Advert` when a live
            node advertises *our* node id and this node is the newer one
            (:func:`~ringlet.daemon.cluster.identity.should_yield`): regenerate the id
            and call :meth:`set_node_id`. Without it, only a warning is logged.
        on_incompatible: called with ``(node id, ["host:port", ...])`` for a peer whose
            advert names another protocol version: it is not accepted, but its gRPC
            handshake says why it is kept out (:mod:`ringlet.daemon.cluster.incompatible`).
        started_at_ms, incarnation: this process's start time (unix ms) and
            incarnation (``NodeIdentity.started_at_ms``/``.incarnation``);
            default now / random.
        address_poll_s: see ``interfaces``.
        resign_s: with a secret, re-sign and re-announce this often (seconds).

    Everything runs on the asyncio loop that calls :meth:`start` (zeroconf
    uses that loop; no thread of its own); call every method from it.
    Callbacks run on that loop, from zeroconf's callbacks; they must not
    block. A callback may return an awaitable, which is run as a task owned
    by this object (:meth:`stop` cancels it). Exceptions from callbacks are
    logged, never propagated. Adverts that are ignored (other cluster,
    incompatible version, bad signature, malformed, oversized) are logged once per
    (instance name, reason); the node's own advert is ignored silently.

    The advertising half is :class:`~ringlet.daemon.cluster.advertiser.AdvertiserMixin`,
    the browsing half :class:`~ringlet.daemon.cluster.peer_browser.BrowserMixin`.
    """

    def __init__(
        self,
        node_id: str,
        cluster_name: str,
        grpc_port: int,
        api_port: int,
        interfaces: Sequence[str] | None = None,
        secret: bytes | None = None,
        on_peer: PeerCallback | None = None,
        on_goodbye: GoodbyeCallback | None = None,
        *,
        on_conflict: PeerCallback | None = None,
        on_incompatible: Callable[[tuple[str, list[str]]], Any] | None = None,
        started_at_ms: int | None = None,
        incarnation: str | None = None,
        address_poll_s: float = ADDRESS_POLL_S,
        resign_s: float = RESIGN_INTERVAL_S,
    ) -> None:
        self._node_id = validate_node_id(node_id)
        self._cluster_id = cluster_id(cluster_name)
        self._grpc_port = check_port("grpc_port", grpc_port)
        self._api_port = check_port("api_port", api_port)
        if interfaces is not None:
            if isinstance(interfaces, str):
                raise ValueError("interfaces must be a list of strings, not a string")
            interfaces = list(interfaces)
            interface_addresses(interfaces, if_addrs={})  # validates the entries
        self._interfaces = interfaces
        check_secret(secret)
        self._secret = bytes(secret) if secret is not None else None
        self._on_peer = on_peer
        self._on_goodbye = on_goodbye
        self._on_conflict = on_conflict
        self._on_incompatible = on_incompatible
        self._started_at_ms = int(time.time() * 1000) if started_at_ms is None else int(started_at_ms)
        self._incarnation = new_incarnation() if incarnation is None else incarnation
        if not INCARNATION_RE.fullmatch(self._incarnation):
            raise ValueError(f"invalid incarnation {self._incarnation!r}: want 8 lowercase hex chars")
        self._address_poll_s = float(address_poll_s)
        self._resign_s = float(resign_s)

        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._heard_listener: HeardListener | None = None
        self._addresses: list[str] = []
        self._peers: dict[str, Advert] = {}  # node id -> advert reported through on_peer
        self._instances: dict[str, Advert] = {}  # instance name -> last valid advert (other nodes)
        self._conflicts: set[str] = set()  # instance names already judged as clones of us
        self._own_names = {self._own_instance()}  # every instance name this object advertised
        self._logged: set[tuple[str, str]] = set()
        self._last_heard: dict[str, float] = {}  # instance name -> time.monotonic()
        self._resolving: set[str] = set()
        self._resolve_again: set[str] = set()
        #: names whose lookup failed: (failed lookups, first failure, last failure), monotonic s
        self._unresolved: dict[str, tuple[int, float, float]] = {}
        self._retrying: set[str] = set()  # names with a retry scheduled
        self._tasks: set[asyncio.Task[Any]] = set()
        self._maintainer: asyncio.Task[None] | None = None
        self._last_signed = 0.0
        self._running = False
        #: Seconds the last service registration took (for benchmarks and logs).
        self.registration_s: float | None = None

    @classmethod
    def for_identity(
        cls, identity: NodeIdentity, cluster_name: str, grpc_port: int, api_port: int, **kwargs: Any
    ) -> Discovery:
        """Build a Discovery for ``identity``: its node id, start time and incarnation.

        Other arguments as for the constructor (``interfaces``, ``secret``,
        ``on_peer``, ``on_goodbye``, ``on_conflict``, ...), by keyword.
        """
        return cls(
            identity.node_id,
            cluster_name,
            grpc_port,
            api_port,
            started_at_ms=identity.started_at_ms,
            incarnation=identity.incarnation,
            **kwargs,
        )

    # -- public state ------------------------------------------------------------

    @property
    def node_id(self) -> str:
        """This node's id as currently advertised."""
        return self._node_id

    @property
    def cluster_id(self) -> str:
        """This node's cluster id."""
        return self._cluster_id

    @property
    def addresses(self) -> list[str]:
        """The IPv4 addresses currently bound and advertised."""
        return list(self._addresses)

    @property
    def peers(self) -> dict[str, Advert]:
        """Peers currently known through mDNS: node id -> last reported advert (a copy)."""
        return dict(self._peers)

    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._running

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Bind, register this node's advert and start browsing. Returns in a few ms.

        Raises:
            DiscoveryError: no usable IPv4 address for the configured interfaces.
            RuntimeError: already started.
            OSError: the mDNS sockets cannot be opened.
        """
        if self._running or self._aiozc is not None:
            raise RuntimeError("Discovery already started")
        addresses = interface_addresses(self._interfaces)
        if not addresses:
            raise DiscoveryError(
                f"no usable IPv4 address for interfaces={self._interfaces!r}; "
                "pass interfaces=['127.0.0.1'] for a one-machine cluster, or use --peers"
            )
        self._addresses = addresses
        self._aiozc = AsyncZeroconf(interfaces=list(addresses), ip_version=IPVersion.V4Only)
        try:
            zc = self._aiozc.zeroconf
            self._heard_listener = HeardListener(self)
            zc.async_add_listener(self._heard_listener, None)
            await self._register()
            # Set before the browser exists: it reports cached peers as soon as it is created.
            self._running = True
            self._browser = AsyncServiceBrowser(
                zc,
                [SERVICE_TYPE],
                handlers=[self._on_state_change],
                question_type=DNSQuestionType.QM,
            )
            if self._needs_maintenance():
                self._maintainer = asyncio.get_running_loop().create_task(self._maintain())
        except BaseException:
            self._running = False
            await self._close_zeroconf()
            raise
        log.info(
            "mDNS: advertising %s on %s (grpc %d, api %d, cluster %s%s) in %.1f ms",
            self.advert.instance_name,
            ",".join(self._addresses),
            self._grpc_port,
            self._api_port,
            self._cluster_id,
            ", signed" if self._secret else "",
            (self.registration_s or 0) * 1000,
        )

    async def stop(self) -> None:
        """Send a goodbye for this node, stop browsing and close the sockets (idempotent).

        Peers see the goodbye within milliseconds; it takes ~0.3 s here
        because zeroconf repeats the goodbye. No callback is called after it returns.
        """
        self._running = False
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._maintainer
            self._maintainer = None
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self._close_zeroconf()
        self._peers.clear()
        self._instances.clear()
        self._last_heard.clear()
        self._resolving.clear()
        self._resolve_again.clear()
        self._unresolved.clear()
        self._retrying.clear()

    async def __aenter__(self) -> Discovery:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _close_zeroconf(self) -> None:
        aiozc, self._aiozc = self._aiozc, None
        browser, self._browser = self._browser, None
        self._info = None
        if aiozc is None:
            return
        try:
            if browser is not None:
                await browser.async_cancel()
            if self._heard_listener is not None:
                aiozc.zeroconf.async_remove_listener(self._heard_listener)
        finally:
            self._heard_listener = None
            await aiozc.async_close()  # unregisters (goodbye) then closes the sockets

    # -- node id change ------------------------------------------------------------

    async def set_node_id(self, node_id: str) -> None:
        """Advertise under a new node id (after ``NodeIdentity.regenerate``).

        Sends a goodbye for the old instance and registers the new one. Peers
        see ``on_peer`` with the new id, and for the old id either
        ``on_goodbye`` or, if another live node still holds it (the clone
        case), ``on_peer`` with that node. Nodes that were ignored as holders
        of our old id are then looked at again as ordinary peers.
        Raises ``ValueError`` for an invalid id.
        """
        validate_node_id(node_id)
        if node_id == self._node_id:
            return
        old = self._node_id
        if self._aiozc is not None and self._info is not None:
            old_info, self._info = self._info, None
            await (await self._aiozc.async_unregister_service(old_info))
        self._node_id = node_id
        self._own_names.add(self._own_instance())
        if self._aiozc is None:
            return
        await self._register()
        log.warning("mDNS: re-advertised as %s (was %s)", node_id, old)
        holders, self._conflicts = self._conflicts, set()
        for name in holders:
            self._schedule_resolve(name)

    # -- refresh -----------------------------------------------------------------

    async def refresh(self, timeout: float = FRESH_ANSWER_WAIT_S, *, announce: bool = True) -> list[Advert]:
        """Ask the network afresh who is there; report and return every peer that answered.

        Sends one multicast PTR question for :data:`SERVICE_TYPE` without the
        known-answer list (so peers already in the cache answer too), waits
        ``timeout`` seconds, then calls ``on_peer`` for each valid peer that
        answered (even if unchanged) and returns their adverts. With
        ``announce``, also re-multicasts this node's advert so peers whose
        browsers missed it can see it. Call it after a link comes back: a
        running browser does not re-query by itself. The default ``timeout``
        (:data:`FRESH_ANSWER_WAIT_S`) lets every live peer answer; a shorter
        one may miss peers that multicast in the last second.
        """
        if self._aiozc is None:
            raise RuntimeError("Discovery is not started")
        t0 = time.monotonic()
        if announce:
            await self._reannounce()
        self._send_fresh_query(SERVICE_TYPE, TYPE_PTR)
        await asyncio.sleep(timeout)
        names = [n for n, t in self._last_heard.items() if t >= t0 and n not in self._own_names]
        results = await asyncio.gather(*(self._resolve(n, force=True) for n in names))
        return [a for a in results if a is not None]

    # -- helpers -----------------------------------------------------------------

    def _own_instance(self) -> str:
        return f"{self._node_id}-{self._incarnation}.{SERVICE_TYPE}"
