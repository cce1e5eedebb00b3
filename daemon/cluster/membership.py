"""Membership: who is in the cluster, what each member is, and whether it is alive.

An mDNS advert, a ``--peers`` address or a peer's heartbeat naming a node we do not know
leads to a handshake (``GetNodeInfo``): the peer's id, protocol version, cluster id and its
*record* (probe, usable memory, measured links, API URL). A successful handshake makes the
peer a member, once it has a record (a daemon answers before its cluster starts: retried);
one of another protocol version is kept out, with the reason (:mod:`.incompatible`).

Liveness comes from heartbeats, never from mDNS (a killed node's mDNS records live ~19
minutes in peers' caches). Every node sends ``Beat`` to every member every ``heartbeat_s``;
a failed or missed beat makes the member *suspect*, and a member not heard from for
``remove_after_s`` is removed. A clean mDNS goodbye marks it suspect at once. Each node owns
its record and versions it; a beat's reply carries the responder's record version, and a
newer version is fetched, so every member converges on the same records (gossip: replies
also list the responder's members, and unknown ones are handshaken).

Members learn members from members (beats, proposals, refusals: :meth:`Membership.learn`), by
the same handshake as an mDNS advert. A failed dial drops that address's channel, so the next
connects afresh: a cached channel's reconnect backoff (doubling to 2 minutes while a peer was
down) must not keep a restarted peer out once it answers again.

A member may answer at several addresses; it is dialled at :attr:`Member.address`, which only
:meth:`Membership.use_address` changes (the address in use stopped answering and another
does, or a faster link was measured: :mod:`ringlet.daemon.cluster.router`), never a
handshake at another address while the one in use works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import grpc

from ringlet.daemon.cluster.incompatible import Incompatible
from ringlet.daemon.cluster.member import Member, membership_digest
from ringlet.daemon.wire import versions
from ringlet.daemon.wire.rpc import ringlet_pb2 as pb
from ringlet.daemon.wire.rpc import ringlet_pb2_grpc as pb_grpc
from ringlet.daemon.wire.transport import TransportConfig, make_channel

log = logging.getLogger(__name__)

#: How long a removed member's address is re-dialled, seconds.
LOST_MEMORY_S = 600.0
#: A channel dropped after a failed dial is closed this much later, seconds.
RETIRED_CLOSE_S = 30.0


class Membership:
    """The member table of one node, kept alive by heartbeats.

    Args:
        node_id: this node's id.
        address: this node's gRPC ``host:port`` as peers should dial it.
        cluster_id: hash of the cluster name; peers of another cluster are refused.
        incarnation: this process's incarnation.
        transport: gRPC settings for the channels to members.
        heartbeat_s: seconds between beats to each member.
        suspect_after_s: silence after which a member is suspect, seconds.
        remove_after_s: silence after which a member is removed, seconds.
        on_change: called (no arguments) after a member joins or leaves.
        on_event: called with ``(kind, message)`` for the event log.
    """

    def __init__(self, node_id: str, address: str, cluster_id: str, incarnation: str,
                 transport: TransportConfig, *, heartbeat_s: float = 0.5, suspect_after_s: float = 1.0,
                 remove_after_s: float = 2.0, on_change: Callable[[], None] | None = None,
                 on_event: Callable[[str, str], None] | None = None,
                 epoch_fn: Callable[[], tuple[int, str]] | None = None):
        self.node_id, self.address, self.cluster_id, self.incarnation = node_id, address, cluster_id, incarnation
        self.transport, self.heartbeat_s, self.suspect_after_s = transport, heartbeat_s, suspect_after_s
        self.remove_after_s = remove_after_s
        self.on_change, self.on_event = on_change or (lambda: None), on_event or (lambda kind, msg: None)
        self.incompatible = Incompatible(self.on_event)  # nodes of another protocol version, kept out
        self.epoch_fn = epoch_fn or (lambda: (0, ""))
        self.members: dict[str, Member] = {}
        self._record, self.record_version = {}, 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[tuple[float, grpc.aio.Channel]] = []  # dropped channels, closed later
        self._pending: set[str] = set()  # addresses being handshaken
        self._refused: dict[str, float] = {}  # address -> monotonic time of the last refusal
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        #: removed members: node id -> (address, monotonic time of removal)
        self.lost: dict[str, tuple[str, float]] = {}
        #: node id -> why it was last removed ("stopped" for a graceful leave)
        self.departed: dict[str, str] = {}
        #: member id -> the address that member reaches this node at (from its beats)
        self.seen_as: dict[str, str] = {}
        #: set when links should be measured again (membership changed)
        self.links_wanted = asyncio.Event()
        self.on_member_added: Callable[[Member], Awaitable[None] | None] | None = None
        #: called with a member whose record changed (a newer version was fetched)
        self.on_record_changed: Callable[[Member], None] | None = None
        #: set by :meth:`announce_leave`: this node is draining and admits no one
        self.leaving = False
        #: awaited (in a task) with a member whose address failed a heartbeat and the gRPC
        #: code's name; it may move the member to another address (:meth:`use_address`).
        #: The member is not removed while it runs.
        self.on_unreachable: Callable[[Member, str], Awaitable[object]] | None = None
        #: called with ``(member, old address, why)`` after :meth:`use_address` moved a member
        self.on_address_changed: Callable[[Member, str, str], None] | None = None
        #: called with ``(node id, address, why)`` when dialling a member there failed outside
        #: the heartbeats (a proposal's reachability check)
        self.on_dial_failed: Callable[[str, str, str], None] | None = None
        self.rerouting: set[str] = set()  # members whose on_unreachable runs

    # --- own record --------------------------------------------------------------------

    @property
    def own_record(self) -> dict:
        """This node's record (JSON-safe dict)."""
        return self._record

    def set_record(self, record: dict) -> None:
        """Replace this node's record; bumps the version when it changed."""
        if record != self._record:
            self._record = record
            self.record_version += 1

    # --- views ---------------------------------------------------------------------------

    def alive_ids(self) -> list[str]:
        """Ids of this node and every member not removed, sorted."""
        return sorted([self.node_id, *self.members])

    def digest(self) -> str:
        """Digest of :meth:`alive_ids` (see :func:`membership_digest`)."""
        return membership_digest(self.alive_ids())

    def views_agree(self) -> bool:
        """Every alive member's last beat reported this node's view (:meth:`digest`)."""
        mine = self.digest()
        return all(m.digest == mine for m in self.members.values() if m.state == "alive")

    def reachable_address(self) -> str:
        """The address this node's stage goes by in a plan: the one most of its alive
        members reach it at (each member's beats list the address it has for this node,
        verified by its own handshake), else the advertised :attr:`address`. A node whose
        first interface is a bridge its peers cannot route to (``docker0`` 172.17.0.1 on
        every Docker host) thus stands in the plan at the address that works."""
        counts = Counter(a for i, a in self.seen_as.items() if i in self.members and self.members[i].state == "alive")
        if not counts:
            return self.address
        best = max(counts.values())
        return self.address if counts[self.address] == best else min(a for a, n in counts.items() if n == best)

    def address_of(self, node_id: str) -> str | None:
        """The address ``node_id`` is dialled at: a member's as this node reached it, this
        node's own as its members reach it (:meth:`reachable_address`)."""
        if node_id == self.node_id:
            return self.reachable_address()
        m = self.members.get(node_id)
        return m.address if m else None

    def record_of(self, node_id: str) -> dict | None:
        if node_id == self.node_id:
            return self._record
        m = self.members.get(node_id)
        return m.record if m else None

    def channel(self, address: str) -> grpc.aio.Channel:
        """A cached channel to ``address`` (its own connection: see :meth:`_drop_channel`)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = make_channel(self.transport, address, own_connection=True)
            self._channels[address] = ch
        return ch

    def stub(self, address: str) -> pb_grpc.RingStub:
        return pb_grpc.RingStub(self.channel(address))

    def _drop_channel(self, address: str) -> None:
        """Forget the channel to ``address`` unless a member is dialled there: the next dial
        connects afresh, not after the channel's reconnect backoff (minutes while a peer
        is down). Closed :data:`RETIRED_CLOSE_S` later: calls in flight on it end as usual."""
        if any(m.address == address for m in self.members.values()):
            return
        now = time.monotonic()
        while self._retired and now - self._retired[0][0] > RETIRED_CLOSE_S:
            self._spawn(self._retired.pop(0)[1].close())
        ch = self._channels.pop(address, None)
        if ch is not None:
            self._retired.append((now, ch))

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the heartbeat loop."""
        self._task = asyncio.create_task(self._beat_loop(), name="heartbeats")

    async def stop(self) -> None:
        """Stop beating and close channels."""
        for t in [self._task, *self._tasks]:
            if t is not None:
                t.cancel()
        for t in [self._task, *self._tasks]:
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        for ch in [*self._channels.values(), *(ch for _, ch in self._retired)]:
            await ch.close()
        self._channels.clear()
        self._retired.clear()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- joining -------------------------------------------------------------------------

    def consider(self, address: str, node_id: str | None = None) -> None:
        """A node may be reachable at ``address`` (advert, --peers, gossip): handshake
        with it in the background unless it is already a member."""
        if self.leaving or node_id == self.node_id or address == self.address:
            return
        if node_id is not None and node_id in self.members and self.members[node_id].address == address:
            return
        if address in self._pending:
            return
        refused = self._refused.get(address)
        if refused is not None and time.monotonic() - refused < 2.0:
            return
        self._pending.add(address)
        self._spawn(self._handshake(address))

    async def _handshake(self, address: str) -> None:
        try:
            info = await self.stub(address).GetNodeInfo(
                pb.NodeInfoRequest(caller_id=self.node_id, caller_address=self.address),
                timeout=max(2.0, 4 * self.heartbeat_s))
        except grpc.aio.AioRpcError as exc:
            self._refuse(address, f"no gRPC handshake ({exc.code().name}); retrying quietly")
            self._drop_channel(address)
            return
        finally:
            self._pending.discard(address)
        if info.cluster_id != self.cluster_id:
            self._refuse(address, "another cluster")
            return
        if info.protocol_version != versions.PROTOCOL_VERSION:  # kept out, with the reason
            self._refuse(address, self.incompatible.seen(info.node_id, address, info.protocol_version,
                                                         info.record_json))
            return
        if info.node_id == self.node_id or self.leaving:
            return
        if info.leaving:
            self._refuse(address, f"{info.node_id} is stopping")
            return
        if not info.record_version:  # its gRPC answers before its cluster starts (servicer.GetNodeInfo)
            self._refuse(address, f"{info.node_id} is still starting (no record yet); retrying quietly")
            return
        self._admit(info, address)

    def _refuse(self, address: str, why: str) -> None:
        if address not in self._refused:
            log.info("ignoring the node at %s: %s", address, why)
        self._refused[address] = time.monotonic()

    def _admit(self, info: pb.NodeInfo, address: str) -> None:
        try:
            record = json.loads(info.record_json) if info.record_json else {}
        except ValueError:
            record = {}
        existing = self.members.get(info.node_id)
        self.incompatible.admitted(info.node_id)
        if existing is not None:
            changed = existing.record != record
            if address != existing.address and (existing.failures or existing.state != "alive"):
                self.use_address(existing, address, f"{existing.address} stopped answering; it answers here")
            existing.record, existing.record_version = record, info.record_version
            existing.incarnation = info.incarnation
            existing.state, existing.last_ok = "alive", time.monotonic()
            if changed and self.on_record_changed is not None:
                self.on_record_changed(existing)
            return
        member = Member(node_id=info.node_id, address=address, incarnation=info.incarnation, record=record,
                        record_version=info.record_version)
        self.members[info.node_id] = member
        log.info("member joined: %s at %s", info.node_id, address)
        self.on_event("join", f"{info.node_id} joined from {address}")
        if self.on_member_added is not None:
            result = self.on_member_added(member)
            if asyncio.iscoroutine(result):
                self._spawn(result)
        self.on_change()

    def use_address(self, member: Member, address: str, why: str) -> None:
        """Dial ``member`` at ``address`` from now on (the caller has seen it answer there as
        that member): heartbeats, proposals and this node's plan routes go there."""
        old = member.address
        if address == old or self.members.get(member.node_id) is not member:
            return
        member.address, member.failures, member.last_ok, member.state = address, 0, time.monotonic(), "alive"
        log.info("reaching %s at %s instead of %s: %s", member.node_id, address, old, why)
        self.on_event("route", f"{member.node_id} reached at {address}, not {old}: {why}")
        if self.on_address_changed is not None:
            self.on_address_changed(member, old, why)

    def reroute(self, member: Member, why: str) -> None:
        """Run :attr:`on_unreachable` for ``member`` in a task, unless it runs already."""
        if self.on_unreachable is not None and member.node_id not in self.rerouting:
            self.rerouting.add(member.node_id)
            self._spawn(self._reroute(member, why))

    async def _reroute(self, member: Member, code: str) -> None:
        try:
            await self.on_unreachable(member, code)
        except Exception:  # a failed reroute leaves the member to the heartbeats
            log.exception("rerouting %s failed", member.node_id)
        finally:
            self.rerouting.discard(member.node_id)

    def redial_lost(self) -> bool:
        """Handshake again with members removed in the last :data:`LOST_MEMORY_S` (a cut
        link that came back, a restarted node). Returns whether any are still lost."""
        now = time.monotonic()
        for node_id, (address, when) in list(self.lost.items()):
            if node_id in self.members or now - when > LOST_MEMORY_S:
                self.lost.pop(node_id, None)
            else:
                self.consider(address, node_id)
        return bool(self.lost)

    def remove(self, node_id: str, why: str) -> None:
        """Remove a member now (missed heartbeats, goodbye confirmed). Its address is
        remembered for :data:`LOST_MEMORY_S` so it can be re-dialled when it comes back."""
        member = self.members.pop(node_id, None)
        if member is None:
            return
        self.lost[node_id] = (member.address, time.monotonic())
        self._drop_channel(member.address)
        self.departed[node_id] = why
        while len(self.departed) > 256:
            self.departed.pop(next(iter(self.departed)))
        self.seen_as.pop(node_id, None)
        log.warning("member left: %s (%s)", node_id, why)
        self.on_event("leave", f"{node_id} left: {why}")
        self.on_change()

    def suspect(self, node_id: str, why: str) -> None:
        """Mark a member suspect (it is removed if it stays silent)."""
        member = self.members.get(node_id)
        if member is not None and member.state != "suspect":
            member.state = "suspect"
            log.info("member suspect: %s (%s)", node_id, why)
            self.on_event("suspect", f"{node_id} suspect: {why}")

    # --- heartbeats ----------------------------------------------------------------------

    def member_digests(self) -> list[pb.MemberDigest]:
        """This node's alive members as they travel in beats and refusals: id, the address
        this node dials it at, its record version."""
        return [pb.MemberDigest(node_id=m.node_id, grpc_address=m.address, record_version=m.record_version)
                for m in self.members.values() if m.state == "alive"]

    def learn(self, listed) -> int:
        """:meth:`consider` each ``(node id, address)`` another member listed (beats,
        proposals, refusals) that is not a member yet; returns how many were unknown."""
        unknown = 0
        for node_id, address in listed:
            if node_id and address and node_id != self.node_id and node_id not in self.members:
                unknown += 1
                self.consider(address, node_id)
        return unknown

    def make_beat(self) -> pb.Heartbeat:
        """This node's heartbeat message."""
        epoch, plan_id = self.epoch_fn()
        return pb.Heartbeat(
            sender_id=self.node_id, incarnation=self.incarnation, record_version=self.record_version,
            members=self.member_digests(), committed_epoch=epoch, plan_id=plan_id, grpc_address=self.address,
            membership_digest=self.digest())

    def on_beat(self, beat: pb.Heartbeat) -> pb.Heartbeat:
        """Handle a peer's heartbeat; returns ours. A beat marked ``leaving`` removes
        its sender at once, as ``stopped`` (see :meth:`announce_leave`)."""
        member = self.members.get(beat.sender_id)
        if beat.leaving:
            if member is not None:
                self.remove(member.node_id, "stopped")
            self.lost.pop(beat.sender_id, None)  # it left on purpose: do not re-dial it
            return self.make_beat()
        if member is None:
            if beat.grpc_address:
                self.consider(beat.grpc_address, beat.sender_id)
        else:
            self._heard(member, beat)
        return self.make_beat()

    def _heard(self, member: Member, beat: pb.Heartbeat) -> None:
        member.last_ok = time.monotonic()
        if member.state != "alive":
            member.state = "alive"
            self.on_event("alive", f"{member.node_id} is alive again")
        member.committed_epoch, member.plan_id = beat.committed_epoch, beat.plan_id
        member.digest = beat.membership_digest
        if beat.incarnation and member.incarnation and beat.incarnation != member.incarnation:
            member.incarnation = beat.incarnation
            self.on_event("restart", f"{member.node_id} restarted")
        if beat.record_version != member.record_version:
            self.consider_refresh(member)
        for digest in beat.members:
            if digest.node_id == self.node_id and digest.grpc_address:
                self.seen_as[member.node_id] = digest.grpc_address  # how it reaches us: a route that works
        self.learn((d.node_id, d.grpc_address) for d in beat.members)

    def consider_refresh(self, member: Member) -> None:
        """Fetch a member's newer record (another handshake to the same address)."""
        if member.address not in self._pending:
            self._pending.add(member.address)
            self._spawn(self._handshake(member.address))

    async def announce_leave(self, timeout_s: float) -> list[str]:
        """Tell every member that this node is stopping, and stop beating and admitting.

        Each member removes this node at once (``left: stopped``) and re-plans without
        it, instead of waiting for missed heartbeats. Returns the addresses of the
        members that acknowledged within ``timeout_s`` seconds (the others learn it
        from silence)."""
        self.leaving = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        beat = self.make_beat()
        beat.leaving = True
        members = list(self.members.values())

        async def tell(member: Member) -> str | None:
            try:
                await self.stub(member.address).Beat(beat, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.info("leave not acknowledged by %s: %s", member.node_id, exc.code().name)
                return None
            return member.address

        acked = await asyncio.gather(*(tell(m) for m in members))
        return [a for a in acked if a is not None]

    async def _beat_one(self, member: Member) -> None:
        try:
            reply = await self.stub(member.address).Beat(self.make_beat(), timeout=2 * self.heartbeat_s)
        except grpc.aio.AioRpcError as exc:
            member.failures += 1
            self.suspect(member.node_id, f"heartbeat failed ({exc.code().name})")
            if member.failures == 1:  # once a streak: another of its addresses may answer
                self.reroute(member, exc.code().name)
            # Unavailable twice in a row (>= one heartbeat apart): the process died
            # (connection refused) or the route is gone (a cut link). Remove now rather
            # than after the silence timeout; a lost member is re-dialled (redial_lost).
            if (exc.code() == grpc.StatusCode.UNAVAILABLE and member.failures >= 2
                    and time.monotonic() - member.last_ok >= self.heartbeat_s
                    and member.node_id not in self.rerouting):
                self.remove(member.node_id, f"unreachable at {member.address} (connection refused or no route)")
            return
        member.failures = 0
        if reply.sender_id != member.node_id:
            self.remove(member.node_id, f"{member.address} now answers as {reply.sender_id}")
            self.consider(member.address, reply.sender_id)
            return
        self._heard(member, reply)

    async def _beat_loop(self) -> None:
        while True:
            started = time.monotonic()
            members = list(self.members.values())
            if members:
                await asyncio.gather(*(self._beat_one(m) for m in members), return_exceptions=True)
            now = time.monotonic()
            for m in list(self.members.values()):
                silent = now - m.last_ok
                if m.node_id in self.rerouting:
                    continue  # its other addresses are being tried
                if silent > self.remove_after_s:
                    self.remove(m.node_id, f"silent for {silent:.1f} s at {m.address}")
                elif silent > self.suspect_after_s:
                    self.suspect(m.node_id, f"silent for {silent:.1f} s")
            await asyncio.sleep(max(0.0, self.heartbeat_s - (time.monotonic() - started)))

    # --- introspection -------------------------------------------------------------------

    def info(self) -> list[dict]:
        """Every member (this node first) as JSON-safe dicts."""
        now = time.monotonic()
        out = [{"node_id": self.node_id, "grpc_address": self.address, "state": "self", "record_version":
                self.record_version, "record": self._record, **versions.member_versions(self._record)}]
        for m in sorted(self.members.values(), key=lambda m: m.node_id):
            out.append({"node_id": m.node_id, "grpc_address": m.address, "state": m.state,
                        "record_version": m.record_version, "record": m.record, **versions.member_versions(m.record),
                        "silent_s": round(now - m.last_ok, 3), "committed_epoch": m.committed_epoch})
        return out
