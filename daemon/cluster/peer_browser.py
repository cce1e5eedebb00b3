"""Browsing for peers over mDNS: listen for adverts, resolve them, admit or drop the peers.

Every ``_ringlet._tcp.local.`` instance the browser sees is resolved (cache
first, at most :data:`MAX_PENDING_RESOLVES` at once), its TXT record checked
(:func:`~ringlet.daemon.cluster.advert.parse_txt`: cluster, version, signature),
and the peer reported through ``on_peer`` when it appears or its endpoint
changes. A removed instance, or one whose advert became invalid, is reported
through ``on_goodbye``, unless another cached incarnation of that node id
answers a fresh query (a clone, or a crashed earlier run: only a live one is
reported). An advert carrying *our* node id is a clone of this node, judged by
:func:`~ringlet.daemon.cluster.identity.should_yield`. Every record heard is
noted (:class:`HeardListener`), which is how a fresh query tells who answered.

A lookup that fails (no answer within :data:`RESOLVE_TIMEOUT_MS`: a busy peer, a lost
packet) is not the end of that peer: it is tried again after :data:`RETRY_FIRST_S`,
doubling up to :data:`RETRY_MAX_S` (with jitter), for as long as the name is advertised
(at most :data:`RETRY_FOR_S`), and at once (at most once a second) when any record of
that name is heard again (the peer announced itself anew).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import time

from zeroconf import (
    DNSOutgoing,
    DNSQuestion,
    DNSQuestionType,
    IPVersion,
    RecordUpdate,
    RecordUpdateListener,
    ServiceStateChange,
    Zeroconf,
)
from zeroconf.asyncio import AsyncServiceInfo

from ringlet.daemon.cluster.advert import (
    SERVICE_TYPE,
    Advert,
    AdvertError,
    IncompatibleVersion,
    OtherCluster,
    parse_txt,
)
from ringlet.daemon.cluster.discovery_base import MAX_TRACKED, DiscoveryBase
from ringlet.daemon.cluster.identity import should_yield

#: Set in a model's lane of a node serving several models (ops/lanes.py).
LANE_ENV = "RINGLET_LANE"

__all__ = [
    "CLASS_IN",
    "FLAGS_QR_QUERY",
    "FRESH_ANSWER_WAIT_S",
    "MAX_PENDING_RESOLVES",
    "RESOLVE_TIMEOUT_MS",
    "RETRY_FIRST_S",
    "RETRY_FOR_S",
    "RETRY_MAX_S",
    "TYPE_PTR",
    "TYPE_SRV",
    "TYPE_TXT",
    "BrowserMixin",
    "HeardListener",
]

# All of discovery logs under one name (its parts live in several modules).
log = logging.getLogger("ringlet.daemon.cluster.discovery")

#: How long to wait for a peer's SRV/TXT/A records when they are not in the cache, ms.
RESOLVE_TIMEOUT_MS = 1000
#: How long to wait for answers to a fresh query, seconds. A responder that
#: multicast a record in the last second delays its answer by 1 s + 20-120 ms
#: (RFC 6762 section 14; zeroconf's delay queue); others answer in 20-120 ms.
FRESH_ANSWER_WAIT_S = 1.5
#: At most this many peer resolutions run at once; beyond, new names are dropped
#: (logged) until some finish. Bounds work under an advert flood.
MAX_PENDING_RESOLVES = 64
#: A failed lookup is tried again after this many seconds, then after twice as long each
#: time, up to :data:`RETRY_MAX_S` (each delay jittered by +-20 %).
RETRY_FIRST_S = 1.0
#: The longest wait between two lookups of a name that did not answer, seconds.
RETRY_MAX_S = 30.0
#: How long a name that never answers is looked up again, seconds: a killed node's
#: records outlive it ~19 minutes (PTR TTL), after which zeroconf removes the name.
RETRY_FOR_S = 1200.0
#: A name that failed is looked up again when its records are heard, at most this often, s.
HEARD_RETRY_MIN_S = 1.0

# DNS constants (RFC 1035).
FLAGS_QR_QUERY = 0x0000
TYPE_PTR = 12
TYPE_TXT = 16
TYPE_SRV = 33
CLASS_IN = 1


class HeardListener(RecordUpdateListener):
    """Notes when any record of a ringlet instance arrives (refreshes included)."""

    def __init__(self, owner: BrowserMixin) -> None:
        super().__init__()
        self._owner = owner

    def async_update_records(self, zc: Zeroconf, now: float, records: list[RecordUpdate]) -> None:
        try:
            self._owner._note_heard(records)
        except Exception:  # never raise into zeroconf
            log.exception("internal error while noting mDNS records")


class BrowserMixin(DiscoveryBase):
    """The browsing half of :class:`~ringlet.daemon.cluster.discovery.Discovery`: peers of the same cluster."""

    def _send_fresh_query(self, name: str, type_: int) -> None:
        """Multicast a QM question with no known answers, so every live responder answers."""
        if self._aiozc is None:
            return
        out = DNSOutgoing(FLAGS_QR_QUERY, True)
        out.add_question(DNSQuestion(name, type_, CLASS_IN))
        self._aiozc.zeroconf.async_send(out)

    # -- zeroconf callbacks ------------------------------------------------------

    def _note_heard(self, records: list[RecordUpdate]) -> None:
        now = time.monotonic()
        suffix = "." + SERVICE_TYPE
        for update in records:
            rec = update.new
            if rec.ttl == 0:
                continue
            if rec.type == TYPE_PTR and rec.name.lower() == SERVICE_TYPE:
                name = rec.alias.lower()  # type: ignore[attr-defined]
            elif rec.type in (TYPE_SRV, TYPE_TXT) and rec.name.lower().endswith(suffix):
                name = rec.name.lower()
            else:
                continue
            if name in self._last_heard or len(self._last_heard) < MAX_TRACKED:
                self._last_heard[name] = now
            failed = self._unresolved.get(name)
            if (failed is not None and self._running and name not in self._resolving
                    and now - failed[2] >= HEARD_RETRY_MIN_S):
                self._schedule_resolve(name)  # it announced itself again: look it up now

    def _on_state_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        try:
            if not self._running:
                return
            key = name.lower()
            if key in self._own_names:
                return
            if state_change is ServiceStateChange.Removed:
                self._handle_removed(key)
            else:
                self._schedule_resolve(key)
        except Exception:  # never raise into zeroconf
            log.exception("mDNS: internal error handling %s %s", state_change, name)

    def _schedule_resolve(self, name: str) -> None:
        if name in self._resolving:
            self._resolve_again.add(name)
            return
        if len(self._resolving) >= MAX_PENDING_RESOLVES:
            self._log_once(name, "flood", logging.WARNING, "mDNS: too many adverts at once; dropped %s", name)
            return
        self._resolving.add(name)
        self._track(self._resolve_task(name))

    async def _resolve_task(self, name: str) -> None:
        try:
            await self._resolve(name)
        finally:
            self._resolving.discard(name)
        if name in self._resolve_again and self._running:
            self._resolve_again.discard(name)
            self._schedule_resolve(name)

    async def _resolve(self, name: str, *, force: bool = False) -> Advert | None:
        """Fetch a peer's records (cache first) and hand them to :meth:`_handle_info`."""
        zc = self._aiozc.zeroconf if self._aiozc is not None else None
        if zc is None:
            return None
        try:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            ok = await info.async_request(zc, RESOLVE_TIMEOUT_MS, question_type=DNSQuestionType.QM)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._ignore(name, AdvertError(f"cannot resolve: {type(e).__name__}: {e}"))
            return None
        if not self._running:
            return None
        if not ok:
            self._log_once(
                name,
                "unresolved",
                logging.INFO,
                "mDNS: %s did not answer within %d ms; looking it up again (after %.0f s, then longer)",
                name,
                RESOLVE_TIMEOUT_MS,
                RETRY_FIRST_S,
            )
            self._retry_later(name)
            return None
        failed = self._unresolved.pop(name, None)
        if failed is not None:
            log.info("mDNS: %s answered on lookup %d (%.1f s after the first failed)", name, failed[0] + 1,
                     time.monotonic() - failed[1])
        return self._handle_info(name, info, force=force)

    def _retry_later(self, name: str) -> None:
        """Look ``name`` up again later (see the module docstring for when)."""
        now = time.monotonic()
        attempts, since, _ = self._unresolved.get(name, (0, now, now))
        if now - since > RETRY_FOR_S:
            self._unresolved.pop(name, None)
            self._log_once(name, "gave-up", logging.INFO, "mDNS: %s did not answer for %.0f s; no longer looked up",
                           name, now - since)
            return
        if name not in self._unresolved and len(self._unresolved) >= MAX_TRACKED:
            return
        self._unresolved[name] = (attempts + 1, since, now)
        if name in self._retrying:
            return
        self._retrying.add(name)
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2**attempts) * random.uniform(0.8, 1.2)  # noqa: S311 - jitter
        self._track(self._retry(name, delay))

    async def _retry(self, name: str, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            self._retrying.discard(name)
        if self._running and name in self._unresolved:
            self._schedule_resolve(name)

    def _handle_info(self, name: str, info: AsyncServiceInfo, *, force: bool = False) -> Advert | None:
        try:
            addresses = tuple(sorted(info.parsed_addresses(IPVersion.V4Only), key=ipaddress.IPv4Address))
            advert = parse_txt(
                info.properties,
                secret=self._secret,
                cluster_id=self._cluster_id,
                addresses=addresses,
                txt_bytes=len(info.text or b""),
            )
            if advert.instance_name != name:
                raise AdvertError(f"instance name does not match TXT id/incarnation ({advert.instance_name})")
            if info.port != advert.grpc_port:
                raise AdvertError(f"SRV port {info.port} differs from TXT gRPC port {advert.grpc_port}")
            if not addresses:
                raise AdvertError("no IPv4 address in the advert")
        except AdvertError as e:
            self._ignore(name, e)
            if isinstance(e, IncompatibleVersion) and e.node_id and e.cluster_id == self._cluster_id and info.port:
                # of this cluster: its handshake keeps it out, saying why
                self._call(self._on_incompatible, (e.node_id, [f"{a}:{info.port}" for a in addresses]))
            return None
        return self._accept(name, advert, force=force)

    def _accept(self, name: str, advert: Advert, *, force: bool) -> Advert | None:
        if advert.node_id == self._node_id:
            self._handle_conflict(name, advert)
            return None
        self._instances[name] = advert
        current = self._peers.get(advert.node_id)
        if current is not None and current.instance_name != name:
            if (advert.started_at_ms, advert.incarnation) < (current.started_at_ms, current.incarnation):
                return None  # an older incarnation of a node we already know
        if current is not None and current.same_endpoint(advert) and not force:
            self._peers[advert.node_id] = advert
            return advert
        self._peers[advert.node_id] = advert
        self._call(self._on_peer, advert)
        return advert

    def _handle_conflict(self, name: str, advert: Advert) -> None:
        if name in self._conflicts:
            return
        self._conflicts.add(name)
        where = ",".join(advert.addresses)
        if should_yield(self._started_at_ms, self._incarnation, advert.started_at_ms, advert.incarnation):
            log.warning(
                "mDNS: node id %s is also used by a live node at %s (started %d ms, incarnation %s); "
                "this node started later (%d ms, %s), so it must take a fresh id",
                self._node_id,
                where,
                advert.started_at_ms,
                advert.incarnation,
                self._started_at_ms,
                self._incarnation,
            )
            self._call(self._on_conflict, advert)
        else:
            log.warning(
                "mDNS: node id %s is also used by a newer node at %s (started %d ms); that node should take a fresh id",
                self._node_id,
                where,
                advert.started_at_ms,
            )

    def _handle_removed(self, name: str) -> None:
        self._last_heard.pop(name, None)
        self._unresolved.pop(name, None)
        self._resolve_again.discard(name)
        self._conflicts.discard(name)
        advert = self._instances.pop(name, None)
        if advert is None:
            return
        current = self._peers.get(advert.node_id)
        if current is None or current.instance_name != name:
            return
        del self._peers[advert.node_id]
        others = [(n, a) for n, a in self._instances.items() if a.node_id == advert.node_id]
        if others:
            # Another incarnation of the same id is cached: a clone, or a crashed
            # earlier run whose records outlive it. Report it only if it answers.
            self._track(self._promote_or_goodbye(advert.node_id, others))
        else:
            self._call(self._on_goodbye, advert.node_id)

    async def _promote_or_goodbye(
        self, node_id: str, candidates: list[tuple[str, Advert]], timeout: float = FRESH_ANSWER_WAIT_S
    ) -> None:
        t0 = time.monotonic()
        for name, _ in candidates:
            self._send_fresh_query(name, TYPE_SRV)
        while time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.02)
            if any(self._last_heard.get(n, 0.0) >= t0 for n, _ in candidates):
                break
        alive = [(a.started_at_ms, a.incarnation, n) for n, a in candidates if self._last_heard.get(n, 0.0) >= t0]
        for n, _ in candidates:
            if all(n != x[2] for x in alive):
                self._instances.pop(n, None)
        if not self._running or node_id in self._peers:
            return
        if alive:
            await self._resolve(max(alive)[2], force=True)
        else:
            self._call(self._on_goodbye, node_id)

    def _ignore(self, name: str, err: AdvertError) -> None:
        # a model's lane (ops/lanes.py) sees its node's other models' adverts: expected, not a warning
        level = logging.DEBUG if isinstance(err, OtherCluster) and os.environ.get(LANE_ENV) else logging.WARNING
        self._log_once(name, err.reason, level, "mDNS: ignoring advert %s: %s", name, err)
        advert = self._instances.pop(name, None)
        if advert is not None:
            current = self._peers.get(advert.node_id)
            if current is not None and current.instance_name == name:
                del self._peers[advert.node_id]
                self._call(self._on_goodbye, advert.node_id)
