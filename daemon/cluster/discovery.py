"""mDNS discovery: advertise this node and find peers (python-zeroconf, asyncio API).

Service type ``_ringlet._tcp.local.``; one service instance per daemon, named
``<node_id>-<incarnation>._ringlet._tcp.local.``. The name is unique by
construction (the incarnation is random per process), so registration skips
mDNS probing (``cooperating_responders=True``): about 1-4 ms instead of ~1.1 s
(measured, issue 4). Even two nodes with the same node id (a cloned disk) get
distinct names, which is how the clone is seen (see ``on_conflict``).

The TXT record carries only what is needed to connect (issue 4, DESIGN.md):

====== ===================================================== =================
key    value                                                 example
====== ===================================================== =================
``v``  protocol version, decimal (:data:`PROTOCOL_VERSION`)   ``1``
``id`` node id (:data:`~ringlet.daemon.cluster.identity.NODE_ID_RE`)  ``3f9c0a17b2e45d68``
``in`` incarnation, 8 hex, random per process                 ``a1b2c3d4``
``st`` process start, unix milliseconds (decides clones)      ``1733000000123``
``g``  gRPC port, 1..65535 (also the SRV port)                ``50051``
``a``  HTTP API port, 1..65535                                ``8080``
``c``  cluster id (:func:`~ringlet.daemon.cluster.identity.cluster_id`) ``9e107d9d372bb682``
``ts`` with a secret only: signing time, unix seconds        ``1733000000``
``sig`` with a secret only: HMAC-SHA256, 64 hex chars         ...
====== ===================================================== =================

Addresses come from the A records of the service, not from TXT. Everything
else about a peer comes over gRPC.

Signatures (issue 7). With a cluster secret, ``sig`` is HMAC-SHA256 keyed with
``HMAC(secret, "ringlet/mdns-advert/v1")`` (a key of its own, so the RPC layer
can derive others from the same secret) over every TXT key/value except
``sig``, sorted by key, each length-prefixed (see :func:`canonical_txt`). A
receiver with the secret rejects an advert without a valid signature, or whose
``ts`` is more than :data:`SIGNATURE_WINDOW_S` away from its own clock; the
advertiser re-signs every :data:`RESIGN_INTERVAL_S` so that cached adverts stay
fresh. This needs clocks within a few minutes of each other (NTP). What the
signature does not do: it does not cover the addresses (A records), and an
advert captured on the link can be replayed within the window. Both only make
a node try to connect somewhere; the authenticated gRPC handshake decides
membership, so the worst case is a wasted connection attempt.

Liveness is NOT decided here. A killed node's records stay in peers' caches
for ~19 min (PTR TTL floor); only a clean :meth:`Discovery.stop` sends a
goodbye, seen within milliseconds. Heartbeats over gRPC detect failures; after
a link comes back, call :meth:`Discovery.refresh` to re-learn who is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import inspect
import ipaddress
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
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
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from ringlet.daemon.cluster.identity import (
    INCARNATION_RE,
    NODE_ID_RE,
    PROTOCOL_VERSION,
    NodeIdentity,
    cluster_id,
    new_incarnation,
    should_yield,
    validate_node_id,
)

log = logging.getLogger(__name__)

__all__ = [
    "ADDRESS_POLL_S",
    "FRESH_ANSWER_WAIT_S",
    "MAX_TXT_BYTES",
    "MAX_TXT_KEYS",
    "MAX_TXT_KEY_BYTES",
    "MAX_TXT_VALUE_BYTES",
    "PROTOCOL_VERSION",
    "RESIGN_INTERVAL_S",
    "SERVICE_TYPE",
    "SIGNATURE_WINDOW_S",
    "Advert",
    "AdvertError",
    "BadSignature",
    "Discovery",
    "DiscoveryError",
    "IncompatibleVersion",
    "OtherCluster",
    "OversizedAdvert",
    "StaleSignature",
    "canonical_txt",
    "encode_txt",
    "interface_addresses",
    "parse_peers",
    "parse_txt",
]

#: The DNS-SD service type of ringlet.
SERVICE_TYPE = "_ringlet._tcp.local."

#: Largest TXT record accepted, in wire bytes (each entry: 1 length byte +
#: ``key=value``). RFC 6763 section 6.2: a TXT record SHOULD fit, with the
#: rest of the reply, in one 1500-byte Ethernet packet, "about 1300 bytes".
#: Ours is about 110 bytes, or 190 signed.
MAX_TXT_BYTES = 1300
#: Largest TXT value accepted, in bytes (the longest we send is ``sig``, 64).
MAX_TXT_VALUE_BYTES = 64
#: Longest TXT key accepted: RFC 6763 section 6.4 says keys SHOULD be at most 9 chars.
MAX_TXT_KEY_BYTES = 9
#: Most TXT entries accepted (we send 7, or 9 signed).
MAX_TXT_KEYS = 16
#: A signed advert's ``ts`` may differ from the receiver's clock by at most this, seconds.
SIGNATURE_WINDOW_S = 300
#: With a secret, the advert is re-signed (new ``ts``) and re-announced this often, seconds.
#: Well under :data:`SIGNATURE_WINDOW_S`, so a cached advert is at most this old
#: and clocks may differ by up to ``SIGNATURE_WINDOW_S - RESIGN_INTERVAL_S``.
RESIGN_INTERVAL_S = 60
#: With ``interfaces=None`` or interface names, local addresses are polled this often
#: (seconds) and the advert is re-announced when they change. psutil gives no
#: change notification on Linux or macOS; polling ``net_if_addrs`` is cheap (<1 ms).
ADDRESS_POLL_S = 5.0
#: How long to wait for a peer's SRV/TXT/A records when they are not in the cache, ms.
RESOLVE_TIMEOUT_MS = 1000
#: How long to wait for answers to a fresh query, seconds. A responder that
#: multicast a record in the last second delays its answer by 1 s + 20-120 ms
#: (RFC 6762 section 14; zeroconf's delay queue); others answer in 20-120 ms.
FRESH_ANSWER_WAIT_S = 1.5
#: At most this many peer resolutions run at once; beyond, new names are dropped
#: (logged) until some finish. Bounds work under an advert flood.
MAX_PENDING_RESOLVES = 64
#: Size bound for the "logged once" memory and the "last heard" table.
_MAX_TRACKED = 4096

# DNS constants (RFC 1035).
_FLAGS_QR_QUERY = 0x0000
_TYPE_PTR = 12
_TYPE_TXT = 16
_TYPE_SRV = 33
_CLASS_IN = 1

_SIG_CONTEXT = b"ringlet/mdns-advert/v1"
_CANON_PREFIX = b"ringlet-advert-v1\0"

_RE_UINT = re.compile(rb"0|[1-9][0-9]{0,14}")
_RE_PORT = re.compile(rb"[1-9][0-9]{0,4}")
_RE_HEX16 = re.compile(rb"[0-9a-f]{16}")
_RE_HEX64 = re.compile(rb"[0-9a-f]{64}")
_RE_NODE_ID = re.compile(NODE_ID_RE.pattern.encode())
_RE_INCARNATION = re.compile(INCARNATION_RE.pattern.encode())


# --------------------------------------------------------------------------- errors


class AdvertError(ValueError):
    """An mDNS advert was rejected. ``reason`` is a short stable code for logs and metrics."""

    reason = "malformed"


class OversizedAdvert(AdvertError):
    """The TXT record exceeds :data:`MAX_TXT_BYTES`, :data:`MAX_TXT_KEYS` or a per-entry limit."""

    reason = "oversized"


class IncompatibleVersion(AdvertError):
    """The peer speaks another protocol version; ``peer_version`` holds it (int)."""

    reason = "incompatible_version"

    def __init__(self, message: str, peer_version: int) -> None:
        super().__init__(message)
        self.peer_version = peer_version


class OtherCluster(AdvertError):
    """The advert belongs to another cluster (its cluster id differs)."""

    reason = "other_cluster"


class BadSignature(AdvertError):
    """With a secret: the signature is missing, malformed or does not verify."""

    reason = "bad_signature"


class StaleSignature(BadSignature):
    """With a secret: the signature verifies but ``ts`` is outside :data:`SIGNATURE_WINDOW_S`."""

    reason = "stale_signature"


class DiscoveryError(RuntimeError):
    """Discovery cannot run as configured (e.g. no usable interface address)."""


# --------------------------------------------------------------------------- advert


@dataclass(frozen=True)
class Advert:
    """What one node advertises: enough to open a gRPC connection to it.

    Attributes:
        node_id: the node's id.
        protocol_version: its protocol version.
        grpc_port: its gRPC port (1..65535).
        api_port: its OpenAI-compatible HTTP API port (1..65535).
        cluster_id: hash of its cluster name (:func:`~ringlet.daemon.cluster.identity.cluster_id`).
        incarnation: 8 hex chars, random per process start.
        started_at_ms: when its process started, unix milliseconds.
        addresses: its IPv4 addresses from the service's A records, sorted
            numerically (empty in an advert built for :func:`encode_txt`).
        signed_at: unix seconds of the verified signature, when a secret was used.
        signature: the verified signature (hex), when a secret was used.
    """

    node_id: str
    protocol_version: int
    grpc_port: int
    api_port: int
    cluster_id: str
    incarnation: str
    started_at_ms: int
    addresses: tuple[str, ...] = ()
    signed_at: int | None = None
    signature: str | None = None

    @property
    def instance_name(self) -> str:
        """The mDNS service instance name: ``<node_id>-<incarnation>._ringlet._tcp.local.``."""
        return f"{self.node_id}-{self.incarnation}.{SERVICE_TYPE}"

    def same_endpoint(self, other: Advert) -> bool:
        """True if ``other`` describes the same process reachable the same way (ignores signing)."""
        return dataclasses.replace(self, signed_at=None, signature=None) == dataclasses.replace(
            other, signed_at=None, signature=None
        )


def _advert_key(secret: bytes) -> bytes:
    return hmac.new(secret, _SIG_CONTEXT, hashlib.sha256).digest()


def _check_secret(secret: object) -> None:
    if secret is not None and (not isinstance(secret, bytes | bytearray) or not secret):
        raise ValueError("secret must be non-empty bytes or None")


def canonical_txt(txt: Mapping[bytes, bytes]) -> bytes:
    """Return the bytes that ``sig`` signs: every entry but ``sig``, sorted by key.

    Layout: ``b"ringlet-advert-v1\\0"`` then, per entry, 1 byte key length,
    key, 2 bytes big-endian value length, value. Length prefixes make the
    encoding unambiguous whatever bytes the values hold. Keys must be at most
    255 bytes and values at most 65535 (callers enforce far smaller caps).
    """
    parts = [_CANON_PREFIX]
    for key in sorted(k for k in txt if k != b"sig"):
        value = txt[key]
        parts.append(len(key).to_bytes(1, "big") + key + len(value).to_bytes(2, "big") + value)
    return b"".join(parts)


def _sign(secret: bytes, txt: Mapping[bytes, bytes]) -> str:
    return hmac.new(_advert_key(bytes(secret)), canonical_txt(txt), hashlib.sha256).hexdigest()


def _check_port(name: str, port: object) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"{name} must be an int in 1..65535, got {port!r}")
    return port


def encode_txt(advert: Advert, secret: bytes | None, *, now: float | None = None) -> dict[bytes, bytes]:
    """Return the TXT properties for ``advert`` (its ``addresses`` and signature fields are not used).

    With ``secret``, adds ``ts`` (``now``, default ``time.time()``, unix
    seconds) and ``sig``. Raises ``ValueError`` if a field is out of range.
    """
    _check_secret(secret)
    validate_node_id(advert.node_id)
    if not INCARNATION_RE.fullmatch(advert.incarnation):
        raise ValueError(f"invalid incarnation {advert.incarnation!r}")
    if not _RE_HEX16.fullmatch(advert.cluster_id.encode()):
        raise ValueError(f"invalid cluster id {advert.cluster_id!r}: want 16 lowercase hex chars")
    for name, value in (
        ("protocol_version", advert.protocol_version),
        ("started_at_ms", advert.started_at_ms),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 10**15:
            raise ValueError(f"{name} must be an int in 0..10**15-1, got {value!r}")
    txt = {
        b"v": str(advert.protocol_version).encode(),
        b"id": advert.node_id.encode(),
        b"in": advert.incarnation.encode(),
        b"st": str(advert.started_at_ms).encode(),
        b"g": str(_check_port("grpc_port", advert.grpc_port)).encode(),
        b"a": str(_check_port("api_port", advert.api_port)).encode(),
        b"c": advert.cluster_id.encode(),
    }
    if secret is not None:
        txt[b"ts"] = str(int(time.time() if now is None else now)).encode()
        txt[b"sig"] = _sign(bytes(secret), txt).encode()
    return txt


def _field(txt: Mapping[bytes, bytes], key: bytes, pattern: re.Pattern[bytes], what: str) -> bytes:
    value = txt.get(key)
    if value is None:
        raise AdvertError(f"missing TXT field {key.decode()!r} ({what})")
    if not pattern.fullmatch(value):
        raise AdvertError(f"TXT field {key.decode()!r} is not {what}: {value[:MAX_TXT_VALUE_BYTES]!r}")
    return value


def _port(txt: Mapping[bytes, bytes], key: bytes, what: str) -> int:
    port = int(_field(txt, key, _RE_PORT, f"a {what} in 1..65535"))
    if port > 65535:
        raise AdvertError(f"TXT field {key.decode()!r}: {what} {port} is not in 1..65535")
    return port


def parse_txt(
    properties: Mapping[bytes, bytes | None],
    *,
    secret: bytes | None,
    cluster_id: str | None = None,
    addresses: Sequence[str] = (),
    now: float | None = None,
    txt_bytes: int | None = None,
) -> Advert:
    """Validate TXT properties (as ``ServiceInfo.properties`` gives them) and return the :class:`Advert`.

    Args:
        properties: key bytes to value bytes (``None`` for a key without ``=``).
        secret: the cluster secret; when set, a valid ``sig`` over a ``ts``
            within :data:`SIGNATURE_WINDOW_S` of ``now`` is required.
        cluster_id: when set, adverts of another cluster id are rejected.
        addresses: IPv4 addresses to put in the advert (from the A records).
        now: unix seconds for the signature window (default ``time.time()``).
        txt_bytes: wire size of the whole TXT record (``len(ServiceInfo.text)``),
            checked against :data:`MAX_TXT_BYTES`. The per-entry caps bound a
            parsed mapping to 1200 bytes, but the raw record may hold more
            (repeated keys, which the mapping collapses).

    Checks, in order: shape and size (:class:`OversizedAdvert`), protocol
    version (:class:`IncompatibleVersion`, before the other fields, whose
    format a future version may change), every field's format (ports must be
    decimal 1..65535, no sign, no leading zero), cluster (:class:`OtherCluster`),
    then signature (:class:`BadSignature`, :class:`StaleSignature`). Unknown
    keys are allowed (they count toward the size caps and are signed).

    Raises:
        AdvertError: on any problem, never another exception, whatever the input.
    """
    if secret is not None and (not isinstance(secret, bytes | bytearray) or not secret):
        raise AdvertError("bad secret argument: want non-empty bytes or None")
    if txt_bytes is not None and (not isinstance(txt_bytes, int) or txt_bytes > MAX_TXT_BYTES):
        raise OversizedAdvert(f"TXT record is {txt_bytes} bytes, more than {MAX_TXT_BYTES}")
    if not isinstance(properties, Mapping):
        raise AdvertError(f"TXT properties must be a mapping, got {type(properties).__name__}")
    try:
        n_keys = len(properties)
        items = list(properties.items()) if n_keys <= MAX_TXT_KEYS else []
    except Exception as e:  # a hostile Mapping implementation
        raise AdvertError(f"unreadable TXT properties: {type(e).__name__}") from None
    if n_keys > MAX_TXT_KEYS:
        raise OversizedAdvert(f"TXT has {n_keys} entries, more than {MAX_TXT_KEYS}")
    txt: dict[bytes, bytes] = {}
    size = 0
    for key, value in items:
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_TXT_KEY_BYTES or b"=" in key:
            shown = key[:16] if isinstance(key, bytes | str) else type(key).__name__
            if isinstance(key, bytes) and len(key) > MAX_TXT_KEY_BYTES:
                raise OversizedAdvert(f"TXT key {shown!r}... longer than {MAX_TXT_KEY_BYTES} bytes")
            raise AdvertError(f"bad TXT key {shown!r}")
        if value is None:
            raise AdvertError(f"TXT key {key!r} has no value")
        if not isinstance(value, bytes):
            raise AdvertError(f"TXT value of {key!r} is {type(value).__name__}, not bytes")
        if len(value) > MAX_TXT_VALUE_BYTES:
            raise OversizedAdvert(f"TXT value of {key!r} is {len(value)} bytes, more than {MAX_TXT_VALUE_BYTES}")
        size += 2 + len(key) + len(value)
        txt[key] = value
    if size > MAX_TXT_BYTES:
        raise OversizedAdvert(f"TXT is {size} bytes, more than {MAX_TXT_BYTES}")

    version = int(_field(txt, b"v", _RE_UINT, "a decimal protocol version"))
    if version != PROTOCOL_VERSION:
        raise IncompatibleVersion(
            f"incompatible protocol version {version} (this node speaks {PROTOCOL_VERSION})", version
        )
    node_id = _field(txt, b"id", _RE_NODE_ID, "a node id").decode()
    incarnation = _field(txt, b"in", _RE_INCARNATION, "an incarnation (8 hex chars)").decode()
    started_at_ms = int(_field(txt, b"st", _RE_UINT, "a start time in unix ms"))
    grpc_port = _port(txt, b"g", "gRPC port")
    api_port = _port(txt, b"a", "API port")
    peer_cluster = _field(txt, b"c", _RE_HEX16, "a cluster id (16 hex chars)").decode()
    if cluster_id is not None and not hmac.compare_digest(peer_cluster, cluster_id):
        raise OtherCluster(f"other cluster id {peer_cluster} (ours {cluster_id})")

    signed_at: int | None = None
    signature: str | None = None
    if secret is not None:
        sig = txt.get(b"sig")
        ts = txt.get(b"ts")
        if sig is None or ts is None:
            raise BadSignature("unsigned advert, but this node has a cluster secret")
        if not _RE_HEX64.fullmatch(sig) or not _RE_UINT.fullmatch(ts):
            raise BadSignature("malformed signature or timestamp")
        if not hmac.compare_digest(_sign(bytes(secret), txt).encode(), sig):
            raise BadSignature("signature does not verify (wrong secret or altered advert)")
        signed_at = int(ts)
        clock = time.time() if now is None else now
        skew = clock - signed_at
        if abs(skew) > SIGNATURE_WINDOW_S:
            direction = "old" if skew > 0 else "in the future"
            raise StaleSignature(
                f"signature timestamp is {abs(skew):.0f} s {direction} (window {SIGNATURE_WINDOW_S} s)"
            )
        signature = sig.decode()

    return Advert(
        node_id=node_id,
        protocol_version=version,
        grpc_port=grpc_port,
        api_port=api_port,
        cluster_id=peer_cluster,
        incarnation=incarnation,
        started_at_ms=started_at_ms,
        addresses=tuple(addresses),
        signed_at=signed_at,
        signature=signature,
    )


# --------------------------------------------------------------------------- static peers

_RE_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def parse_peers(spec: str) -> list[tuple[str, int]]:
    """Parse ``--peers``: comma-separated ``host:port`` (gRPC ports), for networks without multicast.

    Hosts are names, IPv4 addresses, or IPv6 addresses in brackets
    (``[fe80::1%en0]:50051``). Whitespace around entries is ignored; an empty
    ``spec`` gives ``[]``; duplicates are dropped (first kept). Returns
    ``(host, port)`` pairs, IPv6 without brackets.

    Raises:
        ValueError: naming the bad entry: empty entry, missing port, port not
            decimal 1..65535, bad host name, IPv6 without brackets.
    """
    if not isinstance(spec, str):
        raise ValueError(f"--peers must be a string, got {type(spec).__name__}")
    if not spec.strip():
        return []
    out: list[tuple[str, int]] = []
    for i, raw in enumerate(spec.split(","), start=1):
        entry = raw.strip()
        where = f"--peers entry {i} {entry!r}"
        if not entry:
            raise ValueError(f"--peers entry {i} is empty (stray comma?)")
        if entry.startswith("["):
            close = entry.find("]")
            if close < 0 or not entry[close + 1 :].startswith(":"):
                raise ValueError(f"{where}: want [ipv6]:port")
            host, port_s = entry[1:close], entry[close + 2 :]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise ValueError(f"{where}: {host!r} is not an IPv6 address") from None
        else:
            if entry.count(":") > 1:
                raise ValueError(f"{where}: IPv6 addresses need brackets, e.g. [::1]:50051")
            host, sep, port_s = entry.partition(":")
            if not sep:
                raise ValueError(f"{where}: missing ':port'")
            if not host:
                raise ValueError(f"{where}: missing host")
            if not _RE_HOSTNAME.fullmatch(host):
                raise ValueError(f"{where}: {host!r} is not a valid host name or IPv4 address")
        if not re.fullmatch(r"[0-9]{1,5}", port_s) or not 1 <= int(port_s) <= 65535:
            raise ValueError(f"{where}: port {port_s!r} is not a number in 1..65535")
        pair = (host, int(port_s))
        if pair not in out:
            out.append(pair)
    return out


# --------------------------------------------------------------------------- interfaces


def interface_addresses(
    interfaces: Sequence[str] | None,
    *,
    if_addrs: Mapping[str, Sequence[Any]] | None = None,
    if_stats: Mapping[str, Any] | None = None,
) -> list[str]:
    """Resolve an interface selection to the IPv4 addresses to bind and advertise.

    Args:
        interfaces: ``None`` means every interface that is up, multicast-capable
            and not loopback (its IPv4 addresses, link-local included: a
            Thunderbolt bridge often has only 169.254.x.x). Otherwise a list
            whose entries are IPv4 addresses (used as given, e.g. ``127.0.0.1``
            for one-machine clusters) or interface names (``en0``, ``lo``:
            their IPv4 addresses now; names absent or without IPv4 give none).
        if_addrs, if_stats: ``psutil.net_if_addrs()``/``net_if_stats()``
            results to use instead (tests).

    Returns:
        addresses in first-seen order, without duplicates (possibly empty).

    Raises:
        ValueError: an entry is empty, not a string, or an IPv6 address (mDNS
            here is IPv4 only).
    """
    if interfaces is not None:
        for spec in interfaces:
            if not isinstance(spec, str) or not spec:
                raise ValueError(f"bad interface {spec!r}: want an IPv4 address or an interface name")
            if ":" in spec:
                raise ValueError(f"interface {spec!r}: IPv6 is not supported, give an IPv4 address or a name")
        if all(_is_ipv4(s) for s in interfaces):
            return list(dict.fromkeys(str(ipaddress.IPv4Address(s)) for s in interfaces))
    addrs = psutil.net_if_addrs() if if_addrs is None else if_addrs
    out: list[str] = []
    if interfaces is None:
        stats = psutil.net_if_stats() if if_stats is None else if_stats
        for name, entries in addrs.items():
            st = stats.get(name)
            if st is None or not st.isup:
                continue
            flags = set(filter(None, str(getattr(st, "flags", "") or "").split(",")))
            if "loopback" in flags or (flags and "multicast" not in flags):
                continue
            out.extend(
                e.address
                for e in entries
                if e.family == socket.AF_INET and not ipaddress.IPv4Address(e.address).is_loopback
            )
    else:
        for spec in interfaces:
            if _is_ipv4(spec):
                out.append(str(ipaddress.IPv4Address(spec)))
            else:
                out.extend(e.address for e in addrs.get(spec, ()) if e.family == socket.AF_INET)
    return list(dict.fromkeys(out))


def _is_ipv4(s: str) -> bool:
    try:
        ipaddress.IPv4Address(s)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- discovery

PeerCallback = Callable[[Advert], Awaitable[None] | None]
GoodbyeCallback = Callable[[str], Awaitable[None] | None]


class _HeardListener(RecordUpdateListener):
    """Notes when any record of a ringlet instance arrives (refreshes included)."""

    def __init__(self, owner: Discovery) -> None:
        super().__init__()
        self._owner = owner

    def async_update_records(self, zc: Zeroconf, now: float, records: list[RecordUpdate]) -> None:
        try:
            self._owner._note_heard(records)
        except Exception:  # never raise into zeroconf
            log.exception("internal error while noting mDNS records")


class Discovery:
    """Advertise this node over mDNS and report peers of the same cluster.

    Args:
        node_id: this node's id (:class:`~ringlet.daemon.cluster.identity.NodeIdentity`).
        cluster_name: the cluster name; only peers with the same
            :func:`~ringlet.daemon.cluster.identity.cluster_id` are reported.
        grpc_port, api_port: this node's ports, 1..65535.
        interfaces: ``None`` for every multicast-capable non-loopback IPv4
            interface, or a list of IPv4 addresses / interface names
            (:func:`interface_addresses`). ``["127.0.0.1"]`` for one-machine
            clusters and tests. With ``None`` or names, addresses are polled
            every ``address_poll_s`` and changes re-announced.
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
        started_at_ms: int | None = None,
        incarnation: str | None = None,
        address_poll_s: float = ADDRESS_POLL_S,
        resign_s: float = RESIGN_INTERVAL_S,
    ) -> None:
        self._node_id = validate_node_id(node_id)
        self._cluster_id = cluster_id(cluster_name)
        self._grpc_port = _check_port("grpc_port", grpc_port)
        self._api_port = _check_port("api_port", api_port)
        if interfaces is not None:
            if isinstance(interfaces, str):
                raise ValueError("interfaces must be a list of strings, not a string")
            interfaces = list(interfaces)
            interface_addresses(interfaces, if_addrs={})  # validates the entries
        self._interfaces = interfaces
        _check_secret(secret)
        self._secret = bytes(secret) if secret is not None else None
        self._on_peer = on_peer
        self._on_goodbye = on_goodbye
        self._on_conflict = on_conflict
        self._started_at_ms = int(time.time() * 1000) if started_at_ms is None else int(started_at_ms)
        self._incarnation = new_incarnation() if incarnation is None else incarnation
        if not INCARNATION_RE.fullmatch(self._incarnation):
            raise ValueError(f"invalid incarnation {self._incarnation!r}: want 8 lowercase hex chars")
        self._address_poll_s = float(address_poll_s)
        self._resign_s = float(resign_s)

        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._heard_listener: _HeardListener | None = None
        self._addresses: list[str] = []
        self._peers: dict[str, Advert] = {}  # node id -> advert reported through on_peer
        self._instances: dict[str, Advert] = {}  # instance name -> last valid advert (other nodes)
        self._conflicts: set[str] = set()  # instance names already judged as clones of us
        self._own_names = {self._own_instance()}  # every instance name this object advertised
        self._logged: set[tuple[str, str]] = set()
        self._last_heard: dict[str, float] = {}  # instance name -> time.monotonic()
        self._resolving: set[str] = set()
        self._resolve_again: set[str] = set()
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
            self._heard_listener = _HeardListener(self)
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

    # -- addresses and re-signing ---------------------------------------------------

    def _needs_maintenance(self) -> bool:
        dynamic = self._interfaces is None or not all(_is_ipv4(s) for s in self._interfaces)
        return dynamic or self._secret is not None

    async def _maintain(self) -> None:
        dynamic = self._interfaces is None or not all(_is_ipv4(s) for s in self._interfaces)
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

    # -- refresh -----------------------------------------------------------------

    def _send_fresh_query(self, name: str, type_: int) -> None:
        """Multicast a QM question with no known answers, so every live responder answers."""
        if self._aiozc is None:
            return
        out = DNSOutgoing(_FLAGS_QR_QUERY, True)
        out.add_question(DNSQuestion(name, type_, _CLASS_IN))
        self._aiozc.zeroconf.async_send(out)

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
        self._send_fresh_query(SERVICE_TYPE, _TYPE_PTR)
        await asyncio.sleep(timeout)
        names = [n for n, t in self._last_heard.items() if t >= t0 and n not in self._own_names]
        results = await asyncio.gather(*(self._resolve(n, force=True) for n in names))
        return [a for a in results if a is not None]

    # -- zeroconf callbacks ------------------------------------------------------

    def _own_instance(self) -> str:
        return f"{self._node_id}-{self._incarnation}.{SERVICE_TYPE}"

    def _note_heard(self, records: list[RecordUpdate]) -> None:
        now = time.monotonic()
        suffix = "." + SERVICE_TYPE
        for update in records:
            rec = update.new
            if rec.ttl == 0:
                continue
            if rec.type == _TYPE_PTR and rec.name.lower() == SERVICE_TYPE:
                name = rec.alias.lower()  # type: ignore[attr-defined]
            elif rec.type in (_TYPE_SRV, _TYPE_TXT) and rec.name.lower().endswith(suffix):
                name = rec.name.lower()
            else:
                continue
            if name in self._last_heard or len(self._last_heard) < _MAX_TRACKED:
                self._last_heard[name] = now

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
                "mDNS: %s did not answer within %d ms",
                name,
                RESOLVE_TIMEOUT_MS,
            )
            return None
        return self._handle_info(name, info, force=force)

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
            self._send_fresh_query(name, _TYPE_SRV)
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
        self._log_once(name, err.reason, logging.WARNING, "mDNS: ignoring advert %s: %s", name, err)
        advert = self._instances.pop(name, None)
        if advert is not None:
            current = self._peers.get(advert.node_id)
            if current is not None and current.instance_name == name:
                del self._peers[advert.node_id]
                self._call(self._on_goodbye, advert.node_id)

    # -- helpers -----------------------------------------------------------------

    def _log_once(self, peer: str, reason: str, level: int, msg: str, *args: object) -> None:
        key = (peer, reason)
        if key in self._logged:
            return
        if len(self._logged) >= _MAX_TRACKED:
            self._logged.clear()
        self._logged.add(key)
        log.log(level, msg, *args)

    def _call(self, callback: Callable[..., Any] | None, arg: object) -> None:
        if callback is None:
            return
        try:
            result = callback(arg)
            if inspect.isawaitable(result):
                self._track(result)
        except Exception:
            log.exception("mDNS: %s callback failed", getattr(callback, "__name__", "discovery"))

    def _track(self, aw: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)  # type: ignore[arg-type]
        if not task.cancelled() and task.exception() is not None:
            log.error("mDNS: background task failed", exc_info=task.exception())
