"""This node's own addresses, followed while it runs: waiting for a first one at start,
moving when they change.

A daemon started before its network has no address to advertise: a launchd or systemd
start at boot, a container whose ``eth0`` is not up yet, a Mac waking up (Linux sets a
link *running* about a second after ``ip link set up``, and skips it until then). With a
wildcard ``--host`` and no ``--advertise-host`` it waits for one instead of exiting: its
gRPC server and API are up (binding 0.0.0.0 needs no address), its state is
``no-address``, ``/v1/cluster``'s ``network.waiting`` and the log say why ("waiting for a
network address: eth0: down"), and it joins once an address appears.

While it runs, the interface addresses are read every :data:`POLL_S` seconds (psutil;
well under a millisecond; Linux and macOS give no change notification without netlink or
a routing socket). When they change — a cable plugged in, DHCP renumbering, Wi-Fi
roaming, sleep and wake — :class:`NetworkFollower` moves this node: the address its beats
and handshakes name (``Membership.address``), the record's ``addresses`` (and ``api_url``),
the mDNS advert (re-registered on the new addresses, or started if it had none), and
every member is dialled afresh. That matters: a TCP connection from an address that is
gone is not reset, it hangs. The handshakes give the members this node's new record, so
a member whose beats to the old address fail moves to the new one
(:meth:`.router.Router.reroute`), and the plan moves with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringlet.daemon.cluster.addresses import (
    advertised_host,
    dial_addresses,
    interface_addresses,
    is_ipv4,
    no_address_reason,
)

if TYPE_CHECKING:
    from ringlet.daemon.cluster.discovery import Discovery
    from ringlet.daemon.cluster.membership import Membership
    from ringlet.daemon.cluster.router import Router

__all__ = ["POLL_S", "AddressWatcher", "Addresses", "NetworkFollower", "hosts"]

log = logging.getLogger(__name__)

#: Seconds between two readings of the interface addresses.
POLL_S = 1.0
#: Seconds mDNS is asked afresh who is there after this node's addresses changed.
REFRESH_WAIT_S = 0.5


@dataclass(frozen=True)
class Addresses:
    """What this node advertises, read at one moment.

    Attributes:
        public: the host peers dial (``--advertise-host``, ``--host``, or an interface's
            address); ``None`` when there is none (no network yet, or it went away).
        dial: every ``host:port`` it may be dialled at, ``public`` first (empty with it).
        mdns: the IPv4 addresses mDNS binds and advertises on.
    """

    public: str | None
    dial: tuple[str, ...] = ()
    mdns: tuple[str, ...] = ()


def hosts(addresses: Addresses) -> set[str]:
    """Every local address in ``addresses`` (the dial addresses' hosts and mDNS's)."""
    return {a.rsplit(":", 1)[0] for a in addresses.dial} | set(addresses.mdns)


class AddressWatcher:
    """Reads this node's addresses from ``--advertise-host``, ``--host``, ``--interface``
    and the interfaces' current state.

    Args:
        advertise_host, host, interfaces, port: as ``ringlet run`` was given them
            (``interfaces`` ``None``: every usable interface).
        poll_s: seconds between two readings in :meth:`wait_first` and :meth:`watch`.
    """

    def __init__(self, advertise_host: str | None, host: str, interfaces: Sequence[str] | None, port: int,
                 *, poll_s: float = POLL_S):
        self.advertise_host, self.host, self.port = advertise_host, host, port
        self.interfaces = list(interfaces) if interfaces is not None else None
        self.poll_s = poll_s
        self.current = Addresses(None)
        self.current = self.read()
        #: why there is no address (``None``: there is one)
        self.waiting: str | None = None if self.current.public else no_address_reason(self.interfaces)
        #: how many times the addresses changed since the first was found, and when (unix s) last
        self.changes, self.changed_at = 0, None

    @property
    def static(self) -> bool:
        """No interface can bring an address: ``--interface`` gave only IPv4 addresses (which
        are used as given) and no non-loopback one among them, with a wildcard ``--host``
        and no ``--advertise-host`` (``ringlet run`` then refuses at once)."""
        return (self.interfaces is not None and all(is_ipv4(s) for s in self.interfaces)
                and self.current.public is None)

    def read(self) -> Addresses:
        """The addresses now (the one advertised so far is kept while it is still there)."""
        mdns = tuple(interface_addresses(self.interfaces))
        public = advertised_host(self.advertise_host, self.host, self.interfaces, prefer=self.current.public)
        if public is None:
            return Addresses(None, (), mdns)
        return Addresses(public, tuple(dial_addresses(public, self.host, self.interfaces, self.port)), mdns)

    def poll(self) -> tuple[Addresses, Addresses] | None:
        """Read the addresses; ``(old, new)`` when they changed, else ``None``."""
        new = self.read()
        if new == self.current:
            return None
        old, self.current = self.current, new
        if new.public is None:
            self.waiting = no_address_reason(self.interfaces)
        else:
            self.waiting = None
            self.changes += 1
            self.changed_at = time.time()
        return old, new

    async def wait_first(self, say: Callable[[str], None] = lambda line: None) -> Addresses:
        """Return once there is an address to advertise, reading every ``poll_s`` seconds;
        say why it waits (the log, and ``say`` for the event log) at first and whenever
        the reason changes (an interface came up, got no carrier yet, ...)."""
        t0, said = time.monotonic(), None
        while self.current.public is None:
            if self.waiting != said:
                said = self.waiting
                line = f"waiting for a network address: {self.waiting}"
                log.warning("%s; --advertise-host or --interface pins one", line)
                say(line)
            await asyncio.sleep(self.poll_s)
            self.poll()
        self.changes = 0
        if said is not None:
            line = f"network address {self.current.public} after {time.monotonic() - t0:.1f} s: joining"
            log.info("%s (dialled at %s)", line, ", ".join(self.current.dial))
            say(line)
        return self.current

    def info(self) -> dict:
        """``/v1/cluster``'s ``network``: ``advertised`` (the host peers dial, or ``None``),
        ``addresses`` (``host:port`` each), ``mdns``, ``waiting`` (why there is no
        address, or ``None``), ``changes`` and ``changed_at`` (unix s) since the first."""
        return {"advertised": self.current.public, "addresses": list(self.current.dial),
                "mdns": list(self.current.mdns), "waiting": self.waiting, "changes": self.changes,
                "changed_at": self.changed_at}


class NetworkFollower:
    """Keeps this node's membership, routes and mDNS advert on its current addresses.

    Args:
        watcher: the node's :class:`AddressWatcher`.
        membership, router: the node's (its own address and its published ``addresses``).
        on_change: called (no arguments) after the addresses moved (re-plan if the plan's
            addresses moved), and when the first one appeared.
        on_event: called with ``(kind, message)`` for the event log.
        on_waiting: called with the reason when this node has no address (``None`` once it
            has one): the runner shows it as the node's state.
        peers: ``--peers`` as ``host:port`` strings, dialled again after a change.
        reconnect: awaited when an address of this node went away: close the node's own
            links opened from it (the hop link to the next stage, its channels).
    """

    def __init__(self, watcher: AddressWatcher, membership: Membership, router: Router, *,
                 on_change: Callable[[], None] = lambda: None,
                 on_event: Callable[[str, str], None] = lambda kind, msg: None,
                 on_waiting: Callable[[str | None], None] = lambda why: None, peers: Sequence[str] = (),
                 reconnect: Callable[[], Awaitable[None]] | None = None):
        self.watcher, self.membership, self.router = watcher, membership, router
        self.on_change, self.on_event, self.on_waiting = on_change, on_event, on_waiting
        self.peers = list(peers)
        self.reconnect = reconnect
        self.discovery: Discovery | None = None
        self._mdns_started = False
        #: the addresses this node advertises (the last it moved to; kept while it has none)
        self.advertised = watcher.current

    def info(self) -> dict:
        """See :meth:`AddressWatcher.info`."""
        return self.watcher.info()

    async def wait_first(self) -> None:
        """Wait for a first address (no-op when there is one), then take it."""
        if self.watcher.current.public is not None:
            return
        self.on_waiting(self.watcher.waiting)
        await self.watcher.wait_first(lambda line: self.on_event("network", line))
        self.move(self.watcher.current)
        self.advertised = self.watcher.current
        self.on_waiting(None)
        self.on_change()  # the first plan waits its settle time from now: mDNS finds the others first

    async def start_mdns(self) -> bool:
        """Start :attr:`discovery` unless it runs or has no address to bind yet (then the
        next change starts it). Returns whether it runs."""
        if self.discovery is None or self._mdns_started:
            return self._mdns_started
        if not self.watcher.current.mdns:
            log.info("mDNS: no address to advertise on yet; starting once there is one")
            return False
        from ringlet.daemon.cluster.discovery import DiscoveryError

        try:
            await self.discovery.start()
        except (DiscoveryError, OSError) as exc:  # the address went again meanwhile: the next change
            log.warning("mDNS: not started yet: %s", exc)
            return False
        self._mdns_started = True
        return True

    def move(self, new: Addresses, lost: bool = False) -> None:
        """Advertise ``new`` (its ``public`` must be set): the address in this node's beats
        and handshakes, its record's ``addresses``; every member is handshaken again (it
        fetches the new record). ``lost``: an address went away, so every channel to a
        member is replaced (connections opened from it hang: no reset comes).

        Raises:
            ValueError: ``new`` has no ``public`` address.
        """
        if new.public is None:
            raise ValueError("no address to move to")
        membership = self.membership
        membership.address = f"{new.public}:{self.watcher.port}"
        self.router.addresses = list(new.dial)
        self.router.publish()
        if lost:  # retired, closed later (as Membership._drop_channel does): calls in flight end as usual
            now = time.monotonic()
            for address in list(membership._channels):
                membership._retired.append((now, membership._channels.pop(address)))
        for member in list(membership.members.values()):
            membership.consider(member.address)  # no id: a handshake even though it is a member
        for peer in self.peers:
            membership.consider(peer)
        membership.links_wanted.set()

    async def changed(self, new: Addresses) -> None:
        """The addresses are ``new`` now: follow them (see the module's text). With none, the
        old ones stay advertised (nobody reaches them anyway) until an address comes back."""
        if new.public is None:
            line = f"no network address any more ({self.watcher.waiting}); waiting for one"
            log.warning("%s", line)
            self.on_event("network", line)
            return
        old, self.advertised = self.advertised, new
        if new == old:
            line = f"network addresses back: {', '.join(new.dial)}"
        elif new.dial == old.dial:
            line = f"mDNS addresses changed: {', '.join(old.mdns) or 'none'} -> {', '.join(new.mdns)}"
        else:
            line = (f"addresses changed: {', '.join(old.dial) or 'none'} -> {', '.join(new.dial)}; "
                    "advertising and dialling the new ones")
        log.info("%s", line)
        self.on_event("network", line)
        lost = bool(hosts(old) - hosts(new))  # an address went away (also while there was none)
        self.move(new, lost)
        if lost and self.reconnect is not None:
            await self.reconnect()
        if self.discovery is not None:
            if not self._mdns_started:
                await self.start_mdns()
            elif new.mdns:
                await self.discovery.update_addresses()  # rebinds and re-announces when they differ
            if self._mdns_started:
                with contextlib.suppress(Exception):  # peers answer from their caches otherwise
                    await self.discovery.refresh(timeout=REFRESH_WAIT_S)
        self.on_change()

    async def run(self, then: Callable[[], Awaitable[None]]) -> None:
        """Wait for a first address (:meth:`wait_first`), then run ``then`` (what needs one:
        negotiation), start mDNS and follow every change (:meth:`watch`)."""
        await self.wait_first()
        await then()
        await self.start_mdns()
        await self.watch()

    async def watch(self) -> None:
        """Read the addresses every ``poll_s`` seconds and follow each change. Runs until
        cancelled; a failed step is logged and the next reading tries again."""
        while True:
            await asyncio.sleep(self.watcher.poll_s)
            try:
                change = self.watcher.poll()
                if change is not None:
                    await self.changed(change[1])
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("following the network addresses failed; will retry")
