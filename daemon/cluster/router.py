"""This node's routes to its members: which of a member's addresses answer, which is
fastest, and moving to another when the one in use breaks (the rules: :mod:`.routes`).

* **Measured per address.** Every :data:`LINK_REFRESH_S` seconds (``--link-refresh-s``), and after every
  membership change, each of a member's addresses (:func:`.routes.candidates`: those its
  record lists, none that another node holds too) is checked to answer *as that member*
  (``GetNodeInfo``), classified (:func:`.linkprobe.link_kind`) and measured
  (:func:`.linkprobe.measure`); the member is dialled at the best
  (:func:`.routes.better`: Thunderbolt first, then throughput).
* **Failover.** A heartbeat that fails at the address in use (:attr:`Membership.on_unreachable`)
  is checked once more; if the address still does not answer, the member's other
  addresses are tried at once and the first best that answers becomes its address
  (:meth:`Membership.use_address`), without removing the member. The negotiator is told
  (``on_change``), and a plan naming the dead address is replaced by one over the
  address that works.
* **Published.** This node's ``addresses`` and its ``routes`` (per member: the address in
  use, what answered, what did not and why) go in its record, so every member plans with
  them (:func:`.routes.stage_addresses`) and ``/v1/cluster`` lists every unreachable
  address, from where, and the flag that fixes it (:func:`.routes.unreachable_routes`).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence

import grpc

from ringlet.daemon.cluster.linkprobe import LinkMeasurement, link_kind, measure
from ringlet.daemon.cluster.membership import Member, Membership
from ringlet.daemon.cluster.routes import RouteOption, better, candidates, route_digest, shared_addresses
from ringlet.daemon.probes.interfaces import interface_for_peer, local_addresses, wireless_interfaces
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb

log = logging.getLogger(__name__)

#: Seconds between two measurements of every member's addresses.
LINK_REFRESH_S = 30.0
#: Seconds an address has to answer ``GetNodeInfo`` as the member (a LAN takes milliseconds).
VERIFY_TIMEOUT_S = 1.0


class Router:
    """The routes of one node; attaches itself to ``membership``'s hooks.

    Args:
        membership: the member table (its ``on_unreachable``, ``on_address_changed`` and
            ``on_dial_failed`` hooks are set here).
        addresses: where this node may be dialled (``host:port``), its advertised address
            first (published as the record's ``addresses``).
        on_change: called (no arguments) when a route this node or a member uses changed:
            the negotiator re-plans if the plan's addresses moved.
        thunderbolt: names of this machine's Thunderbolt interfaces (link kinds).
        refresh_s: seconds between two measurements of every member's addresses.
        api_port: the HTTP API's port when it binds every interface: its published ``api_url``
            names the advertised address, unless another member holds that one too (a
            private bridge every host has), then the address the members reach it at.
    """

    def __init__(self, membership: Membership, addresses: Sequence[str], *,
                 on_change: Callable[[], None] | None = None, thunderbolt: frozenset[str] = frozenset(),
                 refresh_s: float = LINK_REFRESH_S, api_port: int | None = None):
        self.membership = membership
        self.addresses = list(dict.fromkeys(addresses))
        self.on_change = on_change or (lambda: None)
        self.thunderbolt = frozenset(thunderbolt)
        self.refresh_s = refresh_s
        self.api_port = api_port
        self.wifi: frozenset[str] = frozenset()
        self._reached: dict[str, dict[str, RouteOption]] = {}  # member -> address -> as last measured
        self._failed: dict[str, dict[str, str]] = {}  # member -> address -> why it did not answer
        self._broken: dict[str, set[str]] = {}  # member -> failed addresses that had answered before
        self._links: dict[str, dict] = {}  # member -> measurement of the address in use
        self._seen: dict[str, str] = {}  # member -> its published routes, to notice a change
        membership.on_unreachable = self.reroute
        membership.on_address_changed = self._moved
        membership.on_dial_failed = self.dial_failed

    # --- what this node knows ------------------------------------------------------------

    def _records(self) -> dict[str, dict]:
        ids = self.membership.alive_ids()
        return {i: self.membership.record_of(i) or {} for i in ids}

    def candidates(self, member: Member) -> list[str]:
        """The addresses ``member`` may be dialled at (the one in use included)."""
        return candidates(member.node_id, self._records(), [member.address])

    def kind(self, address: str, own: frozenset[str] = frozenset()) -> str:
        """The link kind to ``address`` (:func:`.linkprobe.link_kind`)."""
        return link_kind(address.rsplit(":", 1)[0], self.thunderbolt, interface_for_peer, own, self.wifi)

    def _ok(self, node_id: str, option: RouteOption) -> None:
        self._reached.setdefault(node_id, {})[option.address] = option
        self._failed.get(node_id, {}).pop(option.address, None)
        self._broken.get(node_id, set()).discard(option.address)

    def _bad(self, node_id: str, address: str, why: str) -> None:
        member = self.membership.members.get(node_id)
        if address in self._reached.get(node_id, {}) or (member is not None and member.address == address):
            self._broken.setdefault(node_id, set()).add(address)  # it answered before: a route that broke
        self._failed.setdefault(node_id, {})[address] = why
        self._reached.get(node_id, {}).pop(address, None)

    def routes(self) -> dict[str, dict]:
        """This node's routes as published in its record (see :mod:`.routes`)."""
        out = {}
        for node_id in sorted(set(self.membership.members) | set(self.membership.lost)):
            member = self.membership.members.get(node_id)
            reached, failed = self._reached.get(node_id, {}), self._failed.get(node_id, {})
            if member is None and not failed:
                continue
            address = member.address if member is not None and member.address not in failed else None
            reachable = set(reached) | ({address} if address else set())
            out[node_id] = {"address": address, "kind": (reached.get(address) or RouteOption("", "")).kind or None,
                            "reachable": sorted(reachable), "unreachable": dict(sorted(failed.items())),
                            "broken": sorted(self._broken.get(node_id, set()) & set(failed))}
        return out

    def publish(self) -> None:
        """Put ``addresses``, ``links`` (the measurement of each route in use), ``routes`` and
        (see ``api_port``) ``api_url`` in this node's record (its version changes only when
        they did)."""
        record = dict(self.membership.own_record)
        record["addresses"] = list(self.addresses)
        record["links"] = {k: dict(v) for k, v in sorted(self._links.items()) if k in self.membership.members}
        record["routes"] = self.routes()
        if self.api_port is not None and self.addresses:
            shared = shared_addresses({**self._records(), self.membership.node_id: record})
            host = self.addresses[0] if self.addresses[0] not in shared else self.membership.reachable_address()
            record["api_url"] = f"http://{host.rsplit(':', 1)[0]}:{self.api_port}"
        self.membership.set_record(record)

    # --- checking and moving -------------------------------------------------------------

    async def verify(self, node_id: str, address: str, timeout_s: float = VERIFY_TIMEOUT_S) -> str | None:
        """Why ``address`` is not a route to ``node_id`` (``None``: it answered as that node)."""
        try:
            info = await self.membership.stub(address).GetNodeInfo(
                pb.NodeInfoRequest(caller_id=self.membership.node_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        if info.node_id != node_id:
            return "this node itself" if info.node_id == self.membership.node_id else f"answers as {info.node_id}"
        return None

    async def reroute(self, member: Member, code: str) -> bool:
        """A heartbeat to ``member`` failed with ``code``: unless its address answers a second
        try, move it to the best of its other addresses that answers. Returns whether it moved."""
        current = member.address
        others = [a for a in self.candidates(member) if a != current]
        if not others:
            return False  # nowhere else to go: the heartbeats decide
        if await self.verify(member.node_id, current, timeout_s=2 * self.membership.heartbeat_s) is None:
            if current in self._failed.get(member.node_id, {}):  # a failed dial of it was a blip too
                self._ok(member.node_id, self._reached.get(member.node_id, {}).get(current)
                         or RouteOption(current, self.kind(current, local_addresses())))
                self.publish()
            return False  # a beat lost under load, not a broken route
        self._bad(member.node_id, current, code)
        checks = await asyncio.gather(*(self.verify(member.node_id, a) for a in others))
        answered = []
        for address, why in zip(others, checks, strict=True):
            if why is None:
                known = self._reached.get(member.node_id, {}).get(address)
                answered.append(known or RouteOption(address, self.kind(address, local_addresses())))
                self._ok(member.node_id, answered[-1])
            else:
                self._bad(member.node_id, address, why)
        choice = better(None, answered)
        if member.address != current:
            return False  # a handshake moved it meanwhile
        if choice is None:
            log.warning("%s does not answer at %s (%s), nor at %s", member.node_id, current, code,
                        ", ".join(others))
            self.publish()
            return False
        self.membership.use_address(member, choice.address, f"{current} does not answer ({code})")
        return True

    def dial_failed(self, node_id: str, address: str, why: str) -> None:
        """Dialling ``node_id`` at ``address`` failed (a proposal's reachability check): publish
        it, so that the proposer plans over another address; move off it if it is in use."""
        member = self.membership.members.get(node_id)
        if member is None:
            return
        self._bad(node_id, address, why)
        self.publish()
        if address == member.address:
            self.membership.reroute(member, why)

    def _moved(self, member: Member, old: str, why: str) -> None:
        self.publish()
        self.on_change()

    def record_changed(self, member: Member) -> None:
        """A member's record changed: tell the negotiator when its routes or addresses did."""
        mine = route_digest(member.record)
        if self._seen.get(member.node_id) != mine:
            self._seen[member.node_id] = mine
            self.on_change()

    # --- measuring -----------------------------------------------------------------------

    async def measure_member(self, member: Member, own: frozenset[str]) -> None:
        """Check and measure each of ``member``'s addresses; dial it at the best."""
        options: dict[str, tuple[RouteOption, LinkMeasurement]] = {}
        addresses = self.candidates(member)
        others = [a for a in addresses if a != member.address]  # the one in use answers the heartbeats
        checks = dict(zip(others, await asyncio.gather(*(self.verify(member.node_id, a) for a in others)),
                          strict=True))
        for address in addresses:
            if (why := checks.get(address)) is not None:
                self._bad(member.node_id, address, why)
                continue
            kind = self.kind(address, own)
            try:
                m = await measure(self.membership.stub(address), kind)
            except Exception as exc:  # noqa: BLE001 - a failed measurement keeps the old figure
                log.debug("link to %s at %s not measured: %s", member.node_id, address, exc)
                continue
            options[address] = (RouteOption(address, kind, m.bandwidth_bytes_per_s), m)
            self._ok(member.node_id, options[address][0])
        choice = better(member.address, [o for o, _ in options.values()])
        if choice is not None and choice.address != member.address:
            now = options.get(member.address)
            self.membership.use_address(member, choice.address, f"a faster link ({choice.kind}, "
                                        f"{choice.bandwidth_bytes_per_s / 1e6:.1f} MB/s against "
                                        f"{now[1].bandwidth_bytes_per_s / 1e6:.1f} MB/s)" if now else "it answers")
        if member.address in options:
            self._links[member.node_id] = options[member.address][1].to_dict()

    async def run(self) -> None:
        """Measure every member's addresses now, after each membership change and every
        ``refresh_s`` seconds; publish the results in the record. Runs until cancelled."""
        self.wifi = await asyncio.get_running_loop().run_in_executor(None, wireless_interfaces)
        while True:
            # members re-measure after the same membership change: spread the bulk probes so
            # they do not share (and under-read) one node's link
            await asyncio.sleep(random.uniform(0.0, 1.0))  # noqa: S311 - jitter, not crypto
            own = local_addresses()  # this machine's addresses, once a round
            for member in list(self.membership.members.values()):
                await self.measure_member(member, own)
            for gone in set(self._links) - set(self.membership.members):
                self._links.pop(gone)
            for gone in (set(self._reached) | set(self._failed)) - set(self.membership.members) - set(
                    self.membership.lost):
                self._reached.pop(gone, None)
                self._failed.pop(gone, None)
                self._broken.pop(gone, None)
            self.publish()
            try:
                await asyncio.wait_for(self.membership.links_wanted.wait(), timeout=self.refresh_s)
            except TimeoutError:
                pass
            self.membership.links_wanted.clear()
